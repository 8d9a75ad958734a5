"""Distributed training equals single-device training, checked on real clusters.

Each cluster shape runs `tests/scenario.py` once (a session fixture): on a local
cluster of real `worker` and `ps` server processes started by the launcher, with
the scenario as the chief, or on this machine alone with two CPU replicas. The
tests then check the report against the single-device reference it contains.
"""

import json
import os
import subprocess
import sys

import pytest

import scenario

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "scenario.py")
TOLERANCE = 1e-5
SHAPES = {
    "2workers_1ps": ["-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
                     "--", sys.executable, SCENARIO],
    "2workers_2ps": ["-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "2",
                     "--", sys.executable, SCENARIO],
    "one_machine": [SCENARIO, "--local-replicas", "2"],
}


@pytest.fixture(scope="session", params=list(SHAPES))
def report(request):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable] + SHAPES[request.param], env=env,
                         capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(HERE))
    if run.returncode != 0:
        pytest.fail(f"scenario on {request.param} exited {run.returncode}:\n"
                    f"{run.stderr[-6000:]}")
    return request.param, json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(scenario.CASES))
def test_weights_match_single_device(report, case):
    _, result = report
    errors = result[case]["relative_errors"]
    assert errors, "no weights compared"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"{case}: {worst} differs from single-device training by "
        f"{errors[worst]:.2e} (relative)")


def test_embeddings_on_ps_dense_weights_on_every_worker(report):
    shape, result = report
    devices = result["sgd"]["devices"]
    (table_device,) = devices["embedding/embeddings"]
    expected_job = "/job:localhost/" if shape == "one_machine" else "/job:ps/"
    assert table_device.startswith(expected_job)
    for path in ("hidden/kernel", "hidden/bias", "out/kernel", "out/bias"):
        if shape == "one_machine":
            assert [d.rsplit(":", 1)[1] for d in devices[path]] == ["0", "1"]
        else:
            assert sorted(devices[path]) == [
                f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
    assert result["sgd"]["placement"]["hidden/kernel"] == "mirrored"


def test_tables_balanced_over_ps_tasks(report):
    shape, result = report
    placement = result["two_tables"]["placement"]
    if shape == "2workers_2ps":
        assert placement["embedding/embeddings"] == "/job:ps/task:0"
        assert placement["embedding_b/embeddings"] == "/job:ps/task:1"
        assert result["two_tables"]["devices"]["embedding_b/embeddings"][0].startswith(
            "/job:ps/replica:0/task:1/")
    elif shape == "2workers_1ps":
        assert set(placement.values()) == {"/job:ps/task:0", "mirrored"}


def test_sparse_gradients_summed_on_the_ps(report):
    _, result = report
    assert result["sgd"]["ps_aggregated"] == ["embedding/embeddings"]
    assert result["two_tables"]["ps_aggregated"] == [
        "embedding/embeddings", "embedding_b/embeddings"]
    assert result["sgd"]["gradient_types"]["embedding/embeddings"] == "sparse"


def test_misfit_placements_warn_once_each(report):
    _, result = report
    assert result["sgd"]["warnings"] == []
    (tied,) = result["tied"]["warnings"]
    assert "'embedding/embeddings' is on a PS but gets a dense gradient" in tied
    forced = result["forced"]["warnings"]
    assert len(forced) == 2
    assert any("'embedding/embeddings' is mirrored but gets a sparse" in w for w in forced)
    assert any("'hidden/kernel' is on a PS but gets a dense gradient" in w for w in forced)


def test_predict_and_evaluate_match_single_device(report):
    _, result = report
    case = result["adagrad"]
    assert case["predict_error"] <= TOLERANCE
    assert case["evaluate_loss"] == pytest.approx(case["reference_loss"], rel=TOLERANCE)


@pytest.mark.parametrize("source", ["dataset", "numpy"])
def test_every_example_used_once_per_epoch(report, source):
    _, result = report
    counted = result[f"count_{source}"]
    assert len(counted["uses_per_example"]) == scenario.COUNT_EXAMPLES
    assert set(counted["uses_per_example"]) == {1.0}
    # 3 full global batches and a final one of a single example.
    assert counted["batches"] == 4
    assert counted["loss_finite"]
