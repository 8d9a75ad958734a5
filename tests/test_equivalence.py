"""Distributed training equals single-device training, checked on real clusters.

Each cluster shape runs `tests/scenario.py` once (a module fixture; two shapes at a
time): on a local cluster of real `worker` and `ps` server processes started by the
launcher, with the scenario as the chief, or on this machine alone with two CPU
replicas. The tests then check the report against the single-device reference it
contains.
"""

import functools
import os

import pytest

import scenario
from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "scenario.py")
TOLERANCE = 1e-5


# name -> (launch arguments, Keras flavour). Keras 3 on 1 ps (tables whole, the dense
# gradients summed on the ps), on 3 (tables split, unevenly: 167, 167 and 166 rows; the
# dense gradients all-reduced by the workers) and on one machine; tf_keras on 2 ps (on
# one machine its replicas are checked by tests/test_batch_sizes.py and
# tests/test_asynchronous.py).
SHAPES = {
    "2workers_1ps": (on_cluster(SCENARIO, ps=1), "keras3"),
    "2workers_3ps": (on_cluster(SCENARIO, "--dense-sum", "allreduce", ps=3), "keras3"),
    "one_machine": ([SCENARIO, "--local-replicas", "2"], "keras3"),
    "tf_keras_2workers_2ps": (on_cluster(SCENARIO, ps=2), "tf_keras"),
}


RUNS = Runs({shape: functools.partial(json_report, arguments, f"scenario on {shape}", flavour)
             for shape, (arguments, flavour) in SHAPES.items()})


@pytest.fixture(scope="module", params=list(SHAPES))
def report(request):
    return request.param, RUNS.result(request.param)


def num_ps(shape):
    return 0 if shape.endswith("one_machine") else int(shape.split("_")[-1][0])


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
    table_devices = devices["embedding/embeddings"]
    if num_ps(shape):
        # The 16 KB table is split by rows over every PS task, one shard each.
        assert table_devices == [f"/job:ps/replica:0/task:{i}/device:CPU:0"
                                 for i in range(num_ps(shape))]
    else:
        assert table_devices == ["/job:localhost/replica:0/task:0/device:CPU:0"]
    for path in ("hidden/kernel", "hidden/bias", "out/kernel", "out/bias"):
        if num_ps(shape):
            assert sorted(devices[path]) == [
                f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
        else:
            assert [d.rsplit(":", 1)[1] for d in devices[path]] == ["0", "1"]
    assert result["sgd"]["placement"]["hidden/kernel"] == "mirrored"


def test_every_table_has_rows_on_every_ps_task(report):
    shape, result = report
    placement = result["two_tables"]["placement"]
    for table in ("embedding/embeddings", "embedding_b/embeddings"):
        tasks = placement[table]
        if num_ps(shape):
            assert sorted(tasks) == list(range(num_ps(shape)))
        else:
            assert tasks == [None]


def test_large_table_and_its_slots_live_on_the_ps_only(report):
    shape, result = report
    large = result["large_table"]
    assert large["shape"] == [100_000, 64]
    # Adagrad moves exactly the rows the batch looked up.
    assert large["rows_changed"] == large["distinct_ids"]
    if num_ps(shape):
        expected = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(num_ps(shape))]
        assert large["shard_devices"] == expected
        assert all(rows > 0 for rows in large["shard_rows"])
        assert sum(large["shard_rows"]) == 100_000
        assert max(large["shard_rows"]) - min(large["shard_rows"]) <= 1
        (slot,) = large["slot_devices"].values()
        assert slot == expected
        assert "/job:worker" not in large["placement_table"]


def test_table_gradients_summed_per_worker_then_on_the_ps(report):
    _, result = report
    assert result["sgd"]["ps_aggregated"] == ["embedding/embeddings"]
    assert result["adam_lazy"]["ps_aggregated"] == [
        "embedding/embeddings", "embedding_b/embeddings"]
    assert result["two_tables"]["ps_aggregated"] == [
        "embedding/embeddings", "embedding_b/embeddings"]
    assert result["sgd"]["gradient_types"]["embedding/embeddings"] == "sparse"
    # A dense variable forced onto the PS is summed there too, parameter-server style.
    assert result["forced"]["ps_aggregated"] == ["hidden/kernel"]
    # The tape merges the tied table's sparse and dense gradients into one dense
    # tensor: that one is all-reduced among the workers (then applied on the PS
    # under tf_keras; Keras 3 mirrors the table after its first step).
    assert result["tied"]["ps_aggregated"] == []


def test_misfit_placements_warn_once_each(report):
    shape, result = report
    assert result["sgd"]["warnings"] == []
    if shape.startswith("tf_keras"):
        (tied,) = result["tied"]["warnings"]
        assert "'embedding/embeddings' is on a PS but gets a dense gradient" in tied
    else:  # Keras 3's fit moves the tied table to mirrored after its first step
        assert result["tied"]["warnings"] == []
        assert result["tied"]["placement"]["embedding/embeddings"] == "mirrored"
    forced = result["forced"]["warnings"]
    assert len(forced) == 2
    assert any("'embedding/embeddings' is mirrored but gets a sparse" in w for w in forced)
    assert any("'hidden/kernel' is on a PS but gets a dense gradient" in w for w in forced)


@pytest.mark.parametrize("case", scenario.INFERENCE_CASES)
def test_predict_and_evaluate_match_single_device(report, case):
    _, result = report
    case = result[case]
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


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_steps_per_execution_trains_as_single_steps(report, optimizer):
    shape, result = report
    case = result["multi_step"][optimizer]
    assert case["moved"] > 1e-3, "training did not change the weights"
    # 8 batches: 8 calls of one step, or calls of 3, 3 and 2 steps.
    assert case["calls"] == [8, 3]
    errors = case["relative_errors"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"steps_per_execution=3: {worst} differs from one step per call by "
        f"{errors[worst]:.2e} (relative)")
    single, multi = case["evaluate_loss"]
    assert multi == pytest.approx(single, rel=TOLERANCE)
    single, multi = case["loss"]
    assert multi == pytest.approx(single, rel=TOLERANCE)
    if num_ps(shape):
        assert all(d.startswith("/job:ps/") for d in case["table_devices"][1])
