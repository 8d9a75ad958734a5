"""Cluster description for HybridStrategy: parse and check TF_CONFIG, probe the tasks.

Pure Python on purpose (no TensorFlow import), so the launcher and the servers can check a
cluster before paying for TensorFlow's start-up, and so these checks are testable alone.

    >>> config = parse_tf_config(
    ...     '{"cluster": {"chief": ["127.0.0.1:2220"], "worker": ["127.0.0.1:2221"],'
    ...     ' "ps": ["127.0.0.1:2222"]}, "task": {"type": "chief", "index": 0}}')
    >>> config.num_workers, config.num_ps, config.device("ps", 0)
    (1, 1, '/job:ps/task:0')
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import threading
import time
from typing import Iterator, Mapping

# Canonical job order; also the only job names TF_CONFIG may use.
JOBS = ("chief", "worker", "ps", "evaluator")
_ALLOWED_JOBS = ", ".join(f'"{job}"' for job in JOBS)
_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"], "ps": ["host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)
_PROBE_INTERVAL = 0.2  # seconds between two connection attempts to one task
# HTTP/2 (RFC 9113): the client's connection preface, then an empty SETTINGS frame (9-byte
# header: length 0, type 4, no flags, stream 0); a server's first frame is its SETTINGS.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_FRAME_HEADER = 9
_SETTINGS_FRAME = 4
# Exit code of a chief that lost a task during training (sysexits' EX_TEMPFAIL): "restart me".
EXIT_TASK_LOST = 75
# Seconds a worker or ps server waits for a chief that stopped answering before it starts
# afresh, dropping that chief's variables (python -m hybrid_strategy.server --chief-timeout).
CHIEF_TIMEOUT = 5.0
# A task as TensorFlow names it in errors: /job:ps/replica:0/task:0 or /job:ps/task:0.
_DEVICE_PATTERN = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")


class ClusterConfigError(ValueError):
    """The cluster description (TF_CONFIG or a cluster resolver) is invalid."""


class TaskUnreachableError(RuntimeError):
    """Some tasks of the cluster did not answer as gRPC servers in time."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A checked cluster: job name -> task addresses, plus this process's own task.

    `task_type` and `task_index` are both None when the process has no task of its own.
    Construction validates everything and raises ClusterConfigError naming the problem.
    """

    cluster: dict[str, tuple[str, ...]]
    task_type: str | None = None
    task_index: int | None = None

    def __post_init__(self):
        # Normalise to a fresh dict of tuples in canonical job order, so callers cannot
        # mutate the checked addresses through a list they still hold.
        object.__setattr__(self, "cluster", _checked_cluster(self.cluster))
        _check_task(self.cluster, self.task_type, self.task_index)

    @property
    def num_workers(self) -> int:
        return len(self.cluster.get("worker", ()))

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get("ps", ()))

    def address(self, task_type: str, index: int) -> str:
        """The "host:port" of one task."""
        self._check_has_task(task_type, index)
        return self.cluster[task_type][index]

    def tasks(self) -> Iterator[tuple[str, int, str]]:
        """Yields (job, index, address) for every task, chief first, then workers, ps, evaluator."""
        for job, addresses in self.cluster.items():
            for index, address in enumerate(addresses):
                yield job, index, address

    def device(self, job: str, index: int) -> str:
        """The TF device prefix of one task, e.g. "/job:worker/task:1"."""
        self._check_has_task(job, index)
        return _device(job, index)

    def shares_host(self, task_type: str, task_index: int) -> bool:
        """Whether another task's address names this task's host (they share its cores)."""
        host = split_address(self.address(task_type, task_index))[0]
        return any(split_address(address)[0] == host for job, index, address in self.tasks()
                   if (job, index) != (task_type, task_index))

    def to_tf_config(self, task_type: str, task_index: int) -> str:
        """TF_CONFIG (JSON text) for the process that runs task `task_type`/`task_index`."""
        self._check_has_task(task_type, task_index)
        task = {"type": task_type, "index": task_index}
        return json.dumps({"cluster": self.as_cluster_spec_dict(), "task": task})

    def as_cluster_spec_dict(self) -> dict[str, list[str]]:
        """Job name -> list of addresses, as `tf.train.ClusterSpec` accepts it."""
        return {job: list(addresses) for job, addresses in self.cluster.items()}

    def _check_has_task(self, job: str, index: int) -> None:
        if job not in self.cluster:
            raise ClusterConfigError(
                f'the cluster has no job "{job}"; its jobs are {_job_list(self.cluster)}.'
            )
        if not _is_int(index) or not 0 <= index < len(self.cluster[job]):
            raise ClusterConfigError(
                f'job "{job}" has no task {index!r}; use an index from 0 to '
                f"{len(self.cluster[job]) - 1}."
            )


def parse_tf_config(text: str) -> ClusterConfig:
    """Parses and checks TF_CONFIG text; raises ClusterConfigError saying what to fix."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({e}); set it to an object like {_TF_CONFIG_EXAMPLE}."
        ) from None
    if not isinstance(data, dict):
        raise ClusterConfigError(
            f'TF_CONFIG must be a JSON object with "cluster" and "task", got {_kind(data)}; '
            f"set it like {_TF_CONFIG_EXAMPLE}."
        )
    if "cluster" not in data:
        raise ClusterConfigError(
            f'TF_CONFIG has no "cluster"; add one mapping each job to its "host:port" '
            f"addresses, like {_TF_CONFIG_EXAMPLE}."
        )
    if "task" not in data:
        raise ClusterConfigError(
            'TF_CONFIG has no "task"; add "task": {"type": JOB, "index": N} naming the task '
            "this process runs, e.g. {\"type\": \"worker\", \"index\": 0}."
        )
    task = data["task"]
    if not isinstance(task, dict):
        raise ClusterConfigError(
            f'TF_CONFIG "task" must be an object like {{"type": "worker", "index": 0}}, '
            f"got {_kind(task)}."
        )
    for key in ("type", "index"):
        if key not in task:
            raise ClusterConfigError(
                f'TF_CONFIG "task" has no "{key}"; write it like {{"type": "worker", "index": 0}}.'
            )
    return _build(data["cluster"], task["type"], task["index"], "TF_CONFIG")


