"""Peak memory of the chief and each worker when `fit` takes numpy arrays.

    python -m benchmarks.array_memory [--sizes-mib 38 381 4096] [--versions before after]

For every size of arrays and code version ("before": the `hybrid_strategy` package of
the commit this branch forked from main, exported as benchmarks.checkpoint_memory does;
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
import subprocess
import sys
import tempfile

from benchmarks import checkpoint_memory
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
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_dir, REPO, env.get("PYTHONPATH"))
                                        if p)
    command = chief_command(size_mib)
    print(f"[array_memory {size_mib} MiB {version}] {shlex.join(command)}", file=sys.stderr,
          flush=True)
    done = subprocess.run(command, env=env, cwd=code_dir, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    base = {"size_mib": size_mib, "version": version, "command": shlex.join(command)}
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stdout.splitlines() if "Error" in line]
        return dict(base, error=(errors or done.stdout.splitlines() or ["?"])[-1][:400])
    result = json.loads(lines[-1][len(_RESULT_PREFIX):])
    error = result["fit"]["error"]
    print(f"[array_memory {size_mib} MiB {version}] chief peak {result['peak_mib']['chief']} "
          f"MiB, fit +{result['fit']['peak_growth_mib']['chief']} MiB"
          + (f" ({error})" if error else ""), file=sys.stderr, flush=True)
    return dict(result, **base)


def markdown(runs, host, code, before, invocation):
    lines = [
        "# Memory of numpy input: peak RSS of the chief and the workers",
        "",
        f"`{invocation}`: {WORKERS} workers + 1 ps on loopback, keras_examples/criteo.py's "
        f"model, `model.fit(x, y, batch_size={BATCH}, steps_per_epoch={STEPS})` on numpy "
        f"arrays of {ROW_BYTES} bytes a row, Keras 3. *peak* is VmHWM over the whole run "
        "(the arrays included); *fit growth* is VmHWM during fit minus RSS just before it "
        "(the arrays already made). before = the `hybrid_strategy` package of commit "
        f"{before}; after = commit {code['commit']}"
        + (f" with {', '.join(code['modified_files'])} modified" if code["modified_files"]
           else "") + ".",
        "",
        f"Machine: {machine.summary(host)}.",
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
    parser.add_argument("--versions", nargs="+", default=["before", "after"],
                        choices=["before", "after"])
    parser.add_argument("--before", default=None,
                        help="commit whose package is 'before' (default: merge-base with main)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", default=os.path.join(RESULTS, "array_memory.json"))
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    options = parse(argv)
    if options.chief:
        run_chief(options)
        return
    host, code = machine.describe(), machine.code_version()
    before = options.before or subprocess.run(
        ["git", "merge-base", "HEAD", "main"], cwd=REPO, check=True, text=True,
        stdout=subprocess.PIPE).stdout.strip()
    invocation = shlex.join(["python", "-m", "benchmarks.array_memory"] + argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="array_memory_") as before_dir:
        if "before" in options.versions:
            checkpoint_memory.export_package(before, before_dir)
        for size in options.sizes_mib:
            for version in options.versions:
                code_dir = before_dir if version == "before" else REPO
                runs.append(measure(size, version, code_dir, options.timeout))
    with open(options.json, "w") as f:
        json.dump({"machine": host, "code": code, "before_commit": before,
                   "invocation": invocation, "runs": runs}, f, indent=1)
    text = markdown(runs, host, code, before, invocation)
    with open(os.path.splitext(options.json)[0] + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
