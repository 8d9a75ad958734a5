"""Global batches that split unevenly over the replicas, trained as one program; prints JSON.

Each case trains a model with `fit`, then runs `evaluate` and `predict`, under
HybridStrategy and, from the same weights, on one device with the same batches, and
reports how far apart they end: the weights, the logs `fit` gives after every batch
and for the epoch, `evaluate`'s loss and metrics, `predict`'s predictions in order.
Batches: numpy arrays batched by 97 (300 examples: the last batch of 9 splits 5 and 4),
a dataset batched by 265 (531 examples: the last batch has one example, so one replica
of two gets none), batches of one example (a replica empty at every step). Losses: a
mean, a sum, sample weights (with Keras 3's mean over their sum too), per-token losses
of a sequence with padding masked out. Models: a two-headed click-through-rate model (click
and purchase) with an l2-regularized table on the PS, weighted losses, AUC and
accuracy per head; a sequence tagger with a masked table; a model with a synchronized
BatchNormalization. `layers` trains, with a replica empty at the last step, layers that
cannot take zero rows: the error each gives, or its weights' difference from one device.
On one machine, `--mirrored` also trains `MIRRORED_CASES` under
tf.distribute.MirroredStrategy on the same replicas. Works with Keras 3 and, under
TF_USE_LEGACY_KERAS=1, with tf_keras:

    python tests/batch_sizes.py --local-replicas 2 --mirrored --layers
    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/batch_sizes.py \\
        --cases numpy_97,dataset_batch_1
"""

import argparse
import contextlib
import functools
import json
import sys

import numpy as np
import tensorflow as tf

import scenario

keras = scenario.keras
KERAS3 = hasattr(keras, "ops")
VOCAB, FIELDS, SEQ, DIM = 200, 4, 5, 8
TAGS = 7
HEADS = ("click", "purchase")


def ctr_model():
    """Ids of several fields -> probabilities of a click and of a purchase; the table
    carries an l2 penalty (its gradient is dense), the hidden layer an activity one."""
    ids = keras.Input(shape=(FIELDS,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="items",
                               embeddings_regularizer=keras.regularizers.l2(1e-3))(ids)
    x = keras.layers.Dense(16, activation="relu", name="hidden",
                           activity_regularizer=keras.regularizers.l2(1e-2))(
                               keras.layers.Flatten()(x))
    return keras.Model(ids, [keras.layers.Dense(1, activation="sigmoid", name=head)(x)
                             for head in HEADS])


def tagger_model():
    """Token ids (0 pads) -> a tag per token; padded tokens are masked out of the loss."""
    ids = keras.Input(shape=(SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, mask_zero=True, name="tokens")(ids)
    x = keras.layers.Dense(16, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(TAGS, name="tags")(x))


def batchnorm_model(synchronized=True):
    ids = keras.Input(shape=(FIELDS,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="items")(ids))
    # No bias before a normalization (its gradient is 0: the weight would be float noise).
    x = keras.layers.Dense(16, use_bias=False, name="hidden")(x)
    x = keras.layers.BatchNormalization(synchronized=synchronized, name="norm")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.ReLU()(x)))


def conv_model():
    images = keras.Input(shape=(6, 6, 2))
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(images)
    return keras.Model(images, keras.layers.Dense(1, name="out")(
        keras.layers.GlobalAveragePooling2D()(x)))


def ctr_data(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(n, FIELDS)) - 1, VOCAB - 1).astype("int32")
    click = np.sin(ids.sum(axis=1, keepdims=True) / 7.0) > 0
    return ids, (click.astype("float32"), (click & (ids[:, :1] % 3 == 0)).astype("float32"))


def tagger_data(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(n, SEQ)).astype("int32")
    lengths = rng.integers(1, SEQ + 1, size=(n, 1))
    ids[np.arange(SEQ)[None, :] >= lengths] = 0
    return ids, (ids % TAGS).astype("int32")


def regression_data(n, seed=0):
    ids, _ = ctr_data(n, seed)
    return ids, np.sin(ids.sum(axis=1, keepdims=True) / 9.0).astype("float32")


def image_data(n, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, 6, 6, 2)).astype("float32")
    return images, images.mean(axis=(1, 2, 3))[:, None]


def sample_weights(n, seed=0):
    return np.random.default_rng(seed + 7).uniform(0.0, 2.0, size=(n,)).astype("float32")


