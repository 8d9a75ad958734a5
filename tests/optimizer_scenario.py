"""A recommender's tables trained by AdamW, Ftrl and MultiOptimizer, against one device.

The model: user, item and (multi-hot, mean-pooled) category tables, four dense
features and an MLP tower giving a click logit, trained with `model.fit` on
global batches of 34 (17 examples per worker). Each case trains it under
HybridStrategy with its tables split over every ps task, and the same model from
the same weights on one device (`optimizer_references.train`: dense gradients for
exact mode, the lazy rule for lazy mode), and reports the relative error of every
weight and optimizer slot of the tables, and where each weight and slot lives.
Works with Keras 3 and, under TF_USE_LEGACY_KERAS=1, with tf_keras (no
MultiOptimizer there). Prints the report as JSON, of every case or of those named:

    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/optimizer_scenario.py [adamw_exact,...]
"""

import json
import sys

import numpy as np
import tensorflow as tf

import optimizer_references as references

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
KERAS3 = hasattr(keras, "ops")

USERS, ITEMS, CATEGORIES, DIM, FEATURES = 300, 600, 64, 8, 4
GLOBAL_BATCH, STEPS = 34, 6
# Every table (2 KB and more) is split over both ps tasks.
MIN_SHARD_BYTES = 1024
TABLES = ("user", "item", "category")


def cases():
    """name -> (optimizer, the optimizer of the single-device reference, sparse_update)."""
    o = keras.optimizers

    def adamw():
        return o.AdamW(0.01, weight_decay=0.05, epsilon=1e-4)

    def ftrl():
        return o.Ftrl(0.05, l1_regularization_strength=0.001,
                      l2_regularization_strength=0.001)

    out = {
        "adamw_exact": (adamw, adamw, "exact"),
        "adamw_lazy": (adamw, adamw, "lazy"),
        "ftrl_exact": (ftrl, ftrl, "exact"),
    }
    if KERAS3:
        def multi():
            return o.MultiOptimizer(o.OptimizerMap(o.Adam(0.01, epsilon=1e-4), {
                "(user|item)/embeddings": o.Ftrl(0.05), "category/embeddings": o.Adagrad(0.1)}))

        def lamb():
            return o.Lamb(0.02, epsilon=1e-4)

        out["multi_exact"] = (multi, multi, "exact")
        # Loss scaling by powers of two unscales exactly: the reference needs none.
        out["loss_scale_lamb_lazy"] = (lambda: o.LossScaleOptimizer(lamb()), lamb, "lazy")
    return out


def build_model():
    user = keras.Input(shape=(1,), dtype="int32", name="user_id")
    item = keras.Input(shape=(1,), dtype="int32", name="item_id")
    categories = keras.Input(shape=(3,), dtype="int32", name="category_ids")
    features = keras.Input(shape=(FEATURES,), name="features")
    u = keras.layers.Flatten()(keras.layers.Embedding(USERS, DIM, name="user")(user))
    i = keras.layers.Flatten()(keras.layers.Embedding(ITEMS, DIM, name="item")(item))
    c = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(CATEGORIES, DIM, name="category")(categories))
    x = keras.layers.Concatenate()([u * i, c, features])
    x = keras.layers.Dense(16, activation="relu", name="tower_1")(x)
    x = keras.layers.Dense(8, activation="relu", name="tower_2")(x)
    return keras.Model([user, item, categories, features],
                       keras.layers.Dense(1, name="logit")(x))


def make_data():
    rng = np.random.default_rng(11)
    n = GLOBAL_BATCH * STEPS
    # Popular users and items come back within and across batches.
    user = np.minimum(rng.zipf(1.3, (n, 1)) - 1, USERS - 1).astype("int32")
    item = np.minimum(rng.zipf(1.2, (n, 1)) - 1, ITEMS - 1).astype("int32")
    categories = rng.integers(0, CATEGORIES, (n, 3)).astype("int32")
    features = rng.normal(size=(n, FEATURES)).astype("float32")
    clicks = (rng.random((n, 1)) < 0.3).astype("float32")
    return (user, item, categories, features), clicks


def path(weight):
    return getattr(weight, "path", None) or weight.name.split(":")[0]


def is_table(weight):
    return path(weight).split("/")[-2] in TABLES and path(weight).endswith("embeddings")


def raw(variable):
    """What the strategy made: Keras 3 wraps it (`.value`), tf_keras does not."""
    value = getattr(variable, "value", None)
    return variable if value is None or callable(value) else value


def devices(variable):
    value = raw(variable)
    parts = getattr(value, "shards", None) or getattr(value, "values", None)
    return [p.device for p in parts] if parts else [value.device]


def table_slots(optimizer, table):
    """`optimizer`'s variables shaped like `table`, in its own order, of that table's
    optimizer (a MultiOptimizer holds several tables of one shape: match by path)."""
    return [v for v in optimizer.variables
            if tuple(v.shape) == tuple(table.shape) and path(table).split("/")[-2] in path(v)]


def reference_training(weights, factory, lazy, inputs, clicks):
    model = build_model()
    model.set_weights(weights)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    tables = [w for w in model.trainable_variables if is_table(w)]

    def loss_of(step):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        return loss_fn(clicks[batch], model([x[batch] for x in inputs]))

    optimizers = references.train(model.trainable_variables, tables, loss_of, range(STEPS),
                                  factory, lazy)
    return model, {path(t): table_slots(optimizers[id(t)], t) for t in tables}


def case(strategy, weights, make_optimizer, reference_optimizer, mode):
    inputs, clicks = make_data()
    with strategy.scope():
        model = build_model()
        model.set_weights(weights)
        model.compile(optimizer=make_optimizer(),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices((inputs, clicks)).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, verbose=0)
    reference, reference_slots = reference_training(weights, reference_optimizer,
                                                    mode == "lazy", inputs, clicks)
    errors = {path(w): references.error(references.values(w), references.values(r))
              for w, r in zip(model.weights, reference.weights)}
    slots = {}
    for table in (w for w in model.weights if is_table(w)):
        mine = table_slots(model.optimizer, table)
        theirs = reference_slots[path(table)]
        assert len(mine) == len(theirs), (path(table), len(mine), len(theirs))
        for slot, expected in zip(mine, theirs):
            errors[path(slot)] = references.error(references.values(slot),
                                                  references.values(expected))
            slots[path(slot)] = devices(slot)
    out = {}
    if mode == "lazy":
        # How far the lazy step is from the exact one: the comparison can tell them apart.
        exact, _ = reference_training(weights, reference_optimizer, False, inputs, clicks)
        out["exact_reference_error"] = max(
            references.error(references.values(w), references.values(r))
            for w, r in zip(model.weights, exact.weights) if is_table(w))
    return {
        **out,
        "relative_errors": errors,
        "moved": {path(w): references.error(references.values(w), before)
                  for w, before in zip(model.weights, weights)},
        "devices": {path(w): devices(w) for w in model.weights},
        "slot_devices": slots,
        "ps_aggregated": sorted(strategy.ps_aggregated),
    }


def main(argv):
    """Runs every case, or those named in `argv` (comma-separated)."""
    import hybrid_strategy

    keras.utils.set_random_seed(3)
    weights = build_model().get_weights()
    report = {}
    chosen = cases()
    if argv:
        chosen = {name: chosen[name] for name in argv[0].split(",")}
    for name, (make_optimizer, reference_optimizer, mode) in chosen.items():
        strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES,
                                                  sparse_update=mode)
        report[name] = case(strategy, weights, make_optimizer, reference_optimizer, mode)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
