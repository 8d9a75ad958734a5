"""The training programs the benchmark harness (benchmarks/run.py) runs, one per contender.

    python -m benchmarks.contenders SPEC.json

SPEC.json (written by the harness) names the contender, the model, the batch of one step
("global_batch": the examples one call of the step trains, split over every worker of a
synchronous contender, all on one worker for an asynchronous one; benchmarks/batches.py
says how the harness sizes it per contender), the warm-up and measured steps, the file to
write results to, the directory of phase markers and this process's task name. Contenders:

  single     Keras 3, no strategy, one process.
  hybrid     Keras 3, `HybridStrategy(architecture="hybrid")`, this process the chief
  allreduce  of a cluster whose workers and ps run `python -m hybrid_strategy.server`.
  ps
  hybrid-bf16  hybrid with `wire_dtype="bfloat16"`: table rows cross between tasks in
             bfloat16 (tables and their updates stay float32).
  ps-async   Keras 3, `HybridStrategy(architecture="ps", asynchronous=True)`: each step on
             one worker with the whole step's batch, workers not waiting for each other.
  NAME:key=value:...  a HybridStrategy contender with more options, e.g.
             `hybrid:sparse_update='exact'` (values are Python literals).
  mwms       tf_keras (TF_USE_LEGACY_KERAS=1), `tf.distribute.MultiWorkerMirroredStrategy`:
             one such process per worker, TF_CONFIG with worker tasks only; worker 0
             writes the results. Keras 3 `model.fit` fails with MWMS on TF 2.21.
  pss        tf_keras, `tf.distribute.ParameterServerStrategy`, this process the
             coordinator (chief); workers and ps run `python -m hybrid_strategy.server`
             (a `tf.distribute.Server`), as the other contenders' do.
             Keras 3 has no ParameterServerStrategy support.
  horovod    tf_keras, Horovod 0.28.1 with Gloo (`hvd.DistributedOptimizer`): one such
             process per worker, as mwms's, run by benchmarks/horovod_contender.py in a
             virtualenv of its own, with this module's `run` and `Trainer`.

The models come from keras_examples/ (`build_model`, `make_dataset`), with their own
defaults. Input: `single` and `mwms` read the global batches of `make_dataset` (mwms
sharded by data); `pss` and the HybridStrategy contenders give each worker an input
function building only its own batches (`DatasetCreator`; `distribute_datasets_from_function`
over the same examples as `make_dataset`'s, each worker reading its part of every global
batch), so a worker's input costs its share of the examples.

The tf_keras contenders import the same modules with `keras` bound to tf_keras (plus the
two `keras.ops` functions the examples use), so they build the same layers with the same
sizes, optimizer and data; the language model's loss is computed the way tf_keras needs
under a strategy (per-token cross-entropy averaged over the global batch).

Timing: `model.fit` with the spec's `steps_per_execution` (default 1), verbose 0, and a
callback. For the synchronous contenders the callback receives every call's logs as
numbers (so its steps have finished), one epoch runs warm-up + measured steps, and the
measured window starts at `on_train_batch_begin` of the first measured step and ends at
`on_train_batch_end` of the last; with N steps per call, a call's time counts as N steps
of a Nth of it each; the first call (tracing the step, then running it) is timed apart
("first_call_seconds"). The asynchronous contenders (ParameterServerStrategy and ps-async)
run each step on one worker with the whole step's batch, and a call returns before its
step has finished; `fit` runs two epochs of `steps` steps (the first is the warm-up) and
the window is the second epoch, which ends once every step has finished
(`coordinator.join()`, or the end of a ps-async epoch), so only their mean step time is
known (pss' callback takes no per-step logs at all).

With "profile" in the spec, the trainer that writes the results traces every task of
its cluster (or itself, for `single`) with the TensorFlow profiler from the start of the
measured window, and adds benchmarks/trace_summary.py's per-step breakdown to the results.

At each window boundary every process that trains (the chief, or every worker of mwms
and horovod) writes `<sync_dir>/<phase>.<task>` and waits for `<sync_dir>/<phase>.go`,
which the harness writes after it has read the network counters: nothing runs between
the counters and the clock. Between them, it rewrites `<sync_dir>/step.<task>` (the number
of the last step done) at most once a second, so that the harness tells a run whose
steps stopped from a slow one.
"""

