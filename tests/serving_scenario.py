"""Trains models whose tables take every placement on a cluster, and exports each as SavedModels.

The chief of a 2-worker + 3-ps cluster trains, each under its own HybridStrategy:

- "fixed": an `Embedding` split into 3 shards (one per ps task) and one placed whole;
- "dynamic_whole": one `DynamicEmbedding(4, capacity=4000, min_count=2)`, placed whole
  (on ps 0: the first table of its strategy);
- "mixed": a fixed `Embedding` (whole, on ps 0) and a `DynamicEmbedding` (whole, on ps 1);
- "dynamic_split": a `DynamicEmbedding` of int64 ids split over 2 ps tasks and one of
  string ids (multi-hot, padded, mean combiner, few rows: ids are evicted) split over 3.

For each it records where every table lives, the predictions of `model.predict` on the
cluster for held-out inputs (half of the dynamic tables' ids never seen), and writes a
SavedModel with every export path of the Keras flavour it runs (`model.export` and
`tf.saved_model.save`; tf_keras, under TF_USE_LEGACY_KERAS=1, has no `model.export` of
dynamic tables).
It also tries a save that asks to record variables' devices, which must be refused.
It prints a JSON report; `serve_saved_model.py` serves the SavedModels in a process
without the cluster or this package.

    python -m hybrid_strategy.launch --workers 2 --ps 3 -- python tests/serving_scenario.py OUT
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

VOCAB, SEQ, BATCH = 500, 4, 32
# Tables whole by default (none reaches twice this size); some split by count.
WHOLE = 1 << 30


def _dynamic(*args, **kwargs):
    from hybrid_strategy.layers import DynamicEmbedding
    return DynamicEmbedding(*args, **kwargs)


def _inputs(**specs):
    return {name: keras.Input(shape=shape, dtype=dtype, name=name)
            for name, (shape, dtype) in specs.items()}


def _head(inputs, parts):
    x = parts[0] if len(parts) == 1 else keras.layers.Concatenate()(parts)
    x = keras.layers.Dense(16, activation="tanh", name="hidden")(x)
    return keras.Model(list(inputs.values()), keras.layers.Dense(1, name="out")(x))


def fixed():
    inputs = _inputs(token_ids=((SEQ,), "int32"))
    words = keras.layers.Embedding(VOCAB, 8, name="words")(inputs["token_ids"])
    tags = keras.layers.Embedding(VOCAB, 2, name="tags")(inputs["token_ids"])
    return _head(inputs, [keras.layers.Flatten()(keras.layers.Concatenate()([words, tags]))])


def dynamic_whole():
    inputs = _inputs(ids=((2,), "int64"))
    rows = _dynamic(4, capacity=4000, min_count=2, name="raw")(inputs["ids"])
    return _head(inputs, [keras.layers.Flatten()(rows)])


def mixed():
    inputs = _inputs(token_ids=((SEQ,), "int32"), user_id=((1,), "int64"))
    words = keras.layers.Embedding(VOCAB, 8, name="words")(inputs["token_ids"])
    user = _dynamic(4, capacity=4000, min_count=2, name="user")(inputs["user_id"])
    return _head(inputs, [keras.layers.Flatten()(words), keras.layers.Flatten()(user)])


def dynamic_split():
    inputs = _inputs(user_id=((1,), "int64"), item_ids=((3,), "string"))
    user = _dynamic(4, capacity=4000, min_count=2, name="user")(inputs["user_id"])
    items = _dynamic(4, capacity=24, key_dtype="string", combiner="mean", pad_id="",
                     eviction="lfu", name="items")(inputs["item_ids"])
    return _head(inputs, [keras.layers.Flatten()(user), items])


# name -> (model builder, table_shards)
MODELS = {
    "fixed": (fixed, {"words/embeddings": 3}),
    "dynamic_whole": (dynamic_whole, None),
    "mixed": (mixed, None),
    "dynamic_split": (dynamic_split, {"user/embeddings": 2, "items/embeddings": 3}),
}


def data(model, rng, n):
    """`n` training examples for `model`'s inputs, then held-out ones: tokens in the
    vocabulary, raw ids from a pool of 60 (each seen several times in training) and,
    for the held-out half, never seen."""
    pool = rng.integers(-2**62, 2**62, 60, dtype=np.int64)
    names = np.array([f"item-{k}" for k in range(60)] + [""], dtype=object)

    def draw(spec, count, unseen):
        shape = (count,) + tuple(spec.shape[1:])
        if spec.dtype == "int32":
            return rng.integers(0, VOCAB, shape).astype("int32")
        if spec.dtype == "int64":
            seen = pool[rng.zipf(1.5, shape) % len(pool)]
            return np.where(np.arange(count)[:, None] < unseen, seen,
                            rng.integers(-2**62, 2**62, shape, dtype=np.int64))
        seen = names[rng.zipf(1.3, shape) % len(names)]
        return np.where(np.arange(count)[:, None] < unseen, seen,
                        np.full(shape, "never-seen", dtype=object)).astype(bytes)

    specs = {i.name.split(":")[0]: i for i in model.inputs}
    train = {name: draw(spec, n, n) for name, spec in specs.items()}
    held_out = {name: draw(spec, 16, 8) for name, spec in specs.items()}
    return train, held_out


def tables(model):
    """{weight path: [devices of its shards]} of the model's tables."""
    return {path(w): devices(w) for w in model.weights if "embeddings" in path(w)}


