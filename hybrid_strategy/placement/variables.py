"""Where each variable of a HybridStrategy is created, and its moves after the first step.

`Placer` executes the `PlacementPolicy`'s decisions (plan.py): it creates PS tables
and mirrored variables as the policy says, keeps what it needs to move a variable
later (its Keras variable, its optimizer slots), moves a mirrored variable read by
row onto the PS and a PS table with a dense gradient to mirrored, and records
each trainable variable's gradient type.

```python
placer = Placer(options.placement_policy(num_ps=2), topology, container, create_mirrored)
variable = placer.create(next_creator, kwargs, create_mirrored)
```
"""

import contextlib
import functools
import warnings
import weakref

import tensorflow as tf

# TF-private: picks one replica's value of per-replica update arguments.
from hybrid_strategy.tensorflow_private import distribute_utils
# TF-private: ResourceVariable made directly skips the variable creator stack, for
# the shards of a table that replaces a mirrored variable during a traced step.
from hybrid_strategy.tensorflow_private import resource_variable_ops

from hybrid_strategy import errors
from hybrid_strategy.asynchronous import training as asynchronous_lib
from hybrid_strategy.placement import creation
from hybrid_strategy.placement import mirroring
from hybrid_strategy.placement import plan as placement_lib
from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.tables import table as table_lib


