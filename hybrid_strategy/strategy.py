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

import contextlib
import functools
import itertools
import weakref

import tensorflow as tf

# TF-private: MirroredExtended is the in-graph replication engine we extend (TF's
# public MirroredStrategy refuses remote devices in eager mode); the other modules
# are the helpers it is built from (per-replica values, collective options,
# the update/merge plumbing).
from hybrid_strategy.tensorflow_private import collective_util
from hybrid_strategy.tensorflow_private import cross_device_ops as cross_device_ops_lib
from hybrid_strategy.tensorflow_private import distribute_lib
from hybrid_strategy.tensorflow_private import distribute_utils
from hybrid_strategy.tensorflow_private import mirrored_strategy
from hybrid_strategy.tensorflow_private import numpy_dataset
from hybrid_strategy.tensorflow_private import values_lib
# TF-private: tells whether a graph is a tf.while_loop body (steps_per_execution), and
# the variables a mirrored copy of a PS table is made of.
from hybrid_strategy.tensorflow_private import control_flow_util_v2
from hybrid_strategy.tensorflow_private import resource_variable_ops

from hybrid_strategy import options as options_lib
from hybrid_strategy import tracing
from hybrid_strategy.asynchronous import training as asynchronous_lib
from hybrid_strategy.cluster import config as cluster_lib
from hybrid_strategy.cluster import connection
from hybrid_strategy.cluster import data_service
from hybrid_strategy.cluster import liveness
from hybrid_strategy.communication import aggregation
from hybrid_strategy.communication import hierarchical_allreduce
from hybrid_strategy.communication import riders
from hybrid_strategy.communication import routing
from hybrid_strategy.input import service_input
from hybrid_strategy.input import worker_input
from hybrid_strategy.keras_integration import batches
from hybrid_strategy.keras_integration import collective_hooks
from hybrid_strategy.keras_integration import install
from hybrid_strategy.placement import topology as topology_lib
from hybrid_strategy.placement import variables
from hybrid_strategy.sharding import wire
from hybrid_strategy.tables import mirrored_reads
from hybrid_strategy.tables import table as table_lib
from hybrid_strategy.tables import updates

