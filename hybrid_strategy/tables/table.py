"""PS tables: variables split by rows over parameter-server tasks, read and updated by row.

A `ShardedTable` of S shards holds one TensorFlow resource variable per shard, each on
the PS device `placement` chose for it; shard k holds rows k, k + S, k + 2S, ... of
the table, so that frequent ids, which are often the small ones (vocabularies sorted
by frequency), are spread over every PS. It stands in for the variable that Keras
(3 or tf_keras) asked for:

- `lookup` (reached through `tf.gather`, `tf.nn.embedding_lookup` and Keras 3's
  `ops.take`) deduplicates the ids on the worker, gathers each shard's rows on its
  own PS and stitches them back, so each distinct row crosses the network once per
  replica and step;
- its gradient is a `tf.IndexedSlices` over the whole table whose indices are the
  lookup's unique ids; `table_of_gradient` recognises them, so the strategy sends
  the rows to their shards instead of all-reducing them;
- reading it whole (a tied output projection, `get_weights()`) concatenates the
  shards, with a dense gradient;
- a SavedModel (`tf.saved_model.save`, Keras 3 `model.export`) holds it as one
  ordinary variable with the whole table: functions traced for export read a
  stand-in variable of the table's shape (`saving_variable`, which holds no memory
  here), which the export maps to that ordinary variable, as TensorFlow's
  `ShardedVariable` does.

The gradient reaches the tape through the first shard's handle: tape and Keras
know a variable by `handle`, and each read records the table-wide gradient for it.

```python
import tensorflow as tf
from hybrid_strategy.tables import table
shards = [tf.Variable(tf.reshape(tf.range(8.0), (4, 2))), tf.Variable(tf.ones((3, 2)))]
t = table.ShardedTable(shards, "emb/embeddings")   # rows 0, 2, 4, 6 and 1, 3, 5
print(tf.gather(t, [4, 1, 4]))   # row 4 (the first shard's third), 1 (the second's first)
```
"""

import contextlib
import random
import threading
import weakref

import numpy as np
import tensorflow as tf

# TF-private: `record.stop_recording` keeps the tape from also differentiating the
# raw per-shard reads, and `record.record_operation` gives it the table-wide
# gradient instead; `tape.variable_accessed` tells the tape the table was read, as
# reads of a tf.Variable do; `dispatch` lets `tf.nn.embedding_lookup` route tables to
# `lookup` before it would convert them to one dense tensor; gen_resource_variable_ops
# are the raw per-shard reads.
from hybrid_strategy.tensorflow_private import record
from hybrid_strategy.tensorflow_private import tape_lib
from hybrid_strategy.tensorflow_private import gen_resource_variable_ops
from hybrid_strategy.tensorflow_private import dispatch
# TF-private: `save_context` tells that `tf.saved_model.save` is tracing the
# functions it exports; `resource_variable_ops` makes the stand-in variable those
# traces read and writes a variable's SavedModel record (as ShardedVariable does).
from hybrid_strategy.tensorflow_private import resource_variable_ops
from hybrid_strategy.tensorflow_private import save_context

from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.sharding import wire
from hybrid_strategy.tables import row_blocks

# graph -> {name of a lookup's unique ids or of a read's gradient: its table}
_LOOKUPS = weakref.WeakKeyDictionary()
# graph -> names of lookups' unique ids
_DISTINCT = weakref.WeakKeyDictionary()
# graph -> {name of a lookup's unique ids: (shard of each id or None, ids held on each
# shard's PS task)}
_IDS_ON_PS = weakref.WeakKeyDictionary()
# graph -> refs of the tables read whole there while a gradient tape recorded
_WHOLE_READS = weakref.WeakKeyDictionary()
# Gradient-side ops that keep the rows' identity while reshaping or merging them.
_PASS_THROUGH_OPS = ("Reshape", "Identity", "Cast")
# Functions called with a Keras 3 variable read by row that wraps no table (`on_row_read`).
_ROW_READ_HANDLERS = []
# Depth of `tracing_for_export` blocks on this thread.
_EXPORT_TRACING = threading.local()
# The tables whose ids the Embedding layers being called on this thread have checked.
_LAYER_CHECKED = threading.local()
# The tables looked up, on this thread, by distinct rows in range (`distinct_rows_of`).
_DISTINCT_ROWS = threading.local()
# {id(table): the rows standing in for it} while an optimizer's rule runs on this thread
# (`rows_standing_in`): per thread, as asynchronous training's workers trace at once.
_ROWS_VIEWS = threading.local()
# .values: {id(table): its value read ahead} in `reading_ahead` blocks on this thread.
_READ_AHEAD = threading.local()
# Tables read whole, and tables looked up by row, in any function traced so far.
_SEEN_WHOLE = weakref.WeakSet()
_SEEN_BY_ROW = weakref.WeakSet()


