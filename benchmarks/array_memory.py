"""Peak memory of the chief and each worker when `fit` takes numpy arrays.

    python -m benchmarks.array_memory [--sizes-mib 38 381 4096] [--versions before after]

For every size of arrays and code version ("before": the `hybrid_strategy` package of
the commit this branch forked from main, exported as benchmarks.chief_runs does;
"after": this checkout), starts 2 workers + 1 ps with `python -m hybrid_strategy.launch`
and runs this file as its chief (`--chief`). The chief makes keras_examples/criteo.py's
inputs as numpy arrays (26 int32 id columns, 13 float32 dense columns and a float32
label: 160 bytes a row) of the given size, builds criteo's model under
`HybridStrategy()`, and trains `model.fit(x, y, batch_size=512, steps_per_epoch=20,
epochs=1)`. It reports the chief's peak RSS (VmHWM) over the whole run and its growth
while `fit` ran (peak reset just before, as benchmarks.checkpoint_memory does), and
each worker's peak RSS.

Results: benchmarks/results/array_memory.json and .md. Run it on a quiet machine: the
4 GiB case holds the arrays on the chief and half of them on each worker.
"""

import argparse
import json
import os
import shlex
import sys

from benchmarks import checkpoint_memory
from benchmarks import chief_runs
from benchmarks import contenders
from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
WORKERS = 2
ROW_BYTES = 26 * 4 + 13 * 4 + 4
BATCH, STEPS = 512, 20
_RESULT_PREFIX = "array_memory result: "


def run_chief(options):
    import numpy as np  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from keras_examples import criteo  # pylint: disable=import-outside-toplevel
    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    servers = [int(p) for p in os.environ[checkpoint_memory.SERVER_PIDS_ENV].split(",")]
    pids = {"chief": os.getpid(), **{f"worker {i}": p for i, p in
                                     enumerate(servers[:WORKERS])}}
    strategy = hybrid_strategy.HybridStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = criteo.build_model()
    rows = options.size_mib * 2**20 // ROW_BYTES
    rng = np.random.default_rng(0)
    x = {name: rng.integers(0, size, rows, dtype=np.int32)
         for name, size in zip(criteo.CATEGORICAL, criteo.DEFAULT_TABLE_SIZES)}
    x["dense"] = rng.random((rows, criteo.NUM_DENSE), dtype=np.float32)
    y = (rng.random(rows) < 0.3).astype(np.float32)
    arrays_mib = (sum(a.nbytes for a in x.values()) + y.nbytes) / 2**20
    fit = checkpoint_memory.measured(
        lambda: model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS,
                          verbose=0), pids)
    result = {"arrays_mib": round(arrays_mib, 1), "rows": rows, "fit": fit,
              "peak_mib": {task: round(contenders.vm_hwm_kib(pid) / 1024, 1)
                           for task, pid in pids.items()}}
    print(_RESULT_PREFIX + json.dumps(result), flush=True)


def chief_command(size_mib):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", str(WORKERS),
            "--ps", "1", "--startup-timeout", "300", "--",
            sys.executable, "-m", "benchmarks.array_memory", "--chief",
            "--size-mib", str(size_mib)]


def measure(size_mib, version, code_dir, timeout):
    command = chief_command(size_mib)
    print(f"[array_memory {size_mib} MiB {version}] {shlex.join(command)}", file=sys.stderr,
          flush=True)
    result, error = chief_runs.run(command, code_dir, _RESULT_PREFIX, timeout)
    base = {"size_mib": size_mib, "version": version, "command": shlex.join(command)}
    if result is None:
        return dict(base, error=error)
    error = result["fit"]["error"]
    print(f"[array_memory {size_mib} MiB {version}] chief peak {result['peak_mib']['chief']} "
          f"MiB, fit +{result['fit']['peak_growth_mib']['chief']} MiB"
          + (f" ({error})" if error else ""), file=sys.stderr, flush=True)
    return dict(result, **base)


def markdown(report):
    runs = report["runs"]
    lines = [
        "# Memory of numpy input: peak RSS of the chief and the workers",
        "",
        f"`{report['invocation']}`: {WORKERS} workers + 1 ps on loopback, "
        "keras_examples/criteo.py's model, "
        f"`model.fit(x, y, batch_size={BATCH}, steps_per_epoch={STEPS})` on numpy "
        f"arrays of {ROW_BYTES} bytes a row, Keras 3. *peak* is VmHWM over the whole run "
        "(the arrays included); *fit growth* is VmHWM during fit minus RSS just before it "
        "(the arrays already made). " + chief_runs.code_description(report),
        "",
        f"Machine: {machine.summary(report['machine'])}.",
        "",
        "| arrays | code | chief peak MiB | chief fit growth MiB | growth / arrays | "
        "worker 0 peak MiB | worker 1 peak MiB | fit seconds | error |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        if "peak_mib" not in run:
            lines.append(f"| {run['size_mib']} MiB | {run['version']} | | | | | | | run "
                         f"failed: {run['error'][:160].replace('|', '/')} |")
            continue
        fit, peak = run["fit"], run["peak_mib"]
        growth = fit["peak_growth_mib"]["chief"]
        lines.append(
            f"| {run['arrays_mib']:,.0f} MiB | {run['version']} | {peak['chief']:,.0f} | "
            f"+{growth:,.0f} | {growth / run['arrays_mib']:.2f} | "
            f"{peak['worker 0']:,.0f} | {peak['worker 1']:,.0f} | {fit['seconds']:.1f} | "
            f"{(fit['error'] or '').replace('|', '/')[:160]} |")
    lines += ["", "Commands:", ""] + [f"- `{run['command']}`" for run in runs]
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[38, 381, 4096])
    chief_runs.add_arguments(parser, 3600.0, os.path.join(RESULTS, "array_memory.json"))
    parser.add_argument("--size-mib", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    chief_runs.main(argv, parse, run_chief, run_all)


def run_all(options, argv):
    """Every size and code version, each on its own cluster; the report."""
    report = chief_runs.report_header("benchmarks.array_memory", argv, options.before)
    with chief_runs.packages(options.versions, report["before_commit"]) as code_dirs:
        report["runs"] = [measure(size, version, code_dirs[version], options.timeout)
                          for size in options.sizes_mib for version in options.versions]
    text = markdown(report)
    chief_runs.save(options.json, report, text)
    print(text)


if __name__ == "__main__":
    main()
