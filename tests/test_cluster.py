"""Tests of hybrid_strategy.cluster (TF_CONFIG checks, resolver conversion, task probing) and
of the health monitor (hybrid_strategy.liveness)."""

import json
import socket
import subprocess
import sys
import time
from concurrent import futures

import pytest

from hybrid_strategy.cluster import config as cluster

from hybrid_strategy.cluster import liveness
from hybrid_strategy.cluster.config import ClusterConfigError

CLUSTER = {
    "chief": ["127.0.0.1:2220"],
    "worker": ["127.0.0.1:2221", "127.0.0.1:2222"],
    "ps": ["127.0.0.1:2223"],
}


def tf_config(cluster_=None, task=None, **extra):
    data = {"cluster": CLUSTER if cluster_ is None else cluster_,
            "task": {"type": "worker", "index": 1} if task is None else task}
    data.update(extra)
    return json.dumps(data)


class FakeSpec:
    def __init__(self, jobs):
        self.jobs = jobs

    def as_dict(self):
        return self.jobs


class FakeResolver:
    def __init__(self, jobs, task_type="chief", task_id=0):
        self.spec, self.task_type, self.task_id = FakeSpec(jobs), task_type, task_id

    def cluster_spec(self):
        return self.spec


def test_parse_valid_config():
    config = cluster.parse_tf_config(tf_config())
    assert (config.task_type, config.task_index) == ("worker", 1)
    assert (config.num_workers, config.num_ps) == (2, 1)
    assert config.address("worker", 1) == "127.0.0.1:2222"
    assert config.device("ps", 0) == "/job:ps/task:0"
    assert list(config.tasks()) == [
        ("chief", 0, "127.0.0.1:2220"), ("worker", 0, "127.0.0.1:2221"),
        ("worker", 1, "127.0.0.1:2222"), ("ps", 0, "127.0.0.1:2223"),
    ]
    assert config.as_cluster_spec_dict() == CLUSTER


def test_to_tf_config_round_trips():
    config = cluster.parse_tf_config(tf_config())
    other = cluster.parse_tf_config(config.to_tf_config("ps", 0))
    assert other.cluster == config.cluster
    assert (other.task_type, other.task_index) == ("ps", 0)


def test_config_is_frozen_and_copies_addresses():
    addresses = ["127.0.0.1:2221"]
    config = cluster.ClusterConfig({"worker": addresses}, "worker", 0)
    addresses.append("127.0.0.1:2222")
    assert config.cluster == {"worker": ("127.0.0.1:2221",)}
    with pytest.raises(AttributeError):
        config.task_index = 1


def test_unknown_task_lookups_say_what_exists():
    config = cluster.parse_tf_config(tf_config())
    with pytest.raises(ClusterConfigError, match=r'no job "evaluator".*"chief", "worker", "ps"'):
        config.device("evaluator", 0)
    with pytest.raises(ClusterConfigError, match=r'"worker" has no task 2.*0 to 1'):
        config.address("worker", 2)


@pytest.mark.parametrize("text, message", [
    ("{not json", r"not valid JSON \(Expecting property name.*line 1 column 2"),
    ('["a"]', r'must be a JSON object with "cluster" and "task", got a list'),
    (json.dumps({"task": {"type": "worker", "index": 0}}), r'has no "cluster"; add one'),
    (tf_config(cluster_={}), r'"cluster" is empty'),
    (tf_config(cluster_=["127.0.0.1:1"]), r'"cluster" must be an object.*got a list'),
    (tf_config(cluster_={"workers": ["127.0.0.1:1"]}),
     r'unknown job "workers".*allowed jobs are "chief", "worker", "ps", "evaluator"'),
    (tf_config(cluster_={"worker": []}), r'job "worker" must be a non-empty list of "host:port"'),
    (tf_config(cluster_={"worker": "127.0.0.1:1"}), r'job "worker" must be a non-empty list'),
    (tf_config(cluster_={"worker": [2222]}), r'job "worker" must be a non-empty list'),
    (tf_config(cluster_={"worker": ["127.0.0.1:1", "localhost"]}),
     r'job "worker" task 1 has address "localhost", which is not "host:port"'),
    (tf_config(cluster_={"worker": ["127.0.0.1:http"]}), r'address "127.0.0.1:http"'),
    (tf_config(cluster_={"worker": ["127.0.0.1:0"]}), r"port from 1 to 65535"),
    (tf_config(cluster_={"worker": ["127.0.0.1:65536"]}), r"port from 1 to 65535"),
    (tf_config(cluster_={"worker": [":2222"]}), r'address ":2222"'),
    (tf_config(cluster_={"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:1"]}),
     r'"127.0.0.1:1" is used by both /job:worker/task:0 and /job:ps/task:0; give every task'),
    (tf_config(cluster_={"chief": ["a:1", "b:1"], "worker": ["c:1"]}),
     r'"chief" has 2 tasks; there can be only one chief'),
    (json.dumps({"cluster": CLUSTER}), r'has no "task"; add "task"'),
    (tf_config(task=["worker", 0]), r'"task" must be an object'),
    (tf_config(task={"index": 0}), r'"task" has no "type"'),
    (tf_config(task={"type": "worker"}), r'"task" has no "index"'),
    (tf_config(task={"type": "evaluator", "index": 0}),
     r"task type 'evaluator' is not a job of the cluster.*\"chief\", \"worker\", \"ps\""),
    (tf_config(task={"type": "worker", "index": "1"}), r"task index '1' must be an integer"),
    (tf_config(task={"type": "worker", "index": True}), r"task index True must be an integer"),
    (tf_config(task={"type": "worker", "index": 2}),
     r'task index 2 is out of range: job "worker" has 2 task\(s\), so use an index from 0 to 1'),
    (tf_config(task={"type": "worker", "index": -1}), r"task index -1 is out of range"),
])
def test_parse_errors_name_the_problem(text, message):
    with pytest.raises(ClusterConfigError, match=message) as info:
        cluster.parse_tf_config(text)
    assert str(info.value).startswith("TF_CONFIG")


