"""Runs the TF server of one worker or ps task; the chief drives it over gRPC.

    TF_CONFIG='{"cluster": {"chief": ["127.0.0.1:2220"], "worker": ["127.0.0.1:2221"],
                "ps": ["127.0.0.1:2222"]}, "task": {"type": "ps", "index": 0}}' \\
        python -m hybrid_strategy.server

TF_CONFIG says which task this process is. The server runs until SIGTERM or SIGINT, then exits
with code 0. Exit code 2 means TF_CONFIG is missing or invalid, or names a task that is not a
worker or ps; exit code 75 means the gRPC server could not start (e.g. its port is taken).
"""
import argparse
import os
import signal
import sys

from hybrid_strategy import cluster as cluster_lib

_PREFIX = "hybrid_strategy.server:"
_SERVED_JOBS = ("worker", "ps")
EXIT_CANNOT_SERVE = 75  # EX_TEMPFAIL: the launcher retries with other ports


class _Stop(BaseException):
    """Raised by the signal handler to end start-up early; BaseException so that no
    `except Exception` on the way swallows it."""


def main(argv=None) -> int:
    """Serves the task TF_CONFIG names until SIGTERM/SIGINT; returns the exit code."""
    argparse.ArgumentParser(
        prog="python -m hybrid_strategy.server",
        description=__doc__.split("\n", 1)[0] + " The task comes from TF_CONFIG.",
    ).parse_args(argv)
    config, problem = _task_config()
    if problem:
        print(f"{_PREFIX} {problem}", file=sys.stderr)
        return 2
    # Installed before the slow TensorFlow import so that an early SIGTERM also exits cleanly.
    stopped = _stop_on_signals()
    try:
        return _serve(config, stopped)
    except _Stop:
        return 0


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


def _stop_on_signals() -> int:
    """Makes SIGTERM/SIGINT raise _Stop; returns a pipe fd that turns readable once one came.

    The pipe is the reliable half: Python's C-level handler writes to it from whichever
    thread the signal hits, so a signal that lands while TensorFlow's C++ code runs (where
    the raised _Stop can be lost) still wakes the serving loop, with no lost-wakeup race.
    """
    stopped, wakeup = os.pipe()
    os.set_blocking(wakeup, False)
    signal.set_wakeup_fd(wakeup)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_stop)
    return stopped


def _serve(config: cluster_lib.ClusterConfig, stopped: int) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's start-up chatter out
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    job, index = config.task_type, config.task_index
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(config.as_cluster_spec_dict()),
            job_name=job, task_index=index, protocol="grpc", start=True,
        )
    except tf.errors.OpError as e:
        print(f"{_PREFIX} {config.device(job, index)} could not start: {e.message}; is "
              f"{config.address(job, index)} free and an address of this machine?",
              file=sys.stderr)
        return EXIT_CANNOT_SERVE
    print(f"{_PREFIX} {config.device(job, index)} serving on {config.address(job, index)}",
          file=sys.stderr, flush=True)
    # The server serves from its own threads while `server` keeps it referenced (deleting
    # it would ask TF to stop it). Server.join() would block in C++ where no Python signal
    # handler runs, so wait for the stop signal instead.
    os.read(stopped, 1)
    del server
    return 0


def _raise_stop(signum, frame):
    raise _Stop(signum)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A gRPC TF server cannot be stopped; skip interpreter teardown so that destructors
    # racing its threads can neither hang nor crash the exit.
    os._exit(code)
