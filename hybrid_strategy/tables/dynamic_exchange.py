"""A training step's dynamic tables in one exchange: each worker's ids out, the rows back.

Each `DynamicEmbedding` trained in a step (`Remap`, dynamic.py) needs the global
batch's ids in one place before any replica reads a row, and the map's shards on the
tasks that hold its rows. `train` runs every such table of the step together, in
four parts, what crosses between two tasks in each part going as one tensor
(`wire.Outbox`, whatever the number of tables):

1. each worker sends its replicas' distinct ids of every table to each PS task
   holding a shard of its rows (an admitted id's row may be on any of them), with
   their counts to the first shard's task;
2. each shard finds them in its own map (`Remap.find`); the other shards send
   their finds to the first;
3. the first shard's task takes the step's decisions and writes its own map
   (`Remap.decide`), then sends each other shard every id's row and the ids evicted
   from its rows; each writes its own map (`Remap.settle`) and resets the rows it
   gave;
4. each shard gathers its rows of each worker's ids and sends them to that worker,
   the first also each id's row.

Parts 2 and 3 cross between PS tasks only for tables split over several of them. A
worker sends each PS task one tensor and gets one back, as for fixed tables
(table.py's `lookup_many`); the rows' gradients then cross without their ids, which
the PS tasks hold from part 4 (`table.ids_on_ps`).

```python
import tensorflow as tf
from hybrid_strategy.tables import dynamic, dynamic_exchange
remap = dynamic.Remap(capacity=4, devices=["/cpu:0"])
counted = tf.constant([[7, 9], [1, 1]], tf.int64)       # distinct ids, their counts
table = dynamic_exchange.Table(remap, None, lambda rows, keys, shard: [], [counted])
(result,), = dynamic_exchange.train([table])
print(result.rows.numpy())                                # [0 1]
```
"""

import collections

import tensorflow as tf

# TF-private: `record.stop_recording` keeps a gradient tape from differentiating the
# rows' raw reads on the PS tasks; the caller records their table-wide gradient
# (`table.rows_read`).
from hybrid_strategy.tensorflow_private import record

from hybrid_strategy.sharding import wire
from hybrid_strategy.tables import dynamic
from hybrid_strategy.tables import step_lock

# A table's part: its `Remap`; the PS table of its rows when it is split as the map is
# (one shard per map shard), else None (the caller looks its rows up); `reset(rows,
# keys, shard)`, which resets those rows (table-wide ids, on shard `shard` of the
# table, or anywhere when None) and their slots to each key's initial values and
# returns the ops the rows' reads must wait for; and per replica, [2, n] int64: its
# distinct keys and their counts.
Table = collections.namedtuple("Table", "remap rows reset counted")
# A replica's result: the row of each of its keys (-1: none); the rows held, in that
# order; with a PS table, their vectors, the shard of each (None: one shard) and the
# shard-local ids each shard's PS task gathered, in the order the shard takes them.
Result = collections.namedtuple("Result", "rows held_rows vectors shard held_on_ps")


def train(tables, concurrent=False):
    """Admission, eviction and the rows of every `Table`, for the global batch, in one
    exchange; in a cross-replica context. Returns, per table, a `Result` per replica.

    Each table's step finds its ids before any table's decisions are written: a map
    may take part once (a layer called twice trains twice, one call after the other).
    `concurrent`: other steps may train the same tables at the same time (asynchronous
    training); each step then holds every table's `Remap.lock` from its finds to its
    rows' reads (`step_lock.holding`), so that its finds, decisions, writes, resets and
    reads see no other step's writes and another step sees all of them or none.
    """
    remaps = [table.remap for table in tables]
    if len({id(remap) for remap in remaps}) < len(remaps):
        raise ValueError("dynamic_exchange.train: a table takes part in an exchange once; "
                         "train a layer's calls one after the other.")
    steps = [_Step(table) for table in tables]
    with record.stop_recording():
        _run(steps, ("send_keys",))
        # Taken once the step's ids are on each table's first shard's task.
        arrived = [step.arrived[sent[0]] for step in steps for sent in step.sent]
        with step_lock.holding([remap.lock for remap in remaps] if concurrent else [],
                               after=arrived):
            _run(steps, ("find", "decide", "settle"))
        return [step.results() for step in steps]


def _run(steps, parts):
    """The `parts` of every table's step, each part's transfers delivered at once."""
    for part in parts:
        outbox = wire.Outbox()
        for step in steps:
            with tf.name_scope(f"{step.remap.name}_{part}"):
                getattr(step, part)(outbox)
        arrived = outbox.deliver()
        for step in steps:
            step.arrived = arrived


