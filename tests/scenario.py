"""Training scenarios shared by the tests: models, a distributed run, a reference.

The reference is single-device training written out step by step: the same model,
initial weights, global batches and optimizer, with each sparse gradient's duplicate
rows summed first (the exact arithmetic of a dense gradient, which HybridStrategy
also gives; Keras 3 alone applies duplicate rows one by one, which for Adagrad is
not the same step). `report()` trains every case and returns what the tests check.
Run as a script, it prints that report as JSON:

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python tests/scenario.py
    python tests/scenario.py --local-replicas 2       # one machine, two CPU replicas
"""

import functools
import json
import sys
import warnings

import numpy as np

VOCAB, SEQ, DIM = 500, 6, 8
GLOBAL_BATCH, STEPS = 32, 8
# Not a multiple of GLOBAL_BATCH: the last batch has one example, so one replica
# of two gets none.
COUNT_EXAMPLES = 3 * GLOBAL_BATCH + 1
OPTIMIZERS = {
    "sgd": lambda keras: keras.optimizers.SGD(0.5),
    "adagrad": lambda keras: keras.optimizers.Adagrad(0.3),
}
# name -> (optimizer, model variant, placement overrides)
CASES = {
    "sgd": ("sgd", "plain", None),
    "adagrad": ("adagrad", "plain", None),
    "two_tables": ("adagrad", "two_tables", None),
    "tied": ("adagrad", "tied", None),
    "forced": ("adagrad", "plain", {"embedding": "mirrored", "hidden/kernel": "ps"}),
}


def make_data(num_examples=GLOBAL_BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    # Skewed ids, so batches repeat rows within and across replicas.
    ids = np.minimum(rng.zipf(1.3, size=(num_examples, SEQ)) - 1, VOCAB - 1)
    ids = ids.astype("int32")
    y = np.sin(ids.sum(axis=1, keepdims=True) / 50.0).astype("float32")
    return ids, y


def build_model(variant="plain"):
    """Embedding + Dense layers; "tied" also uses the table as an output projection,
    "two_tables" embeds each half of the ids with its own table."""
    import keras

    inputs = keras.Input(shape=(SEQ,), dtype="int32")
    if variant == "two_tables":
        half = SEQ // 2
        a = keras.layers.Embedding(VOCAB, DIM, name="embedding")(inputs[:, :half])
        b = keras.layers.Embedding(VOCAB * 2, DIM, name="embedding_b")(inputs[:, half:])
        x = keras.layers.Concatenate(axis=1)([a, b])
    else:
        embedding = keras.layers.Embedding(VOCAB, DIM, name="embedding")
        x = embedding(inputs)
    x = keras.layers.Dense(16, activation="tanh", name="hidden")(keras.layers.Flatten()(x))
    if variant == "tied":
        x = keras.layers.Dense(DIM, name="to_dim")(x)
        x = TiedProjection(embedding, name="tied")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(x))


def _tied_projection_class():
    import keras

    class TiedProjection(keras.layers.Layer):
        """Scores against every embedding row: the table gets a dense gradient."""

        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, x):
            table = keras.ops.convert_to_tensor(self.embedding.embeddings)
            return keras.ops.matmul(x, keras.ops.transpose(table)) / 10.0

    return TiedProjection


def TiedProjection(embedding, name):
    return _tied_projection_class()(embedding, name=name)


