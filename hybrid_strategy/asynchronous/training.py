"""Asynchronous training, as Parallax trains in its PS architecture: workers do not wait for each other.

`HybridStrategy(architecture="ps", asynchronous=True)` keeps every variable on the PS tasks
(tables by row; what synchronous training mirrors, such as optimizer counters, whole on
one PS task; metric state per replica, as in synchronous training, each worker's
replicas keeping their own) and gives each worker a training step of its own: a
function replicated over that worker's devices only, which reads that worker's own
batches and applies its gradients to the PS variables itself, with no all-reduce and no
wait for the other workers. The chief runs these functions from one thread per worker
(TensorFlow releases the GIL while a function runs), so all workers train at once.

What Keras sees (`model.fit`, Keras 3 and tf_keras; keras_integration/asynchronous_hooks.py
makes Keras use this module):
- **A step** is one global batch, trained on one worker (split over its replicas), as
  `tf.distribute.ParameterServerStrategy` does: the update is that batch's, as on one
  device, but computed from variables that other workers' steps may have changed since
  it read them. Worker w of W reads batches w, w + W, w + 2W, ... of the dataset (file by
  file when the dataset reads at least W files, as tf.data's auto-sharding does), so
  every example of an epoch is used once. Each call of the training function hands one
  step (N with `steps_per_execution=N`) to whichever worker is free and still has data,
  and returns while it runs; calls wait only while every worker has a step running and
  one queued.
- **Logs** passed to `on_train_batch_end` are those of the latest step that finished
  (the running metrics of the worker that ran it); the first call of each epoch waits
  for its own step, so there always are some. Epoch logs cover every step.
- **Epochs** end once every step handed out has finished: `on_epoch_end`, validation,
  checkpoints and `evaluate` see every step's updates. Saving a checkpoint or the
  weights, `evaluate` and `predict` also wait for the steps in flight when called in the
  middle of an epoch; other reads from a callback (`get_weights`) may see some of them.
- `evaluate` and `predict` run synchronously over every worker, as without this option.

```python
strategy = hybrid_strategy.HybridStrategy(architecture="ps", asynchronous=True)
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
model.fit(dataset, epochs=3)
```
"""

import collections
import contextlib
import threading
import weakref

import tensorflow as tf

# TF-private: the piece of tf.distribute's input pipeline that shards a dataset for one
# worker, the update context and the variable wrapper that aggregates replicas' writes
# (as ParameterServerStrategy has it).
from hybrid_strategy.tensorflow_private import distribute_lib
from hybrid_strategy.tensorflow_private import distribute_utils
from hybrid_strategy.tensorflow_private import input_ops
from hybrid_strategy.tensorflow_private import ps_values

from hybrid_strategy import tracing
from hybrid_strategy.input import worker_input

# Steps a worker may have in flight: one running and one queued, so that it starts its
# next step without waiting for the chief.
STEPS_IN_FLIGHT_PER_WORKER = 2
_LIVE_RUNNERS = weakref.WeakSet()


# Which worker the strategy works for ------------------------------------------------


