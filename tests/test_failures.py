"""A worker or ps task that dies during training ends the program in bounded time."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

# Trains, kills one server of the launcher's cluster, and trains on.
CHIEF = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import tensorflow as tf
    import hybrid_strategy
    keras = tf.keras
    strategy = hybrid_strategy.HybridStrategy(task_timeout=4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(1000, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.randint(0, 1000, (256, 4)).astype("int32")
    y = np.zeros((256, 1), "float32")
    model.fit(x, y, batch_size=32, verbose=0)
    pids = os.environ["HYBRID_STRATEGY_SERVER_PIDS"].split(",")
    os.kill(int(pids[int(sys.argv[1])]), signal.SIGKILL)   # workers first, then ps
    model.fit(x, y, batch_size=32, epochs=10_000, verbose=0)
    print("training went on without the task")
""")


@pytest.mark.parametrize("victim, task", [(2, "/job:ps/task:0"), (1, "/job:worker/task:1")])
def test_lost_task_ends_the_chief_with_a_clear_error(victim, task):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
         "--", sys.executable, "-c", CHIEF, str(victim)],
        env=env, capture_output=True, text=True, timeout=240)
    assert "training went on" not in run.stdout
    assert time.monotonic() - start < 120
    if run.returncode == 75:
        # TensorFlow kept waiting on the task; the strategy's monitor ended it.
        assert f"{task} at 127.0.0.1:" in run.stderr
        assert "stopped answering for 4 s" in run.stderr
    else:
        # TensorFlow noticed first (a connection reset while starting the step).
        assert run.returncode == 1, run.stderr[-3000:]
        assert "UnavailableError" in run.stderr, run.stderr[-3000:]
