"""Liveness: a hung task, a silent listener, restarts. Real processes on loopback."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import hybrid_strategy
from hybrid_strategy import cluster
from hybrid_strategy.launch import LocalCluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")

# Trains and stops (SIGSTOP) worker 1 in the middle of an epoch: the kernel still accepts
# connections for it, TensorFlow waits for it forever.
HANGING_CHIEF = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import tensorflow as tf
    import hybrid_strategy
    keras = tf.keras
    strategy = hybrid_strategy.HybridStrategy(task_timeout=10)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(1000, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.randint(0, 1000, (256, 4)).astype("int32")
    y = np.zeros((256, 1), "float32")
    pid = int(os.environ["HYBRID_STRATEGY_SERVER_PIDS"].split(",")[1])

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                os.kill(pid, signal.SIGSTOP)
                print("stopped", flush=True)

    model.fit(x, y, batch_size=32, epochs=10_000, verbose=0, callbacks=[Stop()])
    print("training went on without the task")
""")


def test_a_hung_worker_ends_the_chief_with_exit_75_naming_it():
    with LocalCluster(workers=2, ps=1) as local:
        stopped_pid = local.pids[1]
        chief = subprocess.Popen([sys.executable, "-c", HANGING_CHIEF],
                                 env=local.chief_environ(ENV), cwd=REPO,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([chief.stdout], [], [], 180)
            assert ready and chief.stdout.readline() == "stopped\n", chief.stderr.read()
            # task_timeout=10, probes every 2 s: the chief ends well within 40 s.
            _, stderr = chief.communicate(timeout=40)
        finally:
            os.kill(stopped_pid, signal.SIGCONT)  # let close() stop it normally
            if chief.poll() is None:
                chief.kill()
                chief.wait()
    assert chief.returncode == 75, stderr[-3000:]
    address = local.config.address("worker", 1)
    assert f"1 task(s) stopped answering for 10 s:\n  /job:worker/task:1 at {address} " \
           "(it accepted the connection but sent no HTTP/2 answer" in stderr
    assert all(process.poll() is not None for process in local.processes)


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
