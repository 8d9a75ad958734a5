"""What the benchmarks record about the machine and the code they measured.

    from benchmarks import machine
    host = machine.describe()   # read before the runs: the load average is "before"
    code = machine.code_version()
    env = machine.environment()  # for a benchmark's subprocess
    pids = machine.server_pids()  # in a launched chief: {"worker0": pid, ...}
    timed = machine.alternate({"a": a, "b": b}, pids, calls=20, rounds=5)
"""

import json
import os
import platform
import subprocess
import sys
import time

from benchmarks import cpu_groups

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU time process `pid` has used, in seconds.

    Counted in clock ticks (1/SC_CLK_TCK s: 10 ms on Linux). Raises ProcessLookupError
    if the process is gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the command name (which may hold spaces) start at its ")".
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} is gone: no CPU time to read") from None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def alternate(functions, pids, calls, rounds, wait=None):
    """Times `functions` ({name: f}) in `rounds` rounds of one block of `calls` calls of
    each, in turn, so that load from elsewhere falls on all of them alike.

    `wait(result)`, if given, takes each block's last result (e.g. `float` of a traced
    function's output), so the block ends when all its calls have. Returns {name:
    {"wall_s_per_call": [one per block], "cpu_s_per_call": {task: over all blocks}}},
    the CPU time being each process's of `pids` ({task: pid}).
    """
    wall = {name: [] for name in functions}
    cpu = {name: {task: 0.0 for task in pids} for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            before = {task: cpu_seconds(pid) for task, pid in pids.items()}
            started = time.perf_counter()
            for _ in range(calls - 1):
                function()
            last = function()
            if wait:
                wait(last)
            wall[name].append((time.perf_counter() - started) / calls)
            for task, pid in pids.items():
                cpu[name][task] += cpu_seconds(pid) - before[task]
    return {name: {"wall_s_per_call": wall[name],
                   "cpu_s_per_call": {task: s / (calls * rounds)
                                      for task, s in cpu[name].items()}}
            for name in functions}


def environment(code_dir=REPO):
    """This process's environment for a benchmark's subprocess: no TF_CONFIG, TensorFlow's
    info logs off, the `hybrid_strategy` package of `code_dir` first on the path, then
    this checkout's (for `benchmarks` and `keras_examples`)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_dir, REPO, env.get("PYTHONPATH"))
                                        if p)
    return env


def run_captured(argv, timeout, code_dir=REPO):
    """Runs `argv` in `code_dir` (`environment(code_dir)`): (its output, stdout and
    stderr together; its exit code, None when it ran past `timeout` seconds; seconds)."""
    start = time.perf_counter()
    try:
        # `python -m` puts the working directory first on sys.path: the package run.
        done = subprocess.run(argv, env=environment(code_dir), cwd=code_dir,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n(timed out after {timeout:.0f} s)"
        code = None
    return output, code, time.perf_counter() - start


def server_pids():
    """{"worker0": pid, ..., "ps0": pid}: the servers of the cluster whose chief this is.

    Read in a chief started by `python -m hybrid_strategy.launch`, from its TF_CONFIG and
    HYBRID_STRATEGY_SERVER_PIDS (the launcher starts and lists them in task order).
    """
    from hybrid_strategy.cluster import config as cluster  # pylint: disable=import-outside-toplevel
    from hybrid_strategy.cluster import launch  # pylint: disable=import-outside-toplevel

    tasks = [f"{job}{index}" for job, index, _ in cluster.from_environment().tasks()
             if job != "chief"]
    pids = [int(p) for p in os.environ[launch.SERVER_PIDS_ENV].split(",")]
    if len(pids) != len(tasks):
        raise RuntimeError(f"{launch.SERVER_PIDS_ENV} lists {len(pids)} processes where "
                           f"TF_CONFIG names {len(tasks)} servers ({', '.join(tasks)})")
    return dict(zip(tasks, pids))


def describe():
    """nproc, CPU model, memory, kernel, Python and the 1/5/15-minute load averages."""
    cpu = platform.processor() or "unknown"
    memory_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            memory_gib = next((round(int(line.split()[1]) / 2**20, 1) for line in f
                               if line.startswith("MemTotal:")), None)
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu, "memory_gib": memory_gib,
            "kernel": platform.release(), "python": platform.python_version(),
            "loadavg_before": os.getloadavg()[0], "loadavg_1_5_15": list(os.getloadavg())}


def summary(host):
    """One line for a report: "2 CPUs (nproc), <model>, 23.4 GiB, Python 3.11, load ..."."""
    load = host.get("loadavg_1_5_15")
    return (f"{host['nproc']} CPUs (nproc), {host['cpu']}, {host.get('memory_gib')} GiB, "
            f"kernel {host.get('kernel')}, Python {host['python']}"
            + (f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the runs"
               if load else ""))


def code_version():
    """The commit of this repository and the code files that differ from it."""
    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.rstrip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None and os.environ.get("HSB_CODE_COMMIT"):
        # A tree unpacked from `git archive` on a host with no checkout: the caller names it.
        return {"commit": os.environ["HSB_CODE_COMMIT"], "modified_files": [],
                "commit_from": "HSB_CODE_COMMIT"}
    changed = git("status", "--porcelain", "--untracked-files=no")
    # Result files (runs write some) say nothing about the code measured.
    paths = [line[3:] for line in (changed or "").splitlines()]
    return {"commit": commit,
            "modified_files": [p for p in paths if not p.startswith("benchmarks/results/")]}


def run_then_summarize(prog, options, runs_dir, run_all, summarize, check=None):
    """The main of a driver of many runs: unless --summary-only, `check()` (a
    cpu_groups.CpuGroupError stops it before any run starts: exit 2) and `run_all(options)`,
    its runs kept in `runs_dir`; then the summary `summarize()` writes, whose path it
    prints. Returns the exit code."""
    if not options.summary_only:
        if check is not None:
            try:
                check()
            except cpu_groups.CpuGroupError as e:
                print(f"python -m {prog}: error: {e}", file=sys.stderr)
                return 2
        os.makedirs(runs_dir, exist_ok=True)
        run_all(options)
    print(f"wrote {os.path.relpath(summarize())}")
    return 0


def write_summary(results_dir, name, runs, render):
    """Writes render(runs) to <results_dir>/<name>.md, a summary of the runs kept in
    <results_dir>/<name>/ (SystemExit saying so if there are none); returns its path."""
    if not runs:
        raise SystemExit(f"no runs in {os.path.join(results_dir, name)}")
    path = os.path.join(results_dir, f"{name}.md")
    with open(path, "w") as f:
        f.write(render(runs))
    return path


def write_results(out, report, markdown):
    """Writes `report` to `out` (JSON) and `markdown` beside it (.md), and prints it."""
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    with open(out.replace(".json", ".md"), "w") as f:
        f.write(markdown)
    print(markdown)


def run_as_chief(module, argv, out, workers=1, ps=1):
    """Runs `python -m module *argv --chief SPEC` as the chief of a local cluster
    (`python -m hybrid_strategy.launch`) and returns the JSON it wrote to SPEC (beside
    `out`, removed after)."""
    spec = out + ".chief.json"
    subprocess.run([sys.executable, "-m", "hybrid_strategy.launch", "--workers", str(workers),
                    "--ps", str(ps), "--", sys.executable, "-m", module, *argv,
                    "--chief", spec], check=True, env=environment())
    with open(spec) as f:
        results = json.load(f)
    os.remove(spec)
    return results
