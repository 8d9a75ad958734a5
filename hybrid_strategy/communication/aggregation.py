"""Gradient aggregation for PS tables: per-worker local sums, then one sum per shard on its PS.

Gradients of mirrored variables take TensorFlow's collective all-reduce (see the
strategy, and `dense_options` for its implementation); this module holds the
parameter-server side: summing a PS table's gradients (`tf.IndexedSlices` the Parallax
way, or dense ones) where it lives. Each worker first merges its replicas' slices
(duplicate rows summed once) and splits them by shard, so only its distinct rows cross
the network, each to the PS that holds it, all its rows for one PS task (of every
table) in one tensor of ids and one of values (wire.py); that PS then sums the
workers' parts, again merging duplicate rows, so the optimizer sees each row once,
exactly as a dense gradient would give it.

```python
import tensorflow as tf

from hybrid_strategy.communication import aggregation as communication
from hybrid_strategy.tables import table as table_lib
g = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([4, 1, 4]), tf.constant([5, 2]))
print(communication.merge_duplicates(g).indices)   # [4 1]; row 4 summed twice
```
"""

import collections

import tensorflow as tf

from hybrid_strategy.communication import wire
from hybrid_strategy.tables import table as table_lib


def merge_duplicates(slices):
    """Returns `slices` with each row index once and its values summed."""
    unique, positions = tf.unique(slices.indices)
    values = tf.math.unsorted_segment_sum(slices.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def concat_slices(slices_list):
    if len(slices_list) == 1:
        return slices_list[0]
    return tf.IndexedSlices(
        tf.concat([s.values for s in slices_list], 0),
        tf.concat([s.indices for s in slices_list], 0),
        slices_list[0].dense_shape,
    )


def dense_options(devices, on_cluster):
    """All-reduce options for the mirrored variables where TensorFlow's own choice misfires.

    MirroredStrategy's choice (RING on CPUs, NCCL on GPUs) falls back to RING when
    this process sees fewer physical GPUs than logical ones, as with virtual GPUs.
    On a cluster the chief compares its own GPUs (often none) with every worker's,
    so a cluster of GPU workers would get RING: it gets NCCL here. None elsewhere.

    ```python
    devices = ["/job:worker/replica:0/task:0/device:GPU:0",
               "/job:worker/replica:0/task:1/device:GPU:0"]
    print(dense_options(devices, on_cluster=True).implementation)   # NCCL
    ```
    """
    if on_cluster and devices and all("/device:GPU:" in d for d in devices):
        return tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.NCCL)
    return None


