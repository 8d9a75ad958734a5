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

On a cluster with PS tasks a small dense part skips the all-reduce: each worker's sum
(`sum_per_worker`) rides with its gradients to the first PS task, which adds them up and
sends the total back (communication/routing.py), while that pays (`sum_on_ps_pays`);
`to_replicas` hands the total to each worker's replicas as the all-reduce does.

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
from hybrid_strategy.tensorflow_private import cross_device_ops
from hybrid_strategy.tensorflow_private import cross_device_utils

from hybrid_strategy.sharding import wire

# Up to this many bytes per replica, workers sum in the step's graph, not by collective ops.
SMALL_BYTES = 512 * 1024
# The CPU a tensor costs each side when it crosses between tasks, whatever its size
# (benchmarks/results/transfer_cost.md).
MESSAGE_CPU_MS = 0.7
# Up to this many bytes of the workers' dense gradients per step, a PS task sums them in
# the step's exchange with it (`sum_on_ps_pays`): 3.4 ms each way on a 10 Gbit/s link.
PS_SUM_BYTES = 4 * 1024 * 1024


def on_cpus(devices, implementation):
    """Whether every replica of `devices` is a CPU and no GPU collective is asked for: a
    `HierarchicalAllReduce` can then sum their dense gradients."""
    return implementation != "NCCL" and not any("/device:GPU:" in d for d in devices)


def applies(devices, implementation):
    """Whether the dense all-reduce over `devices` is this one (per worker first, or in
    the step's graph across a power-of-two number of workers) rather than TensorFlow's.

    Args:
        devices: Every replica's device.
        implementation: The collective implementation chosen (a
            `CommunicationImplementation` value such as "RING", "NCCL", "AUTO").
    """
    if not on_cpus(devices, implementation):
        return False
    hosts = collections.Counter(wire.host_of(d) for d in devices)
    return max(hosts.values()) > 1 or _power_of_two(len(hosts))


