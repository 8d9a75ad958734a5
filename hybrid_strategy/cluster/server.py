"""Runs the TF server of one worker or ps task; the chief drives it over gRPC.

    TF_CONFIG='{"cluster": {"chief": ["127.0.0.1:2220"], "worker": ["127.0.0.1:2221"],
                "ps": ["127.0.0.1:2222"]}, "task": {"type": "ps", "index": 0}}' \\
        python -m hybrid_strategy.server

TF_CONFIG says which task this process is. `--cpu-devices N` makes a worker's server expose N
CPU devices, each a replica of the chief's training step (as the GPUs of a GPU machine are),
so that the multi-replica path of GPU machines runs on CPUs. The server runs until SIGTERM or
SIGINT, then exits
with code 0. Exit code 2 means TF_CONFIG is missing or invalid, or names a task that is not a
worker or ps; exit code 75 means the gRPC server could not start (e.g. its port is taken).

Once the chief has connected, the server probes it; when the chief stops answering for
`--chief-timeout` seconds (default 5), the server starts afresh in the same process (same
pid, same port): TensorFlow would keep a dead chief's variables for ten minutes, so a
restarted chief would find the ps tasks holding every table twice.

`--thread-spinning` says whether TensorFlow's idle threads spin while they wait for work
(TensorFlow's default: less latency, idle cores busy) or sleep at once. By default they
sleep when another task of the cluster has this task's host (a local cluster): the tasks
then share its cores, and a synchronous step's waits would burn the CPU the others need.
They also sleep under a CPU quota (a Kubernetes CPU limit, `docker --cpus`) below the
host's cores, which spinning would spend; and the thread pools are then sized for the
quota, not for the host's cores (cluster/cpu_quota.py), unless TF_NUM_INTRAOP_THREADS or
TF_NUM_INTEROP_THREADS say otherwise.
"""
import argparse
import os
import select
import signal
import sys
import time

from hybrid_strategy.cluster import config as cluster_lib
from hybrid_strategy.cluster import cpu_quota

_PREFIX = "hybrid_strategy.server:"
_SERVED_JOBS = ("worker", "ps")
EXIT_CANNOT_SERVE = 75  # EX_TEMPFAIL: the launcher retries with other ports
_CHIEF_PROBE_INTERVAL = 0.5  # seconds between two probes of the chief
_THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


class Stop(BaseException):
    """Raised by the signal handler to end start-up early; BaseException so that no
    `except Exception` on the way swallows it."""


def command(argv: list[str]) -> list[str]:
    """The command line that runs this server with arguments `argv`."""
    return [sys.executable, "-m", "hybrid_strategy.server", *argv]


def main(argv=None) -> int:
    """Serves the task TF_CONFIG names until SIGTERM/SIGINT; returns the exit code.

    `argv` (default: sys.argv[1:]) are the server's arguments. To start afresh, a server
    run from the command line runs that command line again; one given `argv` here (a
    fork of the launcher) runs `command(argv)`.
    """
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_strategy.server",
        description=__doc__.split("\n", 1)[0] + " The task comes from TF_CONFIG.",
    )
    parser.add_argument(
        "--chief-timeout", type=float, default=cluster_lib.CHIEF_TIMEOUT, metavar="S",
        help="start afresh, dropping every variable, once the chief that connected has not "
             f"answered for S seconds (default {cluster_lib.CHIEF_TIMEOUT:g}; 0: never)")
    parser.add_argument(
        "--cpu-devices", type=int, default=1, metavar="N",
        help="CPU devices this worker exposes, each a replica of the training step "
             "(default 1; a worker with GPUs replicates over its GPUs instead)")
    parser.add_argument(
        "--thread-spinning", choices=("auto", "on", "off"), default="auto",
        help="whether TensorFlow's idle threads spin waiting for work (default auto: off "
             "when another task of TF_CONFIG's cluster has this task's host)")
    options = parser.parse_args(argv)
    restart = sys.orig_argv if argv is None else command(argv)
    if options.chief_timeout < 0:
        parser.error(f"--chief-timeout must be 0 or more, got {options.chief_timeout:g}")
    if options.cpu_devices < 1:
        parser.error(f"--cpu-devices must be at least 1, got {options.cpu_devices}")
    config, problem = _task_config()
    if problem:
        print(f"{_PREFIX} {problem}", file=sys.stderr)
        return 2
    if options.cpu_devices > 1 and config.task_type != "worker":
        print(f"{_PREFIX} --cpu-devices {options.cpu_devices} is for worker tasks (each CPU "
              f"device a replica), but TF_CONFIG names task \"{config.task_type}\" "
              f"{config.task_index}; start it without --cpu-devices.", file=sys.stderr)
        return 2
    # Installed before the slow TensorFlow import so that an early SIGTERM also exits cleanly.
    stopped = stop_on_signals()
    try:
        quota = quota_below_cores()
        return _serve(config, stopped, options.chief_timeout, options.cpu_devices,
                      thread_spinning(options.thread_spinning, config, quota), quota, restart)
    except Stop:
        return 0


def thread_spinning(choice: str, config: cluster_lib.ClusterConfig,
                    quota: float | None = None) -> bool:
    """Whether this task's idle TensorFlow threads spin: `choice` ("on", "off", or "auto":
    not when another task of `config` has this task's host, nor under a CPU `quota`)."""
    if choice == "auto":
        return quota is None and not config.shares_host(config.task_type, config.task_index)
    return choice == "on"


