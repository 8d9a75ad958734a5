"""PS step time and memory per task as the embedding table grows, in one run.

    python -m benchmarks.table_scaling [--json results.json]

For every table size (default 100k, 1M and 4M rows x 64 float32), optimizer
(default Keras 3 SGD and Adagrad; `--optimizers` also takes adam, adamw, ftrl and
lamb) and Keras mixed-precision policy (default float32; `--policies` also takes
mixed_float16, where Keras wraps the optimizer in a LossScaleOptimizer, and
mixed_bfloat16), starts a local cluster of 2 workers + 2 ps with
`python -m hybrid_strategy.launch` and runs this file as its chief
(`python -m benchmarks.table_scaling --chief ...`), one cluster per run. The chief
trains, under `HybridStrategy()`,

    keras.Input((20,), int32) -> Embedding(rows, 64) -> GlobalAveragePooling1D
        -> Dense(64, relu) -> Dense(1)

with MSE on a global batch of 512 and `steps_per_execution=1`. The table is placed
by HybridStrategy's defaults: split by rows over the ps tasks in shards of at least
1 MiB, so every default size is split over both ps (the shard count is printed; with
`--ps 1` the table stays in one shard, which results/table_scaling.md shows to be
read whole every step). Ids are drawn uniformly over the whole table (or Zipf,
`--distribution zipf`) with numpy once (seed 0, a pool of `--pool-batches` batches
that a `tf.data.Dataset` repeats), so each step touches about as many distinct rows
whatever the table size (the figure is printed). `model.fit` runs `--warmup` steps (the first one traces) and then
`--steps` measured ones; a Keras callback takes time.perf_counter() on
`on_train_batch_begin` and `on_train_batch_end` (Keras has turned the step's logs
into Python numbers by then, so the step has finished). Reported: the median step
time, steps/s over the measured steps' wall time, and the peak RSS (VmHWM from
/proc/<pid>/status) of every task after the measured steps: worker 0, worker 1,
ps 0, ps 1 and the chief.

The check: per optimizer and policy, the largest median step time over the smallest
must be <= 1.3 (step time does not grow with the table). `--before COMMIT` runs that
commit's `hybrid_strategy` package (the one before a change, say) with this file. `--local-replicas N`
runs each case in one process instead, with no cluster: HybridStrategy replicates over
N logical CPU devices of that process and keeps the table on its CPU. It prints PASS or FAIL with the
figures, the machine (nproc, CPU model, load average before the runs) and the exact
commands. On loopback every task shares this machine's cores, so the step times
are the per-step cost of the strategy here, not the speed of a real network.
"""

import argparse
import faulthandler
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from benchmarks import chief_runs
from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM = 64
SEQUENCE = 20
TARGET_RATIO = 1.3
OPTIMIZERS = ("sgd", "adagrad")  # run by default
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# Keras 3 optimizers a run may use (lazy updates): class name, table-sized slots.
CHOICES = {"sgd": ("SGD", 0), "adagrad": ("Adagrad", 1), "adam": ("Adam", 2),
           "adamw": ("AdamW", 2), "ftrl": ("Ftrl", 2), "lamb": ("Lamb", 2)}
# HYBRID_STRATEGY_SERVER_PIDS lists the servers in task order: workers, then ps.
SERVER_PIDS_ENV = "HYBRID_STRATEGY_SERVER_PIDS"
_RESULT_PREFIX = "table_scaling result: "


# Shared -----------------------------------------------------------------------


