"""How the coordinator's cost and the throughput per worker scale with the number of workers.

    python -m benchmarks.scaling --model text,recommender --workers 1,2,4,8 \\
        --contenders hybrid,mwms --steps-per-execution 1,4 --loopback

For every model, worker count W and steps per execution N, this runs
`python -m benchmarks.run` once (fresh clusters of real processes, one per contender)
and keeps its JSON under benchmarks/results/scaling/ (files ending in "-before.json"
there are runs of earlier code, shown as such, for comparison). It then writes
benchmarks/results/scaling.md: per model, network, contender and N, examples/s per
worker, the coordinator's CPU ms per step, every task's CPU ms per step and the bytes a
worker moves per step beside the lower bound; a least-squares line through the
coordinator's CPU ms per step against W (its slope is the coordinator's cost per
worker); and how many workers one coordinator can drive, by that line, before its CPU
time alone fills a step of a given length (the line is fitted from W = 2 on). With matplotlib, it also draws the
coordinator's CPU per step against W (benchmarks/results/scaling-<model>-<network>.png).

The coordinator is the chief for HybridStrategy (one process drives every task); a
MultiWorkerMirroredStrategy cluster has none, every worker runs its own copy of the
program, so its row shows worker 0.

CPU time per step counts only the time a process itself ran, so it holds when other
programs share the machine; examples/s (wall clock) does not: on a shared machine,
compare throughput only between runs made back to back. Keep runs short (the
defaults: 5 warm-up and 40 measured steps; with N steps per call both must be
multiples of N, so they are rounded up). `--per-worker-batch B` is benchmarks.run's: every
worker takes B examples per step, a synchronous contender's global batch growing as W x B,
pss's and ps-async's steps (one worker's) staying B (benchmarks/batches.py); without it,
every run has the model's global batch. `--machine-cpus C` (`--quota-period-ms`,
`--colocate`, `--ps-cpus`) gives every emulated machine its own CPU share
(benchmarks/cpu_groups.py); such runs are kept and shown as a network of their own
("netns-1gbit-cpu0.5").
"""

import argparse
import glob
import json
import math
import os
import re
import shlex
import sys

from benchmarks import batches
from benchmarks import cpu_groups
from benchmarks import machine
from benchmarks import run_tables

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS_DIR = os.path.join(RESULTS_DIR, "scaling")
STEP_TIMES_MS = (10, 50, 100, 200)  # step lengths the projection is given for
# The line is fitted from 2 workers on: with one, no step crosses workers (its
# all-reduces have nothing to reduce), so it is not on the same line.
FIT_FROM_WORKERS = 2
# Runs of earlier code, kept beside the others for comparison, end with this.
BEFORE_SUFFIX = "-before.json"


def run_file(model, network, workers, steps_per_execution, per_worker_batch=None):
    batch = f"-b{per_worker_batch}" if per_worker_batch else ""
    return os.path.join(RUNS_DIR, f"{model}-{network}-w{workers}-spe{steps_per_execution}"
                        f"{batch}.json")


def batch_of(path, run, contender):
    """The batch series `contender`'s row of a kept run belongs to: batches.label() of the
    run. A run kept before runs recorded their per-worker batch says it by its file name
    ("-b128"), made with --global-batch W x 128: 128 per worker for a synchronous
    contender, while an asynchronous one's steps (and single's) took all W x 128, a series
    of its own ("128 x W per step")."""
    config = run["config"]
    match = re.search(r"-b(\d+)(?:-before)?\.json$", os.path.basename(path or ""))
    if not match or "per_worker_batch" in config:
        return batches.label(config)
    if batches.runs_on_one_worker(contender):
        return f"{match.group(1)} x W per step"
    return f"{match.group(1)} per worker"


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def run_all(options):
    """Runs benchmarks.run for every model, W and N; returns the files written."""
    written = []
    for model in options.models:
        for n in options.steps_per_execution:
            for workers in options.workers:
                path = run_file(model, options.network, workers, n, options.per_worker_batch)
                argv = ["--model", model, "--contenders", options.contenders,
                        "--workers", str(workers), "--ps", str(options.ps),
                        *batches.forward(options), "--steps", str(_round_up(options.steps, n)),
                        "--warmup", str(_round_up(options.warmup, n)),
                        "--steps-per-execution", str(n), "--json", os.path.relpath(path)]
                if options.loopback:
                    argv.append("--loopback")
                if options.link_gbit:
                    argv += ["--link-gbit", str(options.link_gbit)]
                argv += cpu_groups.forward(options)
                run_benchmark("scaling", argv)
                written.append(path)
    return written


