"""The benchmark harness: lower-bound arithmetic, the emulated network, one quick run."""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import lower_bound
from benchmarks import netem
from benchmarks import report
from benchmarks import run_tables

pytestmark = pytest.mark.cluster

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


# Trace summary ------------------------------------------------------------------------


def _write_trace(logdir, stem, lines):
    """An XSpace of one plane; `lines` maps thread names to (name, start_ns, end_ns)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    ids = {}
    for line_name, events in lines.items():
        line = plane.lines.add(name=line_name, timestamp_ns=1000)
        for name, start, end in events:
            if name not in ids:
                ids[name] = len(ids) + 1
                plane.event_metadata[ids[name]].id = ids[name]
                plane.event_metadata[ids[name]].name = name
            line.events.add(metadata_id=ids[name], offset_ps=start * 1000,
                            duration_ps=(end - start) * 1000)
    run = logdir / "plugins" / "profile" / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / f"{stem}.xplane.pb").write_bytes(space.SerializeToString())


def test_trace_summary_splits_thread_time_by_category(tmp_path):
    train = "EagerLocalExecute: __inference_multi_step_on_iterator_7"
    _write_trace(tmp_path, "127.0.0.1_1000", {
        "python": [(train, 0, 8_000_000), (train, 10_000_000, 18_000_000),
                   (train, 20_000_000, 28_000_000), ("EagerExecute", 30_000_000, 30_000_500)]})
    _write_trace(tmp_path, "127.0.0.1_1001", {
        "tf_Compute/1": [
            ("ExecutorState::Process", 0, 3_000_000),
            # A kernel covers what is nested in it (ParallelFor counts as the lookup).
            ("replica/embedding/hybrid_lookup/ResourceGather:ResourceGather", 100_000, 700_000),
            ("ParallelFor", 200_000, 600_000),
            ("functional/dense/MatMul:MatMul", 1_000_000, 1_900_000),
            ("sgd/local_aggregation/UnsortedSegmentSum:UnsortedSegmentSum",
             2_000_000, 2_300_000),
            ("sgd/CollectiveReduceV2:CollectiveReduceV2", 4_000_000, 5_500_000),
            ("StatefulPartitionedCall/_Send:_Send", 6_000_000, 6_030_000)],
        "tf_GrpcWorkerEnvQueues/2": [("CollectiveExecutor::CompleteParams", 0, 150_000)],
        "tf_data_iterator_resource/3": [
            ("Iterator::Root::Prefetch", 0, 1_200_000),
            ("batch/TensorSlice:TensorSliceDataset", 100_000, 400_000)]})
    _write_trace(tmp_path, "127.0.0.1_1002", {
        "tf_Compute/1": [("sgd/ps_update_0/SGD_row_update/Sub:Sub", 0, 270_000),
                         ("ResourceScatterUpdate:ResourceScatterUpdate", 300_000, 330_000)]})
    from benchmarks import trace_summary
    summary = trace_summary.summarize(str(tmp_path), {
        "chief": "127.0.0.1:1000", "worker0": "127.0.0.1:1001", "ps0": "127.0.0.1:1002"})
    assert summary["steps"] == 3
    assert list(summary["tasks"]) == ["chief", "worker0", "ps0"]
    worker = summary["tasks"]["worker0"]["busy_ms_per_step"]
    expected = {"embedding lookup": 0.6, "model compute": 0.9, "sparse aggregation": 0.3,
                "all-reduce": 1.5 + 0.15, "send/recv": 0.03, "input pipeline": 1.2,
                # The executor's own time: 3 ms less the kernels inside it.
                "runtime": 3.0 - 0.6 - 0.9 - 0.3, "variable update": 0.0}
    for category, ms in expected.items():
        assert worker[category] == pytest.approx(ms / 3), category
    ps = summary["tasks"]["ps0"]["busy_ms_per_step"]
    assert ps["variable update"] == pytest.approx(0.3 / 3)
    trainer = summary["tasks"]["chief"]["trainer"]
    assert trainer["step_wall_ms"] == pytest.approx(10.0)
    assert trainer["in_train_function_ms"] == pytest.approx(8.0)
    assert trainer["python_between_steps_ms"] == pytest.approx(2.0)
    table = trace_summary.markdown(summary)
    assert "| embedding lookup | 0.00 | 0.20 | 0.00 |" in table


def test_trace_summary_refuses_a_trace_without_training(tmp_path):
    _write_trace(tmp_path, "127.0.0.1_1000", {"python": [("EagerExecute", 0, 10)]})
    from benchmarks import trace_summary
    with pytest.raises(ValueError, match="no call of a Keras train function"):
        trace_summary.summarize(str(tmp_path))


# The harness ------------------------------------------------------------------------


def test_profiled_quick_run_of_single(tmp_path):
    out = tmp_path / "profile.json"
    done = _run_harness("--contenders", "single", "--quick", "--loopback", "--profile",
                        "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:]
    run = json.loads(out.read_text())
    assert run["profiled"] is True
    profile = run["contenders"][0]["profile"]
    assert profile["steps"] == 10  # the measured window, traced from its first step
    task = profile["tasks"]["chief"]
    assert task["busy_ms_per_step"]["model compute"] > 0
    assert task["trainer"]["step_wall_ms"] > 0
    assert "Where a step's time goes, single" in done.stdout


def _run_harness(*args):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--model", "recommender", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=240)


def test_quick_run_of_single_and_hybrid_on_loopback(tmp_path):
    out = tmp_path / "quick.json"
    done = _run_harness("--contenders", "single,hybrid", "--quick", "--loopback",
                        "--json", str(out))
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
        assert task["cpu_ms_per_step"] >= 0
    # CPU time is counted in clock ticks (10 ms): over 10 quick steps one task may use
    # less than a tick, all of them together do not.
    assert sum(task["cpu_ms_per_step"] for task in hybrid["per_task"].values()) > 0
    assert hybrid["bytes_source"].startswith("tcp_info")
    assert hybrid["summary"]["worker_bytes_per_step_mean"] > 0
    # Horovod is built and reported only when asked for (its virtualenv takes minutes).
    assert "| hybrid |" in done.stdout and "horovod" not in done.stdout
    assert run["not_run"] == []


def test_a_trainer_without_a_step_past_the_stall_timeout_is_named(tmp_path):
    from benchmarks import contenders
    from benchmarks import run as run_lib

    sync_dir = str(tmp_path)
    contenders.heartbeat(sync_dir, "chief", 41)
    contenders.heartbeat(sync_dir, "worker0", 7)
    now = time.time()
    os.utime(tmp_path / "step.worker0", (now - 400, now - 400))
    tasks = ["chief", "worker0", "worker1"]  # worker1 has done no step yet: not judged
    name, seconds, batch = run_lib.stalled(sync_dir, tasks, 300, now)
    assert (name, batch) == ("worker0", "7") and seconds == pytest.approx(400, abs=1)
    assert run_lib.stalled(sync_dir, tasks, 500, now) is None
    assert run_lib.stalled(sync_dir, ["chief", "worker1"], 300, now) is None


def test_step_floor_measures_each_function_and_the_model_beside_it(tmp_path):
    out = tmp_path / "floor.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_floor", "--workers", "2", "--steps", "20",
         "--rounds", "2", "--warmup", "2", "--model-steps", "10", "--steps-per-call", "2",
         "--json", str(out)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    # Sized after the recommender: its dense gradients, one worker's unique rows.
    bound = lower_bound.for_model("recommender", 2)
    assert run["sizes"]["dense_floats"] * 4 == bound["dense_bytes"]
    assert run["sizes"]["rows"] * run["sizes"]["width"] * 4 == pytest.approx(
        bound["sparse_per_direction"], rel=0.01)
    assert run["calls_per_function"] == 40
    assert list(run["functions"]) == ["call", "rows", "sum", "sum xN", "ahead xN"]
    for name, function in run["functions"].items():
        assert function["steps_per_call"] == (2 if name.endswith("xN") else 1)
        assert set(function["cpu_ms_per_step"]) == {"chief", "worker0", "worker1", "ps0"}
        assert function["wall_ms_per_step"] > 0
        assert sum(function["cpu_ms_per_step"].values()) > 0
    for key in ("model", "model_per_call"):
        model = run[key]["cpu_ms_per_step"]
        assert set(model) == {"hybrid", "single"}
        assert set(model["hybrid"]) == {"chief", "worker0", "worker1", "ps0"}
    assert "--steps-per-execution 2" in run["model_per_call"]["command"]
    text = (tmp_path / "floor.md").read_text()
    assert f"| 2 | sum | {run['sizes']['dense_floats']:,} |" in text
    assert f"| 2 | ahead xN | {run['sizes']['dense_floats']:,} |" in text
    assert "single: one process training recommender, 2 steps per call" in text
    assert "x |" in text


def test_cluster_start_reports_both_ways_of_starting_servers(tmp_path):
    out = tmp_path / "start.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_start", "--workers", "1", "--rounds", "1",
         "--out", str(out)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["1"] and list(results["1"]) == ["exec", "fork"]
    for (start,) in results["1"].values():
        assert start["wall_s"] >= start["ready_s"] > 0 and start["cpu_s"] > 0
    assert "| 1 worker + 1 ps | " in (tmp_path / "start.md").read_text()


def test_dynamic_table_cost_times_every_operation_and_checks_its_values(tmp_path):
    from benchmarks import dynamic_table_cost

    out = tmp_path / "dynamic.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.dynamic_table_cost", "--rows", "1000",
         "--batches", "100", "--inner", "2", "--calls", "2", "--export-calls", "1",
         "--rounds", "2", "--warmup", "1", "--json", str(out)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["rows"] == 1000 and "error" not in run
    (entry,) = run["batches"]
    assert entry["batch"] == 100
    timed = entry["operations"]
    assert set(timed) == set(dynamic_table_cost.OPERATIONS)
    for name, op in timed.items():
        # warm-up + 2 rounds of 2 calls, every call's checksum checked
        assert op["calls_checked"] == 1 + 2 * 2, name
        assert len(op["wall_s_per_call"]) == 2 and min(op["wall_s_per_call"]) > 0, name
    # Every operation that returns values had them compared with what was inserted.
    assert set(entry["checks"]) == set(dynamic_table_cost.OPERATIONS) - {"call"}
    exports = run["exports"]
    assert set(exports["operations"]) == set(exports["checks"]) == set(
        dynamic_table_cost.EXPORTS)
    assert all(min(op["wall_s_per_call"]) > 0 for op in exports["operations"].values())
    assert set(run["table_rss_mib"]) == set(dynamic_table_cost.TABLES)
    assert all(run["rss_mib"][name]["after_mib"] > 0 for name in dynamic_table_cost.TABLES)
    text = (tmp_path / "dynamic.md").read_text()
    for name in [*dynamic_table_cost.OPERATIONS, *dynamic_table_cost.EXPORTS]:
        if name != "call":
            assert f"| {name} |" in text, name


# Scaling ------------------------------------------------------------------------------


def test_scaling_line_and_projection():
    from benchmarks import scaling

    line = scaling.fit_line([(1, 3.0), (2, 5.0), (4, 9.0), (8, None)])
    assert line["slope"] == pytest.approx(2.0) and line["intercept"] == pytest.approx(1.0)
    # 1 + 2 W <= 50 for W up to 24.
    assert scaling.workers_within(line, 50) == 24
    assert scaling.workers_within(line, 0.5) == 0
    assert scaling.fit_line([(2, 3.0), (2, 4.0)]) is None
    assert scaling.workers_within({"slope": 0.0, "intercept": 1.0}, 50) is None


def _scaling_run(workers, chief_ms, contender="hybrid", throughput=None, machines=None):
    tasks = {"chief": {"cpu_ms_per_step": chief_ms}} if contender == "hybrid" else {}
    tasks.update({f"worker{i}": {"cpu_ms_per_step": 10.0 + i} for i in range(workers)})
    return {"model": "text", "network": {"mode": "loopback"}, "command": f"cmd w{workers}",
            "date": "d", "machines": machines,
            "config": {"workers": workers, "steps_per_execution": 1, "global_batch": 256},
            "lower_bound": {"sent_plus_received": 1000.0},
            "contenders": [
                {"contender": contender, "status": "ok",
                 "examples_per_s": throughput or 100.0 * workers,
                 "median_step_s": 0.01, "per_task": tasks,
                 "summary": {"worker_bytes_per_step_mean": 1500.0}},
                {"contender": "mwms", "status": "failed"}]}


def test_scaling_summary_of_runs(tmp_path):
    from benchmarks import scaling

    runs = tmp_path / "scaling"
    runs.mkdir()
    for w, ms in ((1, 3.0), (2, 5.0), (4, 9.0)):
        (runs / f"h{w}.json").write_text(json.dumps(_scaling_run(w, ms)))
        (runs / f"m{w}.json").write_text(json.dumps(_scaling_run(w, None, "mwms")))
    path = scaling.summarize(str(tmp_path), plots=False)
    text = open(path).read()
    # hybrid: the chief, 2 ms per worker, 1 ms fixed; within 10 ms: 4 workers.
    assert "| text | loopback | hybrid | 1 | chief | 1: 3.0, 2: 5.0, 4: 9.0 | 2.00 | 1.0 | 4 / 24 / 49 / 99 |" in text
    # MultiWorkerMirroredStrategy has no chief: worker 0 stands for it (10 ms each).
    assert "| text | loopback | mwms | 1 | worker0 |" in text
    assert "| text | loopback | global 256 | hybrid | 1 | 4 | 100 | 10.0 | 9.0 | 10.0, 11.0, 12.0, 13.0 | - | 1.50 kB | 1.00 kB | 1.50 |" in text
    assert "- `cmd w4`" in text
    assert "Throughput against the number of machines" not in text  # shared cores only


def test_scaling_on_machines_reports_throughput_against_the_ideal_line(tmp_path):
    from benchmarks import scaling

    runs = tmp_path / "scaling"
    runs.mkdir()
    machines = {"cpus": 0.2, "colocate": False, "quota_period_ms": 10}
    for batch, top in ((32, 640.0), (128, 720.0)):
        for w, throughput in ((1, 100.0), (2, 190.0), (4, 360.0), (8, top)):
            name = os.path.basename(scaling.run_file("text", "loopback-cpu0.2", w, 1, batch))
            (runs / name).write_text(json.dumps(_scaling_run(w, 3.0, throughput=throughput,
                                                             machines=machines)))
    text = open(scaling.summarize(str(tmp_path), plots=False)).read()
    # 640 examples/s on 8 machines against 8 x 100 on one: 0.80 of the ideal line.
    assert ("| text | loopback-cpu0.2 | 32 per worker | hybrid | 1: 100, 2: 190, 4: 360, "
            "8: 640 examples/s | 0.80 (W = 8) |") in text
    # One efficiency per batch, smallest batch first.
    efficiencies = report.scaling_efficiencies("text", results_dir=str(tmp_path))
    assert list(efficiencies) == ["32 per worker", "128 per worker"]
    assert efficiencies["32 per worker"] == pytest.approx(0.8)
    assert efficiencies["128 per worker"] == pytest.approx(0.9)
    assert report.scaling_efficiencies("lm", results_dir=str(tmp_path)) == {}


def _recommender_run(steps, hybrid, pss, date):
    return {"model": "recommender", "date": date, "network": {"mode": "netns", "link_gbit": 1},
            "config": {"workers": 4, "ps": 1, "repeats": 3, "warmup": 5, "steps": steps,
                       "global_batch": 512},
            "contenders": [{"contender": name, "status": "ok", "units_per_s": value}
                           for name, value in (("hybrid", hybrid), ("pss", pss))]}


def test_targets_take_the_run_measured_longest():
    # The 30-step run is newer; the 1000-step one has as many repeats and more steps.
    runs = [_recommender_run(1000, 55.0, 72.0, "2026-01-01"),
            _recommender_run(30, 45.0, 63.0, "2026-02-01")]
    rows = {name: value for name, value, _ in report.targets(runs)}
    assert rows["recommender, 4 workers + 1 ps, 1 Gbit/s, sharing this machine's cores: "
                "hybrid against pss examples/s"] == f"{55.0 / 72.0:.2f}x"
    assert len({report._group_key(r) for r in runs}) == 2  # not drawn as one line


def test_targets_on_machines_of_their_own_are_read_from_those_runs_only():
    shared = _recommender_run(1000, 55.0, 72.0, "2026-01-01")
    own = dict(_recommender_run(300, 90.0, 60.0, "2026-01-02"),
               machines={"cpus": 0.33, "quota_period_ms": 10.0, "colocate": False})
    colocated = dict(_recommender_run(300, 80.0, 100.0, "2026-01-03"),
                     machines={"cpus": 0.4, "quota_period_ms": 10.0, "colocate": True})
    colocated["config"] = dict(colocated["config"], ps=4)
    rows = {name: (value, met) for name, value, met in
            report.targets([shared, own, colocated])}
    assert rows["recommender, 4 workers + 1 ps, 1 Gbit/s, machines of 0.33 core (10 ms "
                "period): hybrid >= 1.5x pss examples/s"] == ("1.50x", True)
    assert rows["recommender, 4 workers + 1 ps, 1 Gbit/s, sharing this machine's cores: "
                "hybrid against pss examples/s"] == (f"{55.0 / 72.0:.2f}x", report.REPORTED)
    assert rows["recommender, 4 machines of a worker and a ps each (Parallax's layout), "
                "1 Gbit/s, machines of 0.4 core (10 ms period, worker i + ps i colocated): "
                "hybrid ahead of every contender (pss), the least ratio of examples/s"] == (
                    "0.80x", False)


def test_report_leads_with_the_runs_on_real_cores_and_names_their_host(tmp_path):
    kept = os.path.join(REPO, "benchmarks", "results", "real-cores",
                        "recommender-w4-p1-pwb512-spe8.json")
    with open(kept) as f:
        run = json.load(f)
    os.makedirs(tmp_path / "real-cores")
    with open(tmp_path / "real-cores" / "run.json", "w") as f:
        json.dump(run, f)
    hybrid, pss = (report.ok_result(run, name)["units_per_s"] for name in ("hybrid", "pss"))
    text = report.readme([], {}, str(tmp_path))
    section = text[text.index("## On real cores"):text.index("## On machines of their own")]
    row = next(line for line in section.splitlines() if line.startswith("| recommender"))
    assert "512 per worker, 8 steps per call" in row
    assert f"on a host of 16 cores ({run['machine']['cpu']})" in row
    assert f"| {hybrid:,.0f} | {pss:,.0f} |" in row and f"{hybrid / pss:.2f}x" in row
    assert "- file: `real-cores/run.json`" in section
    assert f"- code: commit {run['code']['commit']}" in section
    assert "No such runs yet." in report.real_cores_section(str(tmp_path / "none"))


def test_a_tree_without_git_takes_its_commit_from_the_environment(tmp_path, monkeypatch):
    from benchmarks import machine
    monkeypatch.setattr(machine, "REPO", str(tmp_path))
    monkeypatch.delenv("HSB_CODE_COMMIT", raising=False)
    assert machine.code_version()["commit"] is None
    monkeypatch.setenv("HSB_CODE_COMMIT", "f0a466b")
    assert machine.code_version() == {"commit": "f0a466b", "modified_files": [],
                                      "commit_from": "HSB_CODE_COMMIT"}


def test_real_cores_plan_runs_the_targets_in_order_until_the_budget_is_spent(
        monkeypatch, capsys):
    from benchmarks import real_cores
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    # 6 runs of 60 s fit in 400 s; nothing after them fits in the 40 s left.
    assert real_cores.main(["--budget", "400", "--out", "/nowhere", "--skip",
                            "recommender-pwb512", "--dry-run"]) == 0
    out = capsys.readouterr().out
    planned = [line.split(",")[0][4:] for line in out.splitlines() if line.startswith("=== ")]
    assert planned == ["recommender-pwb128"]
    assert "criteo-pwb512 (about 390 s, 40 s left)" in out
    first = next(line for line in out.splitlines() if line.startswith("=== "))
    assert ("--machine-cpus 2 --contenders hybrid,pss --model recommender --workers 4 "
            "--ps 1 --steps-per-execution 8" in first)
    assert "--per-worker-batch 128 --repeats 3 --loopback" in first
    assert "--json /nowhere/recommender-pwb128.json" in first
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    real_cores.main(["--budget", "9999", "--out", "/nowhere", "--only", "lm-w8,lm-w1",
                     "--repeats", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert "lm-w8 (its machines take 15 cores, this host has 12)" in out
    assert "=== lm-w1, about 45 s" in out
    with pytest.raises(SystemExit):
        real_cores.main(["--budget", "10", "--out", "/nowhere", "--only", "lm-w9"])
    assert "no target named 'lm-w9'; the targets are recommender-pwb512" in (
        capsys.readouterr().err)


def _lm_run(workers, ps, hybrid, steps=20, cpus=0.2, colocate=False):
    return {"model": "lm", "date": "2026-01-01", "network": {"mode": "netns", "link_gbit": 1},
            "config": {"workers": workers, "ps": ps, "repeats": 3, "warmup": 3,
                       "steps": steps, "global_batch": 128 * workers},
            "machines": {"cpus": cpus, "quota_period_ms": 10.0, "colocate": colocate},
            "contenders": [{"contender": "hybrid", "status": "ok", "units_per_s": hybrid}]}


def test_efficiency_between_two_clusters_takes_each_end_from_its_own_runs():
    # 8 workers + 2 ps at 6,400 tokens/s against 8 x 1,000 on 1 worker + 1 ps: 0.80; the
    # colocated run, another share and 8 workers + 1 ps are other clusters.
    runs = [_lm_run(1, 1, 1000.0), _lm_run(8, 2, 6400.0), _lm_run(8, 1, 5000.0),
            _lm_run(8, 2, 7900.0, cpus=0.33), _lm_run(8, 2, 7900.0, colocate=True),
            _lm_run(8, 2, 100.0, steps=10)]
    assert report.efficiency_between(runs, "lm", 128, (1, 1), (8, 2), 0.2) == pytest.approx(0.8)
    assert report.efficiency_between(runs, "lm", 32, (1, 1), (8, 2), 0.2) is None
    rows = {name: (value, met) for name, value, met in report.targets(runs)}
    assert rows["lm, 1 worker + 1 ps to 8 workers + 2 ps (a ps per 4 workers) on machines of "
                "0.2 core, 128 per worker (Parallax's LM1B batch), median of 3 each: hybrid "
                "scaling efficiency >= 0.8"] == ("0.80", True)


def _round_trips(scalar_ms, tensor_ms):
    return {"scalar": {"wall_ms": 1.0, "client_cpu_ms": scalar_ms, "server_cpu_ms": scalar_ms},
            "tensor": {"wall_ms": 5.0, "client_cpu_ms": tensor_ms, "server_cpu_ms": tensor_ms}}


def test_transfer_cost_reports_each_network_per_mb_against_loopback():
    from benchmarks import transfer_cost

    # 4 MB each way: each process moves 8 MB per call. Loopback 0.5 + 2.4 ms: 0.30 ms/MB;
    # the other network's runs 0.45, 0.60 and 0.90 ms/MB: the median, 0.60, is 2.00x.
    result = {"command": "python -m benchmarks.transfer_cost", "mb": 4.0, "calls": 10,
              "rounds": 3, "machine": {"nproc": 2, "cpu": "test", "python": "3.11"},
              "networks": [{"network": "loopback", "runs": [_round_trips(0.5, 2.9)] * 3},
                           {"network": "emulated", "runs": [_round_trips(0.5, 5.3),
                                                            _round_trips(0.5, 4.1),
                                                            _round_trips(0.5, 7.7)]}]}
    assert transfer_cost.per_mb(_round_trips(0.5, 2.9), 4.0) == {
        "client": pytest.approx(0.3), "server": pytest.approx(0.3)}
    text = transfer_cost.markdown(result)
    assert "| loopback | 1.00 / 5.00 | 0.50 / 2.90 | 0.50 / 2.90 | 0.30 / 0.30 (0.30, 0.30, 0.30) | 1.00x |" in text
    assert "| emulated | 1.00 / 5.00 | 0.50 / 5.30 | 0.50 / 5.30 | 0.60 / 0.60 (0.45, 0.60, 0.90) | 2.00x |" in text


def test_run_refuses_steps_per_execution_that_does_not_divide_the_window():
    done = _run_harness("--contenders", "hybrid", "--steps", "10", "--warmup", "5",
                        "--steps-per-execution", "4", "--loopback")
    assert done.returncode == 2
    assert "--steps-per-execution 4: must be at least 1 and divide --steps" in done.stdout


# Machines of their own (CPU groups) ------------------------------------------------------


def _cgroup_parent(groups):
    """A fresh CPU group of this test's own under the root of `groups` (the harness makes
    its groups inside it)."""
    parent = os.path.join(groups.root, f"hsb-test-{os.urandom(2).hex()}")
    os.mkdir(parent)
    if groups.version == 2:  # children of a v2 group get the cpu controller from it
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write("+cpu")
    return parent


def _task_of(pid):
    """("chief", "worker0", ... from the process's TF_CONFIG, "single" without one, and
    its "intra-op/inter-op" thread counts), or None while it has not yet exec'd a task's
    program."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    if not any(p in cmdline for p in (b"hybrid_strategy.server", b"benchmarks.contenders")):
        return None
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    config = env.get(b"TF_CONFIG")
    task = "single"
    if config:
        task = json.loads(config)["task"]
        task = f"{task['type']}{task['index'] if task['type'] != 'chief' else ''}"
    return task, b"/".join(env.get(f"TF_NUM_{pool}_THREADS".encode(), b"")
                           for pool in ("INTRAOP", "INTEROP")).decode()


