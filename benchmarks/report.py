"""Markdown tables and plots from the benchmark results in benchmarks/results/.

    python -m benchmarks.report [--results benchmarks/results] [--no-plots]

Reads every JSON file that `python -m benchmarks.run` wrote there and writes
`README.md` beside them: per run, the machine (nproc, CPU, kernel), date, network and
exact command, then the table of contenders (batch per step, throughput and ratio to one
process alone, median step time, bytes per worker per step beside the lower bound, bytes of
the chief and ps, peak RSS per task) and the bytes of every task; then the targets, met or
not.
With matplotlib it also draws, as PNG beside them, throughput against the number of
workers per contender (one figure per model and network), and each run's bytes per
worker per step against its lower bound. Plots need matplotlib (`pip install matplotlib`).
"""

import argparse
import glob
import json
import os
import sys

from benchmarks import batches
from benchmarks import contenders
from benchmarks import cpu_groups
from benchmarks import scaling
from benchmarks.run_tables import (
    ok_result, modified_files, machines_key, machines_label, machines_phrase, markdown, step_batch, per_worker_batch, DEFAULT_WINDOW)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPORTED = "reported"  # a targets row that is a figure shown beside them, not a target
ORDER = ("hybrid", "hybrid-bf16", "allreduce", "ps", "ps-async", "mwms", "pss", "horovod",
         "single")


def _ratio(run, a, b):
    x, y = ok_result(run, a), ok_result(run, b)
    return x["units_per_s"] / y["units_per_s"] if x and y else None


def _is_target_cluster(run, ps, machines=None, workers=4):
    """`workers` workers + `ps` ps on 1 Gbit/s links; tasks sharing this machine's cores,
    or with `machines` "own" / "colocated", on emulated machines of the default quota
    period with pools for the share, one per task or worker i and ps i on one."""
    net, m = run["network"], run.get("machines")
    if machines is None:
        cores = not m
    else:
        cores = (bool(m) and m["colocate"] == (machines == "colocated")
                 and m["quota_period_ms"] == cpu_groups.DEFAULT_PERIOD_MS
                 and m.get("thread_sizing", "share") == "share")
    return (run["config"]["workers"] == workers and run["config"]["ps"] == ps
            and net["mode"] == "netns" and net.get("link_gbit") == 1 and cores)


def _cpu_ratio(run, a, b):
    """CPU time of all of `a`'s tasks per example over `b`'s."""
    totals = []
    for contender in (ok_result(run, a), ok_result(run, b)):
        cpu = [e.get("cpu_ms_per_step") for e in (contender or {}).get("per_task", {}).values()]
        if not cpu or None in cpu:
            return None
        totals.append(sum(cpu) / step_batch(run, contender))
    return totals[0] / totals[1]


def _measured_longest(run):
    """Of runs of one configuration, the one a target takes has the largest of these: the
    most repeats, then the most measured steps, then the newest."""
    return (run["config"].get("repeats", 1), run["config"]["steps"], run["date"])


