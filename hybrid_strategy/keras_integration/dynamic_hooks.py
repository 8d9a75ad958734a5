"""A DynamicEmbedding's optimizer slots are known to it, so an admitted id's slots restart too.

Keras optimizers make their slots (momentum, accumulators) from the variable they
follow; the wrappers here record, on a DynamicEmbedding's rows variable, each slot
made from it and the value one of its rows starts with. When the layer gives a row
to a newly admitted id, `reset_rows` writes that row of the variable and of every
slot, on the PS tasks under a HybridStrategy.

```python
from hybrid_strategy.keras_integration import dynamic_hooks
dynamic_hooks.install()   # DynamicEmbedding() and HybridStrategy() do
```
"""

import functools

import numpy as np
import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.keras_integration import registry

# The list of (slot, its initial row) on a rows variable `track_slots` marked.
_SLOTS = "_hybrid_dynamic_slots"


@functools.cache
def install():
    """Records slots made from a DynamicEmbedding's rows, for Keras 3 and tf_keras."""
    registry.install("dynamic_hooks.slots_recorded", _keras_recorder)
    if versions.legacy_keras() is not None:
        registry.install("dynamic_hooks.slots_recorded_tf_keras", _tf_keras_recorder)
        registry.install("dynamic_hooks.slots_recorded_tf_keras_legacy", _legacy_recorder)


def track_slots(variable):
    """Marks `variable` (a DynamicEmbedding's rows) so that its slots are recorded."""
    setattr(variable, _SLOTS, [])


def reset_rows(variable, rows, values, shard=None):
    """Writes `values` to `rows` of `variable` and its slots' initial rows; returns the
    op writing the variable's, in a list. The slots' writes need no waiting for: the
    optimizer reads them after the step's lookups, and tf.function runs them first.
    With `shard`, `variable` is a PS table and `rows` (table-wide) are on that shard:
    they are written there alone, on the caller's device."""
    for slot, row in getattr(variable, _SLOTS):
        # A constant of the graph, made where the slot's rows are written: an eager
        # tensor would be an input of every step, sent from the chief.
        initial = tf.tile(tf.constant(row, slot.dtype), tf.stack([tf.size(rows), 1]))
        _rows_of(slot, rows, shard).scatter_update(tf.IndexedSlices(initial, _local(
            slot, rows, shard)))
    return [_rows_of(variable, rows, shard).scatter_update(
        tf.IndexedSlices(values, _local(variable, rows, shard)))]


def _rows_of(variable, rows, shard):
    """What `rows` of `variable` are written to: the variable, or its PS shard."""
    variable = _tf_variable(variable)
    return variable if shard is None else variable.shards[shard]


def _local(variable, rows, shard):
    """`rows` as `_rows_of` numbers them: rows r of shard k of S are r // S there."""
    return rows if shard is None else rows // _tf_variable(variable).num_shards


def _tf_variable(variable):
    """The TensorFlow variable (or PS table) a Keras 3 variable wraps; tf_keras' itself."""
    # Keras-private: `_value` holds the backend variable (Keras 3 has no public scatter).
    return variable if isinstance(variable, tf.Variable) else variable._value


def _record(reference, slot, initial_row):
    slots = getattr(reference, _SLOTS, None)
    if slots is not None:
        with tf.init_scope():
            slots.append((slot, np.asarray(initial_row())))
    return slot


def _keras_recorder(add_variable_from_reference):
    import keras  # pylint: disable=import-outside-toplevel

    def recorded(self, reference_variable, name=None, initializer="zeros"):
        slot = add_variable_from_reference(self, reference_variable, name=name,
                                           initializer=initializer)
        return _record(reference_variable, slot, lambda: keras.initializers.get(initializer)(
            (1,) + tuple(reference_variable.shape[1:]), slot.dtype))

    return recorded


def _tf_keras_recorder(add_variable_from_reference):
    def recorded(self, model_variable, variable_name, shape=None, initial_value=None):
        slot = add_variable_from_reference(self, model_variable, variable_name, shape=shape,
                                           initial_value=initial_value)
        return _record(model_variable, slot, lambda: (
            tf.zeros((1,) + tuple(slot.shape[1:])) if initial_value is None
            else tf.convert_to_tensor(initial_value)[:1]))

    return recorded


def _legacy_recorder(add_slot):
    import tf_keras  # pylint: disable=import-outside-toplevel

    def recorded(self, var, slot_name, initializer="zeros", shape=None):
        slot = add_slot(self, var, slot_name, initializer=initializer, shape=shape)
        row_shape = (1,) + tuple(slot.shape[1:])
        if callable(initializer) and not isinstance(initializer, str):
            return _record(var, slot, lambda: initializer(row_shape, dtype=slot.dtype))
        return _record(var, slot, lambda: tf_keras.initializers.get(initializer)(
            row_shape, dtype=slot.dtype))

    return recorded