def test_every_task_runs_in_its_machines_cpu_group_and_colocated_tasks_share_one(
        tmp_path, cpu_groups_here):
    from benchmarks import cpu_groups
    parent = _cgroup_parent(cpu_groups_here)
    out = tmp_path / "machines.json"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    harness = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.run", "--model", "recommender", "--contenders",
         "single,hybrid", "--workers", "2", "--ps", "1", "--quick", "--loopback",
         "--machine-cpus", "0.75", "--quota-period-ms", "20", "--colocate",
         "--cgroup-root", parent, "--json", str(out)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = {}  # group name -> [{task: threads}, (quota, period)]
    try:
        deadline = time.monotonic() + 240
        while harness.poll() is None and time.monotonic() < deadline:
            for name in os.listdir(parent):
                path = os.path.join(parent, name)
                if not (name.startswith(cpu_groups.PREFIX) and os.path.isdir(path)):
                    continue
                try:
                    limits = cpu_groups.read_limits(path)
                    tasks = [_task_of(pid) for pid in cpu_groups.group_pids(path)]
                except (OSError, ValueError):
                    continue  # removed under our feet
                entry = seen.setdefault(name, [{}, limits])
                entry[0].update(t for t in tasks if t)
            time.sleep(0.2)
        output, _ = harness.communicate(timeout=30)
    finally:
        if harness.poll() is None:
            harness.kill()
        leftovers = [n for n in os.listdir(parent) if os.path.isdir(os.path.join(parent, n))]
        os.rmdir(parent)
    assert harness.returncode == 0, output[-3000:]
    assert leftovers == []  # every group removed when its contender's run ended
    # The quota asked for, as the kernel holds it: 0.75 core of a 20 ms period.
    assert {tuple(limits) for _, limits in seen.values()} == {(15000, 20000)}
    groups = {("single" if "single" in tasks else "hybrid", name.split("-", 2)[2]): tasks
              for name, (tasks, _) in seen.items()}
    # One machine per task, worker 0 and ps 0 on one (colocated); for 0.75 core, one
    # intra-op thread and the 2 inter-op threads TensorFlow needs at least.
    assert groups == {("single", "chief"): {"single": "1/2"},
                      ("hybrid", "chief"): {"chief": "1/2"},
                      ("hybrid", "worker0+ps0"): {"worker0": "1/2", "ps0": "1/2"},
                      ("hybrid", "worker1"): {"worker1": "1/2"}}
    run = json.loads(out.read_text())
    assert run["machines"]["cpus"] == 0.75 and run["machines"]["quota_period_ms"] == 20
    assert run["machines"]["colocate"] is True
    hybrid = run["contenders"][1]
    assert hybrid["status"] == "ok" and hybrid["machines"]["ps0"] == "worker0+ps0"
    # Every task says how often its machine's quota stopped it, read from its group.
    for task, usage in hybrid["per_task"].items():
        assert 0 <= usage["throttled_periods"] <= 1, (task, usage)
        assert usage["throttled_ms_per_step"] >= 0, (task, usage)
    assert "machines of 0.75 core each (CFS quota 15 ms per 20 ms period; worker i and " \
        "ps i on one machine" in output


