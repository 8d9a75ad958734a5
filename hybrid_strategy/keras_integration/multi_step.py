"""Keras' training and evaluation steps on a HybridStrategy that spans devices or tasks.

Keras runs `compile(steps_per_execution=N)` as a `tf.while_loop` around the step (Keras 3)
or a `tf.range` loop that autograph turns into one (tf_keras). TensorFlow 2.21 cannot run
that loop when the step spans devices: a function call inside a loop or conditional that
spans devices loses the inputs it captures ("You must feed a value for placeholder
tensor 'while/cond/...'"). So under a HybridStrategy whose replicas span several devices
or tasks, `install()` makes Keras trace the N steps one after the other in one function:

    outputs = step(iterator.get_next())                  # no data at all: OutOfRange
    for the N - 1 other steps:
        has_value, batch = end_of_data.next_if_any(iterator)     # Keras 3
        outputs = tf.cond(has_value, step(batch()), outputs)
        # tf_keras: tf.cond(i < steps_per_execution variable, step(next(iterator)), outputs)

A conditional outside a loop runs across devices, with the step traced inline (not as
a nested function call). Each step reads the variables the one before wrote (automatic
control dependencies order the stateful ops as traced), so N steps per call train
exactly as N calls of one step; a final call with fewer batches left (Keras 3: the data
runs out; tf_keras: its data handler lowers the variable) runs only those. The traced
function holds N copies of the step, so its tracing time and size grow with N.

On an endless dataset (`repeat()`), every step has a batch: Keras 3's N steps then run one
after the other with no conditional, each reading the next step's batch before it is traced,
so that its push carries the next step's lookups and their rows come back with its dense
sum (communication/rows_ahead.py): a worker exchanges one tensor each way per step with
each PS task, where a step alone takes two.

Keras 3 steps also cost this process less per worker, N = 1 included:
- the step is traced inline, so no control edge runs from every task to a no-op on this
  process (Keras' nested step function ends in one, placed where the call is);
- the logs (loss, metrics) are computed on the first replica's device, from the
  metrics' state summed over the replicas (as one device holding every replica's rows
  would have it, however the batch was split), and cross to this process as one vector,
  where Keras would fetch every replica's value of every log and average them;
- the steps are traced under the first replica's device, so what neither Keras nor the
  strategy places (the input pipeline's end-of-data checks, the conditionals between
  steps) runs there, not on this process; each worker's batches stay on that worker
  (input/end_of_data.py).
"""

import math
import weakref

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.communication import riders
from hybrid_strategy.communication import rows_ahead
from hybrid_strategy.input import end_of_data
from hybrid_strategy.keras_integration import batched_lookups
from hybrid_strategy.keras_integration import registry


def install(unrolls):
    """Makes Keras 3 (and tf_keras if it is in use) run steps as this module says.

    Args:
        unrolls: `unrolls(strategy)` says whether a model under `strategy` runs its
            steps this way (a HybridStrategy spanning several devices or tasks).
    """
    _install_keras3(unrolls)
    if versions.legacy_keras() is not None:
        _install_tf_keras(unrolls)


def unrolled_steps(steps, first_step, later_step):
    """`run(iterator)`: step 0, then steps 1 to `steps` - 1, each if its predicate holds.

    Args:
        steps: Steps per call (N).
        first_step: `first_step(iterator) -> outputs`, step 0 (it reads its batch).
        later_step: `later_step(iterator, i) -> (bool tensor, thunk)` for step i >= 1:
            whether it runs, and the step (`thunk() -> outputs`).
    Returns:
        A function returning the outputs of the last step that ran.
    """
    def run(iterator):
        outputs = first_step(iterator)
        for i in range(1, steps):
            runs, step = later_step(iterator, i)
            outputs = tf.cond(runs, step, lambda o=outputs: o)
        return outputs

    return run


