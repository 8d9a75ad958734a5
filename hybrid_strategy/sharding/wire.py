"""What crosses between tasks in a step: everything one task sends another as one tensor.

TensorFlow sends every tensor an edge carries from one task to another by a call of
its own (a gRPC request, and thread hand-offs on both sides), about 0.6-0.9 ms of CPU
per side whatever its size: with small tensors, the calls cost more than the bytes.
So what one task sends another in one exchange of a step (the ids a worker looks up
in every table, the rows that come back, its gradients of every table, its dense
gradients and what rides with them) is put in an `Outbox` and crosses as one tensor
of bytes per pair of tasks: the shapes of the parts not fully known when traced in
front, then every part's bytes. The receiver knows each part's dtype and static shape
from the graph, and reads the rest from the front.

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

import numpy as np
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
    and known rank; the shapes of those not fully known when traced cross in front.
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


def _bytes_of(tensor, flat):
    """`tensor`'s bytes as one uint8 vector (`flat`: the shape [-1], shared by a pack)."""
    if tensor.dtype == tf.bool:
        tensor = tf.cast(tensor, tf.uint8)
    elif tensor.dtype != tf.uint8:
        tensor = tf.bitcast(tensor, tf.uint8)  # each element's bytes on a new last axis
    return tf.reshape(tensor, flat)


def _pack(parts):
    """The shapes of the parts with a dimension unknown when traced (int64), then each
    part's bytes, as one uint8 vector.

    Each op costs the tracing process a fraction of a millisecond and every step a few
    microseconds on its task, and a step packs dozens of parts: so a part takes a
    bitcast and a reshape on each side, whatever its shape, and the sizes of them all
    are found in a few ops.
    """
    flat = tf.constant([-1])
    front = [tf.shape(part, out_type=tf.int64) for part in parts
             if not part.shape.is_fully_defined()]
    if len(front) > 1:
        front = [tf.concat(front, 0)]
    return tf.concat([_bytes_of(part, flat) for part in front + parts], 0)


def _unpack(packed, parts):
    """The inverse of `_pack`, given the parts as the sender traced them."""
    dynamic = [i for i, part in enumerate(parts) if not part.shape.is_fully_defined()]
    static = [i for i in range(len(parts)) if i not in dynamic]
    sizes = [parts[i].shape.num_elements() * _carried(parts[i]).size for i in static]
    shapes = {}
    if dynamic:
        ranks = [parts[i].shape.rank for i in dynamic]
        front, packed = tf.split(packed, [8 * sum(ranks), -1], num=2)
        dims = tf.bitcast(tf.reshape(front, [-1, 8]), tf.int64)
        # Each dynamic part's size in bytes: the product of its dimensions, times its
        # item's size.
        owners = np.repeat(np.arange(len(dynamic), dtype=np.int64), ranks)
        dynamic_sizes = tf.math.segment_prod(dims, owners) * np.array(
            [_carried(parts[i]).size for i in dynamic], np.int64)
        sizes = tf.dynamic_stitch([np.array(static, np.int32), np.array(dynamic, np.int32)],
                                  [np.array(sizes, np.int64), dynamic_sizes])
        # A reshape infers one unknown dimension, if no other is 0; other parts need
        # their shapes.
        explicit = [i for i in dynamic if parts[i].shape.as_list().count(None) > 1
                    or 0 in parts[i].shape.as_list()]
        if explicit:
            for i, shape in zip(dynamic, tf.split(dims, ranks, num=len(dynamic))):
                if i in explicit:
                    shapes[i] = shape
    received = []
    for i, (piece, part) in enumerate(zip(tf.split(packed, sizes, num=len(parts)), parts)):
        dtype = _carried(part)
        shape = shapes.get(i, [-1 if d is None else d for d in part.shape.as_list()])
        if dtype.size > 1:
            shape = (tf.concat([shape, np.array([dtype.size], np.int64)], 0) if i in shapes
                     else shape + [dtype.size])
        value = tf.reshape(piece, shape)
        if dtype != tf.uint8:
            value = tf.bitcast(value, dtype)
        value.set_shape(part.shape)
        received.append(tf.cast(value, tf.bool) if part.dtype == tf.bool else value)
    return received


def _carried(part):
    """The dtype `part` crosses in: bool as uint8."""
    return tf.uint8 if part.dtype == tf.bool else part.dtype


def canonical(device):
    """One spelling of `device` ('/cpu:0' and '/device:CPU:0' alike), to compare or key by."""
    return tf.DeviceSpec.from_string(device or "").to_string()


def host_of(device):
    """'/job:worker/replica:0/task:1/device:GPU:0' -> its task's CPU device."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()