@dispatch.register_dispatchable_type
class ShardedTable(tf.Variable):
    """A variable whose rows are dealt over `shards`, one per PS device.

    Shard k of S holds rows k, k + S, k + 2S, ...: row r is row r // S of shard
    r % S, so the first shards hold one row more when S does not divide the rows.

    It is a `tf.Variable` (as a MirroredVariable is) so that code which accepts
    only variables takes it: tf_keras' h5 weights files, for one. Like a Python
    object, and unlike a `tf.Variable`, it is hashable and equal only to itself.

    Args:
        shards: tf.Variables with the same trailing shape, the k-th holding rows
            k::S of the table.
        path: The name users know the table by, e.g. "embedding/embeddings".
        name: The variable name Keras asked for (default: the path's last part).
    """

    _should_act_as_resource_variable = True

    def __init__(self, shards, path, name=None, wire_dtype=None):
        if not shards:
            raise ValueError(f"table {path} needs at least one shard.")
        self.shards = tuple(shards)
        self.path = path
        self._name = name or path.rsplit("/", 1)[-1]
        rows = [int(s.shape[0]) for s in self.shards]
        if rows != sharding.shard_rows(sum(rows), len(rows)):
            raise ValueError(
                f"table {path}: shards of {rows} rows cannot hold rows k::{len(rows)} of "
                f"{sum(rows)} rows; shard k needs {sharding.shard_rows(sum(rows), len(rows))}[k].")
        self.num_shards = len(rows)
        self._shape = tf.TensorShape([sum(rows)]).concatenate(self.shards[0].shape[1:])
        self._saving_variable = None
        self.wire_dtype = wire.check_wire_dtype(wire_dtype)

    # The tf.Variable surface Keras, optimizers and tf.distribute read ----------

    @property
    def name(self):
        return self._name

    @property
    def dtype(self):
        return self.shards[0].dtype

    @property
    def shape(self):
        return self._shape

    def get_shape(self):
        return self._shape

    @property
    def trainable(self):
        return self.shards[0].trainable

    @property
    def device(self):
        return self.shards[0].device

    @property
    def handle(self):
        return self.shards[0].handle

    @property
    def _unique_id(self):
        return f"table:{self.shards[0]._unique_id}"

    @property
    def _shared_name(self):
        return self.path.replace("/", "_")

    @property
    def synchronization(self):
        return self.shards[0].synchronization

    @property
    def aggregation(self):
        return self.shards[0].aggregation

    @property
    def _in_graph_mode(self):
        return False

    @property
    def constraint(self):
        return None

    @property
    def devices(self):
        return tuple(s.device for s in self.shards)

    def ref(self):
        return _Ref(self)

    @property
    def rows_view(self):
        """While an optimizer updates some rows of the table on this thread
        (`rows_standing_in`): the object standing in for them, which whole reads and
        writes go to instead; else None."""
        return getattr(_ROWS_VIEWS, "views", {}).get(id(self))

    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        """What tf.Variable's conversion to a tensor calls: the whole table."""
        return _to_tensor(self, dtype=dtype, name=name)

    def __repr__(self):
        return (f"<ShardedTable {self.path} shape={self._shape.as_list()} "
                f"shards={len(self.shards)}>")

    # Reads -----------------------------------------------------------------

    def sparse_read(self, indices, name=None):
        return lookup(self, indices, name=name)

    def value(self):
        return _read_whole(self)

    def read_value(self):
        return _read_whole(self)

    def numpy(self):
        whole = np.empty(self._shape.as_list(), dtype=self.dtype.as_numpy_dtype)
        for k, shard in enumerate(self.shards):
            whole[k::self.num_shards] = shard.numpy()
        return whole

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)

    # Writes ------------------------------------------------------------------

    def assign(self, value, use_locking=False, name=None, read_value=False):
        return self._write_rows(value, "assign")

    def assign_add(self, delta, use_locking=False, name=None, read_value=False):
        return self._write_rows(delta, "assign_add")

    def assign_sub(self, delta, use_locking=False, name=None, read_value=False):
        return self._write_rows(delta, "assign_sub")

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(sparse_delta, "scatter_update")

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(sparse_delta, "scatter_add")

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(sparse_delta, "scatter_sub")

    def _write_rows(self, value, method):
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        view = self.rows_view
        if view is not None:
            return view.write(method, value)
        _forget_read_ahead(self)
        ops = []
        for shard, part in zip(self.shards, sharding.split_dense(value, self.num_shards)):
            with tf.device(shard.device):
                ops.append(getattr(shard, method)(part, read_value=False))
        return tf.group(ops)

    def _scatter(self, sparse_delta, method):
        _forget_read_ahead(self)
        ops = []
        for shard, part in zip(self.shards, sharding.split_slices(sparse_delta, self.num_shards)):
            with tf.device(shard.device):
                ops.append(getattr(shard, method)(part))
        return tf.group(ops)

    # SavedModel export: one ordinary variable holding the whole table -------

    @property
    def saving_variable(self):
        """The whole-table stand-in that functions traced for export read.

        An uninitialized variable on this process: a handle, no memory. Exported
        functions capture it instead of the shards, and the export maps it to the
        ordinary variable the SavedModel holds the table in.
        """
        if self._saving_variable is None:
            with tf.init_scope():
                self._saving_variable = resource_variable_ops.UninitializedVariable(
                    shape=self._shape, dtype=self.dtype, name=self._shared_name,
                    trainable=self.trainable,
                    synchronization=tf.VariableSynchronization.NONE,
                    aggregation=tf.VariableAggregation.NONE)
        return self._saving_variable

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        """Maps the table, and the stand-in its exported functions read, to one variable."""
        saving = self.saving_variable
        resources = saving._export_to_saved_model_graph(
            object_map=object_map, tensor_map=tensor_map, options=options, **kwargs)
        object_map[self] = object_map[saving]
        if self.num_shards == 1:
            # A function traced for training reads the only shard as the whole
            # table: it is exported as such. The shards of a split table are not
            # (their rows are not the table's), so the export refuses such a
            # function instead of serving wrong rows.
            tensor_map[self.handle] = tensor_map[saving.handle]
            resources.append(self.handle)
        return resources

    def _write_object_proto(self, proto, options):
        """Records the table in the SavedModel as an ordinary variable of its shape."""
        resource_variable_ops.write_object_proto_for_resource_variable(
            self.saving_variable, proto, options, enforce_naming=False)

    def _copy_trackable_to_cpu(self, object_map):
        """Copies the whole table to this process's CPU (asynchronous checkpoints)."""
        if self not in object_map:
            with tf.device("/device:CPU:0"):
                object_map[self] = resource_variable_ops.UninitializedVariable(
                    shape=self._shape, dtype=self.dtype, name=self._shared_name,
                    trainable=self.trainable)
        copy = object_map[self]
        with tf.device(copy.device):
            copy.assign(_read_whole(self))

    # Checkpoints: the table in row order under one key, each block written and
    # read on its own ps (see row_blocks.py) --------------------------------

    def _serialize_to_tensors(self):
        return row_blocks.serialize(self)

    def _restore_from_tensors(self, restored_tensors):
        return row_blocks.restore(self, restored_tensors)


