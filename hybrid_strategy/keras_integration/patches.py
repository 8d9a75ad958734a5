"""Every run-time patch of Keras, tf_keras and TensorFlow: the one list (registry.py reads it).

An entry declares what changes and when; the code that makes the change sits in
the keras_integration module the entry's name starts with, and applies it with
`registry.install(name, make)`. A patch that is not declared here cannot be
installed. docs/patches.md is generated from this list.

```python
from hybrid_strategy.keras_integration.patches import PATCHES
print(len(PATCHES), "patches")
```
"""

from hybrid_strategy.keras_integration.patch import (
    ADD, ASYNCHRONOUS, CLUSTER, REGISTER, REPLACE, SPANS, STRATEGY, TABLES, WRAP, Patch)

PATCHES = (
    # --- tables: row reads, ids, penalties, checkpoints, optimizers ---------------
    # --- input and steps: keras_input, multi_step, batches, end_of_data, service_input, increments, asynchronous ---
    # --- placement, communication, cluster: creation, mirroring, clipping, side_effects, collectives ---
)