def head_metrics():
    return [[keras.metrics.AUC(name="auc"), keras.metrics.BinaryAccuracy(name="acc")]
            for _ in HEADS]


def ctr_losses(*reductions):
    """Binary cross-entropy for each head of the CTR model, with these reductions."""
    return [keras.losses.BinaryCrossentropy(reduction=reduction) for reduction in reductions]


# Keras 3's mean divided by the sum of the sample weights (tf_keras has only the other).
WEIGHTED_MEAN = "mean_with_sample_weight" if KERAS3 else "sum_over_batch_size"
# name -> (build, data, compile's arguments but the optimizer)
MODELS = {
    "ctr": (ctr_model, ctr_data, lambda: {
        "loss": ctr_losses("sum_over_batch_size", "sum_over_batch_size"),
        "loss_weights": [1.0, 0.5], "metrics": head_metrics()}),
    # A sum over a batch of about 100 examples, weighted about 100 times less.
    "ctr_sum_and_weighted_mean": (ctr_model, ctr_data, lambda: {
        "loss": ctr_losses("sum", WEIGHTED_MEAN),
        "loss_weights": [0.01, 1.0], "metrics": head_metrics()}),
    "tagger": (tagger_model, tagger_data, lambda: {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]}),
    "batchnorm": (batchnorm_model, regression_data, lambda: {
        "loss": "mse", "metrics": ["mae"]}),
}
# name -> (model, input, global batch, examples, sample weights)
CASES = {
    "numpy_97": ("ctr", "numpy", 97, 300, False),
    "dataset_265_final_1": ("ctr", "dataset", 265, 531, False),
    "dataset_batch_1": ("ctr", "dataset", 1, 5, False),
    "numpy_batch_1": ("ctr", "numpy", 1, 3, False),
    "sample_weight": ("ctr", "numpy", 97, 300, True),
    "sum_and_weighted_mean": ("ctr_sum_and_weighted_mean", "dataset", 97, 300, True),
    "sequence_masked": ("tagger", "dataset", 33, 100, False),
    # Batches of 3 split 2 and 1; the last batch, of 1, leaves a replica empty.
    "synchronized_batchnorm": ("batchnorm", "dataset", 3, 7, False),
}
# Under MirroredStrategy too: a final batch that splits unevenly (17 and 16), and
# numpy batched by 97 (Keras 3 fails on it before training: it adds up the replicas'
# first batches, of 49 and 48 rows).
MIRRORED_CASES = {"dataset_96_final_33": ("ctr", "dataset", 96, 225, False),
                  "numpy_97": CASES["numpy_97"]}
# Layers that cannot take a replica without rows, trained on batches of 3 from 7
# examples: name -> (build, data).
LAYERS = {
    "unsynchronized_batchnorm": (functools.partial(batchnorm_model, False), regression_data),
    "convolution": (conv_model, image_data),
}


def inputs(source, x, y, sw, batch_size):
    """`fit`'s arguments for these arrays: numpy with `batch_size`, or a dataset."""
    if source == "numpy":
        args = {"x": x, "y": list(y) if isinstance(y, tuple) else y, "batch_size": batch_size}
        if sw is not None:
            args["sample_weight"] = sw
        return args
    arrays = (x, y) if sw is None else (x, y, sw)
    return {"x": tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size)}


def run(model, source, x, y, sw, batch_size):
    """fit, evaluate and predict; returns what each logged and the final weights."""
    batch_logs = []
    history = model.fit(**inputs(source, x, y, sw, batch_size), shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.LambdaCallback(
                            on_train_batch_end=lambda batch, logs: batch_logs.append(
                                {k: float(v) for k, v in logs.items()}))])
    evaluated = model.evaluate(**inputs(source, x, y, sw, batch_size), verbose=0,
                               return_dict=True)
    features = inputs(source, x, y, None, batch_size)
    if source == "dataset":
        features["x"] = features["x"].map(lambda x, y: x)
    else:
        del features["y"]
    return {
        "weights": model.get_weights(),
        "batch_logs": batch_logs,
        "epoch_logs": {k: v[-1] for k, v in history.history.items()},
        "evaluate": {k: float(v) for k, v in evaluated.items()},
        "predict": model.predict(**features, verbose=0),
    }


_COMPILED = {}


