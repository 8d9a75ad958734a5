"""A synchronous step with no model: the CPU its transfers alone cost on W workers.

    python -m benchmarks.step_floor [--model recommender] [--workers 1 2 4] [--steps 500]
        [--steps-per-call 8]

For every W, a cluster of W workers + 1 ps (`python -m hybrid_strategy.launch`) runs this
file as its chief (`--chief`), which traces five functions, each of the first three doing
what the one before it does and more, sized after the model (benchmarks.lower_bound: its
dense gradients' bytes, and the unique rows one worker's share of the global batch
touches):

  call   the chief calls one function that updates a variable on every worker and on
         the ps and returns one scalar: what every step pays, whatever it computes;
  rows   + each worker sends its row ids to the ps, gets the rows back and sends their
         gradients, which the ps adds to its table at the ids it kept: the hybrid's
         lookup and push, one tensor each way per exchange (sharding/wire.py);
  sum    + the workers' dense gradients ride with their push to the ps, which sums
         them and sends each worker the sum, as the hybrid sums a small dense part
         (communication/hierarchical_allreduce.py `sum_on_ps_pays`; none with one
         worker): 4 tensors per worker per step;

and two that run N steps per call (`--steps-per-call N`), as `compile(steps_per_execution=N)`
does:

  sum xN    `sum`, N times per call: the call's cost spread over N steps;
  ahead xN  + the steps read ahead, as a call's steps do on an endless dataset
            (communication/rows_ahead.py): each push carries the next step's row ids,
            whose rows come back with the dense sum: 2 tensors per worker per step, the
            call's first lookup aside.

No layer, loss, optimizer or metric runs: a hybrid training step does all of this and
the model's arithmetic besides, so `sum` is a floor under its CPU per step. The
functions run in alternating blocks, so load from elsewhere falls on all of them alike;
every task's CPU time is read from /proc. Each function's results are checked (the
summed vector, the rows pushed), so none of the transfers can be pruned away unseen.

Then, unless --model-steps 0, `python -m benchmarks.run --contenders hybrid,single
--loopback` trains the model at the same W, and with `--steps-per-execution N` as well,
and the report sets the floor and the hybrid's CPU per step against one process's
(`single`): with the cores shared, a target of k x one process's CPU per example cannot
be met where the floor alone exceeds k x `single`. Results:
benchmarks/results/step_floor.json and .md.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from benchmarks import chief_runs
from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
# What each function does, each the one before it and more.
FUNCTIONS = {
    "call": "the chief calls one function that updates a variable on every worker and "
            "on the ps and gets one scalar back",
    "rows": "+ each worker's row ids to the ps, their rows back, their gradients added "
            "to the ps's table (the hybrid's lookup and push)",
    "sum": "+ the workers' dense gradients summed on the ps as the hybrid sums them, "
           "riding with the push, the sum back (none with one worker)",
    "sum xN": "`sum`, N steps per call (`--steps-per-call N`)",
    "ahead xN": "+ the steps of the call read ahead: each push carries the next step's "
                "row ids, whose rows come back with the dense sum",
}
_RESULT_PREFIX = "step_floor result: "


# Chief ------------------------------------------------------------------------------


def _floor_functions(tf, extended, dense_floats, rows, width, steps_per_call):
    """{name: (traced function, steps per call)} of FUNCTIONS over the strategy's workers
    and first ps, and check(calls), which raises unless the variables hold what `calls`
    ({name: count}) calls of each function made."""
    # pylint: disable=import-outside-toplevel
    from hybrid_strategy.sharding import wire

    workers, ps = extended.worker_devices, "/job:ps/replica:0/task:0/device:CPU:0"
    count = len(workers)
    with tf.device(ps):
        table = tf.Variable(tf.ones([rows * count, width]))
        pushed = tf.Variable(tf.zeros([rows * count, width]))
        ps_calls = tf.Variable(0.0)
    ids, gradients, sums, worker_calls = [], [], [], []
    for i, device in enumerate(workers):
        with tf.device(device):
            worker_calls.append(tf.Variable(0.0))
            # Each worker's rows are its own, as unique ids within a batch are.
            ids.append(tf.Variable(tf.range(i * rows, (i + 1) * rows)))
            gradients.append(tf.Variable(tf.fill([dense_floats], float(i + 1))))
            sums.append(tf.Variable(tf.zeros([dense_floats])))

    def exchange(sent):
        """{worker: tensor on ps} -> {worker: as it arrived}, one tensor each way."""
        outbox = wire.Outbox()
        tickets = {i: [outbox.put(source, destination, t) for t in tensors]
                   for i, (source, destination, tensors) in sent.items()}
        arrived = outbox.deliver()
        return {i: [arrived[t] for t in ts] for i, ts in tickets.items()}

    def function(rows_too, sum_too, steps=1, ahead=False):
        summing = sum_too and count > 1

        def look_up(worker_ids):
            """Each worker's ids sent to the ps, their rows back: (ids held, rows)."""
            held = exchange({i: (d, ps, [worker_ids[i]]) for i, d in enumerate(workers)})
            return held, exchange({i: (ps, d, [r]) for (i, r), d in
                                   zip(gathered(held).items(), workers)})

        def gathered(held):
            with tf.device(ps):
                return {i: tf.gather(table, held[i][0]) for i in held}

        @tf.function
        def call():
            with tf.device(ps):
                ps_calls.assign_add(1.0, read_value=False)
            worker_ids = {}
            for i, device in enumerate(workers):
                with tf.device(device):
                    worker_calls[i].assign_add(1.0, read_value=False)
                    worker_ids[i] = ids[i].read_value()
            if rows_too:
                held, rows_back = look_up(worker_ids)
            for step in range(steps if rows_too else 0):
                reads_ahead = ahead and step < steps - 1
                pushes = {}
                for i, device in enumerate(workers):
                    with tf.device(device):
                        pushes[i] = [rows_back[i][0] * 0.5]
                        if summing:
                            pushes[i].append(gradients[i].read_value())
                        if reads_ahead:
                            pushes[i].append(worker_ids[i])
                arrived = exchange({i: (d, ps, pushes[i]) for i, d in enumerate(workers)})
                back = {i: [] for i in arrived}
                with tf.device(ps):
                    pushed.scatter_add(tf.IndexedSlices(
                        tf.concat([arrived[i][0] for i in arrived], 0),
                        tf.concat([held[i][0] for i in arrived], 0)))
                    if summing:
                        total = tf.add_n([arrived[i][1] for i in arrived])
                        back = {i: [total] for i in arrived}
                if reads_ahead:
                    held = {i: [arrived[i][-1]] for i in arrived}
                    for i, r in gathered(held).items():
                        back[i].append(r)
                if any(back.values()):
                    came = exchange({i: (ps, d, back[i]) for i, d in enumerate(workers)})
                    for i, device in enumerate(workers):
                        if summing:
                            with tf.device(device):
                                sums[i].assign(came[i][0], read_value=False)
                    if reads_ahead:
                        rows_back = {i: [came[i][-1]] for i in came}
                if step < steps - 1 and not reads_ahead:  # the next step's own lookup
                    held, rows_back = look_up(worker_ids)
            with tf.device(workers[0]):
                return worker_calls[0].read_value()
        return call, steps

    functions = {"call": function(False, False), "rows": function(True, False),
                 "sum": function(True, True),
                 "sum xN": function(True, True, steps_per_call),
                 "ahead xN": function(True, True, steps_per_call, ahead=True)}

    def check(calls):
        total = sum(calls.values())
        pushes = sum(number * functions[name][1] for name, number in calls.items()
                     if name != "call")
        expected = {"ps calls": (float(ps_calls.numpy()), float(total)),
                    "last worker's calls": (float(worker_calls[-1].numpy()), float(total)),
                    "rows pushed": (float(pushed.numpy().sum(dtype="float64")),
                                    0.5 * pushes * rows * count * width)}
        if count > 1 and calls["sum"]:
            expected["sum"] = (float(sums[-1].numpy().sum(dtype="float64")),
                               count * (count + 1) / 2 * dense_floats)
        wrong = {k: v for k, v in expected.items() if abs(v[0] - v[1]) > 1e-6 * abs(v[1])}
        if wrong:
            raise AssertionError("the floor's functions computed the wrong values "
                                 f"(got, expected): {wrong}")
    return functions, check