class _Ref:
    """Hashable identity for a table, like `tf.Variable.ref()`."""

    def __init__(self, table):
        self._table = table

    def deref(self):
        return self._table

    def __hash__(self):
        return id(self._table)

    def __eq__(self, other):
        return isinstance(other, _Ref) and other._table is self._table


@contextlib.contextmanager
def rows_standing_in(views):
    """Within, on this thread: whole reads and writes of each view's `table` go to the
    view (`view.read()`, `view.write(method, value)`), as an optimizer's rule reads and
    writes the rows it updates (sparse_optimizers.py). Other threads, tracing other
    steps at the same time, still see the tables."""
    outer = getattr(_ROWS_VIEWS, "views", {})
    _ROWS_VIEWS.views = {**outer, **{id(view.table): view for view in views}}
    try:
        yield
    finally:
        _ROWS_VIEWS.views = outer


def _to_tensor(table, dtype=None, name=None, as_ref=False):
    if dtype is not None and not tf.as_dtype(dtype).is_compatible_with(table.dtype):
        raise ValueError(
            f"Cannot convert table {table.path} of dtype {table.dtype.name} to "
            f"{tf.as_dtype(dtype).name}.")
    return _read_whole(table)


tf.register_tensor_conversion_function(ShardedTable, _to_tensor)


def is_table(value):
    return isinstance(value, ShardedTable)


def table_behind(variable):
    """The PS table `variable` is (tf_keras, TensorFlow) or wraps (a Keras 3
    variable), else None."""
    if is_table(variable):
        return variable
    value = getattr(variable, "_value", None)
    return value if is_table(value) else None


# Initializers whose values do not depend on the full shape: each shard can draw
# its own rows directly, on its own PS.
_ROW_WISE_INITIALIZERS = ("Zeros", "Ones", "Constant", "RandomUniform", "RandomNormal",
                          "TruncatedNormal")