def test_ipv6_address_is_accepted():
    config = cluster.parse_tf_config(tf_config(cluster_={"worker": ["[::1]:2222"]},
                                               task={"type": "worker", "index": 0}))
    assert config.address("worker", 0) == "[::1]:2222"


def test_shares_host_tells_tasks_on_one_machine_from_tasks_on_their_own():
    config = cluster.ClusterConfig({"chief": ["10.0.0.1:2222"],
                                    "worker": ["10.0.0.2:2222", "10.0.0.2:2223"],
                                    "ps": ["[::1]:2222"]})
    assert config.shares_host("worker", 0) and config.shares_host("worker", 1)
    assert not config.shares_host("chief", 0) and not config.shares_host("ps", 0)


def test_from_environment():
    assert cluster.from_environment({}) is None
    assert cluster.from_environment({"TF_CONFIG": "  "}) is None
    assert cluster.from_environment({"TF_CONFIG": tf_config()}).task_index == 1
    with pytest.raises(ClusterConfigError, match="not valid JSON"):
        cluster.from_environment({"TF_CONFIG": "{"})


def test_from_cluster_resolver_accepts_lists_and_index_dicts():
    jobs = {"chief": ["127.0.0.1:2220"], "worker": {1: "127.0.0.1:2222", 0: "127.0.0.1:2221"}}
    config = cluster.from_cluster_resolver(FakeResolver(jobs))
    assert config.cluster["worker"] == ("127.0.0.1:2221", "127.0.0.1:2222")
    assert (config.task_type, config.task_index) == ("chief", 0)


@pytest.mark.parametrize("resolver, message", [
    (FakeResolver({"worker": {0: "a:1", 2: "b:1"}}), r'task indices \[0, 2\]; number its tasks'),
    (FakeResolver({"worker": ["a:1"]}, task_type=None), r"has no task.*task_type=\"chief\""),
    (FakeResolver({"worker": ["a:1"]}, task_type="ps"), r"task type 'ps' is not a job"),
    (FakeResolver({"worker": ["a:1", "a:1"]}), r'"a:1" is used by both'),
])
def test_from_cluster_resolver_errors(resolver, message):
    with pytest.raises(ClusterConfigError, match=message) as info:
        cluster.from_cluster_resolver(resolver)
    assert str(info.value).startswith("cluster resolver")


def test_from_tf_simple_cluster_resolver():
    tf = pytest.importorskip("tensorflow")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(CLUSTER), task_type="chief", task_id=0)
    config = cluster.from_cluster_resolver(resolver)
    assert config.as_cluster_spec_dict() == CLUSTER
    assert (config.task_type, config.task_index) == ("chief", 0)


