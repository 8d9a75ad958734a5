"""The benchmark harness: lower-bound arithmetic, the emulated network, one quick run."""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import lower_bound
from benchmarks import netem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Lower bound ------------------------------------------------------------------------


def test_lower_bound_arithmetic():
    # 4 workers: the ring all-reduce moves 2 * 3/4 of the 1000 dense bytes each way;
    # 10 unique rows of 16 bytes are pulled (received) and pushed (sent).
    bound = lower_bound.lower_bound(
        1000, [lower_bound.Table("t", rows=100, row_bytes=16, unique_rows=10)], workers=4)
    assert bound["dense_per_direction"] == pytest.approx(1500)
    assert bound["tables"] == {"t": pytest.approx(160)}
    assert bound["per_direction"] == pytest.approx(1660)
    assert bound["sent_plus_received"] == pytest.approx(3320)


def test_lower_bound_one_worker_moves_nothing():
    bound = lower_bound.lower_bound(
        1000, [lower_bound.Table("t", rows=100, row_bytes=16, unique_rows=10)], workers=1)
    assert bound["sent_plus_received"] == 0


def test_lower_bound_of_a_toy_model_matches_a_hand_computation():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input(shape=(3,), dtype="int32"),
        keras.layers.Embedding(10, 4),            # 10 rows of 4 float32: 16 B a row
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2),                    # 4x2 kernel + 2 bias: 40 B, dense
    ])
    model.compile(optimizer="sgd", loss="mse")
    ids = np.array([[1, 1, 2], [3, 1, 0]], dtype="int32")  # rows 0, 1, 2, 3 touched
    y = np.zeros((2, 2), dtype="float32")
    dense_bytes, tables = lower_bound.gradient_profile(model, [(ids, y)])
    assert dense_bytes == 40
    assert len(tables) == 1
    assert (tables[0].rows, tables[0].row_bytes, tables[0].unique_rows) == (10, 16, 4)
    bound = lower_bound.lower_bound(dense_bytes, tables, workers=2)
    # Each way: 2 * 1/2 * 40 dense + 4 rows * 16 B = 104; sent + received 208.
    assert bound["per_direction"] == pytest.approx(104)
    assert bound["sent_plus_received"] == pytest.approx(208)


# Emulated network -------------------------------------------------------------------

_AVAILABLE, _WHY = netem.available() if sys.platform.startswith("linux") else (False, "")
needs_netns = pytest.mark.skipif(not _AVAILABLE, reason=f"no network namespaces: {_WHY}")


def _links_in_root_namespace():
    done = subprocess.run(["ip", "-o", "link", "show"], stdout=subprocess.PIPE, text=True,
                          check=True)
    return done.stdout


@needs_netns
def test_network_counts_bytes_and_leaves_nothing_behind():
    links_before = _links_in_root_namespace()
    net = netem.Network(["a", "b"], link_gbit=0.5)
    with net:
        assert set(net.namespaces) <= set(netem.list_namespaces())
        assert "tbf" in net.qdisc("a") and "500Mbit" in net.qdisc("a")
        payload = 2_000_000
        receiver = subprocess.Popen(net.exec_prefix("b") + [sys.executable, "-c", (
            "import socket\n"
            "s = socket.socket(); s.bind(('0.0.0.0', 2222)); s.listen(); s.settimeout(20)\n"
            "c, _ = s.accept(); c.settimeout(20); n = 0\n"
            "while True:\n"
            "    d = c.recv(1 << 16)\n"
            "    if not d: break\n"
            "    n += len(d)\n"
            "print(n)")], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(0.3)
            before = net.counters()
            subprocess.run(net.exec_prefix("a") + [sys.executable, "-c", (
                "import socket, time\n"
                "for _ in range(100):\n"
                "    try:\n"
                f"        s = socket.create_connection(('{net.address('b')}', 2222), 5); break\n"
                "    except OSError: time.sleep(0.05)\n"
                f"s.sendall(b'x' * {payload}); s.close()")], check=True, timeout=30)
            out, _ = receiver.communicate(timeout=30)
        finally:
            if receiver.poll() is None:
                receiver.kill()
        after = net.counters()
        assert int(out) == payload
        sent = after["a"]["tx_bytes"] - before["a"]["tx_bytes"]
        received = after["b"]["rx_bytes"] - before["b"]["rx_bytes"]
        # Every payload byte crossed the link, plus TCP/IP/Ethernet headers (a few %).
        assert payload <= sent <= payload * 1.1
        # What a sends, b receives; the two ports' counters are read one after the
        # other, so a last small packet of the connection (a 54-byte ACK, FIN or RST)
        # can fall between the reads: allow a few hundred bytes either way.
        assert abs(received - sent) <= 512
    assert not set(net.namespaces) & set(netem.list_namespaces())
    assert _links_in_root_namespace() == links_before


@needs_netns
def test_cleanup_removes_leftovers_and_what_runs_inside():
    net = netem.Network(["a"], run_id="t" + os.urandom(2).hex())
    net.start()
    sleeper = subprocess.Popen(net.exec_prefix("a") + ["sleep", "60"])
    try:
        removed = netem.cleanup(prefix=f"{netem.PREFIX}{net.run_id}-")
        assert sorted(removed) == sorted(net.namespaces)
        assert sleeper.wait(timeout=10) != 0  # stopped by the clean-up
        assert not set(net.namespaces) & set(netem.list_namespaces())
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        net.close()


# One quick harness run ----------------------------------------------------------------


def test_quick_run_of_single_and_hybrid_on_loopback(tmp_path):
    out = tmp_path / "quick.json"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--model", "recommender",
         "--contenders", "single,hybrid", "--quick", "--loopback", "--json", str(out)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=240)
    assert done.returncode == 0, done.stdout[-3000:]
    run = json.loads(out.read_text())
    assert run["schema"] == 1 and run["quick"] is True
    assert run["network"]["mode"] == "loopback"
    assert run["config"]["steps"] == 10 and run["config"]["warmup"] == 3
    assert run["lower_bound"]["sent_plus_received"] > 0
    assert [c["contender"] for c in run["contenders"]] == ["single", "hybrid"]
    for c in run["contenders"]:
        assert c["status"] == "ok", c
        assert c["units_per_s"] > 0 and c["median_step_s"] > 0
        assert len(c["step_times_s"]) == 10
        assert c["keras"].startswith("keras 3")
    hybrid = run["contenders"][1]
    assert hybrid["strategy"] == "HybridStrategy"
    assert set(hybrid["per_task"]) == {"chief", "worker0", "worker1", "ps0"}
    for task in hybrid["per_task"].values():
        assert task["peak_rss_mib"] > 0
    assert hybrid["bytes_source"].startswith("tcp_info")
    assert hybrid["summary"]["worker_bytes_per_step_mean"] > 0
    assert "| hybrid |" in done.stdout and "horovod" in done.stdout
