"""Tensors crossing between tasks in one training step, counted from the step's graph.

    python -m hybrid_strategy.launch --workers 4 --ps 1 -- \\
        python -m benchmarks.step_transfers --model recommender [--json FILE]

Run as the chief of a cluster, it builds a model of benchmarks/contenders.py under
HybridStrategy (the `hybrid` contender, or `--contender hybrid-bf16`, ...), trains
two steps on per-worker input, and reads the graphs TensorFlow ran the training
step as: one partition per task. Every tensor an edge carries from one task to
another (a `_Recv` whose sender is on another task) costs a call between the two
(a gRPC request, thread hand-offs at both ends), whatever its size: with small
tensors, each step's fixed cost on a worker is mostly those. Collective ops (TensorFlow's
all-reduce) move their tensors outside the graph's edges, by calls of their own: each
counts as the messages a ring of its group makes on its device. Unlike CPU time on a
shared machine, the count is exact and does not vary between runs. It prints, per
pair of tasks, the tensors crossing per step, the tensors each task sends and receives,
collectives' included, and the ops each task runs.
"""

import argparse
import collections
import json
import os
import re
import sys

_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def task_of(device):
    """'/job:worker/replica:0/task:1/device:CPU:0' -> 'worker1'."""
    match = _TASK.search(device or "")
    return f"{match[1]}{match[2]}" if match else device


# Collective ops move their tensors by calls of their own, outside the graph's edges: a
# RING all-reduce of N devices sends and receives 2 (N - 1) chunks of at most 4 MiB on each.
_COLLECTIVES = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                "CollectiveGather", "CollectiveGatherV2", "CollectiveAllToAllV2",
                "CollectiveAllToAllV3", "CollectiveBcastSend", "CollectiveBcastRecv",
                "CollectiveBcastSendV2", "CollectiveBcastRecvV2")


def _collective_messages(node, nodes):
    """Tensors a collective op sends and receives on its device (at least: a tensor over
    the ring's chunk size takes more), from its group size (an attribute, or for the V2
    ops a constant input, its second; `nodes` maps names to the partition's nodes)."""
    if "group_size" in node.attr:
        size = node.attr["group_size"].i
    else:
        const = nodes.get(node.input[1].split(":")[0].lstrip("^"))
        values = const.attr["value"].tensor.int_val if const is not None else ()
        size = values[0] if values else 2  # not a constant: one exchange each way at least
    return 4 * (size - 1) if "Reduce" in node.op else 2 * max(size - 1, 1)


def _functions(run_metadata):
    """The partition graphs of each function that ran, one list per function.

    TensorFlow records the partitions of the functions instantiated since its last
    record in one entry: functions first run at once on several threads (asynchronous
    training's workers) share one. An entry is split into its functions here: a
    partition joins the one holding the other end of any of its sends or receives (the
    same tensor between the same two devices).
    """
    for graphs in run_metadata.function_graphs:
        parts = list(graphs.partition_graphs)
        group = list(range(len(parts)))

        def root(i):
            while group[i] != i:
                group[i] = group[group[i]]
                i = group[i]
            return i

        ends = collections.defaultdict(list)  # (tensor, from, to) -> partitions
        for i, part in enumerate(parts):
            for node in part.node:
                if node.op in ("_Send", "_HostSend", "_Recv", "_HostRecv"):
                    ends[tuple(node.attr[key].s for key in (
                        "tensor_name", "send_device", "recv_device"))].append(i)
        for linked in ends.values():
            for i in linked[1:]:
                group[root(i)] = root(linked[0])
        functions = collections.defaultdict(list)
        for i, part in enumerate(parts):
            functions[root(i)].append(part)
        yield from functions.values()


# The name scope of the PS tasks' sums of dense gradients (communication/routing.py).
_DENSE_SUM = re.compile(r"(^|/)ps_dense_sum(_\d+)?/")


