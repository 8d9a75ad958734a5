"""Cost on a PS of the hash tables a dynamic vocabulary could use, against today's row gather.

    python -m benchmarks.dynamic_table_cost [--rows 100000 1000000] [--batches 1000 8000]

For every table size N, a local cluster of 1 worker + 1 ps (`python -m
hybrid_strategy.launch`) runs this file as its chief (`--chief`). The chief builds, on the
ps (`/job:ps/replica:0/task:0/device:CPU:0`), tables of N rows x 64 float32 keyed by N
distinct random int64 ids (and by their decimal strings), reading the ps's VmRSS before
and after each, and then times tf.functions that run wholly on the ps, for batches of B
unique ids:

  today        `gather`: tf.gather of a resource variable (today's PS lookup);
               `scatter_add`: resource scatter-add of B rows (today's row update);
  design A     a hash table keyed by id whose value is the row:
               MutableHashTable (`mht_*`) and DenseHashTable (`dht_*`, empty key -1,
               deleted key -2) int64 -> float[64]: lookup of existing ids; lookup of
               half existing, half new ids with per-id defaults (MutableHashTable's
               `dynamic_default_values`; DenseHashTable has none: a NaN default row and
               tf.where stand in); insert of existing ids (an update); admission and
               eviction of B new ids (insert, then remove them: the table stays at N, as
               under a capacity); export of the whole table (a checkpoint's snapshot);
  design B     a fixed-capacity id -> row remap in front of today's row table:
               MutableHashTable or DenseHashTable int64 -> int64 (`remap_mht_*`,
               `remap_dht_*`) and tf.string -> int64 (`remap_str_mht_*`,
               `remap_str_dht_*`): lookup (remap, then tf.gather of the rows); admission
               and eviction of B new ids (rows popped from a free list, mappings
               inserted, the rows reset to their initial values, the row -> id record
               written; then the ids removed and the rows pushed back); export of the
               remap (the row table is saved as today's).

Each timed call runs `--inner` batches one after the other (each batch's ops wait for the
previous batch's), so the call's fixed cost (the chief -> ps round trip, measured as
`call`) is spread over them; a batch's cost is (call - `call`'s) / inner. The functions
run in alternating blocks (benchmarks.machine.alternate), so load from elsewhere falls on
all of them alike. Every call returns an integer checksum of what it looked up or
inserted, checked against the ids and values put in; before timing, each operation's
values for one batch are compared with what was inserted, and after timing the tables
and the scatter-added rows are checked again: a wrong value fails the run with the
values. Results: benchmarks/results/dynamic_table_cost.json and .md.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time

from benchmarks import chief_runs
from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
PS = "/job:ps/replica:0/task:0/device:CPU:0"
DIM = 64
EMPTY, DELETED = -1, -2  # DenseHashTable's reserved int64 keys (ids are >= 0)
EMPTY_STR, DELETED_STR = "", "-"  # and string keys (decimal ids never equal these)
CHUNK = 8192  # rows per insert while building a table (small: RSS deltas count freed chunks)
_RESULT_PREFIX = "dynamic_table_cost result: "

# name: (design, what one batch does). Per batch of B ids; exports are per table.
OPERATIONS = {
    "call": ("-", "the chief calls a function on the ps that reads a scalar: the fixed "
                  "cost of a call, subtracted from the others"),
    "gather": ("today", "tf.gather of B rows of a resource variable"),
    "scatter_add": ("today", "resource scatter-add of B rows"),
    "mht_lookup": ("A", "MutableHashTable int64 -> float[64]: lookup of B existing ids"),
    "mht_lookup_default": ("A", "the same, B/2 existing and B/2 new ids, with "
                                "dynamic_default_values"),
    "mht_insert_existing": ("A", "the same: insert of B existing ids (an update)"),
    "mht_admit_evict": ("A", "the same: insert of B new ids, then their removal"),
    "dht_lookup": ("A", "DenseHashTable int64 -> float[64]: lookup of B existing ids"),
    "dht_lookup_default": ("A", "the same, B/2 existing and B/2 new ids, per-id defaults "
                                "by tf.where on a NaN default row"),
    "dht_insert_existing": ("A", "the same: insert of B existing ids (an update)"),
    "dht_admit_evict": ("A", "the same: insert of B new ids, then their removal"),
    "remap_mht_lookup": ("B", "MutableHashTable int64 -> int64 remap lookup + tf.gather"),
    "remap_mht_admit_evict": ("B", "the same remap: B new ids admitted (free rows popped, "
                                   "mappings inserted, rows reset, row -> id written), "
                                   "then evicted (mappings removed, rows pushed back)"),
    "remap_dht_lookup": ("B", "DenseHashTable int64 -> int64 remap lookup + tf.gather"),
    "remap_dht_admit_evict": ("B", "the same remap: admission and eviction of B new ids"),
    "remap_str_mht_lookup": ("B", "MutableHashTable string -> int64 remap lookup + "
                                  "tf.gather"),
    "remap_str_mht_admit_evict": ("B", "the same remap: admission and eviction of B new "
                                       "ids"),
    "remap_str_dht_lookup": ("B", "DenseHashTable string -> int64 remap lookup + "
                                  "tf.gather"),
    "remap_str_dht_admit_evict": ("B", "the same remap: admission and eviction of B new "
                                       "ids"),
}
EXPORTS = {
    "mht_export": ("A", "MutableHashTable int64 -> float[64]: export of every key and value"),
    "dht_export": ("A", "DenseHashTable int64 -> float[64]: export of every bucket"),
    "remap_mht_export": ("B", "MutableHashTable int64 -> int64 remap: export"),
    "remap_dht_export": ("B", "DenseHashTable int64 -> int64 remap: export"),
    "remap_str_mht_export": ("B", "MutableHashTable string -> int64 remap: export"),
}
TABLES = {
    "row table": "resource variable of N + spare rows x 64 float32 (today's table; design "
                 "B's rows, spare rows for admission)",
    "scatter-add target": "resource variable of N x 64 float32",
    "mht": "MutableHashTable int64 -> float[64], N ids",
    "dht": "DenseHashTable int64 -> float[64], N ids",
    "remap_mht": "MutableHashTable int64 -> int64, N ids",
    "remap_dht": "DenseHashTable int64 -> int64, N ids",
    "remap_str_mht": "MutableHashTable string -> int64, N ids",
    "remap_str_dht": "DenseHashTable string -> int64, N ids",
}


# Chief ------------------------------------------------------------------------------


def _ids(rows, fresh, seed=0):
    """`rows` ids in the table and `fresh` ids never in it: distinct int64 in [0, 2^62)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    total = rows + fresh
    ids = np.unique(rng.integers(0, 2 ** 62, size=total + total // 100 + 16, dtype=np.int64))
    ids = rng.permutation(ids)[:total]
    if len(ids) < total:
        raise RuntimeError("drew too few distinct ids")
    return ids[:rows], ids[rows:]


def _buckets(entries):
    """DenseHashTable buckets for `entries` below its load factor 0.8: a power of two."""
    buckets = 1
    while buckets * 0.8 < entries:
        buckets *= 2
    return buckets


def _vm_rss(pid):
    """VmRSS of process `pid`, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for {pid}")


class Failed(AssertionError):
    pass


def _settle(tf, *things):
    """Waits until eager writes from here to the ps (a variable's creation or assign, a
    table's creation) have run there. The chief's eager ops on the ps are not ordered
    with the tf.functions it calls next: without this, a function can read a variable
    before an assign made just before its call."""
    with tf.device(PS):
        for thing in things:
            if callable(getattr(thing, "export", None)):
                thing.size().numpy()
            else:
                tf.reshape(thing.read_value(), [-1])[:1].numpy()


def _same(name, got, expected):
    import numpy as np  # pylint: disable=import-outside-toplevel

    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape or not np.array_equal(got, expected):
        bad = (np.argwhere(got != expected)[:3].tolist() if got.shape == expected.shape
               else "shapes differ")
        raise Failed(f"{name}: wrong values: got shape {got.shape} {got.ravel()[:8]}, "
                     f"expected shape {expected.shape} {expected.ravel()[:8]}; first "
                     f"differences at {bad}")


class Tables:
    """The tables of one size N on the ps, with the per-row values they hold: row p of
    every table holds id p (keys[p], or its decimal string) and value
    float32(64 p + j) in column j (design B: row p)."""

    def __init__(self, tf, rows, spare, keys, ps_pid):
        self.tf, self.rows, self.spare = tf, rows, spare
        self.capacity = rows + spare
        self.rss, self.build_s = {}, {}
        self.ps_pid = ps_pid

        def built(name, make):
            before = _vm_rss(ps_pid)
            start = time.perf_counter()
            with tf.device(PS):
                value = make()
            _settle(tf, value)
            self.build_s[name] = time.perf_counter() - start
            self.rss[name] = {"before_mib": before, "after_mib": _vm_rss(ps_pid)}
            return value

        with tf.device(PS):
            self.keys = tf.Variable(keys)
            self.str_keys = tf.Variable(tf.strings.as_string(self.keys))
        _settle(tf, self.keys, self.str_keys)
        self.rss["start_mib"] = _vm_rss(ps_pid)

        def row_table():
            return tf.Variable(tf.range(self.capacity, dtype=tf.float32)[:, None] * float(DIM)
                               + tf.range(DIM, dtype=tf.float32)[None, :])

        def zeros():
            return tf.Variable(tf.zeros([rows, DIM]))

        self.values = built("row table", row_table)
        self.added = built("scatter-add target", zeros)
        self.mht = built("mht", lambda: self._filled(tf.lookup.experimental.MutableHashTable(
            tf.int64, tf.float32, default_value=tf.zeros([DIM])), self.keys, "rows"))
        self.dht = built("dht", lambda: self._filled(tf.lookup.experimental.DenseHashTable(
            tf.int64, tf.float32, default_value=tf.fill([DIM], float("nan")),
            empty_key=EMPTY, deleted_key=DELETED,
            initial_num_buckets=_buckets(rows + spare)), self.keys, "rows"))
        self.remap_mht = built("remap_mht", lambda: self._filled(
            tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=-1),
            self.keys, "index"))
        self.remap_dht = built("remap_dht", lambda: self._filled(
            tf.lookup.experimental.DenseHashTable(
                tf.int64, tf.int64, default_value=-1, empty_key=EMPTY, deleted_key=DELETED,
                initial_num_buckets=_buckets(rows + spare)), self.keys, "index"))
        self.remap_str_mht = built("remap_str_mht", lambda: self._filled(
            tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1),
            self.str_keys, "index"))
        self.remap_str_dht = built("remap_str_dht", lambda: self._filled(
            tf.lookup.experimental.DenseHashTable(
                tf.string, tf.int64, default_value=-1, empty_key=EMPTY_STR,
                deleted_key=DELETED_STR, initial_num_buckets=_buckets(rows + spare)),
            self.str_keys, "index"))
        with tf.device(PS):
            # Design B's bookkeeping: free rows (a stack), the id of every row.
            self.free = tf.Variable(tf.range(rows, self.capacity, dtype=tf.int64))
            self.top = tf.Variable(tf.constant(spare, tf.int64))
            self.row_ids = tf.Variable(tf.concat(
                [self.keys, tf.fill([spare], tf.constant(EMPTY, tf.int64))], 0))
            self.row_str_ids = tf.Variable(tf.concat(
                [self.str_keys, tf.fill([spare], EMPTY_STR)], 0))
        _settle(tf, self.free, self.top, self.row_ids, self.row_str_ids)
        self.rss["end_mib"] = _vm_rss(ps_pid)

    def _filled(self, table, keys, kind):
        """`table` with keys[p] -> row p (kind "rows") or p ("index"), in chunks."""
        tf = self.tf
        _settle(tf, table)

        @tf.function
        def insert(start, size):
            with tf.device(PS):
                index = tf.range(start, start + size)
                chunk = tf.gather(keys, index)
                value = tf.gather(self.values, index) if kind == "rows" else index
                table.insert(chunk, value)
                return table.size()

        for start in range(0, self.rows, CHUNK):
            size = min(CHUNK, self.rows - start)
            got = int(insert(tf.constant(start, tf.int64), tf.constant(size, tf.int64)))
            if got != start + size:
                raise Failed(f"building {table.name}: size {got} after inserting "
                             f"{start + size} distinct ids")
        return table


def _operations(tf, t, batch, inner, positions, fresh):
    """{name: (timed function, expected checksum per call, check function)}.

    Batch i looks up the ids of rows positions[i] (unique) and admits fresh[i] (ids in
    no table); the half-new lookups take positions[i][:B/2] and the other half of
    fresh[i]'s ids beyond the admitted ones (never inserted).
    """
    import numpy as np  # pylint: disable=import-outside-toplevel

    half = batch // 2
    with tf.device(PS):
        pos = [tf.Variable(p) for p in positions]
        ids = [tf.Variable(tf.gather(t.keys, p)) for p in pos]
        str_ids = [tf.Variable(tf.gather(t.str_keys, p)) for p in pos]
        new = [tf.Variable(f[:batch]) for f in fresh]
        str_new = [tf.Variable(tf.strings.as_string(n)) for n in new]
        mixed = [tf.Variable(tf.concat([i[:half], f[batch:batch + batch - half]], 0))
                 for i, f in zip(ids, fresh)]
        # Per-id defaults, the values of admitted ids: -(b + 1) in every column.
        defaults = tf.Variable(tf.tile(-tf.range(1, batch + 1, dtype=tf.float32)[:, None],
                                       [1, DIM]))
        ones = tf.Variable(tf.ones([batch, DIM]))
        updates = [tf.Variable(tf.gather(t.values, p)) for p in pos]
        marker = tf.Variable(0.0)
    _settle(tf, *pos, *ids, *str_ids, *new, *str_new, *mixed, defaults, ones, *updates,
            marker)
    row_values = [(p[:, None] * DIM).astype(np.float32) + np.arange(DIM, dtype=np.float32)
                  for p in positions]
    default_values = np.tile(-np.arange(1, batch + 1, dtype=np.float32)[:, None], [1, DIM])
    column0 = [int((p * DIM).sum()) for p in positions]
    mixed_column0 = [int((p[:half] * DIM).sum()) - sum(range(half + 1, batch + 1))
                     for p in positions]

    def checksum(values):
        return tf.reduce_sum(tf.cast(values[:, 0], tf.int64))

    def timed(body):
        @tf.function
        def run():
            with tf.device(PS):
                total = tf.constant(0, tf.int64)
                for i in range(inner):
                    with tf.control_dependencies([total]):
                        total = total + body(i, False)[0]
                return total
        return run

    def checked(body):
        @tf.function
        def run():
            with tf.device(PS):
                return body(0, True)[1]
        return run

    def dense_default(values, i):
        """DenseHashTable's missing ids (NaN rows) given their per-id defaults."""
        return tf.where(tf.math.is_nan(values[:, :1]), defaults, values)

    ops = {}

    def add(name, body, expected, check_values):
        ops[name] = (timed(body), expected, checked(body), check_values)

    def call(i, check):
        return tf.cast(marker.read_value(), tf.int64), None

    add("call", call, 0, None)

    def gather(i, check):
        values = tf.gather(t.values, pos[i])
        return checksum(values), values

    add("gather", gather, sum(column0), row_values[0])

    def scatter_add(i, check):
        t.added.scatter_add(tf.IndexedSlices(ones, pos[i]))
        return tf.constant(1, tf.int64), None

    add("scatter_add", scatter_add, inner, None)

    for prefix, table in (("mht", t.mht), ("dht", t.dht)):
        def lookup(i, check, table=table):
            values = table.lookup(ids[i])
            return checksum(values), values

        def lookup_default(i, check, table=table, prefix=prefix):
            if prefix == "mht":
                values = table.lookup(mixed[i], dynamic_default_values=defaults)
            else:
                values = dense_default(table.lookup(mixed[i]), i)
            return checksum(values), values

        def insert_existing(i, check, table=table):
            table.insert(ids[i], updates[i])
            size = table.size()
            return size, (table.lookup(ids[i]) if check else None)

        def admit_evict(i, check, table=table):
            table.insert(new[i], defaults)
            size = table.size()
            values = table.lookup(new[i]) if check else None
            with tf.control_dependencies([size] + ([values] if check else [])):
                table.remove(new[i])
            return size, values

        add(f"{prefix}_lookup", lookup, sum(column0), row_values[0])
        add(f"{prefix}_lookup_default", lookup_default, sum(mixed_column0),
            np.concatenate([row_values[0][:half], default_values[half:]]))
        add(f"{prefix}_insert_existing", insert_existing, inner * t.rows, row_values[0])
        add(f"{prefix}_admit_evict", admit_evict, inner * (t.rows + batch), default_values)

    for prefix, remap, keys, new_keys, row_ids in (
            ("remap_mht", t.remap_mht, ids, new, t.row_ids),
            ("remap_dht", t.remap_dht, ids, new, t.row_ids),
            ("remap_str_mht", t.remap_str_mht, str_ids, str_new, t.row_str_ids),
            ("remap_str_dht", t.remap_str_dht, str_ids, str_new, t.row_str_ids)):
        def remap_lookup(i, check, remap=remap, keys=keys):
            values = tf.gather(t.values, remap.lookup(keys[i]))
            return checksum(values), values

        def remap_admit_evict(i, check, remap=remap, new_keys=new_keys, row_ids=row_ids):
            top = t.top.read_value()
            slots = tf.range(top - batch, top)
            rows = tf.gather(t.free, slots)                          # free rows popped
            with tf.control_dependencies([rows]):
                t.top.assign_sub(batch)
            remap.insert(new_keys[i], rows)                          # mappings
            t.values.scatter_update(tf.IndexedSlices(defaults, rows))  # rows reset
            row_ids.scatter_update(tf.IndexedSlices(new_keys[i], rows))
            size = remap.size()
            values = tf.gather(t.values, remap.lookup(new_keys[i])) if check else None
            # Eviction of the same rows: their ids' mappings removed, rows pushed back.
            with tf.control_dependencies([size] + ([values] if check else [])):
                evicted = tf.gather(row_ids, rows)
                remap.remove(evicted)
                t.free.scatter_update(tf.IndexedSlices(rows, slots))
                t.top.assign_add(batch)
            return size, values

        add(f"{prefix}_lookup", remap_lookup, sum(column0), row_values[0])
        add(f"{prefix}_admit_evict", remap_admit_evict, inner * (t.rows + batch),
            default_values)
    return ops, pos, updates, row_values


def _exports(tf, t):
    """{name: (timed function, expected checksum, check function, expected check)}.

    The timed function exports the table and counts its real keys (DenseHashTable
    exports every bucket, empty and deleted ones too); the check sums, over the real
    keys, column 0 of the values (64 p for row p) or the row (p)."""
    n = t.rows

    def real(keys):
        keys = tf.reshape(keys, [-1])
        if keys.dtype == tf.string:
            return tf.logical_and(keys != EMPTY_STR, keys != DELETED_STR)
        return keys >= 0

    def exported(table):
        @tf.function
        def run():
            with tf.device(PS):
                keys, _ = table.export()
                return tf.reduce_sum(tf.cast(real(keys), tf.int64))

        @tf.function
        def check():
            with tf.device(PS):
                keys, values = table.export()
                mask = real(keys)
                values = tf.reshape(values, [tf.size(mask), -1])[:, 0]
                return tf.reduce_sum(tf.cast(tf.boolean_mask(values, mask), tf.int64))
        return run, check

    out = {}
    for name, table, per_row in (("mht_export", t.mht, DIM), ("dht_export", t.dht, DIM),
                                 ("remap_mht_export", t.remap_mht, 1),
                                 ("remap_dht_export", t.remap_dht, 1),
                                 ("remap_str_mht_export", t.remap_str_mht, 1)):
        run, check = exported(table)
        out[name] = (run, n, check, per_row * n * (n - 1) // 2)
    return out


def _timed_results(results, name, expected):
    """Raises unless every call of `name` returned `expected`."""
    got = [int(r) for r in results]
    wrong = [(k, g) for k, g in enumerate(got) if g != expected]
    if wrong:
        raise Failed(f"{name}: {len(wrong)} of {len(got)} calls returned the wrong checksum "
                     f"(call, got) {wrong[:5]}; expected {expected}")
    return len(got)


def _time(ops, pids, options, calls):
    """machine.alternate over `ops` ({name: (function, expected, ...)}), every call's
    result kept and checked. {name: {"calls_checked", "wall_s_per_call", ...}}."""
    results = {name: [] for name in ops}

    def keeping(name, function):
        def call():
            out = function()
            results[name].append(out)
            return out
        return call

    functions = {name: keeping(name, op[0]) for name, op in ops.items()}
    for call in functions.values():  # traces, and runs past the first calls' costs
        for _ in range(options.warmup):
            call()
    timed = machine.alternate(functions, pids, calls, options.rounds, wait=lambda r: r.numpy())
    for name, op in ops.items():
        timed[name]["calls_checked"] = _timed_results(results[name], name, op[1])
    return timed


def run_chief(options):
    """Runs as the launcher's chief: one table size, every batch size; one result line."""

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    hybrid_strategy.HybridStrategy()  # connects this process to the cluster
    servers = machine.server_pids()
    ps_pid = servers["ps0"]
    pids = {"ps0": ps_pid, "chief": os.getpid()}
    rows, inner = options.rows[0], options.inner
    largest = max(options.batches)
    # Ids for the admissions (B per batch) and the never-inserted half of the half-new
    # lookups (B/2 more), every batch its own.
    keys, fresh = _ids(rows, 2 * largest * inner)
    started = time.perf_counter()
    tables = Tables(tf, rows, spare=largest, keys=keys, ps_pid=ps_pid)
    build_s = time.perf_counter() - started
    rng = np.random.default_rng(1)
    per_batch = []
    for batch in options.batches:
        positions = [rng.choice(rows, size=batch, replace=False).astype(np.int64)
                     for _ in range(inner)]
        fresh_batches = [fresh[(2 * i) * largest:(2 * i) * largest + 2 * batch]
                         for i in range(inner)]
        ops, pos, updates, row_values = _operations(tf, tables, batch, inner, positions,
                                                    fresh_batches)
        checks = {}
        for name, (_, _, check, expected) in ops.items():
            if expected is not None:
                _same(f"{name} (N={rows}, B={batch})", check().numpy(), expected)
                checks[name] = "values equal"
        # insert_existing must write: a changed row is read back, then the old one.
        for name in ("mht_insert_existing", "dht_insert_existing"):
            original = updates[0].read_value()
            updates[0].assign(original + 0.5)
            _settle(tf, updates[0])
            _same(f"{name} writes", ops[name][2]().numpy(), row_values[0] + np.float32(0.5))
            updates[0].assign(original)
            _settle(tf, updates[0])
            _same(f"{name} restores", ops[name][2]().numpy(), row_values[0])
            checks[name] = "values equal; a changed row read back"
        before = tables.added.numpy()[positions[0]]
        timed = _time(ops, pids, options, options.calls)
        # Every scatter-add call added 1 to each row of each of its batches.
        counts = np.zeros(rows, np.int64)
        for p in positions:
            counts[p] += 1
        scatter_calls = timed["scatter_add"]["calls_checked"]
        total_calls = sum(o["calls_checked"] for o in timed.values())
        _same(f"scatter_add (N={rows}, B={batch}) rows after {scatter_calls} calls",
              tables.added.numpy()[positions[0]] - before,
              np.repeat((counts[positions[0]] * scatter_calls)[:, None], DIM, 1)
              .astype(np.float32))
        checks["scatter_add"] = "rows hold the sum of every call's adds"
        # The tables still hold what was inserted (admissions were evicted again).
        for name in ("mht_lookup", "dht_lookup", "remap_mht_lookup", "remap_dht_lookup",
                     "remap_str_mht_lookup", "remap_str_dht_lookup"):
            _same(f"{name} after timing", ops[name][2]().numpy(), row_values[0])
        per_batch.append({"batch": batch, "checks": checks, "calls_per_block": options.calls,
                          "calls": total_calls, "operations": timed})
        del ops, pos, updates
    exports = _exports(tf, tables)
    export_checks = {}
    for name, (_, _, check, expected) in exports.items():
        got = int(check())
        if got != expected:
            raise Failed(f"{name}: the exported values' checksum is {got}, expected "
                         f"{expected}")
        export_checks[name] = "every key exported with its value"
    timed_exports = _time(exports, pids, options, options.export_calls)
    ps_rss_end = _vm_rss(ps_pid)
    print(_RESULT_PREFIX + json.dumps({
        "rows": rows, "dim": DIM, "inner": inner, "spare_rows": largest,
        "build_s": tables.build_s, "tables_build_s": build_s,
        "rss_mib": tables.rss, "ps_rss_end_mib": ps_rss_end,
        "dense_buckets": _buckets(rows + largest),
        "batches": per_batch,
        "exports": {"checks": export_checks, "operations": timed_exports}}), flush=True)


# Runs --------------------------------------------------------------------------------


def _command(options, rows):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "1", "--ps", "1",
            "--", sys.executable, "-m", "benchmarks.dynamic_table_cost", "--chief",
            "--rows", str(rows), "--batches", *map(str, options.batches),
            "--inner", str(options.inner), "--calls", str(options.calls),
            "--export-calls", str(options.export_calls), "--rounds", str(options.rounds),
            "--warmup", str(options.warmup)]


def _shown(command):
    split = command.index("--")
    return shlex.join(["python"] + command[1:split + 1] + ["python"] + command[split + 2:])


def _summary(timed, inner, floor, cpu_floor):
    """Median µs per call; per batch net of the call floor; the ps's CPU per batch, net
    of an empty call's."""
    median = statistics.median(timed["wall_s_per_call"]) * 1e6
    return {"median_us_per_call": median,
            "us_per_batch": (median - floor) / inner,
            "ps_cpu_us_per_batch": (timed["cpu_s_per_call"]["ps0"] * 1e6 - cpu_floor) / inner,
            "calls_checked": timed["calls_checked"]}


def summarize(run):
    """Adds per-batch figures and ratios to one size's result."""
    for entry in run["batches"]:
        ops = entry["operations"]
        floor = statistics.median(ops["call"]["wall_s_per_call"]) * 1e6
        cpu_floor = ops["call"]["cpu_s_per_call"]["ps0"] * 1e6
        entry["call_floor_us"], entry["call_floor_ps_cpu_us"] = floor, cpu_floor
        entry["figures"] = {name: _summary(o, run["inner"], floor, cpu_floor)
                            for name, o in ops.items() if name != "call"}
        base = entry["figures"]["gather"]["us_per_batch"]
        for name, f in entry["figures"].items():
            f["us_per_id"] = f["us_per_batch"] / entry["batch"]
            f["vs_gather"] = f["us_per_batch"] / base if base > 0 else None
    run["export_figures"] = {
        name: {"median_ms_per_call": statistics.median(o["wall_s_per_call"]) * 1e3,
               "ps_cpu_ms_per_call": o["cpu_s_per_call"]["ps0"] * 1e3,
               "calls_checked": o["calls_checked"]}
        for name, o in run["exports"]["operations"].items()}
    rss = run["rss_mib"]
    run["table_rss_mib"] = {name: rss[name]["after_mib"] - rss[name]["before_mib"]
                            for name in TABLES}
    return run


def markdown(report):
    lines = ["# Dynamic vocabularies: the cost of hash tables on a PS", "",
             f"Generated by `{report['invocation']}` on {machine.summary(report['machine'])}; "
             f"code: commit {report['code']['commit']}.", "",
             "Each table holds N distinct random int64 ids (or their decimal strings) x 64 "
             "float32 on the ps of a 1 worker + 1 ps cluster on loopback; the chief times "
             "tf.functions that run wholly on the ps. A call runs "
             f"{report['options']['inner']} batches of B unique ids one after the other; "
             "*µs/batch* = (median µs per call - the median of an empty call) / batches; "
             "*vs gather* = µs/batch over tf.gather's of the same B rows (today's PS "
             "lookup); *ps CPU* = the ps process's user + system time per batch, net of an "
             "empty call's (clock ticks of 10 ms, over all calls). Every call's checksum and every operation's "
             "values were checked (see the JSON's `checks`).", ""]
    lines += [f"- `{name}` ({design}): {text}." for name, (design, text) in OPERATIONS.items()
              if name != "call"]
    lines += ["", "| N | B | operation | design | µs/call (median) | µs/batch | µs/id | "
              "vs gather | ps CPU µs/batch |", "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        if "error" in run:
            lines.append(f"| {run['rows']:,} | | FAILED: {run['error']} | | | | | | |")
            continue
        for entry in run["batches"]:
            lines.append(f"| {run['rows']:,} | {entry['batch']:,} | call (empty; subtracted) "
                         f"| - | {entry['call_floor_us']:,.0f} | | | | "
                         f"{entry['call_floor_ps_cpu_us']:,.0f} per call |")
            for name, f in entry["figures"].items():
                ratio = f"{f['vs_gather']:.2f}x" if f["vs_gather"] is not None else ""
                lines.append(f"| {run['rows']:,} | {entry['batch']:,} | {name} | "
                             f"{OPERATIONS[name][0]} | {f['median_us_per_call']:,.0f} | "
                             f"{f['us_per_batch']:,.1f} | {f['us_per_id']:.3f} | {ratio} | "
                             f"{f['ps_cpu_us_per_batch']:,.0f} |")
    lines += ["", "Exports of the whole table (a checkpoint's snapshot), and the memory each "
              "table added to the ps (VmRSS after building it minus before; build time):", "",
              "| N | export | design | ms/call (median) | ps CPU ms/call |",
              "|---:|---|---|---:|---:|"]
    for run in report["runs"]:
        if "error" in run:
            continue
        for name, f in run["export_figures"].items():
            lines.append(f"| {run['rows']:,} | {name} | {EXPORTS[name][0]} | "
                         f"{f['median_ms_per_call']:,.1f} | {f['ps_cpu_ms_per_call']:,.1f} |")
    lines += ["", "| N | table | ps VmRSS added MiB | bytes per id | ps VmRSS after MiB | "
              "build s |", "|---:|---|---:|---:|---:|---:|"]
    for run in report["runs"]:
        if "error" in run:
            continue
        for name, mib in run["table_rss_mib"].items():
            lines.append(f"| {run['rows']:,} | {name}: {TABLES[name]} | {mib:,.1f} | "
                         f"{mib * 2 ** 20 / run['rows']:,.0f} | "
                         f"{run['rss_mib'][name]['after_mib']:,.0f} | "
                         f"{run['build_s'][name]:.2f} |")
    lines += ["", "DenseHashTable buckets: the power of two that keeps N + B below its "
              "load factor 0.8 (" + ", ".join(f"N={r['rows']:,}: {r['dense_buckets']:,}"
                                              for r in report["runs"] if "error" not in r)
              + "). Spare rows of the row table for design B's admissions: the largest B.",
              "", "Clusters: " + "; ".join(f"`{run['command']}`" for run in report["runs"])]
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dynamic_table_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000],
                        help="table sizes N, one cluster each (default %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1000, 8000],
                        help="unique ids per batch B (default %(default)s)")
    parser.add_argument("--inner", type=int, default=50,
                        help="batches one after the other per call (default %(default)s)")
    parser.add_argument("--calls", type=int, default=10, help="calls per block")
    parser.add_argument("--export-calls", type=int, default=2, help="export calls per block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each function")
    parser.add_argument("--warmup", type=int, default=2, help="calls before measuring")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per cluster (default %(default)s)")
    parser.add_argument("--json", default=os.path.join(RESULTS, "dynamic_table_cost.json"),
                        help="results; the markdown beside it")
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if min(options.rows) < 2 or min(options.batches) < 2:
        parser.error("--rows and --batches must be at least 2")
    if max(options.batches) > min(options.rows):
        parser.error("a batch takes B unique rows of the table: --batches <= --rows")
    if min(options.inner, options.calls, options.export_calls, options.rounds) < 1 \
            or options.warmup < 1:
        parser.error("--inner, --calls, --export-calls, --rounds and --warmup must be >= 1")
    if options.chief and len(options.rows) != 1:
        parser.error("--chief runs one table size")
    return options


def run_all(options, argv):
    report = {"machine": machine.describe(), "code": machine.code_version(),
              "invocation": shlex.join(["python", "-m", "benchmarks.dynamic_table_cost"]
                                       + list(argv)),
              "options": {k: v for k, v in vars(options).items() if k not in ("chief",)},
              "operations": {**OPERATIONS, **EXPORTS}, "tables": TABLES, "runs": []}
    for rows in options.rows:
        command = _command(options, rows)
        shown = _shown(command)
        print(f"[dynamic_table_cost N={rows}] {shown}", file=sys.stderr, flush=True)
        result, error = chief_runs.run(command, REPO, _RESULT_PREFIX, options.timeout)
        if result is None:
            print(f"[dynamic_table_cost N={rows}] FAILED: {error}", file=sys.stderr,
                  flush=True)
            report["runs"].append({"rows": rows, "command": shown, "error": error})
            continue
        result["command"] = shown
        result["loadavg_after"] = list(os.getloadavg())
        report["runs"].append(summarize(result))
    text = markdown(report)
    chief_runs.save(options.json, report, text)
    print(text)
    failed = [run["rows"] for run in report["runs"] if "error" in run]
    if failed:
        raise SystemExit(f"dynamic_table_cost: the runs with N = {failed} failed (see above)")


def main(argv=None):
    chief_runs.main(argv, parse, run_chief, run_all)


if __name__ == "__main__":
    main()