def targets(runs):
    """(target, measured, met) rows; measured None when no run covers the target."""
    rows = []

    def add(name, value, threshold, fmt="{:.2f}x", lower_is_better=False):
        """A target row; with `threshold` None, a figure reported beside them."""
        if value is None:
            rows.append((name, "not measured", None))
        elif threshold is None:
            rows.append((name, fmt.format(value), REPORTED))
        else:
            met = value <= threshold if lower_is_better else value >= threshold
            rows.append((name, fmt.format(value), met))

    def headline(model, ps=2, machines=None, versus=None):
        """The full (not --quick) run on 4 workers + `ps` ps, 1 Gbit/s links, of one global
        batch for every contender (no --per-worker-batch), measured longest: the most
        repeats, then the most measured steps; with `versus`, of the runs where it and
        the hybrid both finished."""
        found = [r for r in runs if r["model"] == model and _is_target_cluster(r, ps, machines)
                 and not r.get("quick") and not r.get("profiled")
                 and not r["config"].get("per_worker_batch")
                 and (versus is None or (ok_result(r, "hybrid") and ok_result(r, versus)))]
        return max(found, key=_measured_longest, default=None)

    def versus(model, unit, other, threshold, machines=None, where=""):
        """hybrid against `other` on 4 workers + 1 ps (`threshold` None: reported)."""
        run = headline(model, ps=1, machines=machines, versus=other)
        label = (machines_label(run) if run and machines
                 else where or ", machines of their own")
        add(f"{model}, 4 workers + 1 ps, 1 Gbit/s{label}: hybrid "
            + (f">= {threshold:g}x" if threshold else "against") + f" {other} {unit}",
            _ratio(run, "hybrid", other) if run else None, threshold)

    # On machines of their own, where a cluster's tasks run side by side as on machines.
    for model, unit in (("recommender", "examples/s"), ("criteo", "examples/s"),
                        ("lm", "tokens/s")):
        versus(model, unit, "pss", 1.5, machines="own")
        versus(model, unit, "mwms", 3.0, machines="own")
    for model, unit in (("lm", "tokens/s"), ("recommender", "examples/s")):
        versus(model, unit, "horovod", None, machines="own")
        versus(model, unit, "horovod", None, where=", sharing this machine's cores")
    for model, unit in (("lm", "tokens/s"), ("recommender", "examples/s")):
        run = headline(model, ps=4, machines="colocated")
        others = [c["contender"] for c in (run or {}).get("contenders", ())
                  if c["contender"] != "hybrid" and c.get("status") == "ok"]
        ratios = [_ratio(run, "hybrid", c) for c in others]
        add(f"{model}, 4 machines of a worker and a ps each (Parallax's layout), 1 Gbit/s"
            + (machines_label(run) if run else "") + f": hybrid ahead of every contender "
            f"({', '.join(others) or 'none run'}), the least ratio of {unit}",
            min(ratios) if ratios and None not in ratios else None, 1.0)
    for batch, efficiency in (scaling_efficiencies("lm") or {"": None}).items():
        add("lm, 1 to 8 workers on machines of their own, batch fixed per worker"
            + (f" ({batch})" if batch else "") + ": hybrid scaling efficiency >= 0.8",
            efficiency, 0.8, "{:.2f}")
    add("lm, 1 worker + 1 ps to 8 workers + 2 ps (a ps per 4 workers) on machines of 0.2 "
        "core, 128 per worker (Parallax's LM1B batch), median of 3 each: hybrid scaling "
        "efficiency >= 0.8", efficiency_between(runs, "lm", 128, (1, 1), (8, 2), 0.2),
        0.8, "{:.2f}")

    lm, cnn = headline("lm"), headline("cnn")
    add("LM, 4 workers + 2 ps, 1 Gbit/s: hybrid >= 2x mwms tokens/s",
        _ratio(lm, "hybrid", "mwms") if lm else None, 2.0)
    add("LM, 4 workers + 2 ps, 1 Gbit/s: hybrid >= 1.3x ps tokens/s",
        _ratio(lm, "hybrid", "ps") if lm else None, 1.3)
    add("CNN, 4 workers + 2 ps, 1 Gbit/s: hybrid >= 0.95x mwms examples/s",
        _ratio(cnn, "hybrid", "mwms") if cnn else None, 0.95)
    # Where every task shares this machine's 2 cores, throughput is the CPU all tasks
    # spend per example: against the asynchronous ParameterServerStrategy (reported, not
    # targeted, on the recommender), the synchronous peer, and one process.
    for model, unit, cpu_bound, pss in (("recommender", "examples/s", 2.0, None),
                                        ("lm", "tokens/s", 1.15, 1.0)):
        shared = ", sharing this machine's cores"
        versus(model, unit, "pss", pss, where=shared)
        versus(model, unit, "mwms", 3.0, where=shared)
        run = headline(model, ps=1, versus="single")
        add(f"{model}, 4 workers + 1 ps, 1 Gbit/s{shared}: CPU time of all tasks per "
            f"example, hybrid <= {cpu_bound:g}x single",
            _cpu_ratio(run, "hybrid", "single") if run else None, cpu_bound,
            lower_is_better=True)
    floor = step_floor(4)
    add("recommender, 4 workers + 1 ps, loopback: CPU time of all tasks for a synchronous "
        "step with no model (the hybrid's transfers: rows and dense sum; "
        "benchmarks.step_floor) against one process training the model", floor, None)
    for run in runs:
        hybrid = ok_result(run, "hybrid")
        value = (hybrid or {}).get("summary", {}).get("vs_lower_bound")
        if value is not None and run["network"]["mode"] == "netns" and not run.get("profiled"):
            add(f"{run['model']} {run['config']['workers']}w+{run['config']['ps']}ps"
                f"{' (--quick)' if run.get('quick') else ''}{machines_label(run)}: "
                "hybrid worker bytes/step "
                "<= 1.25x lower bound", value, 1.25, "{:.2f}x", lower_is_better=True)
    spike = [r for r in runs if r["model"] == "text" and r["network"]["mode"] == "loopback"
             and r["config"]["workers"] == 2 and not r.get("quick")
             and not r.get("profiled") and not r.get("machines")]
    spike = max(spike, key=_measured_longest, default=None)
    spike_hybrid = ok_result(spike, "hybrid") if spike else None
    add("Loopback, the design spike's model (text: 200k x 64 embedding, mean-pool, "
        "Dense 256, batch 256, SGD, 2 workers): hybrid > 12.5 steps/s (the spike)",
        spike_hybrid["examples_per_s"] / spike_hybrid["global_batch"]
        if spike_hybrid else None, 12.5, "{:.1f} steps/s")
    add("Same run: hybrid >= 1x mwms steps/s (the spike ran 0.49x: 12.5 vs 25.3)",
        _ratio(spike, "hybrid", "mwms") if spike else None, 1.0)
    quick = [r for r in runs if r.get("quick") and r.get("wall_seconds")
             and not r.get("machines")]
    for run in quick:
        add(f"quick configuration ({run['model']}, {len(run['contenders'])} contenders) "
            "under 10 minutes", run["wall_seconds"] / 60, 10.0, "{:.1f} min",
            lower_is_better=True)
    return rows


