"""HybridStrategy against MultiWorkerMirroredStrategy, ParameterServerStrategy and one
process alone: throughput, step time, bytes on the wire per task, peak memory per task.

    python -m benchmarks.run --model recommender \\
        --contenders hybrid,allreduce,ps,mwms,pss,single --workers 2 --ps 1 --link-gbit 1

For each contender, in turn, the harness starts a fresh cluster on this machine as real
processes, with the same model and data (benchmarks/contenders.py says what each contender
runs) and batches sized one of two ways (benchmarks/batches.py): `--global-batch G`
(default: the model's), every contender's step G examples, split over the workers of a
synchronous contender, all on one worker for an asynchronous one (pss, ps-async) and in
one process for `single`; or `--per-worker-batch B`, every worker B examples per step:
synchronous contenders a global batch of W x B, pss's and ps-async's steps (one worker's)
and single's B. Throughput is examples (tokens) per second either way; the table and the
JSON give each contender's batch per step.

  hybrid, ps      chief + W workers + P ps; servers `python -m hybrid_strategy.server
                  --thread-spinning off` (pss's too: the tasks share this machine's cores)
  allreduce       chief + W workers (every variable mirrored: no ps needed)
  mwms            W workers, each training (tf_keras); TF_CONFIG has worker tasks only
  pss             chief (coordinator, tf_keras) + W workers + P ps
  horovod         W workers, each a Horovod rank (tf_keras, Gloo), no horovodrun: each
                  rank has the environment horovodrun would give it, and Horovod's
                  rendezvous server runs in worker 0's namespace; Horovod's virtualenv is
                  built once, before the first horovod run (benchmarks/horovod_contender.py;
                  where that fails, horovod is reported not run, saying why)
  single          one process, no strategy

Network: as root with `ip netns`, every task runs in its own network namespace joined to
one bridge by a veth pair (benchmarks/netem.py), with `--link-gbit` as a tbf rate limit on
both ends of every link, and bytes are read from the link counters (whole frames) of every
task at the two boundaries of the measured window, which every training process marks and
waits at. Elsewhere (or with `--loopback`) the tasks share loopback: the output says so,
links are not limited, and bytes are the TCP payload of each process's sockets (tcp_info
from `ss`), or unavailable if `ss` cannot tell.

CPU time (user + system, /proc/<pid>/stat) of every task is read at the same two
boundaries. With `--profile`, the TensorFlow profiler also traces the chief, worker 0 and
every ps over the measured window, and benchmarks/trace_summary.py splits each task's
thread time per step into kernels of the model, embedding lookups, sparse aggregation,
updates, all-reduce, send/recv, input pipeline and TF runtime; tracing slows the steps,
so those runs are written to their own `-profile` file and left out of the targets and
throughput plots. TensorFlow 2.21's profiler now and then crashes the worker it traces
(SIGSEGV): a profiled contender that fails is run again, up to 3 times in all.

It prints a markdown table per model (throughput and ratio to `single`, median step time,
bytes sent + received per worker per step beside the lower bound of benchmarks/lower_bound.py,
per-task bytes, CPU time and peak RSS) and writes everything to a JSON file (default:
benchmarks/results/<model>-w<W>-p<P>-<network>.json), which benchmarks/report.py turns into
benchmarks/results/README.md and plots. A contender that fails is reported with the tail
of its output; the others still run. One that hangs fails after `--timeout` in all, or
sooner, `--stall-timeout` seconds after its last step (its trainers report their steps
at most once a second). `--cleanup` removes leftover namespaces and CPU groups (hsb-*).

Machines of their own: with `--machine-cpus C` every emulated machine also gets its own
CPU share, a cgroup with a CFS quota of C cores per `--quota-period-ms` (every task of
every contender on a machine of its own, the chief and `single` too; with `--colocate`
worker i and ps i share one, Parallax's layout), and each task's TensorFlow thread pools
are sized for it (ceil(C) intra-op threads; inter-op the same but at least 2). With
`--ps-cpus C2` too, a machine holding ps tasks only gets C2 cores (and pools for C2)
instead; not with `--colocate`. benchmarks/cpu_groups.py says how; where cgroups
cannot be written the run stops before any process starts, saying why. Without it, every
task shares this machine's cores, as before; the report names which with every table.
"""

import argparse
import ctypes
import datetime
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import batches
from benchmarks import contenders as contenders_lib
from benchmarks import cpu_groups
from benchmarks import horovod_contender
from benchmarks import machine as machine_lib
from benchmarks import netem
from benchmarks import run_tables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
SCHEMA = 1
PORT = 2222  # every task has its own namespace, so all can use the same port
QUICK = {"steps": 10, "warmup": 3}
PROFILE_ATTEMPTS = 3  # a profiled contender is run again when a task crashed
_POLL = 0.005               # seconds between looks at the phase markers
STALL_TIMEOUT = 300.0       # default --stall-timeout
_SERVER_START_TIMEOUT = 180.0
_STOP_GRACE = 5.0
_PR_SET_PDEATHSIG = 1
_SERVING = re.compile(r"serving on")
EXIT_INTERRUPTED = 130  # as a shell reports a command stopped by SIGINT


