"""HybridStrategy: dense variables mirrored and all-reduced, embedding tables on PS tasks.

One coordinator process (this one, TF_CONFIG task `chief`) drives every `worker` and
`ps` task of the cluster. A training step is one `tf.function` replicated in-graph
on every worker device, as MirroredStrategy does on one machine; variables that
`placement` assigns to a PS live there once and are read and updated by row.

```python
import keras, hybrid_strategy
strategy = hybrid_strategy.HybridStrategy()      # TF_CONFIG if set, else this machine
with strategy.scope():
    model = keras.Sequential([keras.layers.Embedding(1000, 8),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
print(strategy.placement)
```
"""

import atexit
import contextlib
import functools
import inspect
import itertools
import warnings
import weakref

import tensorflow as tf

# TF-private: MirroredExtended is the in-graph replication engine we extend (TF's
# public MirroredStrategy refuses remote devices in eager mode); the other modules
# are the helpers it is built from (per-replica values, collective options,
# the update/merge plumbing).
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import values as values_lib
# TF-private: tells whether a graph is a tf.while_loop body (steps_per_execution).
from tensorflow.python.ops import control_flow_util_v2
# TF-private: the registry whose absence makes a traced function skip removing itself
# from the eager context when it is garbage-collected (see _keep_functions_at_exit).
from tensorflow.python.eager.polymorphic_function import atomic_function
# TF-private: ResourceVariable made directly skips the variable creator stack, for
# the shards of a table that replaces a mirrored variable during a traced step.
from tensorflow.python.ops import resource_variable_ops

from hybrid_strategy.asynchronous import training as asynchronous_lib
from hybrid_strategy.keras_integration import batches
from hybrid_strategy.keras_integration import install
from hybrid_strategy.cluster import config as cluster_lib
from hybrid_strategy.communication import aggregation as communication
from hybrid_strategy.placement import creation
from hybrid_strategy.cluster import data_service
from hybrid_strategy.communication import hierarchical_allreduce
from hybrid_strategy.cluster import liveness
from hybrid_strategy.tables import mirrored_reads
from hybrid_strategy.placement import mirroring
from hybrid_strategy.tables import penalties
from hybrid_strategy.placement import plan as placement_lib
from hybrid_strategy.input import service_input
from hybrid_strategy.communication import side_effects
from hybrid_strategy.tables import sparse_optimizers
from hybrid_strategy.tables import table as table_lib
from hybrid_strategy.communication import wire
from hybrid_strategy.input import worker_input

_LOCAL_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
_CHIEF_JOB = "chief"
# The cluster this process is connected to: TensorFlow keeps one per process.
_connected_cluster = None
# Collective group keys: TensorFlow's MirroredStrategy and MultiWorkerMirroredStrategy
# start theirs at 1, so a HybridStrategy in the same process starts far above, each
# with room for as many groups (sets of devices) as it could need.
_collective_key_bases = itertools.count(1 << 24, 1 << 12)


PlacementWarning = placement_lib.PlacementWarning