def step_floor(workers, results_dir=None):
    """benchmarks.step_floor's all-task CPU per step of its "sum" function at `workers`,
    over one process's training the recommender; None if not measured."""
    try:
        with open(os.path.join(results_dir or RESULTS_DIR, "step_floor.json")) as f:
            runs = json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return None
    for run in runs:
        if run.get("workers") == workers and "sum" in run.get("functions", {}):
            single = sum(run["model"]["cpu_ms_per_step"]["single"].values())
            return sum(run["functions"]["sum"]["cpu_ms_per_step"].values()) / single
    return None


def efficiency_between(runs, model, per_worker, small, large, cpus, contender="hybrid",
                       ps_cpus=None):
    """`contender`'s throughput on `large` = (workers, ps) over (large workers / small
    workers) times its throughput on `small`, both on machines of `cpus` cores (one task
    each; the ps tasks' of `ps_cpus`, where given), 1 Gbit/s links and `per_worker`
    examples per worker in each of `contender`'s steps; each the run measured longest;
    None unless both were measured."""
    def measures(run, workers, ps):
        found = ok_result(run, contender)
        return (run["model"] == model and not run.get("quick") and not run.get("profiled")
                and _is_target_cluster(run, ps, machines="own", workers=workers)
                and run["machines"]["cpus"] == cpus
                and run["machines"].get("ps_cpus") == ps_cpus
                and found is not None and per_worker_batch(run, found) == per_worker)

    throughput = {}
    for workers, ps in (small, large):
        found = [r for r in runs if measures(r, workers, ps)]
        if not found:
            return None
        throughput[workers] = ok_result(max(found, key=_measured_longest), contender)["units_per_s"]
    return throughput[large[0]] / (large[0] / small[0] * throughput[small[0]])


