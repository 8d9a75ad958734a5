"""Runs a test scenario in a Python process of its own and reads the JSON report it prints last.

Scenarios run as the chief of a local cluster (`on_cluster`) or alone, under Keras 3 or
tf_keras, and always import the package from this checkout. Each process is a fork of a
Python that has imported TensorFlow (`python`), and a chief is a fork of its launcher
(`--fork-chief`), so that no scenario pays for importing TensorFlow:

    report = json_report(on_cluster("tests/scenario.py", workers=2, ps=1), "scenario")
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from concurrent import futures

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The start of a chief program: a strategy that reports a task silent for 10 s, and a
# compiled model with a table, with its data `x`, `y`.
SMALL_CHIEF = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np
    import tensorflow as tf
    import hybrid_strategy
    keras = tf.keras
    strategy = hybrid_strategy.HybridStrategy(task_timeout=10)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(1000, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.randint(0, 1000, (256, 4)).astype("int32")
    y = np.zeros((256, 1), "float32")
""")

# A chief (arguments: VICTIM SIGNAL) that trains, sends SIGNAL (SIGKILL, SIGSTOP) to server
# number VICTIM of the launcher's cluster (workers first, then ps) at its 4th step, prints
# that server's [job, index, address] and time.monotonic() then, and trains on.
FAULTY_CHIEF = SMALL_CHIEF + textwrap.dedent("""
    victim, signum = int(sys.argv[1]), signal.Signals[sys.argv[2]]
    pid = int(os.environ["HYBRID_STRATEGY_SERVER_PIDS"].split(",")[victim])
    task = [t for t in strategy.cluster.tasks() if t[0] != "chief"][victim]

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                os.kill(pid, signum)
                print(json.dumps(list(task) + [time.monotonic()]), flush=True)

    model.fit(x, y, batch_size=32, epochs=10_000, verbose=0, callbacks=[Fault()])
    print("training went on without the task")
""")


def on_cluster(script, *args, workers=2, ps=1, devices_per_worker=1, launcher=()):
    """The arguments after `python` that run `script` as the chief of a local cluster
    (each worker with `devices_per_worker` CPU replicas), the launcher given the further
    options `launcher`."""
    return ["-m", "hybrid_strategy.launch", "--workers", str(workers), "--ps", str(ps),
            "--devices-per-worker", str(devices_per_worker), *launcher, "--fork-chief", "--",
            sys.executable, script, *args]


def environ(flavour="keras3"):
    """This process's environment for a scenario: the package from this checkout first on
    PYTHONPATH, `tf.keras` as Keras 3 or tf_keras, and no TF_CONFIG of its own."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_USE_LEGACY_KERAS="1" if flavour == "tf_keras" else "0",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    env.pop("TF_CONFIG", None)
    return env


def json_report(arguments, what, flavour="keras3", timeout=900, env=None, cwd=ROOT,
                fresh=False):
    """Runs `python *arguments` (see `python`; `fresh=True`: a new Python, for a run that
    must not find even a part of this package imported); fails the test with its stderr
    if it fails, else returns the last line it printed, parsed as JSON. `what` names the
    run in the failure."""
    env = environ(flavour) if env is None else env
    if fresh:
        run = subprocess.run([sys.executable, *arguments], env=env, cwd=cwd,
                             capture_output=True, text=True, timeout=timeout)
    else:
        run = python(arguments, env=env, cwd=cwd, timeout=timeout)
    if run.returncode != 0:
        pytest.fail(f"{what} exited {run.returncode}:\n{run.stderr[-6000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def python(arguments, env, cwd=ROOT, timeout=900):
    """subprocess.run([python, *arguments], capture_output=True, text=True, ...), in a fork
    of a Python that has imported TensorFlow with `env`'s import-time settings
    (tests/python_forks.py): a scenario's process starts without importing it again."""
    key = tuple(env.get(name) for name in _IMPORT_SETTINGS) + tuple(
        dict.fromkeys(env.get("PYTHONPATH", "").split(os.pathsep)))  # each folder once
    with _FORKERS_LOCK:
        if key not in _FORKERS:
            _FORKERS[key] = _Forker(env)
    return _FORKERS[key].run(list(arguments), env, cwd, timeout)


# What TensorFlow reads from the environment when it is imported; Python's path too.
_IMPORT_SETTINGS = ("TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL")
_FORKERS = {}
_FORKERS_LOCK = threading.Lock()
# (CPU seconds, command) of every run that ended, for the session's summary (conftest.py).
CPU_SECONDS = []