class HybridStrategy(tf.distribute.MirroredStrategy):
    """Mirrors dense variables on every worker device and keeps embeddings on PS tasks.

    A `tf.distribute.MirroredStrategy` in kind: dense variables are mirrored and
    all-reduced as there, so Keras features that accept MirroredStrategy by type
    (tf_keras' BackupAndRestore and mixed_float16 loss scaling) accept it too.

    With a cluster (a `cluster_resolver`, or TF_CONFIG in the environment), this
    process must be the cluster's `chief`: it connects to every `worker` and `ps`
    task (each running `python -m hybrid_strategy.server`) and replicates the
    training step on every worker device. Without one, replicas are this machine's
    devices and PS variables live on its CPU.

    Placement is decided when a layer builds its weights: weights of Keras
    `Embedding` layers (and subclasses) go to a PS task, everything else is
    mirrored; a Keras 3 weight read by row (`tf.gather`, `ops.take`,
    `tf.nn.embedding_lookup`) moves to a PS task at its first row read, and a
    Keras 3 table whose gradient turns out dense (a tied output projection)
    moves to mirrored after `fit`'s first step. Regularizers of PS tables are
    computed on their PS tasks (tables/penalties.py).
    `placement_overrides` changes that per layer or variable, and
    `strategy.placement` shows the result, by the paths of `model.weights`.

    ```python
    strategy = HybridStrategy(placement_overrides={"decoder/kernel": "ps"})
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adagrad", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3)
    ```

    Args:
        cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver`, or None
            to read TF_CONFIG (and run on this machine alone if it is unset).
        architecture: "hybrid" (default), "allreduce" (every variable mirrored) or
            "ps" (every layer weight on a PS task): one code path, so the three can
            be compared.
        placement_overrides: `{pattern: "ps" | "mirrored"}`; a pattern (fnmatch)
            matches a variable's path as in `model.weights`, its "layer/variable"
            tail, or the name of a layer on the path.
        min_shard_bytes: A PS table is split by rows over up to every PS task, in
            shards of at least this many bytes (default 1 MiB): smaller tables stay
            whole on one task.
        table_shards: `{pattern: number of shards}` for chosen tables.
        max_mirrored_bytes: A PS table that gets a dense gradient moves to
            mirrored if it takes, with its optimizer slots, at most this many
            bytes on each worker (default 2 GiB); a larger one stays, with a
            warning. 0 keeps every table on its PS.
        sparse_update: Which rows of a PS table the optimizer's update moves:
            "lazy" (default: the step's rows and their slots, so a step costs the
            same whatever the table size) or "exact" (every row, identical to
            single-device training with dense gradients). SGD without momentum and
            Adagrad are exact either way; Adafactor and Muon's own update always
            update the whole table (tables/sparse_optimizers.py).
        wire_dtype: The dtype in which rows of PS tables cross between tasks: None
            (default: the table's own) or "bfloat16" (half the bytes of float32).
            Looked-up rows leave the PS and row gradients leave the workers in it,
            and are cast back on arrival: tables, their sums across workers and
            their updates stay in the table's dtype on the PS. Training then
            differs from float32 training by bfloat16's rounding of those rows.
        devices: Single-machine mode only: the local devices to replicate over
            (default: every GPU, else the CPU).
        communication_options: `tf.distribute.experimental.CommunicationOptions`
            for the dense all-reduce (implementation, timeout).
        connect_timeout: Seconds to wait for every task to answer at start-up.
        task_timeout: Seconds a worker or ps task may stop answering during
            training before this process reports it and exits with code 75
            (EX_TEMPFAIL): the in-graph step cannot finish without it, and
            TensorFlow would otherwise wait forever; the same for the tf.data
            service dispatcher named in HYBRID_STRATEGY_DATA_SERVICE, if set.
            None disables the check.
        asynchronous: With architecture "ps": each worker trains on its own
            batches and applies its own updates, without waiting for the other
            workers, as Parallax's asynchronous PS training (asynchronous/training.py says
            what a step and the logs are then). Off by default.
    """

    def __init__(self, cluster_resolver=None, *, architecture="hybrid",
                 placement_overrides=None, min_shard_bytes=placement_lib.DEFAULT_MIN_SHARD_BYTES,
                 table_shards=None,
                 max_mirrored_bytes=placement_lib.DEFAULT_MAX_MIRRORED_BYTES,
                 sparse_update="lazy", wire_dtype=None, devices=None,
                 communication_options=None, connect_timeout=60.0, task_timeout=60.0,
                 asynchronous=False):
        if cluster_resolver is not None:
            config = cluster_lib.from_cluster_resolver(cluster_resolver)
        else:
            config = cluster_lib.from_environment()
        # Collective instances are keyed by group; a group used by an earlier
        # strategy keeps that strategy's tensor shapes, so each gets its own.
        self._collective_key_base = next(_collective_key_bases)
        extended = HybridExtended(
            self, config, architecture=architecture,
            placement_overrides=placement_overrides, min_shard_bytes=min_shard_bytes,
            table_shards=table_shards, max_mirrored_bytes=max_mirrored_bytes,
            sparse_update=sparse_update,
            wire_dtype=wire_dtype, devices=devices,
            communication_options=communication_options,
            connect_timeout=connect_timeout, task_timeout=task_timeout,
            asynchronous=asynchronous)
        # MirroredStrategy.__init__ would build its own extended object.
        tf.distribute.Strategy.__init__(self, extended)

    @property
    def architecture(self):
        return self.extended.policy.architecture

    @property
    def asynchronous(self):
        return self.extended.policy.asynchronous

    @property
    def cluster(self):
        """The `ClusterConfig` driven by this strategy, or None on one machine."""
        return self.extended.cluster

    @property
    def placement(self):
        """The `PlacementPlan` of every variable created so far (print it)."""
        return self.extended.policy.plan

    @property
    def gradient_types(self):
        """`{variable path: "sparse" | "dense"}` as seen in traced training steps."""
        return dict(self.extended.gradient_types)

    @property
    def ps_aggregated(self):
        """Paths of the PS tables whose gradients are summed per worker and on their PS."""
        return set(self.extended.ps_aggregated)