def shard_initial_values(initial_value, initializer, shape, dtype, num_shards):
    """One initial value per shard of a `shape` table dealt over `num_shards`.

    Row-wise initializers run per shard (the full table is never built); anything
    else is built whole where the shard's variable is created, on its PS, and
    sliced there, so a worker or the chief never holds the table.
    """
    if num_shards == 1:
        return [initial_value]
    shape = tf.TensorShape(shape)
    if initializer is not None and type(initializer).__name__ in _ROW_WISE_INITIALIZERS:
        return [lambda rows=rows, init=init: init(
                    tf.TensorShape([rows]).concatenate(shape[1:]), dtype=dtype)
                for rows, init in zip(sharding.shard_rows(shape[0], num_shards),
                                      _per_shard(initializer, num_shards))]

    def rows_of(k):
        value = initial_value() if callable(initial_value) else initial_value
        return tf.convert_to_tensor(value, dtype=dtype)[k::num_shards]

    return [lambda k=k: rows_of(k) for k in range(num_shards)]


def _per_shard(initializer, num_shards):
    """One initializer per shard, random ones each with a seed of its own.

    A Keras initializer with an integer seed (Keras 3 gives every unseeded one a
    fixed seed; tf_keras repeats an unseeded one's values) draws the same values
    for every call of the same shape: shards would all hold the same rows. Shard
    k's seed derives from the initializer's, or from Python's `random`, which
    `keras.utils.set_random_seed` seeds, so runs stay reproducible.
    """
    seed = getattr(initializer, "seed", None)
    if "seed" not in initializer.get_config() or not (seed is None or isinstance(seed, int)):
        return [initializer] * num_shards  # constant, or a stateful SeedGenerator
    base = seed if seed is not None else random.randrange(1 << 31)
    config = initializer.get_config()
    return [type(initializer).from_config(dict(config, seed=hash((base, k)) & 0x7FFFFFFF))
            for k in range(num_shards)]