@pytest.mark.parametrize("how", ["missing", "not a cgroup file system"])
def test_without_writable_cgroups_the_run_stops_before_starting_anything(tmp_path, how):
    root = tmp_path / "cgroup"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    if how == "missing":
        argv = ["--cgroup-root", str(root)]
    else:  # looks like a cgroup v1 cpu directory, but a group made there gets no files
        root.mkdir()
        (root / "cpu.cfs_quota_us").write_text("-1\n")
        argv, env["HSB_CGROUP_ROOT"] = [], str(root)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--model", "recommender", "--contenders",
         "single,hybrid", "--quick", "--machine-cpus", "0.5", *argv],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=60)
    assert done.returncode == 2, done.stdout
    assert f"cannot give the emulated machines their CPU share: {root}" in done.stdout
    assert ("does not exist" if how == "missing" else "is not a cgroup file system") \
        in done.stdout
    assert "leave out --machine-cpus" in done.stdout  # what to do
    assert "lower bound" not in done.stdout and "[recommender]" not in done.stdout
    if how != "missing":
        assert os.listdir(root) == ["cpu.cfs_quota_us"]  # the probe group is gone


def test_machine_layout_and_thread_counts():
    from benchmarks import cpu_groups
    tasks = ["chief", "worker0", "worker1", "worker2", "ps0", "ps1"]
    assert cpu_groups.layout(tasks, colocate=False) == {t: t for t in tasks}
    assert cpu_groups.layout(tasks, colocate=True) == {
        "chief": "chief", "worker0": "worker0+ps0", "ps0": "worker0+ps0",
        "worker1": "worker1+ps1", "ps1": "worker1+ps1", "worker2": "worker2"}
    assert [cpu_groups.threads(c) for c in (0.33, 1, 1.5, 2)] == [1, 1, 2, 2]
    assert cpu_groups.thread_environment(0.33) == {"TF_NUM_INTRAOP_THREADS": "1",
                                                   "TF_NUM_INTEROP_THREADS": "2"}
    assert cpu_groups.thread_environment(3) == {"TF_NUM_INTRAOP_THREADS": "3",
                                                "TF_NUM_INTEROP_THREADS": "3"}
    assert cpu_groups.label(0.33, True) == "-cpu0.33-colocated"
    assert cpu_groups.label(0.5, False, 5) == "-cpu0.5-period5ms"
    # TensorFlow's defaults (0), which the servers keep as the variables are set; or
    # nothing, and the servers size their pools from their quota.
    assert cpu_groups.thread_environment(0.33, "host") == {"TF_NUM_INTRAOP_THREADS": "0",
                                                           "TF_NUM_INTEROP_THREADS": "0"}
    assert cpu_groups.thread_environment(0.33, "auto") == {}
    assert cpu_groups.label(0.5, False, 10, "host") == "-cpu0.5-hostthreads"
    assert cpu_groups.label(0.5, True, 10, "auto") == "-cpu0.5-autothreads-colocated"


