"""Gradient aggregation for PS tables: per-worker local sums, then one sum per shard on its PS.

This module holds the parameter-server side of a step's gradients (routing.py routes
them): summing a PS table's gradients (`tf.IndexedSlices` the Parallax way, or dense
ones) where it lives. Each worker first merges its replicas' slices (duplicate rows
summed once) and splits them by shard, so only its distinct rows cross the network,
each to the PS that holds it, everything it sends one PS task in one tensor (`Push`,
wire.py), without the ids that task holds from the step's lookup; that PS then sums
the workers' parts, again merging duplicate rows, so the optimizer sees each row once,
exactly as a dense gradient would give it. `dense_options` chooses the implementation of
the collective all-reduce for what the PS does not sum.

```python
import tensorflow as tf
from hybrid_strategy.communication import aggregation
from hybrid_strategy.tables import table
t = table.ShardedTable([tf.Variable(tf.zeros((3, 2))), tf.Variable(tf.zeros((2, 2)))], "emb")
g = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([4, 1, 4]), tf.constant([5, 2]))
(sums,) = aggregation.sum_sparse([([g], t)], ["/cpu:0"])
print([s.indices.numpy() for s in sums])   # [2] and [0]: row 4 once, summed twice
```
"""

import collections

import tensorflow as tf

from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.sharding import wire
from hybrid_strategy.tables import table as table_lib


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


def _by_host(replica_values, replica_devices):
    by_host = collections.OrderedDict()
    for value, replica_device in zip(replica_values, replica_devices):
        by_host.setdefault(wire.host_of(replica_device), []).append(value)
    return by_host.items()


