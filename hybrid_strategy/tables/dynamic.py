"""Dynamic vocabularies: raw int64 or string ids remapped to the rows of a fixed-capacity table.

A `Remap` gives each admitted id a row of a `capacity`-row table (a `ShardedTable`
on the PS tasks under a HybridStrategy, a plain variable elsewhere). It holds one
`MutableHashTable` per shard of the rows (under a HybridStrategy, on that shard's PS
task), from an id's key to one int64: shard k maps the admitted ids whose rows it
holds (rows k, k + S, k + 2S, ..., as a `ShardedTable` deals them) to their rows, and
the first shard also maps each id waiting for a row to its count and last step. Beside
the first shard are each row's `[key, count, last step]` (last -1: a free row), a stack
of free rows, the step counter and the totals of admissions and evictions. An admitted
id's count and last step live in its row's record alone, so that the maps are written
only for ids without a row and ids given one, and the eviction pass chooses among
admitted ids without exporting a map; it exports the first shard's only when waiting
ids may be forgotten.

A training step (`Remap.train`) sees the global batch's distinct ids and their counts
once, in the cross-replica context, before any replica looks a row up:

1. each distinct id's count grows by its occurrences and its last step becomes this
   step;
2. ids not yet admitted whose count reached `min_count` are admitted, in ascending
   key order, as long as rows are free; when too few are, a pass over the rows
   evicts those of ids not seen this step (by `policy`: the oldest last step first
   for "lru", the smallest count first for "lfu"), `headroom` more than needed, so
   that the pass runs rarely; ids that still find no row wait for the next step;
3. an admitted id's row, and its optimizer slots, are reset (`reset(rows, keys)`),
   so an id evicted and admitted again starts from a fresh row;
4. with `max_age`, the pass also runs every `max_age // 4 + 1` steps and evicts
   ids not seen for more than `max_age` steps, admitted or waiting; when more than
   `max_waiting` ids wait for admission, it forgets the oldest of them, down to half.

With `admission="sketch"`, waiting ids are in no map: their counts are in a
`sketch.WaitingSketch` of a fixed size beside the first shard, which estimates them
(above the exact count with odds of at most `admission_error`, never below it until
halved) and halves them all when it fills, instead of forgetting the oldest waiting
ids or those older than `max_age`.

Every decision depends only on the multiset of the step's ids, never on how they
were split over replicas or shards, so N workers decide exactly what one device
decides on the same global batch. Ids not admitted look up no row (row -1).

The step runs in three parts, so that each shard's finds and writes run on its own
task (`dynamic_exchange.py` sends what crosses between them): `find` on every shard
(an id's row may be on any of them), `decide` on the first, which takes every
decision from the shards' finds and writes its own map, and `settle` on each other
shard, which writes the rows given to its ids and forgets the ids evicted from its
rows. `train` runs the three in one place.

```python
import tensorflow as tf
from hybrid_strategy.tables import dynamic
remap = dynamic.Remap(capacity=4, devices=["/cpu:0"], min_count=2)
keys, counts = tf.constant([7, 9], tf.int64), tf.constant([2, 1], tf.int64)
print(remap.train(keys, counts, reset=lambda rows, keys: []).numpy())  # [ 0 -1]
```
"""

import collections

import numpy as np
import tensorflow as tf

from hybrid_strategy.tables import remap_ops
from hybrid_strategy.tables import sketch as sketch_lib
from hybrid_strategy.tables import step_lock
from hybrid_strategy.tables import table as table_lib

POLICIES = ("lru", "lfu")
ADMISSIONS = ("exact", "sketch")
_ROW, _COUNT, _LAST = 0, 1, 2  # of an id's state in a snapshot: [row, count, last]
_KEY = 0  # of a row's record: [key, count, last]
_STRING_BUCKETS = np.iinfo(np.int64).max
# A waiting id's map value packs its count (up to 2**31 - 1) and last step + 1 (up to
# 2**32 - 1): -1 - (count << 32 | last + 1), so -1 is an id never seen.
_LOW = 2**32


