"""Peak memory of the chief and each ps while saving and restoring a large PS table.

    python -m benchmarks.checkpoint_memory [--sizes-mib 256 1024] [--apis ...] [--before COMMIT]

For every table size and code version ("before": the `hybrid_strategy` package of
COMMIT, default the commit this branch forked from main, exported with `git archive`
into a temporary directory; "after": this checkout), starts a cluster of 1 worker +
2 ps with `python -m hybrid_strategy.launch` and runs this file as its chief
(`--chief`). The chief builds, under `HybridStrategy()`,

    keras.Input((1,), int32) -> Embedding(rows, 64, float32) -> Flatten -> Dense(1)

with rows = size / 256 bytes (the table is dealt over both ps), compiles it with
Keras 3 Adagrad and builds the optimizer (one table-sized slot: table + slot = twice
the size). After one round through every operation with a small table (so that
what loads once per process is not counted), it saves and restores, in turn, with
`tf.train.Checkpoint(model=, optimizer=)` (`write`, then `read`), Keras
`save_weights` / `load_weights` (`.weights.h5`) and `model.save` /
`keras.models.load_model` (`.keras`, which builds a second model: the ps then hold
the table twice; `--apis` chooses), measuring every process: just before an operation it resets
the peak RSS of the chief, the worker and both ps (writing 5 to /proc/PID/clear_refs
resets VmHWM to the current RSS) and reads their RSS; just after, VmHWM - RSS before
is the operation's peak growth. An operation that fails is recorded with its error.

Results: benchmarks/results/checkpoint_memory-<sizes>MiB.json and .md (the machine,
the code version, the commands). On one machine every task shares its
memory: run the 1 GiB case when the machine is otherwise quiet.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from benchmarks import chief_runs
from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DIM = 64
ROW_BYTES = DIM * 4
SERVER_PIDS_ENV = "HYBRID_STRATEGY_SERVER_PIDS"  # workers, then ps, in task order
TASKS = ("chief", "worker 0", "ps 0", "ps 1")
APIS = {"checkpoint": "tf.train.Checkpoint", "weights_h5": "save_weights (.weights.h5)",
        "keras": "model.save (.keras)"}
_RESULT_PREFIX = "checkpoint_memory result: "


# Chief: save and restore once per API on the cluster the launcher started ---------


def _status(pid):
    """VmHWM and VmRSS of a process in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) / 1024.0
    return fields


def _reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def measured(operation, pids):
    """Runs `operation()`; returns its seconds, error and each task's peak RSS growth."""
    for pid in pids.values():
        _reset_peak(pid)
    before = {task: _status(pid)["VmRSS"] for task, pid in pids.items()}
    start = time.perf_counter()
    error = None
    try:
        operation()
    except Exception as e:  # pylint: disable=broad-except
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
    seconds = time.perf_counter() - start
    peak = {task: _status(pid)["VmHWM"] for task, pid in pids.items()}
    return {"seconds": round(seconds, 2), "error": error,
            "rss_before_mib": {t: round(v, 1) for t, v in before.items()},
            "peak_growth_mib": {t: round(peak[t] - before[t], 1) for t in pids}}


def run_chief(options):
    import tensorflow as tf
    import keras
    import hybrid_strategy

    servers = [int(p) for p in os.environ[SERVER_PIDS_ENV].split(",")]
    pids = dict(zip(TASKS, [os.getpid()] + servers))
    rows = options.size_mib * 2**20 // ROW_BYTES
    strategy = hybrid_strategy.HybridStrategy()

    def build(rows):
        with strategy.scope():
            model = keras.Sequential([
                keras.Input(shape=(1,), dtype="int32"),
                keras.layers.Embedding(rows, DIM, name="table"),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ])
            model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
            model.optimizer.build(model.trainable_variables)
        return model

    def operations(model, directory):
        os.makedirs(directory, exist_ok=True)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        prefix = os.path.join(directory, "ckpt")
        weights = os.path.join(directory, "model.weights.h5")
        whole = os.path.join(directory, "model.keras")

        def load_model():
            with strategy.scope():
                keras.models.load_model(whole)

        ops = {
            "checkpoint": (lambda: checkpoint.write(prefix), lambda: checkpoint.read(prefix)),
            "weights_h5": (lambda: model.save_weights(weights),
                           lambda: model.load_weights(weights)),
            "keras": (lambda: model.save(whole), load_model),
        }
        return {api: ops[api] for api in options.apis}

    # A small table first, through every operation: what loads once per process
    # (h5py, Keras' saving code, TensorFlow's checkpoint functions) is not counted.
    warm_up = operations(build(8192), os.path.join(options.directory, "warm-up"))
    for save, restore in warm_up.values():
        measured(save, pids)
        measured(restore, pids)
    model = build(rows)
    table = model.get_layer("table").embeddings
    shards = getattr(getattr(table, "_value", None), "num_shards", None)
    result = {"rows": rows, "table_mib": options.size_mib, "table_shards": shards,
              "rss_after_build_mib": {t: round(_status(p)["VmRSS"], 1) for t, p in pids.items()}}
    for api, (save, restore) in operations(model, os.path.join(options.directory, "table")).items():
        result[APIS[api]] = {"save": measured(save, pids), "restore": measured(restore, pids)}
    print(_RESULT_PREFIX + json.dumps(result), flush=True)


