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

import inspect
import itertools
import os
import sys
import threading
import warnings

import tensorflow as tf

# TF-private: MirroredExtended is the in-graph replication engine we extend (TF's
# public MirroredStrategy refuses remote devices in eager mode); the other modules
# are the helpers it is built from (per-replica values, collective options,
# the update/merge plumbing).
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import values as values_lib
# TF-private: tells whether a graph is a tf.while_loop body (steps_per_execution).
from tensorflow.python.ops import control_flow_util_v2

from hybrid_strategy import cluster as cluster_lib
from hybrid_strategy import communication
from hybrid_strategy import placement as placement_lib
from hybrid_strategy import sparse_optimizers
from hybrid_strategy import table as table_lib

_LOCAL_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
_CHIEF_JOB = "chief"
# The cluster this process is connected to: TensorFlow keeps one per process.
_connected_cluster = None
_collective_key_bases = itertools.count(0, 100)
# Exit code when a task is lost during training: "restart me" (sysexits' EX_TEMPFAIL).
EXIT_TASK_LOST = cluster_lib.EXIT_TASK_LOST
_exiting = threading.Lock()
# Errors TensorFlow raises when a connection to another task breaks or times out.
_CONNECTION_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                      tf.errors.CancelledError, tf.errors.DeadlineExceededError)
_PROBE_TIMEOUT = 2.0  # seconds each task gets to answer when an error may name a lost one


class PlacementWarning(UserWarning):
    """A variable's placement does not fit the type of gradient it receives."""


