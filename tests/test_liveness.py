"""Liveness: a hung task, a silent listener, restarts. Real processes on loopback.

The launcher runs that restart after a lost task (and the one that loses none) run in
the background, two at a time; the tests whose timing matters run alone.
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent import futures

import numpy as np
import pytest

import hybrid_strategy
from hybrid_strategy.cluster import config as cluster
from hybrid_strategy.cluster.launch import LocalCluster
from runs import FAULTY_CHIEF, SMALL_CHIEF, Runs, environ, on_cluster, python

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")

def test_a_hung_worker_ends_the_chief_with_exit_75_naming_it():
    # SIGSTOP: the kernel still accepts connections for the worker, TensorFlow would wait
    # for it forever.
    run = python(on_cluster("-c", FAULTY_CHIEF, "1", "SIGSTOP", workers=2, ps=1),
                 env=environ(), timeout=300)
    ended = time.monotonic()
    assert run.returncode == 75, run.stderr[-3000:]
    job, index, address, stopped_at = json.loads(run.stdout.splitlines()[0])
    assert (job, index) == ("worker", 1)
    # task_timeout=10, probes every 2 s: the chief ends well within 40 s, and the launcher
    # then gives the stopped worker 5 s to end before it kills it.
    assert ended - stopped_at < 45
    assert f"1 task(s) stopped answering for 10 s:\n  /job:worker/task:1 at {address} " \
           "(it accepted the connection but sent no HTTP/2 answer" in run.stderr


def test_a_silent_listener_fails_start_up_within_connect_timeout(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("TF_CONFIG", json.dumps({
            "cluster": {"chief": [f"127.0.0.1:{cluster.free_port()}"], "worker": [address],
                        "ps": [f"127.0.0.1:{cluster.free_port()}"]},
            "task": {"type": "chief", "index": 0}}))
        started = time.monotonic()
        with pytest.raises(hybrid_strategy.TaskUnreachableError) as error:
            hybrid_strategy.HybridStrategy(connect_timeout=3.0)
        assert time.monotonic() - started < 30
    message = str(error.value)
    assert message.startswith("2 task(s) did not answer within 3 s:")
    assert f"/job:worker/task:0 at {address} (it accepted the connection but sent no " \
           "HTTP/2 answer" in message
    assert "/job:ps/task:0 at 127.0.0.1:" in message


# Trains 4 epochs with BackupAndRestore and saves every weight, slot and counter, and the
# id -> row map of its DynamicEmbedding (ids, rows, counts, last steps, free rows,
# admissions and evictions). On its first run it kills, in epoch 2, server number `victim` of HYBRID_STRATEGY_SERVER_PIDS or,
# with "chief", itself; -1 kills nothing.
RESTARTING_CHIEF = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import tensorflow as tf
    import hybrid_strategy
    keras = tf.keras
    backup_dir, out, victim = sys.argv[1:4]
    first_run = os.environ.get("HYBRID_STRATEGY_RESTART_COUNT", "0") == "0"
    strategy = hybrid_strategy.HybridStrategy(task_timeout=10)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        ids = keras.Input((4,), dtype="int32")
        table = keras.layers.Flatten()(keras.layers.Embedding(1000, 8)(ids))
        dynamic = hybrid_strategy.DynamicEmbedding(8, capacity=100, min_count=2,
                                                   max_waiting=2000, combiner="sum",
                                                   name="dynamic")(ids)
        x = keras.layers.Dense(4, activation="relu")(
            keras.layers.Concatenate()([table, dynamic]))
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.randint(0, 1000, (256, 4)).astype("int32")
    y = rng.normal(size=(256, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    epochs = []

    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

        def on_train_batch_end(self, batch, logs=None):
            if first_run and victim != "-1" and epochs[-1] == 2 and batch == 3:
                pids = os.environ["HYBRID_STRATEGY_SERVER_PIDS"].split(",")
                os.kill(os.getpid() if victim == "chief" else int(pids[int(victim)]),
                        signal.SIGKILL)

    model.fit(data, epochs=4, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup_dir, save_freq="epoch"), Kill()])
    state = {f"weight {i}": w for i, w in enumerate(model.get_weights())}
    state.update({f"optimizer {v.path}": v.numpy() for v in model.optimizer.variables})
    snapshot = model.get_layer("dynamic").remap.snapshot()
    order = np.argsort(snapshot["keys"])
    state.update({"map keys": snapshot["keys"][order], "map values": snapshot["values"][order],
                  "map free rows": snapshot["free"], "map counters": snapshot["counters"]})
    np.savez(out, epochs_run=np.array(epochs), **state)
""")


# Launcher runs of RESTARTING_CHIEF: name -> (victim, restarts allowed).
RESTARTS = {"uninterrupted": (-1, 0), "worker": (1, 2), "ps": (2, 2)}


def restarting_launcher(name, directory):
    """(the launcher's run, the state file) of RESTARTS[name]."""
    victim, max_restarts = RESTARTS[name]
    out = os.path.join(directory, "state.npz")
    run = python(on_cluster("-c", RESTARTING_CHIEF, os.path.join(directory, "backup"), out,
                            str(victim), workers=2, ps=1,
                            launcher=("--max-restarts", str(max_restarts))),
                 env=environ(), timeout=600)
    return run, out


def load(path):
    with np.load(path) as state:
        return {name: state[name] for name in state.files}


RESTART_RUNS = Runs.in_directories(restarting_launcher, RESTARTS)


@pytest.fixture(scope="module")
def uninterrupted():
    run, out = RESTART_RUNS.result("uninterrupted")
    assert run.returncode == 0, run.stderr[-3000:]
    state = load(out)
    assert list(state.pop("epochs_run")) == [0, 1, 2, 3]
    return state


