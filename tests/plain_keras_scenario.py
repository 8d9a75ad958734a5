"""Runs the same plain Keras work before and after a HybridStrategy is created, and prints both.

The work, outside any strategy scope: training with SGD and with Adam; saving and loading
a model whose Embedding table is over 4 MiB (`.keras`, `.weights.h5` and legacy `.h5`);
`tf.shape` of variables inside a `tf.function`; and a `tf.function`'s side effects
(variable increments and assignments, `tf.py_function` appends, `tf.print` output, its
traces). Each run starts from the same seed with fresh models and its own directory.

Between the runs it creates `hybrid_strategy.HybridStrategy()` (this machine alone, no
TF_CONFIG) and records which attributes of Keras and TensorFlow it replaced, so a reader
can tell the second run happened with the patches in place.

Runs under whichever Keras `tf.keras` is (set TF_USE_LEGACY_KERAS=1 for tf_keras). Prints
one JSON line: {"flavour", "strategy", "patched", "before", "after"}.
"""

import hashlib
import inspect
import json
import os
import tempfile

import h5py
import numpy as np
import tensorflow as tf

import hybrid_strategy

keras = tf.keras
LEGACY = keras.__name__.startswith("tf_keras")
ROWS, WIDTH, LENGTH = 20_000, 64, 8      # 20000 x 64 float32 = 5.1 MB, over 4 MiB
SEED = 1234


def digest(array):
    """Dtype, shape and sha256 of an array's bytes: equal only if bit for bit equal."""
    array = np.ascontiguousarray(np.asarray(array))
    return f"{array.dtype}{list(array.shape)}:{hashlib.sha256(array.tobytes()).hexdigest()}"


def digests(variables):
    return [digest(v.numpy()) for v in variables]


def exact(values):
    """Floats as hex strings, so that JSON keeps every bit."""
    return [float(v).hex() for v in values]


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, ROWS, (256, LENGTH)).astype("int32")
    y = rng.normal(size=(256, 1)).astype("float32")
    return x, y


def build(optimizer):
    # Explicit names: the second run's layers would otherwise be numbered after the first's.
    model = keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        keras.layers.Embedding(ROWS, WIDTH, name="table"),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.Dense(1, name="out"),
    ], name=f"model_{optimizer}")
    optimizer_class = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer]
    model.compile(optimizer=optimizer_class(name=optimizer), loss="mse")
    return model


def h5_contents(path):
    """Every dataset of an HDF5 file, by its path in the file."""
    contents = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: contents.__setitem__(name, digest(item[()]))
                     if isinstance(item, h5py.Dataset) else None)
    return contents


def train(optimizer, x, y):
    model = build(optimizer)
    initial = digests(model.weights)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
    return model, {
        "initial_weights": initial,
        "losses": exact(history.history["loss"]),
        "weights": digests(model.weights),
        "optimizer_variables": digests(model.optimizer.variables),
        "iterations": int(model.optimizer.iterations.numpy()),
        "predictions": digest(model.predict(x, batch_size=64, verbose=0)),
    }