def test_throttling_is_read_from_cpu_stat_of_either_cgroup_version(tmp_path):
    from benchmarks import cpu_groups
    (tmp_path / "cpu.stat").write_text(
        "nr_periods 200\nnr_throttled 50\nthrottled_time 7000000\n")  # v1: ns
    assert cpu_groups.read_stat(tmp_path) == {"periods": 200, "throttled": 50,
                                              "throttled_us": 7000}
    (tmp_path / "cpu.stat").write_text(
        "usage_usec 9\nnr_periods 10\nnr_throttled 2\nthrottled_usec 300\n")  # v2
    assert cpu_groups.read_stat(tmp_path) == {"periods": 10, "throttled": 2,
                                              "throttled_us": 300}
    (tmp_path / "cpu.stat").write_text("usage_usec 9\n")
    assert cpu_groups.read_stat(tmp_path) is None


def test_the_criteo_benchmark_model_has_criteo_examples_tables():
    from benchmarks import contenders
    from keras_examples import criteo
    assert contenders.CRITEO_TABLE_SIZES == criteo.DEFAULT_TABLE_SIZES
    assert contenders.MODELS["criteo"].build["num_dense"] == criteo.NUM_DENSE


# Batches per contender and the ps tasks' share ------------------------------------------


def _parsed(*argv, model="recommender"):
    """benchmarks.run's options for `model`'s run, as run_model sets them."""
    from benchmarks import run as run_lib

    options = run_lib.parse(["--model", model, "--quick", *argv])
    run_lib.configure(options, model)
    return options