def assert_same_state(state, expected):
    assert sorted(state) == sorted(expected)
    # The dynamic table admitted and evicted ids: its map is compared too.
    assert expected["map counters"][1] > 100 and expected["map counters"][2] > 0
    assert any(name.startswith("optimizer adam/") and "velocity" in name for name in state)
    assert state["optimizer adam/iteration"] == 32  # 4 epochs of 8 steps
    for name, value in expected.items():
        assert state[name].dtype == value.dtype and np.array_equal(state[name], value), name


@pytest.mark.parametrize("victim, task", [("worker", "/job:worker/task:1"),
                                          ("ps", "/job:ps/task:0")], ids=["worker", "ps"])
def test_launcher_restarts_after_a_killed_task_and_resumes_from_the_backup(
        uninterrupted, victim, task):
    run, out = RESTART_RUNS.result(victim)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (f"hybrid_strategy.launch: server {task} (pid " in run.stderr
            and "was killed by SIGKILL; the chief exited with code 75 (a task was lost); "
                "restarting the cluster and the chief (restart 1 of 2)." in run.stderr), \
        run.stderr[-3000:]
    assert "restart 2 of 2" not in run.stderr
    state = load(out)
    # The second run started from the backup of epoch 1, not from scratch.
    assert list(state.pop("epochs_run")) == [2, 3]
    assert_same_state(state, uninterrupted)


def ps_rss_mb(local):
    with open(f"/proc/{local.pids[-1]}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def test_a_chief_restarted_against_the_same_servers_resumes_without_stale_state(
        tmp_path, uninterrupted):
    """A chief killed and restarted at once (Kubernetes restarts only the chief's pod):
    the servers it finds hold nothing of its predecessor."""
    out = tmp_path / "state.npz"
    command = ["-c", RESTARTING_CHIEF, str(tmp_path / "backup"), str(out), "chief"]
    with LocalCluster(workers=2, ps=1) as local:
        first = python(command, env=local.chief_environ(environ()), timeout=300)
        assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
        rss_after_kill = ps_rss_mb(local)
        second = python(command, env=dict(local.chief_environ(environ()),
                                          HYBRID_STRATEGY_RESTART_COUNT="1"), timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
        print(f"ps RSS: {rss_after_kill} MB after the kill, {ps_rss_mb(local)} MB after "
              "the restarted chief trained")
        assert all(process.poll() is None for process in local.processes)
    state = load(out)
    assert list(state.pop("epochs_run")) == [2, 3]
    assert_same_state(state, uninterrupted)


def servers_output_until_serving_again(capfd, servers):
    """What a `quiet=False` cluster's `servers` printed until each says it serves anew
    (at most 120 s)."""
    output = ""
    deadline = time.monotonic() + 120
    while output.count("serving on") < servers and time.monotonic() < deadline:
        time.sleep(0.5)
        output += capfd.readouterr().err
    return output


def test_servers_start_afresh_when_their_chief_is_gone(capfd):
    grpc = pytest.importorskip("grpc")
    with LocalCluster(workers=1, ps=1, quiet=False) as local:
        chief_address = local.config.address("chief", 0)
        # Any gRPC server answers the servers' probes as a chief's would.
        chief = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        chief.add_insecure_port(chief_address)
        chief.start()
        time.sleep(3)  # the servers see the chief answer
        capfd.readouterr()
        chief.stop(None)
        output = servers_output_until_serving_again(capfd, servers=2)
        for job in ("worker", "ps"):
            assert (f"hybrid_strategy.server: /job:{job}/task:0: the chief at {chief_address} "
                    "has not answered for 5 s (connection refused); starting afresh to drop "
                    "its variables.") in output
            # On loopback the tasks share this machine's cores: their idle threads sleep.
            assert (f"/job:{job}/task:0 serving on {local.config.address(job, 0)}; idle "
                    "threads sleep") in output
        # Same processes, same ports, serving again.
        assert all(process.poll() is None for process in local.processes)
        cluster.wait_for_tasks(local.config, timeout=60)


# Trains one epoch, waits for a line on stdin, trains again.
PAUSED_CHIEF = SMALL_CHIEF + textwrap.dedent("""
    model.fit(x, y, batch_size=32, verbose=0)
    print("trained", flush=True)
    sys.stdin.readline()
    model.fit(x, y, batch_size=32, verbose=0)
    print("trained again", flush=True)
""")


def test_a_chief_stopped_longer_than_the_chief_timeout_exits_75_when_it_resumes(capfd):
    with LocalCluster(workers=2, ps=1, quiet=False) as local:
        chief = subprocess.Popen([sys.executable, "-c", PAUSED_CHIEF],
                                 env=local.chief_environ(ENV), cwd=REPO,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([chief.stdout], [], [], 180)
            assert ready and chief.stdout.readline() == "trained\n"
            capfd.readouterr()
            os.kill(chief.pid, signal.SIGSTOP)
            # The servers start afresh 5 s after the chief went silent.
            servers_output_until_serving_again(capfd, servers=3)
            os.kill(chief.pid, signal.SIGCONT)
            stdout, stderr = chief.communicate("go\n", timeout=120)
        finally:
            if chief.poll() is None:
                chief.kill()
                chief.wait()
    assert chief.returncode == 75, stderr[-3000:]
    assert "trained again" not in stdout
    # Either the step fails on servers that forgot the chief, or the monitor, resuming too,
    # finds one still starting afresh.
    assert "HybridStrategy: lost " in stderr or " stopped answering for 10 s:" in stderr
    assert "/job:ps/task:0 at " in stderr or "/job:worker/task:" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
