"""Keras optimizers on PS tables: each optimizer's own update rule, run on the table's rows.

Keras (3 and tf_keras) updates a variable under a `tf.distribute` strategy by
handing the strategy a closure that calls `optimizer.update_step(gradient,
variable, ...)`. For a PS table the strategy runs that closure here
(`update_table`) with the table and each of its optimizer slots standing in for
some of their rows (`RowsView`): the optimizer's reads of them return those rows,
its writes (`assign`, `assign_add`, `assign_sub`) replace them, and the rows are
written back to their shards afterwards. So every Keras optimizer updates a table
by its own rule, hyperparameters, learning-rate schedule and step count, with no
copy of any rule here. What the rows are depends on the `mode`:

- `"lazy"`: the step's rows (those with a gradient) of the table and of each slot;
  rows without gradient keep their values and slots. A step costs the rows it
  touches, whatever the table's size.
- `"exact"`: every row, with the densified gradient: the step of training with
  dense gradients (rows without gradient still move by momentum, moment decay,
  weight decay).

And where the rule runs depends on how it relates a variable's rows
(`coupling`): a rule that treats each row on its own runs on every shard, on its
ps task, in parallel (SGD, Adagrad, Adam, AdamW, RMSprop, Adadelta, Adamax, Nadam,
Ftrl, Lion, ScheduleFreeAdamW, Muon's AdamW update); Lamb's trust ratio is taken
over all the rows being updated, so its rule runs once on them, gathered from
every shard onto the first shard's ps task; Adafactor's factored moments and
update clipping, and Muon's orthogonalised update, span the whole variable, so
both modes run them on the whole table there. Decoupled weight decay (`AdamW`,
`weight_decay=`) shrinks every row in exact mode and the step's rows in lazy mode.

```python
import keras
import tensorflow as tf
from hybrid_strategy.tables import sparse_optimizers

optimizer = keras.optimizers.AdamW(learning_rate=0.1)
print(sparse_optimizers.coupling(optimizer, keras.Variable(tf.ones((6, 2)))))  # rows
optimizer.use_ema = True
try:
    sparse_optimizers.check(optimizer, "words/embeddings")
except sparse_optimizers.UnsupportedOptimizerError as e:
    print(e)
```
"""

import contextlib
import sys
import threading
import weakref

import tensorflow as tf

from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.tables import mirrored_reads
from hybrid_strategy.tables import table as table_lib

MODES = ("lazy", "exact")

# How an optimizer's update rule relates the rows of a variable (`coupling`).
ROWS = "rows"                    # each row on its own; rows without gradient move too
ROWS_STILL = "rows_still"        # each row on its own; rows without gradient stay still
ROWS_TOGETHER = "rows_together"  # one statistic over the rows being updated
WHOLE = "whole"                  # statistics over the whole variable, in every mode

_KERAS, _TF_KERAS, _LEGACY = "keras", "tf_keras", "tf_keras.optimizers.legacy"

# The shipped optimizer classes whose `update_step` runs on tables, by name.
_COUPLINGS = {
    # Keras 3's SGD keeps no slot without momentum; tf_keras' keeps one that moves.
    "SGD": lambda optimizer, variable, flavour: (
        ROWS_STILL if flavour == _KERAS and not optimizer.momentum else ROWS),
    "Adagrad": ROWS_STILL,
    "Adam": ROWS, "AdamW": ROWS, "RMSprop": ROWS, "Adadelta": ROWS, "Adamax": ROWS,
    "Nadam": ROWS,  # Keras 3's; tf_keras' is refused (`_problem`)
    "Ftrl": ROWS, "Lion": ROWS, "ScheduleFreeAdamW": ROWS,
    "Lamb": ROWS_TOGETHER,
    "Adafactor": WHOLE,
    # Muon takes AdamW's step for embeddings (paths holding "embedding", by default),
    # variables not of rank 2 and `exclude_layers`; its own step orthogonalises the
    # whole matrix.
    "Muon": lambda optimizer, variable, flavour: (
        ROWS if optimizer._should_use_adamw(variable) else WHOLE),
}


class UnsupportedOptimizerError(TypeError):
    """An optimizer, or one of its settings, cannot update a PS table.

    The message names the table and the placement override that trains it as a
    mirrored variable instead.

    ```python
    import keras
    from hybrid_strategy.tables import sparse_optimizers
    optimizer = keras.optimizers.Adam(gradient_accumulation_steps=4)
    try:
        sparse_optimizers.check(optimizer, "item/embeddings")
    except sparse_optimizers.UnsupportedOptimizerError as e:
        print(e)
    ```
    """

    # AutoGraph re-raises an error from a traced step as its own type only if its
    # constructor is Exception's (else as a StagingError): tf_keras builds its
    # optimizer while it traces the first step.
    __init__ = Exception.__init__