class _Forker:
    """tests/python_forks.py, started with `env`, and the runs it forks for this process."""

    def __init__(self, env):
        self._directory = new_directory("python_forks")
        self._stderr = os.path.join(self._directory, "stderr")
        with open(self._stderr, "wb") as stderr:
            self._process = subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "tests", "python_forks.py")], env=env,
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._runs = {}  # request id -> (future pid, future exit code)
        self._commands = {}  # request id -> its command's arguments, shortened
        threading.Thread(target=self._read_answers, daemon=True).start()

    def _read_answers(self):
        for line in self._process.stdout:
            answer = json.loads(line)
            pid, code = self._runs[answer["id"]]
            if "pid" in answer:
                pid.set_result(answer["pid"])
            else:
                code.set_result(answer["exit"])
                CPU_SECONDS.append((answer["cpu"], " ".join(self._commands[answer["id"]])))
        with open(self._stderr, errors="replace") as stderr:
            died = RuntimeError(f"tests/python_forks.py exited {self._process.wait()}:\n"
                                f"{stderr.read()[-3000:]}")
        for run in self._runs.values():
            for future in run:
                if not future.done():
                    future.set_exception(died)

    def run(self, arguments, env, cwd, timeout):
        request = next(self._ids)
        output = {name: os.path.join(self._directory, f"{request}.{name}")
                  for name in ("stdout", "stderr")}
        with self._lock:
            pid, code = self._runs[request] = (futures.Future(), futures.Future())
            self._commands[request] = [_short(argument) for argument in arguments
                                       if argument != sys.executable]
            self._process.stdin.write(json.dumps(dict(
                output, id=request, arguments=arguments, env=env, cwd=cwd)).encode() + b"\n")
            self._process.stdin.flush()
        try:
            returncode = code.result(timeout)
        except futures.TimeoutError:
            os.kill(pid.result(), signal.SIGKILL)
            code.result()
            raise subprocess.TimeoutExpired([sys.executable, *arguments], timeout) from None
        texts = {}
        for name, path in output.items():
            with open(path, encoding="utf-8", errors="replace") as f:
                texts[name] = f.read()
            os.remove(path)
        return subprocess.CompletedProcess([sys.executable, *arguments], returncode, **texts)

    def close(self):
        self._process.stdin.close()
        self._process.wait()


def _short(argument):
    """A command's argument as the session's summary shows it."""
    if "\n" in argument:
        return "CODE"
    return os.path.relpath(argument, ROOT) if argument.startswith(ROOT) else argument[:60]


# Chief programs run in the background, two at a time: a chief alone keeps about one of
# two cores busy (it traces while its servers wait), so the next one runs beside it.
_POOL = futures.ThreadPoolExecutor(2, thread_name_prefix="runs")
_DIRECTORIES = []  # the session's directory for the runs' files, once one needs it


def in_background(module):
    """Whether test module `module` runs chief programs in the background (a `Runs`)."""
    return any(isinstance(value, Runs) for value in vars(module or object).values())


def start_in_order(items):
    """Starts, in the order of `items`, every job of a module's `Runs` that one of them
    names: the whole session's chief programs queue at once, so that two run at every
    moment, the next module's while this module's last one ends."""
    by_module = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None:
            by_module.setdefault(module, []).append(item)
    for module, module_items in by_module.items():
        named = set()
        for item in module_items:
            callspec = getattr(item, "callspec", None)
            named.update(item.fixturenames,
                         map(str, callspec.params.values()) if callspec else ())
        for runs in vars(module).values():
            if isinstance(runs, Runs):
                runs.start(named)


def end_session():
    """Drops the programs not started yet (the session ends early: -x, an interrupt)
    and the runs' files."""
    _POOL.shutdown(wait=False, cancel_futures=True)
    for forker in _FORKERS.values():
        forker.close()
    for directory in _DIRECTORIES:
        shutil.rmtree(directory, ignore_errors=True)


def new_directory(name):
    """A new directory for one run's files, removed when the session ends."""
    if not _DIRECTORIES:
        _DIRECTORIES.append(tempfile.mkdtemp(prefix="hybrid_strategy_runs_"))
    return tempfile.mkdtemp(prefix=f"{name}_", dir=_DIRECTORIES[0])


class Job:
    """A function that runs one chief program (or a few, one after the other) and returns
    what the tests read, run once in the background."""

    def __init__(self, run):
        self._run = run
        self._future = None

    def start(self):
        if self._future is None:
            self._future = _POOL.submit(self._run)

    def result(self):
        """The run's result; a run no test named up front runs now, in this thread, not
        behind every program queued for the session."""
        if self._future is None:
            self._future = futures.Future()
            try:
                self._future.set_result(self._run())
            except BaseException as e:  # pylint: disable=broad-except
                self._future.set_exception(e)
        return self._future.result()


class Runs:
    """The chief programs of a test module, started before the tests need them.

    `jobs` maps a key to a function (or another module's `Job`); a test names a job by
    a parameter or a fixture of the same name. A module keeps its `Runs` in a global:
    when the session starts, `start_in_order` starts every job its selected tests name.

        RUNS = Runs({flavour: functools.partial(json_report, arguments, what, flavour)
                     for flavour in ("keras3", "tf_keras")})

        @pytest.fixture(scope="module", params=["keras3", "tf_keras"])
        def report(request):
            return RUNS.result(request.param)
    """

    def __init__(self, jobs):
        self._jobs = {key: job if isinstance(job, Job) else Job(job)
                      for key, job in jobs.items()}

    @classmethod
    def in_directories(cls, run, keys):
        """The runs of `run(key, directory)` for each of `keys`, each in a new directory."""
        return cls({key: lambda key=key: run(key, new_directory(key)) for key in keys})

    def job(self, key):
        return self._jobs[key]

    def start(self, named):
        """Starts, in order, the jobs whose keys are in `named`."""
        for name, job in self._jobs.items():
            if name in named:
                job.start()

    def result(self, key):
        """Job `key`'s result, once it is done."""
        return self._jobs[key].result()
