"""A PS table trained under mixed_float16 and mixed_bfloat16, against the same policy on one device.

For each policy, the model (an Embedding table, mean-pooled, and two Dense layers) is
trained with Adagrad and `model.fit` for a few global batches of 64 under
HybridStrategy (its table on the ps), and from the same weights by Keras' training
step on one device. The
first batch's labels are so large that mixed_float16's first step overflows in
every replica: Keras' LossScaleOptimizer skips it and halves its scale, on one
device and under the strategy. Reported per policy: the relative error of every
weight, the optimizer (and its loss scale) on both sides, the table's devices and
gradient type, and the ops of the traced steps that hold a tensor with as many rows
as the table (a step that costs the whole table). Prints the report as JSON:

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python tests/mixed_precision_scenario.py
"""

import gc
import json
import sys

import numpy as np
import tensorflow as tf
# TF-private: the graphs of traced functions, searched for table-sized tensors.
from tensorflow.python.framework import func_graph

import keras

ROWS, DIM, IDS = 20_000, 16, 8
GLOBAL_BATCH, STEPS = 64, 8
TABLE = "item/embeddings"
POLICIES = ("mixed_float16", "mixed_bfloat16")


def build_model():
    ids = keras.Input(shape=(IDS,), dtype="int32", name="ids")
    x = keras.layers.Embedding(ROWS, DIM, name="item")(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def make_data():
    rng = np.random.default_rng(5)
    n = GLOBAL_BATCH * STEPS
    # Popular ids come back within and across batches.
    ids = np.minimum(rng.zipf(1.3, (n, IDS)) - 1, ROWS - 1).astype("int32")
    labels = rng.normal(size=(n, 1)).astype("float32")
    # The first step's scaled gradient overflows float16 (on one device and in each
    # replica's half of the batch alike).
    labels[:GLOBAL_BATCH] = 1e4
    return ids, labels


def train(weights, data):
    """HybridStrategy's training: `model.fit` in its scope."""
    model = build_model()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH), epochs=1,
              verbose=0)
    return model


def reference_training(weights, data):
    """Keras 3's training step on one device, with the table's gradient made dense: its
    `IndexedSlices` repeat the rows an id comes back in, which Keras' Adagrad squares
    one by one, where the step of the batch's gradient squares their sum."""
    model = build_model()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    optimizer = model.optimizer
    for x, y in tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
            loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
    return model


def optimizer_state(optimizer):
    scale = getattr(optimizer, "dynamic_scale", None)
    return {"class": type(optimizer).__name__,
            "loss_scale": None if scale is None else float(scale.numpy())}


def table_sized_ops(graphs):
    """'type name shape' of every op in `graphs` with an output of at least ROWS rows."""
    found = []
    for graph in graphs:
        for op in graph.get_operations():
            for output in op.outputs:
                shape = output.shape
                if shape.rank and shape[0] is not None and shape[0] >= ROWS:
                    found.append(f"{op.type} {op.name} {shape}")
                    break
    return found


def traced_graphs(before):
    return [g for g in gc.get_objects()
            if isinstance(g, func_graph.FuncGraph) and id(g) not in before]


def case(policy, weights):
    import hybrid_strategy

    keras.mixed_precision.set_global_policy(policy)
    try:
        data = make_data()
        before = {id(g) for g in gc.get_objects() if isinstance(g, func_graph.FuncGraph)}
        strategy = hybrid_strategy.HybridStrategy()
        with strategy.scope():
            model = train(weights, data)
        big_ops = table_sized_ops(traced_graphs(before))
        reference = reference_training(weights, data)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    errors = {}
    for mine, theirs in zip(model.weights, reference.weights):
        actual, expected = np.asarray(mine), np.asarray(theirs)
        errors[mine.path] = float(np.max(np.abs(actual - expected))
                                  / max(np.max(np.abs(expected)), 0.01))
    table = next(w for w in model.weights if w.path == TABLE)
    return {
        "relative_errors": errors,
        "moved": float(np.max(np.abs(np.asarray(table) - weights[0]))),
        "optimizer": optimizer_state(model.optimizer),
        "reference_optimizer": optimizer_state(reference.optimizer),
        "table_devices": [s.device for s in table.value.shards],
        "gradient_types": strategy.gradient_types,
        "ps_aggregated": sorted(strategy.ps_aggregated),
        "table_sized_ops": big_ops,
    }


def main():
    keras.utils.set_random_seed(3)
    weights = build_model().get_weights()
    report = {policy: case(policy, weights) for policy in POLICIES}
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