class Interrupted(BaseException):
    """SIGINT/SIGTERM: unwinds through every finally (processes, namespaces)."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


# Machine and environment ----------------------------------------------------------


def _environ(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("TF_CONFIG", None)
    env.update(extra or {})
    return env


def _load_prctl():
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    return prctl


_PRCTL = _load_prctl()


def _die_with_us():
    """preexec_fn: the kernel kills the child if the harness dies (even by SIGKILL)."""
    parent = os.getpid()

    def preexec():
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def vm_hwm_kib(pid):
    return contenders_lib.vm_hwm_kib(pid)


def cpu_seconds(pid):
    """User + system CPU time a process has used, in seconds, or None if it is gone."""
    try:
        return machine_lib.cpu_seconds(pid)
    except ProcessLookupError:
        return None


def stalled(sync_dir, tasks, limit, now=None):
    """(task, seconds since its last step, that step) for the first of `tasks` whose
    trainer has reported a step (contenders.heartbeat) but none in the last `limit`
    seconds; None if there is none."""
    now = time.time() if now is None else now
    for task in tasks:
        path = os.path.join(sync_dir, f"step.{task}")
        try:
            seconds = now - os.path.getmtime(path)
            with open(path) as f:
                batch = f.read()
        except FileNotFoundError:
            continue
        if seconds > limit:
            return task, seconds, batch
    return None


# Bytes per process without namespaces ------------------------------------------------

_SS_PID = re.compile(r"pid=(\d+)")
_SS_FIELD = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def tcp_bytes(namespace=None, pids=None):
    """TCP payload bytes {pid or None: {"tx_bytes", "rx_bytes"}} over established sockets,
    from tcp_info (`ss -tinpH`); None if ss fails. In a namespace, every socket there
    counts (key None); otherwise sockets are attributed to `pids`."""
    argv = (["ip", "netns", "exec", namespace] if namespace else []) + [
        "ss", "-tinH" + ("" if namespace else "p"), "state", "established"]
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    totals = {}
    owner = None
    for line in done.stdout.splitlines():
        if not line.startswith((" ", "\t")):
            match = _SS_PID.search(line)
            owner = int(match.group(1)) if match else None
            if namespace:
                owner = None
            elif owner not in (pids or ()):
                owner = "other"
            continue
        if owner == "other":
            continue
        fields = dict(_SS_FIELD.findall(line))
        entry = totals.setdefault(owner, {"tx_bytes": 0, "rx_bytes": 0})
        entry["tx_bytes"] += int(fields.get("bytes_acked", 0))
        entry["rx_bytes"] += int(fields.get("bytes_received", 0))
    return totals


# One contender -------------------------------------------------------------------------


class Task:
    def __init__(self, name, job, index):
        self.name, self.job, self.index = name, job, index
        self.process = None
        self.log = None

    def log_tail(self, lines=15):
        """The last lines of this task's output: what a failure says about itself."""
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:])


def cluster_tasks(contender, workers, ps):
    """Task list of a contender's cluster: (name, job, index)."""
    if contender == "single":
        return [Task("chief", "chief", 0)]
    tasks = [] if contender in contenders_lib.WORKERS_TRAIN else [Task("chief", "chief", 0)]
    tasks += [Task(f"worker{i}", "worker", i) for i in range(workers)]
    if contenders_lib.base_of(contender) in contenders_lib.WITH_PS:
        tasks += [Task(f"ps{i}", "ps", i) for i in range(ps)]
    return tasks


def trainers_of(contender, tasks):
    """Tasks that run the training program (and mark the window's boundaries)."""
    if contender in contenders_lib.WORKERS_TRAIN:
        return [t for t in tasks if t.job == "worker"]
    return [t for t in tasks if t.job == "chief"]