class HybridStrategy(tf.distribute.Strategy):
    """Mirrors dense variables on every worker device and keeps embeddings on PS tasks.

    With a cluster (a `cluster_resolver`, or TF_CONFIG in the environment), this
    process must be the cluster's `chief`: it connects to every `worker` and `ps`
    task (each running `python -m hybrid_strategy.server`) and replicates the
    training step on every worker device. Without one, replicas are this machine's
    devices and PS variables live on its CPU.

    Placement is decided when a layer builds its weights: weights of Keras
    `Embedding` layers (and subclasses) go to a PS task, everything else is
    mirrored. `placement_overrides` changes that per layer or variable, and
    `strategy.placement` shows the result.

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
            matches a variable path "layer_name/variable_name" or a layer name.
        min_shard_bytes: A PS table is split by rows over up to every PS task, in
            shards of at least this many bytes (default 1 MiB): smaller tables stay
            whole on one task.
        table_shards: `{pattern: number of shards}` for chosen tables.
        sparse_update: How PS tables apply optimizers whose dense form also moves
            rows without gradient (SGD with momentum, Adam, RMSprop): "lazy"
            (default: only the step's rows and their slots change, so a step costs
            the same whatever the table size) or "exact" (every row, identical to
            single-device training). SGD and Adagrad are exact either way.
        devices: Single-machine mode only: the local devices to replicate over
            (default: every GPU, else the CPU).
        communication_options: `tf.distribute.experimental.CommunicationOptions`
            for the dense all-reduce (implementation, timeout).
        connect_timeout: Seconds to wait for every task to answer at start-up.
        task_timeout: Seconds a worker or ps task may stop answering during
            training before this process reports it and exits with code 75
            (EX_TEMPFAIL): the in-graph step cannot finish without it, and
            TensorFlow would otherwise wait forever. None disables the check.
    """

    def __init__(self, cluster_resolver=None, *, architecture="hybrid",
                 placement_overrides=None, min_shard_bytes=placement_lib.DEFAULT_MIN_SHARD_BYTES,
                 table_shards=None, sparse_update="lazy", devices=None,
                 communication_options=None, connect_timeout=60.0, task_timeout=60.0):
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
            table_shards=table_shards, sparse_update=sparse_update, devices=devices,
            communication_options=communication_options,
            connect_timeout=connect_timeout, task_timeout=task_timeout)
        super().__init__(extended)

    @property
    def architecture(self):
        return self.extended.policy.architecture

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
                 placement_overrides, min_shard_bytes, table_shards, sparse_update,
                 devices, communication_options, connect_timeout, task_timeout):
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
            table_shards=table_shards)
        if sparse_update not in sparse_optimizers.MODES:
            raise ValueError(f"sparse_update={sparse_update!r}; use one of "
                             f"{sparse_optimizers.MODES}.")
        self.sparse_update = sparse_update
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
                cluster_lib.HealthMonitor(config, task_timeout, _exit_on_lost_task).start()
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
        if communication_options is not None:
            self._communication_options = self._communication_options.merge(
                communication_options)
        self._cross_device_ops = self._collective_ops
        self._inferred_cross_device_ops = self._collective_ops
        self.experimental_enable_get_next_as_optional = True
        self._use_var_policy = False
        self._variable_paths = {}
        self.gradient_types = {}
        self.ps_aggregated = set()
        table_lib.install_keras_hook()

    def _call_for_each_replica(self, fn, args, kwargs):
        if (self.cluster is not None or len(self._devices) > 1) and _inside_while_loop():
            raise NotImplementedError(
                "HybridStrategy runs one training step per call when it spans several "
                "devices or tasks: a step inside a tf.while_loop (Keras "
                "compile(steps_per_execution=N) with N > 1) fails on TensorFlow 2.21 "
                "when the loop spans devices (its loop variables are not sent to the "
                "other devices). Use steps_per_execution=1, the default.")
        return super()._call_for_each_replica(fn, args, kwargs)

    # Variable creation -------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        context = _creation_context()
        if table_lib.is_table(colocate_with):
            # An optimizer slot of a PS table: sharded exactly like the table.
            kwargs.pop("colocate_with")
            path = f"{colocate_with.path}/{kwargs.get('name') or 'slot'}"
            return self._create_table(next_creator, kwargs, path, colocate_with.shape,
                                      colocate_with.devices, context.initializer)
        info = _describe_variable(kwargs, context) if colocate_with is None else None
        if info is not None:
            decided = self.policy.decide(info)
            if decided.kind == placement_lib.PS:
                devices = [self._ps_devices[shard.task or 0] for shard in decided.shards]
                return self._create_table(next_creator, kwargs, info.path, info.shape,
                                          devices, context.initializer)
        variable = super()._create_variable(next_creator, **kwargs)
        if info is not None:
            self._variable_paths[variable.ref()] = info.path
        return variable

    def _create_table(self, next_creator, kwargs, path, shape, devices, initializer):
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
        return table_lib.ShardedTable(shards, path, name=name)

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
        collective = []
        for i, (value, destinations) in enumerate(value_destination_pairs):
            table = _table_of_gradient(value)
            if table is None:
                collective.append(i)
                continue
            components = _components(value)
            if isinstance(components[0], tf.IndexedSlices):
                sums = communication.sum_sparse(components, self._devices, table)
            else:
                sums = communication.sum_dense(components, self._devices, table)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                sums = [_scaled(s, 1.0 / self._num_replicas_in_sync) for s in sums]
            # The table-wide sum is what all_reduce promises; the update uses the
            # per-shard sums where they are, so the joined one is built only if
            # something else reads it.
            total = communication.join_shards(sums, table)
            total._hybrid_shard_sums = sums
            results[i] = values_lib.Mirrored((total,) * self._num_replicas_in_sync)
            self.ps_aggregated.add(table.path)
        if collective:
            # A PS table as destination (tf_keras names the variables) would make
            # TF reduce value by value; its update reads one replica's copy anyway.
            pairs = [(value, value if table_lib.is_table(destinations) else destinations)
                     for value, destinations in
                     (value_destination_pairs[i] for i in collective)]
            reduced = super()._batch_reduce_to(reduce_op, pairs, options)
            for i, value in zip(collective, reduced):
                results[i] = _merge_duplicate_rows(value)
        return results

    # Updates -----------------------------------------------------------------

    def _update(self, var, fn, args, kwargs, group):
        self._note_gradient_type(var, args)
        if table_lib.is_table(var):
            return self._update_table(var, fn, args, kwargs, group)
        return super()._update(var, fn, args, kwargs, group)

    def _update_table(self, table, fn, args, kwargs, group):
        """Applies an optimizer step shard by shard, each on its PS, row-sparse.

        Other updates (assignments, weight decay) run `fn` on the table itself,
        whose methods write each shard on its own device.
        """
        args = distribute_utils.select_replica(0, args)
        kwargs = distribute_utils.select_replica(0, kwargs)
        optimizer = _optimizer_of(fn)
        grad = args[0] if args else None
        with distribute_lib.UpdateContext(0):
            if optimizer is None or not isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
                result = fn(table, *args, **kwargs)
            else:
                updater = sparse_optimizers.row_updater(optimizer)
                slots = {name: _table_of(slot) for name, slot
                         in updater.slots(optimizer, table).items()}
                updates = []
                for k, part in enumerate(_shard_gradients(grad, table)):
                    with tf.device(table.shards[k].device), tf.name_scope(f"ps_update_{k}"):
                        updates.append(updater.apply(
                            optimizer, table.shards[k],
                            {name: slot.shards[k] for name, slot in slots.items()},
                            part, mode=self.sparse_update))
                result = tf.group(updates)
        return distribute_utils.update_regroup(self, [result], group)

    def _note_gradient_type(self, var, args):
        """Records each trainable variable's gradient type; warns once on a misfit."""
        # Eager updates are assignments (set_weights, restores), not training steps.
        if not args or not tf.inside_function() or not getattr(var, "trainable", False):
            return
        grad = distribute_utils.select_replica(0, args[0])
        if not isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
            return
        if table_lib.is_table(var):
            path, kind = var.path, placement_lib.PS
        else:
            path, kind = self._variable_paths.get(var.ref()), placement_lib.MIRRORED
        if path is None or path in self.gradient_types:
            return
        sparse = isinstance(grad, tf.IndexedSlices)
        self.gradient_types[path] = "sparse" if sparse else "dense"
        advice = placement_lib.gradient_misfit(kind, sparse)
        if advice:
            warnings.warn(
                f"HybridStrategy: variable '{path}' {advice} (override with "
                f"placement_overrides={{'{path}': ...}}). Training stays correct.",
                PlacementWarning, stacklevel=2)