def count_transfers(run_metadata, names=False):
    """{"transfers": {"from->to": tensors}, "total": n, "ops": {task: ops},
    "per_task": {task: tensors sent and received, collectives' included}, "collectives":
    {task: collective ops}, "dense_sums": {task: ops summing the workers' dense
    gradients on a PS}} of the largest function (most nodes) that ran over several
    tasks, or None; with `names`, also "names": {"from->to": [edge names of the
    tensors]}."""
    best = None
    for parts in _functions(run_metadata):
        tasks = {task_of(node.device) for part in parts for node in part.node}
        if len(tasks) < 2:
            continue
        size = sum(len(part.node) for part in parts)
        if best is None or size > best[0]:
            best = (size, parts)
    if best is None:
        return None
    transfers, ops = collections.Counter(), collections.Counter()
    collectives, per_task = collections.Counter(), collections.Counter()
    dense_sums = collections.Counter()
    edge_names = collections.defaultdict(list)
    for part in best[1]:
        nodes = {node.name: node for node in part.node}
        for node in part.node:
            ops[task_of(node.device)] += 1
            if node.op == "AddN" and _DENSE_SUM.search(node.name):
                dense_sums[task_of(node.device)] += 1
            if node.op in _COLLECTIVES:
                collectives[task_of(node.device)] += 1
                per_task[task_of(node.device)] += _collective_messages(node, nodes)
            if node.op in ("_Recv", "_HostRecv"):
                source = task_of(node.attr["send_device"].s.decode())
                destination = task_of(node.attr["recv_device"].s.decode())
                if source != destination:
                    transfers[f"{source}->{destination}"] += 1
                    per_task[source] += 1
                    per_task[destination] += 1
                    edge_names[f"{source}->{destination}"].append(
                        node.attr["tensor_name"].s.decode())
    counted = {"transfers": dict(sorted(transfers.items())), "total": sum(transfers.values()),
               "ops": dict(sorted(ops.items())), "per_task": dict(sorted(per_task.items())),
               "collectives": dict(sorted(collectives.items())),
               "dense_sums": dict(sorted(dense_sums.items()))}
    if names:
        counted["names"] = dict(sorted(edge_names.items()))
    return counted


class RunMetadata:
    """Collects the graphs of the functions run in its block (`.result` after it)."""

    def __enter__(self):
        # TF-private: the eager context's run metadata, the only way to the graphs a
        # multi-device function was partitioned into.
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        self._context = context.context()
        self._context.enable_run_metadata()
        self.result = None
        return self

    def __exit__(self, *exc):
        self.result = self._context.export_run_metadata()
        self._context.disable_run_metadata()


def measure(model_name, contender="hybrid", steps_per_execution=1, names=False):
    """Trains `model_name` under `contender` for two calls; returns `count_transfers` of
    its training step, with what was measured."""
    import importlib  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from benchmarks import contenders  # pylint: disable=import-outside-toplevel

    strategy = contenders.make_strategy(contender, 0)
    spec = contenders.MODELS[model_name]
    module = importlib.import_module(spec.module)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = module.build_model(**spec.build)
    model.steps_per_execution = steps_per_execution
    batch = spec.global_batch
    asynchronous = contenders.is_asynchronous(contender)
    # An asynchronous step runs on one worker: every worker runs two.
    steps = 2 * steps_per_execution * (len(strategy.extended.input_hosts) if asynchronous else 1)
    arrays = module.make_arrays(batch * steps, seed=0, **spec.data)
    if asynchronous:  # one dataset of global batches, each worker reading its own
        from keras_examples import common  # pylint: disable=import-outside-toplevel
        data = common.batched_dataset(arrays, batch, repeat=True)
    else:
        data = contenders.per_worker_input(strategy, arrays, batch)
    with RunMetadata() as metadata:
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    counted = count_transfers(metadata.result, names)
    if counted is not None:
        counted.update(model=model_name, contender=contender,
                       steps_per_execution=steps_per_execution,
                       replicas=strategy.num_replicas_in_sync)
    return counted


def describe(counted):
    lines = [f"{counted['model']}, {counted['contender']}, {counted['replicas']} replicas, "
             f"{counted['steps_per_execution']} step(s) per call: "
             f"{counted['total']} tensors cross between tasks per call"]
    lines += [f"  {pair:24s} {n}" for pair, n in counted["transfers"].items()]
    lines.append("sent and received per task (collective ops' included): " + ", ".join(
        f"{t} {n}" for t, n in counted["per_task"].items()))
    if counted["collectives"]:
        lines.append("collective ops per task: " + ", ".join(
            f"{t} {n}" for t, n in counted["collectives"].items()))
    lines.append("ops per task: " + ", ".join(f"{t} {n}" for t, n in counted["ops"].items()))
    for pair, tensors in counted.get("names", {}).items():
        lines += [f"{pair}:"] + [f"  {name}" for name in tensors]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_transfers",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="recommender")
    from benchmarks import contenders  # pylint: disable=import-outside-toplevel
    parser.add_argument("--contender", default="hybrid",
                        help="a HybridStrategy contender of benchmarks/contenders.py ("
                             f"{', '.join(sorted(contenders.HYBRID_ARCHITECTURES))}), "
                             "options included, e.g. hybrid:min_shard_bytes=65536")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--names", action="store_true",
                        help="also list the tensors crossing, by their edge names")
    parser.add_argument("--json", help="also write the counts to this file")
    options = parser.parse_args(argv)
    if contenders.base_of(options.contender) not in contenders.HYBRID_ARCHITECTURES:
        parser.error(f"--contender {options.contender}: not a HybridStrategy contender")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    counted = measure(options.model, options.contender, options.steps_per_execution,
                      options.names)
    if counted is None:
        print("no training step ran over several tasks (run it as a cluster's chief)",
              file=sys.stderr)
        return 1
    print(describe(counted))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(counted, f, indent=1)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a process connected to a cluster can hang in interpreter teardown
