"""A worker or ps task killed during training ends the chief with exit code 75, naming it.

The launcher runs go in the background, two at a time.
"""

import functools
import json
import textwrap

import pytest

from runs import FAULTY_CHIEF, Runs, environ, on_cluster, python

pytestmark = pytest.mark.cluster


# FAULTY_CHIEF's victims: the server that it kills.
VICTIMS = {"worker": 1, "ps": 2}
# A chief raising UnavailableError, as a lost task would make TensorFlow raise, but with
# every task answering.
UNAVAILABLE_CHIEF = textwrap.dedent("""
    import tensorflow as tf
    import hybrid_strategy
    hybrid_strategy.HybridStrategy()
    raise tf.errors.UnavailableError(None, None, "the data server is down")
""")


def launched(workers, *chief):
    return python(on_cluster("-c", *chief, workers=workers, ps=1), env=environ(), timeout=240)


RUNS = Runs({**{victim: functools.partial(launched, 2, FAULTY_CHIEF, str(server), "SIGKILL")
                for victim, server in VICTIMS.items()},
             "unavailable": functools.partial(launched, 1, UNAVAILABLE_CHIEF)})


@pytest.mark.parametrize("victim", VICTIMS)
def test_killed_task_ends_the_chief_with_exit_75_naming_it(victim):
    run = RUNS.result(victim)
    assert run.returncode == 75, run.stderr[-3000:]
    job, index, address, _ = json.loads(run.stdout.splitlines()[0])
    assert "training went on" not in run.stdout
    # One message naming the task, whether TensorFlow raised (a connection reset) or the
    # monitor noticed first; no TensorFlow traceback.
    assert f"/job:{job}/task:{index} at {address} (" in run.stderr, run.stderr[-3000:]
    assert "Exiting with code 75" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.fixture
def unavailable():
    return RUNS.result("unavailable")


def test_an_error_no_lost_task_caused_is_left_alone(unavailable):
    # UnavailableError, as a lost task would raise, but every task answers and none is named.
    assert unavailable.returncode == 1, unavailable.stderr[-3000:]
    assert "UnavailableError: the data server is down" in unavailable.stderr
    assert "Traceback" in unavailable.stderr and "HybridStrategy: lost" not in unavailable.stderr
