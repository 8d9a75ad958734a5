"""Emulated machines: every machine of a benchmark cluster gets its own share of a core.

With `--machine-cpus C` (benchmarks.run, time_to_accuracy, scaling), every emulated
machine is a CPU cgroup `hsb-<run>-<machine>` whose CFS quota lets its processes run
C cores' worth of time per `--quota-period-ms` period, however many threads they have:
each task of a cluster (chief, every worker, every ps, for every contender alike; the
`single` contender's one process too) runs on its own machine, or, with `--colocate`,
worker i and ps i share one (Parallax's layout: a worker and a server per machine; the
chief, and workers or servers without a partner, keep a machine of their own). This is
on top of the network namespace and rate-limited link each task already has
(benchmarks/netem.py): colocated tasks still have a link each. With `--ps-cpus C2`, a
machine holding ps tasks only gets C2 cores instead (parameter servers provisioned larger
than workers); with `--colocate` every ps shares a worker's machine, so the two are refused
together.

The quota caps time, not cores: a machine of 0.5 core may run on both of this machine's
cores at once for a quarter period, then waits for the rest of it. There is no NUMA, no
cache or memory bandwidth of its own, and no real NIC; see benchmarks/results/README.md.

Each task's TensorFlow thread pools are sized for its machine's share:
TF_NUM_INTRAOP_THREADS (the threads an op's kernel splits its work over) is set to ceil(C)
(ceil(C2) on a ps machine), at least 1, in every task's environment, and
TF_NUM_INTEROP_THREADS (threads running whole ops) to the same but at least 2: with one,
ops that block waiting for others starve them, and ParameterServerStrategy's steps never
finish. TensorFlow reads both wherever no explicit thread count was configured: the
trainers, and the servers of `python -m hybrid_strategy.server`, whose session config
leaves both at 0.

cgroup v1 (a `cpu` hierarchy, /sys/fs/cgroup/cpu: cpu.cfs_period_us, cpu.cfs_quota_us) and
v2 (/sys/fs/cgroup with the cpu controller enabled: cpu.max) are supported; another root
can be given with `--cgroup-root` or HSB_CGROUP_ROOT. A process joins its group before it
execs (its pid is written to cgroup.procs in the forked child), so every thread it ever
starts is in it. Groups are removed when the contender's run ends, whatever the outcome;
`python -m benchmarks.cpu_groups --cleanup` removes leftovers of a run killed by SIGKILL.

    groups = CpuGroups(cpus=0.5, period_ms=10).check()  # raises CpuGroupError, says why
    groups.add("worker0")
    groups.add("ps0", cpus=1.0)  # a machine of another share
    subprocess.Popen(argv, preexec_fn=groups.joiner("worker0"))
    groups.close()
"""

import argparse
import atexit
import math
import os
import secrets
import signal
import sys
import time

PREFIX = "hsb-"
ROOT_ENV = "HSB_CGROUP_ROOT"
V1_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOT = "/sys/fs/cgroup"
DEFAULT_PERIOD_MS = 10.0
MIN_QUOTA_US = 1000  # the kernel's smallest CFS quota and period
MAX_PERIOD_US = 1_000_000
# TensorFlow's inter-op pool runs whole ops, some of which block until others have run:
# with one thread ParameterServerStrategy's steps never finish, so it keeps at least 2.
MIN_INTER_OP_THREADS = 2
# share: pools sized here for the machine (TF_NUM_*_THREADS = ceil(C)); host: TensorFlow's
# defaults everywhere (the variables at 0), sized for this host's cores; auto: neither, so
# hybrid_strategy.server sizes its pools from its quota and the trainers keep the defaults.
THREAD_SIZINGS = ("share", "host", "auto")


class CpuGroupError(RuntimeError):
    """CPU groups cannot be made or written here; the message names the path and the fix."""


# Options shared by benchmarks.run, time_to_accuracy and scaling --------------------------