def run_benchmark(tag, argv):
    """Runs `python -m benchmarks.run ARGV` in this process, saying so on stderr."""
    from benchmarks import run as run_lib  # pylint: disable=import-outside-toplevel
    print(f"[{tag}] python -m benchmarks.run {shlex.join(argv)}", file=sys.stderr, flush=True)
    if run_lib.main(argv) == run_lib.EXIT_INTERRUPTED:  # SIGINT/SIGTERM stop every run
        raise SystemExit(run_lib.EXIT_INTERRUPTED)


# Summary ---------------------------------------------------------------------------


def rows_of(run, label="", path=None):
    """One row per successful contender of a benchmarks.run result (`label` after its
    name: runs of earlier code kept for comparison; `path`: its file, for batch_of())."""
    cfg = run["config"]
    workers = cfg["workers"]
    for c in run["contenders"]:
        if c.get("status") != "ok":
            continue
        per_task = c.get("per_task") or {}
        cpu = {name: e.get("cpu_ms_per_step") for name, e in per_task.items()}
        coordinator = "chief" if "chief" in cpu else "worker0"
        summary = c.get("summary") or {}
        yield {
            "model": run["model"],
            "network": _network(run),
            "contender": c["contender"] + label,
            "steps_per_execution": cfg.get("steps_per_execution", 1),
            "workers": workers,
            "examples_per_s_per_worker": c["examples_per_s"] / workers,
            "units_per_s": c.get("units_per_s", c["examples_per_s"]),
            "unit": cfg.get("unit", "examples"),
            "batch": batch_of(path, run, c["contender"]),
            "machines": bool(run.get("machines")),
            "coordinator": coordinator,
            "coordinator_cpu_ms": cpu.get(coordinator),
            "worker_cpu_ms": [cpu[name] for name in sorted(cpu) if name.startswith("worker")],
            "ps_cpu_ms": [cpu[name] for name in sorted(cpu) if name.startswith("ps")],
            "worker_bytes": summary.get("worker_bytes_per_step_mean"),
            "bound_bytes": (run.get("lower_bound") or {}).get("sent_plus_received"),
            "median_step_ms": c["median_step_s"] * 1000,
            "command": run["command"],
            "date": run["date"],
            "code": run.get("code"),
        }


def _network(run):
    net, m = run["network"], run.get("machines")
    cores = cpu_groups.machines_label(m)
    if net["mode"] != "netns":
        return "loopback" + cores
    return (f"netns-{net['link_gbit']:g}gbit" if net.get("link_gbit")
            else "netns-nolimit") + cores


def fit_line(points):
    """Least squares y = intercept + slope * x over [(x, y)]; None with fewer than 2 x."""
    points = [(x, y) for x, y in points if y is not None]
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return {"slope": slope, "intercept": mean_y - slope * mean_x}


def workers_within(line, step_ms):
    """Workers whose coordinator CPU time per step, by `line`, still fits in `step_ms`."""
    if line is None or line["slope"] <= 0:
        return None
    return max(0, math.floor((step_ms - line["intercept"]) / line["slope"]))


def series(rows):
    """{(model, network, contender, N, batch): rows sorted by W}."""
    out = {}
    for row in rows:
        key = (row["model"], row["network"], row["contender"], row["steps_per_execution"],
               row["batch"])
        out.setdefault(key, []).append(row)
    return {k: sorted(v, key=lambda r: r["workers"]) for k, v in sorted(out.items())}


def efficiency(points):
    """Throughput at the largest W over W times the throughput at W = 1 (1.0: linear),
    with that W; None without both ends."""
    by_w = {r["workers"]: r["units_per_s"] for r in points}
    if 1 not in by_w or len(by_w) < 2:
        return None
    top = max(by_w)
    return by_w[top] / (top * by_w[1]), top


def throughput_section(rows, images):
    """Throughput against W on machines of their own (runs with --machine-cpus), as
    Parallax plots it; [] without such runs."""
    by_series = {k: v for k, v in series(rows).items() if v[0]["machines"]}
    if not by_series:
        return []
    lines = ["## Throughput against the number of machines", "",
             "Every task on an emulated machine of its own (a CPU quota, a rate-limited "
             "link; benchmarks/cpu_groups.py), so W workers have W machines' CPU, not a "
             "share of this host's. Efficiency at W: throughput at W over W times the "
             "same contender's throughput at W = 1 (1.00 is the ideal line).", "",
             "| model | machines | batch | contender | throughput at W = ... | "
             "efficiency |", "|---|---|---|---|---|---:|"]
    for (model, network, contender, _, batch), points in by_series.items():
        unit = points[0]["unit"]
        at = ", ".join(f"{r['workers']}: {r['units_per_s']:,.0f}" for r in points)
        eff = efficiency(points)
        lines.append(f"| {model} | {network} | {batch} | {contender} | {at} {unit}/s | "
                     + ("n/a" if eff is None else f"{eff[0]:.2f} (W = {eff[1]})") + " |")
    lines.append("")
    for key, image in sorted(images.items()):
        lines += [f"![throughput against workers, {key}]({image})", ""]
    return lines