def keys_of(ids):
    """The remap's int64 keys of `ids`: int ids as they are, strings by a 63-bit hash.

    Strings share a key only if their 64-bit fingerprints agree modulo 2**63 - 1
    (odds about n**2 / 2**64 for n distinct strings).
    """
    if ids.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(ids, _STRING_BUCKETS)
    return tf.cast(ids, tf.int64)


def held_on(rows, shard, num_shards):
    """Which of `rows` (-1: none) shard `shard` of `num_shards` holds (rows k::S)."""
    if num_shards == 1:
        return rows >= 0
    return (rows >= 0) & tf.equal(rows % num_shards, shard)


def initial_rows(keys, dim, initializer, seed, dtype):
    """Each key's initial row: the same for a key whatever its row or worker.

    `initializer`: ("uniform", low, high), ("normal", mean, stddev) or
    ("constant", value), drawn from a hash of (seed, key, column).
    """
    kind, a, b = initializer
    if kind == "constant":
        return tf.fill(tf.stack([tf.size(keys), dim]), tf.cast(a, dtype))
    columns = tf.range(1, dim + 1, dtype=tf.int64) * np.int64(0x9E3779B97F4A7C1)
    mix, top_bits = remap_ops.mix, remap_ops.top_bits
    salted = tf.bitwise.bitwise_xor(tf.bitcast(mix(keys, seed), tf.int64)[:, None],
                                    columns[None, :])
    # 53 random bits per value, in (0, 1).
    uniform = (tf.cast(top_bits(mix(salted), 53), tf.float64) + 0.5) * 2.0 ** -53
    if kind == "uniform":
        values = a + (b - a) * uniform
    else:
        other = (tf.cast(top_bits(mix(salted, 0x5851F42D4C957F2D), 53), tf.float64)
                 + 0.5) * 2.0 ** -53
        values = a + b * tf.sqrt(-2.0 * tf.math.log(uniform)) * tf.cos(2.0 * np.pi * other)
    return tf.cast(values, dtype)


def _packed(row, count, last):
    """The map's value of ids: the row of those holding one, else the count and last step
    (one for all, or each id's) of a waiting id, packed (both saturate: a count at
    2**31 - 1, a step at 2**32 - 2)."""
    code = tf.minimum(count, 2**31 - 1) * _LOW + tf.clip_by_value(last + 1, 0, _LOW - 1)
    return tf.where(row >= 0, row, -1 - code)


def _waiting(value):
    """(count, last step) packed in map values; meaningful where the value is negative."""
    code = -1 - value
    return code // _LOW, code % _LOW - 1


def _exported(table):
    """Every id of a shard and its map value, with their static shapes."""
    keys, values = table.export()
    return tf.reshape(keys, [-1]), tf.reshape(values, [-1])


# A training step's decisions (`Remap.decide`): each distinct key's row (-1: none),
# per shard after the first the keys evicted from its rows, and the rows admitted ids
# were given, with their keys.
Decision = collections.namedtuple("Decision", "rows evicted admitted_rows admitted_keys")