class WorkerScope:
    """Tells the strategy which worker's devices to replicate over while a step is traced.

    The strategy replicates over every worker's devices, except while it works for one
    worker: inside `with scope.of_worker(w)` on this thread (building that worker's
    input, calling its step function), and in any function traced there, whichever
    thread reads it (tf.distribute traces each replica on a thread of its own), but
    not inside `with scope.of_every_worker()` on this thread (creating a variable).
    """

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._graphs = weakref.WeakKeyDictionary()  # outermost FuncGraph -> worker
        self._tracing = threading.RLock()  # re-entered by a strategy.run within a run

    def of_worker(self, worker):
        return self._on_this_thread("worker", worker)

    def of_every_worker(self):
        """Within, on this thread, the strategy works for every worker, in a function
        traced for one too: a variable a worker's step creates (tf_keras builds its
        metrics in the first step) is the model's, with a part on every replica."""
        return self._on_this_thread("every", True)

    @contextlib.contextmanager
    def _on_this_thread(self, name, value):
        previous = getattr(self._local, name, None)
        setattr(self._local, name, value)
        try:
            yield
        finally:
            setattr(self._local, name, previous)

    @contextlib.contextmanager
    def one_trace_at_a_time(self):
        """Within, while a function is traced: no other thread traces such a block.

        The strategy traces each replica step (`strategy.run`) of a worker's step in
        one: Keras keeps what a step traces in objects every worker's step shares (the
        losses layers add, kept in the layers; tf_keras' compiled loss and metrics,
        built in the first step), which only one thread may fill at a time. The
        package's own state of a trace is per trace or per thread (tracing.py), and
        tracing is Python, which runs one thread at a time anyway; steps already
        traced run at once.
        """
        if not tf.inside_function():
            yield
            return
        with self._tracing:
            yield

    def current(self):
        """The worker index being worked for, or None for every worker."""
        if getattr(self._local, "every", False):
            return None
        worker = getattr(self._local, "worker", None)
        if not getattr(tf.compat.v1.get_default_graph(), "building_function", False):
            return worker
        graph = tracing.outermost()
        with self._lock:
            if graph not in self._graphs:
                if worker is None:
                    return None
                self._graphs[graph] = worker
            return self._graphs[graph]


# Variables ------------------------------------------------------------------------------


def create_shared(next_creator, kwargs, device, strategy, replicas_per_worker):
    """One variable on `device` that every worker's steps read and write.

    What synchronous training mirrors (optimizer counters, scalar weights, their
    slots), but not per-replica state (metrics), which the strategy keeps per replica
    of every worker, so that no two steps write it at once. With several replicas per
    worker, writes made in a replica context are aggregated over the worker's
    replicas first (by the variable's aggregation), as a mirrored variable's would be.
    """
    kwargs = dict(kwargs)
    kwargs.pop("colocate_with", None)
    aggregation = kwargs.pop("aggregation", tf.VariableAggregation.NONE)
    with tf.device(device):
        variable = next_creator(**kwargs)
    if replicas_per_worker > 1:
        variable = ps_values.AggregatingVariable(strategy, variable, aggregation)
    variable._hybrid_shared = True  # pylint: disable=protected-access
    return variable


def is_shared(variable):
    return getattr(variable, "_hybrid_shared", False)


def update_shared(extended, variable, fn, args, kwargs, group):
    """`extended.update` of a shared variable: `fn` once, on the variable's PS task."""
    if isinstance(variable, ps_values.AggregatingVariable):
        variable = variable.get()
    with tf.device(variable.device), distribute_lib.UpdateContext(variable.device):
        result = fn(variable, *distribute_utils.select_replica(0, args),
                    **distribute_utils.select_replica(0, kwargs))
    return distribute_utils.update_regroup(extended, [result], group)


# Input ----------------------------------------------------------------------------------


class AsyncDataset:
    """A dataset distributed for asynchronous training: one pipeline per worker.

    What `strategy.experimental_distribute_dataset(dataset)` returns under an
    asynchronous strategy. Its iterator (`AsyncIterator`) reads each worker's batches
    for that worker's training steps, and the dataset distributed as in synchronous
    training for `evaluate`, `predict` and Keras' first look at a batch. Either is
    built on first use.
    """

    def __init__(self, strategy, scope, dataset, options, synchronous):
        self._strategy = strategy
        self._scope = scope
        self._dataset = dataset
        self._options = options
        self._make_synchronous = synchronous
        self._synchronous = None

    def synchronous(self):
        if self._synchronous is None:
            self._synchronous = self._make_synchronous()
        return self._synchronous

    @property
    def element_spec(self):
        return self.synchronous().element_spec

    def worker_iterator(self, worker):
        """A fresh iterator over worker `worker`'s batches, split over its replicas."""
        hosts = self._strategy.extended.input_hosts
        host, devices = hosts[worker]
        dataset = self._dataset
        if len(hosts) > 1:
            # By file when the dataset reads enough files, else every W-th batch.
            dataset = input_ops.auto_shard_dataset(dataset, len(hosts), worker, len(devices))
        with self._scope.of_worker(worker):
            return iter(worker_input.distributed_by_tensorflow(
                dataset, [(host, devices)], self._strategy, len(devices), self._options))

    def __iter__(self):
        return AsyncIterator(self)