def host_of(device):
    """'/job:worker/replica:0/task:1/device:GPU:0' -> its task's CPU device."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def _by_host(replica_values, replica_devices):
    by_host = collections.OrderedDict()
    for value, replica_device in zip(replica_values, replica_devices):
        by_host.setdefault(host_of(replica_device), []).append(value)
    return by_host.items()


def sum_sparse(gradients, replica_devices):
    """Sums per-replica `IndexedSlices` of PS tables into one sum per shard, on its PS.

    Each worker merges its replicas' rows of a table first and splits them by shard;
    all its parts bound for one PS task, of every table, cross as one tensor of
    row ids and one of values (`transfer`), in the table's `wire_dtype`; each
    shard's PS then sums the workers' parts in the table's dtype. Returns, per
    table, one `IndexedSlices` per shard, with row ids local to the shard.

    Args:
        gradients: `(replica_slices, table)` pairs: one table-wide `IndexedSlices`
            per replica, and the `ShardedTable` they belong to.
        replica_devices: The device each replica runs on (same order).
    """
    # (worker host, ps device) -> [((table number, shard), rows bound there)]
    outgoing = collections.OrderedDict()
    for t, (replica_slices, table) in enumerate(gradients):
        for host, host_slices in _by_host(replica_slices, replica_devices):
            with tf.device(host), tf.name_scope("local_aggregation"):
                merged = _merged(host_slices)
                for k, part in enumerate(table_lib.split_slices(merged, table.num_shards)):
                    outgoing.setdefault((host, table.shards[k].device), []).append(
                        ((t, k), (part, table.wire_dtype)))
    arrived = collections.defaultdict(list)
    for (host, destination), parts in outgoing.items():
        keys = [key for key, _ in parts]
        for key, part in zip(keys, transfer([part for _, part in parts], host, destination)):
            arrived[key].append(part)
    sums = []
    for t, (_, table) in enumerate(gradients):
        sums.append([])
        for k, shard in enumerate(table.shards):
            with tf.device(shard.device), tf.name_scope("ps_aggregation"):
                sums[-1].append(merge_duplicates(concat_slices(arrived[(t, k)])))
    return sums


def _merged(host_slices):
    """One worker's replicas' rows of a table, each row once."""
    if len(host_slices) == 1 and table_lib.distinct_rows(host_slices[0].indices):
        return host_slices[0]  # one replica's single lookup: its rows are distinct
    return merge_duplicates(concat_slices(host_slices))


def transfer(parts, source, destination):
    """`parts` (`(IndexedSlices, wire dtype)` pairs) as they arrive on `destination`,
    sent from `source`: parts alike in dtypes cross as one tensor of row ids and one
    of values (wire.py), in their wire dtype (None: their own), whatever the
    dtypes of their ids."""
    arrived = [None] * len(parts)
    for (dtype, wire_dtype), members in wire.alike(
            (part.values.dtype, wire_dtype) for part, wire_dtype in parts):
        group = [parts[i][0] for i in members]
        if len(group) == 1 and wire_dtype is None:
            arrived[members[0]] = group[0]  # TensorFlow sends it as it is
            continue
        with tf.device(source), tf.name_scope("local_aggregation"):
            ids, _ = wire.pack_ids([part.indices for part in group])
            values = wire.pack_values([part.values for part in group], wire_dtype)
        with tf.device(destination), tf.name_scope("ps_aggregation"):
            indices, counts = wire.unpack_ids(ids, [part.indices.dtype for part in group])
            rows = wire.unpack_values(values, counts,
                                      [part.values.shape[1:] for part in group], dtype)
            for i, index, row in zip(members, indices, rows):
                arrived[i] = tf.IndexedSlices(row, index)
    return arrived


def sum_dense(replica_values, replica_devices, table):
    """Sums per-replica dense gradients of `table` into one sum per shard, on its PS.

    The parameter-server way: each worker adds its replicas' gradients, sends each
    shard's rows to that shard's PS, and the PS adds the workers' parts.
    """
    parts_by_shard = [[] for _ in table.shards]
    for host, host_values in _by_host(replica_values, replica_devices):
        with tf.device(host), tf.name_scope("local_aggregation"):
            total = tf.add_n(host_values) if len(host_values) > 1 else host_values[0]
            for k, part in enumerate(table_lib.split_dense(total, table.num_shards)):
                parts_by_shard[k].append(part)
    sums = []
    for shard, parts in zip(table.shards, parts_by_shard):
        with tf.device(shard.device), tf.name_scope("ps_aggregation"):
            sums.append(tf.add_n(parts) if len(parts) > 1 else tf.identity(parts[0]))
    return sums


def join_shards(shard_sums, table):
    """One table-wide gradient from per-shard sums (global row ids for slices)."""
    if not isinstance(shard_sums[0], tf.IndexedSlices):
        return table_lib.join_dense(shard_sums) if len(shard_sums) > 1 else shard_sums[0]
    return table_lib.join_slices(shard_sums, table.shape)


def shard_summed(shard_sums, table):
    """The table-wide sum, carrying its per-shard parts for `shard_sums_of`.

    The table-wide sum is what an all-reduce promises; the update and clipping
    use the per-shard sums where they are, so the joined one is built only if
    something else reads it.
    """
    total = join_shards(shard_sums, table)
    total._hybrid_shard_sums = tuple(shard_sums)
    total._hybrid_table = table
    return total


def shard_sums_of(gradient):
    """The per-shard sums of a `shard_summed` gradient, else None."""
    return getattr(gradient, "_hybrid_shard_sums", None)


def table_of_sum(gradient):
    """The PS table of a `shard_summed` gradient."""
    return gradient._hybrid_table
