"""`DynamicEmbedding`: an embedding keyed by raw int64 or string ids, with no vocabulary given.

```python
import keras, numpy as np
from hybrid_strategy.layers import DynamicEmbedding
model = keras.Sequential([keras.Input((2,), dtype="int64"),
                          DynamicEmbedding(8, capacity=1000, combiner="mean"),
                          keras.layers.Dense(1)])
model.compile(optimizer="adagrad", loss="mse")
ids = np.array([[2**40 + 3, -7], [123456789012, -7]], np.int64)
model.fit(ids, np.ones((2, 1)), epochs=2, verbose=0)
```
"""

import collections
import collections.abc
import functools
import re
import weakref

import numpy as np
import tensorflow as tf

# TF-private: regroups the rows computed once for the global batch into each
# replica's part, as merge_call's results are handed back.
from hybrid_strategy.tensorflow_private import distribute_utils

from hybrid_strategy.keras_integration import batched_lookups
from hybrid_strategy.keras_integration import dynamic_hooks
from hybrid_strategy.tables import dynamic
from hybrid_strategy.tables import dynamic_exchange
from hybrid_strategy.tables import sketch
from hybrid_strategy.tables import table as table_lib

COMBINERS = (None, "sum", "mean", "sqrtn")
KEY_DTYPES = ("int64", "string")


