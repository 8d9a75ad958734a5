"""Loss scaling's check for non-finite gradients, at the cost of the rows a step touches.

Under `mixed_float16`, Keras 3 wraps the optimizer in a `LossScaleOptimizer`, which
skips a step whose gradients hold an inf or NaN: `check_finite` takes
`ops.all(ops.isfinite(g))` of every gradient. Keras' `isfinite` of a
`tf.IndexedSlices` (a PS table's gradient) is dense: it fills a boolean tensor of
the whole table's shape and scatters the rows' results into it, in every replica
and step, so a step's cost grew with the table. The rows outside the slices are
finite (they have no gradient), so the slices' values decide alone; they also
cover every duplicate row and the penalty marker rows (tables/penalties.py, row id
-1) that a scatter would pick among or refuse. tf_keras' `LossScaleOptimizer`
checks the values of `tf.IndexedSlices` already.

```python
from hybrid_strategy.keras_integration import loss_scaling_hooks
loss_scaling_hooks.install(lambda: False)   # HybridStrategy() passes its gate
```
"""

import tensorflow as tf

from hybrid_strategy.keras_integration import registry


def install(applies):
    """Makes Keras 3's `LossScaleOptimizer.check_finite` check `tf.IndexedSlices` by
    their values where `applies()` (under HybridStrategy)."""

    def make(check_finite):
        def check_finite_by_values(self, grads):
            if applies():
                grads = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
            return check_finite(self, grads)

        return check_finite_by_values

    registry.install("loss_scaling_hooks.finite_check_by_rows", make)