def scaling_efficiencies(model, contender="hybrid", results_dir=None):
    """`{batch: efficiency}`: `contender`'s scaling efficiency from 1 to 8 workers on
    machines of their own for each batch fixed per worker ("32 per worker"), from
    benchmarks.scaling's runs; empty if none was measured."""
    rows = []
    for path in glob.glob(os.path.join(results_dir or RESULTS_DIR, "scaling", "*.json")):
        if path.endswith(scaling.BEFORE_SUFFIX):
            continue
        with open(path) as f:
            run = json.load(f)
        rows += [r for r in scaling.rows_of(run, path=path)
                 if r["model"] == model and r["contender"] == contender and r["machines"]
                 and r["batch"].endswith("per worker")]
    found = {}
    for points in scaling.series(rows).values():
        eff = scaling.efficiency(points)
        if eff and eff[1] == 8:
            found[points[0]["batch"]] = eff[0]
    return dict(sorted(found.items(), key=lambda item: int(item[0].split()[0])))


# Files ----------------------------------------------------------------------------------


def load(results_dir):
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(run, dict) and run.get("schema") == 1 and "contenders" in run:
            run["_file"] = os.path.basename(path)
            runs.append(run)
    runs.sort(key=lambda r: (r["model"], r["network"]["mode"], r["config"]["workers"],
                             r["config"]["ps"], r["_file"]))
    return runs


# benchmarks.run's default (warm-up, measured) steps.


def _group_key(run):
    """Runs drawn on one throughput-vs-workers plot: same model, network, machines, batches
    (one global batch, or one batch per worker: batches.label) and window."""
    net, cfg = run["network"], run["config"]
    return (run["model"], net["mode"], net.get("link_gbit"), batches.label(cfg),
            cfg["warmup"], cfg["steps"], machines_key(run))


def _slug(text):
    return "".join(ch if ch.isalnum() or ch in "-." else "-" for ch in str(text))