def test_module_does_not_import_tensorflow():
    # Load cluster/config.py alone: the package __init__ may import TensorFlow, this module must not.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('c', {cluster.__file__!r})\n"
        "module = sys.modules['c'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'tensorflow' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _answering_server():
    """A real gRPC server (grpcio, which TensorFlow installs) with no services: it answers
    the HTTP/2 handshake as TensorFlow's servers do. Yields its address."""
    grpc = pytest.importorskip("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


answering = pytest.fixture(_answering_server)
answering_too = pytest.fixture(_answering_server, name="answering_too")


@pytest.fixture
def silent():
    """A listener that accepts connections and never answers, as a stopped process's
    kernel does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_probe_tells_answering_refusing_and_silent_tasks_apart(answering, silent):
    assert cluster.probe(answering, timeout=5) is None
    assert cluster.probe(f"127.0.0.1:{cluster.free_port()}", timeout=5) == "connection refused"
    started = time.monotonic()
    problem = cluster.probe(silent, timeout=0.5)
    assert time.monotonic() - started < 3
    assert "accepted the connection but sent no HTTP/2 answer within 0.5 s" in problem


def test_wait_for_tasks_reaches_an_answering_task(answering):
    config = cluster.ClusterConfig({"chief": ["127.0.0.1:1"], "worker": [answering]})
    started = time.monotonic()
    cluster.wait_for_tasks(config, timeout=30)  # chief/0 (nothing listens) is skipped
    assert time.monotonic() - started < 5


def test_wait_for_tasks_names_unreachable_tasks_within_timeout(answering, silent):
    closed = f"127.0.0.1:{cluster.free_port()}"
    config = cluster.ClusterConfig({"worker": [answering, silent], "ps": [closed]})
    started = time.monotonic()
    with pytest.raises(cluster.TaskUnreachableError) as info:
        cluster.wait_for_tasks(config, timeout=1.0)
    assert time.monotonic() - started < 3.0
    message = str(info.value)
    assert f"/job:ps/task:0 at {closed} (connection refused)" in message
    assert (f"/job:worker/task:1 at {silent} (it accepted the connection but sent no HTTP/2"
            in message)
    assert answering not in message
    assert "within 1 s" in message and "hybrid_strategy.server" in message


def test_wait_for_tasks_stops_early_when_check_raises():
    config = cluster.ClusterConfig({"worker": [f"127.0.0.1:{cluster.free_port()}"]})

    def check():
        raise RuntimeError("server died")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="server died"):
        cluster.wait_for_tasks(config, timeout=30, check=check)
    assert time.monotonic() - started < 5


def test_wait_for_tasks_rejects_bad_timeout():
    config = cluster.ClusterConfig({"worker": ["127.0.0.1:1"]})
    with pytest.raises(ValueError, match="positive number of seconds"):
        cluster.wait_for_tasks(config, timeout=0)


def test_free_port_is_bindable():
    with socket.create_server(("127.0.0.1", cluster.free_port())):
        pass


def watch(config, timeout):
    reports = []
    monitor = liveness.HealthMonitor(config, timeout=timeout, on_failure=reports.append,
                                    interval=0.1).start()
    return monitor, reports


def wait_for_report(reports, seconds):
    deadline = time.monotonic() + seconds
    while not reports and time.monotonic() < deadline:
        time.sleep(0.05)


def test_health_monitor_reports_a_task_that_stops_answering():
    grpc = pytest.importorskip("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    monitor, reports = watch(cluster.ClusterConfig({"worker": (address,)}), timeout=1.0)
    try:
        time.sleep(1.5)
        assert reports == []  # answering all along
        server.stop(None)
        wait_for_report(reports, 5)
    finally:
        monitor.stop()
    (message,) = reports
    assert f"/job:worker/task:0 at {address} (connection refused)" in message
    assert "stopped answering for 1 s" in message


def test_health_monitor_reports_a_silent_task_once(answering, silent):
    config = cluster.ClusterConfig({"worker": (answering, silent)})
    started = time.monotonic()
    monitor, reports = watch(config, timeout=1.0)
    try:
        wait_for_report(reports, 10)
        reported = time.monotonic() - started
        time.sleep(1.0)
    finally:
        monitor.stop()
    (message,) = reports
    assert reported >= 1.0
    assert message.startswith("1 task(s) stopped answering for 1 s:")
    assert f"/job:worker/task:1 at {silent} (it accepted the connection but" in message


def test_lost_tasks_and_tasks_named_in_an_error(answering, silent):
    closed = f"127.0.0.1:{cluster.free_port()}"
    config = cluster.ClusterConfig(
        {"chief": ["127.0.0.1:1"], "worker": [answering, silent], "ps": [closed]})
    lost = cluster.lost_tasks(config, timeout=0.5)
    assert [(task[0], task[1]) for task, _ in lost] == [("worker", 1), ("ps", 0)]
    text = ("Additional GRPC error information from remote target /job:ps/replica:0/task:0 "
            f"while calling RecvTensor; /job:worker/task:1 ... ipv4:{answering}: reset")
    assert cluster.tasks_named_in(config, text) == [
        ("worker", 0, answering), ("worker", 1, silent), ("ps", 0, closed)]
    assert cluster.tasks_named_in(config, f"{answering}0 /job:ps/task:10") == []


@pytest.mark.parametrize("message, lost", [
    ("sendmsg: Broken pipe (32)", True),
    ("Unable to find a context_id matching the specified one", True),
    ("failed to reach /job:ps/replica:0/task:0", True),
    ("the data server is down", False),
])
def test_an_error_from_a_broken_connection_to_tasks_that_answer_again_names_them(
        answering, answering_too, message, lost):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    config = cluster.ClusterConfig({"chief": ["127.0.0.1:1"], "worker": [answering],
                                    "ps": [answering_too]})
    tasks = liveness.tasks_lost_behind(config, tf.errors.UnavailableError(None, None, message))
    expected = [("ps", 0)] if "task:0" in message else [("worker", 0), ("ps", 0)]
    assert [(task[0], task[1]) for task, _ in tasks] == (expected if lost else [])