class HierarchicalAllReduce:
    """Sums per worker, all-reduces the sums across workers, copies back to the replicas.

    Args:
        devices: Every replica's device, in replica order.
        collective_keys: The strategy's `CollectiveKeys` (group and instance keys).
        options: `collective_util.Options` for the collective across workers.
        replaces_collectives: Whether it all-reduces in place of TensorFlow's collectives
            (`applies`); otherwise it only sums per worker for the reducer PS.
    """

    def __init__(self, devices, collective_keys, options, replaces_collectives=True):
        self.replaces_collectives = replaces_collectives
        self._devices = tuple(devices)
        self._hosts = collections.OrderedDict()
        for index, device in enumerate(self._devices):
            self._hosts.setdefault(wire.host_of(device), []).append(index)
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

    @property
    def leaders(self):
        """Each worker's first device, in replica order: where its replicas' sum is made."""
        return tuple(self._leaders)

    def all_reduce(self, reduce_op, per_replica_values, options=None):
        """Reduces each of `per_replica_values` (dense, one tensor per replica).

        Returns, for each value, one tensor per replica holding the sum (or mean).
        One collective runs across workers per dtype.
        """
        options = self._options.merge(options) if options is not None else self._options
        sums = self.sum_per_worker(per_replica_values)
        totals = []
        for worker_sums, pack in zip(sums.per_dtype, sums.packs):
            if _power_of_two(len(worker_sums)) and _bytes(pack) <= SMALL_BYTES:
                totals.append(_in_graph_sum(worker_sums, self._leaders))
            elif self.launchers:
                totals.append([launcher.all_reduce(total, None, options)
                               for launcher, total in zip(self.launchers, worker_sums)])
            else:
                totals.append(worker_sums)
        return self.to_replicas(reduce_op, sums, totals)

    def sum_per_worker(self, per_replica_values):
        """Each worker's sum of its replicas' values, flattened into one vector per dtype
        on its first device (`WorkerSums`), for `to_replicas` once summed across workers."""
        by_dtype = collections.OrderedDict()
        for k, values in enumerate(per_replica_values):
            by_dtype.setdefault(values[0].dtype, []).append(k)
        packs = [[per_replica_values[k] for k in indices] for indices in by_dtype.values()]
        per_dtype = []
        for pack in packs:
            flat = []
            for replica, device in enumerate(self._devices):
                with tf.device(device):
                    flat.append(tf.concat([tf.reshape(values[replica], [-1])
                                           for values in pack], 0))
            per_dtype.append([])
            for indices in self._hosts.values():
                with tf.device(self._devices[indices[0]]), tf.name_scope("local_sum"):
                    parts = [flat[i] for i in indices]
                    per_dtype[-1].append(tf.add_n(parts) if len(parts) > 1 else parts[0])
        return WorkerSums(per_dtype, [list(indices) for indices in by_dtype.values()], packs)

    def to_replicas(self, reduce_op, sums, totals):
        """Every value of `sums` (`sum_per_worker`) for each replica, from `totals`: for
        each dtype, the sum across workers on each worker's first device (or where it
        is, for its replicas to copy); the sum, or for MEAN the mean, per replica."""
        results = [None] * sum(len(indices) for indices in sums.indices)
        for indices, pack, worker_totals in zip(sums.indices, sums.packs, totals):
            shapes = [_shape(values[0]) for values in pack]
            sizes = [tf.reduce_prod(shape) if tf.is_tensor(shape) else _product(shape)
                     for shape in shapes]
            per_replica = [None] * len(self._devices)
            for total, replicas in zip(worker_totals, self._hosts.values()):
                for i in replicas:
                    with tf.device(self._devices[i]):
                        value = tf.identity(total)
                        if reduce_op == tf.distribute.ReduceOp.MEAN:
                            value = value / len(self._devices)
                        parts = (tf.split(value, sizes, num=len(sizes)) if len(pack) > 1
                                 else [value])
                        per_replica[i] = [tf.reshape(part, shape) for part, shape
                                          in zip(parts, shapes)]
            for j, k in enumerate(indices):
                results[k] = [per_replica[i][j] for i in range(len(self._devices))]
        return results


class WorkerSums:
    """`HierarchicalAllReduce.sum_per_worker`'s result: `per_dtype[d][w]` is worker w's
    vector of dtype group d, `indices[d]` the positions of the values it holds and
    `packs[d]` those values (one tensor per replica each)."""

    def __init__(self, per_dtype, indices, packs):
        self.per_dtype = per_dtype
        self.indices = indices
        self.packs = packs


def sum_on_ps_pays(num_workers, dense_bytes):
    """Whether a PS task should sum the workers' dense gradients (`dense_bytes` per worker)
    in the step's exchange with it, rather than the workers all-reducing them.

    Each worker's gradients then ride with its row gradients to the PS and the sum comes
    back as one tensor: a worker receives one tensor and sends none of its own, where the
    all-reduce takes 2 log2 W - 1 messages each way in the step's graph (W a power of
    two, `SMALL_BYTES` or less; 1 for 2 workers) or 2 (W - 1) in a ring, each costing
    both sides a call (`MESSAGE_CPU_MS`) whatever its size. What the PS pays grows with
    the bytes: every worker's gradient arrives on its link and the sum leaves on it, one
    after the other, where a ring spreads 2 (W - 1) / W of them over every worker's
    link. So the PS sums while the bytes it receives per step, W times `dense_bytes`,
    are at most `PS_SUM_BYTES`: a click-through model's dense layers (about 200 KB) are
    summed on the PS up to 20 workers, a language model's 2 MB stay all-reduced.

    ```python
    from hybrid_strategy.communication import hierarchical_allreduce
    print(hierarchical_allreduce.sum_on_ps_pays(4, 200_000))     # True
    print(hierarchical_allreduce.sum_on_ps_pays(8, 2_200_000))   # False
    ```
    """
    return num_workers > 1 and num_workers * dense_bytes <= PS_SUM_BYTES


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