# Driver -----------------------------------------------------------------------------


def chief_command(size_mib, directory, apis):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "1", "--ps", "2",
            "--startup-timeout", "180", "--",
            sys.executable, "-m", "benchmarks.checkpoint_memory", "--chief",
            "--size-mib", str(size_mib), "--directory", directory, "--apis", *apis]


def measure(size_mib, version, code_dir, apis, timeout, attempts=2):
    """One run; a cluster that fails to start (a loaded machine) gets another attempt."""
    for _ in range(attempts):
        result = _measure_once(size_mib, version, code_dir, apis, timeout)
        if "error" not in result or not any(
                sign in result["error"] for sign in ("did not start", "TaskUnreachableError")):
            return result
    return result


def _measure_once(size_mib, version, code_dir, apis, timeout):
    env = machine.environment(code_dir)
    with tempfile.TemporaryDirectory(prefix="checkpoint_memory_") as directory:
        command = chief_command(size_mib, directory, apis)
        shown = shlex.join(chief_command(size_mib, "DIR", apis))
        print(f"[{size_mib} MiB, {version}] {shown}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        # `python -m` puts the working directory first on sys.path: the package under test.
        done = subprocess.run(command, env=env, cwd=code_dir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stdout.rstrip().splitlines()[-30:])
        print(f"[{size_mib} MiB, {version}] failed (exit {done.returncode}):\n{tail}",
              file=sys.stderr, flush=True)
        return {"table_mib": size_mib, "version": version, "command": shown, "error": tail}
    result = json.loads(lines[-1][len(_RESULT_PREFIX):])
    result.update(version=version, command=shown, wall_s=round(time.perf_counter() - start, 1),
                  loadavg_after=list(os.getloadavg()))
    print(f"[{size_mib} MiB, {version}] " + "; ".join(
        f"{api} {op}: chief +{result[api][op]['peak_growth_mib']['chief']:.0f} MiB"
        + (f" ({result[api][op]['error']})" if result[api][op]["error"] else "")
        for api in APIS.values() if api in result
        for op in ("save", "restore")), file=sys.stderr, flush=True)
    return result


def markdown(runs, host, code, before, invocation):
    lines = [
        "# Checkpoint memory: peak RSS growth while saving and restoring a PS table",
        "",
        f"`{invocation}`: 1 worker + 2 ps on loopback; Embedding(rows, 64) float32 dealt over "
        "both ps, Keras 3 Adagrad (one table-sized slot), Keras 3; growth = VmHWM after the "
        "operation - RSS before it (peak reset through /proc/PID/clear_refs). before = the "
        f"`hybrid_strategy` package of commit {before}; after = commit {code['commit']}"
        + (f" with {', '.join(code['modified_files'])} modified" if code["modified_files"] else "")
        + ".",
        "",
        f"Machine: {machine.summary(host)}.",
        "",
        "| table | code | API | operation | seconds | chief MiB | worker MiB | ps 0 MiB "
        "| ps 1 MiB | error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['table_mib']} MiB | {run['version']} | | | | | | | | "
                         f"run failed: {run['error'].splitlines()[-1][:120]} |")
            continue
        for api in (a for a in APIS.values() if a in run):
            for op in ("save", "restore"):
                m = run[api][op]
                growth = m["peak_growth_mib"]
                lines.append(
                    f"| {run['table_mib']} MiB | {run['version']} | {api} | {op} | "
                    f"{m['seconds']:.1f} | " + " | ".join(f"+{growth[t]:,.0f}" for t in TASKS)
                    + f" | {(m['error'] or '').replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024],
                        help="table sizes in MiB (the slot doubles what the ps hold)")
    parser.add_argument("--versions", nargs="+", default=["before", "after"],
                        choices=["before", "after"])
    parser.add_argument("--before", default=None,
                        help="commit whose package is 'before' (default: merge-base with main)")
    parser.add_argument("--apis", nargs="+", default=list(APIS), choices=list(APIS),
                        help="checkpoint: tf.train.Checkpoint write/read; weights_h5: "
                             "save_weights/load_weights; keras: model.save/load_model (a "
                             "second model: the ps hold the table twice)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", help="default: results/checkpoint_memory-<sizes>MiB.json")
    parser.add_argument("--markdown", help="default: results/checkpoint_memory-<sizes>MiB.md")
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    chief_runs.main(argv, parse, run_chief, run_all)


def run_all(options, argv):
    """Every size and version, each on a cluster of its own; the report."""
    sizes = "-".join(map(str, options.sizes_mib))
    stem = os.path.join(RESULTS, f"checkpoint_memory-{sizes}MiB")
    options.json = options.json or stem + ".json"
    options.markdown = options.markdown or stem + ".md"
    report = chief_runs.report_header("benchmarks.checkpoint_memory", argv, options.before)
    report["runs"] = []
    with chief_runs.packages(options.versions, report["before_commit"]) as code:
        for size in options.sizes_mib:
            for version in options.versions:
                report["runs"].append(measure(size, version, code[version], options.apis,
                                              options.timeout))
    text = markdown(report["runs"], report["machine"], report["code"],
                    report["before_commit"], report["invocation"])
    with open(options.json, "w") as f:
        json.dump(report, f, indent=1)
    with open(options.markdown, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