class PackedLogs:
    """A step's outputs, with its float32 scalars (the logs) in one vector.

    Keras fetches every replica's value of every log to this process and averages
    them here, with equal weights. When the step's outputs are the model's metric
    results (Keras' own steps), `pack` computes them instead from each metric's
    state summed over the replicas, as one device holding every replica's rows would:
    each replica's state variables cross to the first replica's device as one vector
    per dtype. Other float32 scalars are averaged there, as Keras does. `unpack`
    splits the logs' vector on this process, so one tensor crosses to it. Other
    outputs are reduced as Keras does (`reduce_per_replica(value, strategy, "auto")`).
    Both run while the step is traced.
    """

    def __init__(self, model, reduce_per_replica):
        self._model = model
        self._strategy = model.distribute_strategy
        self._reduce_per_replica = reduce_per_replica
        self._structure, self._scalars = None, ()

    def summed_with_push(self):
        """Registers the metrics' state to ride with the step's push (riders.py); the
        `Summed` to hand `pack`, or None where no push carries it."""
        if not self._strategy.extended.pushes:
            return None
        groups = list(_summable_by_dtype(self._model.metrics,
                                         self._strategy.extended.replica_parts[0]).values())
        if not groups:
            return None
        return riders.summed_with_push(lambda: [
            self._per_replica(variables) for variables in groups])

    def pack(self, outputs, state=None):
        """`state`: the metrics' state summed on the reducer PS by the step's push
        (`summed_with_push`); the logs are then computed there."""
        strategy = self._strategy
        devices = strategy.extended.worker_devices
        summed = state.result() if state is not None else None
        # The logs are made where the state was summed, the first replica's device or the PS.
        home = devices[0] if summed is None else summed[0].device
        with tf.device(home):
            results = self._metric_results(summed)
        if isinstance(outputs, dict) and set(outputs) == set(results):
            outputs = {key: results[key] for key in outputs}
        flat = tf.nest.flatten(outputs)
        self._structure = outputs
        self._scalars = [i for i, value in enumerate(flat) if _is_float32_scalar(value)]
        packed = {"rest": [self._reduce_per_replica(value, strategy, "auto")
                           for i, value in enumerate(flat) if i not in self._scalars]}
        if self._scalars:
            per_replica = [i for i in self._scalars if _is_per_replica(flat[i])]
            vectors = []
            for device, values in zip(devices, zip(*(
                    strategy.experimental_local_results(flat[i]) for i in per_replica))):
                with tf.device(device):
                    vectors.append(tf.stack(values))
            with tf.device(home):
                means = iter(tf.unstack(tf.reduce_mean(tf.stack(vectors), axis=0))
                             if vectors else ())
                packed["logs"] = tf.stack([next(means) if i in per_replica else flat[i]
                                           for i in self._scalars])
        return packed

    def unpack(self, packed):
        logs = ()
        if "logs" in packed:
            with tf.device(_this_process_device()):
                logs = tf.unstack(tf.identity(packed["logs"]))
        logs, rest = iter(logs), iter(packed["rest"])
        flat = [next(logs) if i in self._scalars else next(rest)
                for i in range(len(self._scalars) + len(packed["rest"]))]
        return tf.nest.pack_sequence_as(self._structure, flat)

    def _per_replica(self, variables):
        """Each replica's state of `variables` (metric variables of one dtype) as one
        vector, on the replica's device: the step's replicas' (an asynchronous step's
        are its worker's, whose own running metrics its logs are)."""
        strategy = self._strategy
        _, parts = strategy.extended.replica_parts
        vectors = []
        for part, device in zip(parts, strategy.extended.worker_devices):
            with tf.device(device):
                vectors.append(tf.concat([tf.reshape(tf.convert_to_tensor(
                    strategy.experimental_local_results(v.value)[part]), [-1])
                    for v in variables], 0))
        return vectors

    def _metric_results(self, summed=None):
        """The model's metric results, from their state summed over the replicas (here,
        or `summed`: the sums of `summed_with_push`'s groups, made by the push)."""
        import keras  # pylint: disable=import-outside-toplevel  (Keras 3)

        every, ours = self._strategy.extended.replica_parts
        replicas = len(ours)
        groups = list(_summable_by_dtype(self._model.metrics, every).values())
        if summed is None:
            summed = [tf.add_n(self._per_replica(variables)) for variables in groups]
        state = []
        for variables, total in zip(groups, summed):
            parts = tf.split(total, [math.prod(v.shape) for v in variables])
            for v, part in zip(variables, parts):
                value = tf.reshape(part, v.shape)
                state.append((v, value / replicas if v.aggregation == "mean" else value))
        with keras.StatelessScope(state_mapping=state):
            return self._model.get_metrics_result()


def _this_process_device():
    """Where this process runs its own ops, e.g. /job:chief/replica:0/task:0/device:CPU:0."""
    with tf.init_scope():
        return tf.constant(0).device


def _is_per_replica(value):
    return isinstance(value, tf.distribute.DistributedValues)


def _is_float32_scalar(value):
    """A float32 scalar, or one per replica."""
    values = value.values if _is_per_replica(value) else (value,)
    return all(tf.is_tensor(v) and v.dtype == tf.float32 and v.shape.rank == 0
               for v in values)


def _summable_by_dtype(metrics, num_replicas):
    """`{dtype: [variable]}`: the metrics' variables with a part on every replica
    (`num_replicas` parts), whose cross-replica value is their parts' sum or mean."""
    groups = {}
    for metric in metrics:
        for variable in metric.variables:
            if (variable.aggregation in ("sum", "mean") and isinstance(
                    variable.value, tf.distribute.DistributedValues)
                    and len(variable.value.values) == num_replicas):
                groups.setdefault(variable.dtype, []).append(variable)
    return groups