def from_environment(environ: Mapping[str, str] = os.environ) -> ClusterConfig | None:
    """The cluster TF_CONFIG describes, or None when TF_CONFIG is unset or empty."""
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    return parse_tf_config(text)


def from_cluster_resolver(resolver) -> ClusterConfig:
    """Converts a `tf.distribute.cluster_resolver.ClusterResolver` and checks it.

    Accepts any object with `cluster_spec().as_dict()`, `task_type` and `task_id`.
    """
    jobs = resolver.cluster_spec().as_dict()
    if not isinstance(jobs, Mapping):
        raise ClusterConfigError(
            f"cluster resolver: cluster_spec().as_dict() returned {_kind(jobs)}, "
            "not a dict of jobs."
        )
    cluster = {job: _dense_addresses(job, tasks) for job, tasks in jobs.items()}
    if resolver.task_type is None or resolver.task_id is None:
        raise ClusterConfigError(
            "cluster resolver has no task (task_type or task_id is None); give it the task "
            'this process runs, e.g. task_type="chief", task_id=0.'
        )
    return _build(cluster, resolver.task_type, resolver.task_id, "cluster resolver")


def wait_for_tasks(
    config: ClusterConfig, timeout: float, skip=(("chief", 0),), *, check=None
) -> None:
    """Waits until every task except those in `skip` answers as a gRPC server (see `probe`).

    Probes all tasks in parallel, retrying every 0.2 s, and raises TaskUnreachableError
    naming every task still unreachable once `timeout` seconds have passed, with why (refused,
    or accepted and then silent). `check`, if given, is called every 0.2 s while waiting;
    whatever it raises ends the wait early (the launcher uses it to notice a server that died).
    """
    check_timeout(timeout)
    skipped = {(job, index) for job, index in skip}
    targets = [(job, i, addr) for job, i, addr in config.tasks() if (job, i) not in skipped]
    deadline = time.monotonic() + timeout
    reached: set = set()
    errors: dict[tuple[str, int, str], str] = {}
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=_probe_until, args=(t, deadline, stop, reached, errors), daemon=True
        )
        for t in targets
    ]
    for thread in threads:
        thread.start()
    try:
        _join_all(threads, deadline, check)
    finally:
        stop.set()
    unreachable = [t for t in targets if t not in reached]
    if unreachable:
        raise TaskUnreachableError(_unreachable_message(unreachable, errors, timeout))