@tf.keras.utils.register_keras_serializable(package="hybrid_strategy")
class DynamicEmbedding(tf.keras.layers.Layer):
    """Turns raw ids (any int64 value, or strings) into vectors, admitting ids as they come.

    The layer holds `capacity` rows. An id gets a row once it was seen `min_count`
    times in training; until then, and after it is evicted, its vector is zeros and
    its gradient is dropped. When rows run out, the rows of ids not seen in the step
    are evicted by `eviction` ("lru": least recently seen first; "lfu": least often
    seen first), and `max_age` evicts ids not seen for that many steps. An admitted
    id's row starts from `embeddings_initializer`, drawn from a hash of the id, and
    its optimizer slots from their initial values. Under a `HybridStrategy` the rows
    are a table on the PS tasks, and the id -> row map is split as the rows are (each
    PS task holding rows maps the ids of its rows); elsewhere both are local, with the
    same results.

    Decisions are taken once per training step for the global batch, before any
    row is read, so training on N workers gives what one device gives on the same
    global batch. Under asynchronous training they are taken once per worker's step,
    for its batch, one step at a time per table (a lock on its first shard's task:
    tables/step_lock.py). Evaluation and prediction look ids up without counting them. The
    DynamicEmbedding layers of a Keras 3 functional model that read its inputs (each
    called once in it) train together, in one exchange with each PS task
    (tables/dynamic_exchange.py).

    Args:
        output_dim: Size of each vector.
        capacity: Number of rows (ids held at once), or the memory they may take on
            the PS tasks as a string such as "256MiB" (units B, KB, MB, GB, KiB, MiB,
            GiB): each row's float32 vector, its map entry and its 32-byte record,
            and the map entries of up to `max_waiting` ids waiting for admission (with
            `admission="sketch"`, the sketch's bytes).
            Optimizer slots come on top, a row's vector each (Adagrad one, Adam two);
            `layer.capacity` says the rows.
        key_dtype: "int64" (integer ids, any value) or "string".
        min_count: Sightings in training before an id gets a row (1: at once).
        eviction: "lru" or "lfu".
        max_age: Training steps without a sighting after which an id is evicted;
            None: only when rows run out.
        max_waiting: Ids seen fewer than `min_count` times whose counts are kept
            (None: `capacity`); past it, the oldest half is forgotten (with a sketch,
            every count is halved). Make it larger than the number of distinct ids seen
            between an id's sightings.
        admission: How ids waiting for `min_count` are counted: "exact" (an entry of
            about 48 bytes each in the id -> row map) or "sketch" (a count-min sketch of
            a fixed size for `max_waiting` ids, a few bits per id: `admission_bytes`).
        admission_error: With "sketch", the odds that an id is admitted before its
            `min_count`-th sighting, at most (it is never admitted later than exact
            counting would admit it, counts forgotten aside).
        combiner: None (a vector per id, shaped like the input plus `output_dim`), or
            "sum", "mean", "sqrtn": one vector per row of a 2-D (padded or ragged)
            input, combining its ids.
        pad_id: An id that stands for no id (padding of multi-hot inputs): its vector
            is zeros and it never gets a row.
        embeddings_initializer: "uniform" (-0.05, 0.05), "normal" (0, 0.05), "zeros",
            or a Keras `RandomUniform`, `RandomNormal`, `Zeros` or `Constant`.
        seed: Seed of the initial rows.
    """

    def __init__(self, output_dim, capacity, key_dtype="int64", min_count=1, eviction="lru",
                 max_age=None, max_waiting=None, combiner=None, pad_id=None,
                 embeddings_initializer="uniform", seed=0, admission="exact",
                 admission_error=0.01, **kwargs):
        super().__init__(**kwargs)
        self.output_dim = _positive_int(output_dim, "output_dim")
        self.max_waiting = (None if max_waiting is None
                            else _positive_int(max_waiting, "max_waiting"))
        self.min_count = _positive_int(min_count, "min_count")
        if admission not in dynamic.ADMISSIONS:
            raise ValueError(f"DynamicEmbedding: admission={admission!r}; use one of "
                             f"{dynamic.ADMISSIONS}.")
        self.admission, self.admission_error = admission, float(admission_error)
        waiting_bytes = functools.partial(_waiting_bytes, admission, self.min_count,
                                          self.admission_error)
        waiting_bytes(1)  # refuses a sketch that cannot be built, now
        self.capacity_given = capacity
        self.capacity = (_rows_in(capacity, self.output_dim, self.max_waiting, waiting_bytes)
                         if isinstance(capacity, str) else _positive_int(capacity, "capacity"))
        # The memory of the ids waiting for admission, at most (exact: an estimate).
        self.admission_bytes = waiting_bytes(self.max_waiting or self.capacity)
        if key_dtype not in KEY_DTYPES:
            raise ValueError(f"DynamicEmbedding: key_dtype={key_dtype!r}; use one of "
                             f"{KEY_DTYPES}.")
        self.key_dtype = key_dtype
        if eviction not in dynamic.POLICIES:
            raise ValueError(f"DynamicEmbedding: eviction={eviction!r}; use one of "
                             f"{dynamic.POLICIES}.")
        self.eviction = eviction
        self.max_age = None if max_age is None else _positive_int(max_age, "max_age")
        if combiner not in COMBINERS:
            raise ValueError(f"DynamicEmbedding: combiner={combiner!r}; use one of "
                             f"{COMBINERS}.")
        self.combiner = combiner
        self.pad_id = pad_id
        self.embeddings_initializer = embeddings_initializer
        self._initializer = _initializer_spec(embeddings_initializer)
        self.seed = int(seed)
        self.remap = None
        dynamic_hooks.install()

    def build(self, input_shape=None):
        # Rows are reset when admitted; zeros until then.
        self.embeddings = self.add_weight(name="embeddings",
                                          shape=(self.capacity, self.output_dim),
                                          initializer="zeros", trainable=True)
        dynamic_hooks.track_slots(self.embeddings)
        with tf.init_scope():  # Keras may build inside a traced function
            self.remap = dynamic.Remap(self.capacity, _remap_devices(self.embeddings),
                                       self.min_count, self.eviction, self.max_age,
                                       self.max_waiting, admission=self.admission,
                                       admission_error=self.admission_error,
                                       name=f"{self.name}_remap")
        placer = getattr(tf.distribute.get_strategy().extended, "placer", None)
        if placer is not None:  # a HybridStrategy lists the table in its placement
            stats = weakref.WeakMethod(self.table_stats)
            placer.add_dynamic(_path_of(self.embeddings),
                               lambda: None if stats() is None else stats()())
        self.built = True

    def call(self, inputs, training=None):
        looked_up = batched_lookups.looked_up(self, inputs)
        if looked_up is not None:  # with the model's other tables
            return looked_up
        context = tf.distribute.get_replica_context()
        # A SavedModel's traces (tf_keras traces training calls too) only look up.
        if training and context is not None and not table_lib.exporting():
            return train_together([(self, inputs)])[0]
        ids, output = self._flat_ids(inputs)
        distinct, position = tf.unique(dynamic.keys_of(ids), out_idx=tf.int64)
        rows = self.remap.lookup(distinct)
        held_rows = tf.gather_nd(rows, tf.where(rows >= 0))
        return self._output(_Counted(None, position, output),
                            dynamic_exchange.Result(rows, held_rows, None, None, None))

    def _counted(self, inputs):
        """The distinct keys of `inputs` with their counts, for a training step."""
        ids, output = self._flat_ids(inputs)
        # Each distinct id once, uniqued where the ids are: distinct ids hold distinct
        # rows, each read once, so that its gradient has each row once, its occurrences
        # summed, as a dense gradient would (Keras' sparse optimizer steps would
        # otherwise take repeated rows one by one).
        distinct, position, counts = tf.unique_with_counts(dynamic.keys_of(ids),
                                                           out_idx=tf.int64)
        return _Counted(tf.stack([distinct, counts]), position, output)

    def _exchanged(self, counted):
        """This table's part of a step's exchange (`counted`: per replica)."""
        rows = getattr(self.embeddings, "_value", self.embeddings)
        split_as_map = table_lib.is_table(rows) and rows.devices == self.remap.devices
        return dynamic_exchange.Table(self.remap, rows if split_as_map else None,
                                      self._reset, counted)

    def _output(self, counted, result):
        """The layer's output from the rows of its distinct keys (`result`)."""
        held = result.rows >= 0
        # Each id's place among the vectors (-1: no row).
        place = tf.gather(tf.where(held, tf.cumsum(tf.cast(held, tf.int64)) - 1, -1),
                          counted.position)
        found = tf.where(place >= 0)
        rows = getattr(self.embeddings, "_value", self.embeddings)
        if result.vectors is not None:
            vectors = table_lib.rows_read(rows, result.vectors, result.held_rows,
                                          result.shard, result.held_on_ps)
        else:
            with table_lib.distinct_rows_of(rows):
                vectors = tf.nn.embedding_lookup(self.embeddings, result.held_rows)
        return counted.output(found, tf.cast(tf.gather(vectors, tf.gather_nd(place, found)),
                                             self.compute_dtype))

    def _reset(self, rows, keys, shard):
        values = dynamic.initial_rows(keys, self.output_dim, self._initializer, self.seed,
                                      self.embeddings.dtype)
        return dynamic_hooks.reset_rows(self.embeddings, rows, values, shard)

    def _flat_ids(self, inputs):
        """(the ids to look up, flat; a function from the places of those with a row
        among them, and their vectors, to the output)."""
        ragged = isinstance(inputs, tf.RaggedTensor)
        if ragged:
            if self.combiner is None or inputs.ragged_rank != 1:
                raise ValueError("DynamicEmbedding: a ragged input needs a combiner and "
                                 "one ragged dimension ([batch, (ids)]).")
            ids, splits = inputs.values, inputs.row_splits
        else:
            ids = tf.convert_to_tensor(inputs)
        self._check_dtype(ids)
        if not ragged and self.combiner is not None and ids.shape.rank != 2:
            raise ValueError(f"DynamicEmbedding: combiner={self.combiner!r} combines "
                             f"the ids of each row of a 2-D input; got shape {ids.shape}.")
        shape = tf.shape(ids, out_type=tf.int64)
        flat = tf.reshape(ids, [-1])
        dim = self.output_dim
        num_ids = tf.size(flat, out_type=tf.int64)
        if self.pad_id is None:
            kept, where = None, None
        else:
            kept = tf.not_equal(flat, tf.constant(self.pad_id, flat.dtype))
            where = tf.where(kept)
            flat = tf.gather_nd(flat, where)

        def output(found, vectors):
            # One scatter puts each vector in its place among all the input's ids, zeros
            # for ids without a row and for pads.
            places = found if where is None else tf.gather_nd(where, found)
            every = tf.scatter_nd(places, vectors, tf.stack([num_ids, dim]))
            if self.combiner is None:
                return tf.reshape(every, tf.concat([shape, [dim]], 0))
            weights = tf.ones_like(every[:, 0]) if kept is None else tf.cast(kept, every.dtype)
            if ragged:
                segments = tf.ragged.row_splits_to_segment_ids(splits)
                num_rows = tf.size(splits, out_type=tf.int64) - 1
                total = tf.math.unsorted_segment_sum(every, segments, num_rows)
                counts = tf.math.unsorted_segment_sum(weights, segments, num_rows)
            else:  # [batch, ids]: a sum over the second axis, pads' vectors being zeros
                total = tf.reduce_sum(tf.reshape(every, tf.stack([shape[0], shape[1], dim])), 1)
                counts = tf.reduce_sum(tf.reshape(weights, shape), 1)
            if self.combiner == "sum":
                return total
            counts = counts[:, None]
            if self.combiner == "sqrtn":
                counts = tf.sqrt(counts)
            return tf.math.divide_no_nan(total, counts)

        return flat, output

    def _check_dtype(self, ids):
        if self.key_dtype == "string" and ids.dtype != tf.string:
            raise TypeError(f"DynamicEmbedding(key_dtype='string') got {ids.dtype.name} "
                            "ids; give strings, or use key_dtype='int64'.")
        if self.key_dtype == "int64" and not ids.dtype.is_integer:
            raise TypeError(f"DynamicEmbedding(key_dtype='int64') got {ids.dtype.name} ids; "
                            "give int32 or int64 ids (floats lose ids beyond 2**53): a model's "
                            "keras.Input(..., dtype='int64'), or key_dtype='string'.")

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if self.combiner is None:
            return input_shape + (self.output_dim,)
        return input_shape[:1] + (self.output_dim,)

    # State --------------------------------------------------------------------------

    def table_stats(self):
        """{"capacity", "rows_in_use" (per map shard), "admissions", "evictions", "steps"},
        and with a sketch "sketch_halvings" (the times its counts were halved)."""
        remap = self.remap
        stats = {"capacity": self.capacity,
                 "rows_in_use": [int(n) for n in remap.rows_in_use().numpy()],
                 "admissions": int(remap.admissions.numpy()),
                 "evictions": int(remap.evictions.numpy()),
                 "steps": int(remap.step.numpy())}
        if remap.sketch is not None:
            stats["sketch_halvings"] = int(remap.sketch.halvings.numpy())
        return stats

    def save_own_variables(self, store):
        super().save_own_variables(store)
        for name, value in self.remap.snapshot().items():
            store[f"remap_{name}"] = value

    def load_own_variables(self, store):
        names = [k for k in store.keys() if k.startswith("remap_")]
        if not names:
            raise ValueError(f"DynamicEmbedding {self.name!r}: the weights file holds no "
                             "id -> row map: it was not saved from a DynamicEmbedding.")
        super().load_own_variables(_Without(store, names))
        self.remap.restore({k[len("remap_"):]: np.asarray(store[k]) for k in names})

    def get_config(self):
        config = super().get_config()
        config.update(output_dim=self.output_dim, capacity=self.capacity_given,
                      key_dtype=self.key_dtype, min_count=self.min_count,
                      eviction=self.eviction, max_age=self.max_age,
                      max_waiting=self.max_waiting, admission=self.admission,
                      admission_error=self.admission_error, combiner=self.combiner,
                      pad_id=self.pad_id, seed=self.seed,
                      embeddings_initializer=_serializable(self.embeddings_initializer))
        return config