def check(optimizer, path):
    """Raises `UnsupportedOptimizerError` if `optimizer` cannot update PS table `path`.

    `optimizer` is the one that updates the table: for a `LossScaleOptimizer`, its
    inner optimizer; for a `MultiOptimizer`, the one it assigns to the table.
    Refused: optimizers not shipped with Keras 3 or tf_keras (and subclasses that
    replace `update_step`), tf_keras' legacy optimizers and its Nadam,
    `use_ema=True`, Keras 3's `gradient_accumulation_steps` and a tf_keras DTensor
    mesh.

    ```python
    import keras
    from hybrid_strategy.tables import sparse_optimizers
    sparse_optimizers.check(keras.optimizers.Ftrl(), "wide/embeddings")   # fine
    ```
    """
    problem = _problem(optimizer)
    if problem:
        raise UnsupportedOptimizerError(
            f"HybridStrategy cannot update PS table '{path}' with {_describe(optimizer)}: "
            f"{problem}. To train this table with it anyway, place the table mirrored: "
            f"HybridStrategy(placement_overrides={{'{path}': 'mirrored'}}).")


def _optimizer_for(optimizer, variable):
    """The optimizer that updates `variable`: through a `LossScaleOptimizer` to the
    optimizer it wraps, through a Keras 3 `MultiOptimizer` to the one it assigns to
    `variable` (a Keras 3 variable)."""
    while True:
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is not None:
            optimizer = inner
        elif hasattr(optimizer, "_optimizer_map"):
            optimizer = optimizer._optimizer_map(variable)
        else:
            return optimizer


def coupling(optimizer, variable):
    """How `optimizer`'s update rule relates the rows of `variable`.

    `ROWS`: each row on its own, and rows without gradient move too (momentum,
    moment decay); `ROWS_STILL`: each row on its own, rows without gradient stay
    still (Adagrad, SGD without momentum: lazy updates are exact); `ROWS_TOGETHER`:
    one statistic over all the rows being updated (Lamb's trust ratio); `WHOLE`:
    statistics over the whole variable whatever the mode (Adafactor, Muon's own
    update).

    ```python
    import keras
    from hybrid_strategy.tables import sparse_optimizers
    table = keras.Variable(keras.ops.ones((100, 8)), name="embeddings")
    print(sparse_optimizers.coupling(keras.optimizers.Lamb(), table))   # rows_together
    ```
    """
    flavour, name = _rule_of(optimizer)
    rule = _COUPLINGS.get(name) if flavour in (_KERAS, _TF_KERAS) else None
    if rule is None:
        raise UnsupportedOptimizerError(f"{_describe(optimizer)}: {_problem(optimizer)}")
    return rule(optimizer, variable, flavour) if callable(rule) else rule


def is_weight_decay(fn):
    """Whether `fn`, handed to the strategy's update, is a Keras optimizer's weight decay.

    Keras 3 and tf_keras apply decoupled weight decay through the strategy with a
    closure named `weight_decay_fn(variable)`, before the update of the same step.
    """
    return getattr(fn, "__name__", None) == "weight_decay_fn"


def update_table(optimizer, fn, table, grads, args=(), kwargs=None, mode="lazy",
                 concurrent=False, copy_on=None):
    """Runs Keras' update closure `fn(variable, gradient, *args)` on `table`'s rows.

    `grads` holds the step's summed gradient of each shard of `table`, with
    shard-local rows: `tf.IndexedSlices` with distinct indices, or dense tensors
    of the shard's shape. The table and its optimizer slots stand in for the rows
    `mode` updates, on each shard's ps task or together on the first shard's
    (`coupling`); a weight decay deferred by `decay_table` is applied to the same
    rows first. Returns the op that writes the rows back.

    `concurrent=True` (asynchronous training: other steps may update the same rows
    meanwhile) writes each row's change since it was read, added by the shard's own
    atomic operation, so that no step's update overwrites another's. `copy_on(tensor,
    device)`: a copy of an argument already on the ps task's `device`, or None.
    """
    _check_mode(mode)
    kind = coupling(optimizer, table)
    decays = _take_deferred_decays(table)
    tables = [table] + _slots_of(optimizer, table)
    views = []
    for selection, grad in _selections(table, grads, mode, kind):
        on_device = [_on(arg, selection.device, copy_on) for arg in args]
        views += _run_on(selection, tables, optimizer, fn,
                         decays + [lambda grad=grad, on_device=on_device:
                                   fn(table, grad, *on_device, **(kwargs or {}))])
    return _flushed(views, concurrent)