class _Step:
    """One table's part of the exchange, as it goes: each method adds what it sends
    to the outbox of its part, and finds what it was sent in `arrived`."""

    def __init__(self, table):
        self.table = table
        self.remap = table.remap
        self.devices = table.remap.devices
        self.hosts = [wire.host_of(counted.device) for counted in table.counted]
        self.arrived = None

    def send_keys(self, outbox):
        # The first shard's task takes the counts, the others the keys alone.
        self.sent = []
        for host, counted in zip(self.hosts, self.table.counted):
            with tf.device(host):
                keys = counted[0]
            self.sent.append([outbox.put(host, device, counted if k == 0 else keys)
                              for k, device in enumerate(self.devices)])

    def find(self, outbox):
        """Each shard's task unites the replicas' keys (all in the same order) and finds
        them in its map; the others send their finds, and their maps' sizes, on."""
        self.keys, self.places, self.found, self.up = [], [], [], []
        for k, device in enumerate(self.devices):
            parts = [self.arrived[sent[k]] for sent in self.sent]
            with tf.device(device):
                if k == 0:
                    keys = _joined([p[0] for p in parts])
                    self.counts = _joined([p[1] for p in parts])
                else:
                    keys = _joined(parts)
                places = None
                if len(parts) > 1:
                    keys, place = tf.unique(keys, out_idx=tf.int64)
                    if k == 0:
                        self.counts = tf.math.unsorted_segment_sum(self.counts, place,
                                                                   tf.size(keys))
                    places = tf.split(place, [tf.shape(p)[-1] for p in parts])
            found = self.remap.find(k, keys)
            self.keys.append(keys)
            self.places.append(places)
            self.found.append(found)
            if k > 0:
                self.up.append((outbox.put(device, self.devices[0], found),
                                outbox.put(device, self.devices[0], self.remap.size(k))))

    def decide(self, outbox):
        """The first shard's task decides, then sends each other shard its part."""
        found = [self.found[0]] + [self.arrived[ticket] for ticket, _ in self.up]
        self.decision = self.remap.decide(self.keys[0], self.counts, found,
                                          [self.arrived[ticket] for _, ticket in self.up])
        self.down = [(outbox.put(self.devices[0], device, self.decision.rows),
                      outbox.put(self.devices[0], device, evicted))
                     for device, evicted in zip(self.devices[1:], self.decision.evicted)]

    def settle(self, outbox):
        """Each shard's task writes its map, resets the rows it gave, and sends each
        replica's host the vectors of its rows among the replica's keys (the first
        shard also every key's row)."""
        decision, rows_table = self.decision, self.table.rows
        rows = [decision.rows] + [self.arrived[ticket] for ticket, _ in self.down]
        given = [self.remap.settle(k, self.keys[k], self.found[k], rows[k],
                                   self.arrived[evicted])
                 for k, (_, evicted) in enumerate(self.down, 1)]
        with tf.device(self.devices[0]):
            if rows_table is None:
                resets = [self.table.reset(decision.admitted_rows, decision.admitted_keys,
                                           None)]
            elif self.down:
                here = tf.where(dynamic.held_on(decision.admitted_rows, 0,
                                                len(self.devices)))[:, 0]
                given.insert(0, (tf.gather(decision.admitted_rows, here),
                                 tf.gather(decision.admitted_keys, here)))
            else:
                given.insert(0, (decision.admitted_rows, decision.admitted_keys))
        if rows_table is not None:
            resets = []
            for k, (device, (new_rows, new_keys)) in enumerate(zip(self.devices, given)):
                with tf.device(device):
                    resets.append(self.table.reset(new_rows, new_keys, k))
        self.rows_sent, self.vectors_sent, self.held = [], [], []
        for i, host in enumerate(self.hosts):
            vectors, held = [], []
            for k, device in enumerate(self.devices):
                with tf.device(device):
                    mine = rows[k] if self.places[k] is None else tf.gather(
                        rows[k], self.places[k][i])
                    if k == 0:
                        self.rows_sent.append(outbox.put(device, host, mine))
                    if rows_table is None:
                        continue
                    local = tf.gather(mine, tf.where(
                        dynamic.held_on(mine, k, len(self.devices)))[:, 0])
                    if self.down:
                        local //= len(self.devices)
                    with tf.control_dependencies(resets[k]):
                        gathered = tf.raw_ops.ResourceGather(
                            resource=rows_table.shards[k].handle, indices=local,
                            dtype=rows_table.dtype)
                    vectors.append(outbox.put(device, host, wire.to_wire(
                        gathered, rows_table.wire_dtype)))
                    held.append(local)
            self.vectors_sent.append(vectors)
            self.held.append(tuple(held))

    def results(self):
        out = []
        rows_table = self.table.rows
        for host, rows_sent, vectors_sent, held in zip(
                self.hosts, self.rows_sent, self.vectors_sent, self.held):
            rows = self.arrived[rows_sent]
            with tf.device(host):
                held_rows = tf.gather(rows, tf.where(rows >= 0)[:, 0])
                if rows_table is None:
                    out.append(Result(rows, held_rows, None, None, None))
                    continue
                parts = [wire.from_wire(self.arrived[ticket], rows_table.dtype)
                         for ticket in vectors_sent]
                shard, vectors = None, parts[0]
                if len(parts) > 1:
                    shard = tf.cast(held_rows % len(parts), tf.int32)
                    vectors = tf.dynamic_stitch(tf.dynamic_partition(
                        tf.range(tf.size(held_rows)), shard, len(parts)), parts)
            out.append(Result(rows, held_rows, vectors, shard, held))
        return out


def _joined(tensors):
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, 0)
