"""What crosses between tasks in a step: everything one task sends another as one tensor.

TensorFlow sends every tensor an edge carries from one task to another by a call of
its own (a gRPC request, and thread hand-offs on both sides), about 0.6-0.9 ms of CPU
per side whatever its size: with small tensors, the calls cost more than the bytes.
So what one task sends another in one exchange of a step (the ids a worker looks up
in every table, the rows that come back, its gradients of every table, its dense
gradients and what rides with them) is put in an `Outbox` and crosses as one tensor
of bytes per pair of tasks: the parts' dynamic dimensions in front, then every part's
bytes. The receiver knows each part's dtype and static shape from the graph, and
reads the rest from the front.

Values may cross in a narrower dtype than they are computed in (`wire_dtype`,
e.g. bfloat16: half the bytes of float32); `to_wire` and `from_wire` cast them and
back, so every sum and update is made in the table's own dtype.

```python
import tensorflow as tf
from hybrid_strategy.sharding import wire
outbox = wire.Outbox()
ids = outbox.put("/cpu:0", "/cpu:0", tf.constant([4, 1], tf.int64))
rows = outbox.put("/cpu:0", "/cpu:0", tf.ones((2, 3)))
arrived = outbox.deliver()
print(arrived[ids].numpy(), arrived[rows].shape)      # [4 1] (2, 3)
```
"""

import collections

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


class Outbox:
    """What tasks send each other in one exchange; each pair's parts cross as one tensor.

    `put(source, destination, tensor)` returns a ticket; `deliver()` packs each
    pair's parts on the source, sends them as one tensor of bytes, and unpacks them
    on the destination: `deliver()[ticket]` is the tensor as it arrived there. A
    part that travels alone crosses as it is. Parts may be of any numeric dtype
    and known rank; their dimensions unknown when traced cross in front of them.
    """

    def __init__(self):
        self._parts = collections.OrderedDict()  # (source, destination) -> [tensor]

    def put(self, source, destination, tensor):
        if tensor.shape.rank is None:
            raise ValueError(f"{tensor.name} cannot cross between tasks in an Outbox: its "
                             "rank is unknown.")
        pair = (canonical(source), canonical(destination))
        parts = self._parts.setdefault(pair, [])
        parts.append(tensor)
        return pair + (len(parts) - 1,)

    def deliver(self):
        """{ticket: the part as it arrived on its destination}."""
        arrived = {}
        for (source, destination), parts in self._parts.items():
            if _same_device(source, destination):
                received = parts
            elif len(parts) == 1:
                with tf.device(destination):
                    received = [tf.identity(parts[0])]
            else:
                with tf.device(source), tf.name_scope("pack"):
                    packed = _pack(parts)
                with tf.device(destination), tf.name_scope("unpack"):
                    received = _unpack(packed, parts)
            for i, tensor in enumerate(received):
                arrived[(source, destination, i)] = tensor
        self._parts.clear()
        return arrived


def _same_device(a, b):
    """Whether devices `a` and `b` are one; an unnamed device is this process's."""
    a, b = tf.DeviceSpec.from_string(a or ""), tf.DeviceSpec.from_string(b or "")
    if not a.to_string() or not b.to_string():
        named = a if a.to_string() else b
        return named.job in (None, "localhost")
    return a == b


def _bytes_of(tensor):
    """`tensor` flattened into its bytes (uint8)."""
    if tensor.dtype == tf.bool:
        tensor = tf.cast(tensor, tf.uint8)
    flat = tf.reshape(tensor, [-1])
    if flat.dtype.size == 1:
        return tf.bitcast(flat, tf.uint8) if flat.dtype != tf.uint8 else flat
    return tf.reshape(tf.bitcast(flat, tf.uint8), [-1])


def _pack(parts):
    """[every unknown dimension of `parts`, as int64] + each part's bytes, as uint8."""
    unknown = [tf.shape(part, out_type=tf.int64)[axis] for part in parts
               for axis, size in enumerate(part.shape.as_list()) if size is None]
    front = [_bytes_of(tf.stack(unknown))] if unknown else []
    return tf.concat(front + [_bytes_of(part) for part in parts], 0)


def _unpack(packed, parts):
    """The inverse of `_pack`, given the parts as the sender traced them."""
    unknown = sum(size is None for part in parts for size in part.shape.as_list())
    dims = iter(())
    if unknown:
        dims = iter(tf.unstack(tf.bitcast(tf.reshape(packed[:8 * unknown], [unknown, 8]),
                                          tf.int64)))
        packed = packed[8 * unknown:]
    shapes, sizes = [], []
    for part in parts:
        shape = [next(dims) if size is None else size for size in part.shape.as_list()]
        shapes.append(shape)
        size = 1 if part.dtype == tf.bool else part.dtype.size
        for d in shape:
            size = size * d
        sizes.append(size)
    if any(tf.is_tensor(size) for size in sizes):
        sizes = tf.stack([tf.cast(size, tf.int64) for size in sizes])
    received = []
    for piece, part, shape in zip(tf.split(packed, sizes, num=len(parts)), parts, shapes):
        dtype = tf.uint8 if part.dtype == tf.bool else part.dtype
        if dtype.size > 1:
            piece = tf.bitcast(tf.reshape(piece, [-1, dtype.size]), dtype)
        elif dtype != tf.uint8:
            piece = tf.bitcast(piece, dtype)
        value = tf.reshape(piece, shape)
        value.set_shape(part.shape)
        received.append(tf.cast(value, tf.bool) if part.dtype == tf.bool else value)
    return received


def canonical(device):
    """One spelling of `device` ('/cpu:0' and '/device:CPU:0' alike), to compare or key by."""
    return tf.DeviceSpec.from_string(device or "").to_string()


def host_of(device):
    """'/job:worker/replica:0/task:1/device:GPU:0' -> its task's CPU device."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()
