"""Registers communication/side_effects.py's resolver and graph transform with TensorFlow.

With both, tf.function orders a step's side effects per task, and its outputs wait
for those of the calling process only.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls side_effect_hooks.order_per_task()
```
"""

from hybrid_strategy.communication import side_effects
from hybrid_strategy.keras_integration import registry


def order_per_task():
    """Orders stateful ops that touch no variable per task from now on (idempotent)."""

    # TF-private: automatic control dependencies take resolvers that name the
    # resources an op touches.
    def register_resolver(register_acd_resource_resolver):
        register_acd_resource_resolver(side_effects.side_effects_of_task)

    # TF-private: the transformations tf.function applies to a traced graph before
    # it becomes a function.
    def register_transform(func_graph_transforms):
        func_graph_transforms.append(side_effects.outputs_wait_for_this_task_only)

    registry.install("side_effect_hooks.order_per_task", register_resolver)
    registry.install("side_effect_hooks.outputs_wait_for_this_task", register_transform)
