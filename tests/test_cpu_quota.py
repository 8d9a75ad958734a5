"""A server under a CPU quota (a container's CPU limit) sizes its thread pools for it."""

import json
import os
import subprocess
import sys
import time

import pytest

from hybrid_strategy.cluster import config as cluster
from hybrid_strategy.cluster import cpu_quota
from hybrid_strategy.cluster import server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_the_least_quota_of_a_v2_group_and_its_ancestors(tmp_path):
    _write(tmp_path / "proc", "0::/pod/task\n")
    _write(str(tmp_path / "fs" / "pod" / "task" / "cpu.max"), "max 100000\n")
    _write(str(tmp_path / "fs" / "pod" / "cpu.max"), "33000 100000\n")
    assert cpu_quota.cpu_quota(tmp_path / "proc", tmp_path / "fs", ()) == pytest.approx(0.33)
    _write(str(tmp_path / "fs" / "pod" / "task" / "cpu.max"), "20000 100000\n")
    assert cpu_quota.cpu_quota(tmp_path / "proc", tmp_path / "fs", ()) == pytest.approx(0.2)


def test_a_v1_quota_and_none_where_unlimited(tmp_path):
    mount = tmp_path / "cpu"
    _write(tmp_path / "proc", "5:memory:/x\n4:cpu,cpuacct:/x\n")
    _write(str(mount / "x" / "cpu.cfs_quota_us"), "50000\n")
    _write(str(mount / "x" / "cpu.cfs_period_us"), "100000\n")
    assert cpu_quota.cpu_quota(tmp_path / "proc", tmp_path / "none", (str(mount),)) == 0.5
    _write(str(mount / "x" / "cpu.cfs_quota_us"), "-1\n")
    assert cpu_quota.cpu_quota(tmp_path / "proc", tmp_path / "none", (str(mount),)) is None
    assert cpu_quota.cpu_quota(tmp_path / "missing") is None


def test_in_a_cgroup_namespace_the_mount_is_the_process_group(tmp_path):
    _write(tmp_path / "proc", "0::/\n")
    _write(str(tmp_path / "fs" / "cpu.max"), "150000 100000\n")
    assert cpu_quota.cpu_quota(tmp_path / "proc", tmp_path / "fs", ()) == 1.5


def test_pools_are_sized_for_the_quota_unless_the_environment_sizes_them(monkeypatch):
    assert cpu_quota.pool_sizes(0.33) == (1, 2)  # inter-op keeps 2: blocking ops
    assert cpu_quota.pool_sizes(2.5) == (3, 3)
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    monkeypatch.delenv("TF_NUM_INTEROP_THREADS", raising=False)
    assert server._pools_for(0.33) == (1, 2)
    assert server._pools_for(None) is None
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "4")
    assert server._pools_for(0.33) is None
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "0")  # TensorFlow's default, asked for
    assert server._pools_for(0.33) is None


def test_idle_threads_sleep_under_a_quota_even_on_a_host_of_their_own():
    config = cluster.ClusterConfig({"chief": ["10.0.0.1:2220"], "worker": ["10.0.0.2:2221"]},
                                   "worker", 0)
    assert server.thread_spinning("auto", config) is True
    assert server.thread_spinning("auto", config, quota=0.5) is False
    assert server.thread_spinning("on", config, quota=0.5) is True


def test_a_server_in_a_cgroup_of_half_a_core_sizes_its_pools_for_it(tmp_path, cpu_groups_here):
    """A real server process in a real CPU cgroup with a quota."""
    from benchmarks import cpu_groups
    groups = cpu_groups.CpuGroups(0.5, root=cpu_groups_here.root).check()
    groups.add("server")
    port = cluster.free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}
    env.update(PYTHONPATH=REPO, TF_CONFIG=json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "hybrid_strategy.server"], env=env,
                                   stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=groups.joiner("server"))
    try:
        deadline = time.monotonic() + 120
        while "serving on" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
    finally:
        process.terminate()
        process.wait(30)
        groups.close()
    assert "serving on" in text, text
    assert "idle threads sleep" in text
    assert "for a CPU quota of 0.5 core: 1 intra-op and 2 inter-op threads" in text