def _batches_of(options, contenders, tmp_path):
    """{contender: (its ContenderRun's batch per step, the batch its trainers are told)}."""
    from benchmarks import run as run_lib

    found = {}
    for contender in contenders:
        kind = run_lib.HorovodRun if contender == "horovod" else run_lib.ContenderRun
        run = kind(contender, options, "loopback", str(tmp_path), run_label=contender)
        told = {run.trainer_spec(t)["global_batch"] for t in run.trainers}
        assert len(told) == 1, (contender, told)
        found[contender] = (run.batch, told.pop())
    return found


SYNCHRONOUS = ("hybrid", "hybrid-bf16", "allreduce", "ps", "mwms", "horovod")


def test_every_contender_takes_the_per_worker_batch_on_each_worker(tmp_path):
    everyone = ",".join(SYNCHRONOUS + ("pss", "ps-async", "single"))
    options = _parsed("--contenders", everyone, "--workers", "4", "--per-worker-batch", "64")
    # Synchronous: 4 workers x 64; an asynchronous step is one worker's, single's its own.
    assert options.global_batch == 256
    expected = {**{c: 256 for c in SYNCHRONOUS}, "pss": 64, "ps-async": 64, "single": 64,
                "ps:asynchronous=True": 64}
    assert _batches_of(options, expected, tmp_path) == {
        c: (batch, batch) for c, batch in expected.items()}
    # Without it, every contender's step is the global batch, however it is split.
    options = _parsed("--contenders", everyone, "--workers", "4", "--global-batch", "512")
    assert _batches_of(options, expected, tmp_path / "global") == {
        c: (512, 512) for c in expected}
    # With several replicas per worker, still 64 per worker (32 per replica).
    options = _parsed("--contenders", "hybrid,ps-async", "--workers", "2",
                      "--devices-per-worker", "2", "--per-worker-batch", "64")
    assert _batches_of(options, ["hybrid", "ps-async"], tmp_path / "devices") == {
        "hybrid": (128, 128), "ps-async": (64, 64)}