class Remap(tf.__internal__.tracking.AutoTrackable):
    """The id -> row map of one dynamic table, and its admission and eviction state.

    Trackable, so that TensorFlow checkpoints of the layer holding it save it; not a
    `tf.Module`, whose variables tf_keras would count among the layer's weights.

    Args:
        capacity: Rows of the table (ids admitted at once), at least 1.
        devices: One device per shard of the map (the PS tasks, or one local device).
        min_count: Occurrences before an id is admitted (1: at first sight).
        policy: "lru" or "lfu": which rows go when rows run out.
        max_age: Steps without a sighting after which an id is evicted (None: never).
        max_waiting: Ids kept waiting for admission at most (None: the capacity);
            with a sketch, the ids it is sized for.
        headroom: Rows evicted beyond the shortfall, when rows run out (None:
            capacity // 8).
        admission: "exact": a waiting id's count in the first shard's map; "sketch":
            in a `sketch.WaitingSketch` beside it, of a fixed size.
        admission_error: With a sketch, the odds that an id is admitted before its
            `min_count`-th sighting, at most.
        name: A name for the state's variables.
    """

    def __init__(self, capacity, devices, min_count=1, policy="lru", max_age=None,
                 max_waiting=None, headroom=None, admission="exact", admission_error=0.01,
                 name="remap"):
        self.name = name
        self.capacity = int(capacity)
        self.devices = tuple(devices)
        self.min_count = int(min_count)
        self.policy = policy
        self.max_age = None if max_age is None else int(max_age)
        self.max_waiting = self.capacity if max_waiting is None else int(max_waiting)
        self.headroom = max(0, self.capacity // 8 if headroom is None else int(headroom))
        # MutableHashTable: TensorFlow's DenseHashTable never reclaims the buckets
        # of erased keys (evicted ids), and lookups of absent ids then fail.
        self.shards = []
        for k, device in enumerate(self.devices):
            with tf.device(device):
                self.shards.append(tf.lookup.experimental.MutableHashTable(
                    tf.int64, tf.int64, default_value=tf.constant(-1, tf.int64),
                    name=f"{name}_shard_{k}"))
        home, variable = self.devices[0], remap_ops.variable
        # Rows are popped from the end: 0, 1, 2, ... first.
        self.free = variable(tf.range(self.capacity - 1, -1, -1, dtype=tf.int64), home,
                             f"{name}_free")
        # One spare record at the end, written for ids without a row and never read.
        self.rows = variable(tf.fill([self.capacity + 1, 3], np.int64(-1)), home,
                             f"{name}_rows")
        self.num_free = variable(tf.constant(self.capacity, tf.int64), home,
                                 f"{name}_num_free")
        self.step = variable(tf.constant(0, tf.int64), home, f"{name}_step")
        self.admissions = variable(tf.constant(0, tf.int64), home, f"{name}_admissions")
        self.evictions = variable(tf.constant(0, tf.int64), home, f"{name}_evictions")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r}; use one of {ADMISSIONS}.")
        # Waiting ids are counted where the decisions are taken.
        self.sketch = None if admission == "exact" else sketch_lib.WaitingSketch(
            self.max_waiting, self.min_count, admission_error, home, name)
        # Concurrent steps (asynchronous training) take the decisions one at a time.
        self.lock = step_lock.StepLock(home, f"{name}_lock")

    # Reads -----------------------------------------------------------------------

    def find(self, shard, keys):
        """Shard `shard`'s map values of `keys`, found on its device: the rows it holds
        (-1 for other keys) and, on the first shard, waiting ids' counts."""
        with tf.device(self.devices[shard]):
            return tf.ensure_shape(self.shards[shard].lookup(keys), [None])

    def size(self, shard):
        """The ids shard `shard`'s map holds, read on its device."""
        with tf.device(self.devices[shard]):
            return self.shards[shard].size()

    def lookup(self, keys):
        """Each key's row, or -1 for keys not admitted; changes nothing."""
        rows = [tf.maximum(self.find(k, keys), -1) for k in range(len(self.shards))]
        return rows[0] if len(rows) == 1 else tf.reduce_max(tf.stack(rows), 0)

    def _state(self, values):
        """(row, count, last step) of ids whose map values are `values`: an admitted
        id's from its row's record."""
        row = tf.maximum(values, -1)
        held = self.rows.sparse_read(tf.where(row >= 0, row, self.capacity))
        count, last = _waiting(values)
        return (row, tf.where(row >= 0, held[:, _COUNT], count),
                tf.where(row >= 0, held[:, _LAST], last))

    def _map_values(self):
        """(keys, map values) of every id the map holds, all shards."""
        keys, values = [], []
        for table, device in zip(self.shards, self.devices):
            with tf.device(device):
                k, v = _exported(table)
                keys.append(k)
                values.append(v)
        return tf.concat(keys, 0), tf.concat(values, 0)

    def entries(self):
        """(keys, [row, count, last] values) of every id the remap holds, all shards."""
        keys, values = self._map_values()
        with tf.device(self.devices[0]):
            return keys, tf.stack(self._state(values), 1)

    def rows_in_use(self):
        """Rows held by admitted ids, per shard (each shard maps the ids of its rows)."""
        counts = []
        for table, device in zip(self.shards, self.devices):
            with tf.device(device):
                _, v = _exported(table)
                counts.append(tf.reduce_sum(tf.cast(v >= 0, tf.int64)))
        return tf.stack(counts)

    # The training step ---------------------------------------------------------------

    def train(self, distinct, counts, reset):
        """One training step's admission and eviction for the global batch's keys:
        `distinct` keys, each seen `counts` times (int64), every part in one place.

        `reset(rows, keys)` resets those rows (and their slots) to each key's initial
        values and returns the ops the rows' lookups must wait for. Returns each
        distinct key's row after the step's decisions (-1: not admitted), computed
        once for all replicas.
        """
        # The keys cross to the first shard once, before any op (a cond's branches among
        # them) would take them from where they were made.
        with tf.device(self.devices[0]):
            distinct, counts = tf.identity(distinct), tf.identity(counts)
        found = [self.find(k, distinct) for k in range(len(self.shards))]
        decision = self.decide(distinct, counts, found,
                               [self.size(k) for k in range(1, len(self.shards))])
        for k in range(1, len(self.shards)):
            self.settle(k, distinct, found[k], decision.rows, decision.evicted[k - 1])
        with tf.device(self.devices[0]), tf.control_dependencies(
                reset(decision.admitted_rows, decision.admitted_keys)):
            return tf.identity(decision.rows)

    def decide(self, distinct, counts, found, sizes):
        """Takes the step's decisions on the first shard's device, and writes its map.

        `distinct`: the global batch's distinct keys, each seen `counts` times; `found`:
        every shard's `find` of them; `sizes`: the other shards' map `size`s, read
        before the step's writes. Returns a `Decision`.
        """
        with tf.device(self.devices[0]):
            values = found[0]
            if len(found) > 1:
                elsewhere = tf.reduce_max(tf.stack(found[1:]), 0)
                values = tf.where(elsewhere >= 0, elsewhere, values)
            return self._decide(distinct, counts, values,
                                tf.add_n([self.shards[0].size(), *sizes]))

    def settle(self, shard, distinct, found, rows, evicted):
        """The step's writes of shard `shard` (not the first), on its device, after
        `decide`: maps the step's ids given one of its rows to their rows, and forgets
        the `evicted` keys. `found`: its `find` of `distinct`; `rows`: the decision's.
        Returns (the rows given, their keys)."""
        with tf.device(self.devices[shard]):
            given = tf.where((found < 0) & held_on(rows, shard, len(self.shards)))[:, 0]
            rows, keys = tf.gather(rows, given), tf.gather(distinct, given)
            self.shards[shard].remove(evicted)
            self.shards[shard].insert(keys, rows)
            return rows, keys

    def _decide(self, distinct, count, values, entries):
        # A step counts once its ids came: a call that finds its dataset at an end (of
        # unknown length) fails before then and counts no step.
        with tf.control_dependencies([distinct, count]):
            step = self.step.assign_add(1)
        new_to_map = tf.reduce_sum(tf.cast(tf.equal(values, -1), tf.int64))
        row, count_before, _ = self._state(values)
        if self.sketch is not None:  # waiting ids' counts: the sketch's
            waiting = tf.where(row < 0)
            count_before = tf.tensor_scatter_nd_update(
                count_before, waiting, self.sketch.estimate(tf.gather_nd(distinct, waiting)))
        count = count_before + count
        # Rows held before this step: seen now, so never evicted by its pass.
        seen = self._note_rows(row, distinct, count, step)
        wanting = tf.where((row < 0) & (count >= self.min_count))[:, 0]
        with tf.control_dependencies([seen]):
            shortfall = tf.size(wanting, out_type=tf.int64) - self.num_free.read_value()
        kept, evicted_keys, evicted_rows = self._evict(
            step, shortfall, entries + new_to_map, distinct, (row, count, step))
        with tf.control_dependencies([kept]):
            num_free = self.num_free.read_value()
        # Rows go to waiting ids in ascending key order, so that who gets one, and which,
        # depends on the step's ids and not on their order.
        wanting = tf.gather(wanting, tf.argsort(tf.gather(distinct, wanting), stable=True))
        num_admitted = tf.minimum(tf.size(wanting, out_type=tf.int64), num_free)
        admitted = wanting[:num_admitted]
        # The free stack's top, read without copying the stack.
        new_rows = self.free.sparse_read(num_free - 1 - tf.range(num_admitted))
        new_keys = tf.gather(distinct, admitted)
        # The step's writes: a tf.function runs them beside the lookups of its rows (which
        # wait for their reset only) and before the next step's reads.
        self.num_free.assign_sub(num_admitted, read_value=False)
        self.admissions.assign_add(num_admitted, read_value=False)
        self._note_rows(new_rows, new_keys, tf.gather(count, admitted), step)
        row = tf.tensor_scatter_nd_update(row, admitted[:, None], new_rows)
        is_admitted = tf.scatter_nd(admitted[:, None], tf.ones_like(admitted, tf.bool),
                                    tf.shape(distinct, out_type=tf.int64))
        # One write of the first shard's map: the step's ids still waiting (ids the pass
        # forgot stay out of it; with a sketch, they are counted there instead) and those
        # given one of its rows; admitted ids' counts and steps are in their rows' records.
        here = held_on(row, 0, len(self.shards))
        if self.sketch is None:
            written = tf.where((kept & (row < 0)) | (is_admitted & here))[:, 0]
        else:
            written = tf.where(is_admitted & here)[:, 0]
            self.sketch.add(tf.boolean_mask(distinct, row < 0),
                            tf.boolean_mask(count, row < 0))
        self.shards[0].insert(tf.gather(distinct, written), _packed(
            tf.gather(row, written), tf.gather(count, written), step))
        evicted = []
        if len(self.shards) > 1:
            if self.sketch is None:  # ids given a row of another shard wait no more here
                self.shards[0].remove(tf.boolean_mask(distinct, is_admitted & ~here))
            shard = tf.cast(evicted_rows % len(self.shards), tf.int32)
            evicted = tf.dynamic_partition(evicted_keys, shard, len(self.shards))[1:]
        return Decision(row, evicted, new_rows, new_keys)

    def _note_rows(self, rows, keys, counts, step):
        """Writes the records of `rows`; rows -1 land in the spare last record."""
        rows = tf.where(rows >= 0, rows, self.capacity)
        return self.rows.scatter_update(tf.IndexedSlices(
            tf.stack([keys, counts, tf.fill(tf.shape(keys), step)], 1), rows))

    def _evict(self, step, shortfall, entries, distinct, record):
        """The pass over the rows when rows run short, ids age or waiting ids outnumber
        `max_waiting` (`entries`: the ids the maps will hold before it). Returns which
        of the step's `distinct` ids stay in the map (all but those forgotten while
        waiting), and the keys and rows of the ids evicted from other shards' rows (the
        first shard forgets its own). Waiting ids are only in the first shard's map: it
        is exported, with the step's `record` of its ids ((rows, counts, this step),
        written first), when some of them may go (they age, or are too many). With a
        sketch, no waiting id is in a map (`forget` None)."""
        due, forget = shortfall > 0, None
        if self.sketch is None:
            waiting = entries - (self.capacity - self.num_free.read_value())
            forget = waiting > self.max_waiting
            due |= forget
        if self.max_age is not None:
            aging = tf.equal(step % (self.max_age // 4 + 1), 0)
            if forget is not None:
                forget |= aging & (waiting > 0)
            due |= aging
        none = tf.zeros([0], tf.int64)
        return remap_ops.rarely(
            due, lambda: self._evict_now(step, shortfall, forget, distinct, record),
            lambda: (tf.ones_like(distinct, tf.bool), none, none))

    def _evict_now(self, step, shortfall, forget, distinct, record):
        rows = self.rows.read_value()[:self.capacity]
        key, count, last = rows[:, _KEY], rows[:, _COUNT], rows[:, _LAST]
        admitted = last >= 0
        gone = tf.zeros_like(admitted)
        if self.max_age is not None:
            gone = admitted & (last < step - self.max_age)
        # Rows of ids not seen this step, by policy, as many as the shortfall needs.
        needed = tf.maximum(shortfall + self.headroom, 0) * tf.cast(shortfall > 0, tf.int64)
        needed = tf.maximum(needed - tf.reduce_sum(tf.cast(gone, tf.int64)), 0)
        first, second = (last, count) if self.policy == "lru" else (count, last)
        gone |= self._lowest(key, admitted & (last < step) & ~gone, first, second, needed)
        freed = tf.where(gone)[:, 0]
        num_freed = tf.size(freed, out_type=tf.int64)
        num_free = self.num_free.read_value()
        freed_keys = tf.gather(key, freed)
        here = held_on(freed, 0, len(self.shards))
        ops = [self.free.scatter_update(tf.IndexedSlices(freed, num_free + tf.range(num_freed))),
               self.num_free.assign_add(num_freed, read_value=False),
               self.evictions.assign_add(num_freed, read_value=False),
               self.rows.scatter_update(tf.IndexedSlices(
                   tf.fill(tf.stack([num_freed, 3]), np.int64(-1)), freed)),
               self.shards[0].remove(tf.boolean_mask(freed_keys, here))]
        with tf.control_dependencies(ops):
            kept = tf.ones_like(distinct, tf.bool)
            if forget is not None:
                kept = tf.cond(forget, lambda: self._forget_waiting(step, distinct, record),
                               lambda: kept)
        return kept, tf.boolean_mask(freed_keys, ~here), tf.boolean_mask(freed, ~here)

    def _forget_waiting(self, step, distinct, record):
        """Forgets waiting ids unseen for `max_age` steps, and the oldest when they
        outnumber `max_waiting`, down to half of it; returns which of `distinct` stay."""
        waiting = record[0] < 0
        home = self.shards[0]
        with tf.control_dependencies([home.insert(tf.boolean_mask(distinct, waiting), _packed(
                tf.boolean_mask(record[0], waiting), tf.boolean_mask(record[1], waiting),
                record[2]))]):
            keys, values = _exported(home)
        waiting = values < 0
        count, last = _waiting(values)
        gone = tf.zeros_like(waiting)
        if self.max_age is not None:
            gone = waiting & (last < step - self.max_age)
        waiting &= ~gone
        excess = tf.reduce_sum(tf.cast(waiting, tf.int64)) - self.max_waiting // 2
        excess *= tf.cast(tf.reduce_sum(tf.cast(waiting, tf.int64)) > self.max_waiting,
                          tf.int64)
        gone |= self._lowest(keys, waiting, last, count, excess)
        with tf.control_dependencies([home.remove(tf.boolean_mask(keys, gone))]):
            return tf.not_equal(home.lookup(distinct), -1)

    @staticmethod
    def _lowest(keys, eligible, first, second, n):
        """A mask of the `n` eligible entries lowest by (first, second, key).

        `first` and `second` are counts or step numbers (at least 0), compared up to
        2**31 - 1: beyond it, entries tie and their keys decide.
        """
        index = tf.where(eligible)[:, 0]
        k = tf.minimum(n, tf.size(index, out_type=tf.int64))

        def chosen():
            cap = tf.constant(2**31 - 1, tf.int64)
            packed = (tf.minimum(tf.gather(first, index), cap) * 2**32
                      + tf.minimum(tf.gather(second, index), cap))
            # A partial sort finds the k-th lowest value; keys decide only among the
            # entries that share it.
            lowest = tf.math.top_k(-packed, k=tf.cast(k, tf.int32), sorted=False).values
            kth = -tf.reduce_min(lowest)
            below = tf.boolean_mask(index, packed < kth)
            tied = tf.boolean_mask(index, tf.equal(packed, kth))
            tied = tf.gather(tied, tf.argsort(tf.gather(keys, tied), stable=True))
            return tf.concat([below, tied[:k - tf.size(below, out_type=tf.int64)]], 0)

        picked = tf.cond(k > 0, chosen, lambda: tf.zeros([0], tf.int64))
        return tf.scatter_nd(picked[:, None], tf.ones_like(picked, tf.bool),
                             tf.shape(keys, out_type=tf.int64))

    # Snapshots -------------------------------------------------------------------
    #
    # One snapshot for the whole map: every id with its row, count and last step,
    # the free rows and the counters, whatever the number of shards, so that it
    # restores onto another number of PS tasks. TensorFlow checkpoints save the
    # snapshot, not the shards; SavedModels hold the shards, which serving reads.

    def _snapshot_tensors(self):
        keys, values = self.entries()
        tensors = {"keys": keys, "values": values,
                   "free": self.free[:self.num_free.read_value()],
                   "counters": tf.stack([self.step.read_value(), self.admissions.read_value(),
                                         self.evictions.read_value()])}
        if self.sketch is not None:
            tensors.update(self.sketch.state())
        return tensors

    def snapshot(self):
        """Every key and its [row, count, last], the free rows and counters, as numpy."""
        return {name: value.numpy() for name, value in self._snapshot_tensors().items()}

    def restore(self, snapshot):
        """Replaces the map's state with `snapshot`'s (numpy arrays or tensors), over
        this map's shards, whose number may differ from the saving map's. Runs in
        eager mode and in a tf.function (restores on a cluster)."""
        if self.sketch is None and "sketch" in snapshot:
            raise ValueError(f"{self.name}: the snapshot holds an admission sketch: it was "
                             "saved with admission='sketch'; restore it into such a table.")
        with tf.device(self.devices[0]):
            values = tf.reshape(tf.convert_to_tensor(snapshot["values"], tf.int64), [-1, 3])
            free = tf.convert_to_tensor(snapshot["free"], tf.int64)
            counters = tf.convert_to_tensor(snapshot["counters"], tf.int64)
            fits = tf.debugging.assert_less(
                tf.reduce_max(tf.concat([values[:, _ROW], free, [-1]], 0)),
                tf.constant(self.capacity, tf.int64),
                message=f"The snapshot holds rows beyond this table's capacity "
                        f"{self.capacity}: restore it into a table of its capacity.")
            with tf.control_dependencies([fits]):
                keys = tf.convert_to_tensor(snapshot["keys"], tf.int64)
                packed = _packed(values[:, _ROW], values[:, _COUNT], values[:, _LAST])
                # An admitted id's entry goes beside its row, a waiting id's to the first
                # shard.
                shard = tf.cast(tf.where(values[:, _ROW] >= 0,
                                         values[:, _ROW] % len(self.shards), 0), tf.int32)
                parts = zip(tf.dynamic_partition(keys, shard, len(self.shards)),
                            tf.dynamic_partition(packed, shard, len(self.shards)))
                writes = []
                for table, device, (part_keys, part_values) in zip(self.shards, self.devices,
                                                                   parts):
                    with tf.device(device):
                        with tf.control_dependencies([table.remove(_exported(table)[0])]):
                            writes.append(table.insert(part_keys, part_values))
                held = tf.where(values[:, _ROW] >= 0)[:, 0]
                record = tf.stack([keys, values[:, _COUNT], values[:, _LAST]], 1)
                writes.append(self.rows.assign(tf.tensor_scatter_nd_update(
                    tf.fill([self.capacity + 1, 3], np.int64(-1)),
                    tf.gather(values[:, _ROW], held)[:, None], tf.gather(record, held)),
                    read_value=False))
                stack = tf.concat([free, tf.zeros([self.capacity - tf.size(free)], tf.int64)], 0)
                writes += [self.free.assign(stack, read_value=False),
                           self.num_free.assign(tf.size(free, out_type=tf.int64),
                                                read_value=False)]
                writes += [v.assign(counters[i], read_value=False) for i, v in enumerate(
                    (self.step, self.admissions, self.evictions))]
                if self.sketch is not None:
                    writes.append(self.sketch.restore(snapshot))
            return tf.group(writes)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type == "checkpoint":
            return {}
        return super()._trackable_children(save_type, **kwargs)

    def _serialize_to_tensors(self):
        if table_lib.exporting():  # a SavedModel: its shards save themselves
            return {}
        return self._snapshot_tensors()

    def _restore_from_tensors(self, restored_tensors):
        if not restored_tensors:  # traced for a SavedModel, which saved none
            return tf.no_op()
        return self.restore(restored_tensors)