def compiled(strategy, model_name, weights):
    """`model_name`'s model under `strategy` (None: one device), holding `weights`.

    Cases of one model share it, so its functions are traced once.
    """
    key = (id(strategy), model_name)
    if key not in _COMPILED:
        build, _, arguments = MODELS[model_name]
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(0.5), **arguments())
        _COMPILED[key] = model
    model = _COMPILED[key]
    model.set_weights(weights)
    return model


def relative(actual, expected):
    """max |actual - expected| / max(max |expected|, 1e-2), over arrays or numbers."""
    actual, expected = np.asarray(actual, "float64"), np.asarray(expected, "float64")
    if actual.shape != expected.shape:
        return float("inf")
    return float(np.max(np.abs(actual - expected), initial=0.0)
                 / max(float(np.max(np.abs(expected), initial=0.0)), 1e-2))


def log_errors(actual, expected):
    """Per log name, the largest relative difference over the batches (inf if the
    batches or names differ)."""
    if len(actual) != len(expected) or any(set(a) != set(e) for a, e in zip(actual, expected)):
        return {"batches or names": float("inf")}
    return {key: max(relative(a[key], e[key]) for a, e in zip(actual, expected))
            for key in expected[0]}


def initial_weights(build):
    keras.utils.set_random_seed(1)
    return build().get_weights()


def case_report(strategy, spec):
    model_name, source, batch_size, n, weighted = spec
    build, make_data, _ = MODELS[model_name]
    x, y = make_data(n)
    sw = sample_weights(n) if weighted else None
    weights = initial_weights(build)
    expected = run(compiled(None, model_name, weights), source, x, y, sw, batch_size)
    actual = run(compiled(strategy, model_name, weights), source, x, y, sw, batch_size)
    return {
        "weights": max(relative(a, e) for a, e in zip(actual["weights"], expected["weights"])),
        # How far training moved the weights: the comparison above can fail.
        "moved": max(relative(e, w) for e, w in zip(expected["weights"], weights)),
        "batch_logs": log_errors(actual["batch_logs"], expected["batch_logs"]),
        "epoch_logs": log_errors([actual["epoch_logs"]], [expected["epoch_logs"]]),
        "evaluate": log_errors([actual["evaluate"]], [expected["evaluate"]]),
        "predict": relative(actual["predict"], expected["predict"]),
    }


def error_of(run_case):
    """`run_case()`, or the message of the exception it raises."""
    try:
        return run_case()
    except Exception as error:  # pylint: disable=broad-except
        return f"{type(error).__name__}: {error}"


def layer_report(strategy, build, make_data):
    """The error training `build()` under `strategy` gives (a replica empty at the last
    step), or how far its weights end from one device's."""
    x, y = make_data(7)
    weights = initial_weights(build)
    models = []
    for scope in (contextlib.nullcontext(), strategy.scope()):
        with scope:
            model = build()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        models.append(model)
        model.fit(x, y, batch_size=3, shuffle=False, verbose=0)
    return max(relative(a, e) for a, e in zip(models[1].get_weights(),
                                              models[0].get_weights()))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-replicas", type=int, default=0,
                        help="run on this machine alone with this many CPU replicas")
    parser.add_argument("--mirrored", action="store_true",
                        help="also train MIRRORED_CASES under tf.distribute.MirroredStrategy")
    parser.add_argument("--layers", action="store_true",
                        help="also train LAYERS with a replica empty at the last step")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="the cases to run, separated by commas")
    args = parser.parse_args(argv)
    import hybrid_strategy

    kwargs = {"min_shard_bytes": scenario.MIN_SHARD_BYTES}
    devices = None
    if args.local_replicas:
        devices = kwargs["devices"] = scenario.local_cpu_replicas(args.local_replicas)
    strategy = hybrid_strategy.HybridStrategy(**kwargs)
    cases = {name: case_report(strategy, CASES[name]) for name in args.cases.split(",")}
    report = {"replicas": strategy.num_replicas_in_sync, "cases": cases}
    if args.layers:
        report["layers"] = {name: error_of(lambda spec=spec: layer_report(strategy, *spec))
                            for name, spec in LAYERS.items()}
    if args.mirrored:
        mirrored = tf.distribute.MirroredStrategy(devices)
        report["mirrored"] = {
            name: {"hybrid": cases.get(name) or case_report(strategy, spec),
                   "mirrored": error_of(lambda spec=spec: case_report(mirrored, spec))}
            for name, spec in MIRRORED_CASES.items()}
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