def test_a_result_of_another_batch_than_the_contenders_is_refused():
    from benchmarks import run as run_lib

    options = _parsed("--contenders", "pss", "--workers", "4", "--per-worker-batch", "64")
    result = {"contender": "pss", "model": "recommender", "steps": options.steps,
              "global_batch": 256, "measured_seconds": 1.0}
    with pytest.raises(RuntimeError, match="10 steps of batch 256"):
        run_lib._check_result(result, options, "pss", 64)
    run_lib._check_result(dict(result, global_batch=64), options, "pss", 64)


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "512", "--per-worker-batch", "64"],
     "argument --per-worker-batch: not allowed with argument --global-batch"),
    (["--per-worker-batch", "0"], "--per-worker-batch must be at least 1"),
    (["--per-worker-batch", "63", "--devices-per-worker", "2", "--contenders", "hybrid"],
     "--per-worker-batch 63 must be a multiple of --devices-per-worker 2"),
    (["--ps-cpus", "1"], "--ps-cpus needs --machine-cpus"),
    (["--machine-cpus", "0.5", "--ps-cpus", "1", "--colocate"],
     "--ps-cpus and --colocate exclude each other: with --colocate every ps shares a "
     "machine with a worker, which keeps --machine-cpus"),
    (["--machine-cpus", "0.5", "--ps-cpus", "-1"], "--ps-cpus must be positive"),
    (["--machine-cpus", "0.5", "--ps-cpus", "0.05"],
     "--ps-cpus 0.05 of a 10 ms period is a quota under the kernel's minimum"),
])
def test_run_refuses_batches_and_shares_no_run_can_have(argv, message, capsys):
    from benchmarks import run as run_lib

    with pytest.raises(SystemExit) as stopped:
        run_lib.parse(["--model", "recommender", *argv])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_scaling_passes_its_per_worker_batch_and_shares_to_every_run(monkeypatch):
    from benchmarks import scaling

    ran = []
    monkeypatch.setattr(scaling, "run_benchmark", lambda tag, argv: ran.append(argv))
    options = scaling.parse(["--model", "lm", "--workers", "1,4", "--per-worker-batch",
                             "128", "--machine-cpus", "0.4", "--ps-cpus", "0.8"])
    paths = scaling.run_all(options)
    assert [os.path.basename(p) for p in paths] == [
        "lm-netns-nolimit-cpu0.4-ps0.8-w1-spe1-b128.json",
        "lm-netns-nolimit-cpu0.4-ps0.8-w4-spe1-b128.json"]
    for argv in ran:  # benchmarks.run sizes each contender's step from it
        assert argv[argv.index("--per-worker-batch") + 1] == "128"
        assert "--global-batch" not in argv
        assert argv[argv.index("--ps-cpus") + 1] == "0.8"
    with pytest.raises(SystemExit):
        scaling.parse(["--global-batch", "512"])  # scaling sizes by worker only


def _batch_run(workers, per_worker=None, global_batch=512, hybrid=100.0, pss=80.0,
               cpus=0.2):
    """A benchmarks.run result of hybrid, pss and single on machines of `cpus` cores."""
    config = {"workers": workers, "ps": 1, "repeats": 3, "warmup": 5, "steps": 100,
              "global_batch": per_worker * workers if per_worker else global_batch}
    if per_worker:
        config["per_worker_batch"] = per_worker
    run = {"model": "recommender", "date": "2026-01-01", "quick": False,
           "network": {"mode": "netns", "link_gbit": 1, "description": "namespaces"},
           "machines": {"cpus": cpus, "quota_period_ms": 10.0, "colocate": False},
           "config": config, "contenders": []}
    from benchmarks import batches
    for name, value in (("hybrid", hybrid), ("pss", pss), ("single", 50.0)):
        step = batches.step_batch(name, workers, config["global_batch"], per_worker)
        run["contenders"].append({"contender": name, "status": "ok", "units_per_s": value,
                                  "median_step_s": 0.01, "global_batch": step,
                                  "per_task": {"chief": {"job": "chief",
                                                         "cpu_ms_per_step": step / 64}}})
    return run


def test_report_says_each_contenders_batch_and_keeps_per_worker_runs_apart():
    per_worker = _batch_run(4, per_worker=128, hybrid=300.0)
    default = _batch_run(4, global_batch=512)  # the same global batch; pss's step 512
    # The table gives every contender's step, the title how the batches were sized.
    table = run_tables.markdown(dict(per_worker, lower_bound={}, machines=None))
    assert "4 workers + 1 ps, 128 examples per worker per step (a synchronous global " \
        "batch of 512; an asynchronous or single step of 128)" in table
    assert "| contender | Keras | batch per step |" in table
    for cell in ("| hybrid | None | 512 (4 x 128) |", "| pss | None | 128 (one worker) |",
                 "| single | None | 128 |"):
        assert cell in table, cell
    assert "| pss | None | 512 (one worker) |" in run_tables.markdown(
        dict(default, lower_bound={}, machines=None))
    # Never one plot series, and the targets take the run of one global batch only.
    assert report._group_key(per_worker) != report._group_key(default)
    rows = {name: value for name, value, _ in report.targets([per_worker, default])}
    assert rows["recommender, 4 workers + 1 ps, 1 Gbit/s, machines of 0.2 core (10 ms "
                "period): hybrid >= 1.5x pss examples/s"] == "1.25x"
    # CPU per example, not per step: single's steps here are a quarter of hybrid's.
    assert report._cpu_ratio(per_worker, "hybrid", "single") == pytest.approx(1.0)