class Push:
    """A step's gradients of PS tables on their way to the PS tasks, and what rides with them.

    Each worker first sums its replicas' gradients of a table (duplicate rows merged
    once) and splits them by shard; everything it sends one PS task in the step (every
    table's rows, their ids unless that task holds them from the step's lookup
    (`table.ids_on_ps`), dense gradients of PS tables, penalty factors, and what the
    caller adds with `put`) crosses as one tensor (wire.py), rows in each table's
    `wire_dtype`. After `deliver()`, `sparse_sums(i)` and `dense_sums(i)` are the sums
    of each shard, made on its PS in the table's dtype.

    Args:
        replica_devices: The device each replica runs on, in replica order.
    """

    def __init__(self, replica_devices):
        self._replica_devices = tuple(replica_devices)
        self._outbox = wire.Outbox()
        self._arrived = None
        # (table, {shard: [(ids held on its PS or their ticket, values' ticket)] per
        # worker, or [ticket of a dense part] per worker}) of each table added
        self._tables = []

    def put(self, source, destination, tensor):
        """Sends `tensor` from `source` to `destination` with the gradients (a ticket)."""
        return self._outbox.put(source, destination, tensor)

    def add_sparse(self, replica_slices, table):
        """Adds the replicas' `IndexedSlices` of `table` (table-wide rows); its number."""
        parts = {k: [] for k in range(table.num_shards)}
        for host, host_slices in _by_host(replica_slices, self._replica_devices):
            with tf.device(host), tf.name_scope("local_aggregation"):
                held, shard_parts = _shard_parts(host_slices, table)
                for k, (ids, values) in enumerate(shard_parts):
                    destination = table.shards[k].device
                    parts[k].append(
                        (ids if held else self.put(host, destination, ids),
                         self.put(host, destination, wire.to_wire(values, table.wire_dtype))))
        self._tables.append((table, parts))
        return len(self._tables) - 1

    def add_dense(self, replica_values, table):
        """Adds the replicas' dense gradients of `table`; its number."""
        parts = {k: [] for k in range(table.num_shards)}
        for host, host_values in _by_host(replica_values, self._replica_devices):
            with tf.device(host), tf.name_scope("local_aggregation"):
                total = tf.add_n(host_values) if len(host_values) > 1 else host_values[0]
                for k, part in enumerate(sharding.split_dense(total, table.num_shards)):
                    parts[k].append(self.put(host, table.shards[k].device, part))
        self._tables.append((table, parts))
        return len(self._tables) - 1

    def put_per_worker(self, replica_values, destinations):
        """Sends each worker's sum of its replicas' scalars in `replica_values` to every
        device of `destinations`: {destination: [the workers' sums as they arrive]}."""
        tickets = {destination: [] for destination in destinations}
        for host, host_values in _by_host(replica_values, self._replica_devices):
            with tf.device(host):
                total = tf.add_n(host_values) if len(host_values) > 1 else host_values[0]
            for destination in destinations:
                tickets[destination].append(self.put(host, destination, total))
        return tickets

    @property
    def destinations(self):
        """The PS devices the tables added so far send gradients to."""
        return sorted({shard.device for table, _ in self._tables for shard in table.shards})

    @property
    def first_worker(self):
        """The first replica's worker (its CPU device)."""
        return wire.host_of(self._replica_devices[0])

    def deliver(self):
        """Sends everything; `arrived(ticket)` and the sums are then at hand."""
        self._arrived = self._outbox.deliver()

    def arrived(self, ticket):
        return self._arrived[ticket]

    @property
    def delivered(self):
        """{ticket: tensor as it arrived}, once delivered."""
        return self._arrived

    def sparse_sums(self, number):
        """Table `number`'s gradient summed on each shard's PS: one `IndexedSlices` of
        shard-local rows per shard, each row once."""
        table, parts = self._tables[number]
        sums = []
        for k, shard in enumerate(table.shards):
            with tf.device(shard.device), tf.name_scope("ps_aggregation"):
                arrived = [tf.IndexedSlices(
                               wire.from_wire(self.arrived(values), table.dtype),
                               self.arrived(ids) if isinstance(ids, tuple) else ids)
                           for ids, values in parts[k]]
                sums.append(sharding.merge_duplicates(sharding.concat_slices(arrived)))
        return sums

    def dense_sums(self, number):
        """Table `number`'s dense gradient summed on each shard's PS, one per shard."""
        table, parts = self._tables[number]
        sums = []
        for k, shard in enumerate(table.shards):
            with tf.device(shard.device), tf.name_scope("ps_aggregation"):
                arrived = [self.arrived(ticket) for ticket in parts[k]]
                sums.append(tf.add_n(arrived) if len(arrived) > 1 else tf.identity(arrived[0]))
        return sums


def _shard_parts(host_slices, table):
    """One worker's replicas' rows of `table`, each row once, split by shard: (whether
    the ids are those each shard's PS holds from the step's lookup, [(shard-local ids,
    values)] per shard)."""
    if len(host_slices) == 1 and table_lib.distinct_rows(host_slices[0].indices):
        # One replica's single lookup: its rows are distinct, as the lookup sent them.
        slices = host_slices[0]
        held = table_lib.ids_on_ps(slices.indices)
        if held is not None:
            shard, ids = held
            values = ([slices.values] if shard is None else
                      tf.dynamic_partition(slices.values, shard, table.num_shards))
            return True, list(zip(ids, values))
    else:
        slices = sharding.merge_duplicates(sharding.concat_slices(host_slices))
    return False, [(part.indices, part.values)
                   for part in sharding.split_slices(slices, table.num_shards)]


def sum_sparse(gradients, replica_devices):
    """Sums per-replica `IndexedSlices` of PS tables into one sum per shard, on its PS
    (`Push`). Returns, per table, one `IndexedSlices` per shard, with row ids local to
    the shard.

    Args:
        gradients: `(replica_slices, table)` pairs: one table-wide `IndexedSlices`
            per replica, and the `ShardedTable` they belong to.
        replica_devices: The device each replica runs on (same order).
    """
    push = Push(replica_devices)
    numbers = [push.add_sparse(replica_slices, table) for replica_slices, table in gradients]
    push.deliver()
    return [push.sparse_sums(number) for number in numbers]
