"""Each worker's input CPU per step against the number of workers, and reads per record.

    python -m benchmarks.input_scaling [--workers 1 2 4 8] [--inputs files one_file in_memory]
        [--versions before after] [--records 131072] [--files 32]

The model and data are keras_examples/criteo.py's (13 dense and 26 categorical features
per record, 26 tables, global batch 512), fed three ways:

  files      32 TFRecord shards, read with list_files -> interleave -> batch ->
             parse_example (sharded by file: each worker reads its own shards);
  one_file   the same pipeline over one shard (fewer files than workers);
  in_memory  the parsed columns as numpy arrays, from_tensor_slices -> repeat -> batch
             (the way the examples fed data before per-worker input functions).

For every input, W and code version ("before": the `hybrid_strategy` package of the
commit this branch forked from main, as benchmarks.chief_runs exports it;
"after": this checkout) it starts a cluster of W workers + 1 ps with
`python -m hybrid_strategy.launch` and runs this file as its chief (`--chief`), which

1. distributes the dataset (one pass over the records, no repeat) and has every worker
   run its own dataset through at once (`reduce` on the worker, all workers in
   parallel): each worker's CPU time over that pass, divided by the global steps of a
   pass, is its input pipeline's CPU per step (tf.data's threads have no names of
   their own to tell them apart from the rest of a training step's), and the examples
   they counted add up to the records once; the bytes the workers read (rchar,
   /proc/PID/io: every read() call, files and sockets alike) are counted against the
   bytes of the files;
2. trains `--steps` steps (after `--warmup`) and reads each worker's CPU per step.

Results: benchmarks/results/input_scaling.json and .md, and input_scaling.png (input CPU
per worker per step against W; a line 1/W through W = 1 beside it). CPU time holds on a
machine shared with other programs; wall-clock examples/s does not.
"""

import argparse
import glob
import json
import os
import shlex
import sys
import tempfile
import time

from benchmarks import checkpoint_memory
from benchmarks import chief_runs
from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
INPUTS = ("files", "one_file", "in_memory")
GLOBAL_BATCH = 512
_RESULT_PREFIX = "input_scaling result: "


# Chief ------------------------------------------------------------------------------


