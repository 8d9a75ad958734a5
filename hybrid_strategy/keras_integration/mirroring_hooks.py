"""Keras 3's training function moves PS tables with a dense gradient after its first call.

The move itself is placement/mirroring.py's; this hook puts it around the training
function Keras makes, once per function made.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls mirroring_hooks.install(gates.placer)
```
"""

from hybrid_strategy.keras_integration import registry
from hybrid_strategy.placement import mirroring


def install(placer_of):
    """Makes Keras 3's training function move tables after its first call.

    Args:
        placer_of: `placer_of(strategy)` is a HybridStrategy's `Placer`, or None for
            any other strategy (nothing changes then).
    """

    # Keras-private: the TensorFlow trainer's `make_train_function` sets
    # `model.train_function`, which `fit` and `train_on_batch` call.
    def make(original):
        def make_train_function(self, force=False):
            made = force or self.train_function is None
            result = original(self, force=force)
            placer = placer_of(self.distribute_strategy)
            if made and placer is not None:
                self.train_function = mirroring.moving_after_first_call(
                    self, self.train_function, placer)
            return result

        return make_train_function

    registry.install("mirroring_hooks.move_tables_after_first_step", make)
