"""Where a training step's time goes, per task, from a TensorFlow profiler trace.

    python -m benchmarks.trace_summary LOGDIR [--task chief=127.0.0.1:2222 ...]

LOGDIR holds one XSpace per traced task (`plugins/profile/<run>/<host>_<port>.xplane.pb`,
as `tf.profiler.experimental.client.trace` writes them for every gRPC address it is
given, or `<host>.xplane.pb` from a local `tf.profiler.experimental.start`). The trace's
training steps are counted from the trainer's Python thread (each call of the Keras train
function), and every figure is divided by that count, so the trace window need not match
the measured window of the benchmark.

Per task, the busy time of its threads is split into categories (milliseconds of thread
time per step; a task with two busy threads can show more than the step's wall time):

  model compute        the model's forward and backward kernels
  embedding lookup     gathers of table rows (HybridStrategy's `hybrid_lookup` scope)
  sparse aggregation   merging duplicate rows and summing gradients per worker and per PS
  variable update      optimizer kernels (PS row updates and mirrored variables)
  all-reduce           collective kernels, from start to end, so waiting for peers counts,
                       and resolving each collective's parameters; the dense sum that
                       workers run in the step's graph (communication/hierarchical_allreduce.py: its
                       kernels and the tensors they send)
  send/recv            tensors sent between tasks (_Send/_Recv kernels)
  input pipeline       tf.data: the iterator kernels and everything on tf.data's threads
  runtime              what is not a kernel: executors scheduling kernels, function
                       dispatch, RPC handling (exclusive time of those events)

A kernel's event covers everything nested in it. For the trainer (the chief, or each
MultiWorkerMirroredStrategy worker) its Python thread is given separately: the wall time
per step, the part spent inside the train function call (dispatching the step and waiting
for every task to finish it) and the rest (Keras' loop and callbacks).
"""

import argparse
import collections
import glob
import json
import os
import re
import sys

CATEGORIES = ("model compute", "embedding lookup", "sparse aggregation", "variable update",
              "all-reduce", "send/recv", "input pipeline", "runtime")
_TRAIN_CALL = re.compile(
    r"^EagerLocalExecute: __inference_(multi_step_on_iterator|one_step_on_iterator|"
    r"train_function)_\d+$")
# A kernel's TraceMe reads "<node name>:<op type>".
_KERNEL = re.compile(r"^(?P<name>[^\s:]+):(?P<type>[A-Za-z_][A-Za-z0-9_]*)$")
_INPUT_EVENT = re.compile(r"^(Iterator::|Prefetch|IteratorGetNext|GetNextFromShard|"
                          r"MakeIterator|MultiDeviceIterator)")
_COLLECTIVE_TYPE = re.compile(r"^Collective")
# Resolving a collective's group and instance, and running its steps.
_COLLECTIVE_EVENT = re.compile(r"^(Base)?Collective(Executor|OpV2Kernel)")
_TRANSFER_TYPE = re.compile(r"^_?(Host)?(Send|Recv)$")
# communication/hierarchical_allreduce.py's name scopes for the sum in the step's graph.
_IN_GRAPH_SUM = re.compile(r"(^|/)(local_sum|exchange|halving|doubling)(_\d+)?/")
_UPDATE_TYPE = re.compile(r"^(ResourceApply|ResourceSparseApply|Assign(Add|Sub)?Variable|"
                          r"ResourceScatter)")


def _kernel_category(name, op_type):
    if _COLLECTIVE_TYPE.match(op_type) or _IN_GRAPH_SUM.search(name):
        return "all-reduce"
    if _TRANSFER_TYPE.match(op_type):
        return "send/recv"
    if op_type.startswith(("Iterator", "MultiDeviceIterator", "OptionalFromValue")):
        return "input pipeline"
    if "/hybrid_lookup" in name or name.startswith("hybrid_lookup"):
        return "embedding lookup"
    if "aggregation" in name:
        return "sparse aggregation"
    if "/ps_update_" in name or "_row_update" in name or _UPDATE_TYPE.match(op_type):
        return "variable update"
    return "model compute"


def _event_category(name):
    """Category of a non-kernel event's own time."""
    if _INPUT_EVENT.match(name):
        return "input pipeline"
    if _COLLECTIVE_EVENT.match(name):
        return "all-reduce"
    return "runtime"


def _line_events(plane, line):
    """(start_ps, end_ps, name) of a line's events, by start (outer before inner)."""
    names = plane.event_metadata
    events = [(e.offset_ps, e.offset_ps + e.duration_ps, names[e.metadata_id].name)
              for e in line.events if e.duration_ps > 0]
    events.sort(key=lambda e: (e[0], -e[1]))
    return events


def busy_by_category(space):
    """{category: thread picoseconds} of one task's XSpace."""
    totals = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if line.name != "python":  # the trainer's own thread is reported apart
                _add_line(plane, line, totals)
    return totals


