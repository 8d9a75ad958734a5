"""How long a local cluster takes to serve, and the CPU it takes, with forked servers or not.

    python -m benchmarks.cluster_start [--workers 1 2 4] [--rounds 3] [--out FILE]

Each start runs in a fresh Python process (as `python -m hybrid_strategy.launch` does) that
starts `LocalCluster(workers=W, ps=1)`, waits until every server answers, and stops it:
`exec` starts every server as `python -m hybrid_strategy.server`, each importing
TensorFlow; `fork` imports TensorFlow once in the starting process and forks the servers
from it (`fork_servers=True`, what the launcher does). The two alternate, round after
round, so that load from elsewhere falls on both. Reported per start: seconds until
every server answers (LocalCluster.startup_seconds), wall seconds of the whole process,
and the CPU seconds of it and every server (user + system, read from the kernel as each
exits). Results: benchmarks/results/cluster_start.json and .md unless --out says otherwise.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
MODES = ("exec", "fork")
# Starts the cluster, prints how long it took to serve, stops it, exits as the launcher does.
_START = (
    "import sys\n"
    "from hybrid_strategy.cluster.launch import LocalCluster\n"
    "with LocalCluster(workers=int(sys.argv[1]), ps=1, fork_servers=sys.argv[2] == 'fork') "
    "as local:\n"
    "    print(local.startup_seconds, flush=True)\n"
    "from hybrid_strategy.cluster.server import exit_at_once\n"
    "exit_at_once(0)  # as the launcher ends\n"
)


def start_once(workers, mode):
    """{"ready_s", "wall_s", "cpu_s"} of one cluster start and stop in a fresh process."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _START, str(workers), mode], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} start of {workers} workers + 1 ps exited "
                           f"{done.returncode}:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"ready_s": float(done.stdout.split()[-1]), "wall_s": wall, "cpu_s": cpu}


def run(workers, rounds, progress=print):
    """{str(W): {mode: [one start's figures per round]}}."""
    results = {str(w): {mode: [] for mode in MODES} for w in workers}
    for round_index in range(rounds):
        for w in workers:
            for mode in MODES:
                figures = start_once(w, mode)
                results[str(w)][mode].append(figures)
                progress(f"round {round_index + 1}/{rounds}: {_cluster(w)}, {mode}: "
                         f"ready in {figures['ready_s']:.1f} s, {figures['cpu_s']:.1f} s "
                         "of CPU")
    return results


def _cluster(workers):
    return f"{workers} worker{'s' if workers != 1 else ''} + 1 ps"


def table(results):
    """A markdown table of the medians, fork against exec."""
    lines = ["| cluster | exec: ready s | exec: CPU s | fork: ready s | fork: CPU s | "
             "CPU fork / exec |", "|---|---:|---:|---:|---:|---:|"]
    for w, modes in results.items():
        medians = {mode: {key: statistics.median(start[key] for start in starts)
                          for key in ("ready_s", "cpu_s")} for mode, starts in modes.items()}
        lines.append(
            f"| {_cluster(int(w))} | {medians['exec']['ready_s']:.1f} | "
            f"{medians['exec']['cpu_s']:.1f} | {medians['fork']['ready_s']:.1f} | "
            f"{medians['fork']['cpu_s']:.1f} | "
            f"{medians['fork']['cpu_s'] / medians['exec']['cpu_s']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_start",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], metavar="W",
                        help="worker counts, each with 1 ps (default 1 2 4)")
    parser.add_argument("--rounds", type=int, default=3, help="starts of each (default 3)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "cluster_start.json"),
                        help="JSON results file (default benchmarks/results/cluster_start.json)")
    options = parser.parse_args(argv)
    if options.rounds < 1 or min(options.workers) < 1:
        parser.error("--rounds and every --workers count must be at least 1")
    command = " ".join(["python -m benchmarks.cluster_start"]
                       + (sys.argv[1:] if argv is None else list(argv)))
    results = run(options.workers, options.rounds)
    with open(options.out, "w") as f:
        json.dump({"command": command, "cores": os.cpu_count(), "results": results}, f,
                  indent=1)
    report = (f"# Cluster start: servers forked or started afresh\n\n{__doc__.split(chr(10), 1)[0]}"
              f"\n\n```bash\n{command}\n```\n\nMedians of {options.rounds} starts on "
              f"{os.cpu_count()} cores:\n\n{table(results)}\n")
    with open(os.path.splitext(options.out)[0] + ".md", "w") as f:
        f.write(report)
    print(table(results))


if __name__ == "__main__":
    main()