@contextlib.contextmanager
def tracing_for_export():
    """Functions traced inside read every table through its `saving_variable`.

    `tf.saved_model.save` needs no such block (it traces in its own save context);
    Keras 3's export traces its endpoints before it calls it.
    """
    _EXPORT_TRACING.depth = getattr(_EXPORT_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _EXPORT_TRACING.depth -= 1


def exporting():
    """Whether a function is being traced for a SavedModel (`tf.saved_model.save`, Keras'
    export, a `tracing_for_export` block): its reads and lookups must not change state."""
    if tf.executing_eagerly():
        return False
    return save_context.in_save_context() or getattr(_EXPORT_TRACING, "depth", 0) > 0


def _read_whole(table):
    """The whole table as one tensor; its gradient flows to the table's handle."""
    view = table.rows_view
    if view is not None:
        return view.read()
    if exporting():
        return gen_resource_variable_ops.read_variable_op(
            table.saving_variable.handle, table.dtype)
    ahead = getattr(_READ_AHEAD, "values", {}).get(id(table))
    with record.stop_recording():
        if ahead is not None and ahead.graph is tf.compat.v1.get_default_graph():
            whole = tf.identity(ahead)
        else:
            whole = sharding.join_dense(_read_shards(table))
    record_gradient(table, whole, lambda dy: remember_gradient(tf.identity(dy), table))
    if not tf.executing_eagerly():
        _SEEN_WHOLE.add(table)
        if record.could_possibly_record():
            _WHOLE_READS.setdefault(whole.graph, set()).add(table.ref())
    return whole


def _read_shards(table):
    """Each shard's value, read on its own device."""
    parts = []
    for shard in table.shards:
        with tf.device(shard.device):
            parts.append(gen_resource_variable_ops.read_variable_op(shard.handle, table.dtype))
    return parts


def reads_whole(table):
    """Whether the functions traced so far read `table` whole and never by row: a
    table a layer reads whole (a Dense kernel under `architecture="ps"`), whose value
    `reading_ahead` may read for the layer."""
    return table in _SEEN_WHOLE and table not in _SEEN_BY_ROW


@contextlib.contextmanager
def reading_ahead(tables, device):
    """Within, on this thread: whole reads of `tables` in the function being traced
    return their values read on entry, until the table is written (a write reads anew).

    The values cross to `device` as the lookups' rows do (sharding/wire.py): what
    one PS task holds of every table, as one tensor, where reading each table where it
    is used takes a tensor per table and shard. Tables already read ahead on this
    thread keep their value.
    """
    values = _READ_AHEAD.__dict__.setdefault("values", {})
    tables = [t for t in {id(t): t for t in tables}.values() if id(t) not in values]
    if tables and not exporting():
        outbox = wire.Outbox()
        with record.stop_recording():
            tickets = [[outbox.put(shard.device, device, part)
                        for shard, part in zip(table.shards, _read_shards(table))]
                       for table in tables]
            arrived = outbox.deliver()
            with tf.device(device):
                for table, parts in zip(tables, tickets):
                    values[id(table)] = sharding.join_dense([arrived[part] for part in parts])
    else:
        tables = []
    try:
        yield
    finally:
        for table in tables:
            values.pop(id(table), None)


def _forget_read_ahead(table):
    """The table is written: its later reads on this thread read it anew."""
    getattr(_READ_AHEAD, "values", {}).pop(id(table), None)


def read_whole_with_gradient(table):
    """Whether a traced function being built has read `table` whole under a gradient tape.

    Its gradient is then dense whatever else reads it.
    """
    graph = tf.compat.v1.get_default_graph()
    return table.ref() in _WHOLE_READS.get(graph, ())


def lookup(table, ids, name=None):
    """Returns `table`'s rows for `ids` (any shape), each gathered on its shard's PS.

    Ids outside `[0, rows)` raise an `InvalidArgumentError` naming the table, ids
    that are not integers a `TypeError`.
    """
    return lookup_many([(table, ids)], name=name)[0]


def lookup_many(requests, name=None, checked=False):
    """`lookup` of several `(table, ids)` at once: a list of rows, one per request.

    The ids a worker sends each PS task cross as one tensor, and the rows that task
    sends back as one (sharding/wire.py): one exchange per PS task, whatever the number of
    tables, in each table's `wire_dtype`. `checked`: the caller has checked the ids
    (`checked_ids`) already. Rows in a `distinct_rows_of` block are looked up as they
    are, without a unique of the lookup's own.
    """
    for_export = exporting()
    with tf.name_scope(name or "hybrid_lookup"):
        distinct = distinct_requests(requests, checked, for_export)
        with record.stop_recording():
            rows = _gather_rows([(table, unique_ids) for table, _, unique_ids, _ in distinct],
                                for_export)
        return rows_looked_up(distinct, rows, for_export)


def distinct_requests(requests, checked=False, for_export=False):
    """`lookup_many`'s first half: each `(table, ids)` as `(table, ids, unique ids,
    positions of the ids among them or None)`, the unique ids checked unless `checked`."""
    distinct = []
    for table, ids in requests:
        if not tf.executing_eagerly():
            _SEEN_BY_ROW.add(table)
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise TypeError(
                f"ids looked up in table {table.path} must be integers (int32 or "
                f"int64), got {ids.dtype.name}: cast them with tf.cast(ids, tf.int32).")
        if _listed(_DISTINCT_ROWS, table):
            unique_ids, positions = ids, None
        else:
            unique_ids, positions = tf.unique(tf.reshape(ids, [-1]))
        if not (checked or _listed(_LAYER_CHECKED, table)):
            unique_ids = _checked(unique_ids, table)
        if not for_export:
            remember_gradient(unique_ids, table, distinct=True)
        distinct.append((table, ids, unique_ids, positions))
    return distinct


def rows_looked_up(distinct, rows, for_export=False):
    """`lookup_many`'s second half: each request of `distinct` (`distinct_requests`)
    given its unique ids' `rows`, shaped as its ids, with its gradient recorded."""
    with record.stop_recording():
        outputs = [r if positions is None else tf.gather(r, positions)
                   for r, (_, _, _, positions) in zip(rows, distinct)]
    results = []
    for out, (table, ids, unique_ids, positions) in zip(outputs, distinct):
        if not for_export:  # a served function computes no gradient
            record_gradient(table, out, _row_gradients(table, unique_ids, positions))
        results.append(tf.reshape(out, tf.concat([tf.shape(ids), table.shape[1:]], 0)))
    return results


def rows_looked_up_ahead(distinct, rows):
    """`rows_looked_up` of one request of `distinct_requests` made in an enclosing graph
    (an earlier step's, whose exchange gathered its `rows`): its unique ids are named
    again in this graph, so that this step's gradient of them is known as a lookup's
    and crosses without its ids, as `ids_on_ps` says."""
    table, ids, unique_ids, positions = distinct
    here = remember_gradient(tf.identity(unique_ids), table, distinct=True)
    held = ids_on_ps(unique_ids)
    if held is not None:
        _note_ids_on_ps(here, *held)
    return rows_looked_up([(table, ids, here, positions)], [rows])[0]


def _row_gradients(table, unique_ids, positions):
    """The gradient of a lookup: the rows' gradients summed per distinct id."""
    num_unique = tf.shape(unique_ids)[0]
    dense_shape = tf.constant(table.shape.as_list(), dtype=tf.int64)

    def row_gradients(dy):
        summed = dy if positions is None else tf.math.unsorted_segment_sum(
            dy, positions, num_unique)
        return tf.IndexedSlices(summed, unique_ids, dense_shape)

    return row_gradients


def record_gradient(table, output, gradient):
    """Tells the tape that `output` was read from `table`, with this gradient.

    The tape knows a variable by its handle, so the gradient goes to the first
    shard's handle, recorded on the tape only: an op taking the handle would be
    ordered after every earlier use of that shard by tf.function's automatic
    control dependencies, which would keep otherwise unused whole-table reads
    (Keras reads the table's shape through one) alive in every step.
    """
    tape_lib.variable_accessed(table)
    handle = tf.convert_to_tensor(table.handle)  # the captured one inside a tf.function
    record.record_operation("HybridTableRead", [output], [handle],
                            lambda dy: [gradient(dy)])


def rows_read(table, rows, unique_ids, shard=None, held=None):
    """Records `rows` as `table`'s rows of `unique_ids` (distinct, in range), gathered on
    its PS tasks by the caller (a dynamic table's exchange), as `lookup_many` records
    its own: their gradient, and the ids `held` on each shard's PS task, split as
    `shard` says (`ids_on_ps`), so that the gradient crosses without them. Returns
    `rows`."""
    remember_gradient(unique_ids, table, distinct=True)
    if held is not None:
        _note_ids_on_ps(unique_ids, shard, held)
    record_gradient(table, rows, _row_gradients(table, unique_ids, None))
    return rows


@contextlib.contextmanager
def _ids_checked_for(table):
    """Lookups of `table` in this block skip the id check: the layer has done it."""
    with _listing(_LAYER_CHECKED, table):
        yield


@contextlib.contextmanager
def distinct_rows_of(table):
    """Lookups of `table` (a PS table or a variable) in this block are of distinct rows
    in range, as a DynamicEmbedding's map gives them: no unique and no check of their
    own."""
    with _listing(_DISTINCT_ROWS, table), _listing(_LAYER_CHECKED, table):
        yield


@contextlib.contextmanager
def _listing(local, table):
    """Adds `table` to `local`'s list in this block."""
    outer = getattr(local, "tables", ())
    local.tables = outer + (table,)
    try:
        yield
    finally:
        local.tables = outer


def _listed(local, table):
    return any(listed is table for listed in getattr(local, "tables", ()))


def _checked(unique_ids, table):
    return checked_ids(unique_ids, table.shape[0], f"table {table.path}")


def checked_ids(ids, num_rows, what):
    """`ids` once checked to be whole numbers in [0, num_rows); else a clear error.

    Integer ids are checked for their range; float ids (Keras' Embedding layers
    cast them to int32, truncating) must also have no fractional part. `what`
    names the table in the message, e.g. "table words/embeddings".
    """
    if isinstance(ids, (tf.SparseTensor, tf.RaggedTensor)):
        return ids.with_values(checked_ids(ids.values, num_rows, what))
    ids = tf.convert_to_tensor(ids)
    if not (ids.dtype.is_integer or ids.dtype.is_floating):
        raise TypeError(f"embedding ids for {what} must be integers (int32 or int64), "
                        f"got {ids.dtype.name}.")
    message = (f"embedding id out of range for {what} ({num_rows} rows): ids must be "
               f"in [0, {num_rows})")
    # One assertion for both bounds: each is a stateful op, which tf.function orders
    # after every other one traced before it on the same task (communication/side_effects.py).
    # tf.raw_ops.Assert, not tf.debugging.Assert: for ids other than int32 that one guards
    # the assertion with a conditional, two more functions traced for every lookup.
    in_range = tf.logical_and(ids >= 0, ids < tf.cast(num_rows, ids.dtype))
    checks = [tf.raw_ops.Assert(condition=tf.reduce_all(in_range),
                                data=[message, "ids:", ids], summarize=3)]
    if ids.dtype.is_floating:
        checks.append(tf.raw_ops.Assert(
            condition=tf.reduce_all(tf.equal(ids, tf.floor(ids))),
            data=[f"embedding ids for {what} must be whole numbers, got {ids.dtype.name} "
                  "ids with a fractional part: pass integer ids (int32 or int64)",
                  "ids:", ids], summarize=3))
    with tf.control_dependencies(checks):
        return tf.identity(ids)


def _gather_rows(requests, for_export=False):
    """Rows for distinct ids of each `(table, unique ids)`: each shard gathers its own on
    its PS, every PS task in parallel, in one exchange per task: the ids a worker sends
    a PS task, of every table, cross as one tensor, and the rows come back as one
    (sharding/wire.py), in each table's `wire_dtype`. The ids then held on each PS
    are noted (`ids_on_ps`), for the gradients of these rows to cross without them."""
    if for_export:
        return [gen_resource_variable_ops.resource_gather(
                    table.saving_variable.handle, unique_ids, dtype=table.dtype)
                for table, unique_ids in requests]
    outbox = wire.Outbox()
    sent = send_ids(outbox, requests)
    rows_outbox = wire.Outbox()
    tickets = send_rows(outbox.deliver(), requests, sent, rows_outbox)
    return rows_arrived(rows_outbox.deliver(), requests, sent, tickets)


def send_ids(outbox, requests, sources=None):
    """Puts the unique ids of each `(table, unique ids)` in `outbox`, split by shard, to
    each shard's PS from the request's device in `sources` (by default its ids' device).
    Returns what `send_rows` takes: per request, (shard of each id or None, [ticket of
    each shard's ids])."""
    sent = []
    for (table, unique_ids), source in zip(requests, sources or [None] * len(requests)):
        source = source or unique_ids.device
        with tf.device(source):
            if table.num_shards == 1:
                shard, local_ids = None, [unique_ids]
            else:
                shard, local = sharding.shard_of(unique_ids, table.num_shards)
                local_ids = tf.dynamic_partition(local, shard, table.num_shards)
        sent.append((shard, [outbox.put(source, part.device, ids)
                             for part, ids in zip(table.shards, local_ids)]))
    return sent


def send_rows(arrived, requests, sent, outbox, destinations=None):
    """Gathers on each shard's PS the rows of the ids that `arrived` there (`send_ids`),
    and puts them in `outbox`, to the request's device in `destinations` (by default
    its ids' device). Returns the tickets, for `rows_arrived`."""
    tickets = []
    for (table, unique_ids), (shard, id_tickets), destination in zip(
            requests, sent, destinations or [None] * len(requests)):
        held = []
        for part, ticket in zip(table.shards, id_tickets):
            ids = arrived[ticket]
            held.append(ids)
            with tf.device(part.device):
                rows = gen_resource_variable_ops.resource_gather(part.handle, ids,
                                                                 dtype=table.dtype)
                rows = wire.to_wire(rows, table.wire_dtype)
            tickets.append(outbox.put(part.device, destination or unique_ids.device, rows))
        _note_ids_on_ps(unique_ids, shard, held)
    return tickets


def rows_arrived(returned, requests, sent, tickets, devices=None):
    """The rows of each request, in the order of its unique ids, made on its device in
    `devices` (by default the current one) from what `send_rows` put in its outbox, as
    `returned` by its delivery."""
    tickets = iter(tickets)
    rows = []
    for (table, unique_ids), (shard, _), device in zip(requests, sent,
                                                       devices or [None] * len(requests)):
        with tf.device(device) if device else contextlib.nullcontext():
            parts = [wire.from_wire(returned[next(tickets)], table.dtype)
                     for _ in range(table.num_shards)]
            if shard is None:
                rows.append(parts[0])
            else:
                positions = tf.dynamic_partition(tf.range(tf.shape(unique_ids)[0]), shard,
                                                 table.num_shards)
                rows.append(tf.dynamic_stitch(positions, parts))
    return rows


def _note_ids_on_ps(unique_ids, shard, held):
    if not tf.executing_eagerly():
        _IDS_ON_PS.setdefault(unique_ids.graph, {})[unique_ids.name] = (shard, tuple(held))


def ids_on_ps(indices):
    """`(shard of each id or None, ids held on each shard's PS task)` when `indices` are
    the unique ids of one lookup (`lookup_many`), whose shard-local ids every shard's PS
    task received for it; else None. The gradient of that lookup, split as `shard`
    says (`tf.dynamic_partition`), has those ids, in that order, on each shard."""
    if tf.executing_eagerly() or not hasattr(indices, "graph"):
        return None
    while indices.op.type == "Identity" and indices.name not in _IDS_ON_PS.get(
            indices.graph, {}):
        indices = indices.op.inputs[0]
    return _IDS_ON_PS.get(indices.graph, {}).get(indices.name)


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup, {"params": ShardedTable})
def _embedding_lookup(params, ids, max_norm=None, name=None):
    if max_norm is not None:
        raise ValueError(
            f"embedding_lookup(max_norm=...) is not supported on PS table {params.path}; "
            "clip the looked-up rows yourself, or place the table 'mirrored'.")
    return lookup(params, ids, name=name)