class AsyncIterator:
    """Each worker's batches for its training steps; the synchronous ones for the rest.

    Iterating it in Python (Keras' first look at a batch, `predict`) reads the
    synchronous distribution, as `get_next` does.
    """

    def __init__(self, dataset):
        self._dataset = dataset
        self._workers = None
        self._synchronous = None

    def synchronous(self):
        if self._synchronous is None:
            self._synchronous = iter(self._dataset.synchronous())
        return self._synchronous

    def start(self, num_workers):
        """Makes every worker's iterator (on this thread, before the workers need them)."""
        if self._workers is None:
            self._workers = [self._dataset.worker_iterator(w) for w in range(num_workers)]

    def of_worker(self, worker):
        return self._workers[worker]

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.synchronous())

    def get_next(self):
        return self.synchronous().get_next()

    def get_next_as_optional(self):
        return self.synchronous().get_next_as_optional()

    @property
    def element_spec(self):
        return self.synchronous().element_spec


def synchronous_iterator(iterator):
    """The synchronous distribution's iterator of `iterator`, or `iterator` itself."""
    return iterator.synchronous() if isinstance(iterator, AsyncIterator) else iterator


# Running steps on the workers --------------------------------------------------------------


class _Ticket:
    """One call of the training function: `steps` steps for some worker to run."""

    __slots__ = ("iterator", "functions", "steps", "done", "ran_out")

    def __init__(self, iterator, functions, steps):
        self.iterator, self.functions, self.steps = iterator, functions, steps
        self.done = self.ran_out = False