def add_options(parser):
    group = parser.add_argument_group(
        "emulated machines (CPU cgroups; benchmarks/cpu_groups.py)")
    group.add_argument("--machine-cpus", type=float, default=None, metavar="C",
                       help="give every emulated machine its own CPU share: C cores' worth "
                       "of time (a CFS quota), e.g. 0.33; default: every task shares this "
                       "machine's cores")
    group.add_argument("--ps-cpus", type=float, default=None, metavar="C",
                       help="give every machine that holds only ps tasks C cores instead of "
                       "--machine-cpus (parameter servers provisioned larger than workers; "
                       "not with --colocate, where each ps shares a worker's machine)")
    group.add_argument("--quota-period-ms", type=float, default=DEFAULT_PERIOD_MS, metavar="MS",
                       help="CFS period of the machines' quotas (default 10)")
    group.add_argument("--machine-threads", choices=THREAD_SIZINGS, default="share",
                       help="TensorFlow thread pools of every task: sized for the machine's "
                       "share (default); host: TensorFlow's defaults, sized for this host's "
                       "cores; auto: HybridStrategy's servers size theirs from their quota, "
                       "the trainers keep the defaults (to measure what sizing changes)")
    group.add_argument("--colocate", action="store_true",
                       help="worker i and ps i share one machine (Parallax's layout); "
                       "default: one machine per task")
    group.add_argument("--cgroup-root", default=None, metavar="DIR",
                       help=f"cgroup directory to make the groups in (default: ${ROOT_ENV}, "
                       f"else {V2_ROOT} if it is cgroup v2, else {V1_ROOT})")


def check_options(parser, options):
    """parser.error for option values no quota can have."""
    if options.machine_cpus is None:
        for given, name in ((options.colocate, "--colocate"),
                            (options.ps_cpus is not None, "--ps-cpus")):
            if given:
                parser.error(f"{name} needs --machine-cpus (machines of their own)")
        return
    if options.ps_cpus is not None and options.colocate:
        parser.error("--ps-cpus and --colocate exclude each other: with --colocate every ps "
                     "shares a machine with a worker, which keeps --machine-cpus; leave out "
                     "one of them")
    period_us = round(options.quota_period_ms * 1000)
    if not MIN_QUOTA_US <= period_us <= MAX_PERIOD_US:
        parser.error("--quota-period-ms must be between 1 and 1000")
    for name, cpus in (("--machine-cpus", options.machine_cpus),
                       ("--ps-cpus", options.ps_cpus)):
        if cpus is None:
            continue
        if cpus <= 0:
            parser.error(f"{name} must be positive")
        if round(cpus * period_us) < MIN_QUOTA_US:
            parser.error(f"{name} {cpus:g} of a {options.quota_period_ms:g} ms period is a "
                         f"quota under the kernel's minimum of {MIN_QUOTA_US / 1000:g} ms; "
                         "give a longer period")


def from_options(options):
    """CpuGroups for the options (checked: raises CpuGroupError), or None without
    --machine-cpus."""
    if getattr(options, "machine_cpus", None) is None:
        return None
    return CpuGroups(options.machine_cpus, options.quota_period_ms,
                     root=options.cgroup_root).check()


def forward(options):
    """The options again, as arguments of another benchmarks.run."""
    if getattr(options, "machine_cpus", None) is None:
        return []
    argv = ["--machine-cpus", f"{options.machine_cpus:g}",
            "--quota-period-ms", f"{options.quota_period_ms:g}",
            "--machine-threads", options.machine_threads]
    if options.ps_cpus is not None:
        argv += ["--ps-cpus", f"{options.ps_cpus:g}"]
    if options.colocate:
        argv.append("--colocate")
    if options.cgroup_root:
        argv += ["--cgroup-root", options.cgroup_root]
    return argv


# Layout -------------------------------------------------------------------------------


def threads(cpus):
    """TensorFlow's intra-op threads (the pool an op's kernel splits its work over) for a
    machine of `cpus` cores: ceil, at least 1."""
    return max(1, math.ceil(cpus - 1e-9))


def thread_environment(cpus, sizing="share"):
    """The environment sizing a task's TensorFlow thread pools for a machine of `cpus`
    cores: intra-op ceil(cpus), inter-op that but at least MIN_INTER_OP_THREADS. With
    sizing "host", both 0: TensorFlow's defaults, which hybrid_strategy.server keeps too
    as the variables are set; "auto": nothing."""
    if sizing == "host":
        return {"TF_NUM_INTRAOP_THREADS": "0", "TF_NUM_INTEROP_THREADS": "0"}
    if sizing == "auto":
        return {}
    return {"TF_NUM_INTRAOP_THREADS": str(threads(cpus)),
            "TF_NUM_INTEROP_THREADS": str(max(MIN_INTER_OP_THREADS, threads(cpus)))}