def decay_table(optimizer, fn, table, mode="lazy", concurrent=False):
    """Applies Keras' weight decay closure `fn(variable)` to `table`, or defers it.

    In exact mode, and for rules that span the whole table, every row decays, on
    each shard's ps task. In lazy mode only the step's rows do: the decay waits
    for the table's update in the same step (`update_table`), which applies it to
    those rows before the optimizer's rule. `concurrent` as for `update_table`.
    """
    _check_mode(mode)
    if mode == "lazy" and coupling(optimizer, table) != WHOLE:
        _DEFERRED_DECAYS.setdefault(_graph(), {}).setdefault(table.ref(), []).append(
            lambda: fn(table))
        return tf.no_op()
    tables = [table] + _slots_of(optimizer, table)
    views = []
    for k in range(table.num_shards):
        views += _run_on(_Selection(table, [k]), tables, optimizer, fn, [lambda: fn(table)])
    return _flushed(views, concurrent)


class RowsView:
    """Stands in for a table (or one of its slots) while an optimizer updates some rows.

    Holds the current value of the selected rows, read from their shards when made;
    `read` returns it and `write` replaces it, as the optimizer's reads and writes of
    the table reach it on this thread (`table.rows_standing_in`); `flush` writes the
    rows back. It belongs to the step being traced: its value is a tensor of that
    step's graph.

    ```python
    import tensorflow as tf
    from hybrid_strategy.tables import sparse_optimizers
    from hybrid_strategy.tables import table
    t = table.ShardedTable([tf.Variable(tf.zeros((3, 2))), tf.Variable(tf.ones((2, 2)))], "t")
    rows = sparse_optimizers.RowsView(t, [0, 1], [tf.constant([2]), tf.constant([0])])
    with table.rows_standing_in([rows]):
        t.assign_add(tf.fill((2, 2), 5.0))      # table rows 4 and 1
    rows.flush()
    print(t.numpy())
    ```

    Args:
        table: A `ShardedTable`.
        shards: The positions of the shards whose rows are selected.
        indices: For each of those shards, the shard-local rows selected, or None
            for every row of every selected shard (then several shards read as
            the table in row order, for rules that span it).
    """

    def __init__(self, table, shards, indices=None):
        self.table = table
        self._selection = _Selection(table, shards, indices)
        self._value = self._read = self._selection.read(table)
        self._written = False

    def read(self):
        return self._value

    def write(self, method, value):
        if method == "assign_add":
            value = self._value + value
        elif method == "assign_sub":
            value = self._value - value
        value.set_shape(value.shape.merge_with(self._value.shape))
        self._value = value
        self._written = True

    def flush(self, concurrent=False):
        """Writes the rows back to their shards if they were written; returns the ops.

        `concurrent`: adds their change since they were read instead.
        """
        if not self._written:
            return []
        if concurrent:
            # On the rows' ps task, where both are: the change alone crosses nowhere.
            with tf.device(self._selection.device):
                change = self._value - self._read
            return self._selection.write(self.table, change, added=True)
        return self._selection.write(self.table, self._value)


# Checks and decays the Keras hooks call (keras_integration/optimizer_hooks.py) ----


def check_built(optimizer, variables):
    """Checks `optimizer` against every PS table among `variables` it is built for."""
    # Wrappers (LossScaleOptimizer, MultiOptimizer) build the optimizers they wrap.
    if hasattr(optimizer, "inner_optimizer") or hasattr(optimizer, "_optimizer_map"):
        return
    for variable in variables:
        table = table_lib.table_behind(variable)
        if table is not None:
            check(optimizer, table.path)


def check_model(optimizer, variables):
    """Checks `optimizer` against every PS table among `variables` (`check`)."""
    for variable in variables:
        table = table_lib.table_behind(variable)
        if table is not None:
            check(_optimizer_for(optimizer, variable), table.path)


