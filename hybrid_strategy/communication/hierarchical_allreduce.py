"""Dense all-reduce on CPU workers: sum per worker, then across workers in few messages.

TensorFlow's collective all-reduce puts every replica in one ring: with W workers of D
replicas each, a RING all-reduce takes 2 (W D - 1) steps one after the other, each a
message between two devices, most of them between processes. At Parallax's 8 x 6 = 48
replicas that is 94 steps per all-reduce, and a step of the text model on one machine
spent most of its time waiting in them. Here each worker first adds its replicas'
gradients on its first device (one process: no message), the W sums are all-reduced in a
ring of W devices (2 (W - 1) steps), and each worker passes the result to its replicas.
With one worker no collective runs at all. Every replica gets the same tensor, so
mirrored variables stay identical.

Across a power-of-two number W of workers, a small gradient (at most `SMALL_BYTES`, a
click-through model's dense layers) is summed in the step's graph instead of by collective
ops: by recursive halving, a swap between neighbours, then recursive doubling, 2 log2 W - 1
messages per worker (4 workers: 3, where the ring takes 6) and the ring's bytes; 2 workers
exchange their whole gradients once (1 message, the ring's bytes). Each part of the sum
is added on one worker, or on two neighbours in the same order, and copied to the others,
so every worker holds the same sum. Per message, a step pays calls between processes at
both ends and a network round trip, and collective ops their own executor besides: below
the threshold the fewer messages win.

GPU replicas keep TensorFlow's choice (NCCL organises its own rings within and across
machines); so does a cluster of workers with one replica each whose number is not a power
of two.

```python
from hybrid_strategy.communication import hierarchical_allreduce
devices = [f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in (0, 1) for d in (0, 1)]
print(hierarchical_allreduce.applies(devices, "RING"))   # True: 2 workers of 2 replicas
```
"""

import collections

import tensorflow as tf

# TF-private: the launcher of one device's collective ops (group and instance keys,
# ordering token), as TensorFlow's CollectiveAllReduce uses it, and the devices a
# reduction's destination names.
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.distribute import cross_device_utils

from hybrid_strategy.communication import aggregation as communication

# Up to this many bytes per replica, workers sum in the step's graph, not by collective ops.
SMALL_BYTES = 512 * 1024


def applies(devices, implementation):
    """Whether the dense all-reduce over `devices` is this one (per worker first, or in
    the step's graph across a power-of-two number of workers).

    Args:
        devices: Every replica's device.
        implementation: The collective implementation chosen (a
            `CommunicationImplementation` value such as "RING", "NCCL", "AUTO").
    """
    if implementation == "NCCL" or any("/device:GPU:" in d for d in devices):
        return False
    hosts = collections.Counter(communication.host_of(d) for d in devices)
    return max(hosts.values()) > 1 or _power_of_two(len(hosts))


class HierarchicalAllReduce:
    """Sums per worker, all-reduces the sums across workers, copies back to the replicas.

    Args:
        devices: Every replica's device, in replica order.
        collective_keys: The strategy's `CollectiveKeys` (group and instance keys).
        options: `collective_util.Options` for the collective across workers.
    """

    def __init__(self, devices, collective_keys, options):
        self._devices = tuple(devices)
        self._hosts = collections.OrderedDict()
        for index, device in enumerate(self._devices):
            self._hosts.setdefault(communication.host_of(device), []).append(index)
        leaders = [self._devices[indices[0]] for indices in self._hosts.values()]
        self._leaders = leaders
        self._options = options
        self.launchers = []
        if len(leaders) > 1:
            group_key = collective_keys.get_group_key(leaders)
            self.launchers = [
                cross_device_utils.CollectiveReplicaLauncher(
                    group_key, len(leaders), collective_keys, leader, options)
                for leader in leaders]

    def accepts(self, components, destinations):
        """Whether it reduces a value of these per-replica `components` to `destinations`:
        one dense tensor per replica, the result wanted on every replica."""
        return (len(components) == len(self._devices)
                and all(isinstance(c, tf.Tensor) for c in components)
                and tuple(cross_device_ops.get_devices_from(destinations)) == self._devices)

    def all_reduce(self, reduce_op, per_replica_values, options=None):
        """Reduces each of `per_replica_values` (dense, one tensor per replica).

        Returns, for each value, one tensor per replica holding the sum (or mean).
        One collective runs across workers per dtype.
        """
        options = self._options.merge(options) if options is not None else self._options
        by_dtype = collections.OrderedDict()
        for k, values in enumerate(per_replica_values):
            by_dtype.setdefault(values[0].dtype, []).append(k)
        results = [None] * len(per_replica_values)
        for indices in by_dtype.values():
            reduced = self._reduce_pack(
                reduce_op, [per_replica_values[k] for k in indices], options)
            for k, value in zip(indices, reduced):
                results[k] = value
        return results

    def _reduce_pack(self, reduce_op, pack, options):
        shapes = [_shape(values[0]) for values in pack]
        sizes = [tf.reduce_prod(shape) if tf.is_tensor(shape) else _product(shape)
                 for shape in shapes]
        flat = []
        for replica, device in enumerate(self._devices):
            with tf.device(device):
                flat.append(tf.concat([tf.reshape(values[replica], [-1]) for values in pack],
                                      0))
        sums = []
        for indices in self._hosts.values():
            with tf.device(self._devices[indices[0]]), tf.name_scope("local_sum"):
                parts = [flat[i] for i in indices]
                sums.append(tf.add_n(parts) if len(parts) > 1 else parts[0])
        if _power_of_two(len(sums)) and _bytes(pack) <= SMALL_BYTES:
            sums = _in_graph_sum(sums, self._leaders)
        elif self.launchers:
            sums = [launcher.all_reduce(total, None, options)
                    for launcher, total in zip(self.launchers, sums)]
        per_replica = [None] * len(self._devices)
        for total, indices in zip(sums, self._hosts.values()):
            for i in indices:
                with tf.device(self._devices[i]):
                    value = tf.identity(total)
                    if reduce_op == tf.distribute.ReduceOp.MEAN:
                        value = value / len(self._devices)
                    parts = tf.split(value, sizes, num=len(sizes)) if len(pack) > 1 else [value]
                    per_replica[i] = [tf.reshape(part, shape) for part, shape
                                      in zip(parts, shapes)]
        return [[per_replica[i][k] for i in range(len(self._devices))]
                for k in range(len(pack))]


