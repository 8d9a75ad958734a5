"""What `pip install -e .[test]` brings: one TensorFlow, tf_keras, TensorBoard for Keras."""

import importlib.metadata
import os

import numpy as np


def test_one_tensorflow_distribution_and_tf_keras_beside_it():
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    assert "tensorflow" in installed
    # A second TensorFlow wheel in the same folder would overwrite the first's files.
    assert not installed & {"tensorflow-cpu", "tensorflow-intel", "tf-nightly"}
    assert importlib.metadata.version("tf-keras").startswith("2.21.")
    assert importlib.metadata.version("tensorflow").startswith("2.21.")


def test_tensorboard_callback_writes_logs_under_the_strategy(tmp_path):
    import keras
    import hybrid_strategy

    strategy = hybrid_strategy.HybridStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input(shape=(3,), dtype="int32"),
                                  keras.layers.Embedding(50, 4),
                                  keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    ids = np.random.default_rng(0).integers(0, 50, size=(32, 3)).astype("int32")
    model.fit(ids, np.zeros((32, 1), "float32"), batch_size=16, epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path))])
    events = [f for _, _, files in os.walk(tmp_path) for f in files
              if f.startswith("events.out.tfevents")]
    assert events, f"TensorBoard wrote no event file under {tmp_path}"