class Placer:
    """Creates a strategy's variables where its policy decides, and moves them later.

    Args:
        policy: The `PlacementPolicy` that decides.
        topology: The strategy's `Topology` (its devices, wire dtype, whether it
            trains asynchronously).
        container: `container()` is the strategy, which TensorFlow's variables of
            asynchronous training hold.
        create_mirrored: `create_mirrored(**kwargs)` makes a mirrored variable on every
            replica, with no placement of its own (a PS table's copy once it moves).
    """

    def __init__(self, policy, topology, container, create_mirrored):
        self._policy = policy
        self._topology = topology
        self._ps_devices = topology.ps_devices
        self._strategy = container
        self._create_mirrored = create_mirrored
        # Mirrored variable -> its VariableInfo, and mirrored variable or table ->
        # the Keras 3 slots made beside it (weak references), for moving it to a PS
        # when it is read by row; table -> its Keras 3 variable, for moving it to
        # mirrored when its gradient is dense (`mirror_dense_tables`).
        self._variable_infos = {}
        self._slots_of = {}
        self._keras_variables = {}
        # PS table -> the `Placement` it was given, whose bytes a move to mirrored frees.
        self._placements = {}
        # PS tables found to get a dense gradient in Keras' first step.
        self._dense_tables = []
        self._mirroring_after_step = False
        self._overrides_checked = False
        # A path's latest type; each variable is examined once, by itself: a second
        # model under this strategy reuses the first one's paths.
        self.gradient_types = {}
        self._examined = set()

    @property
    def plan(self):
        """The `PlacementPlan`: the policy's decisions, with the moves this placer made."""
        return self._policy.plan

    def add_dynamic(self, path, stats):
        """Lists the DynamicEmbedding whose rows are `path` in the plan (`stats()`: its
        figures, or None once the layer is gone)."""
        self._policy.plan = self._policy.plan.with_dynamic(path, stats)

    def create(self, next_creator, kwargs, create_mirrored):
        """The strategy's `_create_variable`: a PS table, a shared variable (asynchronous
        training) or `create_mirrored(**kwargs)`, as the policy decides; an optimizer
        slot goes where its variable is."""
        colocate_with = kwargs.get("colocate_with")
        context = creation.creation_context()
        if self._topology.asynchronous and asynchronous_lib.is_shared(colocate_with):
            return asynchronous_lib.create_shared(
                next_creator, kwargs, colocate_with.device, self._strategy(),
                self._topology.replicas_per_worker)
        if colocate_with is not None:
            # An optimizer slot: a PS table's is sharded exactly like the table, a
            # mirrored variable's is mirrored; Keras 3's move with their variable.
            if table_lib.is_table(colocate_with):
                kwargs.pop("colocate_with")
                path = f"{colocate_with.path}/{kwargs.get('name') or 'slot'}"
                slot = self.create_table(next_creator, kwargs, path, colocate_with.shape,
                                         colocate_with.devices, context.initializer)
            else:
                slot = create_mirrored(**kwargs)
            if context.keras_variable is not None:
                self._slots_of.setdefault(colocate_with.ref(), []).append(
                    weakref.ref(context.keras_variable))
            return slot
        info = creation.describe_variable(kwargs, context)
        decided = self._policy.decide(info)
        if decided.kind == placement_lib.PS:
            devices = [self._ps_devices[shard.task or 0] for shard in decided.shards]
            table = self.create_table(next_creator, kwargs, info.path, info.shape,
                                      devices, context.initializer)
            self._placements[table.ref()] = decided
            if context.keras_variable is not None:
                self._keras_variables[table.ref()] = weakref.ref(context.keras_variable)
            return table
        if (decided.kind == placement_lib.SHARED
                and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ):
            return asynchronous_lib.create_shared(
                next_creator, kwargs, self._ps_devices[decided.shards[0].task or 0],
                self._strategy(), self._topology.replicas_per_worker)
        variable = create_mirrored(**kwargs)
        self._variable_infos[variable.ref()] = info
        return variable

    def create_table(self, next_creator, kwargs, path, shape, devices, initializer,
                     table_class=table_lib.ShardedTable):
        """A ShardedTable of one shard variable per device in `devices` (shard k: k::S)."""
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        initial_values = table_lib.shard_initial_values(
            kwargs["initial_value"], initializer, shape, dtype, len(devices))
        name = kwargs.get("name") or path.rsplit("/", 1)[-1]
        shards = []
        for k, (device, rows, initial_value) in enumerate(
                zip(devices, sharding.shard_rows(tf.TensorShape(shape)[0], len(devices)),
                    initial_values)):
            shard_kwargs = dict(kwargs, initial_value=initial_value,
                                name=f"{name}/part_{k}" if len(devices) > 1 else name)
            if shard_kwargs.get("shape") is not None:
                shard_kwargs["shape"] = tf.TensorShape([rows]).concatenate(
                    tf.TensorShape(shape)[1:])
            with tf.device(device):
                shards.append(next_creator(**shard_kwargs))
        return table_class(shards, path, name=name, wire_dtype=self._topology.wire_dtype)

    def move_to_ps(self, keras_variable):
        """Moves a mirrored Keras 3 variable that is read by row onto the PS.

        Called at its first row read (`tf.gather`, `ops.take`,
        `tf.nn.embedding_lookup`), which in training is the first traced step,
        before its gradient exists: its value and its optimizer slots' values
        become PS tables sharded as the policy decides, and the Keras variable
        (and slots) wrap those from then on. Returns the table, or None when the
        variable stays mirrored (pinned by an override, `architecture=
        "allreduce"`, not trainable, or not made by this strategy).
        """
        mirrored = keras_variable._value
        info = self._variable_infos.get(mirrored.ref())
        # A table moved to mirrored for its dense gradient stays there.
        if (info is None or not mirrored.trainable
                or isinstance(mirrored, mirroring.MirroredTable)):
            return None
        decided = self._policy.move_to_ps(info, "read by row (moved at its first read)")
        if decided is None:
            return None
        devices = [self._ps_devices[shard.task or 0] for shard in decided.shards]
        slots = [s() for s in self._slots_of.pop(mirrored.ref(), ()) if s() is not None]
        with tf.init_scope():
            table = self._table_from(
                mirrored, info.path, devices,
                functools.partial(_MovedTable, replaced_id=mirrored._unique_id))
            for slot in slots:
                slot._value = self._table_from(
                    slot._value, f"{info.path}/{slot.name}", devices, table_lib.ShardedTable)
        keras_variable._value = table
        self._placements[table.ref()] = decided
        self._keras_variables[table.ref()] = weakref.ref(keras_variable)
        self._slots_of[table.ref()] = [weakref.ref(slot) for slot in slots]
        # The mirrored copies are not kept (the table is the variable now).
        del self._variable_infos[mirrored.ref()]
        return table

    def _table_from(self, mirrored, path, devices, table_class):
        """A PS table holding the current value of `mirrored` (one replica's copy)."""
        value = mirrored.values[0].read_value()
        kwargs = dict(initial_value=value, dtype=mirrored.dtype,
                      trainable=mirrored.trainable, name=path.rsplit("/", 1)[-1])
        return self.create_table(
            lambda **kw: resource_variable_ops.ResourceVariable(**kw), kwargs, path,
            mirrored.shape, devices, None, table_class)

    def note_gradient_type(self, var, args):
        """Records each trainable variable's gradient type; warns once on a misfit."""
        if not args:
            return
        grad = distribute_utils.select_replica(0, args[0])
        if isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
            self.record_gradient_type(var, isinstance(grad, tf.IndexedSlices))

    def record_gradient_type(self, var, sparse):
        """Records a trainable variable's gradient type in a traced training step.

        A PS table's type is what its replicas' gradients are (`_batch_reduce_to`
        records it before a penalty's gradient is added on the PS). A misfit is
        warned about once; a PS table with a dense gradient in Keras' first step is
        noted for `mirror_dense_tables` instead.
        """
        # Eager updates are assignments (set_weights, restores), not training steps.
        if not tf.inside_function() or not getattr(var, "trainable", False):
            return
        self._check_overrides_once()
        if table_lib.is_table(var):
            path, kind = var.path, placement_lib.PS
        else:
            info = self._variable_infos.get(var.ref())
            path, kind = info and info.path, placement_lib.MIRRORED
        if path is None or var.ref() in self._examined:
            return
        self._examined.add(var.ref())
        self.gradient_types[path] = "sparse" if sparse else "dense"
        if kind == placement_lib.PS and not sparse and self._policy.asynchronous:
            # Never moved (architecture "ps"): said here, in whichever worker's trace,
            # not left to the chief's first call (`mirroring_after_step`), which other
            # workers' traces may outlast.
            _warn_staying(path, self._stays_on_ps(var))
            return
        if kind == placement_lib.PS and not sparse and self._mirroring_after_step:
            self._dense_tables.append(var)
            return
        advice = placement_lib.gradient_misfit(kind, sparse)
        if advice:
            _warn_misfit(path, f"{advice} (override with placement_overrides="
                               f"{{'{path}': ...}})")

    @contextlib.contextmanager
    def mirroring_after_step(self):
        """While Keras' first training step runs (placement/mirroring.py): PS tables found to get
        a dense gradient are noted for `mirror_dense_tables`, not warned about."""
        self._mirroring_after_step = True
        try:
            yield
        finally:
            self._mirroring_after_step = False

    def mirror_dense_tables(self):
        """Moves the PS tables noted in `mirroring_after_step` to mirrored; True if any moved.

        A Keras 3 table moves with its value and optimizer slots (its Keras
        variable and theirs wrap mirrored variables from then on), unless it stays
        (`_stays_on_ps`); one that stays is warned about, saying why. The step must
        then be traced again.
        """
        tables, self._dense_tables = self._dense_tables, []
        moved = False
        for table in tables:
            path = table.path
            why = self._stays_on_ps(table)
            if why is not None:
                _warn_staying(path, why)
                continue
            self._policy.move_to_mirrored(
                path, "dense gradient (moved after the first step)",
                self._placements.pop(table.ref(), None),
                table.shape[1:].num_elements() * table.dtype.size)
            keras_variable = self._keras_variables.pop(table.ref())()
            slots = [ref() for ref in self._slots_of.pop(table.ref(), ())]
            with tf.init_scope():
                mirrored = mirroring.mirrored_copy(self._create_mirrored, table,
                                                   replaced_id=table._unique_id)
                for slot in (slot for slot in slots if slot is not None):
                    slot._value = mirroring.mirrored_copy(self._create_mirrored, slot._value)
            keras_variable._value = mirrored
            self._variable_infos[mirrored.ref()] = placement_lib.VariableInfo(
                path, tuple(table.shape.as_list()), table.dtype.size)
            moved = True
        return moved

    def _stays_on_ps(self, table):
        """Why a PS table with a dense gradient cannot move to mirrored, or None."""
        keras_variable = self._keras_variables.get(table.ref(), lambda: None)()
        if keras_variable is None:
            return "it is not the value of a Keras 3 variable, which could be replaced"
        slots = sum(s() is not None for s in self._slots_of.get(table.ref(), ()))
        replicas = self._topology.replicas_per_worker
        nbytes = table.shape.num_elements() * table.dtype.size
        return self._policy.stays_on_ps(table.path, nbytes * (1 + slots) * replicas)

    def _check_overrides_once(self):
        """Warns, at the first traced training step, about overrides that matched nothing."""
        if self._overrides_checked:
            return
        self._overrides_checked = True
        unmatched = self._policy.unmatched_overrides()
        if unmatched:
            known = ", ".join(record.path for record in self.plan)
            warnings.warn(
                f"HybridStrategy: placement_overrides pattern(s) {unmatched} match no "
                "variable. Patterns match a variable's path as in model.weights, its "
                f"'layer/variable' tail, or a layer name on the path; known paths: "
                f"{known or '(none)'}.", errors.PlacementWarning, stacklevel=3)


def _warn_misfit(path, advice):
    warnings.warn(f"HybridStrategy: variable '{path}' {advice}. Training stays correct.",
                  errors.PlacementWarning, stacklevel=4)


def _warn_staying(path, why):
    _warn_misfit(path, "is on a PS but gets a dense gradient: the whole variable crosses "
                       f"the network every step. It stays on the PS: {why}")


class _MovedTable(table_lib.ShardedTable):
    """A PS table that took a mirrored variable's place (`HybridExtended.move_to_ps`).

    Keras 3 optimizers know a variable by its TensorFlow variable's `_unique_id`;
    the table keeps the mirrored variable's, so the optimizer still finds its slots.
    """

    def __init__(self, shards, path, name=None, wire_dtype=None, *, replaced_id):
        super().__init__(shards, path, name=name, wire_dtype=wire_dtype)
        self._replaced_id = replaced_id

    @property
    def _unique_id(self):
        return self._replaced_id