def proc_status(pid="self"):
    """VmHWM and VmRSS of a process, in MiB (None if it is gone)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    fields[key] = int(value.split()[0]) / 1024.0  # kB -> MiB
    except OSError:
        return None
    return fields


# Chief: one (rows, optimizer) run on the cluster the launcher started -------------


def make_ids(rows, examples, distribution, seed):
    """int32 ids of shape (examples, SEQUENCE) over [0, rows)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        return rng.integers(0, rows, size=(examples, SEQUENCE), dtype=np.int64).astype(
            np.int32)
    # Zipf with exponent 1.1 over the ranks, ranks shuffled over the table.
    ranks = rng.zipf(1.1, size=(examples, SEQUENCE)) - 1
    ranks = ranks[ranks < rows]
    while ranks.size < examples * SEQUENCE:
        more = rng.zipf(1.1, size=examples * SEQUENCE) - 1
        ranks = np.concatenate([ranks, more[more < rows]])
    ranks = ranks[:examples * SEQUENCE].reshape(examples, SEQUENCE)
    permutation = rng.permutation(rows)
    return permutation[ranks].astype(np.int32)


def run_chief(options):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if options.hang_seconds:
        # A run that hangs prints where (every thread's stack) before the driver kills it.
        faulthandler.dump_traceback_later(options.hang_seconds, exit=True)
    started = time.perf_counter()
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel

    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    devices = None
    if options.local_replicas:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * options.local_replicas)
        devices = [f"/cpu:{i}" for i in range(options.local_replicas)]
    pids = [int(p) for p in os.environ.get(SERVER_PIDS_ENV, "").split(",") if p]
    if devices is None and len(pids) != options.workers + options.ps:
        raise SystemExit(f"{SERVER_PIDS_ENV}={os.environ.get(SERVER_PIDS_ENV)!r} does not "
                         f"list {options.workers} workers + {options.ps} ps; run this "
                         "under python -m hybrid_strategy.launch.")
    tasks = _tasks(options)[:-1]

    def memory():
        out = {task: proc_status(pid) for task, pid in zip(tasks, pids)}
        out["chief"] = proc_status()
        return out

    keras.mixed_precision.set_global_policy(options.policy)
    # The strategy first: it connects this process to the cluster.
    strategy = hybrid_strategy.HybridStrategy(devices=devices)
    memory_connected = memory()

    batch = options.batch_size
    examples = batch * options.pool_batches
    ids = make_ids(options.rows, examples, options.distribution, seed=0)
    labels = np.random.default_rng(1).normal(size=(examples, 1)).astype(np.float32)
    distinct = [len(np.unique(ids[i * batch:(i + 1) * batch]))
                for i in range(options.pool_batches)]
    dataset = (tf.data.Dataset.from_tensor_slices((ids, labels))
               .batch(batch, drop_remainder=True).repeat())

    build_start = time.perf_counter()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((SEQUENCE,), dtype="int32"),
            keras.layers.Embedding(options.rows, DIM, name="embedding"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ])
        optimizer = getattr(keras.optimizers, CHOICES[options.optimizer][0])(
            learning_rate=0.01)
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=1)
    build_seconds = time.perf_counter() - build_start
    memory_built = memory()

    timer = step_timer(keras)
    fit_start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=options.warmup + options.steps,
              verbose=0, callbacks=[timer])
    fit_seconds = time.perf_counter() - fit_start
    memory_trained = memory()

    measured = timer.durations[options.warmup:]
    begins = timer.begins[options.warmup:]
    ends = timer.ends[options.warmup:]
    wall = ends[-1] - begins[0]
    result = {
        "rows": options.rows, "dim": DIM, "optimizer": options.optimizer,
        "policy": options.policy, "optimizer_class": type(model.optimizer).__name__,
        "gradient_type": next((kind for path, kind in strategy.gradient_types.items()
                               if path.endswith("embedding/embeddings")), None),
        "distribution": options.distribution, "batch_size": batch,
        "warmup": options.warmup, "steps": len(measured),
        "table_mib": options.rows * DIM * 4 / 2 ** 20,
        "shards": len(next(r for r in strategy.placement
                           if r.path.endswith("embedding/embeddings")).placement.shards),
        # What each ps must hold: its rows of the table, and as many of every slot.
        "table_and_slots_mib_per_ps": [
            nbytes * (1 + CHOICES[options.optimizer][1]) / 2 ** 20
            for nbytes in strategy.placement.bytes_per_ps_task(max(options.ps, 1))],
        "distinct_ids_per_step": statistics.mean(distinct),
        "median_step_ms": 1000 * statistics.median(measured),
        "p10_step_ms": 1000 * _quantile(measured, 0.1),
        "p90_step_ms": 1000 * _quantile(measured, 0.9),
        "mean_step_ms": 1000 * statistics.mean(measured),
        "steps_per_s": len(measured) / wall,
        "first_step_s": timer.durations[0],
        "build_s": build_seconds, "fit_s": fit_seconds,
        "chief_total_s": time.perf_counter() - started,
        "peak_rss_mib": {task: (m or {}).get("VmHWM") for task, m in memory_trained.items()},
        "rss_mib": {stage: {task: (m or {}).get("VmRSS") for task, m in mem.items()}
                    for stage, mem in (("connected", memory_connected),
                                       ("built", memory_built),
                                       ("trained", memory_trained))},
        "placement": str(strategy.placement),
        "final_loss": timer.last_loss,
    }
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
    if options.result_file:
        with open(options.result_file, "w") as f:
            json.dump(result, f)
    return 0


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_timer(keras):
    """A Keras callback taking time.perf_counter() at the begin and end of every batch."""

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.begins, self.ends, self.durations = [], [], []
            self.last_loss = None

        def on_train_batch_begin(self, batch, logs=None):
            self.begins.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            # Keras has turned the logs into Python numbers, so the step is done;
            # float() makes sure of it.
            if logs and "loss" in logs:
                self.last_loss = float(logs["loss"])
            self.ends.append(time.perf_counter())
            self.durations.append(self.ends[-1] - self.begins[-1])

    return StepTimer()