def _in_graph_sum(values, devices):
    """Each of `devices` (a power-of-two number) ends with the sum of `values` (one 1-D
    tensor of static length on each), in 2 log2 W - 1 messages per device with the ring's
    bytes.

    Recursive halving leaves each pair of neighbours (devices 2j and 2j + 1) with partial
    sums of the same 2/W of the vector; they swap those whole, both adding them in the same
    order (the same bits), and recursive doubling gathers the rest. Rabenseifner's scheme
    would halve once more and double once more: one message more for the same bytes.
    """
    count, length = len(devices), values[0].shape[0]
    blocks = count // 2  # a pair of neighbours ends the halving with one block
    block = -(-length // blocks)
    padding = block * blocks - length
    parts = list(values)
    if padding:
        for i, device in enumerate(devices):
            with tf.device(device):
                parts[i] = tf.pad(values[i], [[0, padding]])
    # Reduce-scatter: in each round a device keeps half of its range of blocks, adding its
    # partner's part of that half (sliced where it lies: only the half crosses).
    ranges = [(0, blocks)] * count
    distance = count // 2
    while distance > 1:
        kept_parts, kept_ranges = [], []
        for i, device in enumerate(devices):
            partner = i ^ distance
            start, end = ranges[i]
            middle = (start + end) // 2
            low, high = (start, middle) if i < partner else (middle, end)
            begin, stop = (low - start) * block, (high - start) * block
            with tf.device(devices[partner]), tf.name_scope("halving"):
                theirs = parts[partner][begin:stop]
            with tf.device(device), tf.name_scope("halving"):
                kept_parts.append(parts[i][begin:stop] + theirs)
            kept_ranges.append((low, high))
        parts, ranges, distance = kept_parts, kept_ranges, distance // 2
    swapped = []
    for i, device in enumerate(devices):
        first, second = sorted((i, i ^ 1))
        with tf.device(device), tf.name_scope("exchange"):
            swapped.append(parts[first] + parts[second])
    parts = swapped
    # All-gather: partners join their ranges, doubling them, until every device has all.
    distance = 2
    while distance < count:
        joined = []
        for i, device in enumerate(devices):
            partner = i ^ distance
            ordered = sorted([(ranges[i], parts[i]), (ranges[partner], parts[partner])],
                             key=lambda item: item[0])
            with tf.device(device), tf.name_scope("doubling"):
                joined.append(tf.concat([part for _, part in ordered], 0))
        ranges = [(min(ranges[i][0], ranges[i ^ distance][0]),
                   max(ranges[i][1], ranges[i ^ distance][1])) for i in range(count)]
        parts, distance = joined, distance * 2
    if padding:
        for i, device in enumerate(devices):
            with tf.device(device):
                parts[i] = parts[i][:length]
    return parts


def _power_of_two(n):
    return n > 1 and n & (n - 1) == 0


def _bytes(pack):
    """Bytes of one replica's part of `pack` (infinite if a shape is not static)."""
    if not all(values[0].shape.is_fully_defined() for values in pack):
        return float("inf")
    return sum(values[0].shape.num_elements() * values[0].dtype.size for values in pack)


def _shape(tensor):
    """The static shape as a list when known, else the dynamic one."""
    return tensor.shape.as_list() if tensor.shape.is_fully_defined() else tf.shape(tensor)


def _product(dims):
    size = 1
    for dim in dims:
        size *= dim
    return size
