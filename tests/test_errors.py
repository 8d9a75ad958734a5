"""Bad input gets a clear error naming the problem, fast, never a hang."""

import inspect
import json
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

import hybrid_strategy
from hybrid_strategy.cluster import config as cluster


def closed_port():
    port = cluster.free_port()
    with socket.socket() as s:  # nothing listens there once it is closed again
        s.bind(("127.0.0.1", port))
    return port


def tf_config(cluster_dict, task=("chief", 0)):
    return json.dumps({"cluster": cluster_dict, "task": {"type": task[0], "index": task[1]}})


def test_malformed_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{'cluster': ")
    with pytest.raises(hybrid_strategy.ClusterConfigError, match="TF_CONFIG"):
        hybrid_strategy.HybridStrategy()


def test_hybrid_needs_a_ps_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}))
    with pytest.raises(hybrid_strategy.ClusterConfigError,
                       match="architecture='hybrid' needs at least one `ps` task"):
        hybrid_strategy.HybridStrategy()


def test_training_program_must_run_on_the_chief(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        task=("worker", 0)))
    with pytest.raises(hybrid_strategy.ClusterConfigError,
                       match=r"/job:worker/task:0 .*python -m hybrid_strategy.server"):
        hybrid_strategy.HybridStrategy()


def test_unreachable_task_is_named_within_the_timeout(monkeypatch):
    worker, ps = f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("TF_CONFIG", tf_config(
        {"chief": [f"127.0.0.1:{closed_port()}"], "worker": [worker], "ps": [ps]}))
    start = time.monotonic()
    with pytest.raises(hybrid_strategy.TaskUnreachableError) as error:
        hybrid_strategy.HybridStrategy(connect_timeout=1.0)
    assert time.monotonic() - start < 10
    assert f"/job:worker/task:0 at {worker}" in str(error.value)
    assert f"/job:ps/task:0 at {ps}" in str(error.value)


def test_devices_argument_is_for_one_machine(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}))
    with pytest.raises(ValueError, match="devices= is for single-machine mode"):
        hybrid_strategy.HybridStrategy(devices=["/cpu:0"])


def words_model(optimizer):
    """A 10-row table on this machine's PS, compiled with `optimizer`."""
    import keras

    with hybrid_strategy.HybridStrategy().scope():
        model = keras.Sequential([
            keras.Input(shape=(2,), dtype="int32"),
            keras.layers.Embedding(10, 2, name="words"),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ], name="words_model")  # Keras numbers unnamed models per process
        model.compile(optimizer=optimizer, loss="mse")
    return model


def test_embedding_id_out_of_range_names_the_table(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    model = words_model("sgd")
    ids = np.array([[1, 2], [3, 12]], "int32")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"embedding id out of range for table words_model/words/embeddings "
                             r"\(10 rows\): ids must be in \[0, 10\)"):
        model.fit(ids, np.zeros((2, 1)), batch_size=2, verbose=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"architecture": "sharded"}, "architecture='sharded' is not supported"),
    ({"sparse_update": "eager"}, "sparse_update='eager'; use one of ('lazy', 'exact')"),
    ({"min_shard_bytes": -1}, "min_shard_bytes must be a positive int"),
    ({"placement_overrides": {"emb": "gpu"}}, "placement_overrides['emb'] is 'gpu'"),
    ({"wire_dtype": "float16"}, "wire_dtype='float16'"),
    ({"connect_timeout": 0}, "connect_timeout=0; give a number of seconds above 0"),
    ({"task_timeout": -1}, "task_timeout=-1; give a number of seconds above 0, or None"),
    ({"devices": "/cpu:0"}, "devices='/cpu:0'; give a list of device names"),
])
def test_bad_arguments_fail_before_connecting(monkeypatch, kwargs, message):
    # The cluster does not exist: an argument error must come first, and fast.
    monkeypatch.setenv("TF_CONFIG", tf_config(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}))
    with pytest.raises(ValueError) as error:
        hybrid_strategy.HybridStrategy(**{"connect_timeout": 30, **kwargs})
    assert message in str(error.value)


def test_a_misspelled_argument_names_the_ones_it_takes():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['archtecture'\]; "
                                        r"it takes cluster_resolver and \['architecture', "):
        hybrid_strategy.HybridStrategy(archtecture="ps")
    # Declared once (StrategyOptions), every option still shows in help() and IDEs.
    assert "architecture='hybrid'" in str(inspect.signature(hybrid_strategy.HybridStrategy))


def test_unsupported_optimizer_on_a_ps_table_is_named(monkeypatch):
    import keras

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(hybrid_strategy.UnsupportedOptimizerError,
                       match="PS table 'words_model/words/embeddings' with Adam"):
        words_model(keras.optimizers.Adam(use_ema=True))


def test_a_dataset_a_filter_empties_is_refused_with_a_clear_error(monkeypatch):
    # tf.data cannot tell it empty before reading it; Keras 3 alone would end fit with a
    # bare StopIteration.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    model = words_model("sgd")
    ids = np.zeros((8, 2), "int32")
    dataset = tf.data.Dataset.from_tensor_slices((ids, np.zeros((8, 1), "float32")))
    with pytest.raises(ValueError, match=r"HybridStrategy: the dataset is empty"):
        model.fit(dataset.filter(lambda x, y: False).batch(4), shuffle=False, verbose=0)
