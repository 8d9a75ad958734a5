"""A training step's time against the table's size, under float32, mixed_float16 and mixed_bfloat16.

    python -m benchmarks.mixed_precision_cost [--rows 200000,2000000,8000000] [--cluster]

For every policy and table size, a fresh process sets the Keras 3 global policy and
trains, under HybridStrategy with 2 replicas (2 logical CPU devices of this process,
`HybridStrategy(devices=...)`; or, with `--cluster`, as the chief of a local cluster
of 2 workers + 1 ps started by `python -m hybrid_strategy.launch`),

    keras.Input((8,), int32) -> Embedding(rows, 32) -> GlobalAveragePooling1D -> Dense(1)

with MSE, Adagrad and a global batch of 64 (`steps_per_execution=1`). The table is a
PS table (its gradient row-sparse), ids are uniform over it (numpy, seed 0, a pool of
16 batches that `tf.data` repeats), so a step touches about as many rows whatever the
table's size. Under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer.
`model.fit` runs `--warmup` steps (the first one traces), then `--steps` measured ones,
timed by a Keras callback (`time.perf_counter()` on `on_train_batch_begin` and
`on_train_batch_end`, after the step's loss is a Python number).

The check, per policy: the median step time at the largest table over that at the
smallest must be <= 1.3 (a step does not cost the table). It prints PASS or FAIL per
policy, the figures, the machine and the commands, and writes
benchmarks/results/mixed_precision_cost.md and .json (`--name` changes the stem).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
DIM, SEQUENCE, BATCH, POOL_BATCHES = 32, 8, 64, 16
TARGET_RATIO = 1.3
TABLE = "embedding/embeddings"


# One run: one policy and table size, in this process -------------------------------


def run_one(options):
    started = time.perf_counter()
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if not options.cluster:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras  # pylint: disable=import-outside-toplevel

    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    keras.mixed_precision.set_global_policy(options.policy)
    # Before any variable: on a cluster it connects this process to the other tasks.
    strategy = (hybrid_strategy.HybridStrategy() if options.cluster
                else hybrid_strategy.HybridStrategy(devices=["/cpu:0", "/cpu:1"]))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, options.rows, size=(BATCH * POOL_BATCHES, SEQUENCE)).astype(np.int32)
    labels = rng.normal(size=(BATCH * POOL_BATCHES, 1)).astype(np.float32)
    dataset = (tf.data.Dataset.from_tensor_slices((ids, labels))
               .batch(BATCH, drop_remainder=True).repeat())
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((SEQUENCE,), dtype="int32"),
            keras.layers.Embedding(options.rows, DIM, name="embedding"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse",
                      steps_per_execution=1)
    timer = step_timer(keras)
    model.fit(dataset, epochs=1, steps_per_epoch=options.warmup + options.steps, verbose=0,
              callbacks=[timer])
    measured = timer.durations[options.warmup:]
    table_path = next(path for path in strategy.gradient_types if path.endswith(TABLE))
    return {
        "policy": options.policy, "rows": options.rows,
        "table_mib": options.rows * DIM * 4 / 2 ** 20,
        "optimizer": type(model.optimizer).__name__,
        "table_placement": next(r.placement.kind for r in strategy.placement
                                if r.path == table_path),
        "table_gradient": strategy.gradient_types[table_path],
        "median_step_ms": 1000 * statistics.median(measured),
        "p10_step_ms": 1000 * _quantile(measured, 0.1),
        "p90_step_ms": 1000 * _quantile(measured, 0.9),
        "first_step_s": timer.durations[0],
        "run_s": time.perf_counter() - started,
    }


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_timer(keras):
    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.durations = []
            self._begin = None

        def on_train_batch_begin(self, batch, logs=None):
            self._begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # the step has finished once its loss is a number
            self.durations.append(time.perf_counter() - self._begin)

    return StepTimer()


# Driver -------------------------------------------------------------------------


def run_argv(options, policy, rows, result_file):
    # By path, not `-m`: `-m` puts the working directory first on sys.path, ahead of
    # `--code-dir`'s package.
    argv = [sys.executable, os.path.abspath(__file__), "--run",
            "--policies", policy, "--rows", str(rows), "--steps", str(options.steps),
            "--warmup", str(options.warmup), "--result-file", result_file]
    if options.cluster:
        argv = ([sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps",
                 "1", "--"] + argv + ["--cluster"])
    return argv


def measure(options, policy, rows):
    label = f"{policy}, {rows:,} rows"
    with tempfile.TemporaryDirectory(prefix="mixed_precision_cost_") as tmp:
        result_file = os.path.join(tmp, "result.json")
        shown = shlex.join(run_argv(options, policy, rows, "RESULT.json"))
        print(f"[{label}] {shown}", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(run_argv(options, policy, rows, result_file),
                                  env=machine.environment(options.code_dir), cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=options.timeout)
            output, code = done.stdout, done.returncode
        except subprocess.TimeoutExpired as e:
            output, code = f"{e.stdout or ''}\n(timed out after {options.timeout:.0f} s)", None
        result = None
        if code == 0 and os.path.exists(result_file):
            with open(result_file) as f:
                result = json.load(f)
    if result is None:
        tail = "\n".join(output.rstrip().splitlines()[-30:])
        print(f"[{label}] failed (exit {code}):\n{tail}", file=sys.stderr, flush=True)
        return {"policy": policy, "rows": rows, "command": shown, "error": tail}
    result["command"] = shown
    print(f"[{label}] median {result['median_step_ms']:.1f} ms "
          f"(p10-p90 {result['p10_step_ms']:.1f}-{result['p90_step_ms']:.1f})",
          file=sys.stderr, flush=True)
    return result


def _commit(directory):
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, check=False)
    return done.stdout.strip() or None


def checks(results, options):
    verdicts = []
    for policy in options.policy_list:
        runs = [r for r in results if r["policy"] == policy]
        entry = {"policy": policy, "target": TARGET_RATIO, "ratio": None}
        if any("error" in r for r in runs):
            entry.update(verdict="FAIL", why="a run failed")
        elif len(runs) < 2:
            entry.update(verdict="n/a", why="fewer than two table sizes")
        else:
            small = min(runs, key=lambda r: r["rows"])
            large = max(runs, key=lambda r: r["rows"])
            ratio = large["median_step_ms"] / small["median_step_ms"]
            entry.update(ratio=ratio, verdict="PASS" if ratio <= TARGET_RATIO else "FAIL",
                         why=f"{large['median_step_ms']:.1f} ms at {large['rows']:,} rows / "
                             f"{small['median_step_ms']:.1f} ms at {small['rows']:,} rows")
        verdicts.append(entry)
    return verdicts


def table(results, options):
    lines = ["| rows | table MiB | " + " | ".join(
        f"{p} ms/step (p10-p90)" for p in options.policy_list) + " |",
             "|---:|---:|" + "---:|" * len(options.policy_list)]
    for rows in options.rows_list:
        cells = [f"{rows:,}", f"{rows * DIM * 4 / 2 ** 20:,.0f}"]
        for policy in options.policy_list:
            r = next(r for r in results if r["policy"] == policy and r["rows"] == rows)
            cells.append("failed" if "error" in r else
                         f"{r['median_step_ms']:.1f} ({r['p10_step_ms']:.1f}-"
                         f"{r['p90_step_ms']:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results, verdicts, host, code, options, invocation):
    where = ("the chief of a local cluster of 2 workers + 1 ps (loopback)" if options.cluster
             else "2 replicas on 2 logical CPU devices of one process")
    lines = [f"Embedding(rows, {DIM}) on a PS, mean-pooled, Dense(1); MSE, Adagrad, global "
             f"batch {BATCH}, {SEQUENCE} uniform ids per example; HybridStrategy with {where}; "
             f"median (p10-p90) of {options.steps} steps after {options.warmup} warm-up "
             "steps, each policy and size in a fresh process.", "",
             table(results, options), ""]
    for r in results:
        if "error" not in r:
            lines.append(f"- {r['policy']}, {r['rows']:,} rows: optimizer {r['optimizer']}, "
                         f"table {r['table_placement']}, gradient {r['table_gradient']}")
    lines.append("")
    for v in verdicts:
        ratio = f"{v['ratio']:.2f}" if v["ratio"] is not None else "n/a"
        lines.append(f"- {v['policy']}: largest/smallest table median step time = {ratio} "
                     f"(target <= {v['target']}): **{v['verdict']}** ({v['why']})")
    lines += ["", f"machine: {machine.summary(host)}",
              f"code: {code}", f"command: `{invocation}`",
              "per run (RESULT.json is a temporary file):"]
    lines += [f"    {r['command']}" for r in results]
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mixed_precision_cost",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", default="200000,2000000,8000000",
                        help="comma-separated table sizes (default %(default)s)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated Keras policies (default %(default)s)")
    parser.add_argument("--steps", type=int, default=50, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5,
                        help="steps before measuring; the first traces (default %(default)s)")
    parser.add_argument("--cluster", action="store_true",
                        help="run each as the chief of a local cluster of 2 workers + 1 ps")
    parser.add_argument("--code-dir", default=machine.REPO,
                        help="checkout whose hybrid_strategy package runs (default this one)")
    parser.add_argument("--name", default="mixed_precision_cost",
                        help="stem of the results files in benchmarks/results/")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before one run is abandoned (default %(default)s)")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    try:
        options.rows_list = [int(r.replace("_", "")) for r in options.rows.split(",") if r]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {options.rows!r}")
    options.policy_list = [p.strip() for p in options.policies.split(",") if p.strip()]
    if not options.rows_list or min(options.rows_list) < 1:
        parser.error("--rows needs at least one positive size")
    if options.steps < 1 or options.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step traces)")
    if options.run:
        if len(options.rows_list) != 1 or len(options.policy_list) != 1:
            parser.error("--run takes one table size and one policy")
        options.rows, options.policy = options.rows_list[0], options.policy_list[0]
    return options


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    options = parse(argv)
    if options.run:
        result = run_one(options)
        with open(options.result_file, "w") as f:
            json.dump(result, f)
        return 0
    invocation = shlex.join(["python", "-m", "benchmarks.mixed_precision_cost"] + argv)
    host = machine.describe()  # the load average before our own runs add to it
    code = machine.code_version()
    if os.path.realpath(options.code_dir) != os.path.realpath(REPO):
        code["package_commit"] = _commit(options.code_dir)
    results = [measure(options, policy, rows)
               for policy in options.policy_list for rows in options.rows_list]
    verdicts = checks(results, options)
    text = report(results, verdicts, host, code, options, invocation)
    print("\n" + text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, options.name + ".md"), "w") as f:
        f.write(f"# Mixed precision: step time against table size\n\n{text}\n")
    with open(os.path.join(RESULTS, options.name + ".json"), "w") as f:
        json.dump({"machine": host, "code": code, "command": invocation,
                   "checks": verdicts, "results": results}, f, indent=2)
        f.write("\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
