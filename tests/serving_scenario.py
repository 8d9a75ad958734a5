"""Trains a model with PS tables under HybridStrategy and exports it as SavedModels.

The chief of a cluster (or this machine alone) trains a model whose tables are
split into shards, records its predictions on held-out ids, and writes SavedModels
with every export path of the Keras flavour it runs (Keras 3: `model.export` and
`tf.saved_model.save`; tf_keras under TF_USE_LEGACY_KERAS=1: `tf.saved_model.save`).
It prints a JSON report: the held-out ids, the predictions and each SavedModel's
directory. `serve_saved_model.py` loads them in a process without the strategy.

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python tests/serving_scenario.py OUT
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

VOCAB, SEQ = 500, 4
# "words" is split into 3 shards (on one ps task, if that is all there is),
# "tags" stays whole: both ways a table reaches a SavedModel.
TABLE_SHARDS = {"words/embeddings": 3}


def build_model():
    inputs = keras.Input(shape=(SEQ,), dtype="int32")
    words = keras.layers.Embedding(VOCAB, 8, name="words")(inputs)
    tags = keras.layers.Embedding(VOCAB, 2, name="tags")(inputs)
    x = keras.layers.Concatenate()([words, tags])
    x = keras.layers.Dense(16, activation="tanh", name="hidden")(keras.layers.Flatten()(x))
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(x))


def held_out_ids():
    return np.random.default_rng(7).integers(0, VOCAB, size=(16, SEQ)).astype("int32")


def main(out_dir):
    import hybrid_strategy

    strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=1 << 30,
                                              table_shards=TABLE_SHARDS)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(128, SEQ)).astype("int32")
    y = np.sin(ids.sum(axis=1, keepdims=True) / 50.0).astype("float32")
    model.fit(ids, y, batch_size=32, epochs=2, verbose=0)
    held_out = held_out_ids()
    report = {
        "flavour": "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3",
        "shards": {weight_path(w): len(getattr(raw(w), "shards", ())) for w in model.weights},
        "held_out": held_out.tolist(),
        "predictions": model.predict(held_out, verbose=0).tolist(),
        "exports": {},
    }
    if hasattr(model, "export"):
        path = os.path.join(out_dir, "keras_export")
        model.export(path)  # prints its endpoints: the report is the last line
        report["exports"]["model.export"] = path
    path = os.path.join(out_dir, "tf_saved_model")
    tf.saved_model.save(model, path)
    report["exports"]["tf.saved_model.save"] = path
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


def weight_path(weight):
    return getattr(weight, "path", None) or weight.name.split(":")[0]


def raw(weight):
    """What the strategy created: Keras 3 wraps it (`.value`), tf_keras does not."""
    value = getattr(weight, "value", None)
    return weight if value is None or callable(value) else value


if __name__ == "__main__":
    main(sys.argv[1])