def initial_weights(variant, seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    return build_model(variant).get_weights()


def reference_train(weights, optimizer, ids, y, variant):
    """Single-device training, batch after batch; returns the final weights."""
    import keras
    import tensorflow as tf

    model = build_model(variant)
    model.set_weights(weights)
    opt = OPTIMIZERS[optimizer](keras)
    for start in range(0, len(ids), GLOBAL_BATCH):
        x, t = ids[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [_merge_rows(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        opt.apply(grads, model.trainable_variables)
    model.compile(loss="mse")  # for evaluate() only
    return model


def _merge_rows(g):
    import tensorflow as tf

    unique, pos = tf.unique(g.indices)
    return tf.IndexedSlices(
        tf.math.unsorted_segment_sum(g.values, pos, tf.shape(unique)[0]), unique,
        g.dense_shape)


def distributed_train(strategy, weights, optimizer, ids, y, variant):
    """`model.fit` on a tf.data.Dataset under `strategy`; returns the model."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = build_model(variant)
        model.set_weights(weights)
        model.compile(optimizer=OPTIMIZERS[optimizer](keras), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    return model


def relative_errors(actual, expected):
    """Per weight: max |actual - expected| / max |expected|."""
    return [float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-12))
            for a, e in zip(actual, expected)]


def variable_devices(model):
    """`{variable path: [devices]}`: one device for a PS table, one per replica else."""
    out = {}
    for w in model.weights:
        value = getattr(w, "value", w)
        components = getattr(value, "values", None)
        out[w.path] = [c.device for c in components] if components else [value.device]
    return out


def equivalence_case(make_strategy, optimizer, variant, overrides):
    # The strategy first: on a cluster it connects this process, and variables
    # made before that would belong to a device that no longer exists.
    strategy = make_strategy(placement_overrides=overrides)
    ids, y = make_data()
    weights = initial_weights(variant)
    reference = reference_train(weights, optimizer, ids, y, variant)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = distributed_train(strategy, weights, optimizer, ids, y, variant)
    held_out = make_data(GLOBAL_BATCH * 2, seed=5)[0]
    return {
        "relative_errors": dict(zip([w.path for w in model.weights],
                                    relative_errors(model.get_weights(),
                                                    reference.get_weights()))),
        "devices": variable_devices(model),
        "placement": {r.path: str(r.placement) for r in strategy.placement},
        "placement_table": str(strategy.placement),
        "gradient_types": strategy.gradient_types,
        "ps_aggregated": sorted(strategy.ps_aggregated),
        "warnings": [str(w.message) for w in caught
                     if type(w.message).__name__ == "PlacementWarning"],
        "predict_error": relative_errors(
            [model.predict(held_out, batch_size=GLOBAL_BATCH, verbose=0)],
            [reference.predict(held_out, batch_size=GLOBAL_BATCH, verbose=0)])[0],
        "evaluate_loss": float(model.evaluate(held_out, np.zeros((len(held_out), 1)),
                                              batch_size=GLOBAL_BATCH, verbose=0)),
        "reference_loss": float(reference.evaluate(
            held_out, np.zeros((len(held_out), 1)), batch_size=GLOBAL_BATCH, verbose=0)),
    }


def counting_case(make_strategy, source):
    """Trains one epoch where example i touches only row i of a zero table.

    With loss = sum of outputs, each use of an example moves its row by the same
    amount; dividing by the rows of the same epoch on one device gives how many
    times the cluster used each example.
    """
    import tensorflow as tf

    n = COUNT_EXAMPLES
    ids = np.arange(n, dtype="int32").reshape(n, 1)
    y = np.zeros((n, 1), "float32")
    strategy = make_strategy()
    single_device = _counting_model(n)
    single_device.fit(ids, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    with strategy.scope():
        model = _counting_model(n)
    batches = []
    callback = _batch_counter(batches)
    if source == "numpy":
        history = model.fit(ids, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                            verbose=0, callbacks=[callback])
    else:
        dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)
        history = model.fit(dataset, epochs=1, verbose=0, callbacks=[callback])
    uses = model.get_weights()[0][:, 0] / single_device.get_weights()[0][:, 0]
    return {
        "uses_per_example": np.round(uses, 6).tolist(),
        "batches": len(batches),
        "loss_finite": bool(np.isfinite(history.history["loss"][-1])),
    }


def _counting_model(n):
    import keras

    model = keras.Sequential([
        keras.Input(shape=(1,), dtype="int32"),
        keras.layers.Embedding(n, 1, embeddings_initializer="zeros", name="rows"),
        keras.layers.Flatten(),
    ])
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=_sum_of_outputs_loss()(reduction="sum"))
    return model


def _batch_counter(batches):
    import keras

    return keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append(batch))


def _sum_of_outputs_loss():
    import keras

    class SumOfOutputs(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return keras.ops.sum(y_pred, axis=-1)

    return SumOfOutputs


def report(make_strategy, cases=CASES):
    out = {name: equivalence_case(make_strategy, *spec) for name, spec in cases.items()}
    for source in ("dataset", "numpy"):
        out[f"count_{source}"] = counting_case(make_strategy, source)
    return out


def main(argv):
    """`scenario.py` on a cluster's chief; `scenario.py --local-replicas N` alone."""
    import tensorflow as tf

    import hybrid_strategy

    make_strategy = hybrid_strategy.HybridStrategy
    if len(argv) == 2 and argv[0] == "--local-replicas":
        replicas = int(argv[1])
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
        devices = [f"/cpu:{i}" for i in range(replicas)]
        make_strategy = functools.partial(make_strategy, devices=devices)
    elif argv:
        sys.exit(f"usage: scenario.py [--local-replicas N]; got {argv}")
    json.dump(report(make_strategy), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