def _components(value):
    if isinstance(value, values_lib.DistributedValues):
        return value.values
    return (value,)


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
    sums = getattr(grad, "_hybrid_shard_sums", None)
    if sums is not None:
        return sums
    if isinstance(grad, tf.IndexedSlices):
        return table_lib.split_slices(communication.merge_duplicates(grad), table.num_shards)
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


class _CreationContext(tuple):
    """(owner, name, shape, initializer, is_layer) of the variable being created."""

    __slots__ = ()
    owner = property(lambda self: self[0])
    name = property(lambda self: self[1])
    shape = property(lambda self: self[2])
    initializer = property(lambda self: self[3])
    is_layer = property(lambda self: self[4])


_NO_CONTEXT = _CreationContext((None, None, None, None, False))


def _creation_context(max_depth=40):
    """Reads the innermost `add_weight` / `add_variable` call on the stack.

    Keras 3 and tf_keras layers create weights through `Layer.add_weight(self, ...)`,
    and Keras 3 optimizers their slots through `add_variable`: their frames tell
    the layer, the declared shape and the initializer, without relying on names.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(max_depth):
            frame = frame.f_back
            if frame is None:
                break
            if frame.f_code.co_name not in ("add_weight", "add_variable"):
                continue
            local = frame.f_locals
            owner = local.get("self")
            # tf_keras metrics are layers too, but their weights are counters.
            is_layer = (frame.f_code.co_name == "add_weight"
                        and hasattr(owner, "add_weight")
                        and "Metric" not in {c.__name__ for c in type(owner).__mro__})
            return _CreationContext((owner, local.get("name"), local.get("shape") or (),
                                     local.get("initializer"), is_layer))
        return _NO_CONTEXT
    finally:
        del frame


def _describe_variable(kwargs, context):
    """Describes the variable being created from the layer building it."""
    if not context.is_layer:
        return placement_lib.VariableInfo(
            path=str(kwargs.get("name") or "variable"), shape=(), itemsize=0,
            trainable=bool(kwargs.get("trainable", True)))
    dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
    layer = context.owner
    return placement_lib.VariableInfo(
        path=f"{layer.name}/{context.name or kwargs.get('name')}",
        shape=tuple(int(d) for d in tf.TensorShape(context.shape).as_list()),
        itemsize=dtype.size,
        layer_classes=tuple(c.__name__ for c in type(layer).__mro__),
        trainable=bool(kwargs.get("trainable", True)))


def _local_devices(devices):
    if devices:
        return [device_util.resolve(d) for d in devices]
    return [g.name for g in tf.config.list_logical_devices("GPU")] or [_LOCAL_CPU]


def _exit_on_lost_task(message):
    """Ends this process: a lost task leaves the step, and so the program, hanging."""
    with _exiting:  # the monitor and the exception hook may both get here; one speaks
        sys.stderr.write(
            f"HybridStrategy: {message}\nExiting with code {EXIT_TASK_LOST}; restart the "
            "task and the program (restoring from your last checkpoint).\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # Not sys.exit: interpreter teardown would wait on RPCs to the lost task.
        os._exit(EXIT_TASK_LOST)


def _install_lost_task_hooks(config):
    """Turns an uncaught TensorFlow error caused by a lost task into `_exit_on_lost_task`.

    TensorFlow raises UnavailableError (and kin) when a connection to a task breaks; left
    alone it prints pages of gRPC detail and exits with code 1, which supervisors read as
    a bug, not as "restart me". Other errors reach the hooks installed before.
    """
    previous_hook, previous_thread_hook = sys.excepthook, threading.excepthook

    def hook(kind, error, traceback):
        _exit_if_task_lost(config, error)
        previous_hook(kind, error, traceback)

    def thread_hook(args):
        _exit_if_task_lost(config, args.exc_value)
        previous_thread_hook(args)

    sys.excepthook, threading.excepthook = hook, thread_hook


def _exit_if_task_lost(config, error):
    """Exits with EXIT_TASK_LOST when `error` comes from a task that died, hung or restarted."""
    if not isinstance(error, tf.errors.OpError):
        return
    text = error.message or ""
    # A restarted server has forgotten this chief's context: "Unable to find a context_id".
    if not isinstance(error, _CONNECTION_ERRORS) and "context_id" not in text:
        return
    lost = cluster_lib.lost_tasks(config, _PROBE_TIMEOUT)
    if not lost:
        named = [task for task in cluster_lib.tasks_named_in(config, text)
                 if task[0] != _CHIEF_JOB]
        why = ("named in the error; it answers again, so it restarted or the network "
               "dropped the connection")
        if not named and "context_id" in text:
            # The error does not say which server has forgotten this program.
            named = [task for task in config.tasks() if task[0] != _CHIEF_JOB]
            why = "it answers, but it or another of these restarted and forgot this program"
        lost = [(task, why) for task in named]
    if lost:
        _exit_on_lost_task(
            f"lost {len(lost)} task(s) during training ({type(error).__name__}):\n"
            f"{cluster_lib.describe_tasks(lost)}\nThe training step cannot finish without them.")


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
        _install_lost_task_hooks(config)
        _connected_cluster = spec
    elif _connected_cluster != spec:
        raise RuntimeError(
            "This process is already connected to another cluster "
            f"({_connected_cluster}); TensorFlow supports one per process. Create "
            "every HybridStrategy of a program with the same cluster.")
    devices = tf.config.list_logical_devices()
    worker_devices = []
    for index in range(config.num_workers):
        task = f"/job:worker/replica:0/task:{index}/"
        on_task = [d.name for d in devices if d.name.startswith(task)]
        gpus = [d for d in on_task if "/device:GPU:" in d]
        worker_devices += gpus or [task + "device:CPU:0"]
    ps_devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0"
                  for i in range(config.num_ps)]
    return worker_devices, ps_devices
