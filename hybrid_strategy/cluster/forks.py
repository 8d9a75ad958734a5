"""Runs Python programs in forks of this process, so that they need not import TensorFlow.

A fresh `python train.py` spends 4-5 s of CPU importing TensorFlow before its first line.
A fork of a process that has imported it (and has neither started TensorFlow's runtime
nor any other thread) starts at once. The launcher runs its servers so, and, with
`--fork-chief`, its chief:

    import os, sys
    import tensorflow
    from hybrid_strategy.cluster import forks

    arguments = forks.python_arguments([sys.executable, "train.py", "--epochs", "3"])
    chief = forks.start_python(arguments, dict(os.environ))  # as subprocess.Popen would
    code = chief.wait()

Settings TensorFlow reads when it is imported (TF_USE_LEGACY_KERAS, TF_CPP_MIN_LOG_LEVEL)
come from the forking process's environment, not from the program's.
"""

import atexit
import ctypes
import gc
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
import warnings

_PR_SET_PDEATHSIG = 1


def libc():
    """This process's C library, through ctypes."""
    return ctypes.CDLL(None, use_errno=True)


def _load_prctl():
    """libc's prctl, resolved up front: the child after fork must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = libc().prctl
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(deathsig: int):
    """A function for the child (a preexec_fn) asking the kernel to send it `deathsig` when
    this process dies (None where there is no prctl)."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec():
        _PRCTL(_PR_SET_PDEATHSIG, deathsig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class Forked:
    """A process forked from this one, with the part of subprocess.Popen's interface that
    the launcher uses: `pid`, `args`, `returncode`, `poll`, `wait`, `send_signal`,
    `terminate`, `kill`."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork() -> int:
    """os.fork, after checking that this process runs one Python thread (another's locks
    could be held for good in the child) and flushing its output (else both would write
    it)."""
    if threading.active_count() > 1:
        raise RuntimeError(
            f"cannot fork: this process runs {threading.active_count()} Python threads, whose "
            "locks a fork could inherit held; fork before starting other threads.")
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # Python 3.12+ warns of any other thread; the one TensorFlow's import leaves is
        # OpenBLAS's, whose own fork handler stops its pool around the fork.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def python_arguments(command: list[str]) -> list[str]:
    """The arguments after `python` of `command`, which must run this process's Python on a
    script (`python train.py ...`), a module (`python -m package.train ...`) or code
    (`python -c CODE ...`); else a ValueError that says why not."""
    python = shutil.which(command[0]) if command else None
    if python is None or os.path.abspath(python) != os.path.abspath(sys.executable):
        raise ValueError(f"the command runs {command[0] if command else 'nothing'!r}, not "
                         f"this Python ({sys.executable})")
    arguments = command[1:]
    if arguments[:1] in (["-m"], ["-c"]):
        if len(arguments) < 2:
            raise ValueError(f"the command gives `python {arguments[0]}` nothing to run")
    elif not arguments or arguments[0].startswith("-"):
        raise ValueError("the command gives Python no script, or options of its own")
    elif not os.path.isfile(arguments[0]):
        raise ValueError(f"there is no script {arguments[0]!r}")
    return arguments


def start_python(arguments: list[str], environ: dict[str, str], *, deathsig=None,
                 in_child=None) -> Forked:
    """Runs `python *arguments` (see `python_arguments`) with `environ` in a fork of this
    process, which gets `deathsig` when this process dies; `in_child()`, if given, runs in
    the fork first (to drop what is this process's alone, e.g. its atexit handlers)."""
    preexec = die_with_parent(deathsig) if deathsig else None
    pid = fork()
    if pid:
        return Forked(pid, [sys.executable, *arguments])
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if preexec:
            preexec()
        if in_child:
            in_child()
    except BaseException:  # pylint: disable=broad-except
        # Not through the exit handlers: they are still this process's (a LocalCluster's
        # would stop its servers).
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    run_python(arguments, environ)


def run_python(arguments: list[str], environ: dict[str, str]) -> None:
    """Runs `python *arguments` (see `python_arguments`) with `environ` in this process,
    which it then ends as the interpreter ends a program: it never returns."""
    # What this process held before the program (TensorFlow's modules: 300,000 objects)
    # stays for good: the program's full collections (0.2 s each) need not walk it again.
    gc.freeze()
    code, interrupted = 1, False
    try:
        os.environ.clear()
        os.environ.update(environ)
        if "numpy" in sys.modules:  # a fresh process seeds it anew; `random` reseeds itself
            sys.modules["numpy"].random.seed()
        option, main, rest = ((arguments[0], arguments[1], arguments[2:])
                              if arguments[0] in ("-m", "-c")
                              else (None, arguments[0], arguments[1:]))
        # As Python sets them; run_module then puts the module's file in sys.argv[0].
        sys.argv = ["-c" if option == "-c" else main, *rest]
        sys.path[0] = {"-m": os.getcwd(), "-c": ""}.get(
            option, os.path.dirname(os.path.abspath(main)))
        sys.path[1:1] = [path for path in environ.get("PYTHONPATH", "").split(os.pathsep)
                         if path and path not in sys.path]
        if option == "-m":
            runpy.run_module(main, run_name="__main__", alter_sys=True)
        elif option == "-c":
            module = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(main, "<string>", "exec"), vars(module))  # pylint: disable=exec-used
        else:
            runpy.run_path(main, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _system_exit_code(e)
    except BaseException as e:  # pylint: disable=broad-except
        # As the interpreter does: the program's hook reports it (HybridStrategy's exits
        # with code 75 after a lost task).
        sys.excepthook(type(e), e, e.__traceback__)
        interrupted = isinstance(e, KeyboardInterrupt)
    _end_as_python(code, interrupted)


def _system_exit_code(stop: SystemExit) -> int:
    """The exit code Python gives `raise SystemExit(stop.code)` at the top level."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def _end_as_python(code: int, interrupted: bool) -> None:
    """Ends this process as the interpreter ends a program, never returning into the code
    that forked it: waits for the program's non-daemon threads, runs its exit handlers,
    exits with `code`, or, after an uncaught KeyboardInterrupt, by SIGINT."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    # CPython-private, with no public equivalent: the handlers interpreter exit runs.
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