@tf.experimental.dispatch_for_api(tf.shape, {"input": ShardedTable})
def _table_shape(input, out_type=None, name=None):  # pylint: disable=redefined-builtin
    # The static shape: converting the table would read every row (and in a
    # tf.function that read would run every step, unused or not).
    return tf.constant(input.shape.as_list(), dtype=out_type or tf.int32, name=name)


def remember_gradient(tensor, table, distinct=False):
    """Notes that `tensor` (a lookup's unique ids, a read's gradient) is `table`'s, and
    whether its ids are `distinct` (see `distinct_rows`)."""
    if not tf.executing_eagerly():
        _LOOKUPS.setdefault(tensor.graph, {})[tensor.name] = table
        if distinct:
            _DISTINCT.setdefault(tensor.graph, set()).add(tensor.name)
    return tensor


def distinct_rows(indices):
    """Whether `indices` are one lookup's unique ids (the gradient of a single lookup),
    so that no row repeats; False when that is not known."""
    if tf.executing_eagerly() or not hasattr(indices, "graph"):
        return False
    return indices.name in _DISTINCT.get(indices.graph, ())


def table_of_gradient(tensor, depth=6):
    """The PS table a gradient belongs to, from its indices (sparse) or itself (dense).

    None when the gradient was not produced by this module's reads alone (for
    instance the tape summed a lookup's and a whole read's gradients).
    """
    if tf.executing_eagerly() or not hasattr(tensor, "graph"):
        return None
    lookups = _LOOKUPS.get(tensor.graph)
    if not lookups:
        return None
    return _resolve(tensor, lookups, depth)