class ContenderRun:
    """Starts one contender's cluster, follows its measured window, stops everything."""

    def __init__(self, contender, options, network_mode, workdir, run_label="0"):
        self.contender = contender
        self.options = options
        self.mode = network_mode  # "netns" or "loopback"
        self.workdir = os.path.join(workdir, f"{contender}-{run_label}")
        os.makedirs(self.workdir)
        self.sync_dir = os.path.join(self.workdir, "sync")
        os.makedirs(self.sync_dir)
        self.tasks = cluster_tasks(contender, options.workers, options.ps)
        self.trainers = trainers_of(contender, self.tasks)
        self.servers = [t for t in self.tasks if t not in self.trainers]
        # Examples in one of this contender's steps (benchmarks/batches.py).
        self.batch = batches.step_batch(contender, options.workers, options.global_batch,
                                        options.per_worker_batch)
        self.net = None
        self.groups = None  # cpu_groups.CpuGroups with --machine-cpus
        self.machine_of = (cpu_groups.layout([t.name for t in self.tasks], options.colocate)
                           if getattr(options, "machine_cpus", None) else {})
        self.cpus_of = (cpu_groups.shares(self.machine_of, options.machine_cpus, options.ps_cpus)
                        if self.machine_of else {})  # {machine: its cores}
        self.samples = {}  # phase -> {"counters", "tcp", "time"}
        self.rss = {}
        self.commands = []

    # Cluster description ---------------------------------------------------------------

    def _addresses(self):
        if self.mode == "netns":
            return {t.name: f"{self.net.address(t.name)}:{PORT}" for t in self.tasks}
        from hybrid_strategy.cluster import config as cluster_lib  # pylint: disable=import-outside-toplevel
        ports = set()
        while len(ports) < len(self.tasks):
            ports.add(cluster_lib.free_port("127.0.0.1"))
        return {t.name: f"127.0.0.1:{p}" for t, p in zip(self.tasks, sorted(ports))}

    def _tf_config(self, addresses, task):
        cluster = {}
        for t in self.tasks:
            cluster.setdefault(t.job, []).append(addresses[t.name])
        return json.dumps({"cluster": cluster, "task": {"type": task.job, "index": task.index}})

    def _prefix(self, task):
        if self.mode == "netns" and self.contender != "single":
            return self.net.exec_prefix(task.name)
        return []

    def _spawn(self, task, argv, env):
        task.log = open(os.path.join(self.workdir, f"{task.name}.log"), "w+")
        full = self._prefix(task) + argv
        preexec = _die_with_us()
        command = {"task": task.name, "argv": shlex.join(full),
                   "TF_CONFIG": env.get("TF_CONFIG")}
        if self.groups is not None:
            # Thread pools sized for the share of the task's machine
            # (cpu_groups.thread_environment); the child joins its machine's group before
            # it execs, so every thread it starts runs under the quota.
            machine = self.machine_of[task.name]
            threads = cpu_groups.thread_environment(self.cpus_of[machine],
                                                    self.options.machine_threads)
            env = dict(env, **threads)
            join, die_with_us = self.groups.joiner(machine), preexec

            def preexec():
                die_with_us()
                join()

            command.update(machine=machine, cgroup=self.groups.path(machine), **threads)
        self.commands.append(command)
        task.process = subprocess.Popen(
            full, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=task.log,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)

    def make_machines(self):
        """Makes every machine's CPU group with its share (ps machines: --ps-cpus); returns
        what the results record of them."""
        self.groups = cpu_groups.CpuGroups(
            self.options.machine_cpus, self.options.quota_period_ms,
            root=self.options.cgroup_root).check()
        for machine, cpus in self.cpus_of.items():
            self.groups.add(machine, cpus)
        # As the kernel holds them: (quota, period) in microseconds.
        return {"machines": dict(self.machine_of),
                "cpu_groups": {m: list(self.groups.limits(m)) for m in self.cpus_of}}

    # Run ------------------------------------------------------------------------------

    def run(self):
        result = {"contender": self.contender,
                  "tasks": [t.name for t in self.tasks],
                  "batch_per_step": self.batch,
                  "batch_per_worker": batches.per_worker(self.contender, self.batch,
                                                         self.options.workers),
                  "loadavg_before": os.getloadavg()[0]}
        started = time.monotonic()
        try:
            if self.mode == "netns" and self.contender != "single":
                self.net = netem.Network([t.name for t in self.tasks],
                                         link_gbit=self.options.link_gbit)
                self.net.start()
                result["qdisc"] = self.net.qdisc(self.tasks[0].name)
            if self.machine_of:
                result.update(self.make_machines())
            addresses = self._addresses() if self.contender != "single" else {}
            if self.contender != "single":
                result["cluster"] = {t.name: addresses[t.name] for t in self.tasks}
            self._start_servers(addresses)
            self._start_trainers(addresses)
            self._follow(started)
            result.update(self._collect())
            result["status"] = "ok"
        except Interrupted:
            raise
        except Exception as e:  # a failed contender is reported; the others still run
            result["status"] = "failed"
            result["error"] = f"{type(e).__name__}: {e}"
            result["output_tail"] = self._tails()
        finally:
            self._stop()
            if self.groups is not None:
                self.groups.close()
            if self.net is not None:
                self.net.close()
            result["wall_seconds"] = round(time.monotonic() - started, 1)
            result["loadavg_after"] = os.getloadavg()[0]
            result["commands"] = self.commands
        return result

    def _start_servers(self, addresses):
        python = sys.executable
        devices = self.options.devices_per_worker
        for task in self.servers:
            env = _environ({"TF_CONFIG": self._tf_config(addresses, task)})
            # Every task shares this machine's cores, each with its own address.
            argv = [python, "-m", "hybrid_strategy.server", "--thread-spinning", "off"]
            if task.job == "worker" and devices > 1:
                argv += ["--cpu-devices", str(devices)]
            self._spawn(task, argv, env)
        deadline = time.monotonic() + _SERVER_START_TIMEOUT
        waiting = list(self.servers)
        while waiting:
            for task in list(waiting):
                code = task.process.poll()
                if code is not None:
                    raise RuntimeError(f"server {task.name} exited with {code} at start-up")
                task.log.seek(0)
                if _SERVING.search(task.log.read()):
                    waiting.remove(task)
            if time.monotonic() > deadline:
                raise TimeoutError("servers not serving after "
                                   f"{_SERVER_START_TIMEOUT:.0f} s: "
                                   + ", ".join(t.name for t in waiting))
            time.sleep(0.1)

    # The training program: `python -m TRAINER SPEC.json`, run by `python`.
    TRAINER = "benchmarks.contenders"
    python = sys.executable

    def trainer_spec(self, task):
        """What the training program of `task` is told (SPEC.json)."""
        spec = {"contender": self.contender, "model": self.options.model_name,
                "global_batch": self.batch, "steps": self.options.steps,
                "warmup": self.options.warmup, "num_ps": self.options.ps,
                "steps_per_execution": self.options.steps_per_execution,
                "result": os.path.join(self.workdir, "result.json"),
                "sync_dir": self.sync_dir, "task": task.name,
                "write_result": task.index == 0}
        if self.options.profile and task.index == 0:
            spec["profile"] = {"logdir": os.path.join(self.workdir, "trace"),
                               "duration_ms": self.options.profile_ms}
        return spec

    def _start_trainers(self, addresses):
        for task in self.trainers:
            spec = self.trainer_spec(task)
            spec_path = os.path.join(self.workdir, f"spec.{task.name}.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            self._spawn(task, [self.python, "-m", self.TRAINER, spec_path],
                        self.trainer_environment(task, addresses))

    def trainer_environment(self, task, addresses):
        """The environment of `task`'s training program."""
        extra = {}
        if self.contender != "single":
            extra["TF_CONFIG"] = self._tf_config(addresses, task)
        if self.contender in contenders_lib.LEGACY_KERAS:
            extra["TF_USE_LEGACY_KERAS"] = "1"
        return _environ(extra)

    def _follow(self, started):
        """Answers the phase markers and waits for the trainers; bounded by --timeout, and
        by --stall-timeout once a trainer has done a step."""
        deadline = started + self.options.timeout
        pending = ["start", "end"]
        next_stall_check = time.monotonic()
        while True:
            for phase in list(pending[:1]):
                marks = [os.path.join(self.sync_dir, f"{phase}.{t.name}") for t in self.trainers]
                if all(os.path.exists(m) for m in marks):
                    self._sample(phase)
                    with open(os.path.join(self.sync_dir, f"{phase}.go"), "w") as f:
                        f.write("go")
                    pending.remove(phase)
            codes = [t.process.poll() for t in self.trainers]
            failed = [(t, c) for t, c in zip(self.trainers, codes) if c not in (None, 0)]
            if failed:
                task, code = failed[0]
                raise RuntimeError(f"{task.name} exited with code {code}; its last output:\n"
                                   f"{task.log_tail()}")
            if all(c == 0 for c in codes):
                if pending:
                    raise RuntimeError(f"training ended without the {pending[0]} marker")
                return
            for task in self.servers:
                if task.process.poll() is not None:
                    raise RuntimeError(f"server {task.name} exited with "
                                       f"{task.process.returncode} during training")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after --timeout {self.options.timeout:.0f} s")
            if time.monotonic() >= next_stall_check:
                next_stall_check = time.monotonic() + 1.0
                stall = stalled(self.sync_dir, [t.name for t in self.trainers],
                                self.options.stall_timeout)
                if stall:
                    name, seconds, batch = stall
                    task = next(t for t in self.trainers if t.name == name)
                    raise TimeoutError(
                        f"{name} did no step in {seconds:.0f} s (--stall-timeout "
                        f"{self.options.stall_timeout:.0f}; its last was batch {batch}); its "
                        f"last output:\n{task.log_tail()}")
            time.sleep(_POLL)

    def _sample(self, phase):
        sample = {"time": time.time()}
        if self.net is not None:
            sample["counters"] = self.net.counters()
            sample["tcp"] = {t.name: (tcp_bytes(self.net.namespace(t.name)) or {}).get(None)
                             for t in self.tasks}
        elif self.contender != "single":
            pids = {t.process.pid: t.name for t in self.tasks}
            by_pid = tcp_bytes(pids=set(pids))
            sample["tcp"] = (None if by_pid is None else
                             {name: by_pid.get(pid, {"tx_bytes": 0, "rx_bytes": 0})
                              for pid, name in pids.items()})
        sample["cpu"] = {t.name: cpu_seconds(t.process.pid) for t in self.tasks}
        if self.groups is not None:
            sample["quota"] = {m: self.groups.stat(m) for m in set(self.machine_of.values())}
        if phase == "end":
            self.rss = {t.name: vm_hwm_kib(t.process.pid) for t in self.tasks}
        self.samples[phase] = sample

    def _collect(self):
        path = os.path.join(self.workdir, "result.json")
        with open(path) as f:
            result = json.load(f)
        _check_result(result, self.options, self.contender, self.batch)
        per_task = self.task_usage(result["steps"])
        if ("chief" in per_task and per_task["chief"].get("peak_rss_mib") is None
                and result.get("chief_vmhwm_kib")):
            per_task["chief"]["peak_rss_mib"] = _mib(result["chief_vmhwm_kib"])
        result["per_task"] = per_task
        result["bytes_source"] = ("veth counters (Ethernet frames)" if self.net is not None
                                  else "tcp_info payload per process (ss)"
                                  if self.samples["end"].get("tcp") else "unavailable")
        return result

    def task_usage(self, steps):
        """Per task, over the window between the markers, per step of `steps`: CPU ms,
        bytes sent and received (and peak RSS)."""
        per_task = {}
        start, end = self.samples["start"], self.samples["end"]
        for task in self.tasks:
            entry = {"job": task.job, "peak_rss_mib": _mib(self.rss.get(task.name))}
            cpu = [sample["cpu"].get(task.name) for sample in (start, end)]
            if None not in cpu:
                entry["cpu_ms_per_step"] = (cpu[1] - cpu[0]) * 1000 / steps
            entry.update(_throttling(self.machine_of.get(task.name), start, end, steps))
            for key, label in (("counters", "wire"), ("tcp", "tcp_payload")):
                before = (start.get(key) or {}).get(task.name)
                after = (end.get(key) or {}).get(task.name)
                if before is not None and after is not None:
                    entry[f"{label}_sent_per_step"] = (
                        after["tx_bytes"] - before["tx_bytes"]) / steps
                    entry[f"{label}_received_per_step"] = (
                        after["rx_bytes"] - before["rx_bytes"]) / steps
            per_task[task.name] = entry
        if self.contender == "single":
            per_task["chief"].update(wire_sent_per_step=0.0, wire_received_per_step=0.0)
        return per_task

    def _tails(self, lines=25):
        tails = {}
        for task in self.tasks:
            if task.log is None:
                continue
            try:
                task.log.flush()
                task.log.seek(0)
                text = task.log.read()
            except (OSError, ValueError):
                continue
            kept = [l for l in text.splitlines()
                    if "oneDNN" not in l and "absl::InitializeLog" not in l]
            tails[task.name] = "\n".join(kept[-lines:])
        return tails

    def _stop(self):
        running = [t for t in self.tasks if t.process is not None and t.process.poll() is None]
        for task in running:
            try:
                os.kill(task.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _STOP_GRACE
        for task in running:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                task.process.kill()
                task.process.wait()
        for task in self.tasks:
            if task.log is not None and not task.log.closed:
                task.log.close()


class HorovodRun(ContenderRun):
    """The horovod contender: mwms's tasks, each rank benchmarks/horovod_contender.py run
    by Horovod's virtualenv with the Gloo environment horovodrun would give it, and
    Horovod's rendezvous server beside them, in worker 0's namespace (where its traffic,
    all of it in `hvd.init()`, crosses worker 0's link before the measured window)."""

    TRAINER = "benchmarks.horovod_contender"
    python = horovod_contender.venv_python()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rendezvous = None  # the server's Task, not one of the cluster's
        self.rendezvous_at = None  # (address, port)

    def _start_servers(self, addresses):
        first = self.trainers[0]
        server = self.rendezvous = Task("rendezvous", "rendezvous", 0)
        server.log = open(os.path.join(self.workdir, "rendezvous.log"), "w+")
        argv = self._prefix(first) + [self.python, "-m", self.TRAINER, "--rendezvous",
                                      ",".join(t.name for t in self.trainers)]
        self.commands.append({"task": server.name, "argv": shlex.join(argv)})
        server.process = subprocess.Popen(
            argv, env=_environ(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=server.log,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_us())
        deadline = time.monotonic() + _SERVER_START_TIMEOUT
        while True:
            server.log.seek(0)
            port = horovod_contender.rendezvous_port(server.log.read())
            if port is not None:
                break
            if server.process.poll() is not None:
                raise RuntimeError(f"Horovod's rendezvous server exited with "
                                   f"{server.process.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError("Horovod's rendezvous server not serving after "
                                   f"{_SERVER_START_TIMEOUT:.0f} s")
            time.sleep(0.1)
        self.rendezvous_at = (addresses[first.name].rsplit(":", 1)[0], port)

    def trainer_environment(self, task, addresses):
        interface = netem.TASK_IFNAME if self.net is not None else "lo"
        gloo = horovod_contender.gloo_environment(
            task.index, [t.name for t in self.trainers], *self.rendezvous_at, interface)
        return _environ(dict(gloo, TF_USE_LEGACY_KERAS="1"))

    def _spawn(self, task, argv, env):
        super()._spawn(task, argv, env)
        self.commands[-1]["horovod"] = {k: v for k, v in env.items()
                                        if k.startswith("HOROVOD_")}

    def _stop(self):
        super()._stop()
        server = self.rendezvous
        if server is None:
            return
        if server.process.poll() is None:
            server.process.terminate()
            try:
                server.process.wait(_STOP_GRACE)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
        server.log.close()


def _throttling(machine, start, end, steps):
    """How often `machine`'s quota stopped it over the window: the fraction of its busy
    periods, and ms stopped per step ({} without machines of their own)."""
    stats = [(sample.get("quota") or {}).get(machine) for sample in (start, end)]
    if machine is None or None in stats:
        return {}
    periods = stats[1]["periods"] - stats[0]["periods"]
    return {"throttled_periods": ((stats[1]["throttled"] - stats[0]["throttled"]) / periods
                                  if periods else 0.0),
            "throttled_ms_per_step": (stats[1]["throttled_us"]
                                      - stats[0]["throttled_us"]) / 1000 / steps}


def _check_result(result, options, contender, batch):
    """Refuses a result that does not describe the run that was asked for (steps of
    `batch` examples)."""
    problems = []
    if result.get("contender") != contender or result.get("model") != options.model_name:
        problems.append(f"it names {result.get('contender')}/{result.get('model')}")
    if result.get("steps") != options.steps or result.get("global_batch") != batch:
        problems.append(f"{result.get('steps')} steps of batch {result.get('global_batch')}")
    if result.get("synchronous") and len(result.get("step_times_s") or ()) != options.steps:
        problems.append(f"{len(result.get('step_times_s') or ())} step times")
    if not result.get("measured_seconds", 0) > 0:
        problems.append("no measured time")
    loss = (result.get("last_logs") or {}).get("loss")
    if loss is not None and not math.isfinite(loss):
        problems.append(f"loss {loss}")
    if problems:
        raise RuntimeError("inconsistent result: " + "; ".join(problems))


def _mib(kib):
    return None if kib is None else round(kib / 1024, 1)


# Summary -----------------------------------------------------------------------------


def summarize(result, bound):
    """Adds worker byte means and the ratio to the lower bound to a contender result."""
    per_task = result.get("per_task") or {}
    kinds = [k for k in ("wire", "tcp_payload")
             if any(f"{k}_sent_per_step" in e for e in per_task.values())]
    source = kinds[0] if kinds else None
    workers = [e for name, e in per_task.items() if e["job"] == "worker"]
    totals = [e[f"{source}_sent_per_step"] + e[f"{source}_received_per_step"]
              for e in workers if f"{source}_sent_per_step" in e]
    summary = {"bytes_kind": source}
    if totals:
        summary["worker_bytes_per_step_mean"] = statistics.mean(totals)
        summary["worker_bytes_per_step_max"] = max(totals)
        if bound and bound.get("sent_plus_received"):
            summary["vs_lower_bound"] = (summary["worker_bytes_per_step_mean"]
                                         / bound["sent_plus_received"])
        compressed = (bound or {}).get("compressed", {}).get("sent_plus_received")
        if compressed and contenders_lib.HYBRID_OPTIONS.get(result["contender"]):
            summary["vs_compressed_bound"] = summary["worker_bytes_per_step_mean"] / compressed
    for job in ("chief", "ps"):
        values = [e[f"{source}_sent_per_step"] + e[f"{source}_received_per_step"]
                  for e in per_task.values() if e["job"] == job
                  and f"{source}_sent_per_step" in e]
        if values:
            summary[f"{job}_bytes_per_step_mean"] = statistics.mean(values)
    result["summary"] = summary


# Main ---------------------------------------------------------------------------------


def compute_lower_bound(model, workers, global_batch, timeout):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.lower_bound", "--model", model,
             "--workers", str(workers), "--global-batch", str(global_batch), "--json", path],
            env=_environ(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=timeout)
        if done.returncode != 0:
            tail = "\n".join(done.stdout.splitlines()[-5:])
            return {"error": f"exit {done.returncode}: {tail}"}
        with open(path) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    finally:
        os.unlink(path)


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Contenders: " + ", ".join(contenders_lib.CONTENDERS) + ", horovod (Horovod "
        "0.28.1 in a virtualenv of its own, built on first use: "
        "benchmarks/horovod_contender.py).")
    parser.add_argument("--model", default="recommender",
                        help=", ".join(contenders_lib.MODELS)
                        + " (comma-separated for several)")
    parser.add_argument("--contenders", default=",".join(contenders_lib.CONTENDERS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--devices-per-worker", type=int, default=1,
                        help="CPU devices (replicas) per worker of the HybridStrategy "
                        "contenders (hybrid_strategy.server --cpu-devices)")
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="rate limit of every emulated link, Gbit/s (namespaces only)")
    parser.add_argument("--steps", type=int, default=run_tables.DEFAULT_WINDOW[1],
                        help="measured steps")
    parser.add_argument("--warmup", type=int, default=run_tables.DEFAULT_WINDOW[0],
                        help="warm-up steps (traced first)")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras compile(steps_per_execution=N): steps per call of the "
                        "training function; --steps and --warmup must be multiples of it")
    batches.add_options(parser)
    parser.add_argument("--json", help="results file (default under benchmarks/results/)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['steps']} measured and {QUICK['warmup']} warm-up steps")
    parser.add_argument("--loopback", action="store_true",
                        help="do not use network namespaces even where possible")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every contender this many times, in rounds, and report "
                        "the run of median throughput (all throughputs are kept)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one contender may take, start-up included")
    parser.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT,
                        help="seconds a contender may go without a step once it has done "
                        "one (a hung cluster fails this soon, not after --timeout)")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove leftover namespaces (hsb-*) and exit")
    parser.add_argument("--profile", action="store_true",
                        help="trace every task with the TensorFlow profiler from the start "
                        "of the measured window and report where a step's time goes "
                        "(tracing slows the run: results go to a separate -profile file)")
    parser.add_argument("--profile-ms", type=int, default=3000,
                        help="length of the trace with --profile (default 3000)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep every task's output under the work directory")
    cpu_groups.add_options(parser)
    options = parser.parse_args(argv)
    cpu_groups.check_options(parser, options)
    if options.quick:
        options.steps, options.warmup = QUICK["steps"], QUICK["warmup"]
    options.global_batch_arg = options.global_batch  # each model's run sets global_batch
    options.contender_list = [c.strip() for c in options.contenders.split(",") if c.strip()]
    unknown = [c for c in options.contender_list
               if contenders_lib.base_of(c) not in contenders_lib.CONTENDERS and c != "horovod"]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from "
                     f"{', '.join(contenders_lib.CONTENDERS)}")
    for contender in options.contender_list:
        if ":" in contender:
            try:
                contenders_lib.hybrid_options(contender)
            except ValueError as e:
                parser.error(str(e))
    options.models = [m.strip() for m in options.model.split(",") if m.strip()]
    for m in options.models:
        if m not in contenders_lib.MODELS:
            parser.error(f"unknown model {m!r}; choose from {', '.join(contenders_lib.MODELS)}")
    if options.workers < 1 or options.ps < 1:
        parser.error("--workers and --ps must be at least 1")
    if options.steps < 1 or options.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step traces)")
    if options.devices_per_worker < 1:
        parser.error("--devices-per-worker must be at least 1")
    batches.check_options(parser, options)
    others = [c for c in options.contender_list if c not in contenders_lib.HYBRID_ARCHITECTURES]
    if options.devices_per_worker > 1 and others:
        parser.error(f"--devices-per-worker applies to hybrid, allreduce and ps only; "
                     f"leave out {', '.join(others)}")
    if options.repeats < 1:
        parser.error("--repeats must be at least 1")
    n = options.steps_per_execution
    if n < 1 or options.steps % n or options.warmup % n:
        parser.error(f"--steps-per-execution {n}: must be at least 1 and divide --steps "
                     f"({options.steps}) and --warmup ({options.warmup}), whose windows "
                     "start and end between calls")
    if options.link_gbit is not None and options.link_gbit <= 0:
        parser.error("--link-gbit must be positive")
    if options.stall_timeout <= 0:
        parser.error("--stall-timeout must be positive")
    if options.profile_ms < 100:
        parser.error("--profile-ms must be at least 100")
    if options.json and len(options.models) > 1:
        parser.error("--json takes one model; run the models one by one")
    return options