def layout(tasks, colocate):
    """{task: machine} for task names ("chief", "worker0", "ps0", ...): a machine per task,
    or with `colocate` worker i and ps i on machine "worker<i>+ps<i>"."""
    jobs = {}
    for task in tasks:
        job = task.rstrip("0123456789")
        jobs.setdefault(job, set()).add(task[len(job):])
    machines = {}
    for task in tasks:
        job = task.rstrip("0123456789")
        index = task[len(job):]
        partner = {"worker": "ps", "ps": "worker"}.get(job)
        if colocate and partner and index in jobs.get(partner, ()):
            machines[task] = f"worker{index}+ps{index}"
        else:
            machines[task] = task
    return machines


def shares(machine_of, cpus, ps_cpus=None):
    """{machine: its cores} of a layout() `machine_of`: `ps_cpus` for a machine that holds
    ps tasks only, where given; `cpus` for every other."""
    tasks_on = {}
    for task, machine in machine_of.items():
        tasks_on.setdefault(machine, []).append(task)
    return {machine: (ps_cpus if ps_cpus is not None
                      and all(task.rstrip("0123456789") == "ps" for task in tasks) else cpus)
            for machine, tasks in tasks_on.items()}


def label(cpus, colocate, period_ms=DEFAULT_PERIOD_MS, sizing="share", ps_cpus=None):
    """File-name part of a run with machines: "-cpu0.33", "-cpu0.33-colocated",
    "-cpu0.33-period5ms" (a period other than the default), "-cpu0.33-hostthreads"
    (thread pools of another sizing than "share"), "-cpu0.33-ps1" (ps machines of 1 core)."""
    if cpus is None:
        return ""
    return (f"-cpu{cpus:g}" + (f"-ps{ps_cpus:g}" if ps_cpus is not None else "")
            + (f"-period{period_ms:g}ms" if period_ms != DEFAULT_PERIOD_MS else "")
            + (f"-{sizing}threads" if sizing != "share" else "")
            + ("-colocated" if colocate else ""))


def options_label(options):
    """label() of a benchmark's parsed options."""
    return label(options.machine_cpus, options.colocate, options.quota_period_ms,
                 options.machine_threads, options.ps_cpus)


def machines_label(machines):
    """label() of a results file's "machines" record (None: shared cores)."""
    if not machines:
        return ""
    return label(machines["cpus"], machines["colocate"], machines["quota_period_ms"],
                 machines.get("thread_sizing", "share"), machines.get("ps_cpus"))


def describe(options, groups):
    """What a results file records about the machines (None: all tasks share the cores)."""
    if groups is None:
        return None
    described = {
        "cpus": options.machine_cpus, "quota_period_ms": options.quota_period_ms,
        "quota_us": groups.quota_us, "period_us": groups.period_us,
        "colocate": bool(options.colocate),
        "layout": ("worker i and ps i on one machine (Parallax's layout), the chief "
                   "on its own" if options.colocate else "one machine per task"),
        "threads_per_task": threads(options.machine_cpus),  # intra-op
        "thread_sizing": options.machine_threads,
        "thread_environment": thread_environment(options.machine_cpus,
                                                 options.machine_threads),
        "ps_cpus": options.ps_cpus,
        "cgroup": f"v{groups.version} {groups.root}"}
    if options.ps_cpus is not None:
        described.update(
            ps_quota_us=groups.quota_of(options.ps_cpus),
            ps_thread_environment=thread_environment(options.ps_cpus,
                                                     options.machine_threads))
    return described


def summary(machines, nproc=None):
    """One phrase for a report's title."""
    if not machines:
        return ("all tasks share this machine's "
                + (f"{nproc} cores" if nproc else "cores"))
    text = (f"machines of {machines['cpus']:g} core each (CFS quota "
            f"{machines['quota_us'] / 1000:g} ms per {machines['quota_period_ms']:g} ms "
            f"period; {machines['layout']}; TF threads: "
            + _threads_phrase(machines, machines.get("thread_environment")) + ")")
    if machines.get("ps_cpus") is None:
        return text
    return (text + f", the ps tasks' machines of {machines['ps_cpus']:g} core each (quota "
            f"{machines['ps_quota_us'] / 1000:g} ms; TF threads: "
            + _threads_phrase(machines, machines.get("ps_thread_environment")) + ")")


