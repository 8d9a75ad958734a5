"""A worker or ps task killed during training ends the chief with exit code 75, naming it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Trains, kills one server of the launcher's cluster (workers first, then ps) in the middle
# of an epoch, and trains on.
CHIEF = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import tensorflow as tf
    import hybrid_strategy
    keras = tf.keras
    victim = int(sys.argv[1])
    strategy = hybrid_strategy.HybridStrategy(task_timeout=10)
    tasks = [t for t in strategy.cluster.tasks() if t[0] != "chief"]
    print(json.dumps(tasks[victim]), flush=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(1000, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.randint(0, 1000, (256, 4)).astype("int32")
    y = np.zeros((256, 1), "float32")
    pid = int(os.environ["HYBRID_STRATEGY_SERVER_PIDS"].split(",")[victim])

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                os.kill(pid, signal.SIGKILL)

    model.fit(x, y, batch_size=32, epochs=10_000, verbose=0, callbacks=[Kill()])
    print("training went on without the task")
""")


@pytest.mark.parametrize("victim", [1, 2], ids=["worker", "ps"])
def test_killed_task_ends_the_chief_with_exit_75_naming_it(victim):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    env.pop("TF_CONFIG", None)
    run = subprocess.run(
        [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
         "--", sys.executable, "-c", CHIEF, str(victim)],
        env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 75, run.stderr[-3000:]
    job, index, address = json.loads(run.stdout.splitlines()[0])
    assert "training went on" not in run.stdout
    # One message naming the task, whether TensorFlow raised (a connection reset) or the
    # monitor noticed first; no TensorFlow traceback.
    assert f"/job:{job}/task:{index} at {address} (" in run.stderr, run.stderr[-3000:]
    assert "Exiting with code 75" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


def test_an_error_no_lost_task_caused_is_left_alone():
    # UnavailableError, as a lost task would raise, but every task answers and none is named.
    chief = textwrap.dedent("""
        import tensorflow as tf
        import hybrid_strategy
        hybrid_strategy.HybridStrategy()
        raise tf.errors.UnavailableError(None, None, "the data server is down")
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    run = subprocess.run(
        [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "1", "--ps", "1",
         "--", sys.executable, "-c", chief],
        env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "UnavailableError: the data server is down" in run.stderr
    assert "Traceback" in run.stderr and "HybridStrategy: lost" not in run.stderr