def network_mode(options):
    if options.loopback:
        return "loopback", "--loopback given"
    ok, why = netem.available()
    return ("netns", "") if ok else ("loopback", why)


def configure(options, model):
    """Sets the options of `model`'s run: its name and its global batch."""
    options.model_name = model
    options.global_batch = batches.synchronous_global_batch(
        model, options.workers, options.global_batch_arg, options.per_worker_batch)


def run_model(options, model, mode, why, argv):
    configure(options, model)
    spec = contenders_lib.MODELS[model]
    replicas = options.workers * options.devices_per_worker
    if options.global_batch % replicas:
        raise SystemExit(f"--global-batch {options.global_batch} must be a multiple of "
                         f"the {replicas} replicas (--workers x --devices-per-worker)")
    if not contenders_lib.model_available(model):
        print(f"[{model}] skipped: {spec.module} does not exist yet", file=sys.stderr)
        return None
    if mode == "netns":
        rate = (f"{options.link_gbit:g} Gbit/s tbf on every link" if options.link_gbit
                else "no rate limit")
        description = f"one network namespace per task, veth + bridge, {rate}"
    else:
        description = f"loopback ({why}); links not limited"
    run_started = time.monotonic()
    run = {
        "schema": SCHEMA,
        "quick": options.quick,
        "profiled": options.profile,
        "model": model,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.run " + shlex.join(argv),
        "machine": machine_lib.describe(),
        "code": machine_lib.code_version(),
        "network": {"mode": mode, "link_gbit": options.link_gbit if mode == "netns" else None,
                    "description": description,
                    "fallback_reason": why if mode == "loopback" else None},
        "config": {"workers": options.workers, "ps": options.ps,
                   "devices_per_worker": options.devices_per_worker,
                   "global_batch": options.global_batch,
                   "per_worker_batch": options.per_worker_batch, "steps": options.steps,
                   "repeats": options.repeats,
                   "steps_per_execution": options.steps_per_execution,
                   "warmup": options.warmup, "unit": spec.unit,
                   "units_per_example": spec.units_per_example},
        "contenders": [],
        "not_run": [],
    }
    machines = cpu_groups.describe(options, getattr(options, "cpu_groups", None))
    run["machines"] = machines
    print(f"[{model}] network: {description}", file=sys.stderr, flush=True)
    print(f"[{model}] CPU: {cpu_groups.summary(machines, run['machine']['nproc'])}",
          file=sys.stderr, flush=True)
    print(f"[{model}] lower bound ...", file=sys.stderr, flush=True)
    run["lower_bound"] = compute_lower_bound(model, options.workers, options.global_batch,
                                             options.timeout)
    if "error" not in run["lower_bound"]:
        from benchmarks import lower_bound  # pylint: disable=import-outside-toplevel
        print(lower_bound.describe(run["lower_bound"]), file=sys.stderr, flush=True)
    workdir = tempfile.mkdtemp(prefix=f"hsb-{model}-")
    try:
        attempts = {c: [] for c in options.contender_list}
        if "horovod" in attempts:
            venv = run["horovod_venv"] = dict(horovod_venv(options), path=(
                horovod_contender.VENV.replace(os.path.expanduser("~"), "~", 1)))
            if "error" in venv:
                del attempts["horovod"]
                run["not_run"].append({"contender": "horovod", "error": venv["error"],
                                       "reason": horovod_contender.not_run_reason(venv)})
                print(f"[{model}] horovod {run['not_run'][-1]['reason']}", file=sys.stderr,
                      flush=True)
        # Rounds of every contender in turn, so that load from elsewhere on the machine
        # drifts over all of them alike.
        for round_index in range(options.repeats):
            for contender, results in attempts.items():
                results.append(run_contender(contender, options, mode, workdir,
                                             run["lower_bound"], model, round_index))
        run["contenders"] = [median_of(results) for results in attempts.values()]
    finally:
        if options.keep_logs:
            run["workdir"] = workdir
            print(f"[{model}] task logs kept in {workdir}", file=sys.stderr)
        else:
            _remove_tree(workdir)
    run["wall_seconds"] = round(time.monotonic() - run_started, 1)
    network = ("loopback" if mode != "netns" else
               f"netns-{options.link_gbit:g}gbit" if options.link_gbit else "netns-nolimit")
    cores = cpu_groups.options_label(options)
    path = options.json or os.path.join(
        RESULTS_DIR, f"{model}-w{options.workers}-p{options.ps}-{network}{cores}"
        f"{'-quick' if options.quick else ''}{'-profile' if options.profile else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(run, f, indent=1)
    print(run_tables.markdown(run))
    print(f"\nresults: {os.path.relpath(path)}", flush=True)
    return run


def horovod_venv(options):
    """Horovod's virtualenv record (benchmarks/horovod_contender.py), built or found once
    per invocation."""
    if getattr(options, "horovod_venv", None) is None:
        options.horovod_venv = horovod_contender.ensure_venv()
    return options.horovod_venv


def median_of(results):
    """The run of median throughput among the successful ones (the last failure if none
    succeeded), with every run's throughput under "repeats" when there were several."""
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["units_per_s"])
    if not ok:
        return results[-1]
    chosen = dict(ok[(len(ok) - 1) // 2])
    if len(results) > 1:
        chosen["repeats"] = {"units_per_s": [r.get("units_per_s") for r in results],
                             "median_step_s": [r.get("median_step_s") for r in results],
                             "status": [r["status"] for r in results],
                             "errors": [r["error"] for r in results if r["status"] != "ok"]}
    return chosen


def run_contender(contender, options, mode, workdir, bound, model, round_index=0):
    label = f"{contender}" + (f" (round {round_index + 1}/{options.repeats})"
                              if options.repeats > 1 else "")
    print(f"[{model}] {label} ...", file=sys.stderr, flush=True)
    attempts = PROFILE_ATTEMPTS if options.profile else 1
    for attempt in range(1, attempts + 1):
        kind = HorovodRun if contender == "horovod" else ContenderRun
        result = kind(contender, options, mode, workdir, f"{round_index}-{attempt}").run()
        if result["status"] == "ok" or attempt == attempts:
            break
        # TF 2.21's profiler now and then crashes the worker it traces.
        print(f"[{model}] {contender}: profiled run failed ({result['error']}); "
              "running it again", file=sys.stderr, flush=True)
    if options.profile:
        result["profile_attempts"] = attempt
    if result["status"] == "ok":
        summarize(result, bound)
        print(f"[{model}] {contender}: {result['units_per_s']:,.0f} {result['unit']}/s, "
              f"steps of {result['batch_per_step']}, "
              f"median step {result['median_step_s'] * 1000:.1f} ms, "
              f"{result['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
    else:
        print(f"[{model}] {contender} FAILED: {result['error']}\n"
              + "\n".join(f"--- {k}:\n{v}" for k, v in result["output_tail"].items()),
              file=sys.stderr, flush=True)
    return result


def _remove_tree(path):
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(path, ignore_errors=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    options = parse(argv)
    if options.cleanup:
        removed = netem.cleanup()
        print(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}"
                                                        if removed else ""))
        groups = cpu_groups.cleanup(options.cgroup_root)
        print(f"removed {len(groups)} CPU group(s)" + (f": {' '.join(groups)}"
                                                      if groups else ""))
        return 0
    try:  # before any process starts
        options.cpu_groups = cpu_groups.from_options(options)
    except cpu_groups.CpuGroupError as e:
        print(f"python -m benchmarks.run: error: {e}", file=sys.stderr, flush=True)
        return 2
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        mode, why = network_mode(options)
        if mode == "loopback":
            print(f"network namespaces not used ({why}): tasks share loopback, links are "
                  "not limited, bytes are TCP payload per process where ss can tell",
                  file=sys.stderr, flush=True)
        runs = [run_model(options, model, mode, why, argv) for model in options.models]
    except Interrupted as e:
        print(f"interrupted ({e}); processes, namespaces and CPU groups removed",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    ok = all(c.get("status") == "ok" for r in runs if r for c in r["contenders"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