def plot(runs, results_dir):
    """Draws the PNGs; returns {run file or group: png name}."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
        import matplotlib.ticker  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise SystemExit("benchmarks/report.py draws its plots with matplotlib, which is "
                         f"not installed ({e}): pip install matplotlib (or pip install -e .[bench]) "
                         "(or run with --no-plots for the tables only)") from e
    made = {}
    groups = {}
    for run in runs:
        if not run.get("quick") and not run.get("profiled"):  # full, untraced runs only
            groups.setdefault(_group_key(run), []).append(run)
    for key, group in groups.items():
        model, mode, link, batch, warmup, steps, machines = key
        unit = group[0]["config"].get("unit", "examples")
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for contender in ORDER:
            points = sorted((r["config"]["workers"], c["units_per_s"]) for r in group
                            for c in r["contenders"]
                            if c["contender"] == contender and c.get("status") == "ok")
            if contender == "single":  # measured again in every run: shows the noise
                if points:
                    ax.scatter([p[0] for p in points], [p[1] for p in points], marker="x",
                               color="grey", zorder=3,
                               label="single (one process, in the same run)")
                continue
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=contender)
        ax.set_xlabel("workers")
        ax.set_ylabel(f"{unit}/s")
        network = (f"{link:g} Gbit/s links" if mode == "netns" and link else
                   "namespaces, no limit" if mode == "netns" else "loopback")
        ax.set_title(f"{model}: throughput vs workers ({network}, batch: {batch}"
                     f"{machines_label(group[0])})", fontsize=10)
        workers = sorted({r["config"]["workers"] for r in group})
        ax.set_xticks(workers)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
        window = "" if (warmup, steps) == DEFAULT_WINDOW else f"-{warmup}-{steps}-steps"
        cores = machines or ""
        # Groups apart only by their batch would otherwise draw over each other's file.
        spec = contenders.MODELS.get(model)
        sized = ("" if spec is None or batch == f"global {spec.global_batch}"
                 else "-" + batch.replace("global ", "b").replace(" per worker", "-per-worker"))
        name = f"{_slug(model)}-throughput-{_slug(network)}{cores}{sized}{window}.png"
        fig.tight_layout()
        fig.savefig(os.path.join(results_dir, name), dpi=110)
        plt.close(fig)
        made[key] = name
    for run in runs:
        if run.get("profiled"):
            continue
        bound = (run.get("lower_bound") or {}).get("sent_plus_received")
        bars = [(c["contender"] + ("\n(async)" if not c.get("synchronous", True) else ""),
                 c["summary"].get("worker_bytes_per_step_mean"))
                for c in run["contenders"] if c.get("status") == "ok"
                and c["contender"] != "single"
                and c.get("summary", {}).get("worker_bytes_per_step_mean") is not None]
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        ax.bar([b[0] for b in bars], [b[1] / 1e6 for b in bars], color="tab:blue",
               label="measured (mean over workers, sent + received)")
        if bound:
            ax.axhline(bound / 1e6, color="tab:red", linestyle="--",
                       label="lower bound (sent + received)")
        ax.set_ylabel("MB per worker per step")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_title(f"{run['model']}, {run['config']['workers']} workers + "
                     f"{run['config']['ps']} ps: bytes per step vs lower bound", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
        name = os.path.splitext(run["_file"])[0] + "-bytes.png"
        fig.tight_layout()
        fig.savefig(os.path.join(results_dir, name), dpi=110)
        plt.close(fig)
        made[run["_file"]] = name
    return made


MACHINE_CONTENDERS = ("hybrid", "pss", "mwms", "ps", "horovod")


def _machine_rows(runs, host=False):
    """One table row per run on machines of their own (with `host`, the host's cores and
    CPU model beside each share)."""
    lines = ["| model | cluster | machines | " + " | ".join(MACHINE_CONTENDERS)
             + " | hybrid / pss | hybrid / mwms | repeats |",
             "|---|---|---|" + "---:|" * (len(MACHINE_CONTENDERS) + 3)]
    for run in sorted(runs, key=lambda r: (r["model"], r["machines"]["colocate"],
                                           r["config"]["workers"], r["_file"])):
        cfg, m = run["config"], run["machines"]
        cells = []
        for name in MACHINE_CONTENDERS:
            c = ok_result(run, name)
            cells.append(f"{c['units_per_s']:,.0f}" if c else "-")
        ratios = [_ratio(run, "hybrid", other) for other in ("pss", "mwms")]
        where = (f" on a host of {run['machine']['nproc']} cores ({run['machine']['cpu']})"
                 if host else "")
        lines.append(
            f"| {run['model']} ({cfg.get('unit', 'examples')}/s) | {cfg['workers']} workers "
            f"+ {cfg['ps']} ps, {_network_phrase(run)}, batch: {batches.label(cfg)}"
            + (f", {cfg['steps_per_execution']} steps per call"
               if cfg.get("steps_per_execution", 1) > 1 else "")
            + f" | {machines_phrase(m)}{where} | "
            + " | ".join(cells) + " | "
            + " | ".join("-" if v is None else f"{v:.2f}x" for v in ratios)
            + f" | {cfg.get('repeats', 1)} |")
    return lines


REAL_CORES = "real-cores"


def real_cores_section(results_dir):
    """The runs kept in real-cores/, made on a host with a real core behind every share:
    what the performance claims lead with."""
    runs = load(os.path.join(results_dir, REAL_CORES))
    lines = ["## On real cores", "",
             "Emulated machines as in the next section, on a host with enough cores that "
             "every machine's share is cores of its own (the host's cores at least the sum "
             "of the shares), so no machine waits for another's quota. How they were run "
             "and what they show: [real-cores/README.md](real-cores/README.md).", ""]
    if not runs:
        return lines + ["No such runs yet.", ""]
    lines += _machine_rows(runs, host=True) + [""]
    for run in runs:
        lines += [markdown(run), ""] + _run_facts(run, f"{REAL_CORES}/")
    return lines


def machines_section(runs, results_dir):
    """The runs on machines of their own, one line each (the run of median throughput of
    its repeats), and the scaling plots: what these results lead with."""
    own = [r for r in runs if r.get("machines") and not r.get("quick")
           and not r.get("profiled")]
    lines = ["## On machines of their own", "",
             "Every task (or, in Parallax's layout, each worker with its ps) on an emulated "
             "machine: a CPU cgroup whose CFS quota gives it C cores' worth of time per "
             "period, its thread pools sized for that, and a rate-limited link of its own. "
             "A cluster's tasks then run side by side, as on machines, instead of taking "
             "turns on this host's 2 cores; the emulation's own effect (quota period, "
             "thread pools): [quota_study.md](quota_study.md). What it is not: cores of "
             "their own (a quota of time on the same cores), NUMA, caches or memory "
             "bandwidth of their own, a real NIC. Throughput below is the run of median "
             "throughput of its repeats.", ""]
    if not own:
        return lines + ["No such runs yet (`--machine-cpus`).", ""]
    lines += _machine_rows(own)
    lines += ["", "Throughput against the number of machines (batch fixed per worker; "
              "dotted: each contender's ideal line), from [scaling.md](scaling.md):", ""]
    for name in sorted(glob.glob(os.path.join(results_dir, "scaling-throughput-*.png"))):
        lines += [f"![throughput against machines]({os.path.basename(name)})", ""]
    return lines


def _network_phrase(run):
    net = run["network"]
    if net["mode"] != "netns":
        return "loopback"
    return f"{net['link_gbit']:g} Gbit/s links" if net.get("link_gbit") else "no rate limit"


def _run_facts(run, folder=""):
    """The lines under a run's tables: its file, date, machine, code and command."""
    m = run["machine"]
    return [f"- file: `{folder}{run['_file']}`; date {run['date']}; machine: {m['nproc']} "
            f"CPUs ({m['cpu']}), {m.get('memory_gib')} GiB, kernel {m['kernel']}, "
            f"Python {m['python']}; load average before: {m.get('loadavg_before', 0):.2f}",
            f"- code: commit {(run.get('code') or {}).get('commit') or 'unknown'}"
            + (f", with local changes to {', '.join(modified_files(run))}"
               if modified_files(run) else ""),
            f"- command: `{run['command']}`"
            + (f"; {run['wall_seconds'] / 60:.1f} min in all"
               if run.get("wall_seconds") else ""), ""]


