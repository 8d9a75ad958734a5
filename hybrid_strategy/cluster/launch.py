"""Starts a cluster of TF servers on this machine and runs one chief program against it.

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python train.py --epochs 3

Every worker and ps task runs hybrid_strategy.server in a fork of the launcher, which imports
TensorFlow once for them all (as `python -m hybrid_strategy.server`, each would import it
anew: 3 s of CPU apiece); the command after `--` runs as the chief, with TF_CONFIG naming
task chief/0 of that cluster and HYBRID_STRATEGY_SERVER_PIDS listing the server process ids;
with `--fork-chief`, a chief `python SCRIPT|-m MODULE|-c CODE ...` runs in a fork of the
launcher too.
`--devices-per-worker N` gives every worker N CPU devices (N replicas);
`--data-service-workers N` also starts a tf.data service dispatcher and N tf.data
service workers, and passes the dispatcher's address in HYBRID_STRATEGY_DATA_SERVICE. The
launcher exits with the chief's exit code (128 + signal number if a signal killed it) and
leaves no server behind, whether the chief succeeds, fails or is interrupted. With `--max-restarts N` it starts a fresh cluster and runs the chief again after
a retryable failure (exit code 75, a dead server, a chief killed by a signal), up to N times.
All of them run in a network namespace of their own whose only interface is loopback
(`--network host`: this machine's network), since TensorFlow's servers listen on every
interface. From Python, e.g. in a test fixture (on the host's network):

    import subprocess, sys
    from hybrid_strategy.cluster.launch import LocalCluster

    with LocalCluster(workers=2, ps=1) as local:
        subprocess.run([sys.executable, "train.py"], env=local.chief_environ(), check=True)
"""
import argparse
import atexit
import contextlib
import ctypes
import fcntl
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback

from hybrid_strategy.cluster import config as cluster_lib
from hybrid_strategy.cluster import data_service
from hybrid_strategy.cluster import forks
from hybrid_strategy.cluster import server as server_lib