import ast
import dataclasses
import importlib
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
import types

CONTENDERS = ("hybrid", "hybrid-bf16", "allreduce", "ps", "ps-async", "mwms", "pss", "single")
HYBRID_ARCHITECTURES = {"hybrid": "hybrid", "hybrid-bf16": "hybrid", "allreduce": "allreduce",
                        "ps": "ps", "ps-async": "ps"}
# HybridStrategy options beyond the architecture, by contender.
HYBRID_OPTIONS = {"hybrid-bf16": {"wire_dtype": "bfloat16"}, "ps-async": {"asynchronous": True}}
LEGACY_KERAS = ("mwms", "pss", "horovod")  # contenders that run under tf_keras
# Contenders whose every worker runs the training program, with no chief.
WORKERS_TRAIN = ("mwms", "horovod")
ASYNCHRONOUS = ("ps-async", "pss")  # each step runs on one worker, none waits for the others
WITH_PS = ("hybrid", "hybrid-bf16", "ps", "ps-async", "pss")  # contenders whose cluster has ps tasks
_HANDSHAKE_TIMEOUT = 300.0  # seconds a process waits for the harness at a boundary


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    module: str             # the keras_examples module with build_model / make_dataset
    unit: str               # what throughput counts: "examples" or "tokens"
    global_batch: int       # default global batch (the example's own default)
    units_per_example: int = 1
    build: dict = dataclasses.field(default_factory=dict)  # extra build_model kwargs
    data: dict = dataclasses.field(default_factory=dict)   # extra make_dataset kwargs


LM_SEQ_LEN = 20
# keras_examples/criteo.py's DEFAULT_TABLE_SIZES (importing it here would import Keras
# before a contender has chosen Keras 3 or tf_keras).
CRITEO_TABLE_SIZES = (100_000,) * 2 + (20_000,) * 4 + (5_000,) * 8 + (500,) * 12
MODELS = {
    "recommender": ModelSpec("keras_examples.recommender", "examples", 512),
    "lm": ModelSpec("keras_examples.language_model", "tokens", 128,
                    units_per_example=LM_SEQ_LEN, build={"seq_len": LM_SEQ_LEN},
                    data={"seq_len": LM_SEQ_LEN}),
    "cnn": ModelSpec("keras_examples.cnn", "examples", 256),
    "text": ModelSpec("keras_examples.text_classifier", "examples", 256),
    # Idioms of model libraries: a decoder whose token table is its output projection
    # (a dense gradient), and the recommender with an l2 penalty on every table.
    "lm_tied": ModelSpec("keras_examples.decoder_lm", "tokens", 64,
                         units_per_example=LM_SEQ_LEN, build={"seq_len": LM_SEQ_LEN},
                         data={"seq_len": LM_SEQ_LEN}),
    "recommender_l2": ModelSpec("keras_examples.recommender", "examples", 512,
                                build={"l2": 1e-5}),
    # Criteo's shape: 26 tables (a few large, many small) and 13 dense features.
    "criteo": ModelSpec("keras_examples.recommender", "examples", 512,
                        build={"table_sizes": CRITEO_TABLE_SIZES, "num_dense": 13},
                        data={"table_sizes": CRITEO_TABLE_SIZES, "num_dense": 13}),
    # 8 single-hot tables of 10,000 rows, fixed `Embedding`s or `DynamicEmbedding`s of
    # the same rows: what a dynamic table's step costs beside a fixed one's.
    "recommender8": ModelSpec("keras_examples.recommender", "examples", 512,
                              build={"table_sizes": (10_000,) * 8},
                              data={"table_sizes": (10_000,) * 8}),
    "recommender8_dynamic": ModelSpec("keras_examples.recommender", "examples", 512,
                                      build={"table_sizes": (10_000,) * 8, "dynamic": True},
                                      data={"table_sizes": (10_000,) * 8}),
}


def base_of(contender):
    """The registered contender a "NAME:key=value:..." contender adds options to."""
    return contender.split(":", 1)[0]