def _threads_phrase(machines, env):
    if machines.get("thread_sizing") == "host":
        return "TensorFlow's defaults, sized for this host's cores"
    if machines.get("thread_sizing") == "auto":
        return "servers sized from their quota, trainers TensorFlow's defaults"
    if not env:
        return f"{machines['threads_per_task']} per pool"
    return (f"{env['TF_NUM_INTRAOP_THREADS']} intra-op, "
            f"{env['TF_NUM_INTEROP_THREADS']} inter-op")


# Groups -------------------------------------------------------------------------------


def default_root():
    root = os.environ.get(ROOT_ENV)
    if root:
        return root
    if os.path.exists(os.path.join(V2_ROOT, "cgroup.controllers")):
        return V2_ROOT
    return V1_ROOT


_WHAT_TO_DO = (f"Run as root on a machine whose cgroup cpu controller is mounted writable "
               f"(cgroup v1: `mount -t cgroup -o cpu cgroup {V1_ROOT}`; cgroup v2: `echo "
               f"+cpu > {V2_ROOT}/cgroup.subtree_control`; in a container: --privileged "
               f"or a writable cgroup mount), point --cgroup-root (or ${ROOT_ENV}) at such "
               "a directory, or leave out --machine-cpus to let all tasks share the cores.")


class CpuGroups:
    """The CPU groups of one contender's run under `root`, each of `cpus` cores' worth
    unless added with another share."""

    def __init__(self, cpus, period_ms=DEFAULT_PERIOD_MS, root=None, run_id=None):
        self.cpus = cpus
        self.period_us = round(period_ms * 1000)
        self.quota_us = self.quota_of(cpus)
        self.root = os.path.abspath(root or default_root())
        self.run_id = run_id or secrets.token_hex(2)
        self.version = None
        self._created = []
        self._closed = False

    def _fail(self, problem):
        raise CpuGroupError(f"cannot give the emulated machines their CPU share: {problem}. "
                            + _WHAT_TO_DO)

    def check(self):
        """Finds the cgroup version of `root` and proves a group can be made and limited
        there (a probe group, removed at once); raises CpuGroupError saying why not."""
        root = self.root
        if not os.path.isdir(root):
            self._fail(f"{root} does not exist or is not a directory")
        if os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
            self.version = 1
        elif os.path.exists(os.path.join(root, "cgroup.controllers")):
            self.version = 2
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if "cpu" not in f.read().split():
                    self._fail(f"the cpu controller is not available in {root} "
                               "(cgroup.controllers; it may be bound to a v1 hierarchy)")
            with open(os.path.join(root, "cgroup.subtree_control")) as f:
                if "cpu" not in f.read().split():
                    self._fail(f"the cpu controller is not enabled for the groups under "
                               f"{root} ({os.path.join(root, 'cgroup.subtree_control')})")
        else:
            self._fail(f"{root} is not a cgroup directory with the cpu controller (it has "
                       "neither cpu.cfs_quota_us, cgroup v1, nor cgroup.controllers, v2)")
        if os.geteuid() != 0 and not os.access(root, os.W_OK):
            self._fail(f"{root} is not writable by uid {os.geteuid()} (not root)")
        probe = os.path.join(root, f"{PREFIX}probe-{secrets.token_hex(2)}")
        try:
            os.mkdir(probe)
        except OSError as e:
            self._fail(f"cannot create a group in {root}: {e.strerror}")
        try:
            control = "cpu.cfs_quota_us" if self.version == 1 else "cpu.max"
            if not os.path.exists(os.path.join(probe, control)):
                self._fail(f"{root} is not a cgroup file system: a group made there has "
                           f"no {control}")
            self._limit(probe, self.quota_us)
        except OSError as e:
            self._fail(f"cannot set a CPU quota in {probe}: {e}")
        finally:
            _remove_group(probe)
        return self

    def path(self, machine):
        return os.path.join(self.root, f"{PREFIX}{self.run_id}-{machine}")

    def quota_of(self, cpus):
        """The CFS quota, in microseconds per period, of a machine of `cpus` cores."""
        return round(cpus * self.period_us)

    def _limit(self, path, quota_us):
        if self.version == 1:
            _write(os.path.join(path, "cpu.cfs_period_us"), self.period_us)
            _write(os.path.join(path, "cpu.cfs_quota_us"), quota_us)
        else:
            _write(os.path.join(path, "cpu.max"), f"{quota_us} {self.period_us}")

    def add(self, machine, cpus=None):
        """Creates the group of `machine` with the quota of `cpus` cores (default: the
        groups' share), once; returns its path."""
        path = self.path(machine)
        if path in self._created:
            return path
        if not self._created:
            atexit.register(self.close)
        try:
            os.mkdir(path)
        except FileExistsError:
            raise CpuGroupError(f"{path} exists already; remove leftovers with "
                                "`python -m benchmarks.cpu_groups --cleanup`") from None
        self._created.append(path)
        self._limit(path, self.quota_us if cpus is None else self.quota_of(cpus))
        return path

    def limits(self, machine):
        """(quota_us, period_us) as the group's files say."""
        return read_limits(self.path(machine))

    def pids(self, machine):
        return group_pids(self.path(machine))

    def stat(self, machine):
        """read_stat() of the group of `machine`."""
        return read_stat(self.path(machine))

    def joiner(self, machine):
        """A preexec_fn putting the forked child (and so all it runs) into the group."""
        procs = os.path.join(self.path(machine), "cgroup.procs")

        def join():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return join

    def close(self):
        """Removes every group made (stopping what still runs in them). Safe twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for path in reversed(self._created):
            _remove_group(path)


def read_limits(path):
    """(quota_us, period_us) of the group at `path`; quota None if unlimited."""
    if os.path.exists(os.path.join(path, "cpu.max")):
        with open(os.path.join(path, "cpu.max")) as f:
            quota, period = f.read().split()
        return (None if quota == "max" else int(quota)), int(period)
    with open(os.path.join(path, "cpu.cfs_quota_us")) as f:
        quota = int(f.read())
    with open(os.path.join(path, "cpu.cfs_period_us")) as f:
        period = int(f.read())
    return (None if quota < 0 else quota), period


def read_stat(path):
    """How often the group at `path` hit its quota: {"periods": periods with work,
    "throttled": of those, periods it was stopped in, "throttled_us": time stopped}
    (cpu.stat, v1 or v2); None where the kernel does not say."""
    try:
        with open(os.path.join(path, "cpu.stat")) as f:
            fields = dict(line.split() for line in f if line.strip())
    except (OSError, ValueError):
        return None
    if "throttled_usec" in fields:  # v2
        throttled_us = int(fields["throttled_usec"])
    elif "throttled_time" in fields:  # v1, in nanoseconds
        throttled_us = int(fields["throttled_time"]) // 1000
    else:
        return None
    return {"periods": int(fields.get("nr_periods", 0)),
            "throttled": int(fields.get("nr_throttled", 0)), "throttled_us": throttled_us}


def group_pids(path):
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


def _remove_group(path, grace=5.0):
    """Stops what runs in the group (SIGTERM, SIGKILL after `grace` s), then removes it."""
    pids = group_pids(path)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = group_pids(path)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    for _ in range(100):  # a group is busy until its last process is reaped
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def cleanup(root=None, prefix=PREFIX):
    """Removes every group under `root` whose name starts with `prefix`; returns them."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"only names starting with {PREFIX!r} are this harness's")
    root = root or default_root()
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(prefix)
                       and os.path.isdir(os.path.join(root, n)))
    except OSError:
        return []
    for name in names:
        _remove_group(os.path.join(root, name))
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_groups",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cleanup", action="store_true",
                        help=f"remove every group named {PREFIX}* and stop what runs in it")
    parser.add_argument("--cgroup-root", default=None)
    options = parser.parse_args(argv)
    if options.cleanup:
        removed = cleanup(options.cgroup_root)
        print(f"removed {len(removed)} group(s)" + (f": {' '.join(removed)}"
                                                    if removed else ""))
        return 0
    try:
        groups = CpuGroups(0.5, root=options.cgroup_root).check()
    except CpuGroupError as e:
        print(f"CPU groups: unavailable ({e})")
        return 1
    print(f"CPU groups: available (cgroup v{groups.version} at {groups.root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