def _install_keras3(unrolls):
    # Keras-private: the trainer that builds `model.train_function` and
    # `model.test_function`; Keras has no public way to change its step loop.
    from keras.src.backend.tensorflow import trainer as trainer_lib

    def make(original):
        def _make_function(self, step_function):
            if not unrolls(self.distribute_strategy):
                return original(self, step_function)
            return keras3_function(self, step_function, trainer_lib)
        return _make_function

    registry.install("multi_step.unrolled_steps", make)


def keras3_function(model, step_function, trainer_lib, counted=False):
    """Keras 3's `_make_function`: the step inline, N steps unrolled, logs packed.

    `counted`: the function is `counted_function`'s (it counts the steps it ran).
    """
    strategy = model.distribute_strategy
    steps = model.steps_per_execution
    logs = PackedLogs(model, trainer_lib.reduce_per_replica)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        state = logs.summed_with_push()
        return logs.pack(strategy.run(step_function, args=(data,)), state)

    # Traced inline, not as a nested tf.function: a function call inside a
    # conditional that spans devices loses its captured inputs on TensorFlow 2.21.
    if model.jit_compile and not model.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True,
                                       jit_compile=True)
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)
    if counted:
        return counted_function(strategy, steps, one_step_on_data, logs.unpack,
                                model.run_eagerly)

    def later_step(iterator, _):
        # Each worker's batch picked on that worker (input/end_of_data.py), not in one
        # optional on the first worker.
        has_value, batch = end_of_data.next_if_any(iterator)
        return has_value, lambda: one_step_on_data(batch())

    # With no batch at all, get_next raises OutOfRange, which ends Keras' epoch.
    unrolled = unrolled_steps(
        steps, lambda iterator: one_step_on_data(iterator.get_next()), later_step)

    def run_steps(iterator):
        if steps > 1 and strategy.extended.pushes and end_of_data.endless(iterator):
            return _steps_reading_ahead(model, steps, one_step_on_data, iterator)
        return unrolled(iterator)

    def multi_step_on_iterator(iterator):
        # Unplaced ops would land on this process, each step's data passing through it.
        with tf.device(strategy.extended.worker_devices[0]):
            packed = run_steps(iterator)
        return logs.unpack(packed)

    def step_on_data(data):
        return logs.unpack(one_step_on_data(data))

    if not model.run_eagerly:
        multi_step_on_iterator = CallsOnIterator(
            tf.function(multi_step_on_iterator, reduce_retracing=True))
        step_on_data = tf.function(step_on_data, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return multi_step_on_iterator(iterator)
        outputs = None
        for _, data in zip(range(steps), iterator):
            outputs = step_on_data(data)
        return outputs

    return function


def _steps_reading_ahead(model, steps, one_step_on_data, iterator):
    """`unrolled_steps` on an endless dataset, each step's push taking the next step's
    lookups: step i + 1's batch is read before step i is traced, so that step i's push
    carries its ids and its rows come back with step i's dense sum
    (communication/rows_ahead.py). With no end of data to check, the steps run one
    after the other, each seeing the rows the one before gathered for it."""
    data = iterator.get_next()
    for _ in range(steps - 1):
        following = iterator.get_next()
        with rows_ahead.reading_ahead(lambda devices, batch=following: (
                batched_lookups.next_lookups(model, batch, devices))) as ahead:
            one_step_on_data(data)
        batched_lookups.use_rows_ahead(ahead.rows)
        data = following
    return one_step_on_data(data)


class CallsOnIterator:
    """Calls a `tf.function` of one iterator, flattening the iterator once, not per call.

    At every call, TensorFlow flattens its arguments into tensors through their type
    specs: for a distributed iterator, every worker's iterator spec and its components,
    about 2 ms of this process's time per call on 4 workers. The tensors (each worker's
    iterator resource) stay the same for the iterator's life, so after the first call on
    an iterator (an ordinary call: it traces, creates variables), the later ones pass
    the tensors kept from it.
    """

    def __init__(self, function):
        self._function = function
        self._iterator = lambda: None
        self._concrete = self._flat = None

    def __call__(self, iterator):
        if self._iterator() is iterator:
            # TF-private: the call of a traced function with its inputs already flat.
            return self._concrete._call_flat(  # pylint: disable=protected-access
                self._flat, self._concrete.captured_inputs)
        outputs = self._function(iterator)
        concrete = self._function.get_concrete_function(iterator)
        self._concrete, self._iterator = concrete, weakref.ref(iterator, self._forget)
        self._flat = concrete.function_type.unpack_inputs(concrete.function_type.bind(iterator))
        return outputs

    def _forget(self, iterator_ref):
        # The iterator is gone: let go of its tensors, so that its resources go too.
        if self._iterator is iterator_ref:
            self._concrete = self._flat = None


def counted_function(strategy, steps, one_step_on_data, unpack, run_eagerly=False):
    """`run(iterator, limit) -> (steps run, outputs)`: up to `min(steps, limit)` steps.

    Every step, the first included, runs inside a conditional on its batch, so that a
    call with no data left runs nothing at all (not even what does not depend on the
    data, such as the optimizer's step counter); fewer steps than the limit ran when
    the data ran out. `unpack` brings the last step's outputs to this process.
    """
    def counted_steps_on_iterator(iterator, limit):
        with tf.device(strategy.extended.worker_devices[0]):
            count, outputs = _counted_steps(steps, one_step_on_data, iterator, limit)
        with tf.device(_this_process_device()):
            count = tf.identity(count)
        return count, unpack(outputs)

    if not run_eagerly:
        counted_steps_on_iterator = tf.function(counted_steps_on_iterator,
                                                reduce_retracing=True)

    def run(iterator, limit):
        count, outputs = counted_steps_on_iterator(iterator, tf.constant(limit))
        return int(count), outputs

    return run


def on_this_process(outputs):
    """`outputs` (tensors) copied to this process, within a function being traced."""
    with tf.device(_this_process_device()):
        return tf.nest.map_structure(tf.identity, outputs)


def _counted_steps(steps, one_step_on_data, iterator, limit):
    """Up to `min(steps, limit)` steps, each only if its batch exists; (count, outputs).

    Step i reads its batch only if the steps before it ran and i < limit, so that
    the call reads no batch it does not train on; outputs are the last step's
    (zeros if none ran).
    """
    count, outputs = _if_batch(iterator, one_step_on_data, otherwise=None)
    for i in range(1, steps):
        def step(count=count, outputs=outputs):
            ran, new = _if_batch(iterator, one_step_on_data, otherwise=outputs)
            return count + ran, new

        count, outputs = tf.cond(tf.logical_and(i < limit, tf.equal(count, i)), step,
                                 lambda count=count, outputs=outputs: (count, outputs))
    return count, outputs


def _if_batch(iterator, step, otherwise):
    """(1 and `step(batch)` if `iterator` has a batch, else 0 and `otherwise`).

    `otherwise=None`: zeros shaped like the step's outputs.
    """
    batch = iterator.get_next_as_optional()
    specs = []

    def run():
        outputs = step(batch.get_value())
        specs.append(tf.nest.map_structure(tf.TensorSpec.from_tensor, outputs))
        return tf.constant(1), outputs

    def skip():  # traced after run(), so the outputs' specs are known
        if otherwise is not None:
            return tf.constant(0), otherwise
        return tf.constant(0), tf.nest.map_structure(
            lambda spec: tf.zeros([d or 0 for d in spec.shape], spec.dtype), specs[0])

    return tf.cond(batch.has_value(), run, skip)


def _install_tf_keras(unrolls):
    for name, patch in (("make_train_function", "multi_step.tf_keras_unrolled_train_steps"),
                        ("make_test_function", "multi_step.tf_keras_unrolled_test_steps")):
        registry.install(patch, lambda original, name=name: _tf_keras_maker(
            original, name, unrolls))


def _tf_keras_maker(original, name, unrolls):
    """Wraps tf_keras' `make_train_function` or `make_test_function`."""
    attribute = name[len("make_"):]

    def make(self, force=False):
        variable = getattr(self, "_steps_per_execution", None)
        if ((getattr(self, attribute) is not None and not force) or variable is None
                or self.autotune_steps_per_execution
                or not unrolls(self.distribute_strategy)):
            return original(self, force=force)
        steps = int(variable.numpy())
        if steps <= 1:
            return original(self, force=force)
        # tf_keras builds its one-step function when the variable holds 1; the
        # variable keeps N for its data handler, which lowers it for a last,
        # shorter execution.
        variable.assign(1)
        try:
            one_step = original(self, force=True)
        finally:
            variable.assign(steps)
        # Inline, as for Keras 3 (a nested function call loses its inputs).
        one_step = getattr(one_step, "python_function", one_step)
        function = unrolled_steps(
            steps, one_step,
            lambda iterator, i: (tf.less(tf.cast(i, variable.dtype), variable),
                                 lambda: one_step(iterator)))
        if not self.run_eagerly:
            function = tf.function(function, reduce_retracing=True)

        def run(iterator):
            # The data handler lowers the variable (mirrored on the workers) just
            # before the call; reading it here waits for that assignment, which the
            # call's reads on the workers could otherwise overtake.
            variable.numpy()
            return function(iterator)

        setattr(self, attribute, run)
        return run

    return make