# Collective group keys: TensorFlow's MirroredStrategy and MultiWorkerMirroredStrategy
# start theirs at 1, so a HybridStrategy in the same process starts far above, each
# with room for as many groups (sets of devices) as it could need.
_collective_key_bases = itertools.count(1 << 24, 1 << 12)


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
        placement_plan: A `PlacementPlan` a run ended with (`strategy.placement`), or
            the path it was saved to (`strategy.placement.save(path)`): the variables
            it records are placed as it says from the start (with the same shards on
            the same PS tasks), so the moves of that run are not made again.
        dense_sum: Where the dense gradients of mirrored variables are summed
            across workers on a cluster: "auto" (default: on the first PS task, in
            the step's exchange with it, while the bytes it receives per step stay
            small, 4 MiB; else by an all-reduce among the workers), "ps" or
            "allreduce".
    """

    def __init__(self, cluster_resolver=None, **options):
        options = options_lib.StrategyOptions.from_kwargs(options)
        if cluster_resolver is not None:
            config = cluster_lib.from_cluster_resolver(cluster_resolver)
        else:
            config = cluster_lib.from_environment()
        # Collective instances are keyed by group; a group used by an earlier
        # strategy keeps that strategy's tensor shapes, so each gets its own.
        self._collective_key_base = next(_collective_key_bases)
        extended = HybridExtended(self, config, options)
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
        """The `PlacementPlan` of every variable created so far, and the moves made since
        (print it; `.save(path)` it for `HybridStrategy(placement_plan=path)`)."""
        return self.extended.placer.plan

    @property
    def gradient_types(self):
        """`{variable path: "sparse" | "dense"}` as seen in traced training steps."""
        return dict(self.extended.placer.gradient_types)

    @property
    def ps_aggregated(self):
        """Paths of the PS tables whose gradients are summed per worker and on their PS."""
        return set(self.extended.ps_aggregated)


# The options are declared once, in StrategyOptions; help() still shows each of them.
HybridStrategy.__init__.__signature__ = options_lib.signature()


class HybridExtended(mirrored_strategy.MirroredExtended):
    """The strategy's implementation: placement, sparse aggregation, PS updates."""

    def __init__(self, container_strategy, config, options):
        # MirroredExtended.__init__ refuses remote devices in eager mode; the
        # fields it would set are set here instead.
        distribute_lib.StrategyExtendedV1.__init__(self, container_strategy)
        self.cluster = config
        self._collective_key_base = container_strategy._collective_key_base
        self._cross_device_ops = None
        # Every argument is checked before this process connects to anything.
        self.policy = options.placement_policy(config.num_ps if config else 0)
        # Asynchronous steps run on one worker each: while the strategy works for one
        # (`WorkerScope`), it replicates over that worker's devices only.
        self.worker_scope = asynchronous_lib.WorkerScope() if options.asynchronous else None
        # One object: TF's batch reduction refuses values whose cross-device ops differ.
        self._worker_reduction = cross_device_ops_lib.ReductionToOneDevice()
        worker_devices, ps_devices = connection.devices(
            config, options.architecture, options.devices, options.connect_timeout)
        if config is not None and options.task_timeout is not None:
            liveness.HealthMonitor(config, options.task_timeout, liveness.exit_on_lost_task,
                                   services=data_service.watched()).start()
        self._ps_devices = ps_devices
        self._devices = tuple(worker_devices)
        hosts = {}
        for device in self._devices:
            hosts.setdefault(wire.host_of(device), []).append(device)
        self._input_workers_devices = tuple(
            (host, tuple(replicas)) for host, replicas in hosts.items())
        # What the executors are given instead of the strategy (placement/topology.py).
        self.topology = topology_lib.Topology(
            self._input_workers_devices, ps_devices, on_cluster=config is not None,
            dense_sum=options.dense_sum, wire_dtype=options.wire_dtype,
            sparse_update=options.sparse_update, asynchronous=options.asynchronous)
        self._host_input_device = numpy_dataset.SingleDevice(
            self._input_workers_devices[0][0])
        self._default_device = None
        self._is_multi_worker_training = config is not None
        self._communication_options = collective_util.Options()
        self._collective_ops = self._make_collective_ops_with_fallbacks()
        chosen = aggregation.dense_options(self._devices, config is not None)
        if chosen is not None:
            self._communication_options = self._communication_options.merge(chosen)
        # TF-private: the per-replica collective launchers of CollectiveAllReduce.
        collective_hooks.fix_instance_keys(getattr(self._collective_ops, "_launchers", ()))
        if options.communication_options is not None:
            self._communication_options = self._communication_options.merge(
                options.communication_options)
        self._dense_all_reduce = None
        implementation = self._communication_options.implementation.value
        if hierarchical_allreduce.on_cpus(self._devices, implementation):
            self._dense_all_reduce = hierarchical_allreduce.HierarchicalAllReduce(
                self._devices, self._collective_keys, self._communication_options,
                hierarchical_allreduce.applies(self._devices, implementation))
            collective_hooks.fix_instance_keys(self._dense_all_reduce.launchers)
        self._cross_device_ops = self._collective_ops
        self._inferred_cross_device_ops = self._collective_ops
        self.experimental_enable_get_next_as_optional = True
        self._use_var_policy = False
        self.placer = variables.Placer(self.policy, self.topology, self._container_strategy,
                                       self._create_mirrored_unplaced)
        self.ps_aggregated = set()
        # graph calling `strategy.run` -> its replicas' batch sizes, while they are traced
        self._step_batch_sizes = weakref.WeakKeyDictionary()
        install.install_all(HybridStrategy, connected=config is not None)

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
    def ps_devices(self):
        """The PS tasks' devices (the local CPU when not on a cluster)."""
        return self.topology.ps_devices

    @property
    def replica_parts(self):
        """(parts of a per-replica variable, one per replica of every worker; the
        positions among them of the replicas a step traced now runs on: every replica,
        or its worker's in an asynchronous step)."""
        return len(self._all_devices), tuple(
            self._get_local_replica_id(r) for r in range(len(self._devices)))

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
    def pushes(self):
        """Whether a synchronous step's gradients go to PS tasks of a cluster, with what
        rides with them (communication/riders.py)."""
        return (self.cluster is not None and bool(self._ps_devices)
                and self.worker_scope is None and self.policy.architecture != "allreduce")

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
        graph = tf.compat.v1.get_default_graph()
        outer = self._step_batch_sizes.get(graph, _ABSENT)  # a run within a run keeps it
        self._step_batch_sizes[graph] = batches.replica_batch_sizes(
            args, kwargs, self._num_replicas_in_sync)
        try:
            with self._asynchronous(lambda scope: scope.one_trace_at_a_time()):
                return super()._call_for_each_replica(fn, args, kwargs)
        finally:
            if outer is _ABSENT:
                del self._step_batch_sizes[graph]
            else:
                self._step_batch_sizes[graph] = outer

    @property
    def step_batch_sizes(self):
        """The per-replica batch sizes of the `strategy.run` whose replicas this thread
        traces, or None. Per graph (tracing.py): the replicas' threads trace in the
        graph of their `strategy.run`, and asynchronous workers trace steps of their own
        at the same time."""
        for graph in tracing.graphs():
            if graph in self._step_batch_sizes:
                return self._step_batch_sizes[graph]
        return None

    @property
    def input_hosts(self):
        """(input device, its replicas' devices) of every worker, in replica order."""
        return self.topology.input_hosts

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
            self.topology.input_hosts, dataset, options, self._tensorflow_distribute,
            self._distribute_datasets_from_function)

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
        with self._asynchronous(lambda scope: scope.of_every_worker()):
            return self.placer.create(
                next_creator, kwargs, functools.partial(super()._create_variable, next_creator))

    def _asynchronous(self, block):
        """`block(worker_scope)` when training asynchronously, else an empty block."""
        return block(self.worker_scope) if self.worker_scope else contextlib.nullcontext()

    def replica_sum(self, value):
        """`value` summed over the step's replicas, by an all-reduce the calling replica
        launches itself (no `merge_call`: other replicas' threads do not run in between)."""
        context = tf.distribute.get_replica_context()
        # TF-private: one replica's all-reduce, as MirroredStrategy launches it under XLA.
        return self._get_cross_device_ops(value)._all_reduce(  # pylint: disable=protected-access
            tf.distribute.ReduceOp.SUM, value, context._replica_id,  # pylint: disable=protected-access
            self._communication_options)

    def _create_mirrored_unplaced(self, **kwargs):
        """A mirrored variable made as MirroredStrategy makes one, with no placement of
        its own: a PS table's copy once it moves to mirrored."""
        # ResourceVariable made directly skips the variable creator stack (this one).
        return super()._create_variable(
            lambda **kw: resource_variable_ops.ResourceVariable(**kw), **kwargs)

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

    def step_topology(self):
        """The `Topology` of a step traced now (one worker's under an asynchronous step)."""
        worker = self.worker_scope.current() if self.worker_scope else None
        return self.topology if worker is None else self.topology.of_worker(worker)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        reduced = routing.batch_reduce(self.step_topology(), reduce_op,
                                       value_destination_pairs, options,
                                       super()._batch_reduce_to, self._dense_all_reduce)
        for table, sparse in reduced.gradient_types:
            self.placer.record_gradient_type(table, sparse)
        self.ps_aggregated.update(reduced.aggregated)
        return reduced.values

    # Updates -----------------------------------------------------------------

    def _update(self, var, fn, args, kwargs, group):
        self.placer.note_gradient_type(var, args)
        if table_lib.is_table(var):
            result = updates.update_table(
                self.step_topology(), var, fn, args, kwargs,
                lambda value, device: riders.copy_on(value.ref(), device))
            return distribute_utils.update_regroup(self, [result], group)
        if not isinstance(var, values_lib.DistributedVariable):
            return asynchronous_lib.update_shared(self, var, fn, args, kwargs, group)
        mirrored_reads.forget(var)
        return super()._update(var, fn, args, kwargs, group)


_ABSENT = object()


def _inside_while_loop():
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if control_flow_util_v2.in_while_loop_defun(graph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


