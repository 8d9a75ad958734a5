"""Training steps of models with dynamic tables beside the same models with fixed ones.

    python -m benchmarks.dynamic_step [--models recommender8 recommender8_dynamic]
        [--workers 1] [--ps 1] [--contender hybrid] [--steps 100] [--chunks 6]
        [--versions before after] [--before COMMIT] [--json FILE]

On a local cluster of --workers workers and --ps ps tasks (`python -m
hybrid_strategy.launch`, this file as its chief), it builds every model of --models
(benchmarks/contenders.py's MODELS; by default 8 single-hot tables of 10,000 rows,
fixed `Embedding`s and `DynamicEmbedding`s) under one HybridStrategy (--contender,
options included, e.g. `hybrid:min_shard_bytes=65536` to split the tables), counts the
tensors its training step sends between tasks (benchmarks/step_transfers.py), then
trains the models in turn, --steps steps a chunk and --chunks chunks each (chunk 1 of
every model, then chunk 2 of every model, ...), so that load from elsewhere falls on
all alike. Per model: examples/s, the median over the chunks after the first (which
holds the tracing), and its ratio to the first model's; every task's CPU time per step
over those chunks (less sensitive than time to other work on a shared machine). With
--versions before after, it runs once with the `hybrid_strategy` package of --before
(default: where this branch forked from main; benchmarks/chief_runs.py), then once with
this checkout's. Prints a markdown table per version; with --json, writes the figures
there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import chief_runs
from benchmarks import machine


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dynamic_step",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", nargs="+",
                        default=["recommender8", "recommender8_dynamic"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--contender", default="hybrid")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--versions", nargs="+", default=["after"], choices=["before", "after"])
    parser.add_argument("--before", help="commit whose package is 'before' (default: the "
                                         "merge-base with main)")
    parser.add_argument("--json")
    parser.add_argument("--chief", help=argparse.SUPPRESS)  # JSON file the chief writes
    options = parser.parse_args(argv)
    if options.chunks < 2:
        parser.error("--chunks must be at least 2: the first is not timed")
    return options


def run_chief(options):
    """As the cluster's chief: every model's tensors per step and examples/s, written to
    --chief; then the process ends at once."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import importlib  # pylint: disable=import-outside-toplevel

    import keras  # pylint: disable=import-outside-toplevel

    from benchmarks import contenders  # pylint: disable=import-outside-toplevel
    from benchmarks import step_transfers  # pylint: disable=import-outside-toplevel

    strategy = contenders.make_strategy(options.contender, options.ps)
    models, data, out = {}, {}, {}
    for name in options.models:
        spec = contenders.MODELS[name]
        module = importlib.import_module(spec.module)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            models[name] = module.build_model(**spec.build)
        arrays = module.make_arrays(spec.global_batch * options.steps, seed=0, **spec.data)
        data[name] = contenders.per_worker_input(strategy, arrays, spec.global_batch)
        with step_transfers.RunMetadata() as metadata:
            models[name].fit(data[name], epochs=1, steps_per_epoch=2, verbose=0)
        counted = step_transfers.count_transfers(metadata.result)
        out[name] = {"global_batch": spec.global_batch, "chunks_s": [],
                     "tensors_per_step": counted["total"], "transfers": counted["transfers"],
                     "ops": counted["ops"]}
    pids = {"chief": os.getpid(), **machine.server_pids()}
    for name in out:
        out[name]["cpu_s"] = {task: [] for task in pids}
    for _ in range(options.chunks):
        for name, model in models.items():
            cpu = {task: machine.cpu_seconds(pid) for task, pid in pids.items()}
            began = time.perf_counter()
            model.fit(data[name], epochs=1, steps_per_epoch=options.steps, verbose=0)
            out[name]["chunks_s"].append(time.perf_counter() - began)
            for task, pid in pids.items():
                out[name]["cpu_s"][task].append(machine.cpu_seconds(pid) - cpu[task])
    for result in out.values():
        result["examples_per_s"] = statistics.median(
            result["global_batch"] * options.steps / s for s in result["chunks_s"][1:])
        # Every task's CPU time per step, over the timed chunks.
        result["cpu_ms_per_step"] = {
            task: 1e3 * sum(seconds[1:]) / (options.steps * (options.chunks - 1))
            for task, seconds in result["cpu_s"].items()}
    with open(options.chief, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # a process connected to a cluster can hang in interpreter teardown


def markdown(options, version, results):
    first = results[options.models[0]]["examples_per_s"]
    lines = [f"{version}: {options.workers} worker(s) + {options.ps} ps, {options.contender}, "
             f"{options.steps} steps a chunk, median of {options.chunks - 1} chunks:", "",
             "| model | examples/s | vs first | CPU ms per step, all tasks (per task) "
             "| tensors per step | ops per task |",
             "|---|---:|---:|---|---:|---|"]
    for name in options.models:
        r = results[name]
        ops = ", ".join(f"{task} {n}" for task, n in r["ops"].items())
        cpu = ", ".join(f"{task} {ms:.1f}" for task, ms in r["cpu_ms_per_step"].items())
        lines.append(f"| {name} | {r['examples_per_s']:,.0f} | "
                     f"{r['examples_per_s'] / first:.2f}x | "
                     f"{sum(r['cpu_ms_per_step'].values()):.1f} ({cpu}) | "
                     f"{r['tensors_per_step']} | {ops} |")
    return "\n".join(lines)


def run_version(options, argv, code_dir):
    """The chief's figures, run with `code_dir`'s `hybrid_strategy` package."""
    with tempfile.TemporaryDirectory(prefix="dynamic_step_") as directory:
        spec = os.path.join(directory, "chief.json")
        # `python -m` puts the working directory first on sys.path: the package under test.
        subprocess.run([sys.executable, "-m", "hybrid_strategy.launch", "--workers",
                        str(options.workers), "--ps", str(options.ps), "--", sys.executable,
                        "-m", "benchmarks.dynamic_step", *argv, "--chief", spec],
                       check=True, env=machine.environment(code_dir), cwd=code_dir)
        with open(spec) as f:
            return json.load(f)


def main(argv=None):
    chief_runs.main(argv, parse, run_chief, run_all)


def run_all(options, argv):
    """Every version's figures, each from a cluster of its own; a table per version."""
    report = chief_runs.report_header("benchmarks.dynamic_step", argv, options.before)
    report["results"] = {}
    with chief_runs.packages(options.versions, report["before_commit"]) as code:
        for version in options.versions:
            report["results"][version] = run_version(options, argv, code[version])
            print(markdown(options, version, report["results"][version]), flush=True)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
