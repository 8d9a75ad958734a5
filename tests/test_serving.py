"""Models trained on a cluster are served from their SavedModels by plain TensorFlow.

For each Keras flavour (both at once), `tests/serving_scenario.py` trains, on a real
2-worker + 3-ps cluster, models whose tables take every placement: fixed `Embedding`
tables split over 3 ps tasks and whole, a `DynamicEmbedding` whole on ps 0, one whole on
ps 1 beside a fixed table, and dynamic tables split over 2 and over 3 ps tasks. It exports
each every way its flavour offers; `tests/serve_saved_model.py` then loads every
SavedModel in another process, with no TF_CONFIG and the `hybrid_strategy` package
unimportable, and calls each signature on held-out inputs (half of the dynamic tables'
ids never seen). Outputs must equal `model.predict` on the cluster, and no op, resource
or variable of a SavedModel may name a device of the cluster. In this process: the pass
that clears those devices, on a SavedModel whose function pins an op to a ps task.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from runs import Runs, environ, json_report, on_cluster

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-5
FLAVOURS = ("keras3", "tf_keras")
MODELS = ("fixed", "dynamic_whole", "mixed", "dynamic_split")
PS = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(3)]


def train_and_serve(flavour, out_dir):
    trained = json_report(on_cluster(os.path.join(HERE, "serving_scenario.py"), out_dir,
                                     workers=2, ps=3),
                          f"training on the cluster ({flavour})", flavour)
    requests = os.path.join(out_dir, "requests.json")
    with open(requests, "w") as f:
        json.dump([{"path": path, "inputs": model["inputs"]}
                   for model in trained["models"].values()
                   for path in model["exports"].values()], f)
    serve_env = {k: v for k, v in environ(flavour).items() if k != "PYTHONPATH"}
    served = json_report([os.path.join(HERE, "serve_saved_model.py"), requests],
                         "serving", env=serve_env, timeout=600, cwd=out_dir, fresh=True)
    return flavour, trained, served


RUNS = Runs.in_directories(train_and_serve, FLAVOURS)


@pytest.fixture(scope="module", params=FLAVOURS)
def served(request):
    return RUNS.result(request.param)


@pytest.mark.cluster
def test_the_tables_take_every_placement_and_every_export_path_was_written(served):
    flavour, trained, _ = served
    assert trained["flavour"] == flavour
    models = trained["models"]
    assert sorted(models) == sorted(MODELS)
    fixed, whole, mixed, split = (models[name] for name in MODELS)
    assert sorted(fixed["tables"]["words/embeddings"]) == PS
    assert len(fixed["tables"]["tags/embeddings"]) == 1
    assert whole["tables"]["raw/embeddings"] == [PS[0]]
    assert mixed["tables"] == {"words/embeddings": [PS[0]], "user/embeddings": [PS[1]]}
    assert sorted(split["tables"]["user/embeddings"]) == PS[:2]
    assert sorted(split["tables"]["items/embeddings"]) == PS
    for model in models.values():  # each map is split as its rows are
        assert model["remaps"] == {path.split("/")[0]: devices
                                   for path, devices in model["tables"].items()
                                   if path.split("/")[0] in model["remaps"]}
    # tf_keras' model.export cannot track a DynamicEmbedding's hash tables.
    both = ["model.export", "tf.saved_model.save"]
    assert sorted(fixed["exports"]) == both
    for model in (whole, mixed, split):
        assert sorted(model["exports"]) == (both if flavour == "keras3"
                                            else ["tf.saved_model.save"])


@pytest.mark.cluster
@pytest.mark.parametrize("name", MODELS)
def test_every_signature_of_every_export_serves_the_trained_models_predictions(served, name):
    _, trained, serving = served
    model = trained["models"][name]
    expected = np.asarray(model["predictions"])
    for export, path in model["exports"].items():
        signatures = serving[path]["outputs"]
        assert "serving_default" in signatures and ("serve" in signatures) == (
            export == "model.export"), (export, sorted(signatures))
        for signature, outputs in signatures.items():
            outputs = np.asarray(outputs)
            assert outputs.shape == expected.shape == (16, 1)
            error = np.max(np.abs(outputs - expected)) / max(np.max(np.abs(expected)), 1e-3)
            assert error <= TOLERANCE, f"{export} {signature}: outputs differ by {error:.2e}"
    if name in ("dynamic_whole", "dynamic_split"):
        # Ids never seen (the last 8 rows) all get zero vectors, hence one prediction.
        assert np.ptp(expected[8:]) == 0 and np.ptp(expected[:8]) > 0


@pytest.mark.cluster
def test_no_saved_model_names_a_device_of_the_cluster(served):
    _, trained, serving = served
    assert serving["tf_config"] is None
    for model in trained["models"].values():
        for path in model["exports"].values():
            assert serving[path]["foreign_devices"] == [], path
            assert all("/job:localhost/" in d for d in serving[path]["variable_devices"])


@pytest.mark.cluster
@pytest.mark.parametrize("export", ["model.export", "tf.saved_model.save"])
def test_fixed_tables_are_ordinary_whole_variables_on_the_serving_machine(served, export):
    _, trained, serving = served
    loaded = serving[trained["models"]["fixed"]["exports"][export]]
    # Each table is held whole (500 rows), not as its shards (167, 167, 166 rows).
    assert [500, 8] in loaded["variable_shapes"] and [500, 2] in loaded["variable_shapes"]
    assert not any(shape[:1] in ([167], [166]) for shape in loaded["variable_shapes"])


@pytest.mark.cluster
def test_a_save_recording_variables_devices_on_the_cluster_is_refused(served):
    _, trained, _ = served
    refused = trained["variable_devices"]
    assert not refused["written"]
    assert "/job:ps/replica:0/task:0" in refused["error"]
    assert "SAVE_VARIABLE_DEVICES" in refused["error"]


def test_devices_of_the_cluster_jobs_are_cleared_and_the_model_then_serves(tmp_path):
    from hybrid_strategy.keras_integration import export_hooks

    class Pinned(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def __call__(self, x):
            with tf.device("/job:ps/replica:0/task:1/device:CPU:0"):
                y = tf.ensure_shape(x + 1.0, [None])
            with tf.device("/device:CPU:0"):
                return y * 2.0

    path = str(tmp_path)
    tf.saved_model.save(Pinned(), path)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Cannot assign a device"):
        tf.saved_model.load(path)(tf.constant([1.0]))
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        saved.ParseFromString(f.read())
    meta_graph = saved.meta_graphs[0]
    nodes = [node for function in meta_graph.graph_def.library.function
             for node in function.node_def]
    pinned = sum(node.device.startswith("/job:ps/") for node in nodes)
    assert pinned >= 2  # the sum and EnsureShape, which a serving process cannot place
    assert export_hooks.clear_cluster_devices(meta_graph, {"worker"}) == 0
    assert export_hooks.clear_cluster_devices(meta_graph, {"chief", "ps"}) == pinned
    devices = {node.device for node in nodes}
    assert "/device:CPU:0" in devices and not any("/job:" in d for d in devices), devices
    with open(os.path.join(path, "saved_model.pb"), "wb") as f:
        f.write(saved.SerializeToString())
    np.testing.assert_allclose(tf.saved_model.load(path)(tf.constant([1.0, 2.0])), [4.0, 6.0])