def _read_bytes(pid):
    with open(f"/proc/{pid}/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


class Sampler:
    """Each worker's CPU seconds and bytes read since `start()`."""

    def __init__(self, pids):
        self.pids = pids
        self._cpu = self._read = None

    def start(self):
        self._cpu = [machine.cpu_seconds(p) for p in self.pids]
        self._read = [_read_bytes(p) for p in self.pids]

    def cpu(self):
        return [machine.cpu_seconds(p) - c for p, c in zip(self.pids, self._cpu)]

    def read(self):
        return [_read_bytes(p) - r for p, r in zip(self.pids, self._read)]


def _in_memory_dataset(tf, criteo, records, repeat):
    """criteo's records, parsed, as numpy arrays in a dataset (no files)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    columns = criteo.make_records(records, seed=[0, 1])
    inputs = {name: columns[name].astype(np.int32) for name in criteo.CATEGORICAL}
    inputs["dense"] = np.log1p(np.stack([columns[name] for name in criteo.DENSE], axis=1))
    dataset = tf.data.Dataset.from_tensor_slices((inputs, columns["label"].astype("float32")))
    if repeat:
        dataset = dataset.repeat()
    return dataset.batch(GLOBAL_BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def run_chief(options):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from keras_examples import criteo  # pylint: disable=import-outside-toplevel
    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    servers = [int(p) for p in os.environ[checkpoint_memory.SERVER_PIDS_ENV].split(",")]
    workers = servers[:options.num_workers]
    strategy = hybrid_strategy.HybridStrategy()
    pattern = os.path.join(options.data, "*.tfrecord")

    def dataset(repeat):
        if options.input == "in_memory":
            return _in_memory_dataset(tf, criteo, options.records, repeat)
        return criteo.make_dataset(pattern, GLOBAL_BATCH, repeat=repeat)

    distributed = strategy.experimental_distribute_dataset(dataset(repeat=False))
    # TF-private: each worker's own dataset, as TensorFlow's distribution made it
    # (`_cloned_datasets`) or as HybridStrategy did (`_datasets`, one per worker), and
    # the device of each worker's input (MirroredExtended's, in every code version).
    per_worker = getattr(distributed, "_datasets", None) or distributed._cloned_datasets
    hosts = [host for host, _ in strategy.extended._input_workers_devices]
    sampler = Sampler(workers)
    sampler.start()
    started = time.perf_counter()
    counts = []
    for host, each in zip(hosts, per_worker):
        with tf.device(host):   # every worker runs its whole pass at once, in parallel
            counts.append(each.reduce(tf.constant(0, tf.int64), lambda n, batch: n + tf.shape(
                batch[1], out_type=tf.int64)[0]))
    examples = sum(int(count) for count in counts)
    input_seconds = time.perf_counter() - started
    input_cpu, read = sampler.cpu(), sampler.read()
    steps = options.records // GLOBAL_BATCH
    file_bytes = (0 if options.input == "in_memory"
                  else sum(os.path.getsize(p) for p in glob.glob(pattern)))
    result = {
        "input": options.input, "workers": options.num_workers, "steps": steps,
        "examples": examples, "records": options.records,
        "input_cpu_ms_per_step": [1000 * c / steps for c in input_cpu],
        "input_steps_per_s": steps / input_seconds,
        "file_bytes": file_bytes,
        "reads_per_record": sum(read) / file_bytes if file_bytes else None,
    }

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = criteo.build_model()
    sampler = Sampler(workers)

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == options.warmup - 1:
                sampler.start()
                self.started = time.perf_counter()
            elif batch == options.warmup + options.steps - 1:
                self.seconds = time.perf_counter() - self.started
                self.cpu = sampler.cpu()

    timer = Timer()
    model.fit(dataset(repeat=True), epochs=1, steps_per_epoch=options.warmup + options.steps,
              callbacks=[timer], verbose=0)
    result["train_cpu_ms_per_step"] = [1000 * c / options.steps for c in timer.cpu]
    result["train_examples_per_s"] = options.steps * GLOBAL_BATCH / timer.seconds
    print(_RESULT_PREFIX + json.dumps(result), flush=True)


# Driver -----------------------------------------------------------------------------


def write_data(directory, records, files):
    """The shards of the `files` and `one_file` inputs (criteo.write_files)."""
    from keras_examples import criteo  # pylint: disable=import-outside-toplevel
    paths = {"files": os.path.join(directory, "files"),
             "one_file": os.path.join(directory, "one_file")}
    for name, shards in (("files", files), ("one_file", 1)):
        if not glob.glob(os.path.join(paths[name], "*.tfrecord")):
            print(f"[input_scaling] writing {records} records in {shards} shard(s) to "
                  f"{paths[name]}", file=sys.stderr, flush=True)
            criteo.write_files(paths[name], shards, records // shards)
    return paths


def chief_command(options, kind, workers, data):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", str(workers),
            "--ps", "1", "--startup-timeout", "300", "--",
            sys.executable, "-m", "benchmarks.input_scaling", "--chief", "--input", kind,
            "--num-workers", str(workers), "--data", data, "--records", str(options.records),
            "--steps", str(options.steps), "--warmup", str(options.warmup)]


def measure(options, kind, workers, version, code_dir, data):
    shown = shlex.join(chief_command(options, kind, workers, "DATA"))
    print(f"[input_scaling {kind} W={workers} {version}] {shown}", file=sys.stderr,
          flush=True)
    result, error = chief_runs.run(chief_command(options, kind, workers, data), code_dir,
                                   _RESULT_PREFIX, options.timeout)
    base = {"input": kind, "workers": workers, "version": version, "command": shown}
    if result is None:
        return dict(base, error=error)
    result.update(base, loadavg_after=list(os.getloadavg()))
    print(f"[input_scaling {kind} W={workers} {version}] input CPU ms/step per worker "
          f"{[round(c, 2) for c in result['input_cpu_ms_per_step']]}, reads per record "
          f"{result['reads_per_record']}", file=sys.stderr, flush=True)
    return result


def _mean(values):
    return sum(values) / len(values) if values else None


def markdown(report):
    runs = report["runs"]
    lines = [
        "# Input CPU per worker against the number of workers",
        "",
        f"`{report['invocation']}`: W workers + 1 ps on loopback, keras_examples/criteo.py's "
        "model and "
        f"records (global batch {GLOBAL_BATCH}), Keras 3. *input CPU* is each worker's "
        "CPU time while it runs its own share of the distributed dataset through (one "
        "pass over the records, every worker at once), per global step of the pass; "
        "*examples* is what they counted in all; *train CPU* is each worker's CPU time "
        "per training step; "
        "*reads per record* is the bytes the workers read (rchar) over that pass, divided "
        "by the bytes of the files. " + chief_runs.code_description(report),
        "",
        f"Machine: {machine.summary(report['machine'])}.",
        "",
        "| input | code | W | input CPU ms/step per worker (mean; each) | x W | examples "
        "| reads per record | train CPU ms/step per worker (mean) | train examples/s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['input']} | {run['version']} | {run['workers']} | failed: "
                         f"{run['error'][:160].replace('|', '/')} | | | | | |")
            continue
        each = ", ".join(f"{c:.2f}" for c in run["input_cpu_ms_per_step"])
        mean = _mean(run["input_cpu_ms_per_step"])
        reads = run["reads_per_record"]
        lines.append(
            f"| {run['input']} | {run['version']} | {run['workers']} | {mean:.2f} ({each}) | "
            f"{mean * run['workers']:.2f} | {run['examples']:,} | "
            f"{'n/a' if reads is None else f'{reads:.2f}'} | "
            f"{_mean(run['train_cpu_ms_per_step']):.2f} | "
            f"{run['train_examples_per_s']:,.0f} |")
    lines += ["", "*x W*: the mean input CPU per worker times W, constant where each worker's "
              "input CPU falls as 1/W. Commands (DATA: the shards' directory, written by "
              "`criteo.write_files`):", ""]
    lines += [f"- `{run['command']}`" for run in runs]
    return "\n".join(lines) + "\n"


def plot(runs, path):
    """Input CPU per worker per step against W, log-log, each input and code version."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for (kind, version) in sorted({(r["input"], r["version"]) for r in runs}):
        points = sorted((r["workers"], _mean(r["input_cpu_ms_per_step"])) for r in runs
                        if r["input"] == kind and r["version"] == version and "error" not in r)
        if not points:
            continue
        xs, ys = zip(*points)
        axes.plot(xs, ys, marker="o", linestyle="-" if version == "after" else "--",
                  label=f"{kind} ({version})")
        if version == "after" and xs[0] == 1:
            axes.plot(xs, [ys[0] / x for x in xs], color="grey", linewidth=0.8,
                      linestyle=":")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("workers W")
    axes.set_ylabel("input CPU ms per step, per worker")
    axes.set_title("Each worker's input pipeline CPU per step (dotted: 1/W)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--inputs", nargs="+", default=list(INPUTS), choices=INPUTS)
    parser.add_argument("--records", type=int, default=131072)
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data-dir", help="where the shards are written (default: a "
                                           "temporary directory)")
    chief_runs.add_arguments(parser, 1800.0, os.path.join(RESULTS, "input_scaling.json"))
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--num-workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    chief_runs.main(argv, parse, run_chief, run_all)


def run_all(options, argv):
    """Every input, code version and W, each on its own cluster; the report and plot."""
    report = chief_runs.report_header("benchmarks.input_scaling", argv, options.before)
    with tempfile.TemporaryDirectory(prefix="input_scaling_") as scratch, \
            chief_runs.packages(options.versions, report["before_commit"]) as code_dirs:
        paths = write_data(options.data_dir or scratch, options.records, options.files)
        paths["in_memory"] = paths["files"]  # not read: the records are made in memory
        report["runs"] = [
            measure(options, kind, workers, version, code_dirs[version], paths[kind])
            for kind in options.inputs for version in options.versions
            for workers in options.workers]
    stem = os.path.splitext(options.json)[0]
    plot(report["runs"], stem + ".png")
    text = markdown(report) + f"\n![input CPU per worker against W]({os.path.basename(stem)}.png)\n"
    chief_runs.save(options.json, report, text)
    print(text)


if __name__ == "__main__":
    main()
