"""Keras 3 increments of mirrored variables, each made on its own replica's device.

Keras 3 adds to a variable by reading it and assigning the sum
(`variable.assign(variable + value)`). An optimizer's step counter is such a
variable (mirrored, `aggregation="only_first_replica"`), incremented by every
replica after each update (`optimizer.iterations.assign_add(1)`): TensorFlow then
computes the first replica's sum and sends it to every other replica, which each
signal back once assigned: two tensors crossing between tasks per worker and step,
in a chain. Every copy of a mirrored variable holds the same value, so adding the
same number to each copy where it lives is the same update, with nothing crossing.
`install` makes Keras 3 do that for numbers added to the mirrored variables of the
strategies `applies` accepts, unless the variable sums its replicas' updates
(`aggregation="sum"`, where W replicas adding 1 add W). A variable shared by
asynchronous steps (asynchronous/training.py) adds with its own atomic operation.

```python
import keras
import tensorflow as tf
from hybrid_strategy.keras_integration import increments
increments.install(lambda strategy: isinstance(strategy, tf.distribute.MirroredStrategy))
with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    step = keras.Variable(0, dtype="int64", aggregation="only_first_replica")
step.assign_add(1)
print(int(step.numpy()))   # 1
```
"""

import numbers

import tensorflow as tf

# TF-private: the variable type whose copies live one per replica device.
from hybrid_strategy.tensorflow_private import values_lib

from hybrid_strategy.asynchronous import training as asynchronous
from hybrid_strategy.keras_integration import registry


def install(applies):
    """Makes Keras 3 add numbers to mirrored variables of `applies(strategy)` per copy."""
    # Keras-private: the TensorFlow backend's variable class, whose assign_add reads
    # the variable (Keras has no public way to change how a variable is added to),
    # and the scope in which Keras collects assignments instead of making them.
    from keras.src.backend.common import stateless_scope

    for name in ("assign_add", "assign_sub"):
        registry.install(f"increments.{name}_per_copy", lambda original, name=name: _per_copy(
            original, name, applies, stateless_scope.in_stateless_scope))


def _per_copy(original, name, applies, in_stateless_scope):
    def add(self, value):
        copies = getattr(self, "_value", None)
        if asynchronous.is_shared(copies):
            # One variable that concurrent asynchronous steps add to (the optimizer's
            # step counter): its own atomic operation, so that no increment is lost;
            # a number made a tensor where the variable lives, so that nothing crosses.
            with tf.device(copies.device):
                value = self._convert_to_tensor(value, dtype=self.dtype)
            return getattr(copies, name)(value)
        if (not isinstance(value, numbers.Number)
                or not isinstance(copies, values_lib.MirroredVariable)
                or not applies(copies.distribute_strategy) or in_stateless_scope()):
            return original(self, value)
        # The number, not a tensor: each copy's update makes its own constant.
        if tf.distribute.in_cross_replica_context():
            getattr(copies, name)(value, read_value=False)
        elif copies.aggregation != tf.VariableAggregation.SUM:
            # TF-private: this replica's copy (the one on its device).
            getattr(copies._get_on_device_or_primary(), name)(value, read_value=False)
        else:
            return original(self, value)
        return self.value

    return add
