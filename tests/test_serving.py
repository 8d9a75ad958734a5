"""A model trained on a cluster is served from its SavedModel by plain TensorFlow.

For each Keras flavour (both at once), `tests/serving_scenario.py` trains a model whose tables are
split into shards on a real 2-worker + 1-ps cluster and exports it every way that
flavour offers; `tests/serve_saved_model.py` then loads each SavedModel in another
process, with no TF_CONFIG and the `hybrid_strategy` package unimportable, and
serves the held-out ids. Its outputs must equal the trained model's predictions.
"""

import json
import os

import numpy as np
import pytest

from runs import Runs, environ, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-5


FLAVOURS = ("keras3", "tf_keras")


def train_and_serve(flavour, out_dir):
    trained = json_report(on_cluster(os.path.join(HERE, "serving_scenario.py"), out_dir,
                                     workers=2, ps=1),
                          f"training on the cluster ({flavour})", flavour)
    serve_env = {k: v for k, v in environ(flavour).items() if k != "PYTHONPATH"}
    served = json_report([os.path.join(HERE, "serve_saved_model.py"),
                          json.dumps(trained["held_out"])] + list(trained["exports"].values()),
                         "serving", env=serve_env, timeout=600, cwd=out_dir)
    return flavour, trained, served


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs.in_directories(train_and_serve, FLAVOURS, tmp_path_factory)


@pytest.fixture(scope="module", params=FLAVOURS)
def served(request, runs):
    return runs.result(request.param, request)


def test_every_export_path_of_the_flavour_was_written(served):
    flavour, trained, _ = served
    assert trained["flavour"] == flavour
    assert sorted(trained["exports"]) == ["model.export", "tf.saved_model.save"]
    # One table split into shards, one whole: both kinds reach the SavedModel.
    assert trained["shards"]["words/embeddings"] == 3
    assert trained["shards"]["tags/embeddings"] == 1


@pytest.mark.parametrize("export", ["model.export", "tf.saved_model.save"])
def test_served_predictions_equal_the_trained_model(served, export):
    _, trained, serving = served
    outputs = np.asarray(serving[trained["exports"][export]]["outputs"])
    expected = np.asarray(trained["predictions"])
    assert outputs.shape == expected.shape
    error = np.max(np.abs(outputs - expected)) / max(np.max(np.abs(expected)), 1e-3)
    assert error <= TOLERANCE, f"{export}: served outputs differ by {error:.2e} (relative)"


@pytest.mark.parametrize("export", ["model.export", "tf.saved_model.save"])
def test_tables_are_ordinary_whole_variables_on_the_serving_machine(served, export):
    _, trained, serving = served
    loaded = serving[trained["exports"][export]]
    assert serving["tf_config"] is None
    # Each table is held whole (500 rows), not as its shards (167, 167, 166 rows).
    assert [500, 8] in loaded["variable_shapes"] and [500, 2] in loaded["variable_shapes"]
    assert not any(shape[:1] in ([167], [166]) for shape in loaded["variable_shapes"])
    assert all("/job:localhost/" in d for d in loaded["variable_devices"])