class _Workers:
    """One thread per worker, each running the queued steps its worker can take.

    Holds nothing of the model: a ticket carries the step functions, so that the
    model and its training function can be released while the threads wait.
    """

    def __init__(self, num_workers, scope):
        self.num_workers = num_workers
        self._scope = scope
        self.cv = threading.Condition()
        self.queue = collections.deque()
        self.running = 0
        self.error = None
        self.latest = None  # the logs of the latest step that finished
        self.fresh = True  # no step of this epoch has finished yet
        self._exhausted = weakref.WeakKeyDictionary()  # iterator -> workers out of data
        self._closed = False
        self._threads = None

    def start(self):
        if self._threads is None:
            self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True,
                                              name=f"hybrid-strategy-async-worker-{w}")
                             for w in range(self.num_workers)]
            for thread in self._threads:
                thread.start()

    def close(self):
        with self.cv:
            self._closed = True
            self.cv.notify_all()

    def ran_out(self, iterator):
        return len(self._exhausted.get(iterator, ())) == self.num_workers

    def raise_error(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _take(self, worker):
        for ticket in self.queue:
            if worker not in self._exhausted.get(ticket.iterator, ()):
                self.queue.remove(ticket)
                return ticket
        return None

    def _serve(self, worker):
        while True:
            with self.cv:
                ticket = None
                while not self._closed and ticket is None:
                    ticket = self._take(worker)
                    if ticket is None:
                        self.cv.wait()
                if self._closed:
                    return
                self.running += 1
            ran, logs, error = 0, None, None
            try:
                with self._scope.of_worker(worker):
                    ran, logs = ticket.functions[worker](ticket.iterator.of_worker(worker),
                                                         ticket.steps)
            except Exception as e:  # pylint: disable=broad-except  (raised on the chief's thread)
                error = e
            with self.cv:
                self.running -= 1
                if error is not None:
                    self.error = self.error or error
                    self._drop(lambda t: True)
                    ticket.done = True
                else:
                    self._account(ticket, worker, ran, logs)
                del ticket
                self.cv.notify_all()

    def _account(self, ticket, worker, ran, logs):
        """Records a call that ran `ran` of its ticket's steps on `worker`."""
        if ran:
            self.latest = logs
            ticket.done = True
        if ran == ticket.steps:
            return
        # The worker has read all its batches: another takes the steps left.
        self._exhausted.setdefault(ticket.iterator, set()).add(worker)
        rest = ticket if not ran else _Ticket(ticket.iterator, ticket.functions,
                                               ticket.steps - ran)
        self.queue.appendleft(rest)
        if self.ran_out(ticket.iterator):
            self._drop(lambda t, it=ticket.iterator: t.iterator is it)

    def _drop(self, which):
        """Takes queued tickets out unrun: no worker has data left for them, or a step failed."""
        for ticket in [t for t in self.queue if which(t)]:
            self.queue.remove(ticket)
            ticket.done = ticket.ran_out = True

    def join(self, cancel=False):
        """Waits until every step handed out has finished (`cancel`: unless not started)."""
        with self.cv:
            if cancel:
                self._drop(lambda t: True)
            while self.queue or self.running:
                self.cv.wait()
            self.fresh = True
            if cancel:
                self.error = None
            else:
                self.raise_error()


class AsyncTrainFunction:
    """Keras' training function under an asynchronous strategy (see the module's doc).

    Args:
        functions: One step function per worker, `function(iterator, steps) ->
            (steps run, logs)`, each traced for that worker's replicas (inside
            `scope.of_worker(w)`); it runs up to `steps` steps, fewer when the
            worker's batches run out.
        scope: The strategy's `WorkerScope`.
        steps_per_call: `steps_per_call()`, the steps of the next call (Keras'
            steps per execution).
        one_step: `one_step()` makes a Keras 3 training function for a batch given
            as data (`train_on_batch`), which runs on the first worker.
    """

    def __init__(self, functions, scope, steps_per_call, one_step=None):
        self._functions = functions
        self._scope = scope
        self._steps_per_call = steps_per_call
        self._make_one_step = one_step
        self._one_step = None
        self._workers = _Workers(len(functions), scope)
        weakref.finalize(self, self._workers.close)
        _LIVE_RUNNERS.add(self)

    def __call__(self, iterator):
        if not isinstance(iterator, AsyncIterator):
            # train_on_batch: one step, here and now, on the first worker.
            self.join()
            self._one_step = self._one_step or self._make_one_step()
            with self._scope.of_worker(0):
                return self._one_step(iterator)
        workers = self._workers
        iterator.start(workers.num_workers)
        workers.start()
        with workers.cv:
            workers.raise_error()
            limit = STEPS_IN_FLIGHT_PER_WORKER * workers.num_workers
            while len(workers.queue) + workers.running >= limit and workers.error is None:
                workers.cv.wait()
            workers.raise_error()
            if workers.ran_out(iterator):
                return self._end_of_data()
            ticket = _Ticket(iterator, self._functions, self._steps_per_call())
            workers.queue.append(ticket)
            workers.cv.notify_all()
            if not workers.fresh:
                return workers.latest
            while not ticket.done:
                workers.cv.wait()
            workers.raise_error()
            if ticket.ran_out:
                return self._end_of_data()
            workers.fresh = False
            return workers.latest

    def _end_of_data(self):
        """Every worker has read all its batches: Keras ends the epoch on OutOfRange."""
        workers = self._workers
        while workers.queue or workers.running:
            workers.cv.wait()
        workers.fresh = True
        workers.raise_error()
        raise tf.errors.OutOfRangeError(None, None, "End of sequence")

    def join(self, cancel=False):
        self._workers.join(cancel)


def join_all(cancel=False):
    """Waits for every step in flight in this process (see `AsyncTrainFunction.join`)."""
    for runner in list(_LIVE_RUNNERS):
        runner.join(cancel)