def _resolve(tensor, lookups, depth):
    if tensor.name in lookups:
        return lookups[tensor.name]
    if depth == 0:
        return None
    op = tensor.op
    if op.type in _PASS_THROUGH_OPS:
        return _resolve(op.inputs[0], lookups, depth - 1)
    if op.type == "ConcatV2":  # the tape merging several lookups of one table
        tables = {id(t): t for t in
                  (_resolve(x, lookups, depth - 1) for x in op.inputs[:-1])}
        if len(tables) == 1 and None not in tables.values():
            return next(iter(tables.values()))
    return None


def keras_variable_shape(input, out_type=None, name=None):  # pylint: disable=redefined-builtin
    """`tf.shape` of a Keras 3 variable: its static shape when fully defined.

    Static, without reading the variable: Keras' `ops.take` asks for it before the
    row read, which may move the variable to a PS (`on_row_read`). An `out_type`
    `tf.shape` refuses goes to `tf.shape`, for its error.
    """
    value = table_behind(input) or input.value
    if value.shape.is_fully_defined() and out_type in (None, tf.int32, tf.int64):
        return tf.constant(value.shape.as_list(), dtype=out_type or tf.int32, name=name)
    return tf.shape(value, out_type=out_type, name=name)


def keras_variable_embedding_lookup(params, ids, max_norm=None, name=None):
    """`tf.nn.embedding_lookup` of a Keras 3 variable: by row when it wraps a PS table
    (TensorFlow would read a Keras variable whole before gathering)."""
    value = table_for_row_read(params)
    return tf.nn.embedding_lookup(params.value if value is None else value, ids,
                                  max_norm=max_norm, name=name)