def probe(address: str, timeout: float) -> str | None:
    """Why the task at `address` does not answer as a gRPC server, or None when it does.

    Sends the HTTP/2 client preface and waits up to `timeout` seconds for the server's first
    frame, which gRPC servers (TensorFlow's too) send at once, in well under a millisecond on
    loopback. A TCP connection alone proves nothing: the kernel completes it for a stopped or
    hung process, and for any program that happens to listen on the port.
    """
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        return f"no connection within {timeout:g} s"
    except OSError as e:
        return (e.strerror or str(e) or type(e).__name__).lower()
    with sock:
        try:
            sock.sendall(_HTTP2_PREFACE)
            frame = b""
            while len(frame) < _FRAME_HEADER:
                chunk = sock.recv(_FRAME_HEADER - len(frame))
                if not chunk:
                    return "it accepted the connection and closed it without an HTTP/2 answer"
                frame += chunk
        except socket.timeout:
            return (f"it accepted the connection but sent no HTTP/2 answer within {timeout:g} "
                    "s: the process is stopped or hung, or it is not a TensorFlow server")
        except OSError as e:
            return (e.strerror or str(e) or type(e).__name__).lower()
    if frame[3] != _SETTINGS_FRAME:
        return "it answered, but not as an HTTP/2 server: it is not a TensorFlow server"
    return None


def lost_tasks(config: ClusterConfig, timeout: float, tasks=None) -> list:
    """[((job, index, address), why)] for the tasks (default: all but the chief) that do not
    answer a `probe` within `timeout` seconds; probes them in parallel."""
    if tasks is None:
        tasks = [t for t in config.tasks() if t[0] != "chief"]
    problems: dict = {}

    def check(task):
        problems[task] = probe(task[2], timeout)

    threads = [threading.Thread(target=check, args=(t,), daemon=True) for t in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 1.0)
    # A probe thread still running after its timeout counts as no answer.
    answers = {t: problems.get(t, "no answer") for t in tasks}
    return [(t, why) for t, why in answers.items() if why is not None]


def tasks_named_in(config: ClusterConfig, text: str) -> list:
    """The (job, index, address) of every task of `config` that `text` names, by device
    ("/job:ps/replica:0/task:0", "/job:ps/task:0") or by address, in cluster order."""
    named = {(m.group(1), int(m.group(2))) for m in _DEVICE_PATTERN.finditer(text)}
    return [(job, index, address) for job, index, address in config.tasks()
            if (job, index) in named or re.search(rf"{re.escape(address)}(?!\d)", text)]


def describe_tasks(tasks) -> str:
    """One indented line per ((job, index, address), why): device, address and why (a
    service that is no task has index None, and its name as job)."""
    return "\n".join(f"  {job if index is None else _device(job, index)} at {address} ({why})"
                     for (job, index, address), why in tasks)


