"""Liveness during training: tasks that stop answering, and errors a lost task caused.

An in-graph training step waits on every worker and ps task, so losing one leaves the
chief's program hanging (a stopped or hung task) or failing with pages of gRPC detail
(a dead one). Both end the same way here: one message naming each lost task and its
address, and exit code `cluster.EXIT_TASK_LOST` (75) for a supervisor to restart
the job from its last checkpoint.

- `HealthMonitor` probes every task from background threads and reports those that
  have not answered for a timeout;
- `install_lost_task_hooks` makes an uncaught TensorFlow error that a lost task caused
  exit the same way, and passes every other error to the hooks installed before.

```python
from hybrid_strategy.cluster import config as cluster
from hybrid_strategy.cluster import liveness
config = cluster.parse_tf_config(
    '{"cluster": {"worker": ["127.0.0.1:2221"]}, "task": {"type": "worker", "index": 0}}')
monitor = liveness.HealthMonitor(config, timeout=30.0, on_failure=print).start()
monitor.stop()
```
"""

import os
import sys
import threading
import time

import tensorflow as tf

from hybrid_strategy.cluster import config as cluster_lib

# Errors TensorFlow raises when a connection to another task breaks or times out.
_CONNECTION_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                      tf.errors.CancelledError, tf.errors.DeadlineExceededError)
_PROBE_TIMEOUT = 2.0  # seconds each task gets to answer when an error may name a lost one
# What gRPC says when the connection itself broke (not an error some op raised): the
# peer's process went away, or restarted, under an open channel.
_BROKEN_CONNECTION = ("Broken pipe", "Connection reset", "Socket closed", "Stream removed")
_exiting = threading.Lock()


class HealthMonitor:
    """Probes every task from background threads; reports tasks that stop answering.

    A training step driven from the chief waits on every worker and ps task; when one
    dies, hangs or becomes unreachable mid-step, TensorFlow may keep waiting forever.
    The monitor probes each task (`probe`: an HTTP/2 exchange, which a stopped or hung
    process cannot complete although its kernel still accepts connections) every
    `interval` seconds and, once a task has not answered for `timeout` seconds, calls
    `on_failure(message)` once, naming every task lost by then. `services`, `[(name,
    address)]`, are probed alike (the tf.data service's dispatcher, which the input
    pipelines wait on as they wait on a task).

    ```python
    monitor = HealthMonitor(config, timeout=30.0, on_failure=print)
    monitor.start()
    ...
    monitor.stop()
    ```
    """

    def __init__(self, config: cluster_lib.ClusterConfig, timeout: float, on_failure,
                 interval: float | None = None, skip=(("chief", 0),), services=()):
        cluster_lib.check_timeout(timeout)
        self._timeout = float(timeout)
        # Probes cost well under a millisecond; the interval bounds how late a loss is seen.
        self._interval = interval or min(2.0, self._timeout / 4)
        self._on_failure = on_failure
        skipped = {(job, index) for job, index in skip}
        self._targets = [t for t in config.tasks() if (t[0], t[1]) not in skipped]
        self._targets += [(name, None, address) for name, address in services]
        self._stop = threading.Event()
        self._reported = threading.Lock()
        self._problems: dict = {}  # task -> why its latest probe failed
        self._threads = [
            threading.Thread(target=self._watch, args=(task,), daemon=True,
                             name=f"hybrid-strategy-health-{task[0]}-{task[1] or 0}")
            for task in self._targets]

    def start(self):
        for thread in self._threads:
            thread.start()
        return self

    def stop(self):
        self._stop.set()

    def _watch(self, task):
        # One thread per task: a probe that waits out its timeout delays no other task.
        last_answer = time.monotonic()
        while not self._stop.wait(self._interval):
            problem = cluster_lib.probe(task[2], max(self._interval, 1.0))
            if problem is None:
                last_answer = time.monotonic()
                self._problems.pop(task, None)
                continue
            self._problems[task] = problem
            if time.monotonic() - last_answer >= self._timeout and not self._stop.is_set():
                self._report()
                return

    def _report(self):
        if not self._reported.acquire(blocking=False):
            return
        self._stop.set()
        lost = [(task, self._problems[task]) for task in self._targets if task in self._problems]
        self._on_failure(
            f"{len(lost)} task(s) stopped answering for {self._timeout:g} s:\n"
            f"{cluster_lib.describe_tasks(lost)}\nThe training step cannot finish without them.")


def exit_on_lost_task(message):
    """Ends this process: a lost task leaves the step, and so the program, hanging."""
    with _exiting:  # the monitor and the exception hook may both get here; one speaks
        sys.stderr.write(
            f"HybridStrategy: {message}\nExiting with code {cluster_lib.EXIT_TASK_LOST}; "
            "restart the task and the program (restoring from your last checkpoint).\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # Not sys.exit: interpreter teardown would wait on RPCs to the lost task.
        os._exit(cluster_lib.EXIT_TASK_LOST)


def install_lost_task_hooks(config):
    """Turns an uncaught TensorFlow error caused by a lost task into `exit_on_lost_task`.

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
    """Exits with code 75 when `error` comes from a task that died, hung or restarted."""
    lost = tasks_lost_behind(config, error)
    if lost:
        exit_on_lost_task(
            f"lost {len(lost)} task(s) during training ({type(error).__name__}):\n"
            f"{cluster_lib.describe_tasks(lost)}\nThe training step cannot finish without them.")


def tasks_lost_behind(config, error):
    """[(task, why)] of the tasks whose loss caused `error`; empty when none did."""
    if not isinstance(error, tf.errors.OpError):
        return []
    text = error.message or ""
    # A restarted server has forgotten this chief's context: "Unable to find a context_id".
    if not isinstance(error, _CONNECTION_ERRORS) and "context_id" not in text:
        return []
    lost = cluster_lib.lost_tasks(config, _PROBE_TIMEOUT)
    if lost:
        return lost
    named = [task for task in cluster_lib.tasks_named_in(config, text) if task[0] != "chief"]
    why = ("named in the error; it answers again, so it restarted or the network "
           "dropped the connection")
    if not named:
        # The error does not say which server it was: any of them may be.
        if "context_id" in text:
            why = "it answers, but it or another of these restarted and forgot this program"
        elif any(marker in text for marker in _BROKEN_CONNECTION):
            # A channel to a server that restarted breaks before the server can say so.
            why = ("it answers, but the connection to it or another of these broke: one "
                   "restarted, or the network dropped the connection")
        else:
            return []
        named = [task for task in config.tasks() if task[0] != "chief"]
    return [(task, why) for task in named]
