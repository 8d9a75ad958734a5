"""The dense all-reduce alone: summed per worker first, against one ring of every replica.

    python -m benchmarks.dense_allreduce --shapes 1x6,2x6,4x6,8x6

For every shape WxD (W workers of D CPU replicas), one cluster is started by the launcher
(`--devices-per-worker D`, no ps) with this module as its chief (`--chief`). The chief
traces two functions that all-reduce gradients of the text model's dense layers (a
64 x 256 kernel, its bias, a 256 x 1 kernel and its bias: 67,588 bytes in float32) made
on every replica: one through HybridStrategy's reduction (summed on each worker's first
device, a ring of the W sums, copied back: hybrid_strategy/communication/hierarchical_allreduce.py),
one through TensorFlow's (one RING collective over all W x D replicas, as before). It
calls them in alternating blocks, so that load from elsewhere falls on both alike, and
reports per call: the wall time (median over blocks) and the CPU time of the chief and of
every worker (/proc, over all blocks). Both must give the same sums. Results go to
benchmarks/results/dense_allreduce.json and .md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import chief_runs
from benchmarks import machine

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The text model's dense gradients (keras_examples/text_classifier.py, 64-wide table).
GRADIENT_SHAPES = ((64, 256), (256,), (256, 1), (1,))


def run_chief(options):
    """Runs as the launcher's chief: times both reductions; prints one JSON line."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    # pylint: disable=import-outside-toplevel
    # TF-private: TensorFlow's own reduction (one collective over every replica), and the
    # per-replica value type, to call both reductions on the same values.
    from tensorflow.python.distribute import mirrored_strategy
    from tensorflow.python.distribute import values as values_lib

    import hybrid_strategy

    strategy = hybrid_strategy.HybridStrategy(architecture="allreduce")
    extended = strategy.extended
    devices = extended.worker_devices

    def reduction(reduce):
        @tf.function
        def run():
            pairs = []
            for k, shape in enumerate(GRADIENT_SHAPES):
                components = []
                for r, device in enumerate(devices):
                    with tf.device(device):
                        components.append(tf.fill(shape, float(r + k)))
                value = values_lib.PerReplica(tuple(components))
                pairs.append((value, value))
            reduced = reduce(extended, tf.distribute.ReduceOp.SUM, pairs,
                             tf.distribute.experimental.CommunicationOptions())
            sums = []
            for r, device in enumerate(devices):
                with tf.device(device):
                    sums.append(tf.add_n([tf.reduce_sum(v.values[r]) for v in reduced]))
            with tf.device(devices[0]):
                return tf.stack(sums)
        return run

    ways = {"per worker first": reduction(type(extended)._batch_reduce_to),
            "one ring": reduction(mirrored_strategy.MirroredExtended._batch_reduce_to)}
    results = {name: run().numpy().tolist() for name, run in ways.items()}  # traces
    pids = dict(chief=os.getpid(), **machine.server_pids())
    timed = machine.alternate({name: lambda run=run: run().numpy() for name, run in ways.items()},
                              pids, options.calls, options.rounds)
    report = {
        "replicas": len(devices),
        "same_sums": results["per worker first"] == results["one ring"],
        "ways": {name: {
            "wall_ms_per_call": statistics.median(way["wall_s_per_call"]) * 1000,
            "wall_ms_per_block": [w * 1000 for w in way["wall_s_per_call"]],
            "cpu_ms_per_call": {task: s * 1000 for task, s in way["cpu_s_per_call"].items()},
        } for name, way in timed.items()},
    }
    print(json.dumps(report), flush=True)


def run_shape(workers, devices, options):
    argv = [sys.executable, "-m", "hybrid_strategy.launch", "--workers", str(workers),
            "--devices-per-worker", str(devices), "--ps", "0", "--",
            sys.executable, "-m", "benchmarks.dense_allreduce", "--chief",
            "--calls", str(options.calls), "--rounds", str(options.rounds)]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = machine.environment()
    print(f"[dense_allreduce] {workers}x{devices}", file=sys.stderr, flush=True)
    done = subprocess.run(argv, env=env, cwd=repo, capture_output=True, text=True,
                          timeout=options.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{workers}x{devices} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    report = json.loads(lines[-1])
    report.update(workers=workers, devices=devices,
                  loadavg=os.getloadavg()[0], command=" ".join(argv[1:]))
    return report


def markdown(runs, command):
    lines = ["# The dense all-reduce alone: per worker first, or one ring", "",
             f"Generated by `{command}`. Per call of a traced function all-reducing the "
             "text model's dense gradients (67,588 bytes) made on every replica: wall "
             "time (median of the blocks of calls, which alternate between the two ways) "
             "and CPU time of the chief and of the workers (mean and busiest) over all "
             "calls. \"per worker first\": HybridStrategy's reduction for workers with "
             "several CPU replicas (each worker sums its replicas, a ring of the W sums); "
             "\"one ring\": TensorFlow's, one RING collective over every replica. One "
             "machine with 2 cores shared with other jobs (load average after each shape "
             "given): CPU times hold better than wall times.", "",
             "| W x D | replicas | way | wall ms/call | chief CPU ms | worker CPU ms "
             "(mean; max) | all tasks CPU ms | same sums | load |",
             "|---|---:|---|---:|---:|---|---:|---|---:|"]
    for run in runs:
        for name, way in run["ways"].items():
            cpu = way["cpu_ms_per_call"]
            workers = [v for task, v in cpu.items() if task.startswith("worker")]
            lines.append(
                f"| {run['workers']} x {run['devices']} | {run['replicas']} | {name} | "
                f"{way['wall_ms_per_call']:.1f} | {cpu['chief']:.2f} | "
                f"{statistics.mean(workers):.2f}; {max(workers):.2f} | "
                f"{sum(cpu.values()):.1f} | {run['same_sums']} | {run['loadavg']:.1f} |")
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dense_allreduce",
                                     description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--shapes", default="1x6,2x6,4x6,8x6",
                        help="comma-separated WxD: W workers of D CPU replicas each")
    parser.add_argument("--calls", type=int, default=20, help="calls per block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each way")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.calls < 1 or options.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    if not options.chief:
        from benchmarks import replicas  # pylint: disable=import-outside-toplevel
        try:
            options.shape_list = [replicas.parse_shape(s) for s in options.shapes.split(",")
                                  if s.strip()]
        except ValueError as e:
            parser.error(f"--shapes: {e} is not WxD with W and D at least 1 (e.g. 8x6)")
    return options


def main(argv=None):
    return chief_runs.main(argv, parse, run_chief, run_all)


def run_all(options, argv):
    """One cluster per shape; the report."""
    command = "python -m benchmarks.dense_allreduce " + " ".join(argv)
    runs = [run_shape(workers, devices, options) for workers, devices in options.shape_list]
    with open(os.path.join(RESULTS_DIR, "dense_allreduce.json"), "w") as f:
        json.dump({"command": command, "runs": runs}, f, indent=1)
    path = os.path.join(RESULTS_DIR, "dense_allreduce.md")
    with open(path, "w") as f:
        f.write(markdown(runs, command))
    print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    sys.exit(main())
