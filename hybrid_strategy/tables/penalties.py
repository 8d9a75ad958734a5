"""Weight penalties of PS tables computed where the table lives: value and gradient.

A regularizer on a table (Keras 3 `embeddings_regularizer` or any weight's
`regularizer`, tf_keras alike) reads the whole table: computed on a worker, every
worker would pull the whole table each step and push back a dense gradient. A
regularizer that is a sum over the table's rows (L1, L2, L1L2, and any other whose
value on blocks of rows adds up to its value on all of them, which is checked) is
computed here on each shard's PS instead, and only one scalar per shard crosses
the network:

- `penalty(table, regularizer)` is the value, summed from the shards. The tape
  gets, in place of the dense gradient, one marker row per replica (row id -1)
  whose values are the penalty's upstream gradient `dy` (so Keras' division of
  each replica's loss by the number of replicas, and loss scaling, reach it).
- Where the strategy sums the table's gradients, `without_markers` takes those
  rows out (each replica's `dy` then crosses as a scalar) and `with_gradient`
  adds `sum(dy) * d regularizer(shard) / d shard` on each shard's PS, taken where
  `penalty` read the shard (before the update's weight decay, if any), so clipping
  and the optimizer see the summed gradient single-device training has.

Every row of a penalized table then has a gradient each step: its update on the
PS touches every row (work on the PS, no bytes on the wire). A regularizer that is
not a sum over rows is applied to the whole table, with a `PlacementWarning`.

```python
import keras, hybrid_strategy
strategy = hybrid_strategy.HybridStrategy()
with strategy.scope():
    model = keras.Sequential([
        keras.Input((4,), dtype="int32"),
        keras.layers.Embedding(1000, 8, embeddings_regularizer=keras.regularizers.L2(1e-4)),
        keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer="adagrad", loss="mse")
# model.fit(...): the table's penalty is computed on its PS.
```
"""

import dataclasses
import functools
import warnings
import weakref

import numpy as np
import tensorflow as tf

# TF-private: `record.stop_recording` keeps the tape from differentiating the shard
# reads (it gets the marker rows instead), as table.py's reads do.
from hybrid_strategy.tensorflow_private import record

from hybrid_strategy import errors
from hybrid_strategy.tables import table as table_lib

# The row id of marker rows: out of every table, and dropped by densification.
_MARKER_ROW = -1
# Relative tolerance of the check that a regularizer adds up over blocks of rows.
_SEPARABLE_TOLERANCE = 1e-4
# graph -> {table ref: _Penalty}, for the traced function being built
_PENALTIES = weakref.WeakKeyDictionary()
# regularizer -> {(row shape, dtype): whether it is a sum over rows}
_SEPARABLE = weakref.WeakKeyDictionary()
# Paths of tables already warned about.
_WARNED = set()


@dataclasses.dataclass
class _Penalty:
    """A table's regularizer in one traced function, its marker rows not yet summed, and
    its gradient on each shard at the value the step's loss saw (not yet added)."""

    regularizer: object
    pending: int = 0
    gradients: list = None


def _penalties():
    return _PENALTIES.setdefault(tf.compat.v1.get_default_graph(), {})


def penalty(table, regularizer):
    """`regularizer`'s value on `table`, computed shard by shard on each shard's PS.

    None when it cannot be: outside a traced function, when the function already
    read the table whole under a gradient tape (its gradient is dense anyway), when
    another regularizer of the table was computed so, or when `regularizer` is not a
    sum over rows (with a `PlacementWarning`). The caller then applies
    `regularizer` to the whole table.
    """
    if not tf.inside_function() or table_lib.read_whole_with_gradient(table):
        return None
    if not is_sum_over_rows(regularizer, table.shape[1:].as_list(), table.dtype):
        _warn_once(table, regularizer)
        return None
    known = _penalties().setdefault(table.ref(), _Penalty(regularizer))
    if known.regularizer is not regularizer:
        return None
    first = known.gradients is None  # the step's first replica: the others read the same
    with tf.name_scope("hybrid_penalty"), record.stop_recording():
        parts, gradients = [], []
        for shard in table.shards:
            with tf.device(shard.device):
                rows = shard.read_value()
                parts.append(tf.convert_to_tensor(regularizer(rows)))
                if first:
                    gradients.append(_gradient(parts[-1], rows))
        value = tf.add_n(parts) if len(parts) > 1 else tf.identity(parts[0])
    if first:
        known.gradients = gradients
    table_lib.record_gradient(table, value, functools.partial(_marker_rows, table))
    return value


def _marker_rows(table, dy):
    """The penalty's gradient on the tape: one row, id -1, every value `dy`."""
    _penalties()[table.ref()].pending += 1
    values = tf.fill([1] + table.shape[1:].as_list(), tf.cast(dy, table.dtype))
    indices = table_lib.remember_gradient(tf.constant([_MARKER_ROW], tf.int32), table)
    return tf.IndexedSlices(values, indices, tf.constant(table.shape.as_list(), tf.int64))


def without_markers(replica_gradients, table):
    """(the replicas' `IndexedSlices` of `table` without marker rows, their `dy` sums).

    Each replica's rows are split on its own device, so only a scalar of the penalty
    leaves it. The sums are None when no marker row was made for `table` in this
    traced function (no penalty of it was differentiated).
    """
    known = _penalties().get(table.ref())
    if known is None or not known.pending:
        return list(replica_gradients), None
    known.pending = 0
    row_size = int(np.prod(table.shape[1:].as_list()))
    gradients, coefficients = [], []
    for slices in replica_gradients:
        with tf.device(slices.values.device), tf.name_scope("penalty_markers"):
            is_row = slices.indices >= 0
            gradients.append(tf.IndexedSlices(tf.boolean_mask(slices.values, is_row),
                                              tf.boolean_mask(slices.indices, is_row),
                                              slices.dense_shape))
            markers = tf.boolean_mask(slices.values, tf.logical_not(is_row))
            coefficients.append(tf.reduce_sum(tf.reshape(markers, [-1, row_size])[:, 0]))
    return gradients, coefficients