# A call's distinct keys and their counts ([2, n]; None outside training), each id's
# place among them, and the function from the places and vectors of ids with a row
# to the output (`DynamicEmbedding._flat_ids`).
_Counted = collections.namedtuple("_Counted", "counted position output")


def train_together(calls):
    """The outputs of training calls `(layer, inputs)` of DynamicEmbedding layers, in a
    replica context: every table's admissions, evictions and rows for the global batch
    in one exchange (tables/dynamic_exchange.py), before any replica reads a row."""
    counted = [layer._counted(inputs) for layer, inputs in calls]
    layers = [layer for layer, _ in calls]
    results = tf.distribute.get_replica_context().merge_call(
        functools.partial(_exchange, layers), args=(tuple(c.counted for c in counted),))
    return [layer._output(c, result) for layer, c, result in zip(layers, counted, results)]


def _exchange(layers, strategy, counted):
    """`train_together`'s cross-replica part: per replica, a `Result` per layer."""
    counted = [strategy.experimental_local_results(c) for c in counted]
    results = dynamic_exchange.train(
        [layer._exchanged(c) for layer, c in zip(layers, counted)],
        concurrent=getattr(strategy, "asynchronous", False))
    by_replica = tuple(tuple(result[i] for result in results)
                       for i in range(len(counted[0])))
    return by_replica[0] if len(by_replica) == 1 else distribute_utils.regroup(by_replica)


