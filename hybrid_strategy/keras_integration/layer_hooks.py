"""Keras 3 `Layer.add_weight` tags each weight with its layer's classes, for placement.

Keras 3 may create a layer weight's TensorFlow variable later than `add_weight`,
with no layer on the stack (placement/creation.py): the tag carries the layer's
classes to the strategy's variable creator then.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls layer_hooks.install()
```
"""

import functools

from hybrid_strategy.keras_integration import registry
from hybrid_strategy.placement import creation


def install():
    """Makes Keras 3 `Layer.add_weight` tag its variable with the layer's classes."""

    def make(original):
        @functools.wraps(original)
        def add_weight(self, *args, **kwargs):
            variable = original(self, *args, **kwargs)
            creation.tag_layer_classes(variable, self)
            return variable

        return add_weight

    registry.install("layer_hooks.tag_layer_classes", make)