def with_gradient(shard_sums, coefficients, table):
    """Each shard's summed gradient plus the penalty's, formed on the shard's PS.

    `shard_sums` are `IndexedSlices` with shard-local rows, one per shard; the result
    is one dense tensor per shard (every row has a gradient). `coefficients`, one list
    per shard of scalars that add up to the penalty's factor (`without_markers`' sums,
    or their sums per worker as they arrived on the shard's PS), None leaves
    `shard_sums` as they are.
    """
    if coefficients is None:
        return shard_sums
    known = _penalties()[table.ref()]
    # The gradient where the forward pass read the table, as one device takes it: the
    # update may already have changed the shards (an optimizer's weight decay comes first).
    gradients, known.gradients = known.gradients, None
    out = []
    for i, (shard, part, factors) in enumerate(zip(table.shards, shard_sums, coefficients)):
        with tf.device(shard.device), tf.name_scope("ps_penalty"):
            coefficient = tf.add_n([tf.identity(c) for c in factors])
            if gradients is None:  # a second gradient of one forward pass: read it now
                value = shard.read_value()
                gradient = _gradient(known.regularizer(value), value)
            else:
                gradient = gradients[i]
            rows = tf.math.unsorted_segment_sum(part.values, part.indices, shard.shape[0])
            if gradient is not None:
                rows += tf.cast(coefficient, shard.dtype) * gradient
            out.append(rows)
    return out


def _gradient(total, rows):
    """d total / d rows, None where it does not depend on them. `tf.gradients`: no tape
    records under `record.stop_recording`, and these run in a traced function."""
    return tf.gradients(total, rows)[0]


def check_not_dropped(table):
    """Raises if `table`'s gradient reached the strategy dense after its penalty's
    marker rows were made: densifying drops them, and with them the penalty's gradient."""
    known = _penalties().get(table.ref())
    if known is not None and known.pending:
        raise ValueError(
            f"The gradient of PS table {table.path} reached the optimizer as a dense "
            f"tensor, which loses the gradient of its regularizer ({_describe(known.regularizer)}) "
            "that HybridStrategy computes on the table's PS. Either the table was read "
            "whole after its regularization loss was computed (compute model.losses "
            "after the forward pass), or its gradient was made dense (tf.convert_to_tensor, "
            "Keras' loss_scale_factor). Keep the gradient as the tape returns it, or place "
            f"the table mirrored: placement_overrides={{'{table.path}': 'mirrored'}}.")


def is_sum_over_rows(regularizer, row_shape, dtype=tf.float32):
    """Whether `regularizer` is a sum over the rows of a table of rows of `row_shape`.

    Checked once per regularizer, row shape and dtype, on two blocks of random rows
    (3 and 4): a sum over rows gives the same value on the 7 rows as the two blocks'
    values added (to 1e-4 relative); a mean, a norm or a penalty mixing rows does
    not.

    ```python
    import keras
    from hybrid_strategy.tables import penalties
    print(penalties.is_sum_over_rows(keras.regularizers.L2(1e-4), (16,)))   # True
    ```
    """
    key = (tuple(row_shape), tf.as_dtype(dtype))
    try:
        known = _SEPARABLE.setdefault(regularizer, {})
    except TypeError:  # not weakly referenceable: checked every time
        known = {}
    if key not in known:
        known[key] = _adds_up_over_rows(regularizer, *key)
    return known[key]


def _adds_up_over_rows(regularizer, row_shape, dtype):
    rng = np.random.default_rng(0)
    with tf.init_scope():
        a = tf.constant(rng.normal(size=(3,) + row_shape), dtype)
        b = tf.constant(rng.normal(size=(4,) + row_shape), dtype)
        try:
            values = [float(regularizer(x)) for x in (a, b, tf.concat([a, b], 0))]
        # Any regularizer may be given: one that fails on a block of rows is not a sum
        # over rows, whatever it raises.
        except Exception:  # pylint: disable=broad-except
            return False
    first, second, whole = values
    return abs(whole - first - second) <= _SEPARABLE_TOLERANCE * max(
        abs(whole), abs(first), abs(second), np.finfo(np.float32).tiny)


def _warn_once(table, regularizer):
    if table.path in _WARNED:
        return
    _WARNED.add(table.path)
    warnings.warn(
        f"HybridStrategy: the regularizer of PS table '{table.path}' "
        f"({_describe(regularizer)}) is not a sum over the table's rows, so it is "
        "computed from the whole table, on every worker, and the table's gradient is "
        "dense. Keras 3's fit moves such a table to mirrored after its first step; "
        "otherwise place it mirrored: "
        f"placement_overrides={{'{table.path}': 'mirrored'}}.",
        errors.PlacementWarning, stacklevel=3)


def _describe(regularizer):
    return getattr(type(regularizer), "__qualname__", repr(regularizer))


def weight_penalty(weight):
    """The regularization loss of a Keras 3 weight with a regularizer: `penalty` of
    the PS table it wraps, else (also when `penalty` returns None) its regularizer's
    value on the whole weight."""
    table = table_lib.table_behind(weight)
    loss = None if table is None else penalty(table, weight.regularizer)
    return weight.regularizer(weight) if loss is None else loss


def table_penalty(regularizer, table):
    """`regularizer(table)` as a tf_keras layer's loss: `penalty`, else of the whole table."""
    value = penalty(table, regularizer)
    return regularizer(table) if value is None else value