def decay_tables_once(apply_weight_decay, optimizer, variables):
    """Keras 3 Muon's `apply_weight_decay(optimizer, variables)`, with the tables
    among `variables` decayed through the strategy, once (Muon's own decay assigns
    each variable in each replica: a table would decay once per replica)."""
    tables = [table_lib.table_behind(v) for v in variables if table_lib.table_behind(v) is not None]
    apply_weight_decay(optimizer, [v for v in variables if table_lib.table_behind(v) is None])
    if not tables:
        return

    def decay(distribution, tables):
        for table in tables:
            # Muon's own decay of the table (not of the Keras variable, which
            # would check the rows' shape against the table's).
            def weight_decay_fn(table):
                apply_weight_decay(optimizer, [table])
            distribution.extended.update(table, weight_decay_fn, group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(
        decay, tf.distribute.get_strategy(), tables)


# Running the rule on rows -------------------------------------------------------


class _Selection:
    """Rows of some shards of a table: read them as one tensor, write them back."""

    def __init__(self, table, shards, indices=None):
        self.shards = list(shards)
        self.indices = indices
        self.device = table.shards[self.shards[0]].device
        self._whole = indices is None and len(self.shards) == table.num_shards > 1

    def read(self, table):
        parts = []
        for i, k in enumerate(self.shards):
            shard = table.shards[k]
            with tf.device(shard.device):
                parts.append(shard.read_value() if self.indices is None
                             else tf.gather(shard, self.indices[i]))
        if self._whole:
            # In row order, with its static shape (Muon branches on it).
            return tf.ensure_shape(sharding.join_dense(parts), table.shape)
        return parts[0] if len(parts) == 1 else tf.concat(parts, 0)

    def write(self, table, value, added=False):
        """Writes `value` to the rows, or adds it to them with `added`."""
        if self._whole:
            parts = sharding.split_dense(value, table.num_shards)
        elif len(self.shards) == 1:
            parts = [value]
        else:
            parts = tf.split(value, [tf.size(i) for i in self.indices])
        ops = []
        for i, (k, part) in enumerate(zip(self.shards, parts)):
            shard = table.shards[k]
            with tf.device(shard.device):
                if self.indices is None:
                    write = shard.assign_add if added else shard.assign
                    ops.append(write(part, read_value=False))
                else:
                    write = shard.scatter_add if added else shard.scatter_update
                    ops.append(write(tf.IndexedSlices(part, self.indices[i])))
        return ops


def _selections(table, grads, mode, kind):
    """(rows, their gradient) pairs: one per shard, or one for rules coupling rows."""
    sparse = isinstance(grads[0], tf.IndexedSlices)
    by_rows = sparse and kind != WHOLE and (mode == "lazy" or kind == ROWS_STILL)
    if by_rows:
        pairs = [(_Selection(table, [k], [g.indices]), g.values) for k, g in enumerate(grads)]
    else:
        pairs = [(_Selection(table, [k]), _dense(g, table.shards[k]))
                 for k, g in enumerate(grads)]
    if kind in (ROWS, ROWS_STILL) or len(pairs) == 1:
        return pairs
    everything = range(table.num_shards)
    with tf.device(table.shards[0].device):
        if by_rows:
            return [(_Selection(table, everything, [g.indices for g in grads]),
                     tf.concat([g for _, g in pairs], 0))]
        return [(_Selection(table, everything),
                 tf.ensure_shape(sharding.join_dense([g for _, g in pairs]), table.shape))]


def _on(value, device, copy_on):
    """`value`, or its copy on `device` if `copy_on` knows one."""
    copy = copy_on(value, device) if copy_on is not None and isinstance(value, tf.Tensor) else None
    return value if copy is None else copy


def _run_on(selection, tables, optimizer, update, steps):
    """Runs `steps` with `tables` (a table and its slots) standing in for `selection`'s rows.

    `update` is Keras' closure for the step's update: the mirrored variables the steps
    read are read once per ps task for every table it updates.
    """
    with tf.device(selection.device), mirrored_reads.reading_once(update, selection.device):
        views = [RowsView(t, selection.shards, selection.indices) for t in tables]
        with table_lib.rows_standing_in(views), _without_xla(optimizer):
            for step in steps:
                step()
    return views


def _flushed(views, concurrent):
    return tf.group([op for view in views for op in view.flush(concurrent)])


# id(optimizer) -> threads inside `_without_xla` of an optimizer whose jit_compile was on
_XLA_OFF = {}
_XLA_OFF_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_xla(optimizer):
    """tf_keras compiles updates with XLA on GPU machines, as functions of the variable
    (here a stand-in for rows): update in the strategy's graph instead.

    The setting is the optimizer's, read by every thread tracing a step with it: it
    stays off until the last thread inside leaves (an update of another variable
    traced meanwhile runs without XLA, by the same rule).
    """
    key = id(optimizer)
    with _XLA_OFF_LOCK:
        turned_off = key in _XLA_OFF or getattr(optimizer, "jit_compile", False)
        if turned_off:
            _XLA_OFF[key] = _XLA_OFF.get(key, 0) + 1
            optimizer.jit_compile = False
    try:
        yield
    finally:
        if turned_off:
            with _XLA_OFF_LOCK:
                _XLA_OFF[key] -= 1
                if not _XLA_OFF[key]:
                    del _XLA_OFF[key]
                    optimizer.jit_compile = True


def _slots_of(optimizer, table):
    """The optimizer's slot tables of `table`: the strategy names them '<table path>/<slot>'."""
    prefix = table.path + "/"
    slots = []
    for variable in optimizer.variables:
        slot = table_lib.table_behind(variable)
        if slot is not None and slot.path.startswith(prefix):
            slots.append(slot)
    return slots


def _dense(grad, shard):
    if not isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    # The shard's shape on its own PS: read elsewhere, it would cross the network each step.
    with tf.device(shard.device):
        shape = tf.shape(shard, out_type=grad.indices.dtype)
        return tf.scatter_nd(tf.expand_dims(grad.indices, -1), grad.values, shape)


# Weight decays waiting for their table's update in this step (lazy mode), by graph.
_DEFERRED_DECAYS = weakref.WeakKeyDictionary()


def _graph():
    return tf.compat.v1.get_default_graph()


def _take_deferred_decays(table):
    return _DEFERRED_DECAYS.get(_graph(), {}).pop(table.ref(), [])


# Which optimizers ----------------------------------------------------------------


def _flavour(optimizer):
    for flavour, module, base in ((_KERAS, "keras", "Optimizer"),
                                  (_TF_KERAS, "tf_keras", "Optimizer")):
        optimizers = getattr(sys.modules.get(module), "optimizers", None)
        if optimizers is not None and isinstance(optimizer, getattr(optimizers, base)):
            return flavour
        legacy = getattr(optimizers, "legacy", None)
        if legacy is not None and isinstance(optimizer, legacy.Optimizer):
            return _LEGACY
    return None


def _rule_of(optimizer):
    """(flavour, name of the shipped class whose `update_step` `optimizer` runs or None)."""
    flavour = _flavour(optimizer)
    if flavour not in (_KERAS, _TF_KERAS):
        return flavour, None
    optimizers = sys.modules[flavour].optimizers
    for cls in type(optimizer).__mro__:
        if "update_step" in vars(cls):
            shipped = getattr(optimizers, cls.__name__, None) is cls
            return flavour, cls.__name__ if shipped else None
    return flavour, None


def _problem(optimizer):
    """Why `optimizer` cannot update a PS table, or None."""
    flavour, name = _rule_of(optimizer)
    if flavour == _LEGACY:
        return (f"tf_keras' legacy optimizers apply fused kernels to whole variables; use "
                f"tf_keras.optimizers.{type(optimizer).__name__} (the non-legacy class)")
    if name not in _COUPLINGS:
        shipped = ", ".join(sorted(_COUPLINGS))
        return (f"its update rule is not one shipped with Keras 3 or tf_keras ({shipped}, "
                "and their subclasses that keep the shipped update_step)")
    if flavour == _TF_KERAS and name == "Nadam":
        return ("tf_keras' Nadam counts its momentum schedule in Python, which a traced "
                "step miscounts (its product decays once per variable and step, on one "
                "device too), so no placement trains it as written; use Keras 3's "
                "keras.optimizers.Nadam, or another optimizer")
    problems = []
    if getattr(optimizer, "use_ema", False):
        problems.append("use_ema=True (the moving average moves every row each step, and "
                        "Keras reads the table whole to update it in every replica)")
    if flavour == _KERAS and optimizer.gradient_accumulation_steps:
        problems.append(f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
                        " (Keras accumulates gradients in dense buffers the size of the "
                        "table)")
    if flavour == _TF_KERAS and getattr(optimizer, "_mesh", None) is not None:
        problems.append("a DTensor mesh")
    return "; ".join(problems) or None


def _describe(optimizer):
    cls = type(optimizer)
    return f"{cls.__qualname__} (from {cls.__module__})"


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
