"""A worker or ps task killed during training ends the chief with exit code 75, naming it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from runs import FAULTY_CHIEF

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

@pytest.mark.parametrize("victim", [1, 2], ids=["worker", "ps"])
def test_killed_task_ends_the_chief_with_exit_75_naming_it(victim):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    env.pop("TF_CONFIG", None)
    run = subprocess.run(
        [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
         "--", sys.executable, "-c", FAULTY_CHIEF, str(victim), "SIGKILL"],
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