def train_and_export(name, out_dir):
    import hybrid_strategy

    build, shards = MODELS[name]
    strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=WHOLE, table_shards=shards)
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
    rng = np.random.default_rng(len(name))
    train, held_out = data(model, rng, 4 * BATCH)
    model.fit([train[k] for k in train], rng.random((4 * BATCH, 1)).astype("float32"),
              batch_size=BATCH, epochs=2, verbose=0)
    feed = [tf.constant(held_out[k]) for k in held_out]
    report = {
        "tables": tables(model),
        "remaps": {layer.name: list(layer.remap.devices) for layer in model.layers
                   if hasattr(layer, "remap")},
        "inputs": {k: v.astype(str).tolist() if v.dtype.kind == "S" else v.tolist()
                   for k, v in held_out.items()},
        "predictions": model.predict(feed, verbose=0).tolist(),
        "exports": {},
    }
    directory = os.path.join(out_dir, name)
    # tf_keras' model.export tracks variables only, not a DynamicEmbedding's hash tables.
    if hasattr(keras, "ops") or not report["remaps"]:
        report["exports"]["model.export"] = os.path.join(directory, "keras_export")
        model.export(report["exports"]["model.export"])  # prints: the report is the last line
    report["exports"]["tf.saved_model.save"] = os.path.join(directory, "tf_saved_model")
    tf.saved_model.save(model, report["exports"]["tf.saved_model.save"])
    return report


def refused_variable_devices(out_dir):
    """The error of a save asked to record a variable's device on ps 0, and whether it
    wrote anything."""
    module = tf.Module()
    with tf.device("/job:ps/replica:0/task:0"):
        module.v = tf.Variable([1.0, 2.0])
    module.read = tf.function(lambda: module.v * 2.0, input_signature=[])
    path_ = os.path.join(out_dir, "variable_devices")
    options = tf.saved_model.SaveOptions(
        experimental_variable_policy=tf.saved_model.experimental.VariablePolicy
        .SAVE_VARIABLE_DEVICES)
    try:
        tf.saved_model.save(module, path_, options=options)
    except ValueError as error:
        return {"error": str(error), "written": os.path.exists(
            os.path.join(path_, "saved_model.pb"))}
    return {"error": None, "written": True}


def main(out_dir):
    report = {
        "flavour": "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3",
        "models": {name: train_and_export(name, out_dir) for name in MODELS},
        "variable_devices": refused_variable_devices(out_dir),
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


def path(weight):
    return getattr(weight, "path", None) or weight.name.split(":")[0]


def devices(weight):
    """Where a weight lives: its shards' devices (a table), or its own."""
    value = getattr(weight, "value", None)
    variable = weight if value is None or callable(value) else value  # Keras 3 wraps
    shards = getattr(variable, "shards", None)
    return [s.device for s in shards] if shards else [variable.device]


if __name__ == "__main__":
    main(sys.argv[1])