def wait_until_servers_forgot_previous_chief() -> None:
    """Sleeps until this process has run for CHIEF_TIMEOUT (+1) seconds, on Linux.

    A chief restarted at once would otherwise connect to servers that have not yet noticed
    that the chief before it died, and that start afresh under it moments later (see
    hybrid_strategy.server). A chief is older than that by the time it connects, as a rule:
    importing TensorFlow alone takes seconds.
    """
    try:
        with open("/proc/self/stat") as stat:
            # Field 22 is the start time in clock ticks since boot; the name (field 2) may
            # hold spaces, so count from its closing parenthesis.
            started = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            age = float(uptime.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return
    time.sleep(max(0.0, CHIEF_TIMEOUT + 1.0 - age))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _build(cluster, task_type, task_index, source: str) -> ClusterConfig:
    try:
        return ClusterConfig(cluster, task_type, task_index)
    except ClusterConfigError as e:
        raise ClusterConfigError(f"{source}: {e}") from None


def _checked_cluster(cluster) -> dict[str, tuple[str, ...]]:
    if not isinstance(cluster, Mapping):
        raise ClusterConfigError(
            f'"cluster" must be an object mapping job names to address lists, got {_kind(cluster)}.'
        )
    if not cluster:
        raise ClusterConfigError(
            '"cluster" is empty; list the jobs and their "host:port" addresses, e.g. '
            '{"worker": ["host1:2222"], "ps": ["host2:2222"]}.'
        )
    for job in cluster:
        if job not in JOBS:
            raise ClusterConfigError(
                f'unknown job "{job}" in "cluster"; the allowed jobs are {_ALLOWED_JOBS}.'
            )
    checked = {job: _checked_addresses(job, cluster[job]) for job in JOBS if job in cluster}
    if len(checked.get("chief", ())) > 1:
        raise ClusterConfigError(
            f'job "chief" has {len(checked["chief"])} tasks; there can be only one chief (the '
            "process that runs the training program): make the others workers."
        )
    _check_unique(checked)
    return checked


def _checked_addresses(job: str, addresses) -> tuple[str, ...]:
    if (
        not isinstance(addresses, (list, tuple))
        or not addresses
        or not all(isinstance(a, str) for a in addresses)
    ):
        raise ClusterConfigError(
            f'job "{job}" must be a non-empty list of "host:port" strings, got {addresses!r}.'
        )
    for index, address in enumerate(addresses):
        if split_address(address) is None:
            raise ClusterConfigError(
                f'job "{job}" task {index} has address "{address}", which is not "host:port" '
                'with an integer port from 1 to 65535; write it like "10.0.0.1:2222".'
            )
    return tuple(addresses)


def _check_unique(cluster: dict[str, tuple[str, ...]]) -> None:
    owner: dict[str, str] = {}
    for job, addresses in cluster.items():
        for index, address in enumerate(addresses):
            task = _device(job, index)
            if address in owner:
                raise ClusterConfigError(
                    f'address "{address}" is used by both {owner[address]} and {task}; '
                    "give every task its own port."
                )
            owner[address] = task


def _check_task(cluster, task_type, task_index) -> None:
    if task_type is None and task_index is None:
        return
    if task_type not in cluster:
        raise ClusterConfigError(
            f"task type {task_type!r} is not a job of the cluster (its jobs are "
            f"{_job_list(cluster)}); set the task type to one of them."
        )
    size = len(cluster[task_type])
    if not _is_int(task_index):
        raise ClusterConfigError(
            f"task index {task_index!r} must be an integer from 0 to {size - 1}."
        )
    if not 0 <= task_index < size:
        raise ClusterConfigError(
            f'task index {task_index} is out of range: job "{task_type}" has {size} task(s), '
            f"so use an index from 0 to {size - 1}."
        )


def _dense_addresses(job, tasks):
    """as_dict() gives a list, or a dict index -> address when task indices are sparse."""
    if not isinstance(tasks, Mapping):
        return tasks
    indices = sorted(tasks)
    if indices != list(range(len(indices))):
        raise ClusterConfigError(
            f'cluster resolver: job "{job}" has task indices {indices}; number its tasks '
            f"0 to {len(indices) - 1} without gaps."
        )
    return [tasks[i] for i in indices]


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) for "host:port" or "[ipv6]:port"; None when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() for c in host) or "/" in host:
        return None
    return host, int(port)


def _join_all(threads, deadline: float, check) -> None:
    # Bounded joins on daemon threads: a stuck connect can never hold the caller past the
    # deadline by more than the slack.
    end = deadline + 1.0
    for thread in threads:
        while thread.is_alive() and time.monotonic() < end:
            if check is not None:
                check()
            thread.join(_PROBE_INTERVAL)


def _probe_until(task, deadline: float, stop, reached: set, errors: dict) -> None:
    """Probes one task until it answers (added to `reached`) or the deadline passes."""
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        problem = probe(task[2], max(0.05, min(1.0, remaining)))
        if problem is None:
            reached.add(task)
            return
        errors[task] = problem
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        stop.wait(min(_PROBE_INTERVAL, remaining))  # the last attempt falls on the deadline


def _unreachable_message(unreachable, errors, timeout: float) -> str:
    lines = describe_tasks((task, errors.get(task, "no answer")) for task in unreachable)
    return (
        f"{len(unreachable)} task(s) did not answer within {timeout:g} s:\n{lines}\n"
        "Check that each of them runs its server (python -m hybrid_strategy.server with the "
        "TF_CONFIG of that task) and that the addresses in TF_CONFIG are right and reachable "
        "from this machine."
    )


def check_timeout(timeout) -> None:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")


def _device(job: str, index: int) -> str:
    return f"/job:{job}/task:{index}"


def _job_list(cluster) -> str:
    return ", ".join(f'"{job}"' for job in cluster)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), repr(value))
