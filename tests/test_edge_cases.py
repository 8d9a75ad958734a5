"""Clipping, bad ids, empty datasets and type-checking Keras features on a real cluster.

For each Keras flavour (both at once), `tests/edge_scenario.py` runs every case once as
the chief of a 2-worker + 1-ps cluster (a module fixture), and once more, for the mixed
precision reference, under tf.distribute.MirroredStrategy over two local CPUs.
"""

import os

import numpy as np
import pytest

from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "edge_scenario.py")
TOLERANCE = 1e-5
OUT_OF_RANGE = ("embedding id out of range for table {table} (500 rows): "
                "ids must be in [0, 500)")


FLAVOURS = ("keras3", "tf_keras")


def reports(flavour, out_dir):
    """The cluster's report, then the MirroredStrategy reference's."""
    result = json_report(on_cluster(SCENARIO, out_dir, workers=2, ps=1),
                         f"edge cases on a cluster ({flavour})", flavour, timeout=1200)
    reference = json_report([SCENARIO, "--mirrored-reference", out_dir],
                            f"the MirroredStrategy reference ({flavour})", flavour,
                            timeout=1200)
    return result, reference


RUNS = Runs.in_directories(reports, FLAVOURS)


@pytest.fixture(scope="module", params=FLAVOURS)
def report(request):
    result, reference = RUNS.result(request.param)
    assert result["replicas"] == 2
    return result, reference


@pytest.mark.parametrize("kind", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_equals_single_device_clipping_of_the_global_gradient(report, kind):
    case = report[0]["clipping"][kind]
    assert case["sparse_gradient"] == "sparse"
    assert case["clipping_effect"] > 1e-2, "clipping did not change training"
    assert case["relative_error"] <= TOLERANCE, (
        f"{kind}: differs from single-device training by {case['relative_error']:.2e}")


@pytest.mark.parametrize("placement", ["ps", "mirrored"])
@pytest.mark.parametrize("bad", ["negative", "too_large"])
@pytest.mark.parametrize("call", ["predict", "fit"])
def test_ids_out_of_range_get_one_clear_error(report, placement, bad, call):
    error = report[0]["bad_ids"][placement][f"{bad}_{call}"]
    assert error is not None, f"{bad} id trained or predicted silently"
    assert OUT_OF_RANGE.format(table="embedding/embeddings") in error


@pytest.mark.parametrize("placement", ["ps", "mirrored"])
def test_fractional_ids_are_refused_and_whole_float_ids_work(report, placement):
    case = report[0]["bad_ids"][placement]
    assert "embedding ids for table float_ids/embeddings must be whole numbers" in (
        case["fractional"] or "")
    assert case["whole_floats_error"] == 0.0


def test_float_ids_looked_up_in_a_ps_table_are_refused(report):
    error = report[0]["bad_ids"]["ps"]["lookup_float"]
    assert error.startswith("TypeError: ids looked up in table embedding/embeddings "
                            "must be integers")


def test_empty_dataset_is_refused(report):
    assert report[0]["empty_dataset"].startswith(
        "ValueError: HybridStrategy: the dataset is empty")


def test_backup_and_restore_resumes_where_training_stopped(report):
    case = report[0]["backup_and_restore"]
    assert case["interrupted"] == "RuntimeError: interrupted"
    assert case["epochs_run_after_restore"] == [2]
    assert case["relative_error"] <= TOLERANCE


def test_h5_weights_and_models_round_trip(report):
    case = report[0]["h5"]
    assert case["weights_error"] == 0.0
    assert case["model_weights_error"] == 0.0
    assert case["model_predict_error"] == 0.0


def test_mixed_float16_trains_as_under_mirrored_strategy(report):
    result, reference = report
    assert result["policy"]["compute_dtype"] == "float16"
    assert result["policy"] == reference["policy"]
    actual = [np.asarray(w) for w in result["mixed_precision_weights"]]
    expected = [np.asarray(w) for w in reference["mixed_precision_weights"]]
    for a, e in zip(actual, expected):
        error = np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 0.01)
        assert error <= TOLERANCE, f"differs from MirroredStrategy by {error:.2e}"