# Driver -------------------------------------------------------------------------


def chief_argv(options, rows, optimizer, policy, result_file):
    return [sys.executable, "-m", "benchmarks.table_scaling", "--chief",
            "--rows", str(rows), "--optimizers", optimizer, "--policies", policy,
            "--steps", str(options.steps), "--warmup", str(options.warmup),
            "--workers", str(options.workers), "--ps", str(options.ps),
            "--batch-size", str(options.batch_size),
            "--pool-batches", str(options.pool_batches),
            "--distribution", options.distribution,
            "--local-replicas", str(options.local_replicas),
            "--result-file", result_file,
            "--hang-seconds", str(max(30, int(options.timeout) - 30))]


def launcher_argv(options, chief):
    if options.local_replicas:
        return chief
    return ([sys.executable, "-m", "hybrid_strategy.launch",
             "--workers", str(options.workers), "--ps", str(options.ps), "--"] + chief)


def measure(options, code_dir, rows, optimizer, policy):
    label = f"{rows:,} rows, {optimizer}, {policy}"
    with tempfile.TemporaryDirectory(prefix="table_scaling_") as tmp:
        result_file = os.path.join(tmp, "result.json")
        argv = launcher_argv(options, chief_argv(options, rows, optimizer, policy, result_file))
        shown = shlex.join(launcher_argv(
            options, chief_argv(options, rows, optimizer, policy, "RESULT.json")))
        print(f"[{label}] {shown}", file=sys.stderr, flush=True)
        output, code, seconds = machine.run_captured(argv, options.timeout, code_dir)
        result = None
        if code == 0 and os.path.exists(result_file):
            with open(result_file) as f:
                result = json.load(f)
    if result is None:
        tail = "\n".join(output.rstrip().splitlines()[-40:])
        print(f"[{label}] failed (exit {code}) after {seconds:.0f} s; last output:\n{tail}",
              file=sys.stderr, flush=True)
        return {"rows": rows, "optimizer": optimizer, "policy": policy, "command": shown,
                "error": tail, "wall_s": seconds}
    result["command"] = shown
    result["wall_s"] = seconds
    result["loadavg_after"] = list(os.getloadavg())
    peak = result["peak_rss_mib"]
    print(f"[{label}] median {result['median_step_ms']:.1f} ms, "
          f"{result['steps_per_s']:.1f} steps/s, peak RSS MiB "
          + ", ".join(f"{task} {mib:.0f}" for task, mib in peak.items() if mib is not None)
          + f"; run took {seconds:.0f} s", file=sys.stderr, flush=True)
    return result


