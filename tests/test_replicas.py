"""Several replicas per worker, and the tf.data service, on real clusters.

One launcher run per Keras flavour (in the background, two programs at a time): 2
workers with 2 CPU devices each (`--devices-per-worker 2`), 1 ps and a tf.data service
dispatcher with 2 workers (`--data-service-workers 2`), tests/replicas_scenario.py as
the chief, which ends by killing the dispatcher. The Keras 3 run also trains
asynchronously, for tests/test_asynchronous.py (which starts it). The option checks run
without a cluster.
"""

import functools
import json
import os
import socket

import pytest
import tensorflow as tf

import replicas_scenario
from hybrid_strategy.cluster import config as cluster
from hybrid_strategy.cluster import connection
from hybrid_strategy.cluster import data_service
from hybrid_strategy.cluster import launch
from hybrid_strategy.cluster import server
from hybrid_strategy.communication import hierarchical_allreduce
from hybrid_strategy.input import service_input
from runs import Runs, environ, on_cluster, python
from test_launch import gone

pytestmark = pytest.mark.cluster

TOLERANCE = 1e-5
SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replicas_scenario.py")
LAUNCH = on_cluster(SCENARIO, workers=2, ps=1, devices_per_worker=2,
                    launcher=("--data-service-workers", "2"))


FLAVOURS = ("keras3", "tf_keras")


def launcher_run(flavour):
    """The launcher's run: (its report, the run); the chief ends by losing the dispatcher."""
    run = python(LAUNCH, env=environ(flavour))
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(f"2 workers x 2 replicas ({flavour}) exited {run.returncode} "
                    f"without a report:\n{run.stderr[-6000:]}")
    return json.loads(lines[0]), run


RUNS = Runs({flavour: functools.partial(launcher_run, flavour) for flavour in FLAVOURS})


@pytest.fixture(scope="module", params=FLAVOURS)
def launched(request):
    return RUNS.result(request.param)


@pytest.fixture(scope="module")
def report(launched):
    return launched[0]


@pytest.mark.parametrize("case", replicas_scenario.EQUIVALENCE)
def test_two_workers_of_two_replicas_train_as_one_device(report, case):
    errors = report[case]["relative_errors"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"{case}: {worst} differs from single-device training by {errors[worst]:.2e}")
    devices = report[case]["devices"]
    assert sorted(devices["hidden/kernel"]) == [
        f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in (0, 1) for d in (0, 1)]
    assert all(d.startswith("/job:ps/") for d in devices["embedding/embeddings"])


def test_every_example_used_once_over_four_replicas(report):
    counted = report["count"]
    assert set(counted["uses_per_example"]) == {1.0}
    assert counted["batches"] == 4


def test_a_workers_replicas_are_summed_on_that_worker_first(report):
    aggregation = report["aggregation"]
    assert len(aggregation["replicas"]) == 4
    ops = aggregation["ops"]
    hosts = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in (0, 1)]
    # A table's rows: one concatenation of the worker's 2 replicas' rows per worker
    # (indices and values each), then one per shard on the ps, of the 2 workers' parts.
    local = ops["local_aggregation"]
    assert sorted(device for device, _ in local) == sorted(hosts * 2)
    assert {inputs for _, inputs in local} == {2}
    assert ops["ps_aggregation"] and all(
        device.startswith("/job:ps/") and inputs == 2 for device, inputs in ops["ps_aggregation"])
    # A dense gradient: added up on each worker's first device, then summed between
    # those two only (a small one in the graph: each adds the other's to its own).
    assert sorted(ops["local_sum"]) == [[host, 2] for host in hosts]
    assert sorted(device for device, _ in ops["exchange"]) == hosts
    assert "CollectiveReduceV2" not in ops
    # A gradient over the threshold: a ring of the two workers' first devices.
    assert aggregation["large"] == {"CollectiveReduceV2": 2}


def test_a_small_dense_gradient_is_summed_on_the_ps_from_each_workers_sum(report):
    aggregation = report["aggregation_on_ps"]
    ops = aggregation["ops"]
    hosts = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in (0, 1)]
    # Each worker adds its 2 replicas' gradients, the ps adds the 2 workers' sums.
    assert sorted(ops["local_sum"]) == [[host, 2] for host in hosts]
    assert [inputs for _, inputs in ops["ps_dense_sum"]] == [2]
    assert all(device.startswith("/job:ps/replica:0/task:0/") for device, _ in
               ops["ps_dense_sum"])
    assert "exchange" not in ops and "CollectiveReduceV2" not in ops
    assert aggregation["large"] == {}