class HybridExtended(mirrored_strategy.MirroredExtended):
    """The strategy's implementation: placement, sparse aggregation, PS updates."""

    def __init__(self, container_strategy, config, *, architecture,
                 placement_overrides, min_shard_bytes, table_shards, max_mirrored_bytes,
                 sparse_update, wire_dtype, devices, communication_options, connect_timeout,
                 task_timeout, asynchronous):
        # MirroredExtended.__init__ refuses remote devices in eager mode; the
        # fields it would set are set here instead.
        distribute_lib.StrategyExtendedV1.__init__(self, container_strategy)
        self.cluster = config
        self._collective_key_base = container_strategy._collective_key_base
        self._cross_device_ops = None
        # Every argument is checked before this process connects to anything.
        self.policy = placement_lib.PlacementPolicy(
            architecture, num_ps=config.num_ps if config else 0,
            overrides=placement_overrides, min_shard_bytes=min_shard_bytes,
            table_shards=table_shards, max_mirrored_bytes=max_mirrored_bytes,
            asynchronous=asynchronous)
        # Asynchronous steps run on one worker each: while the strategy works for one
        # (`WorkerScope`), it replicates over that worker's devices only.
        self.worker_scope = asynchronous_lib.WorkerScope() if asynchronous else None
        # One object: TF's batch reduction refuses values whose cross-device ops differ.
        self._worker_reduction = cross_device_ops_lib.ReductionToOneDevice()
        if sparse_update not in sparse_optimizers.MODES:
            raise ValueError(f"sparse_update={sparse_update!r}; use one of "
                             f"{sparse_optimizers.MODES}.")
        self.sparse_update = sparse_update
        self.wire_dtype = wire.check_wire_dtype(wire_dtype)
        if config is None:
            worker_devices, ps_devices = _local_devices(devices), [_LOCAL_CPU]
        else:
            if devices is not None:
                raise ValueError(
                    "devices= is for single-machine mode; with a cluster, the "
                    "replicas are every worker's devices. Remove devices= or unset "
                    "TF_CONFIG.")
            _check_cluster(config, architecture)
            worker_devices, ps_devices = _connect(config, connect_timeout)
            if task_timeout is not None:
                liveness.HealthMonitor(config, task_timeout, liveness.exit_on_lost_task,
                                       services=data_service.watched()).start()
        self._ps_devices = ps_devices
        self._devices = tuple(worker_devices)
        hosts = {}
        for device in self._devices:
            hosts.setdefault(communication.host_of(device), []).append(device)
        self._input_workers_devices = tuple(
            (host, tuple(replicas)) for host, replicas in hosts.items())
        self._host_input_device = numpy_dataset.SingleDevice(
            self._input_workers_devices[0][0])
        self._default_device = None
        self._is_multi_worker_training = config is not None
        self._communication_options = collective_util.Options()
        self._collective_ops = self._make_collective_ops_with_fallbacks()
        chosen = communication.dense_options(self._devices, config is not None)
        if chosen is not None:
            self._communication_options = self._communication_options.merge(chosen)
        # TF-private: the per-replica collective launchers of CollectiveAllReduce.
        _assign_instance_keys_when_traced(getattr(self._collective_ops, "_launchers", ()))
        if communication_options is not None:
            self._communication_options = self._communication_options.merge(
                communication_options)
        self._dense_all_reduce = None
        if hierarchical_allreduce.applies(
                self._devices, self._communication_options.implementation.value):
            self._dense_all_reduce = hierarchical_allreduce.HierarchicalAllReduce(
                self._devices, self._collective_keys, self._communication_options)
            _assign_instance_keys_when_traced(self._dense_all_reduce.launchers)
        self._cross_device_ops = self._collective_ops
        self._inferred_cross_device_ops = self._collective_ops
        self.experimental_enable_get_next_as_optional = True
        self._use_var_policy = False
        # Mirrored variable -> its VariableInfo, and mirrored variable or table ->
        # the Keras 3 slots made beside it (weak references), for moving it to a PS
        # when it is read by row; table -> its Keras 3 variable, for moving it to
        # mirrored when its gradient is dense (`mirror_dense_tables`).
        self._variable_infos = {}
        self._slots_of = {}
        self._keras_variables = {}
        # Path -> PS table found to get a dense gradient in Keras' first step.
        self._dense_tables = {}
        self._mirroring_after_step = False
        self._overrides_checked = False
        self.gradient_types = {}
        self.ps_aggregated = set()
        self.step_batch_sizes = None
        install.install_all(HybridStrategy)
        side_effects.order_per_task()

    @property
    def _devices(self):
        worker = self.worker_scope.current() if self.worker_scope else None
        if worker is None:
            return self._all_devices
        return self._input_workers_devices[worker][1]

    @_devices.setter
    def _devices(self, devices):
        self._all_devices = tuple(devices)

    @property
    def replicas_per_worker(self):
        return max(len(replicas) for _, replicas in self._input_workers_devices)

    def _get_local_replica_id(self, replica_id_in_sync_group):
        worker = self.worker_scope.current() if self.worker_scope else None
        if worker is None:
            return replica_id_in_sync_group
        # Within one worker's step, its replica i reads and writes its own component
        # of per-replica variables (metrics): that of replica i of this worker.
        return sum(len(replicas) for _, replicas
                   in self._input_workers_devices[:worker]) + replica_id_in_sync_group

    def _broadcast_to(self, tensor, destinations):
        if asynchronous_lib.is_shared(destinations):
            # A shared variable's one value (its aggregation "only first replica").
            return tensor
        return super()._broadcast_to(tensor, destinations)

    def _get_cross_device_ops(self, value):
        if self.worker_scope and self.worker_scope.current() is not None:
            # Within one worker's step: its replicas' values meet on its host.
            return self._worker_reduction
        return super()._get_cross_device_ops(value)

    @property
    def spans_devices(self):
        """Whether replicas run on several devices or tasks (no tf.while_loop then)."""
        return self.cluster is not None or len(self._devices) > 1

    def _call_for_each_replica(self, fn, args, kwargs):
        if self.spans_devices and _inside_while_loop():
            raise NotImplementedError(
                "HybridStrategy cannot run a step inside a tf.while_loop when it spans "
                "several devices or tasks: TensorFlow 2.21 loses the loop's captured "
                "inputs across devices. Keras' compile(steps_per_execution=N) works "
                "(the strategy unrolls its N steps, except for tf_keras' predict and "
                "autotuned steps_per_execution); run your own loop in Python, or call "
                "strategy.run once per traced function.")
        # Keras' losses weight each replica by its share of the global batch, read
        # while the replicas' steps are traced (keras_integration/batches.py).
        self.step_batch_sizes = batches.replica_batch_sizes(
            args, kwargs, self._num_replicas_in_sync)
        try:
            return super()._call_for_each_replica(fn, args, kwargs)
        finally:
            self.step_batch_sizes = None

    @property
    def input_hosts(self):
        """(input device, its replicas' devices) of every worker, in replica order."""
        return self._input_workers_devices

    def _experimental_distribute_dataset(self, dataset, options):
        batches.check_dataset(dataset)
        service_input.check_dataset(dataset, len(self._input_workers_devices))
        if self.worker_scope:
            # Each step trains one global batch on one worker's replicas; evaluation
            # and prediction read TensorFlow's own distribution of the dataset.
            return asynchronous_lib.AsyncDataset(
                self._container_strategy(), self.worker_scope, dataset, options,
                functools.partial(super()._experimental_distribute_dataset, dataset,
                                  options))
        # Each worker builds only its own batches (input/worker_input.py).
        return worker_input.distribute_dataset(
            self, dataset, options, self._tensorflow_distribute)

    def _tensorflow_distribute(self, dataset, options):
        """TensorFlow's own distribution of `dataset`, read as worker_input.own_iterators says."""
        if worker_input.own_iterators(self._input_workers_devices, options) is None:
            return super()._experimental_distribute_dataset(dataset, options)
        # (MirroredStrategy's own method refuses the PER_REPLICA input this reads with.)
        return worker_input.distributed_by_tensorflow(
            dataset, self._input_workers_devices, self._container_strategy(),
            self._num_replicas_in_sync, options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if self.worker_scope:
            raise NotImplementedError(
                "HybridStrategy(asynchronous=True) cannot train on a dataset made with "
                "distribute_datasets_from_function: each worker reads every W-th global "
                "batch of one dataset. Pass fit a tf.data.Dataset batched with the global "
                "batch size (or numpy arrays); tf.data shards files among the workers.")
        reading = worker_input.own_iterators(self._input_workers_devices, options)
        if reading is None:
            return super()._distribute_datasets_from_function(dataset_fn, options)
        return super()._distribute_datasets_from_function(
            lambda context: worker_input.prefetched(dataset_fn(context), reading), reading)

    def _input_workers_with_options(self, options=None):
        # TensorFlow's PER_REPLICA input overwrites _input_workers_devices with one input
        # worker per device: the strategy's workers stay what they are.
        workers = self._input_workers_devices
        try:
            return super()._input_workers_with_options(options)
        finally:
            self._input_workers_devices = workers

    # Variable creation -------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        context = creation.creation_context()
        if self.worker_scope and asynchronous_lib.is_shared(colocate_with):
            return asynchronous_lib.create_shared(
                next_creator, kwargs, colocate_with.device, self._container_strategy(),
                self.replicas_per_worker)
        if colocate_with is not None:
            # An optimizer slot: a PS table's is sharded exactly like the table, a
            # mirrored variable's is mirrored; Keras 3's move with their variable.
            if table_lib.is_table(colocate_with):
                kwargs.pop("colocate_with")
                path = f"{colocate_with.path}/{kwargs.get('name') or 'slot'}"
                slot = self._create_table(next_creator, kwargs, path, colocate_with.shape,
                                          colocate_with.devices, context.initializer)
            else:
                slot = super()._create_variable(next_creator, **kwargs)
            if context.keras_variable is not None:
                self._slots_of.setdefault(colocate_with.ref(), []).append(
                    weakref.ref(context.keras_variable))
            return slot
        info = creation.describe_variable(kwargs, context)
        decided = self.policy.decide(info)
        if decided.kind == placement_lib.PS:
            devices = [self._ps_devices[shard.task or 0] for shard in decided.shards]
            table = self._create_table(next_creator, kwargs, info.path, info.shape,
                                       devices, context.initializer)
            if context.keras_variable is not None:
                self._keras_variables[table.ref()] = weakref.ref(context.keras_variable)
            return table
        if (decided.kind == placement_lib.SHARED
                and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ):
            return asynchronous_lib.create_shared(
                next_creator, kwargs, self._ps_devices[decided.shards[0].task or 0],
                self._container_strategy(), self.replicas_per_worker)
        variable = super()._create_variable(next_creator, **kwargs)
        self._variable_infos[variable.ref()] = info
        return variable

    def _create_table(self, next_creator, kwargs, path, shape, devices, initializer,
                      table_class=table_lib.ShardedTable):
        """A ShardedTable of one shard variable per device in `devices` (shard k: k::S)."""
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        initial_values = table_lib.shard_initial_values(
            kwargs["initial_value"], initializer, shape, dtype, len(devices))
        name = kwargs.get("name") or path.rsplit("/", 1)[-1]
        shards = []
        for k, (device, rows, initial_value) in enumerate(
                zip(devices, placement_lib.shard_rows(tf.TensorShape(shape)[0], len(devices)),
                    initial_values)):
            shard_kwargs = dict(kwargs, initial_value=initial_value,
                                name=f"{name}/part_{k}" if len(devices) > 1 else name)
            if shard_kwargs.get("shape") is not None:
                shard_kwargs["shape"] = tf.TensorShape([rows]).concatenate(
                    tf.TensorShape(shape)[1:])
            with tf.device(device):
                shards.append(next_creator(**shard_kwargs))
        return table_class(shards, path, name=name, wire_dtype=self.wire_dtype)

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
        if info is None or not mirrored.trainable:
            return None
        decided = self.policy.move_to_ps(info, "read by row (moved at its first read)")
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
        return self._create_table(
            lambda **kw: resource_variable_ops.ResourceVariable(**kw), kwargs, path,
            mirrored.shape, devices, None, table_class)

    def _validate_colocate_with_variable(self, colocate_with_variable):
        if not table_lib.is_table(colocate_with_variable):
            super()._validate_colocate_with_variable(colocate_with_variable)

    def variable_created_in_scope(self, v):
        return table_lib.is_table(v) or super().variable_created_in_scope(v)

    def read_var(self, replica_local_var):
        if table_lib.is_table(replica_local_var):
            return tf.identity(replica_local_var)
        return super().read_var(replica_local_var)

    # Gradient aggregation ----------------------------------------------------

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        results = [None] * len(value_destination_pairs)
        collective, sparse, tables, shard_sums, penalty_of = [], [], {}, {}, {}
        for i, (value, destinations) in enumerate(value_destination_pairs):
            tables[i] = table = _table_of_gradient(value)
            if table is None:
                collective.append(i)
                continue
            components = _components(value)
            self._record_gradient_type(table, isinstance(components[0], tf.IndexedSlices))
            if isinstance(components[0], tf.IndexedSlices):
                components, penalty = penalties.without_markers(components, table)
                sparse.append((i, (components, table)))
                penalty_of[i] = penalty
            else:
                shard_sums[i] = communication.sum_dense(components, self._devices, table)
        # Every table's rows at once: a worker's parts bound for one PS cross together.
        sums = communication.sum_sparse([pair for _, pair in sparse], self._devices)
        shard_sums.update((i, penalties.with_gradient(s, penalty_of[i], tables[i]))
                          for (i, _), s in zip(sparse, sums))
        for i, sums in shard_sums.items():
            table = tables[i]
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                sums = [_scaled(s, 1.0 / self._num_replicas_in_sync) for s in sums]
            total = communication.shard_summed(sums, table)
            results[i] = values_lib.Mirrored((total,) * self._num_replicas_in_sync)
            self.ps_aggregated.add(table.path)
        # A PS table as destination (tf_keras names the variables) would make TF
        # reduce value by value; its update reads one replica's copy anyway.
        pairs = {i: (value, value if table_lib.is_table(destinations) else destinations)
                 for i, (value, destinations) in
                 ((i, value_destination_pairs[i]) for i in collective)}
        per_worker = [i for i in collective if self._dense_all_reduce is not None
                      and self._dense_all_reduce.accepts(_components(pairs[i][0]),
                                                         pairs[i][1])]
        if per_worker:
            reduced = self._dense_all_reduce.all_reduce(
                reduce_op, [_components(pairs[i][0]) for i in per_worker], options)
            for i, values in zip(per_worker, reduced):
                results[i] = distribute_utils.regroup(tuple(values), values_lib.Mirrored)
        collective = [i for i in collective if i not in per_worker]
        if collective:
            reduced = super()._batch_reduce_to(reduce_op, [pairs[i] for i in collective],
                                               options)
            for i, value in zip(collective, reduced):
                results[i] = _merge_duplicate_rows(value)
        return results

    # Updates -----------------------------------------------------------------

    def _update(self, var, fn, args, kwargs, group):
        self._note_gradient_type(var, args)
        if table_lib.is_table(var):
            return self._update_table(var, fn, args, kwargs, group)
        if not isinstance(var, values_lib.DistributedVariable):
            return asynchronous_lib.update_shared(self, var, fn, args, kwargs, group)
        mirrored_reads.forget(var)
        return super()._update(var, fn, args, kwargs, group)

    def _update_table(self, table, fn, args, kwargs, group):
        """Runs an optimizer's update of a PS table on its ps tasks (tables/sparse_optimizers.py).

        Other updates (assignments) run `fn` on the table itself, whose methods
        write each shard on its own device.
        """
        args = distribute_utils.select_replica(0, args)
        kwargs = distribute_utils.select_replica(0, kwargs)
        optimizer = _optimizer_of(fn)
        grad = args[0] if args else None
        if optimizer is not None and isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
            sparse_optimizers.check(optimizer, table.path)
            # Not in an update context: writes of mirrored optimizer state (tf_keras'
            # Adafactor and Nadam) then reach every replica's copy.
            result = sparse_optimizers.update_table(
                optimizer, fn, table, _shard_gradients(grad, table), args[1:], kwargs,
                mode=self.sparse_update, concurrent=self.worker_scope is not None)
        elif optimizer is not None and not args and sparse_optimizers.is_weight_decay(fn):
            sparse_optimizers.check(optimizer, table.path)
            result = sparse_optimizers.decay_table(optimizer, fn, table,
                                                   mode=self.sparse_update,
                                                   concurrent=self.worker_scope is not None)
        else:
            with distribute_lib.UpdateContext(0):
                result = fn(table, *args, **kwargs)
        return distribute_utils.update_regroup(self, [result], group)

    def _note_gradient_type(self, var, args):
        """Records each trainable variable's gradient type; warns once on a misfit."""
        if not args:
            return
        grad = distribute_utils.select_replica(0, args[0])
        if isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
            self._record_gradient_type(var, isinstance(grad, tf.IndexedSlices))

    def _record_gradient_type(self, var, sparse):
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
        if path is None or path in self.gradient_types:
            return
        self.gradient_types[path] = "sparse" if sparse else "dense"
        if kind == placement_lib.PS and not sparse and self._mirroring_after_step:
            self._dense_tables[path] = var
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
        tables, self._dense_tables = self._dense_tables, {}
        moved = False
        for path, table in tables.items():
            why = self._stays_on_ps(table)
            if why is not None:
                _warn_misfit(path, "is on a PS but gets a dense gradient: the whole "
                                   f"variable crosses the network every step. It stays "
                                   f"on the PS: {why}")
                continue
            self.policy.move_to_mirrored(path, "dense gradient (moved after the first step)")
            keras_variable = self._keras_variables.pop(table.ref())()
            slots = [ref() for ref in self._slots_of.pop(table.ref(), ())]
            with tf.init_scope():
                mirrored = mirroring.mirrored_copy(self, table, replaced_id=table._unique_id)
                for slot in (slot for slot in slots if slot is not None):
                    slot._value = mirroring.mirrored_copy(self, slot._value)
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
        replicas = max(len(devices) for _, devices in self._input_workers_devices)
        nbytes = table.shape.num_elements() * table.dtype.size
        return self.policy.stays_on_ps(table.path, nbytes * (1 + slots) * replicas)

    def _check_overrides_once(self):
        """Warns, at the first traced training step, about overrides that matched nothing."""
        if self._overrides_checked:
            return
        self._overrides_checked = True
        unmatched = self.policy.unmatched_overrides()
        if unmatched:
            known = ", ".join(record.path for record in self.policy.plan)
            warnings.warn(
                f"HybridStrategy: placement_overrides pattern(s) {unmatched} match no "
                "variable. Patterns match a variable's path as in model.weights, its "
                f"'layer/variable' tail, or a layer name on the path; known paths: "
                f"{known or '(none)'}.", PlacementWarning, stacklevel=3)


def _warn_misfit(path, advice):
    warnings.warn(f"HybridStrategy: variable '{path}' {advice}. Training stays correct.",
                  PlacementWarning, stacklevel=4)


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


def _components(value):
    if isinstance(value, values_lib.DistributedValues):
        return value.values
    return (value,)


def _assign_instance_keys_when_traced(launchers):
    """Fixes the collective instance keys of `launchers` when the step is traced.

    By default TensorFlow feeds every all-reduce a new instance key at every call: a
    tensor made on this process and sent to every worker, each step, so that workers
    tracing at different times agree. Here one process traces every replica, so keys
    fixed at trace time agree as well, and none crosses the network.
    """
    for launcher in launchers:
        launcher._use_unique_instance_key = lambda: False


def _inside_while_loop():
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if control_flow_util_v2.in_while_loop_defun(graph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _table_of_gradient(value):
    """The PS table every replica's gradient in `value` belongs to, or None."""
    tables = set()
    for component in _components(value):
        key = component.indices if isinstance(component, tf.IndexedSlices) else component
        table = table_lib.table_of_gradient(key) if tf.is_tensor(key) else None
        if table is None:
            return None
        tables.add(table.ref())
    return tables.pop().deref() if len(tables) == 1 else None


def _scaled(gradient, factor):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices,
                                gradient.dense_shape)
    return gradient * factor


def _merge_duplicate_rows(value):
    """All-gathered IndexedSlices repeat rows; optimizers like Adagrad need them once."""
    components = _components(value)
    if not isinstance(components[0], tf.IndexedSlices):
        return value
    merged = []
    for component in components:
        with tf.device(component.values.device):
            merged.append(communication.merge_duplicates(component))
    return values_lib.Mirrored(tuple(merged))


def _shard_gradients(grad, table):
    """The step's gradient of `table`, one part per shard with shard-local rows."""
    sums = communication.shard_sums_of(grad)
    if sums is not None:
        return list(sums)
    if isinstance(grad, tf.IndexedSlices):
        (grad,), penalty = penalties.without_markers([grad], table)
        parts = table_lib.split_slices(communication.merge_duplicates(grad), table.num_shards)
        return penalties.with_gradient(parts, penalty, table)
    penalties.check_not_dropped(table)
    return table_lib.split_dense(grad, table.num_shards)


def _table_of(slot):
    """Keras 3 wraps the slot's ShardedTable in a keras.Variable; tf_keras does not."""
    return slot if table_lib.is_table(slot) else slot.value


def _optimizer_of(fn):
    """The optimizer whose update `fn` is: Keras and tf_keras pass a closure over it."""
    fn = inspect.unwrap(fn)  # merge_call wraps it for autograph
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            candidate = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(candidate, "iterations") and hasattr(candidate, "apply_gradients"):
            return candidate
    return None


def _local_devices(devices):
    if devices:
        return [device_util.resolve(d) for d in devices]
    return [g.name for g in tf.config.list_logical_devices("GPU")] or [_LOCAL_CPU]


def _check_cluster(config, architecture):
    if config.task_type not in (None, _CHIEF_JOB):
        raise cluster_lib.ClusterConfigError(
            f"This process is /job:{config.task_type}/task:{config.task_index} in "
            "TF_CONFIG, but the training program runs on the chief only. Start "
            f"{config.task_type} tasks with `python -m hybrid_strategy.server` and "
            "run this program with TF_CONFIG's task set to {\"type\": \"chief\", "
            "\"index\": 0}.")
    if config.num_workers < 1:
        raise cluster_lib.ClusterConfigError(
            "The cluster has no `worker` task: HybridStrategy replicates training on "
            "workers. Add at least one worker address to TF_CONFIG's cluster.")
    if architecture in ("hybrid", "ps") and config.num_ps < 1:
        raise cluster_lib.ClusterConfigError(
            f"architecture={architecture!r} needs at least one `ps` task, but the "
            f"cluster has {config.num_workers} worker(s) and no ps. Add ps addresses "
            "to TF_CONFIG's cluster, or use architecture='allreduce'.")


def _connect(config, timeout):
    """Connects this process to the cluster; returns (worker devices, ps devices)."""
    global _connected_cluster
    spec = config.as_cluster_spec_dict()
    if _connected_cluster is None:
        cluster_lib.wait_until_servers_forgot_previous_chief()
        cluster_lib.wait_for_tasks(config, timeout)
        tf.config.experimental_connect_to_cluster(
            tf.train.ClusterSpec(spec), job_name=_CHIEF_JOB, task_index=0,
            protocol="grpc", make_master_device_default=False)
        liveness.install_lost_task_hooks(config)
        _connected_cluster = spec
        atexit.register(_keep_functions_at_exit)
    elif _connected_cluster != spec:
        raise RuntimeError(
            "This process is already connected to another cluster "
            f"({_connected_cluster}); TensorFlow supports one per process. Create "
            "every HybridStrategy of a program with the same cluster.")
    worker_devices = _replica_devices(config.num_workers, tf.config.list_logical_devices())
    ps_devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0"
                  for i in range(config.num_ps)]
    return worker_devices, ps_devices