def _tasks(options):
    if options.local_replicas:
        return ["chief"]
    return ([f"worker {i}" for i in range(options.workers)]
            + [f"ps {i}" for i in range(options.ps)] + ["chief"])


def table(results, options):
    tasks = _tasks(options)
    head = (["rows", "optimizer", "policy", "median step ms", "p10-p90 ms", "steps/s",
             "distinct ids/step", "shards", "table+slots per ps MiB"]
            + [f"peak RSS {t} MiB" for t in tasks])
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---:", "---", "---"] + ["---:"] * (len(head) - 3)) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['rows']:,} | {r['optimizer']} | {r['policy']} | failed |"
                         + " |" * (len(head) - 4))
            continue
        peak = r["peak_rss_mib"]
        cells = [f"{r['rows']:,}", r["optimizer"], r["policy"], f"{r['median_step_ms']:.1f}",
                 f"{r['p10_step_ms']:.0f}-{r['p90_step_ms']:.0f}",
                 f"{r['steps_per_s']:.1f}", f"{r['distinct_ids_per_step']:,.0f}",
                 str(r["shards"]),
                 " / ".join(f"{m:,.0f}" if m >= 10 else f"{m:.1f}"
                            for m in r["table_and_slots_mib_per_ps"])]
        cells += [f"{peak[t]:,.0f}" if peak.get(t) is not None else "?" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(results, optimizers, policies):
    """Per optimizer and policy: largest / smallest median step time, against TARGET_RATIO."""
    out = []
    for optimizer, policy in ((o, p) for o in optimizers for p in policies):
        runs = [r for r in results if (r["optimizer"], r["policy"]) == (optimizer, policy)]
        ok = [r for r in runs if "error" not in r]
        entry = {"optimizer": optimizer, "policy": policy, "target": TARGET_RATIO}
        if len(ok) != len(runs):
            entry.update(ratio=None, verdict="FAIL",
                         why=f"{len(runs) - len(ok)} of {len(runs)} runs failed")
        elif len(ok) < 2:
            entry.update(ratio=None, verdict="n/a", why="fewer than two table sizes")
        else:
            slow = max(ok, key=lambda r: r["median_step_ms"])
            fast = min(ok, key=lambda r: r["median_step_ms"])
            ratio = slow["median_step_ms"] / fast["median_step_ms"]
            entry.update(ratio=ratio, verdict="PASS" if ratio <= TARGET_RATIO else "FAIL",
                         why=f"largest {slow['median_step_ms']:.1f} ms ({slow['rows']:,} "
                         f"rows) / smallest {fast['median_step_ms']:.1f} ms "
                         f"({fast['rows']:,} rows)")
        out.append(entry)
    return out


def report(results, verdicts, host, options, invocation):
    where = (f"on the CPU of one process replicating over {options.local_replicas} "
             "logical CPU devices" if options.local_replicas else
             f"on {options.ps} ps (split by rows into shards of at least 1 MiB, "
             f"HybridStrategy's default), {options.workers} workers, on loopback")
    lines = [f"Embedding(rows, {DIM}) float32 {where}; global batch "
             f"{options.batch_size}, {SEQUENCE} ids per example drawn {options.distribution}"
             f"ly over the table; median of {options.steps} steps after {options.warmup} "
             "warm-up steps; peak RSS = VmHWM after the measured steps; table+slots per ps = "
             "the MiB of table rows and their optimizer slots each ps holds (ps 0 / ps 1 ...).",
             "",
             table(results, options), ""]
    for v in verdicts:
        ratio = f"{v['ratio']:.2f}" if v["ratio"] is not None else "n/a"
        lines.append(f"- {v['optimizer']}, {v['policy']}: largest/smallest median step time = {ratio} "
                     f"(target <= {v['target']}): **{v['verdict']}** ({v['why']})")
    package = (f"the package of commit {options.before}" if options.before
               else f"this checkout's (commit {machine.code_version()['commit'][:12]})")
    lines += ["", f"machine: {machine.summary(host)}", f"hybrid_strategy: {package}",
              f"command: `{invocation}`",
              "per run (a fresh cluster, or process with --local-replicas; RESULT.json is a "
              "temporary file):"]
    lines += [f"    {r['command']}" for r in results]
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.table_scaling", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", default="100000,1000000,4000000",
                        help="comma-separated table sizes (default %(default)s)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help=f"comma-separated, from {','.join(CHOICES)} (default %(default)s)")
    parser.add_argument("--policies", default="float32",
                        help=f"comma-separated Keras mixed-precision policies, from "
                        f"{','.join(POLICIES)} (default %(default)s)")
    parser.add_argument("--before", metavar="COMMIT",
                        help="run this commit's hybrid_strategy package, not this checkout's")
    parser.add_argument("--steps", type=int, default=100, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=10,
                        help="steps before measuring; the first traces (default %(default)s)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--local-replicas", type=int, default=0, metavar="N",
                        help="no cluster: one process replicating over N logical CPU devices")
    parser.add_argument("--batch-size", type=int, default=512, help="global batch")
    parser.add_argument("--pool-batches", type=int, default=64,
                        help="distinct batches of ids the dataset repeats (default %(default)s)")
    parser.add_argument("--distribution", choices=("uniform", "zipf"), default="uniform",
                        help="how ids are drawn over the table (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before one run is abandoned (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here")
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--hang-seconds", type=float, default=0, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    try:
        options.rows_list = [int(r.replace("_", "")) for r in options.rows.split(",") if r]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {options.rows!r}")
    options.optimizer_list = [o.strip().lower() for o in options.optimizers.split(",")
                              if o.strip()]
    unknown = sorted(set(options.optimizer_list) - set(CHOICES))
    if unknown:
        parser.error(f"unknown optimizer(s) {unknown}; choose from {','.join(CHOICES)}")
    options.policy_list = [p.strip() for p in options.policies.split(",") if p.strip()]
    unknown = sorted(set(options.policy_list) - set(POLICIES))
    if unknown or not options.policy_list:
        parser.error(f"unknown policies {unknown or options.policies!r}; choose from "
                     f"{','.join(POLICIES)}")
    if not options.rows_list or min(options.rows_list) < 1:
        parser.error("--rows needs at least one positive size")
    if options.steps < 1 or options.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step traces)")
    if options.chief:
        if (len(options.rows_list), len(options.optimizer_list), len(options.policy_list)) \
                != (1, 1, 1):
            parser.error("--chief runs one table size, one optimizer and one policy")
        options.rows, options.optimizer = options.rows_list[0], options.optimizer_list[0]
        options.policy = options.policy_list[0]
    return options


def main(argv=None):
    return chief_runs.main(argv, parse, run_chief, run_all)


def run_all(options, argv):
    """Every table size, optimizer and policy, each on a cluster of its own; the report.
    Exit status 1 when a run failed."""
    invocation = shlex.join(["python", "-m", "benchmarks.table_scaling", *argv])
    host = machine.describe()  # the load average before our own runs add to it
    started = time.perf_counter()
    with chief_runs.packages(["before"] if options.before else [], options.before) as code:
        code_dir = code["before"] if options.before else REPO
        results = [measure(options, code_dir, rows, optimizer, policy)
                   for optimizer in options.optimizer_list for policy in options.policy_list
                   for rows in options.rows_list]
    verdicts = checks(results, options.optimizer_list, options.policy_list)
    text = report(results, verdicts, host, options, invocation)
    total = time.perf_counter() - started
    print("\n" + text + f"\n\ntotal time: {total:.0f} s")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"machine": host, "code": machine.code_version(),
                       "command": invocation, "total_s": total,
                       "options": {k: v for k, v in vars(options).items()
                                   if k not in ("json", "chief", "result_file")},
                       "checks": verdicts, "results": results}, f, indent=2)
            f.write("\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
