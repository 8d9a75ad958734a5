"""What crosses between tasks in a step: several tensors as one, rows in a chosen dtype.

TensorFlow sends every tensor an edge carries from one task to another by a call of
its own (a gRPC request, and thread hand-offs on both sides), whatever its size: with
small tensors, the calls cost more than the bytes. So what one worker sends one PS
task in a step (the ids it looks up in every table, the row gradients of every
table) crosses as one tensor of ids and one of values: `pack_ids` / `unpack_ids`
put row counts in front of the ids (the receiver learns each part's size from
them), `pack_values` / `unpack_values` flatten the values and split them again by
those counts.

Values may cross in a narrower dtype than they are computed in (`wire_dtype`,
e.g. bfloat16: half the bytes of float32); they are cast back on arrival, so
every sum and update is made in the table's own dtype.

```python
import tensorflow as tf
from hybrid_strategy.communication import wire
ids, counts = wire.pack_ids([tf.constant([4, 1]), tf.constant([7])])
print(ids.numpy())                                    # [2 1 4 1 7]
parts, counts = wire.unpack_ids(ids, [tf.int32, tf.int32])
values = wire.pack_values([tf.ones((2, 3)), tf.zeros((1, 1))], "bfloat16")
print(values.dtype.name, values.shape)                # bfloat16 (7,)
rows = wire.unpack_values(values, counts, [(3,), (1,)], tf.float32)
print([r.shape.as_list() for r in rows])              # [[2, 3], [1, 1]]
```
"""

import tensorflow as tf

# dtypes rows may cross in, besides the table's own.
WIRE_DTYPES = ("bfloat16",)


def check_wire_dtype(wire_dtype):
    """The `tf.DType` for a strategy's `wire_dtype` argument (None stays None)."""
    if wire_dtype is None:
        return None
    name = getattr(wire_dtype, "name", wire_dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(
            f"wire_dtype={wire_dtype!r}: rows of PS tables can cross between tasks in "
            f"their own dtype (wire_dtype=None, the default) or in one of {WIRE_DTYPES}.")
    return tf.as_dtype(name)


def to_wire(values, wire_dtype):
    """`values` as they leave a task: cast to `wire_dtype` if it is narrower."""
    if wire_dtype is None or not values.dtype.is_floating or values.dtype == wire_dtype:
        return values
    return tf.cast(values, wire_dtype)


def from_wire(values, dtype):
    """`values` as they arrive: back in `dtype`, the one they are computed in."""
    return values if values.dtype == dtype else tf.cast(values, dtype)


def alike(keys):
    """[(key, [positions of `keys` equal to it])], keys in order of first appearance:
    the groups of parts that can cross together (equal dtypes, say)."""
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.items())


def pack_ids(parts):
    """1-D integer tensors as one, [count of each part, then every id], in int64 if
    their dtypes differ; returns it and the counts (a 1-D tensor of its dtype)."""
    if not parts:
        raise ValueError("pack_ids needs at least one part.")
    dtypes = {part.dtype for part in parts}
    dtype = dtypes.pop() if len(dtypes) == 1 else tf.int64
    parts = [tf.cast(part, dtype) for part in parts]
    counts = tf.concat([tf.shape(part, out_type=dtype) for part in parts], 0)
    return tf.concat([counts] + parts, 0), counts


def unpack_ids(packed, dtypes):
    """The inverse of `pack_ids`, given each part's dtype: (the parts, their counts)."""
    n = len(dtypes)
    counts = packed[:n]
    return ([tf.cast(part, dtype)
             for part, dtype in zip(tf.split(packed[n:], counts, num=n), dtypes)], counts)


def pack_values(parts, wire_dtype=None):
    """Tensors of one dtype, rows of any shape, flattened into one 1-D tensor, each
    cast to `wire_dtype` (see `to_wire`)."""
    return tf.concat([tf.reshape(to_wire(part, wire_dtype), [-1]) for part in parts], 0)


def unpack_values(packed, counts, row_shapes, dtype):
    """The inverse of `pack_values`, given each part's number of rows (a 1-D tensor)
    and row shape (static): the parts in `dtype`."""
    widths = tf.constant([tf.TensorShape(shape).num_elements() for shape in row_shapes],
                         dtype=counts.dtype)
    flat = tf.split(from_wire(packed, dtype), counts * widths, num=len(row_shapes))
    return [tf.reshape(part, [-1] + tf.TensorShape(shape).as_list())
            for part, shape in zip(flat, row_shapes)]