def test_efficiency_between_takes_runs_of_the_contenders_own_batch_per_worker():
    runs = [_batch_run(1, per_worker=128, hybrid=100.0, pss=90.0),
            _batch_run(8, per_worker=128, hybrid=640.0, pss=720.0),
            # A global batch of 8 x 128: the hybrid's 128 per worker, pss's steps 1,024.
            _batch_run(8, global_batch=1024, hybrid=700.0, pss=100.0)]
    assert report.efficiency_between(runs[:2], "recommender", 128, (1, 1), (8, 1), 0.2) \
        == pytest.approx(0.8)
    assert report.efficiency_between(runs[:2], "recommender", 128, (1, 1), (8, 1), 0.2,
                                     contender="pss") == pytest.approx(1.0)
    # pss's 1,024 per step is another per-worker batch: not its series at 128.
    assert report.efficiency_between([runs[0], runs[2]], "recommender", 128, (1, 1),
                                      (8, 1), 0.2, contender="pss") is None
    assert report.efficiency_between([runs[0], runs[2]], "recommender", 128, (1, 1),
                                      (8, 1), 0.2) == pytest.approx(700 / 800)
    # Machines whose ps tasks had another share are another emulation.
    shared = [dict(r, machines=dict(r["machines"], ps_cpus=0.6)) for r in runs[:2]]
    assert report.efficiency_between(shared, "recommender", 128, (1, 1), (8, 1), 0.2) is None
    assert report.efficiency_between(shared, "recommender", 128, (1, 1), (8, 1), 0.2,
                                     ps_cpus=0.6) == pytest.approx(0.8)


def test_scaling_series_of_runs_kept_before_the_per_worker_batch_was_recorded():
    from benchmarks import scaling

    old = _batch_run(4, global_batch=512)  # made with --global-batch 4 x 128
    new = _batch_run(4, per_worker=128)
    path = scaling.run_file("recommender", "loopback", 4, 1, 128)
    assert scaling.batch_of(path, old, "hybrid") == "128 per worker"
    assert scaling.batch_of(path, old, "pss") == "128 x W per step"  # its steps took 512
    assert scaling.batch_of(path, new, "pss") == scaling.batch_of(path, new, "hybrid") \
        == "128 per worker"
    assert scaling.batch_of("recommender.json", old, "pss") == "global 512"


def test_ps_machines_get_their_own_share_and_threads(tmp_path):
    from benchmarks import cpu_groups

    tasks = ["chief", "worker0", "worker1", "ps0", "ps1"]
    assert cpu_groups.shares(cpu_groups.layout(tasks, False), 0.4, 0.6) == {
        "chief": 0.4, "worker0": 0.4, "worker1": 0.4, "ps0": 0.6, "ps1": 0.6}
    assert cpu_groups.shares(cpu_groups.layout(tasks, False), 0.4) == dict.fromkeys(tasks, 0.4)
    # A machine of a worker and a ps is a worker's.
    assert cpu_groups.shares(cpu_groups.layout(tasks, True), 0.4, 0.6) == {
        "chief": 0.4, "worker0+ps0": 0.4, "worker1+ps1": 0.4}
    assert cpu_groups.label(0.4, False, ps_cpus=1.5) == "-cpu0.4-ps1.5"
    options = _parsed("--machine-cpus", "0.4", "--ps-cpus", "1.5")
    machines = cpu_groups.describe(options, cpu_groups.CpuGroups(0.4, root=str(tmp_path)))
    assert (machines["ps_cpus"], machines["ps_quota_us"]) == (1.5, 15000)
    assert machines["ps_thread_environment"] == {"TF_NUM_INTRAOP_THREADS": "2",
                                                 "TF_NUM_INTEROP_THREADS": "2"}
    assert cpu_groups.machines_label(machines) == "-cpu0.4-ps1.5"
    assert cpu_groups.summary(machines).endswith(
        "TF threads: 1 intra-op, 2 inter-op), the ps tasks' machines of 1.5 core each "
        "(quota 15 ms; TF threads: 2 intra-op, 2 inter-op)")
    assert run_tables.machines_phrase(machines) == "0.4 core, ps 1.5 core (10 ms period)"


def test_each_task_runs_in_a_group_of_its_machines_share(tmp_path, cpu_groups_here):
    from benchmarks import cpu_groups
    from benchmarks import run as run_lib

    parent = _cgroup_parent(cpu_groups_here)
    try:
        for contender, tasks in (("hybrid", ["chief", "worker0", "worker1", "ps0"]),
                                 ("single", ["chief"])):
            options = _parsed("--contenders", contender, "--workers", "2", "--ps", "1",
                              "--machine-cpus", "0.5", "--ps-cpus", "1.5",
                              "--cgroup-root", parent)
            run = run_lib.ContenderRun(contender, options, "loopback", str(tmp_path),
                                       run_label=contender)
            try:
                record = run.make_machines()
                for task in run.tasks:
                    run._spawn(task, ["sleep", "60"], run_lib._environ())
                # As the kernel holds them: 15 ms of a 10 ms period for the ps, 5 for others.
                assert record["cpu_groups"] == {
                    task: [15000 if task.startswith("ps") else 5000, 10000] for task in tasks}
                for task in run.tasks:
                    assert run.groups.pids(task.name) == [task.process.pid]
                    with open(f"/proc/{task.process.pid}/environ", "rb") as f:
                        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0")
                                   if b"=" in item)
                    # Pools for the machine's share: 2 intra-op threads for 1.5 core.
                    assert (env[b"TF_NUM_INTRAOP_THREADS"], env[b"TF_NUM_INTEROP_THREADS"]) \
                        == ((b"2", b"2") if task.job == "ps" else (b"1", b"2")), task.name
            finally:
                run._stop()
                if run.groups is not None:
                    run.groups.close()
        assert [n for n in os.listdir(parent) if n.startswith(cpu_groups.PREFIX)] == []
    finally:
        os.rmdir(parent)


# Horovod (benchmarks/horovod_contender.py): no build, no process -----------------------


def test_every_horovod_rank_gets_the_gloo_environment_horovodrun_would_give_it():
    from benchmarks import horovod_contender

    hosts = ["worker0", "worker1", "worker2"]
    envs = [horovod_contender.gloo_environment(rank, hosts, "10.77.0.1", 4321, "eth0")
            for rank in range(3)]
    for rank, env in enumerate(envs):
        # Every rank a host of its own with one slot, as horovodrun -H worker0:1,...
        # plans them: ranks across hosts are the cross ranks.
        assert env["HOROVOD_HOSTNAME"] == hosts[rank]
        assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"]) == (str(rank), "3")
        assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == ("0", "1")
        assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == (str(rank), "3")
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.77.0.1"
        assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4321"
        assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env["HOROVOD_GLOO_IFACE"] == "eth0"
    # Only the rank-specific variables differ between ranks.
    differing = {k for k in envs[0] if len({env[k] for env in envs}) > 1}
    assert differing == {"HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_CROSS_RANK"}
    assert horovod_contender.rendezvous_port("noise\nrendezvous serving on port 2345\n") == 2345
    assert horovod_contender.rendezvous_port("starting") is None