def hybrid_options(contender):
    """The HybridStrategy keyword arguments of a HybridStrategy contender.

    ```python
    hybrid_options("ps-async")                          # architecture "ps", asynchronous
    hybrid_options("hybrid:sparse_update='exact'")      # architecture "hybrid", exact
    ```
    """
    name, *extra = contender.split(":")
    if name not in HYBRID_ARCHITECTURES:
        raise ValueError(f"contender {contender!r}: options follow one of "
                         f"{', '.join(HYBRID_ARCHITECTURES)}")
    options = {"architecture": HYBRID_ARCHITECTURES[name], **HYBRID_OPTIONS.get(name, {})}
    for item in extra:
        key, _, value = item.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"contender {contender!r}: {item!r} is not key=<Python "
                             "literal>, e.g. sparse_update='exact'") from None
    return options


def is_asynchronous(contender):
    """Whether each step of `contender` runs on one worker, the workers not waiting for each
    other: pss, ps-async, and a HybridStrategy contender given `asynchronous=True`."""
    base = base_of(contender)
    if base in ASYNCHRONOUS:
        return True
    return base in HYBRID_ARCHITECTURES and bool(hybrid_options(contender).get("asynchronous"))


def model_available(name):
    """Whether keras_examples has the model's module yet (without importing TensorFlow)."""
    spec = MODELS[name]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        *spec.module.split(".")) + ".py"
    return os.path.exists(path)


# tf_keras as `keras` ----------------------------------------------------------------


def _take(x, indices, axis=None):
    """`keras.ops.take` for tf_keras: a row lookup for axis 0 (sparse gradient, and
    per-shard on a ParameterServerStrategy ShardedVariable), else `tf.gather`."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if axis == 0:
        return tf.nn.embedding_lookup(x, indices)
    return tf.gather(x, indices, axis=axis)


def install_tf_keras_as_keras():
    """Makes `import keras` return tf_keras (with keras.ops.take / convert_to_tensor)."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras  # pylint: disable=import-outside-toplevel

    shim = types.ModuleType("keras", "tf_keras, seen by the examples as `keras`")
    shim.__getattr__ = lambda name: getattr(tf_keras, name)
    shim.__version__ = tf_keras.__version__
    shim.ops = types.SimpleNamespace(take=_take, convert_to_tensor=tf.convert_to_tensor)
    sys.modules["keras"] = shim
    return shim


def _adapt_for_tf_keras(module):
    """Fixes what tf_keras does differently for a model class defined for Keras 3."""
    lm_class = getattr(module, "LanguageModel", None)
    if lm_class is None:
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        # tf_keras refuses a Keras loss object called under a strategy outside compile()
        # and does not divide by the number of replicas: average over the global batch.
        hidden = tf.reshape(y_pred, [-1, self.embedding_dim])
        targets = tf.reshape(y, [-1])
        logits = self.softmax.sampled_logits(hidden, targets)
        per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.zeros_like(targets), logits=logits)
        loss = tf.nn.compute_average_loss(per_token)
        tracker = getattr(self, "_bench_loss", None)
        if tracker is not None:  # the "loss" of the logs, as Keras 3 reports it
            tracker.update_state(tf.reduce_mean(per_token))
        return loss

    lm_class.compute_loss = compute_loss


# Strategies -----------------------------------------------------------------------


def make_strategy(contender, num_ps):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if base_of(contender) in HYBRID_ARCHITECTURES:
        import hybrid_strategy  # pylint: disable=import-outside-toplevel
        return hybrid_strategy.HybridStrategy(**hybrid_options(contender))
    if contender == "mwms":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if contender == "pss":
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=1 << 20, max_shards=max(num_ps, 1))
        return tf.distribute.ParameterServerStrategy(resolver,
                                                     variable_partitioner=partitioner)
    return tf.distribute.get_strategy()


# Phase boundaries ---------------------------------------------------------------


def _mark(sync_dir, name, text):
    """Writes `<sync_dir>/<name>` whole (the harness never reads half a file)."""
    path = os.path.join(sync_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def handshake(sync_dir, phase, task, timeout=_HANDSHAKE_TIMEOUT):
    """Tells the harness this process reached `phase`; waits until it has read counters."""
    if not sync_dir:
        return
    _mark(sync_dir, f"{phase}.{task}", repr(time.time()))
    go = os.path.join(sync_dir, f"{phase}.go")
    deadline = time.monotonic() + timeout
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} from the harness within {timeout:.0f} s")
        time.sleep(0.002)


_HEARTBEAT_SECONDS = 1.0