def _replica_devices(num_workers, devices):
    """Each worker's replicas: its GPUs, else every CPU device its server exposes.

    A server exposes one CPU device unless started with `--cpu-devices N`. Every
    worker must have as many replicas (tf.distribute splits each global batch so).
    """
    per_worker = []
    for index in range(num_workers):
        on_task = [tf.DeviceSpec.from_string(d.name) for d in devices
                   if d.name.startswith(f"/job:worker/replica:0/task:{index}/")]
        gpus = [d for d in on_task if d.device_type == "GPU"]
        cpus = [d for d in on_task if d.device_type == "CPU"]
        chosen = sorted(gpus or cpus, key=lambda d: d.device_index)
        per_worker.append([d.to_string() for d in chosen] or [
            f"/job:worker/replica:0/task:{index}/device:CPU:0"])
    counts = [len(replicas) for replicas in per_worker]
    if len(set(counts)) > 1:
        listed = ", ".join(f"worker {i}: {n}" for i, n in enumerate(counts))
        raise cluster_lib.ClusterConfigError(
            f"The workers have different numbers of replicas ({listed}); every worker needs "
            "as many. Start every worker's server with the same --cpu-devices, or give "
            "every worker as many GPUs.")
    return [device for replicas in per_worker for device in replicas]


def _keep_functions_at_exit():
    """Lets the interpreter exit without removing traced functions one by one.

    TensorFlow 2.21 cannot release a function whose parts run on remote tasks: each
    removal at exit logs "Ignoring error status when releasing multi-device function
    handle UNIMPLEMENTED" and frees nothing, so skip them; the process is ending.
    """
    atomic_function.RUNTIME_FUNCTION_REFS = None