def test_horovod_ranks_are_the_workers_each_training_in_horovods_venv(tmp_path):
    from benchmarks import horovod_contender
    from benchmarks import run as run_lib

    options = run_lib.parse(["--model", "lm", "--contenders", "hybrid,horovod",
                             "--workers", "3", "--ps", "2", "--quick"])
    options.model_name, options.global_batch = "lm", 128
    horovod = run_lib.HorovodRun("horovod", options, "loopback", str(tmp_path))
    # mwms's layout: no chief, no ps; every worker trains, worker 0 writes the results.
    assert [t.name for t in horovod.tasks] == ["worker0", "worker1", "worker2"]
    assert horovod.trainers == horovod.tasks and horovod.servers == []
    assert [horovod.trainer_spec(t)["write_result"] for t in horovod.trainers] == \
        [True, False, False]
    assert horovod.python == horovod_contender.venv_python(horovod_contender.VENV)
    assert horovod.TRAINER == "benchmarks.horovod_contender"
    horovod.rendezvous_at = ("127.0.0.1", 4321)
    env = horovod.trainer_environment(horovod.trainers[2], addresses={})
    assert env["HOROVOD_RANK"] == "2" and env["HOROVOD_GLOO_IFACE"] == "lo"
    assert env["TF_USE_LEGACY_KERAS"] == "1" and "TF_CONFIG" not in env
    assert REPO in env["PYTHONPATH"].split(os.pathsep)  # the venv imports benchmarks
    hybrid = run_lib.ContenderRun("hybrid", options, "loopback", str(tmp_path))
    assert [t.name for t in hybrid.tasks] == ["chief", "worker0", "worker1", "worker2",
                                              "ps0", "ps1"]


def _fake_sdist(directory):
    """A horovod-0.28.1.tar.gz holding the lines to patch as published."""
    import tarfile

    from benchmarks import horovod_contender

    source = os.path.join(directory, "src", "horovod-0.28.1")
    for patch in horovod_contender.PATCHES:
        path = os.path.join(source, patch["file"])
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            f.write("// line\n" * (patch["line"] - 1) + "  " + patch["from"] + "\n// end\n")
    with tarfile.open(os.path.join(directory, "horovod-0.28.1.tar.gz"), "w:gz") as archive:
        archive.add(source, arcname="horovod-0.28.1")


def test_a_failed_horovod_build_is_recorded_with_its_last_lines(tmp_path, monkeypatch):
    from benchmarks import horovod_contender
    from benchmarks import tfra_contender

    commands = []

    def run_logged(command, tail, env=None, out=None, width=None):
        commands.append(command)
        if "download" in command:
            _fake_sdist(command[command.index("-d") + 1])
        if "--no-build-isolation" in command:
            # The build sees the sdist patched and Horovod's build flags.
            for patch in horovod_contender.PATCHES:
                with open(os.path.join(command[-1], patch["file"])) as f:
                    lines = f.read().split("\n")
                assert lines[patch["line"] - 1] == "  " + patch["to"]
                assert lines[patch["line"]] == "// end"
            assert env["HOROVOD_WITH_GLOO"] == "1" and env["HOROVOD_WITHOUT_MPI"] == "1"
            tail.extend(["compiling", "xla_mpi_ops.cc:30: error: no such file | here",
                         "error: subprocess-exited-with-error"])
            return 1
        return 0

    monkeypatch.setattr(tfra_contender, "run_logged", run_logged)
    venv = str(tmp_path / "venv")
    record = horovod_contender.ensure_venv(venv, packages_=["tensorflow==2.21.0", "x"],
                                           out=sys.stderr)
    assert [c[3] if c[2] == "pip" else c[2] for c in commands] == \
        ["venv", "install", "install", "download", "install"]
    assert record["error"]["exit_code"] == 1
    assert "--no-build-isolation" in record["error"]["command"]
    assert record["error"]["last_lines"][-1] == "error: subprocess-exited-with-error"
    assert not os.path.exists(os.path.join(venv, horovod_contender.INSTALLED))
    reason = horovod_contender.not_run_reason(record)
    assert reason.startswith("not run: building Horovod's virtualenv failed: `")
    assert "exited 1: compiling / xla_mpi_ops.cc:30: error: no such file / here" in reason
    assert "|" not in reason and "\n" not in reason  # one markdown table cell


def test_without_horovods_venv_the_other_contenders_still_run(tmp_path, monkeypatch):
    from benchmarks import horovod_contender
    from benchmarks import run as run_lib

    failed = {"packages": ["horovod==0.28.1"],
              "error": {"command": "pip install horovod", "exit_code": 1,
                        "last_lines": ["error: no compiler"]}}
    builds, ran = [], []
    monkeypatch.setattr(horovod_contender, "ensure_venv",
                        lambda: builds.append(1) or failed)
    monkeypatch.setattr(run_lib, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(run_lib, "compute_lower_bound", lambda *args: {"error": "skipped"})
    monkeypatch.setattr(run_lib, "run_contender", lambda contender, *args: ran.append(
        contender) or {"contender": contender, "status": "failed", "error": "not started"})
    argv = ["--model", "lm,recommender", "--contenders", "horovod,single", "--quick"]
    options = run_lib.parse(argv)
    runs = {model: run_lib.run_model(options, model, "loopback", "test", argv)
            for model in ("lm", "recommender")}
    assert builds == [1]  # once per invocation
    assert ran == ["single", "single"]
    for run in runs.values():
        assert run["not_run"] == [{"contender": "horovod", "error": failed["error"],
                                   "reason": horovod_contender.not_run_reason(failed)}]
        assert run["horovod_venv"]["error"] == failed["error"]
        assert "| horovod | | | not run: building Horovod's virtualenv failed: " \
            "`pip install horovod` exited 1: error: no compiler |" in run_tables.markdown(run)


def test_an_sdist_unlike_the_published_one_is_refused_unpatched(tmp_path):
    from benchmarks import horovod_contender

    _fake_sdist(str(tmp_path))
    source = tmp_path / "src" / "horovod-0.28.1"
    first, second = horovod_contender.PATCHES[:2]
    (source / second["file"]).write_text("// moved\n")
    with pytest.raises(ValueError, match="gloo_context.cc:282 is 'past its end'"):
        horovod_contender.patch_sdist(str(source))
    assert "  " + first["from"] in (source / first["file"]).read_text()  # left as it was


def test_horovods_venv_is_reused_while_its_record_names_the_same_build(tmp_path, monkeypatch):
    from benchmarks import horovod_contender
    from benchmarks import tfra_contender

    commands = []
    monkeypatch.setattr(tfra_contender, "run_logged",
                        lambda command, *args, **kwargs: commands.append(command) or 1)
    venv, packages = tmp_path / "venv", ["tensorflow==2.21.0", "horovod==0.28.1"]
    venv.mkdir()
    record = {"packages": packages, "build": horovod_contender._build(), "versions": {}}
    (venv / horovod_contender.INSTALLED).write_text(json.dumps(record))
    assert horovod_contender.ensure_venv(str(venv), packages, out=sys.stderr) == record
    assert commands == []
    # Another build (here: no patches) builds again.
    record["build"]["patches"] = []
    (venv / horovod_contender.INSTALLED).write_text(json.dumps(record))
    assert "error" in horovod_contender.ensure_venv(str(venv), packages, out=sys.stderr)
    assert commands[0][2:4] == ["venv", "--clear"]