def table_for_row_read(keras_variable):
    """The PS table a Keras 3 variable read by row wraps (after `on_row_read`
    handlers had their say), or None."""
    value = getattr(keras_variable, "_value", None)
    for handler in _ROW_READ_HANDLERS if not is_table(value) else ():
        value = handler(keras_variable) or value
    return value if is_table(value) else None


def on_row_read(handler):
    """Registers `handler(keras_variable)`, called when `tf.gather` reads by row a
    Keras 3 variable that wraps no PS table; it returns a table to read instead (the
    variable now wraps it) or None. Registering the same handler twice is a no-op."""
    if handler not in _ROW_READ_HANDLERS:
        _ROW_READ_HANDLERS.append(handler)


def call_checking_ids(call, layer, inputs):
    """`call(layer, inputs)`, an Embedding layer's own call, after checking its ids.

    Keras 3 turns a negative id -i into row `rows - i` before it reaches the table
    (numpy's `take`), and either flavour casts float ids to int32. Checked here,
    before that, a bad id gets the same error whether its table is on a PS or
    mirrored: out of range, or not a whole number. The table's lookup then skips
    its own check.
    """
    inputs = checked_layer_ids(layer, inputs)
    with _ids_checked_for(table_behind(layer.embeddings) or layer.embeddings):
        return call(layer, inputs)


def checked_layer_ids(layer, ids):
    """`checked_ids` of an Embedding layer's ids, naming its table."""
    return checked_ids(ids, layer.input_dim, f"table {_path_of(layer.embeddings)}")


def _path_of(weight):
    """A weight's name as users see it in `model.weights`: Keras 3's path (which a PS
    table's path is too), or tf_keras' variable name without its ":0"."""
    return getattr(weight, "path", None) or weight.name.rsplit(":", 1)[0]