def readme(runs, images, results_dir=RESULTS_DIR):
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks.report` from the JSON files here, each "
             "written by one `python -m benchmarks.run` (the command is given with each "
             "table). Every contender trains the same model from `keras_examples/` on the "
             "same data on a fresh cluster of real processes, with the same global batch "
             "or, in runs made with `--per-worker-batch B`, the same B examples per worker "
             "per step (a synchronous global batch of W x B; asynchronous steps, each one "
             "worker's, and single's of B); each table gives every contender's batch per "
             "step. `benchmarks/run.py`, `benchmarks/batches.py`, `benchmarks/contenders.py` "
             "and `benchmarks/lower_bound.py` say exactly how; targets take runs of one "
             "global batch, and no plot or target series mixes the two.", "",
             "- **Targets** take, per model and cluster, the run measured longest (the "
             "most repeats, then the most measured steps): where a step lasts a few "
             "milliseconds, the default 30 steps last a fraction of a second, still within "
             "the cluster's start-up.",
             "- **Throughput** counts the measured steps only (after warm-up), examples/s "
             "(tokens/s for the language model); *vs single* is the ratio to one process "
             "without a strategy on the same machine.",
             "- **Bytes** are read, with namespaces, from each task's veth counters (whole "
             "Ethernet frames: payload plus TCP/IP headers, with GSO so fewer headers than "
             "1500-byte frames would carry) between the two boundaries of the measured "
             "window, divided by the measured steps; the TCP payload column is tcp_info "
             "of the task's sockets over the same window. On loopback only the TCP "
             "payload is known.",
             "- **Lower bound**: `benchmarks/lower_bound.py`, per worker per step, sent + "
             "received: ring all-reduce of the dense gradients (2(N-1)/N M each way) plus "
             "the unique embedding rows of one worker's share of the batch, pulled and "
             "pushed. It assumes workers all-reduce dense gradients among themselves; "
             "where dense variables live on parameter servers (`ps`, `ps-async`, `pss`) a "
             "worker moves M each way instead of 2(N-1)/N M, so those can read below it per "
             "worker (the servers carry the rest).",
             "- `pss` (ParameterServerStrategy) and `ps-async` (HybridStrategy(architecture="
             "'ps', asynchronous=True)) are asynchronous: each step runs on one worker with "
             "the whole step's batch (the global batch, or B with `--per-worker-batch B`), "
             "so a worker moves the bytes of 1/W of the steps, and only their mean step "
             "time is known.",
             "- *last loss logged* is the training loss Keras reported at the end, to "
             "show that each contender trained the same model: under "
             "MultiWorkerMirroredStrategy tf_keras logs N times the loss (the figures are "
             "exactly N times the others'), and asynchronous `pss` can diverge on the "
             "language model with 4 workers.",
             "- `mwms` and `pss` run under tf_keras (Keras 3 `fit` fails with "
             "MultiWorkerMirroredStrategy on TF 2.21 and has no ParameterServerStrategy).",
             "- `horovod` is Horovod 0.28.1 with Gloo, under tf_keras (with Keras 3 its "
             "DistributedOptimizer does not average across ranks), built from its sdist "
             "with a one-line patch in a virtualenv of its own "
             "(`benchmarks/horovod_contender.py`); its ranks are the workers, as `mwms`'s, "
             "each reading its part of every global batch, and the loss it logs is rank "
             "0's, over that part. Where the build fails the table says so.",
             "- **CPU ms/step**: user + system CPU time of each task's process over the "
             "measured window, divided by the measured steps. On one machine every task "
             "shares its cores, so a step lasts at least the tasks' total CPU time divided "
             "by the cores.",
             "- **Where a step's time goes** (runs whose file ends in `-profile`, made with "
             "`--profile`): a TensorFlow profiler trace of the chief, worker 0 and every ps "
             "over the measured window, split by `benchmarks/trace_summary.py` into "
             "categories of thread time per step (an event's time counts its waits, so "
             "all-reduce includes waiting for the other workers); tracing slows the steps, "
             "so these runs count in no target or plot.",
             "- `text` is the design's overhead model (keras_examples/text_classifier.py: "
             "200,000 x 64 table, mean-pooled, Dense 256, batch 256, SGD), measured on "
             "loopback against the design spike's figures (12.5 steps/s; "
             "MultiWorkerMirroredStrategy 25.3, one process 193 on its machine and day).",
             "- All tasks share this machine's cores: the machine is named with each run "
             "(and the load average before it: other work on the machine skews figures).",
             "- **Machines of their own** (the section \"On machines of their own\" below; "
             "`--machine-cpus C`): every emulated machine is a CPU cgroup with a CFS quota "
             "of C cores per period, one task per machine or, with `--colocate`, worker i "
             "and ps i on one (Parallax's layout), and every task's TensorFlow thread "
             "pools are sized for it (ceil(C) intra-op threads; inter-op the same but at "
             "least 2, as ParameterServerStrategy hangs with one); with `--ps-cpus C2` "
             "the machines of ps tasks have C2 cores (and pools for C2), as parameter "
             "servers are provisioned larger than workers; each table names the "
             "shares, period and layout. "
             "It is an emulation: a quota of time on the same 2 cores, not cores of its "
             "own (a machine of 0.5 core may run on both cores for a quarter period, then "
             "wait); no NUMA, no cache or memory bandwidth of its own, no real NIC (the "
             "links are the veth pairs above; colocated tasks keep one each).",
             "- **Scaling with the number of workers** (the coordinator's CPU per step "
             "against W, examples/s per worker, several steps per call): "
             "[scaling.md](scaling.md), from `python -m benchmarks.scaling`, whose runs "
             "are kept in `scaling/`; **several replicas per worker**, 1 to 8 x 6 = 48 "
             "replicas (first call, chief memory and CPU, step time, where a step's time "
             "goes): [replicas.md](replicas.md), from `python -m benchmarks.replicas`, "
             "whose runs are kept in `replicas/`.",
             "- **Checkpoint memory** (peak RSS of the chief and each ps while saving and "
             "restoring 256 MiB and 1 GiB tables, before and after checkpoints were written "
             "on the ps): [checkpoint_memory.md](checkpoint_memory.md), from `python -m "
             "benchmarks.checkpoint_memory`; **table sizes** (one step's time and memory "
             "against the table's size): [table_scaling.md](table_scaling.md), from "
             "`python -m benchmarks.table_scaling`, and per mixed-precision policy, before "
             "and after loss scaling checked table gradients by their rows: "
             "[table_scaling_mixed_precision.md](table_scaling_mixed_precision.md).",
             "- **Input** (each worker's input CPU per step against W, reads per record, "
             "for the Criteo-like model fed from files and from memory): "
             "[input_scaling.md](input_scaling.md), from `python -m "
             "benchmarks.input_scaling`; **numpy input's memory** (peak RSS of the chief "
             "and the workers, up to 4 GiB of arrays): [array_memory.md](array_memory.md), "
             "from `python -m benchmarks.array_memory`.",
             "- **Time to accuracy** (every contender trained to a validation target on the "
             "same data: time, steps and examples to it, curves against time): "
             "[time_to_accuracy.md](time_to_accuracy.md), from `python -m "
             "benchmarks.time_to_accuracy`, whose runs are kept in `time_to_accuracy/`.",
             "- **A step with no model** (the CPU a synchronous step's transfers cost all "
             "tasks at W workers, sized after the recommender, against the hybrid and one "
             "process training it): [step_floor.md](step_floor.md), from `python -m "
             "benchmarks.step_floor`; **a transfer's CPU per MB** between two processes on "
             "loopback and across the emulated network, with and without its rate limit: "
             "[transfer_cost.md](transfer_cost.md), from `python -m "
             "benchmarks.transfer_cost`.",
             "- **Dynamic vocabularies** (per-id cost on a ps of MutableHashTable, "
             "DenseHashTable and an id-to-row remap against today's gather and scatter-add, "
             "exports, memory per id): [dynamic_table_cost.md](dynamic_table_cost.md), from "
             "`python -m benchmarks.dynamic_table_cost`; `DynamicEmbedding` against `Hashing` "
             "at the same memory, an offline vocabulary, a fixed table and TensorFlow "
             "Recommenders-Addons on raw ids (examples/s, AUC, collisions): "
             "[dynamic_vocabulary.md](dynamic_vocabulary.md), from `python -m "
             "benchmarks.dynamic_vocabulary` (on 2 ps tasks: "
             "[dynamic_vocabulary-2ps.md](dynamic_vocabulary-2ps.md)); the ps's memory under ids that never repeat: "
             "[dynamic_memory.md](dynamic_memory.md), from `python -m "
             "benchmarks.dynamic_memory`; TensorFlow Recommenders-Addons alone: "
             "[tfra_contender.md](tfra_contender.md), from `python -m "
             "benchmarks.tfra_contender`.",
             "- **Cluster start** (seconds until every server of a local cluster answers, "
             "and the CPU it takes, with servers forked from the launcher or each started "
             "as `python -m hybrid_strategy.server`): [cluster_start.md](cluster_start.md), "
             "from `python -m benchmarks.cluster_start`.",
             ""]
    lines += real_cores_section(results_dir) + machines_section(runs, results_dir)
    rows = targets(runs)
    if rows:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---:|---|"]
        for name, value, met in rows:
            verdict = ("n/a" if met is None else met if met == REPORTED
                       else "yes" if met else "**no**")
            lines.append(f"| {name} | {value} | {verdict} |")
        lines.append("")
    by_model = {}
    for run in runs:
        by_model.setdefault(run["model"], []).append(run)
    for model, group in by_model.items():
        lines += [f"## {model}", ""]
        shown = set()
        for run in group:
            k = _group_key(run)
            if k in images and k not in shown:
                shown.add(k)
                lines += [f"![throughput vs workers]({images[k]})", ""]
        for run in group:
            lines += [markdown(run), ""] + _run_facts(run)
            if run["_file"] in images:
                lines += [f"![bytes per step vs lower bound]({images[run['_file']]})", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", default=RESULTS_DIR,
                        help="directory of the JSON results (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    options = parser.parse_args(argv)
    runs = load(options.results)
    if not runs:
        print(f"no results in {options.results}", file=sys.stderr)
        return 1
    images = {} if options.no_plots else plot(runs, options.results)
    path = os.path.join(options.results, "README.md")
    with open(path, "w") as f:
        f.write(readme(runs, images, options.results))
    print(f"wrote {path}" + (f" and {len(images)} plot(s)" if images else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