def _ms(value):
    return "n/a" if value is None else f"{value:.1f}"


def markdown(rows, images):
    lines = ["# Scaling with the number of workers", "",
             "Generated by `python -m benchmarks.scaling` from the runs in `scaling/` "
             "(one `python -m benchmarks.run` each; its command is listed below the "
             "tables). The coordinator is the chief for HybridStrategy; "
             "MultiWorkerMirroredStrategy has none (every worker runs the program), so its "
             "rows show worker 0. CPU ms per step (user + system, from /proc, over the "
             "measured steps) is what a process itself ran, and holds on a machine "
             "shared with other programs; examples/s is wall clock and does not: this "
             "machine has 2 cores shared with other jobs, and every task of a cluster "
             "runs on them, so throughput per worker falls with W here by construction "
             "and is comparable only between runs made back to back.", ""]
    lines += throughput_section(rows, images.get("throughput", {}))
    by_series = series(rows)
    lines += ["## Coordinator CPU per step against the number of workers", "",
              "| model | network | contender | steps/call | coordinator | CPU ms/step at "
              "W = ... | ms per worker (slope) | fixed ms | workers within "
              + " / ".join(f"{t} ms" for t in STEP_TIMES_MS) + " steps |",
              "|---|---|---|---:|---|---|---:|---:|---|"]
    for (model, network, contender, n, _), points in by_series.items():
        line = fit_line([(r["workers"], r["coordinator_cpu_ms"]) for r in points
                         if r["workers"] >= FIT_FROM_WORKERS])
        at = ", ".join(f"{r['workers']}: {_ms(r['coordinator_cpu_ms'])}" for r in points)
        within = " / ".join(str(workers_within(line, t)) if line else "n/a"
                            for t in STEP_TIMES_MS)
        slope = "n/a" if line is None else f"{line['slope']:.2f}"
        lines.append(f"| {model} | {network} | {contender} | {n} | "
                     f"{points[0]['coordinator']} | {at} | "
                     f"{slope} | "
                     f"{_ms(line and line['intercept'])} | "
                     f"{within} |")
    lines += ["", "The line is fitted by least squares from W = 2 on (with one worker no "
              "step crosses workers). Workers within T ms: the largest W whose "
              "coordinator CPU time per step, on the fitted line, is at most T (the "
              "coordinator's own ceiling; the workers' compute and the network add to "
              "the step).", ""]
    for key, image in sorted(images.get("coordinator", {}).items()):
        lines += [f"![coordinator CPU per step, {key}]({image})", ""]
    lines += ["## Every run", "",
              "| model | network | batch | contender | steps/call | W | examples/s per "
              "worker | median step ms | coordinator CPU ms/step | worker CPU ms/step (each) | "
              "ps CPU ms/step | worker bytes/step | lower bound | measured / bound |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    commands = []
    for (model, network, contender, n, batch), points in by_series.items():
        for r in points:
            ratio = (r["worker_bytes"] / r["bound_bytes"]
                     if r["worker_bytes"] and r["bound_bytes"] else None)
            lines.append(
                f"| {model} | {network} | {batch} | {contender} | {n} | {r['workers']} | "
                f"{r['examples_per_s_per_worker']:,.0f} | {r['median_step_ms']:.1f} | "
                f"{_ms(r['coordinator_cpu_ms'])} | "
                f"{', '.join(_ms(v) for v in r['worker_cpu_ms'])} | "
                f"{', '.join(_ms(v) for v in r['ps_cpu_ms']) or '-'} | "
                f"{run_tables.fmt_bytes(r['worker_bytes'])} | {run_tables.fmt_bytes(r['bound_bytes'])} | "
                f"{'n/a' if ratio is None else f'{ratio:.2f}'} |")
            if r["command"] not in commands:
                commands.append(r["command"])
    lines += ["", "Commands (date and code of each run in its JSON file):", ""]
    lines += [f"- `{c}`" for c in commands]
    return "\n".join(lines) + "\n"


def plot(rows, results_dir):
    """{"coordinator": {...}, "throughput": {...}}: the figures drawn, by what they show."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return {}
    return {"coordinator": plot_coordinator(plt, rows, results_dir),
            "throughput": plot_throughput(plt, rows, results_dir)}


def plot_throughput(plt, rows, results_dir):
    """Throughput against W with each contender's ideal (W times its own W = 1), one
    figure per model, machines and batch; runs on machines of their own only."""
    figures = {}
    for (model, network, contender, _, batch), points in series(rows).items():
        if points[0]["machines"]:
            figures.setdefault((model, network, batch), []).append((contender, points))
    images = {}
    for (model, network, batch), lines in figures.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        workers = sorted({r["workers"] for _, pts in lines for r in pts})
        for contender, points in lines:
            drawn = ax.plot([r["workers"] for r in points], [r["units_per_s"] for r in points],
                            marker="o", label=contender)
            one = [r["units_per_s"] for r in points if r["workers"] == 1]
            if one:
                ax.plot(workers, [w * one[0] for w in workers], linestyle=":",
                        color=drawn[0].get_color(), linewidth=1,
                        label=f"{contender}, ideal (W x its W = 1)")
        ax.set_xlabel("workers (W), each on a machine of its own")
        ax.set_ylabel(f"{lines[0][1][0]['unit']}/s")
        ax.set_title(f"{model}, {network}, batch {batch}: throughput vs machines",
                     fontsize=10)
        ax.set_xticks(workers)
        ax.legend(fontsize=7, ncol=2)
        name = f"scaling-throughput-{model}-{network}-{batch.replace(' ', '-')}.png"
        images[f"{model}, {network}, batch {batch}"] = _save(plt, fig, ax, results_dir, name)
    return images


def plot_coordinator(plt, rows, results_dir):
    """Coordinator CPU ms per step against W, one figure per model and network."""
    images = {}
    figures = {}
    for (model, network, contender, n, _), points in series(rows).items():
        figures.setdefault((model, network), []).append((contender, n, points))
    for (model, network), lines in figures.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for contender, n, points in lines:
            xs = [r["workers"] for r in points if r["coordinator_cpu_ms"] is not None]
            ys = [r["coordinator_cpu_ms"] for r in points if r["coordinator_cpu_ms"] is not None]
            label = f"{contender} ({points[0]['coordinator']}), {n} step(s)/call"
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("workers (W)")
        ax.set_ylabel("coordinator CPU ms per step")
        ax.set_title(f"{model}, {network}: coordinator CPU per step")
        ax.set_xticks(sorted({r["workers"] for _, _, pts in lines for r in pts}))
        ax.legend(fontsize=8)
        images[f"{model}, {network}"] = _save(plt, fig, ax, results_dir,
                                              f"scaling-{model}-{network}.png")
    return images


def _save(plt, fig, ax, results_dir, name):
    """Finishes a figure against W (axis from 0, grid) and writes it; returns `name`."""
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, name), dpi=100)
    plt.close(fig)
    return name


def summarize(results_dir=RESULTS_DIR, plots=True):
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "scaling", "*.json"))):
        with open(path) as f:
            run = json.load(f)
        label = ""
        if path.endswith(BEFORE_SUFFIX):
            label = f" (before, {run['code']['commit'][:7]})"
        rows += list(rows_of(run, label, path))
    return machine.write_summary(
        results_dir, "scaling", rows,
        lambda rows: markdown(rows, plot(rows, results_dir) if plots else {}))


def _ints(text):
    return sorted({int(v) for v in text.split(",") if v.strip()})


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="text", help="comma-separated models")
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    parser.add_argument("--contenders", default="hybrid,mwms")
    parser.add_argument("--steps-per-execution", default="1",
                        help="comma-separated steps per call (Keras steps_per_execution)")
    parser.add_argument("--ps", type=int, default=1)
    batches.add_options(parser, global_batch=False)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--link-gbit", type=float, default=None)
    parser.add_argument("--summary-only", action="store_true",
                        help="do not run; rebuild scaling.md and plots from the runs kept")
    parser.add_argument("--no-plots", action="store_true")
    cpu_groups.add_options(parser)
    options = parser.parse_args(argv)
    cpu_groups.check_options(parser, options)
    options.models = [m.strip() for m in options.model.split(",") if m.strip()]
    try:
        options.workers = _ints(options.workers)
        options.steps_per_execution = _ints(options.steps_per_execution)
    except ValueError:
        parser.error("--workers and --steps-per-execution take comma-separated integers")
    if not options.workers or min(options.workers) < 1:
        parser.error("--workers: at least one count, each at least 1")
    if not options.steps_per_execution or min(options.steps_per_execution) < 1:
        parser.error("--steps-per-execution: each at least 1")
    batches.check_options(parser, options)
    # A label for the run files; each run records the network it really had.
    options.network = ("loopback" if options.loopback else
                       f"netns-{options.link_gbit:g}gbit" if options.link_gbit
                       else "netns-nolimit") + cpu_groups.options_label(options)
    return options


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    return machine.run_then_summarize(
        "benchmarks.scaling", options, RUNS_DIR, run_all,
        lambda: summarize(plots=not options.no_plots),
        check=lambda: cpu_groups.from_options(options))


if __name__ == "__main__":
    sys.exit(main())