def quota_below_cores() -> float | None:
    """This process's CPU quota in cores where it is less than the cores it may run on,
    else None."""
    quota = cpu_quota.cpu_quota()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return quota if quota is not None and quota < (cores or 1) else None


def _pools_for(quota: float | None) -> tuple[int, int] | None:
    """(intra-op, inter-op) threads for `quota`, or None: no quota, or the environment
    sizes the pools itself (TensorFlow reads it where the session config leaves 0)."""
    if quota is None or any(os.environ.get(name) for name in _THREAD_VARIABLES):
        return None
    return cpu_quota.pool_sizes(quota)


def _task_config():
    """(config, None) for a valid worker/ps TF_CONFIG, else (None, message saying what to fix)."""
    try:
        config = cluster_lib.from_environment()
    except cluster_lib.ClusterConfigError as e:
        return None, str(e)
    if config is None:
        return None, (
            "TF_CONFIG is not set; set it to the cluster and this process's task, e.g. "
            '{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}.'
        )
    if config.task_type not in _SERVED_JOBS:
        return None, (
            f'TF_CONFIG names task "{config.task_type}" {config.task_index}, but only worker and '
            "ps tasks run this server; the chief runs the training program itself."
        )
    return config, None


def stop_on_signals() -> int:
    """Makes SIGTERM/SIGINT raise Stop; returns a pipe fd that turns readable once one came.

    The pipe is the reliable half: Python's C-level handler writes to it from whichever
    thread the signal hits, so a signal that lands while TensorFlow's C++ code runs (where
    the raised Stop can be lost) still wakes the serving loop, with no lost-wakeup race.
    """
    stopped, wakeup = os.pipe()
    os.set_blocking(wakeup, False)
    signal.set_wakeup_fd(wakeup)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_stop)
    return stopped


def _serve(config: cluster_lib.ClusterConfig, stopped: int, chief_timeout: float,
           cpu_devices: int, spinning: bool, quota: float | None, restart: list[str]) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's start-up chatter out
    pools = _pools_for(quota)
    if pools:
        # Through the environment, not only the session config: the functions the chief
        # runs here execute in the eager context it creates, whose pools take the chief's
        # config (0: TensorFlow's default) and then these variables.
        os.environ.update(dict(zip(_THREAD_VARIABLES, map(str, pools))))
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    job, index = config.task_type, config.task_index
    session_config = tf.compat.v1.ConfigProto(device_count={"CPU": cpu_devices})
    session_config.experimental.disable_thread_spinning = not spinning
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(config.as_cluster_spec_dict()),
            job_name=job, task_index=index, protocol="grpc", start=True,
            config=session_config,
        )
    except tf.errors.OpError as e:
        print(f"{_PREFIX} {config.device(job, index)} could not start: {e.message}; is "
              f"{config.address(job, index)} free and an address of this machine?",
              file=sys.stderr)
        return EXIT_CANNOT_SERVE
    devices = f" with {cpu_devices} CPU devices" if cpu_devices > 1 else ""
    idle = "" if spinning else "; idle threads sleep (--thread-spinning)"
    if pools:
        idle += (f"; for a CPU quota of {quota:.2g} core: {pools[0]} intra-op and "
                 f"{pools[1]} inter-op threads")
    print(f"{_PREFIX} {config.device(job, index)} serving on {config.address(job, index)}"
          f"{devices}{idle}", file=sys.stderr, flush=True)
    # The server serves from its own threads while `server` keeps it referenced (deleting
    # it would ask TF to stop it). Server.join() would block in C++ where no Python signal
    # handler runs, so wait for the stop signal instead.
    chief = config.cluster.get("chief", (None,))[0] if chief_timeout else None
    lost = _wait_for_stop_or_chief_loss(stopped, chief, chief_timeout)
    if lost:
        print(f"{_PREFIX} {config.device(job, index)}: the chief at {chief} has not answered "
              f"for {chief_timeout:g} s ({lost}); starting afresh to drop its variables.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        # TensorFlow offers no way to drop a client's state; a new process image does, and
        # keeps the pid the launcher or the container runtime watches. gRPC's sockets are
        # close-on-exec, so the port is free again for the new server.
        os.execv(sys.executable, restart)
    del server
    return 0


def _wait_for_stop_or_chief_loss(stopped: int, chief: str | None, timeout: float) -> str | None:
    """Waits for the stop signal (returns None) or, once `chief` has answered a probe, for
    it to stop answering for `timeout` seconds (returns why its last probe failed)."""
    last_answer = None  # armed when the chief first answers: it starts after the servers
    while not select.select([stopped], [], [], _CHIEF_PROBE_INTERVAL if chief else None)[0]:
        problem = cluster_lib.probe(chief, _CHIEF_PROBE_INTERVAL)
        now = time.monotonic()
        if problem is None:
            last_answer = now
        elif last_answer is not None and now - last_answer >= timeout:
            return problem
    return None


def _raise_stop(signum, frame):
    raise Stop(signum)


def exit_at_once(code: int) -> None:
    """Exits with `code` after flushing output, skipping interpreter teardown.

    A gRPC TF server cannot be stopped; destructors racing its threads at teardown could
    hang or crash the exit.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