def heartbeat(sync_dir, task, step):
    """Tells the harness `task` has done step `step` (read by benchmarks.run.stalled)."""
    if sync_dir:
        _mark(sync_dir, f"step.{task}", str(step))


def make_timer(keras, spec, asynchronous, profiler=None):
    """A Keras callback timing the measured steps and marking the window's boundaries
    (and tracing them with `profiler`, a Profiler, if given)."""

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            # tf_keras: ParameterServerStrategy only accepts batch hooks that take
            # RemoteValues; a synchronous contender's hooks get numbers (the step is done).
            self._supports_tf_logs = asynchronous
            self.step_times, self.start, self.end = [], None, None
            self.first_call = [None, None]  # the first call traces the step
            self.last_logs, self._last = {}, None
            self._beat = -math.inf
            self.measuring = False
            self.warmup = spec["warmup"]
            self.last_step = spec["warmup"] + spec["steps"] - 1

        def _begin(self):
            handshake(spec.get("sync_dir"), "start", spec["task"])
            if profiler is not None:
                profiler.start()
            self.measuring = True
            self.start = self._last = time.perf_counter()

        def _finish(self):
            self.end = time.perf_counter()
            self.measuring = False
            if profiler is not None:
                profiler.stop()
            handshake(spec.get("sync_dir"), "end", spec["task"])

        # Synchronous contenders: one epoch, window by steps.
        def on_train_batch_begin(self, batch, logs=None):
            if self.first_call[0] is None:
                self.first_call[0] = time.perf_counter()
            if not asynchronous and batch == self.warmup:
                self._begin()

        def on_train_batch_end(self, batch, logs=None):
            now = time.monotonic()
            if now - self._beat >= _HEARTBEAT_SECONDS:
                heartbeat(spec.get("sync_dir"), spec["task"], batch)
                self._beat = now
            if asynchronous:
                return
            if self.first_call[1] is None:
                self.first_call[1] = time.perf_counter()
            if self.measuring:
                now = time.perf_counter()
                per_step = spec.get("steps_per_execution", 1)
                self.step_times += [(now - self._last) / per_step] * per_step
                self._last = now
            self.last_logs = {k: float(v) for k, v in (logs or {}).items()
                              if _is_number(v)}
            if batch == self.last_step:
                self._finish()

        # ParameterServerStrategy: epoch 0 warms up, epoch 1 is measured.
        def on_epoch_begin(self, epoch, logs=None):
            if asynchronous and epoch == 1:
                self._begin()

        def on_epoch_end(self, epoch, logs=None):
            if asynchronous:
                self.last_logs = {k: float(v) for k, v in (logs or {}).items()
                                  if _is_number(v)}
                if epoch == 1:
                    self._finish()

    return Timer()


class Profiler:
    """Traces every task of the cluster in TF_CONFIG (or this process alone) from start()
    for `duration_ms`; stop() returns once the trace is written to `logdir`.

    Cluster tasks are traced over their gRPC addresses: TensorFlow's gRPC server (which
    hybrid_strategy.server, tf.distribute.Server and a connected chief all run) also
    serves its profiler. Of the workers only worker 0 is traced: with TF 2.21, tracing
    two workers at once makes one of them crash (SIGSEGV or "free(): invalid size")
    within seconds; the workers run the same program on equal shares.
    """

    def __init__(self, logdir, duration_ms):
        self.logdir, self.duration_ms = logdir, duration_ms
        self.tasks = {}
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
        for job, addresses in cluster.items():
            for index, address in enumerate(addresses):
                if job == "chief":
                    self.tasks["chief"] = address
                elif job != "worker" or index == 0:
                    self.tasks[f"{job}{index}"] = address
        self._thread = None
        self._error = None

    def start(self):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        if not self.tasks:
            tf.profiler.experimental.start(self.logdir)
            return
        service = ",".join(f"grpc://{address}" for address in self.tasks.values())

        def trace():
            try:
                tf.profiler.experimental.client.trace(service, self.logdir, self.duration_ms)
            except Exception as e:  # pylint: disable=broad-except
                self._error = e

        self._thread = threading.Thread(target=trace, name="profiler-client", daemon=True)
        self._thread.start()

    def stop(self):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        if self._thread is None:
            tf.profiler.experimental.stop()
        else:
            self._thread.join()
            if self._error is not None:
                raise RuntimeError(f"profiling the cluster failed: {self._error}")

    def summary(self):
        from benchmarks import trace_summary  # pylint: disable=import-outside-toplevel
        # A local trace is named after this host.
        tasks = self.tasks or {"chief": socket.gethostname()}
        try:
            return trace_summary.summarize(self.logdir, tasks)
        except ValueError as e:  # e.g. steps that ran where no traced thread calls them
            return {"error": str(e)}