def run_chief(options):
    """Runs as the launcher's chief: times FUNCTIONS; prints one result line."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    extended = hybrid_strategy.HybridStrategy().extended
    functions, check = _floor_functions(tf, extended, options.dense_floats,
                                        options.rows, options.width, options.steps_per_call)
    for call, _ in functions.values():  # traces, and runs past the first calls' costs
        for _ in range(options.warmup):
            call()
        float(call())
    timed = machine.alternate({name: call for name, (call, _) in functions.items()},
                              dict(machine.server_pids(), chief=os.getpid()),
                              options.steps, options.rounds, wait=float)
    measured = options.steps * options.rounds
    check({name: options.warmup + 1 + measured for name in functions})
    print(_RESULT_PREFIX + json.dumps({
        "functions": {name: {
            "steps_per_call": functions[name][1],
            "wall_ms_per_step": (statistics.mean(f["wall_s_per_call"]) * 1000
                                 / functions[name][1]),
            "cpu_ms_per_step": {task: s * 1000 / functions[name][1]
                                for task, s in f["cpu_s_per_call"].items()},
        } for name, f in timed.items()},
        "calls_per_function": measured}), flush=True)


# Runs --------------------------------------------------------------------------------


def _floor_command(options, workers, sizes):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", str(workers),
            "--ps", "1", "--",
            sys.executable, "-m", "benchmarks.step_floor", "--chief",
            "--steps", str(options.steps), "--rounds", str(options.rounds),
            "--warmup", str(options.warmup), "--dense-floats", str(sizes["dense_floats"]),
            "--rows", str(sizes["rows"]), "--width", str(sizes["width"]),
            "--steps-per-call", str(options.steps_per_call)]


def _sizes(model, workers):
    """The model's dense gradient (floats) and one worker's unique rows per step."""
    from benchmarks import lower_bound  # pylint: disable=import-outside-toplevel

    bound = lower_bound.for_model(model, workers)
    tables = bound["table_detail"]
    width = max(t["row_bytes"] // t["itemsize"] for t in tables)
    # The rows a worker's share touches, in rows of the widest table: with one worker the
    # bound counts none (nothing crosses between workers), but the ps still serves them.
    row_bytes = sum(t["unique_rows"] * t["row_bytes"] for t in tables)
    return {"dense_floats": bound["dense_bytes"] // 4, "width": width,
            "rows": max(1, round(row_bytes / (4 * width)))}


def _model_cpu(options, workers, scratch, steps_per_call=1):
    """CPU ms per step of every task of the hybrid and of `single`, from benchmarks.run,
    `steps_per_call` steps per call."""
    path = os.path.join(scratch, f"run-w{workers}-x{steps_per_call}.json")
    warmup = -(-max(1, options.model_steps // 10) // steps_per_call) * steps_per_call
    command = [sys.executable, "-m", "benchmarks.run", "--model", options.model,
               "--contenders", "hybrid,single", "--workers", str(workers), "--ps", "1",
               "--loopback", "--warmup", str(warmup), "--steps", str(options.model_steps),
               "--steps-per-execution", str(steps_per_call)]
    done = subprocess.run(command + ["--json", path], env=machine.environment(),
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=options.timeout)
    if not os.path.exists(path):
        return {"error": f"benchmarks.run exited with {done.returncode}: "
                         f"{done.stdout[-400:]}"}
    with open(path) as f:
        report = json.load(f)
    cpu = {}
    for contender in report["contenders"]:
        if contender["status"] != "ok":
            return {"error": f"{contender['contender']}: {contender.get('error')}"}
        cpu[contender["contender"]] = {task: t["cpu_ms_per_step"]
                                       for task, t in contender["per_task"].items()}
    return {"cpu_ms_per_step": cpu, "command": shlex.join(["python"] + command[1:])}


def measure(options, workers, scratch):
    sizes = _sizes(options.model, workers)
    command = _floor_command(options, workers, sizes)
    shown = shlex.join(["python"] + command[1:command.index("--") + 1]
                       + ["python"] + command[command.index("--") + 2:])
    print(f"[step_floor W={workers}] {shown}", file=sys.stderr, flush=True)
    result, error = chief_runs.run(command, REPO, _RESULT_PREFIX, options.timeout)
    run = {"workers": workers, "sizes": sizes, "command": shown}
    if result is None:
        print(f"[step_floor W={workers}] FAILED: {error}", file=sys.stderr, flush=True)
        return dict(run, error=error)
    run.update(result)
    totals = {name: sum(f["cpu_ms_per_step"].values())
              for name, f in result["functions"].items()}
    print(f"[step_floor W={workers}] CPU ms per step of all tasks: "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in totals.items()),
          file=sys.stderr, flush=True)
    if options.model_steps:
        print(f"[step_floor W={workers}] training {options.model} (hybrid, single)",
              file=sys.stderr, flush=True)
        run["model"] = _model_cpu(options, workers, scratch)
        run["model_per_call"] = _model_cpu(options, workers, scratch, options.steps_per_call)
    run["loadavg_after"] = list(os.getloadavg())
    return run


def markdown(report):
    per_call = report.get("steps_per_call", 1)
    lines = [f"# A synchronous step with no model: the CPU its transfers cost ({report['model']})",
             "", f"Generated by `{report['invocation']}` on {machine.summary(report['machine'])}.",
             "", "Functions with no layer, loss, optimizer or metric: a hybrid "
             "training step does what `sum` does and the model's arithmetic besides, so "
             "`sum` is a floor under its CPU per step; with N steps per call, `sum xN`, and "
             f"`ahead xN` where the steps read ahead (N = {per_call}).", ""]
    lines += [f"- `{name}`: {text}." for name, text in FUNCTIONS.items()]
    lines += ["",
             "CPU ms per step: user + system time of each task over the measured calls "
             "(loopback, in the launcher's network namespace), divided by the steps they ran. "
             "*vs single*: the task total against one process training the model "
             "(`single`, whose step does the whole global batch), with as many steps per "
             "call. Sizes per worker: the dense gradient summed, and the unique rows "
             "pulled and pushed.", "",
             "| W | function | dense floats | rows x width | wall ms/step | chief | "
             "each worker (mean) | ps | all tasks | vs single |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        if "error" in run:
            lines.append(f"| {run['workers']} | FAILED: {run['error']} | | | | | | | | |")
            continue
        sizes = run["sizes"]
        rows, singles = [], {}
        for key, suffix in (("model", ""), ("model_per_call", f", {per_call} steps per call")):
            model = run.get(key, {}).get("cpu_ms_per_step", {})
            if "single" in model:
                singles[key] = sum(model["single"].values())
            if "hybrid" in model:
                rows.append((f"the hybrid training {report['model']}{suffix}", None,
                             model["hybrid"], singles.get(key)))
            if "single" in model:
                rows.append((f"single: one process training {report['model']}{suffix}",
                             None, model["single"], singles.get(key)))
        rows = [(name, f["wall_ms_per_step"], f["cpu_ms_per_step"],
                 singles.get("model" if f.get("steps_per_call", 1) == 1 else "model_per_call"))
                for name, f in run["functions"].items()] + rows
        for name, wall, cpu, single in rows:
            workers = [ms for task, ms in cpu.items() if task.startswith("worker")]
            ps = [ms for task, ms in cpu.items() if task.startswith("ps")]
            lines.append(
                f"| {run['workers']} | {name} | {sizes['dense_floats']:,} | "
                f"{sizes['rows']} x {sizes['width']} | "
                + (f"{wall:.2f}" if wall is not None else "") + " | "
                f"{cpu.get('chief', 0.0):.2f} | "
                + (f"{sum(workers) / len(workers):.2f}" if workers else "") + " | "
                + (f"{sum(ps):.2f}" if ps else "") + f" | {sum(cpu.values()):.2f} | "
                + (f"{sum(cpu.values()) / single:.2f}x" if single else "") + " |")
        for key in ("model", "model_per_call"):
            if "error" in run.get(key, {}):
                lines.append(f"| {run['workers']} | training FAILED: {run[key]['error']} "
                             "| | | | | | | | |")
    commands = [run[key]["command"] for run in report["runs"]
                for key in ("model", "model_per_call") if "command" in run.get(key, {})]
    lines += ["", "Clusters: " + "; ".join(f"`{run['command']}`" for run in report["runs"])]
    if commands:
        lines.append("Training: " + "; ".join(f"`{c}`" for c in commands))
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_floor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="recommender",
                        help="model of benchmarks.contenders whose sizes the floor takes")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=500, help="calls per block")
    parser.add_argument("--rounds", type=int, default=4, help="blocks of each function")
    parser.add_argument("--warmup", type=int, default=50, help="calls before measuring")
    parser.add_argument("--model-steps", type=int, default=1000,
                        help="measured steps of the model's training runs (0: none)")
    parser.add_argument("--steps-per-call", type=int, default=8,
                        help="steps per call of `sum xN`, `ahead xN` and the second training run")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", default=os.path.join(RESULTS, "step_floor.json"),
                        help="results; the markdown beside it")
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    for name in ("--dense-floats", "--rows", "--width"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.steps < 1 or options.rounds < 1 or options.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    if options.model_steps < 0:
        parser.error("--model-steps must be at least 0")
    if options.steps_per_call < 2 or options.model_steps % options.steps_per_call:
        parser.error(f"--steps-per-call {options.steps_per_call}: take at least 2, dividing "
                     f"--model-steps ({options.model_steps})")
    bad = [w for w in options.workers if w < 1 or w & (w - 1)]
    if bad:
        parser.error(f"--workers {bad}: the hybrid's dense sum takes a power-of-two "
                     "number of workers (1, 2, 4, 8, ...)")
    return options


def run_all(options, argv):
    from benchmarks import contenders  # pylint: disable=import-outside-toplevel

    if options.model not in contenders.MODELS:
        raise SystemExit(f"--model {options.model!r}: choose one of "
                         f"{', '.join(contenders.MODELS)}")
    report = {"model": options.model, "steps_per_call": options.steps_per_call,
              "machine": machine.describe(),
              "code": machine.code_version(),
              "invocation": shlex.join(["python", "-m", "benchmarks.step_floor"]
                                       + list(argv if argv is not None else sys.argv[1:]))}
    with tempfile.TemporaryDirectory(prefix="step_floor_") as scratch:
        report["runs"] = [measure(options, workers, scratch) for workers in options.workers]
    text = markdown(report)
    chief_runs.save(options.json, report, text)
    print(text)
    failed = [run["workers"] for run in report["runs"] if "error" in run
              or "error" in run.get("model", {}) or "error" in run.get("model_per_call", {})]
    if failed:
        raise SystemExit(f"step_floor: the runs with W = {failed} failed (see above)")


def main(argv=None):
    chief_runs.main(argv, parse, run_chief, run_all)


if __name__ == "__main__":
    main()