def test_data_service_uses_every_element_once_per_epoch(report):
    service = report["service"]
    uses = service["uses_per_epoch"]
    assert len(uses) == replicas_scenario.SERVICE_EPOCHS
    for epoch, counts in enumerate(uses):
        assert len(counts) == replicas_scenario.SERVICE_EXAMPLES
        assert set(counts) == {1.0}, f"epoch {epoch}: uses {sorted(set(counts))}"
    # 17 global batches; each worker's batches make 2 steps (2 replicas of 4).
    assert all(steps >= 17 for steps in service["steps_per_epoch"])


def test_a_lost_dispatcher_ends_the_chief_with_75(launched):
    _, run = launched
    assert "training went on without the dispatcher" not in run.stdout
    assert run.returncode == cluster.EXIT_TASK_LOST, run.stderr[-6000:]
    assert "stopped answering for 5 s:\n  tf.data service dispatcher at 127.0.0.1:" in run.stderr


def test_no_server_is_left_behind(report):
    pids = [int(pid) for pid in report["service"]["pids"].split(",")]
    assert len(pids) == 2 + 1 + 1 + 2  # workers, ps, dispatcher, tf.data service workers
    assert all(gone(pid) for pid in pids)


# Options, without a cluster -----------------------------------------------------------


def test_workers_with_different_numbers_of_replicas_are_refused():
    def devices(*names):
        return [tf.config.LogicalDevice(name, name.rsplit(":", 2)[-2]) for name in names]

    worker = "/job:worker/replica:0/task:{}/device:{}"
    same = devices(worker.format(0, "CPU:0"), worker.format(0, "CPU:1"),
                   worker.format(1, "CPU:1"), worker.format(1, "CPU:0"))
    assert connection._replica_devices(2, same) == [
        worker.format(t, f"CPU:{d}") for t in (0, 1) for d in (0, 1)]
    gpus = devices(worker.format(0, "CPU:0"), worker.format(0, "GPU:0"))
    assert connection._replica_devices(1, gpus) == [worker.format(0, "GPU:0")]
    with pytest.raises(cluster.ClusterConfigError,
                       match=r"different numbers of replicas \(worker 0: 2, worker 1: 1\).*"
                             r"same --cpu-devices"):
        connection._replica_devices(2, same[:3])


def test_the_all_reduce_is_ours_for_several_cpu_replicas_or_a_power_of_two_of_workers():
    worker = "/job:worker/replica:0/task:{}/device:{}"
    two_by_two = [worker.format(t, f"CPU:{d}") for t in (0, 1) for d in (0, 1)]
    assert hierarchical_allreduce.applies(two_by_two, "RING")
    assert hierarchical_allreduce.applies(two_by_two[:2], "AUTO")  # one worker: no ring
    # One replica each: 2 workers may sum by recursive doubling, 3 keep TensorFlow's ring.
    assert hierarchical_allreduce.applies(two_by_two[::2], "RING")
    three = [worker.format(t, "CPU:0") for t in range(3)]
    assert not hierarchical_allreduce.applies(three, "RING")
    assert not hierarchical_allreduce.applies(two_by_two, "NCCL")
    gpus = [d.replace("CPU", "GPU") for d in two_by_two]
    assert not hierarchical_allreduce.applies(gpus, "AUTO")


TF_CONFIG = json.dumps({"cluster": {"worker": ["127.0.0.1:2221"], "ps": ["127.0.0.1:2222"]},
                        "task": {"type": "ps", "index": 0}})


@pytest.mark.parametrize("argv, message", [
    (["--cpu-devices", "0"], "--cpu-devices must be at least 1, got 0"),
    (["--cpu-devices", "2"], '--cpu-devices 2 is for worker tasks (each CPU device a '
                             'replica), but TF_CONFIG names task "ps" 0'),
])
def test_server_refuses_bad_cpu_devices(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", TF_CONFIG)
    try:
        code = server.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--devices-per-worker", "0", "--", "true"], "--devices-per-worker must be at least 1"),
    (["--data-service-workers", "-1", "--", "true"],
     "--data-service-workers must be 0 or more, got -1"),
])
def test_launcher_refuses_bad_counts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"devices_per_worker": 0}, "devices_per_worker must be an integer >= 1, got 0"),
    ({"data_service_workers": -2}, "data_service_workers must be an integer >= 0, got -2"),
])
def test_local_cluster_refuses_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch.LocalCluster(**kwargs)


