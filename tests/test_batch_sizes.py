"""Any batch size trains as one device: uneven splits, partial and tiny batches.

`tests/batch_sizes.py` runs once per shape (two shapes at a time): on one machine
with two CPU replicas, every case, beside tf.distribute.MirroredStrategy on the same
replicas, under Keras 3 and tf_keras; on a real cluster of 2 workers and 2 ps started
by the launcher (and under Keras 3 of 4 workers of 2 CPU replicas each, whose replicas
are summed on their worker first and whose dense sum takes other messages), the cases whose arithmetic crosses workers (an uneven split, an empty replica,
and under Keras 3 a divisor summed over the replicas). Each case is checked against one
device training on the same global batches.
"""

import functools
import math
import os

import pytest

import batch_sizes
from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "batch_sizes.py")
TOLERANCE = 1e-5
ONE_MACHINE = [SCRIPT, "--local-replicas", "2", "--mirrored", "--layers"]
CLUSTER_CASES = ["numpy_97", "dataset_265_final_1", "dataset_batch_1"]


def on_workers_2ps(cases, workers=2, devices_per_worker=1):
    return on_cluster(SCRIPT, "--cases", ",".join(cases), workers=workers, ps=2,
                      devices_per_worker=devices_per_worker)


# name -> (arguments after python, Keras flavour, cases)
SHAPES = {
    "one_machine": (ONE_MACHINE, "keras3", list(batch_sizes.CASES)),
    "tf_keras_one_machine": (ONE_MACHINE, "tf_keras", list(batch_sizes.CASES)),
    "2workers_2ps": (on_workers_2ps(CLUSTER_CASES + ["sequence_masked"]), "keras3",
                     CLUSTER_CASES + ["sequence_masked"]),
    "tf_keras_2workers_2ps": (on_workers_2ps(CLUSTER_CASES), "tf_keras", CLUSTER_CASES),
    "4workers_of_2_replicas_2ps": (on_workers_2ps(CLUSTER_CASES, workers=4,
                                                  devices_per_worker=2),
                                   "keras3", CLUSTER_CASES),
}
# Replicas in sync of each shape on a cluster: every worker's CPU devices.
CLUSTER_REPLICAS = {"2workers_2ps": 2, "tf_keras_2workers_2ps": 2,
                    "4workers_of_2_replicas_2ps": 8}
RUNS = Runs({shape: functools.partial(json_report, arguments, f"batch sizes on {shape}",
                                      flavour, timeout=1800)
             for shape, (arguments, flavour, _) in SHAPES.items()})


@pytest.fixture(scope="module")
def run_shape():
    """`run_shape(shape)`: the report of `tests/batch_sizes.py` on `shape`, run once."""
    return RUNS.result


def shape_cases():
    for shape, (_, _, cases) in SHAPES.items():
        for case in cases:
            yield pytest.param(shape, case, id=f"{shape}-{case}")


def assert_close(errors, what):
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"{what}: {worst} differs from one device by {errors[worst]:.2e} (relative)")


@pytest.mark.parametrize("shape", list(CLUSTER_REPLICAS))
def test_each_cluster_shape_trains_on_all_its_replicas(run_shape, shape):
    assert run_shape(shape)["replicas"] == CLUSTER_REPLICAS[shape]


@pytest.mark.parametrize("shape, case", list(shape_cases()))
def test_training_equals_one_device(run_shape, shape, case):
    result = run_shape(shape)["cases"][case]
    assert result["moved"] > 1e-2, "training did not change the weights"
    assert_close({"weights": result["weights"]}, "fit")


@pytest.mark.parametrize("shape, case", list(shape_cases()))
def test_logged_loss_and_metrics_equal_one_device(run_shape, shape, case):
    result = run_shape(shape)["cases"][case]
    assert_close(result["batch_logs"], "the logs after each batch")
    assert_close(result["epoch_logs"], "the epoch's logs")


@pytest.mark.parametrize("shape, case", list(shape_cases()))
def test_evaluate_and_predict_equal_one_device(run_shape, shape, case):
    result = run_shape(shape)["cases"][case]
    assert_close(result["evaluate"], "evaluate")
    assert_close({"predictions": result["predict"]}, "predict")


@pytest.mark.parametrize("shape", ["one_machine", "tf_keras_one_machine"])
@pytest.mark.parametrize("case", list(batch_sizes.MIRRORED_CASES))
def test_mirrored_strategy_does_not_train_as_one_device(run_shape, shape, case):
    result = run_shape(shape)["mirrored"][case]
    assert_close({"weights": result["hybrid"]["weights"]}, "HybridStrategy")
    mirrored = result["mirrored"]
    if isinstance(mirrored, str):
        # Keras 3 fails before training on batches that split unevenly.
        assert shape == "one_machine" and case == "numpy_97", mirrored
        assert "Inputs to operation AddN of type AddN must have the same size" in mirrored
    else:
        # It divides each replica's mean by the number of replicas.
        assert mirrored["weights"] > 1e-3


@pytest.mark.parametrize("shape", ["one_machine", "tf_keras_one_machine"])
def test_convolutions_on_an_empty_cpu_replica_get_a_clear_error(run_shape, shape):
    error = run_shape(shape)["layers"]["convolution"]
    assert error.startswith("InvalidArgumentError"), error
    assert ("a replica got no rows in this step (a global batch of fewer rows than the 2 "
            "replicas, often the last one), and the oneDNN convolutions of TensorFlow 2.21 "
            "on CPU return a wrong shape for zero rows") in error
    assert "batch with drop_remainder=True" in error


def test_per_replica_batch_statistics_of_an_empty_replica_get_a_clear_error(run_shape):
    error = run_shape("one_machine")["layers"]["unsynchronized_batchnorm"]
    assert error.startswith("InvalidArgumentError"), error
    assert "BatchNormalization layer norm computes its statistics per replica" in error
    assert "Use BatchNormalization(synchronized=True)" in error


def test_tf_keras_sets_aside_the_statistics_of_an_empty_replica(run_shape):
    # tf_keras' own handling of empty replicas, as under MirroredStrategy: it trains on,
    # with finite weights (its per-replica statistics differ from one device's anyway).
    difference = run_shape("tf_keras_one_machine")["layers"]["unsynchronized_batchnorm"]
    assert isinstance(difference, float) and math.isfinite(difference), difference