def per_worker_input(strategy, arrays, global_batch):
    """`arrays` as a distributed dataset in which each worker builds only its own batches.

    Worker w of W reads the w-th of W equal parts of every global batch (examples
    [i * B, (i + 1) * B) make global batch i, as in the dataset that `single` reads),
    so that the input pipeline costs a worker its share only, as ParameterServerStrategy's
    `DatasetCreator` does.
    """
    from keras_examples import common  # pylint: disable=import-outside-toplevel

    def dataset_fn(context):
        return common.batched_dataset(
            worker_share(arrays, global_batch, context.input_pipeline_id,
                         context.num_input_pipelines),
            global_batch // context.num_input_pipelines, repeat=True)

    return strategy.distribute_datasets_from_function(dataset_fn)


def worker_share(arrays, global_batch, index, workers):
    """Worker `index` of `workers`' part of `arrays` (numpy, any nesting): the `index`-th
    of `workers` equal parts of every global batch of `global_batch` examples."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    share = global_batch // workers
    begin = index * share

    def part(array):
        by_batch = array.reshape((-1, global_batch) + array.shape[1:])
        return by_batch[:, begin:begin + share].reshape((-1,) + array.shape[1:])

    return tf.nest.map_structure(part, arrays)


def _is_number(value):
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def vm_hwm_kib(pid="self"):
    """Peak resident set (VmHWM) of a process in KiB, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# The chief ------------------------------------------------------------------------


class Trainer:
    """A contender's Keras (Keras 3 or tf_keras), strategy and model module, and its way
    of feeding `fit`; made first in a training program (connecting to the cluster
    invalidates variables made before).

    ```python
    trainer = Trainer("hybrid", "recommender", num_ps=1)
    model = trainer.build_model()
    trainer.fit(model, examples=512 * 100, batch=512, epochs=1, steps_per_epoch=100)
    ```
    """

    def __init__(self, contender, model_name, num_ps):
        self.contender = contender
        self.model_spec = MODELS[model_name]
        self.legacy = contender in LEGACY_KERAS
        if self.legacy:
            self.keras = install_tf_keras_as_keras()
            self.keras_name = f"tf_keras {self.keras.__version__}"
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        if not self.legacy:
            import keras  # pylint: disable=import-outside-toplevel
            self.keras, self.keras_name = keras, f"keras {keras.__version__}"
        tf.get_logger().setLevel("ERROR")
        self.tf = tf
        self.strategy = make_strategy(contender, num_ps)
        self.module = importlib.import_module(self.model_spec.module)
        if self.legacy:
            _adapt_for_tf_keras(self.module)
        self.asynchronous = is_asynchronous(contender)

    @property
    def strategy_name(self):
        """What the results call the way this contender distributes training."""
        return type(self.strategy).__name__

    @property
    def replicas(self):
        """Replicas that train in sync (each on its part of every global batch)."""
        return self.strategy.num_replicas_in_sync

    def build_model(self, seed=0, strategy=None):
        """The model, under `strategy` (default: the contender's), from `seed`."""
        keras = self.keras
        keras.utils.set_random_seed(seed)  # the same initial weights in every run
        with (strategy or self.strategy).scope():
            model = self.module.build_model(**self.model_spec.build)
            if self.legacy and hasattr(self.module, "LanguageModel"):
                model._bench_loss = keras.metrics.Mean(name="loss")
                model.built = True  # its build() is the Keras 3 one; the layers are built
        return model

    def dataset(self, examples, batch, seed=0, shards=1, index=0, repeat=True):
        """The model's data: `examples` examples in batches of `batch`, batch-sharded."""
        tf = self.tf
        data = self.module.make_dataset(examples, batch, seed=seed, repeat=repeat,
                                        **self.model_spec.data)
        if shards > 1:
            data = data.shard(shards, index)
        if self.contender == "mwms":
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.DATA)
            data = data.with_options(options)
        return data

    def fit(self, model, examples, batch, **fit_kwargs):
        """`model.fit` on the repeated training data, as this contender takes it."""
        if self.contender == "pss":
            def dataset_fn(context):
                return self.dataset(examples, batch, shards=context.num_input_pipelines,
                                    index=context.input_pipeline_id)
            data = self.keras.utils.experimental.DatasetCreator(dataset_fn)
        elif base_of(self.contender) in HYBRID_ARCHITECTURES and not self.asynchronous:
            # Each worker builds only its own batches, as pss's workers do.
            arrays = self.module.make_arrays(examples, seed=0, **self.model_spec.data)
            data = per_worker_input(self.strategy, arrays, batch)
        else:
            data = self.dataset(examples, batch)
        return model.fit(data, verbose=0, shuffle=False, **fit_kwargs)


