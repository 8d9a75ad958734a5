"""The CPU a tensor's transfer between two TensorFlow processes costs, per MB, by network.

    python -m benchmarks.transfer_cost [--mb 4] [--calls 100] [--rounds 3] [--link-gbit 1]

Two TensorFlow servers, worker tasks 0 and 1 (worker 0 is also the client). A traced
function sends a float32 tensor from task 0 to task 1 and back; the same function on a
scalar gives the cost of a call with nothing to carry. Each process sends and receives the
tensor once per call, so its CPU per MB is (CPU per call with the tensor - with the
scalar) / (2 x MB). It is measured on loopback and, where network namespaces can be made,
across the emulated network of the benchmarks (benchmarks/netem.py: a namespace per task,
veth pairs into a bridge), without a rate limit and with `--link-gbit`. There a veth
delivers what it sends within the sender's own system call, so the receiving side's
kernel work is charged to the sender, and every byte crosses two veth pairs and a bridge:
a machine's NIC would do part of that work in hardware. The ratio of the emulated
network's cost to loopback's is what the emulation adds to every task's CPU per MB moved.
Results go to benchmarks/results/transfer_cost.json and .md.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import machine
from benchmarks import netem

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PORT = 23470
_WORKERS = ("worker0", "worker1")


def _threads():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    return tf


def serve(addresses):
    """Runs as worker 1: a server until killed."""
    tf = _threads()
    tf.distribute.Server(tf.train.ClusterSpec({"worker": addresses}), job_name="worker",
                         task_index=1).join()


def client(addresses, server_pid, mb, calls):
    """Runs as worker 0: times both round trips; prints one JSON line."""
    from hybrid_strategy.cluster import config as cluster  # pylint: disable=import-outside-toplevel
    # Worker 1 may still be starting; worker 0's server starts with the connection below.
    cluster.wait_for_tasks(cluster.parse_tf_config(json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": 0}})),
        timeout=60, skip=(("worker", 0),))
    tf = _threads()
    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec({"worker": addresses}), job_name="worker", task_index=0)
    here, there = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
    with tf.device(here):
        tensor = tf.Variable(tf.ones([int(mb * 1e6 / 4)]))
        scalar = tf.Variable(1.0)

    @tf.function
    def round_trip(value):
        with tf.device(there):
            away = value * 1.0
        with tf.device(here):
            return tf.reshape(away * 1.0, [-1])[:1]

    cost = {}
    for name, value in (("scalar", scalar), ("tensor", tensor)):
        for _ in range(5):
            round_trip(value)
        cpu = (machine.cpu_seconds(os.getpid()), machine.cpu_seconds(server_pid))
        start = time.perf_counter()
        for _ in range(calls):
            round_trip(value).numpy()
        wall = time.perf_counter() - start
        used = (machine.cpu_seconds(os.getpid()) - cpu[0],
                machine.cpu_seconds(server_pid) - cpu[1])
        cost[name] = {"wall_ms": 1000 * wall / calls, "client_cpu_ms": 1000 * used[0] / calls,
                      "server_cpu_ms": 1000 * used[1] / calls}
    print(json.dumps(cost), flush=True)


def measure(network, mb, calls):
    """Both round trips with the servers on `network` (a started netem.Network, or None
    for loopback); the client's JSON."""
    if network is None:
        addresses = [f"localhost:{PORT}", f"localhost:{PORT + 1}"]
        prefix = {task: [] for task in _WORKERS}
    else:
        addresses = [f"{network.address(task)}:{PORT + k}" for k, task in enumerate(_WORKERS)]
        prefix = {task: network.exec_prefix(task) for task in _WORKERS}
    this = [sys.executable, "-m", "benchmarks.transfer_cost"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    server = subprocess.Popen(prefix["worker1"] + this + ["--serve", ",".join(addresses)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done = subprocess.run(
            prefix["worker0"] + this + ["--client", ",".join(addresses), "--server-pid",
                                        str(server.pid), "--mb", str(mb), "--calls",
                                        str(calls)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        server.kill()
        server.wait()
    if done.returncode != 0:
        raise SystemExit(f"the client (worker 0) failed ({done.returncode}):\n"
                         + "\n".join(done.stderr.strip().splitlines()[-15:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_mb(cost, mb):
    """CPU ms per MB each process moved (sent + received)."""
    return {side: (cost["tensor"][f"{side}_cpu_ms"] - cost["scalar"][f"{side}_cpu_ms"])
            / (2 * mb) for side in ("client", "server")}


def _mean_per_mb(cost, mb):
    rate = per_mb(cost, mb)
    return (rate["client"] + rate["server"]) / 2


def markdown(result):
    """The results as a markdown page: per network, its run of median CPU per MB."""
    mb = result["mb"]
    lines = ["# What a transfer costs, per MB, by network", "",
             f"Generated by `{result['command']}`. Two TensorFlow processes (1 intra-op, "
             f"2 inter-op threads each); a traced function sends {mb:g} MB of float32 from "
             "one to the other and back, {calls} calls, beside the same calls on a scalar. "
             "CPU ms per MB: the CPU a process spent on the tensor's round trip (with the "
             "tensor, less with the scalar) over the MB it sent and received; per network "
             "the run of median CPU per MB of {rounds}, the networks taking turns. "
             "Machine: {machine}.".format(calls=result["calls"], rounds=result["rounds"],
                                         machine=machine.summary(result["machine"])), "",
             "| network | wall ms/call (scalar / tensor) | CPU ms/call, client (scalar / "
             "tensor) | CPU ms/call, server (scalar / tensor) | CPU ms per MB, client / "
             "server (all runs, mean of both) | vs loopback |", "|---|---|---|---|---|---:|"]
    base = None
    for row in result["networks"]:
        runs = sorted(row["runs"], key=lambda cost: _mean_per_mb(cost, mb))
        cost = runs[len(runs) // 2]
        rate, mean = per_mb(cost, mb), _mean_per_mb(cost, mb)
        base = base or mean
        spread = ", ".join(f"{_mean_per_mb(run, mb):.2f}" for run in runs)
        lines.append(
            f"| {row['network']} | {cost['scalar']['wall_ms']:.2f} / "
            f"{cost['tensor']['wall_ms']:.2f} | {cost['scalar']['client_cpu_ms']:.2f} / "
            f"{cost['tensor']['client_cpu_ms']:.2f} | {cost['scalar']['server_cpu_ms']:.2f} "
            f"/ {cost['tensor']['server_cpu_ms']:.2f} | {rate['client']:.2f} / "
            f"{rate['server']:.2f} ({spread}) | {mean / base:.2f}x |")
    if result.get("not_run"):
        lines += ["", f"Not run: {result['not_run']}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer_cost",
                                     description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--mb", type=float, default=4.0, help="tensor size, MB")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per network, the networks taking turns")
    parser.add_argument("--link-gbit", type=float, default=1.0,
                        help="rate limit of the limited emulated network's links")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.serve:
        return serve(options.serve.split(","))
    if options.client:
        return client(options.client.split(","), options.server_pid, options.mb,
                      options.calls)
    if options.mb <= 0 or options.link_gbit <= 0 or min(options.calls, options.rounds) < 1:
        parser.error("--mb and --link-gbit must be positive, --calls and --rounds at least 1")
    result = {"command": " ".join(["python -m benchmarks.transfer_cost"]
                                  + (sys.argv[1:] if argv is None else argv)),
              "mb": options.mb, "calls": options.calls, "rounds": options.rounds,
              "machine": machine.describe(), "networks": []}
    links = [("loopback", False, None)]
    ok, why = netem.available()
    if ok:
        links += [("emulated, no rate limit", True, None),
                  (f"emulated, {options.link_gbit:g} Gbit/s links", True, options.link_gbit)]
    else:
        result["not_run"] = f"the emulated network ({why})"
    runs = {label: [] for label, _, _ in links}
    for k in range(options.rounds):
        for label, emulated, link in links:
            print(f"[transfer_cost] round {k + 1}/{options.rounds}: {label} ...",
                  file=sys.stderr, flush=True)
            if not emulated:
                runs[label].append(measure(None, options.mb, options.calls))
                continue
            with netem.Network(list(_WORKERS), link_gbit=link) as network:
                runs[label].append(measure(network, options.mb, options.calls))
    result["networks"] = [{"network": label, "runs": costs} for label, costs in runs.items()]
    machine.write_results(os.path.join(RESULTS_DIR, "transfer_cost.json"), result,
                          markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