def _add_line(plane, line, totals):
    # tf.data's threads run the input pipeline, its functions' kernels included.
    pipeline = line.name.startswith("tf_data")
    # Events on one line are properly nested: a stack of open ones,
    # [end, name, start, is_kernel, time of closed children].
    stack = []

    def close(until):
        while stack and stack[-1][0] <= until:
            end, name, start, kernel, children = stack.pop()
            if not kernel:
                category = "input pipeline" if pipeline else _event_category(name)
                totals[category] += (end - start) - children
            if stack:
                stack[-1][4] += end - start

    for start, end, name in _line_events(plane, line):
        close(start)
        if stack and stack[-1][3]:
            continue  # inside a kernel: counted with it
        match = _KERNEL.match(name)
        if match:
            category = ("input pipeline" if pipeline
                        else _kernel_category(match["name"], match["type"]))
            totals[category] += end - start
        stack.append([end, name, start, bool(match), 0])
    close(float("inf"))


def train_calls(space):
    """(start_ps, duration_ps) of each train function call on the Python thread."""
    calls = []
    for plane in space.planes:
        for line in plane.lines:
            if line.name != "python":
                continue
            base = line.timestamp_ns * 1000
            names = plane.event_metadata
            calls += [(base + e.offset_ps, e.duration_ps) for e in line.events
                      if _TRAIN_CALL.match(names[e.metadata_id].name)]
    return sorted(calls)


def _order(task):
    """chief, then workers, then ps, by index; other names after them."""
    match = re.match(r"^(chief|worker|ps)(\d*)$", task)
    if not match:
        return (3, 0, task)
    return (("chief", "worker", "ps").index(match[1]), int(match[2] or 0), task)


def load(logdir):
    """{file stem, e.g. "127.0.0.1_2222": XSpace} of the newest trace under logdir."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    runs = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))
    if not runs:
        raise FileNotFoundError(f"no profiler trace under {logdir}/plugins/profile")
    spaces = {}
    for path in glob.glob(os.path.join(runs[-1], "*.xplane.pb")):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        spaces[os.path.basename(path)[:-len(".xplane.pb")]] = space
    return spaces


def summarize(logdir, tasks=None):
    """Per-step breakdown of a trace: {"steps", "tasks": {task: {...}}}.

    `tasks` maps task names to their "host:port" addresses (the file names of a
    multi-task trace); without it, files are named by their address.
    """
    spaces = load(logdir)
    names = {address.replace(":", "_"): task for task, address in (tasks or {}).items()}
    trainer_calls = {}
    for stem, space in spaces.items():
        calls = train_calls(space)
        if calls:
            trainer_calls[names.get(stem, stem)] = calls
    if not trainer_calls:
        raise ValueError(f"the trace in {logdir} has no call of a Keras train function")
    steps = min(len(calls) for calls in trainer_calls.values())
    summary = {"steps": steps, "tasks": {}}
    for task, space in sorted(((names.get(stem, stem), space)
                               for stem, space in spaces.items()),
                              key=lambda item: _order(item[0])):
        busy = busy_by_category(space)
        entry = {"busy_ms_per_step": {c: busy[c] / 1e9 / steps for c in CATEGORIES}}
        entry["busy_ms_per_step_total"] = sum(entry["busy_ms_per_step"].values())
        calls = trainer_calls.get(task)
        if calls and len(calls) > 1:
            wall = (calls[-1][0] - calls[0][0]) / (len(calls) - 1) / 1e9
            inside = sum(d for _, d in calls[:-1]) / (len(calls) - 1) / 1e9
            entry["trainer"] = {"step_wall_ms": wall, "in_train_function_ms": inside,
                                "python_between_steps_ms": wall - inside}
        summary["tasks"][task] = entry
    return summary


def markdown(summary):
    """The breakdown as a markdown table: categories x tasks, ms of thread time per step."""
    tasks = list(summary["tasks"])
    lines = [f"Thread time per step (ms), mean over {summary['steps']} traced steps:", "",
             "| | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for category in CATEGORIES + ("total",):
        cells = []
        for task in tasks:
            entry = summary["tasks"][task]
            value = (entry["busy_ms_per_step_total"] if category == "total"
                     else entry["busy_ms_per_step"][category])
            cells.append(f"{value:.2f}")
        label = f"**{category}**" if category == "total" else category
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for task, entry in summary["tasks"].items():
        trainer = entry.get("trainer")
        if trainer:
            lines += ["", f"{task}'s Python thread: {trainer['step_wall_ms']:.2f} ms per step, "
                      f"{trainer['in_train_function_ms']:.2f} ms of it inside the train "
                      f"function call, {trainer['python_between_steps_ms']:.2f} ms in Keras' "
                      "loop and callbacks."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_summary",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("logdir")
    parser.add_argument("--task", action="append", default=[], metavar="NAME=HOST:PORT",
                        help="names a traced address (repeat per task)")
    parser.add_argument("--json", help="also write the summary to this file")
    options = parser.parse_args(argv)
    tasks = {}
    for item in options.task:
        name, sep, address = item.partition("=")
        if not sep or ":" not in address:
            parser.error(f"--task {item!r}: expected NAME=HOST:PORT")
        tasks[name] = address
    summary = summarize(options.logdir, tasks)
    print(markdown(summary))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