SERVER_PIDS_ENV = "HYBRID_STRATEGY_SERVER_PIDS"
# How many times the launcher restarted the cluster and the chief before this run (0 first).
RESTART_COUNT_ENV = "HYBRID_STRATEGY_RESTART_COUNT"
_PREFIX = "hybrid_strategy.launch:"
_SERVER_GRACE = 5.0  # seconds a server gets to exit after SIGTERM before SIGKILL
_CHIEF_GRACE = 10.0  # seconds the chief gets after a forwarded signal before SIGKILL
# Another process can take a port between free_port() and the server's bind; try new ports.
_START_ATTEMPTS = 3
# The directory holding this package, so servers import the same code as the launcher.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# unshare(2) flags, and the ioctls and flag that bring a network interface up (netdevice(7)).
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: interface name, then ifr_flags in a 24-byte union
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ServerStartError(RuntimeError):
    """A server process of a LocalCluster exited while the cluster was starting."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class LocalCluster:
    """`workers` worker and `ps` ps servers on `host`, as child processes of this one.

        with LocalCluster(workers=2, ps=1) as local:
            env = local.chief_environ()   # TF_CONFIG for chief/0, plus the server pids
            subprocess.run([sys.executable, "train.py"], env=env, check=True)

    Entering starts the servers and waits until each answers as a gRPC server (at most
    `startup_timeout` seconds; a server that finds its port taken meanwhile makes it start
    again on fresh ports, up to 3 times); leaving stops them (SIGTERM, then SIGKILL after 5 s), also
    on error and at interpreter exit. `env` holds extra environment variables for the servers
    (merged over os.environ); `quiet=False` lets their output through and lists the servers
    on stderr once they serve. `devices_per_worker` CPU devices on each worker make as many
    replicas of it (`python -m hybrid_strategy.server --cpu-devices`);
    `data_service_workers` > 0 also starts a tf.data service dispatcher and that many
    tf.data service workers (hybrid_strategy.data_service), whose address `chief_environ`
    passes on. `fork_servers=True` starts each server as a fork of this process, which
    imports TensorFlow once for them all, instead of as `python -m hybrid_strategy.server`:
    the cluster serves sooner and takes less CPU to start, but their process listing
    shows this process's command line; it needs a process with one Python thread that has
    not started TensorFlow's runtime, and no `env`. On Linux the servers
    are killed if this process dies; the kernel ties them to the *thread* that starts them,
    so start the cluster from a thread that outlives it (e.g. the main thread).

    The servers run on this machine's network: TensorFlow listens on every interface
    whatever `host` says (the CLI launcher runs them in a private network namespace).
    Several chiefs may use one cluster in turn; 5 s after a chief is gone, its servers start
    afresh (see hybrid_strategy.server), and the next chief waits for them.
    """

    def __init__(self, workers=2, ps=1, *, devices_per_worker=1, data_service_workers=0,
                 host="127.0.0.1", startup_timeout=60.0, env=None, quiet=True,
                 fork_servers=False):
        _check_count("workers", workers, minimum=1)
        _check_count("ps", ps, minimum=0)
        _check_count("devices_per_worker", devices_per_worker, minimum=1)
        _check_count("data_service_workers", data_service_workers, minimum=0)
        if not isinstance(startup_timeout, (int, float)) or startup_timeout <= 0:
            raise ValueError(
                f"startup_timeout must be a positive number of seconds, got {startup_timeout!r}."
            )
        if fork_servers and env:
            raise ValueError(
                "fork_servers=True starts the servers with this process's modules already "
                "imported, so an `env` for them could not apply at their start; pass one or "
                "the other.")
        self.workers, self.ps, self.host = workers, ps, host
        self.devices_per_worker = devices_per_worker
        self.data_service_workers = data_service_workers
        self.data_service_dispatcher: str | None = None  # "host:port" once started
        self.startup_timeout = startup_timeout
        self.quiet = quiet
        self.fork_servers = fork_servers
        self._env = dict(env or {})
        self.config: cluster_lib.ClusterConfig | None = None
        self.processes: list[subprocess.Popen] = []
        self._servers: list[tuple[str, str]] = []  # (name, address) of each process
        self.startup_seconds: float | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the servers, in task order (workers, then ps, then the tf.data
        service's dispatcher and workers)."""
        return [process.pid for process in self.processes]

    @property
    def chief_tf_config(self) -> str:
        """TF_CONFIG (JSON) for the chief, task chief/0."""
        return self._started_config().to_tf_config("chief", 0)

    def chief_environ(self, base=None) -> dict[str, str]:
        """`base` (default os.environ) plus the chief's TF_CONFIG, the server pids and the
        tf.data service dispatcher's address, if there is one."""
        environ = _with_package_path(dict(os.environ if base is None else base))
        environ["TF_CONFIG"] = self.chief_tf_config
        environ[SERVER_PIDS_ENV] = ",".join(str(pid) for pid in self.pids)
        if self.data_service_dispatcher:
            environ[data_service.DATA_SERVICE_ENV] = f"grpc://{self.data_service_dispatcher}"
        return environ

    def start(self) -> "LocalCluster":
        """Starts the servers and waits until they serve; stops them all if that fails."""
        if self.processes:
            raise RuntimeError("this LocalCluster was already started; create a new one.")
        started = time.monotonic()
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._start_servers(started + self.startup_timeout - time.monotonic())
                break
            except ServerStartError as e:
                if e.exit_code != server_lib.EXIT_CANNOT_SERVE or attempt == _START_ATTEMPTS:
                    raise
        self.startup_seconds = time.monotonic() - started
        if not self.quiet:
            for (name, address), process in zip(self._servers, self.processes):
                print(f"{_PREFIX} {name} on {address}, pid {process.pid}", file=sys.stderr)
        return self

    def _start_servers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.config = _local_config(self.workers, self.ps, self.host)
        self.processes, self._servers = [], []
        if self.fork_servers:
            _prepare_to_fork_servers(self.quiet)
        atexit.register(self.close)
        try:
            for job, index, address in self.config.tasks():
                if job != "chief":
                    devices = (["--cpu-devices", str(self.devices_per_worker)]
                               if job == "worker" and self.devices_per_worker > 1 else [])
                    self._start_server(
                        self.config.device(job, index), address, server_lib.command(devices),
                        fork_args=devices if self.fork_servers else None,
                        TF_CONFIG=self.config.to_tf_config(job, index))
            self._start_data_service()
            cluster_lib.wait_for_tasks(
                self.config, max(timeout, 0.1), check=self._raise_if_server_exited
            )
            self._wait_for_data_service(deadline)
        except BaseException:
            self.close()
            raise

    def _start_data_service(self) -> None:
        """A tf.data service dispatcher and its workers, if asked for, on ports of their own."""
        if not self.data_service_workers:
            return
        taken = [int(address.rsplit(":", 1)[1]) for _, _, address in self.config.tasks()]
        ports = _distinct_free_ports(1 + self.data_service_workers, self.host, taken)
        self.data_service_dispatcher = f"{self.host}:{ports[0]}"
        self._start_server("tf.data service dispatcher", self.data_service_dispatcher,
                           data_service.server_argv("dispatcher", ports[0]))
        for index, port in enumerate(ports[1:]):
            self._start_server(
                f"tf.data service worker {index}", f"{self.host}:{port}",
                data_service.server_argv("worker", port, self.data_service_dispatcher))

    def _wait_for_data_service(self, deadline: float) -> None:
        """Waits until the tf.data service's servers answer as gRPC servers."""
        for name, address in self._servers:
            if not name.startswith("tf.data"):
                continue
            while (problem := cluster_lib.probe(address, 1.0)) is not None:
                self._raise_if_server_exited()
                if time.monotonic() > deadline:
                    raise cluster_lib.TaskUnreachableError(
                        f"{name} at {address} did not answer within {self.startup_timeout:g} "
                        f"s ({problem}); run with quiet=False (launcher: --verbose) to see "
                        "its output.")
                time.sleep(0.2)

    def close(self) -> None:
        """Stops every server still running and reaps it; safe to call more than once."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + _SERVER_GRACE
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        atexit.unregister(self.close)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _started_config(self) -> cluster_lib.ClusterConfig:
        if self.config is None:
            raise RuntimeError(
                "the LocalCluster is not started; use `with LocalCluster(...) as local:` "
                "or call start() first."
            )
        return self.config

    def _start_server(self, name: str, address: str, argv: list[str],
                      fork_args: list[str] | None = None, **extra_env) -> None:
        """Starts one server process running `argv` (`python ...`), or, given `fork_args`,
        a fork of this one running hybrid_strategy.server with them; with fork_servers=True,
        other servers (the tf.data service's) run `argv` in a fork too. `name` and `address`
        describe the server in messages."""
        self._servers.append((name, address))
        environ = self._server_environ(extra_env)
        if fork_args is not None:
            self.processes.append(_fork_server(fork_args, environ, self.quiet))
            return
        if self.fork_servers:
            def in_child():
                _detach(self.quiet)
                atexit.unregister(self.close)  # the launcher's to run, not the server's

            self.processes.append(forks.start_python(
                forks.python_arguments(argv), environ, deathsig=signal.SIGKILL,
                in_child=in_child))
            return
        output = subprocess.DEVNULL if self.quiet else None
        self.processes.append(subprocess.Popen(
            argv, env=environ,
            stdin=subprocess.DEVNULL, stdout=output, stderr=output,
            # Own session: a Ctrl-C meant for the chief does not hit the servers, which
            # the launcher stops itself, in order.
            start_new_session=True,
            preexec_fn=forks.die_with_parent(signal.SIGKILL),
        ))

    def _server_environ(self, extra: dict[str, str]) -> dict[str, str]:
        environ = dict(os.environ)
        environ.update(self._env)
        # The package's __init__ imports TensorFlow before server.py can set this itself.
        environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        environ.pop("TF_CONFIG", None)
        environ.update(extra)
        return _with_package_path(environ)

    def exited_servers(self) -> list[str]:
        """One description per server that has exited, e.g. "server /job:ps/task:0 (pid 7)
        was killed by SIGKILL"."""
        return [f"server {name} (pid {process.pid}) {_describe_exit(process.poll())}"
                for (name, _), process in zip(self._servers, self.processes)
                if process.poll() is not None]

    def _raise_if_server_exited(self) -> None:
        for (name, _), process in zip(self._servers, self.processes):
            code = process.poll()
            if code is not None:
                hint = ("run with quiet=False (launcher: --verbose) to see its output"
                        if self.quiet else "its output is above")
                raise ServerStartError(
                    f"server {name} (pid {process.pid}) "
                    f"{_describe_exit(code)} while the cluster was starting; {hint}.",
                    code,
                )


def _prepare_to_fork_servers(quiet: bool) -> None:
    """Imports TensorFlow here once, for every forked server; raises RuntimeError where
    forking this process could leave a server's copy of it locked or in a broken state."""
    if not hasattr(os, "fork"):
        raise RuntimeError("fork_servers=True needs os.fork, which this platform lacks; "
                           "start the servers with fork_servers=False.")
    if threading.active_count() > 1:
        raise RuntimeError(
            f"fork_servers=True, but this process runs {threading.active_count()} Python "
            "threads, whose locks a forked server could inherit held; start the cluster "
            "before other threads, or with fork_servers=False.")
    # A server imports TensorFlow when it starts serving; importing it (and only that:
    # no op runs here) before forking saves each server the 3 s of CPU it takes. Its
    # start-up chatter goes where a quiet server's would, whatever TF_CPP_MIN_LOG_LEVEL.
    with _stderr_to(os.devnull if quiet else None):
        import tensorflow  # pylint: disable=import-outside-toplevel,unused-import
        # TF-private: whether TensorFlow's runtime (its eager context) has started here.
        from hybrid_strategy.tensorflow_private import context  # pylint: disable=import-outside-toplevel

    if context.context_safe() is not None:
        raise RuntimeError(
            "fork_servers=True, but TensorFlow's runtime has started in this process (an op "
            "ran, or a device was listed) and its threads would not exist in a forked "
            "server; start the cluster before using TensorFlow, or with fork_servers=False.")


@contextlib.contextmanager
def _stderr_to(path: str | None):
    """Sends file descriptor 2 (C libraries' stderr too) to `path` while the block runs;
    None: leaves it."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved, target = os.dup(2), os.open(path, os.O_WRONLY)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _detach(quiet: bool) -> None:
    """In a forked server: what Popen(start_new_session=True, stdin=DEVNULL, close_fds=True)
    and, if `quiet`, stdout=stderr=DEVNULL do."""
    os.setsid()  # the terminal's Ctrl-C is for the chief
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2) if quiet else (0,):
        os.dup2(null, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # no pipe of ours held


def _fork_server(argv: list[str], environ: dict[str, str], quiet: bool) -> forks.Forked:
    """Runs `python -m hybrid_strategy.server *argv` with `environ` in a fork of this
    process, set up as LocalCluster sets up the server processes it starts."""
    die_with_parent = forks.die_with_parent(signal.SIGKILL)
    pid = forks.fork()
    if pid:
        return forks.Forked(pid, server_lib.command(argv))
    code = 1
    try:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        if die_with_parent:
            die_with_parent()
        _detach(quiet)
        os.environ.clear()
        os.environ.update(environ)
        code = server_lib.main(argv)
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
    finally:
        # Never back into the caller's code: no atexit handler, no finally of the parent's.
        server_lib.exit_at_once(code)


def _with_package_path(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with this package's folder first on PYTHONPATH: the chief and the servers
    import the same hybrid_strategy as the launcher, whichever copy is installed."""
    paths = [_PACKAGE_PARENT] + [p for p in [environ.get("PYTHONPATH")] if p]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    return environ


def _local_config(workers: int, ps: int, host: str) -> cluster_lib.ClusterConfig:
    ports = _distinct_free_ports(1 + workers + ps, host)
    addresses = [f"{host}:{port}" for port in ports]
    cluster = {"chief": addresses[:1], "worker": addresses[1:1 + workers]}
    if ps:
        cluster["ps"] = addresses[1 + workers:]
    return cluster_lib.ClusterConfig(cluster, "chief", 0)


def _distinct_free_ports(count: int, host: str, taken=()) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = cluster_lib.free_port(host)
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def _check_count(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == server_lib.EXIT_CANNOT_SERVE:
        return (f"could not start its gRPC server (exit code {code}: its port was taken, "
                f"{_START_ATTEMPTS} times with fresh ports, or the host is not this machine)")
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    """A child's return code as a shell reports it: 128 + signal number if a signal killed it."""
    return 128 - code if code < 0 else code


class _Signalled(BaseException):
    """SIGINT/SIGTERM to the launcher; BaseException so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum, frame):
    raise _Signalled(signum)


def isolate_network() -> str | None:
    """Moves this process, and so every process it starts, into a new network namespace
    whose only interface is loopback; returns why it could not, or None.

    TensorFlow's gRPC server listens on every interface of its machine ("0.0.0.0:port")
    whatever host TF_CONFIG names, and serves anyone who connects. In the new namespace
    the only interface is loopback: no other machine, and no process outside, reaches the
    cluster. Needs Linux and either root or unprivileged user namespaces; call it while
    this process has a single thread.
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    uid, gid = os.getuid(), os.getgid()
    libc = forks.libc()
    # Root may create the network namespace alone; others need their own user namespace
    # first, in which they keep their uid and gain the right to configure it.
    if uid != 0 or libc.unshare(_CLONE_NEWNET) != 0:
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            return f"unshare: {os.strerror(ctypes.get_errno())}"
        for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack(_IFREQ, b"lo", 0)
            flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    except OSError as e:
        # Already in the new namespace: without loopback nothing would work.
        raise RuntimeError(f"cannot bring up loopback in a new network namespace: {e}") from e
    return None


def main(argv=None) -> int:
    """Runs the launcher CLI; returns the exit code."""
    options, command = _parse(_parser(), sys.argv[1:] if argv is None else list(argv))
    if options.network == "private":
        problem = isolate_network()
        if problem:
            print(f"{_PREFIX} cannot keep the cluster off the network ({problem}): its "
                  "unauthenticated servers listen on every interface of this machine.",
                  file=sys.stderr, flush=True)
    # Handlers raise, so a signal at any point unwinds through the cleanup in _launch.
    previous = {signum: signal.signal(signum, _raise_signalled) for signum in _STOP_SIGNALS}
    try:
        return _launch(options, command)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _launch(options, command: list[str]) -> int:
    """Runs the cluster and the chief, again after a retryable failure while restarts last."""
    restart = 0
    try:
        while True:
            code, reason = _launch_once(options, command, restart)
            if reason is None:
                return code
            if restart == options.max_restarts:
                if options.max_restarts:
                    print(f"{_PREFIX} {reason}; no restart left (--max-restarts "
                          f"{options.max_restarts}).", file=sys.stderr, flush=True)
                return code
            restart += 1
            print(f"{_PREFIX} {reason}; restarting the cluster and the chief (restart "
                  f"{restart} of {options.max_restarts}).", file=sys.stderr, flush=True)
    except _Signalled as signalled:  # between two runs
        return 128 + signalled.signum


def _launch_once(options, command: list[str], restart: int):
    """(exit status, why to restart or None) of one run of the cluster and the chief."""
    try:
        with LocalCluster(options.workers, options.ps,
                          devices_per_worker=options.devices_per_worker,
                          data_service_workers=options.data_service_workers,
                          startup_timeout=options.startup_timeout,
                          quiet=not options.verbose, fork_servers=True) as local:
            _report_ready(local, command)
            try:
                environ = local.chief_environ()
                environ[RESTART_COUNT_ENV] = str(restart)
                code = _run_chief(command, environ, local if options.fork_chief else None)
                if code is None:
                    return 127, None
                return _exit_status(code), _restart_reason(code, local.exited_servers())
            finally:
                # Teardown is bounded (SIGTERM, then SIGKILL); another Ctrl-C must not cut it.
                for signum in _STOP_SIGNALS:
                    signal.signal(signum, signal.SIG_IGN)
    except _Signalled as signalled:
        return 128 + signalled.signum, None
    except (ServerStartError, cluster_lib.TaskUnreachableError) as e:
        print(f"{_PREFIX} the cluster did not start: {e}", file=sys.stderr)
        return 1, None
    finally:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, _raise_signalled)


def _restart_reason(code: int, exited_servers: list[str]) -> str | None:
    """Why a chief that ended with return code `code` is worth running again, or None.

    Retryable: exit code 75 (a task was lost, hybrid_strategy.EXIT_TASK_LOST), a server
    that died during the run, or a chief killed by a signal other than a stop request (the
    OOM killer's SIGKILL, a crash). A chief that fails by itself (exit code 1) would fail
    again.
    """
    if code == 0:
        return None
    # 75 means "a task was lost" from the chief, "cannot serve" from a server.
    lost_task = code == cluster_lib.EXIT_TASK_LOST
    chief = (f"the chief exited with code {code} (a task was lost)" if lost_task
             else f"the chief {_describe_exit(code)}")
    if exited_servers:
        return f"{', '.join(exited_servers)}; {chief}"
    if lost_task or (code < 0 and -code not in _STOP_SIGNALS):
        return chief
    return None


def _run_chief(command: list[str], environ: dict[str, str],
               forking: LocalCluster | None) -> int | None:
    """The chief's return code (negative: killed by that signal), None if it cannot start;
    given the cluster `forking`, the chief runs in a fork of this process."""
    if forking is not None:
        # The servers are the launcher's to stop, not the chief's at its exit.
        chief = forks.start_python(forks.python_arguments(command), environ,
                                   deathsig=signal.SIGTERM,
                                   in_child=lambda: atexit.unregister(forking.close))
    else:
        try:
            # Same process group as the launcher, so a Ctrl-C in the terminal reaches it
            # directly.
            chief = subprocess.Popen(command, env=environ,
                                     preexec_fn=forks.die_with_parent(signal.SIGTERM))
        except OSError as e:
            print(f"{_PREFIX} cannot run {shlex.join(command)}: {e}", file=sys.stderr)
            return None
    try:
        return chief.wait()
    except _Signalled as signalled:
        _stop_chief(chief, signalled.signum)
        raise


def _stop_chief(chief: subprocess.Popen | forks.Forked, signum: int) -> None:
    """Forwards `signum` unless the chief got it too, then kills the chief after 10 s or
    on a second signal."""
    if not _sent_by_terminal(signum):
        chief.send_signal(signum)
    try:
        chief.wait(_CHIEF_GRACE)
    except (subprocess.TimeoutExpired, _Signalled):
        chief.kill()
        chief.wait()


def _sent_by_terminal(signum: int) -> bool:
    """Whether `signum` is likely a Ctrl-C typed in the terminal, which the kernel sends to
    the whole foreground process group, chief included.

    A second SIGINT would cut the chief's own clean-up short. The test: SIGINT while our
    process group is the terminal's foreground group. A `kill -INT` aimed at a launcher in
    the foreground is mistaken for Ctrl-C; the chief is then killed after the grace period.
    """
    if signum != signal.SIGINT:
        return False
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal: nothing typed can have reached the chief
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def _report_ready(local: LocalCluster, command: list[str]) -> None:
    servers = f"{local.workers} worker{'s' if local.workers != 1 else ''}"
    if local.devices_per_worker > 1:
        servers += f" x {local.devices_per_worker} devices"
    servers += f" + {local.ps} ps"
    if local.data_service_workers:
        servers += (f" + a tf.data service dispatcher and {local.data_service_workers} "
                    f"tf.data service worker{'s' if local.data_service_workers != 1 else ''}")
    print(f"{_PREFIX} {servers} on {local.host} ready in "
          f"{local.startup_seconds:.1f} s; running: {shlex.join(command)}",
          file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_strategy.launch",
        description="Start worker and ps servers on this machine, run COMMAND as the chief "
                    "with TF_CONFIG set, then stop the servers. Exits with COMMAND's exit code.",
        usage="%(prog)s [--workers N] [--ps N] [--devices-per-worker N] "
              "[--data-service-workers N] [--startup-timeout S] [--max-restarts N] "
              "[--network private|host] [--fork-chief] [--verbose] -- COMMAND ...",
        epilog="example: %(prog)s --workers 2 --ps 1 -- python train.py --epochs 3",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    parser.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default 1)")
    parser.add_argument("--devices-per-worker", type=int, default=1, metavar="N",
                        help="CPU devices per worker, each a replica of the training step, as "
                             "the GPUs of a GPU machine (default 1)")
    parser.add_argument("--data-service-workers", type=int, default=0, metavar="N",
                        help="also start a tf.data service dispatcher and N tf.data service "
                             "workers; the chief finds the dispatcher in "
                             f"{data_service.DATA_SERVICE_ENV} (default 0: none)")
    parser.add_argument("--startup-timeout", type=float, default=60.0, metavar="S",
                        help="seconds to wait for every server to answer (default 60)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="after a retryable failure (the chief exits with code 75, a "
                             "task dies or is killed), start the cluster and the chief again, "
                             "up to N times (default 0)")
    parser.add_argument("--network", choices=("private", "host"), default="private",
                        help="private (default): run the cluster and the chief in a network "
                             "namespace of their own, where loopback is the only interface, "
                             "since TensorFlow's servers listen on every interface; host: "
                             "on this machine's network, for a chief that needs it (downloads)")
    parser.add_argument("--fork-chief", action="store_true",
                        help="run the chief, `python SCRIPT|-m MODULE|-c CODE ...` with "
                             "the launcher's Python, in a fork of the launcher, which "
                             "has imported TensorFlow already: it starts 4-5 s of CPU "
                             "sooner, but settings TensorFlow reads at import "
                             "(TF_USE_LEGACY_KERAS, TF_CPP_MIN_LOG_LEVEL) come from the "
                             "launcher's environment, not from the script")
    parser.add_argument("--verbose", action="store_true",
                        help="let the servers' output through and list their pids")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]):
    split = argv.index("--") if "--" in argv else len(argv)
    options = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("give the chief's command after '--', e.g. -- python train.py")
    if options.workers < 1:
        parser.error(f"--workers must be at least 1, got {options.workers}")
    if options.ps < 0:
        parser.error(f"--ps must be 0 or more, got {options.ps}")
    if options.devices_per_worker < 1:
        parser.error(f"--devices-per-worker must be at least 1, got "
                     f"{options.devices_per_worker}")
    if options.data_service_workers < 0:
        parser.error(f"--data-service-workers must be 0 or more, got "
                     f"{options.data_service_workers}")
    if options.max_restarts < 0:
        parser.error(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    if options.startup_timeout <= 0:
        parser.error(f"--startup-timeout must be a positive number of seconds, "
                     f"got {options.startup_timeout:g}")
    if options.fork_chief:
        try:
            forks.python_arguments(command)
        except ValueError as e:
            parser.error(f"--fork-chief runs a chief `python SCRIPT ...`, `python -m "
                         f"MODULE ...` or `python -c CODE ...` in a fork of the launcher, "
                         f"but {e}; run it without --fork-chief.")
    return options, command

