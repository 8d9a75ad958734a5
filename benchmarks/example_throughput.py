"""Training throughput of keras_examples/recommender.py under three strategies, in one run.

    python -m benchmarks.example_throughput [--json results.json]

Runs the example, each time as a fresh process and with the same model, global batch
and data:

  hybrid    HybridStrategy (architecture=hybrid) on a cluster of 2 workers + 1 ps
            started on this machine by `python -m hybrid_strategy.launch`;
  mirrored  tf.distribute.MirroredStrategy on this machine (`--strategy=mirrored`);
  none      no strategy, one process alone (`--strategy=none`).

`--runs hybrid,allreduce,ps,mirrored,none` adds HybridStrategy's other two
architectures (every variable mirrored; every variable on the PS) on the same cluster.

It reads the steps/s each run prints on its `final:` line (the last epoch's training
steps; the first epoch, which traces, is left out) and prints a markdown table with
steps/s, examples/s and the ratio to the single-process run, the machine, and the
exact commands. On loopback every task shares this machine's cores, so the figures
show the per-step cost of each strategy, not the speed of a real network.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import sys

from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "keras_examples", "recommender.py")
RUNS = ("hybrid", "mirrored", "none")
# HybridStrategy's other architectures, on the same cluster: --runs hybrid,allreduce,ps,...
CLUSTER_RUNS = {"hybrid": "hybrid", "allreduce": "allreduce", "ps": "ps"}
_FINAL = re.compile(r"^final: (.*)$", re.MULTILINE)
_FIELD = re.compile(r"([\w/]+)=([-+0-9.eE]+)")


def command(run, options):
    """The command line of one run."""
    example = [sys.executable, EXAMPLE,
               f"--epochs={options.epochs}",
               f"--steps_per_epoch={options.steps_per_epoch}",
               f"--batch_size={options.batch_size}",
               f"--examples={options.examples}",
               "--verbose=0"]
    if run in CLUSTER_RUNS:
        return ([sys.executable, "-m", "hybrid_strategy.launch",
                 "--workers", str(options.workers), "--ps", str(options.ps), "--"]
                + example + ["--strategy=hybrid", f"--architecture={CLUSTER_RUNS[run]}"])
    return example + [f"--strategy={run}"]


def run_once(argv, timeout):
    """Runs one command; returns (fields of its final line or None, output, seconds)."""
    output, code, seconds = machine.run_captured(argv, timeout)
    finals = _FINAL.findall(output)
    if code != 0 or not finals:
        return None, output, seconds
    return {k: float(v) for k, v in _FIELD.findall(finals[-1])}, output, seconds


def measure(run, options):
    argv = command(run, options)
    print(f"[{run}] {shlex.join(argv)}", file=sys.stderr, flush=True)
    rates, aucs, walls = [], [], []
    for _ in range(options.repeats):
        fields, output, seconds = run_once(argv, options.timeout)
        if fields is None or "steps/s" not in fields:
            tail = "\n".join(output.rstrip().splitlines()[-30:])
            print(f"[{run}] failed after {seconds:.0f} s; last output:\n{tail}",
                  file=sys.stderr, flush=True)
            return {"run": run, "command": shlex.join(argv), "error": tail}
        rates.append(fields["steps/s"])
        aucs.append(fields.get("val_auc"))
        walls.append(seconds)
        print(f"[{run}] steps/s={fields['steps/s']:.2f} val_auc={fields.get('val_auc')} "
              f"wall={seconds:.0f} s", file=sys.stderr, flush=True)
    steps = statistics.median(rates)
    return {"run": run, "command": shlex.join(argv), "steps_per_s": steps,
            "examples_per_s": steps * options.batch_size, "all_steps_per_s": rates,
            "val_auc": aucs[-1], "wall_s": statistics.median(walls)}


def table(results, baseline):
    rows = ["| run | steps/s | examples/s | vs none | val AUC | wall s |",
            "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['run']} | failed | | | | |")
            continue
        ratio = (f"{r['steps_per_s'] / baseline:.2f}x" if baseline else "n/a")
        auc = f"{r['val_auc']:.3f}" if r["val_auc"] is not None else ""
        rows.append(f"| {r['run']} | {r['steps_per_s']:.1f} | {r['examples_per_s']:,.0f} | "
                    f"{ratio} | {auc} | {r['wall_s']:.0f} |")
    return "\n".join(rows)


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.example_throughput",
        description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="comma-separated, in order, from hybrid,allreduce,ps (HybridStrategy "
                        "architectures on the cluster), mirrored, none (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="hybrid run: workers")
    parser.add_argument("--ps", type=int, default=1, help="hybrid run: ps tasks")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps_per_epoch", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=512, help="global batch")
    parser.add_argument("--examples", type=int, default=512 * 50)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per strategy, the table shows the median (default 3: "
                        "one epoch of 50 steps is a short window)")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds before one run is abandoned")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    options = parser.parse_args(argv)
    runs = [r.strip() for r in options.runs.split(",") if r.strip()]
    known = set(RUNS) | set(CLUSTER_RUNS)
    unknown = sorted(set(runs) - known)
    if unknown:
        parser.error(f"unknown run(s) {unknown}; choose from {','.join(sorted(known))}")
    options.runs = runs
    return options


def main(argv=None):
    options = parse(argv)
    host = machine.describe()  # the load average before our own runs add to it
    results = [measure(run, options) for run in options.runs]
    by_run = {r["run"]: r for r in results}
    baseline = by_run.get("none", {}).get("steps_per_s")
    print(f"\nrecommender example: global batch {options.batch_size}, "
          f"{options.epochs} epochs x {options.steps_per_epoch} steps, steps/s of the last "
          f"epoch; HybridStrategy on {options.workers} workers + {options.ps} ps on loopback\n")
    print(table(results, baseline))
    print(f"\nmachine: {machine.summary(host)}")
    print("commands:")
    for r in results:
        print(f"  {r['run']}: {r['command']}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"machine": host, "options": {
                           k: v for k, v in vars(options).items() if k != "json"},
                       "results": results}, f, indent=2)
            f.write("\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