def save_and_load(model, x, y, directory):
    """Saves `model` in every format this Keras offers and reads each back."""
    result = {}

    path = os.path.join(directory, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    result["keras_file"] = {
        "weights": digests(loaded.weights),
        "optimizer_variables": digests(loaded.optimizer.variables),
        "predictions": digest(loaded.predict(x, batch_size=64, verbose=0)),
        # The loaded optimizer's state must carry on training as the saved one would.
        "loss_after_one_more_epoch": exact(
            loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
            .history["loss"]),
        "weights_after_one_more_epoch": digests(loaded.weights),
    }

    path = os.path.join(directory, "model.weights.h5")
    model.save_weights(path)
    fresh = build(model.optimizer.name)
    fresh.optimizer.build(fresh.trainable_variables)   # else its saved state is skipped
    fresh.load_weights(path)
    result["weights_h5_file"] = {"contents": h5_contents(path),
                                 "weights": digests(fresh.weights),
                                 "optimizer_variables": digests(fresh.optimizer.variables)}

    # The legacy full-model HDF5 format, which both Keras flavours still write and read.
    # Keras 3 loads it uncompiled: it cannot deserialize the loss "mse" such a file holds.
    path = os.path.join(directory, "model.h5")
    model.save(path)
    loaded = keras.models.load_model(path, compile=LEGACY)
    result["h5_file"] = {"contents": h5_contents(path), "weights": digests(loaded.weights)}
    return result


def shapes(model):
    plain = tf.Variable(tf.zeros([3, 5]))
    table = model.get_layer("table").embeddings

    @tf.function
    def shape_of():
        return tf.shape(plain), tf.shape(table), tf.shape(table, out_type=tf.int64)

    return [t.numpy().tolist() for t in shape_of()]


def side_effects(directory):
    counter = tf.Variable(0, dtype=tf.int64)
    total = tf.Variable(1.0)
    appended, traces = [], []
    printed = os.path.join(directory, "printed.txt")

    def append(value):
        appended.append(float(value.numpy()).hex())
        return value

    @tf.function
    def step(x):
        traces.append(1)                  # Python: runs once per trace only
        counter.assign_add(1)
        total.assign(total * 0.5 + x)
        total.assign_sub(0.25)
        tf.py_function(append, [total.read_value()], tf.float32)
        tf.print("step", counter, total, output_stream=f"file://{printed}")
        return counter.read_value(), total.read_value()

    returned = [[int(c), float(t).hex()] for c, t in
                (step(tf.constant(float(i))) for i in range(5))]
    result = {"counter": int(counter.numpy()), "total": float(total.numpy()).hex(),
              "returned": returned, "appended": appended, "traces": len(traces)}
    with open(printed, encoding="utf-8") as f:
        result["printed"] = f.read().splitlines()

    if not LEGACY:                        # Keras 3's own variables, incremented eagerly
        steps = keras.Variable(0, dtype="int64", trainable=False)
        for _ in range(3):
            steps.assign_add(2)
        result["keras_variable_counter"] = int(steps.numpy())
    return result


def work(seed):
    keras.utils.set_random_seed(seed)
    x, y = data()
    result = {"in_strategy_scope": tf.distribute.has_strategy()}
    with tempfile.TemporaryDirectory() as directory:
        for optimizer in ("sgd", "adam"):
            model, result[optimizer] = train(optimizer, x, y)
            os.mkdir(os.path.join(directory, optimizer))
            result[optimizer]["saved"] = save_and_load(
                model, x, y, os.path.join(directory, optimizer))
        result["tf_shape"] = shapes(model)
        result["side_effects"] = side_effects(directory)
    return result


def _watched():
    """The attributes, by name, of the Keras and TensorFlow classes and functions a plain
    program uses: those the strategy replaces are no longer the same objects."""
    owners = {"keras.Model": keras.Model, "keras.layers.Layer": keras.layers.Layer,
              "keras.layers.Embedding": keras.layers.Embedding,
              "keras.optimizers.Optimizer": keras.optimizers.Optimizer,
              "keras.optimizers.SGD": keras.optimizers.SGD,
              "keras.optimizers.Adam": keras.optimizers.Adam,
              "keras.callbacks.Callback": keras.callbacks.Callback,
              "tf.Variable": tf.Variable,
              "ResourceVariable": type(tf.Variable(0.0)),
              "tf.data.Dataset": tf.data.Dataset}
    if not LEGACY:
        owners["keras.Variable"] = keras.Variable
    found = {}
    for owner_name, owner in owners.items():
        for name in dir(owner):
            found[f"{owner_name}.{name}"] = inspect.getattr_static(owner, name, None)
    for module_name, module in {"keras.models": keras.models, "tf": tf}.items():
        for name in ("load_model", "save_model", "shape", "function", "py_function", "print"):
            if hasattr(module, name):
                found[f"{module_name}.{name}"] = getattr(module, name)
    return found


def main():
    before = work(SEED)
    attributes = _watched()
    strategy = hybrid_strategy.HybridStrategy()
    patched = sorted(name for name, value in _watched().items()
                     if attributes.get(name) is not value)
    after = work(SEED)
    print(json.dumps({
        "flavour": "tf_keras" if LEGACY else "keras3",
        "strategy": {"type": type(strategy).__name__,
                     "is_distribute_strategy": isinstance(strategy, tf.distribute.Strategy),
                     "replicas": strategy.num_replicas_in_sync},
        "patched": patched,
        "before": before,
        "after": after,
    }))


if __name__ == "__main__":
    main()