@pytest.mark.parametrize("argv, message", [
    (["worker", "--port", "5051"], "a worker needs --dispatcher HOST:PORT"),
    (["worker", "--dispatcher", "nowhere"], "--dispatcher 'nowhere' is not HOST:PORT"),
    (["dispatcher", "--port", "0"], "--port must be from 1 to 65535, got 0"),
    (["dispatcher", "--dispatcher", "a:1"], "--dispatcher and --address are for workers"),
])
def test_data_service_server_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        data_service.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_data_service_server_says_when_its_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: the server cannot bind
        port = taken.getsockname()[1]
        run = python(["-m", "hybrid_strategy.data_service", "dispatcher", "--port", str(port)],
                     env=environ(), timeout=120)
    assert run.returncode == server.EXIT_CANNOT_SERVE, run.stderr
    assert f"tf.data service dispatcher could not start on port {port}" in run.stderr


def test_data_service_address_comes_from_the_environment():
    env = data_service.DATA_SERVICE_ENV
    assert data_service.data_service_address({env: "10.0.0.9:5050"}) == "grpc://10.0.0.9:5050"
    assert data_service.data_service_address({env: "grpc://h:1"}) == "grpc://h:1"
    with pytest.raises(ValueError, match=f"{env} is not set.*--data-service-workers"):
        data_service.data_service_address({})
    with pytest.raises(ValueError, match="is not grpc://HOST:PORT"):
        data_service.data_service_address({env: "grpc://h"})


def test_a_service_dataset_without_a_job_name_is_refused_on_several_workers():
    dispatcher = tf.data.experimental.service.DispatchServer()
    try:
        def read(job_name):
            return tf.data.Dataset.range(8).batch(4).apply(
                tf.data.experimental.service.distribute(
                    "distributed_epoch", dispatcher.target, job_name=job_name)).prefetch(1)

        assert service_input.job_names(read("train")) == ["train"]
        assert service_input.job_names(tf.data.Dataset.range(3)) == []
        service_input.check_dataset(read("train"), num_input_workers=2)
        service_input.check_dataset(read(None), num_input_workers=1)
        with pytest.raises(ValueError, match="without a job name.*Pass job_name"):
            service_input.check_dataset(read(None), num_input_workers=2)
    finally:
        dispatcher._stop()


IN_GRAPH_SUM = """
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from hybrid_strategy.communication import hierarchical_allreduce
errors = []
for count, length in [(2, 5), (4, 13), (4, 16), (8, 29), (8, 3)]:
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(count)]
    values = [np.random.default_rng([count, i]).normal(size=length).astype("float32")
              for i in range(count)]

    @tf.function(autograph=False)
    def summed():
        placed = []
        for value, device in zip(values, devices):
            with tf.device(device):
                placed.append(tf.identity(tf.constant(value)))
        return hierarchical_allreduce._in_graph_sum(placed, devices)

    sums = [s.numpy() for s in summed()]
    # Messages: the tensors each device receives from the others.
    received = {d: set() for d in devices}
    for op in summed.get_concrete_function().graph.get_operations():
        for tensor in op.inputs:
            if tensor.op.device != op.device and op.device in received:
                received[op.device].add(tensor.name)
    errors.append([count, float(np.max(np.abs(sums[0] - np.sum(values, axis=0)))),
                   all((s == sums[0]).all() for s in sums),
                   sorted({len(names) for names in received.values()})])
print(json.dumps(errors))
"""


def test_the_in_graph_sum_gives_every_device_the_same_sum_in_few_messages():
    # 2, 4 and 8 devices, lengths that do not split evenly, one process of 8 CPU devices.
    out = python(["-c", IN_GRAPH_SUM], env=environ(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for count, error, identical, messages in json.loads(out.stdout.strip().splitlines()[-1]):
        assert error <= 1e-6 and identical
        # 2 log2 W - 1 per device: 1, 3, 5.
        assert messages == [2 * count.bit_length() - 3], (count, messages)