def run(spec, trainer_class=Trainer):
    """Trains spec's model under spec's contender, as `trainer_class` (a Trainer) does;
    writes the results JSON (task 0)."""
    contender = spec["contender"]
    started = time.perf_counter()
    trainer = trainer_class(contender, spec["model"], spec.get("num_ps", 0))
    keras, tf, strategy = trainer.keras, trainer.tf, trainer.strategy
    model_spec = trainer.model_spec
    batch = spec["global_batch"]
    asynchronous = trainer.asynchronous
    warmup_steps = spec["steps"] if asynchronous else spec["warmup"]
    total = warmup_steps + spec["steps"]
    model = trainer.build_model()
    steps_per_execution = spec.get("steps_per_execution", 1)
    if steps_per_execution > 1:
        # The examples compile their models; only the steps per call change.
        if trainer.legacy:
            model._configure_steps_per_execution(steps_per_execution)
        else:
            model.steps_per_execution = steps_per_execution
    profile = spec.get("profile")
    profiler = Profiler(profile["logdir"], profile["duration_ms"]) if profile else None
    timer = make_timer(keras, spec, asynchronous, profiler)
    setup_seconds = time.perf_counter() - started
    # Asynchronous contenders: epoch 0 warms up, epoch 1 is measured.
    epochs, steps_per_epoch = (2, spec["steps"]) if asynchronous else (1, total)
    trainer.fit(model, batch * total, batch, epochs=epochs, steps_per_epoch=steps_per_epoch,
                callbacks=[timer])

    seconds = timer.end - timer.start
    steps = spec["steps"]
    examples_per_s = steps * batch / seconds
    result = {
        "contender": contender,
        "model": spec["model"],
        "keras": trainer.keras_name,
        "tensorflow": tf.__version__,
        "strategy": trainer.strategy_name,
        "architecture": HYBRID_ARCHITECTURES.get(base_of(contender)),
        "strategy_options": ({key: value for key, value in hybrid_options(contender).items()
                              if key != "architecture"}
                             if base_of(contender) in HYBRID_ARCHITECTURES else {}),
        "replicas_in_sync": trainer.replicas,
        "global_batch": batch,
        "warmup_steps": warmup_steps,
        "steps": steps,
        "steps_per_execution": steps_per_execution,
        "synchronous": not asynchronous,
        "measured_seconds": seconds,
        "step_times_s": timer.step_times,
        "median_step_s": (statistics.median(timer.step_times) if timer.step_times
                          else seconds / steps),
        "median_step_is_mean": not timer.step_times,
        "examples_per_s": examples_per_s,
        "unit": model_spec.unit,
        "units_per_s": examples_per_s * model_spec.units_per_example,
        "setup_seconds": setup_seconds,
        "first_call_seconds": (None if None in timer.first_call
                               else timer.first_call[1] - timer.first_call[0]),
        "last_logs": timer.last_logs,
        "chief_vmhwm_kib": vm_hwm_kib(),
    }
    if base_of(contender) in HYBRID_ARCHITECTURES:
        result["placement"] = str(strategy.placement)
    if profiler is not None:
        result["profile"] = profiler.summary()
    if spec.get("write_result", True):
        tmp = spec["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, spec["result"])
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.contenders SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    run(spec)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A process connected to a cluster can hang in interpreter teardown while gRPC
    # threads run: results are written, leave at once.
    os._exit(code)