class _Without:
    """A weights store without some of its keys, for Keras' own loading."""

    def __init__(self, store, hidden):
        self._store, self._hidden = store, set(hidden)

    def keys(self):
        return [k for k in self._store.keys() if k not in self._hidden]

    def __getitem__(self, key):
        return self._store[key]


# What an id's entry in a map shard (a MutableHashTable of int64 -> int64) adds to a
# ps's memory: 42 bytes measured at 200k and 1M entries, with ids coming and going.
MAP_ENTRY_BYTES = 48
# A row's [key, count, last step] and its place in the stack of free rows, int64s.
ROW_RECORD_BYTES = 32
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _waiting_bytes(admission, min_count, error, max_waiting):
    """The bytes `max_waiting` ids waiting for admission take: their map entries, or the
    sketch counting them."""
    if admission == "exact":
        return max_waiting * MAP_ENTRY_BYTES
    try:
        return sketch.nbytes(max_waiting, min_count, error)
    except ValueError as error_made:
        raise ValueError(f"DynamicEmbedding: {error_made}") from None


def _rows_in(budget, output_dim, max_waiting, waiting_bytes):
    """The rows a capacity of `budget` bytes ("256MiB") holds: each a float32 vector, a
    map entry and its record, beside `waiting_bytes(max_waiting)` for the waiting ids
    (None: as many as rows)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)\s*", budget, re.IGNORECASE)
    if not match:
        raise ValueError(f"DynamicEmbedding: capacity={budget!r}; give a number of rows or "
                         'a size such as "256MiB" (units B, KB, MB, GB, KiB, MiB, GiB).')
    total = float(match.group(1)) * _UNITS[match.group(2).upper()]
    row = 4 * output_dim + MAP_ENTRY_BYTES + ROW_RECORD_BYTES
    if max_waiting is None:
        # Waiting ids' bytes grow with the rows, by steps (a sketch's rounding): the
        # estimate at a waiting id's average cost, then down until it fits.
        rows = total // (row + waiting_bytes(2**20) / 2**20)
        while rows >= 1 and rows * row + waiting_bytes(int(rows)) > total:
            rows -= 1
    else:
        rows = (total - waiting_bytes(max_waiting)) // row
    if rows < 1:
        raise ValueError(f"DynamicEmbedding: capacity={budget!r} holds no row of "
                         f"{output_dim} floats ({row} bytes with its map entry and record"
                         + (f", after {max_waiting} waiting ids' counts" if max_waiting
                            else ", beside the counts of as many waiting ids") + "); give more.")
    return int(rows)


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"DynamicEmbedding: {name}={value!r}; give a whole number of at "
                         "least 1.")
    return int(value)


def _initializer_spec(initializer):
    """("uniform" | "normal" | "constant", a, b) of a supported initializer."""
    named = {"uniform": ("uniform", -0.05, 0.05), "random_uniform": ("uniform", -0.05, 0.05),
             "normal": ("normal", 0.0, 0.05), "random_normal": ("normal", 0.0, 0.05),
             "zeros": ("constant", 0.0, None)}
    if isinstance(initializer, str) and initializer in named:
        return named[initializer]
    if isinstance(initializer, collections.abc.Mapping):  # from get_config
        kind, config = initializer.get("class_name"), initializer.get("config", {})
    else:
        kind, config = type(initializer).__name__, getattr(
            initializer, "get_config", dict)()
    if kind == "RandomUniform":
        return ("uniform", float(config["minval"]), float(config["maxval"]))
    if kind == "RandomNormal":
        return ("normal", float(config["mean"]), float(config["stddev"]))
    if kind == "Zeros":
        return ("constant", 0.0, None)
    if kind == "Constant" and np.ndim(config["value"]) == 0:
        return ("constant", float(config["value"]), None)
    raise ValueError(f"DynamicEmbedding: embeddings_initializer={initializer!r} is not "
                     "supported; use 'uniform', 'normal', 'zeros', or a RandomUniform, "
                     "RandomNormal, Zeros or scalar Constant initializer (rows are drawn "
                     "per id, from a hash of the id).")


def _serializable(initializer):
    if isinstance(initializer, str):
        return initializer
    if isinstance(initializer, collections.abc.Mapping):  # Keras wraps dicts it tracks
        return {"class_name": initializer["class_name"], "config": dict(initializer["config"])}
    return {"class_name": type(initializer).__name__, "config": initializer.get_config()}


def _path_of(variable):
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def _remap_devices(embeddings):
    """Where the id -> row map's shards live: beside the shards of `embeddings` when
    they are a table on the PS tasks, so that the map is split as its rows are (a table
    placed whole keeps its bookkeeping on one task, calling no other), else over the
    PS tasks of a HybridStrategy in scope, else on the local CPU."""
    rows = getattr(embeddings, "_value", embeddings)
    if table_lib.is_table(rows):
        return rows.devices
    ps_devices = getattr(tf.distribute.get_strategy().extended, "ps_devices", None)
    return tuple(ps_devices) if ps_devices else ("/device:CPU:0",)


# A functional model trains every DynamicEmbedding reading its inputs at once.
batched_lookups.trained_together(DynamicEmbedding, train_together)
