"""Training scenarios shared by the tests: models, a distributed run, references.

Each case trains a small Embedding + Dense model for a few global batches under
HybridStrategy and the same model on one device from the same weights:
- exact cases: the reference is single-device training with dense gradients (the
  exact arithmetic; Keras 3 alone applies an `IndexedSlices` row by row, which for
  Adagrad with repeated ids is not the same step);
- lazy cases: the reference updates the embedding tables with a numpy lazy rule
  (only the step's rows and their slots move) and everything else with Keras.
Works with Keras 3 and, under TF_USE_LEGACY_KERAS=1, with tf_keras (`tf.keras`).
Run as a script, it prints the report as JSON:

    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/scenario.py
    python tests/scenario.py --local-replicas 2       # one machine, two CPU replicas
"""

import argparse
import functools
import json
import numbers
import sys
import warnings

import numpy as np
import tensorflow as tf

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

VOCAB, SEQ, DIM = 500, 6, 8
GLOBAL_BATCH, STEPS = 32, 8
# Not a multiple of GLOBAL_BATCH: the last batch has one example, so one replica
# of two gets none.
COUNT_EXAMPLES = 3 * GLOBAL_BATCH + 1
# Small enough that the scenario's 16 KB tables are split over every PS task.
MIN_SHARD_BYTES = 1024
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.3),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    # Adam divides by sqrt(v) + epsilon: with the default 1e-7, rows whose gradient
    # nearly cancels amplify float summation order into 1e-5 relative differences.
    "adam": lambda: keras.optimizers.Adam(0.01, epsilon=1e-3),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
}
# name -> (optimizer, model variant, placement overrides, sparse_update)
CASES = {
    "sgd": ("sgd", "plain", None, "lazy"),
    "adagrad": ("adagrad", "plain", None, "lazy"),
    "two_tables": ("adagrad", "two_tables", None, "lazy"),
    "tied": ("adagrad", "tied", None, "lazy"),
    "shared": ("adagrad", "shared", None, "lazy"),
    "forced": ("adagrad", "plain", {"embedding": "mirrored", "hidden/kernel": "ps"}, "lazy"),
    "momentum_exact": ("momentum", "plain", None, "exact"),
    "adam_exact": ("adam", "plain", None, "exact"),
    "rmsprop_exact": ("rmsprop", "plain", None, "exact"),
    "momentum_lazy": ("momentum", "plain", None, "lazy"),
    "adam_lazy": ("adam", "two_tables", None, "lazy"),
    "rmsprop_lazy": ("rmsprop", "plain", None, "lazy"),
}
# SGD without momentum and Adagrad move only rows with gradient: lazy is exact.
LAZY_IS_EXACT = ("sgd", "adagrad")
# One case per model and placement: their predictions and evaluated losses are compared
# too. Inference runs no optimizer: the cases that differ from these in their optimizer
# alone would trace and compare the same inference again.
INFERENCE_CASES = ("adagrad", "two_tables", "tied", "shared", "forced")


def make_data(num_examples=GLOBAL_BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    # Skewed ids, so batches repeat rows within and across replicas.
    ids = np.minimum(rng.zipf(1.3, size=(num_examples, SEQ)) - 1, VOCAB - 1)
    ids = ids.astype("int32")
    y = np.sin(ids.sum(axis=1, keepdims=True) / 50.0).astype("float32")
    return ids, y


class TiedProjection(keras.layers.Layer):
    """Scores against every embedding row: the table also gets a dense gradient."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        table = tf.convert_to_tensor(self.embedding.embeddings)
        return tf.matmul(x, table, transpose_b=True) / 10.0


def build_model(variant="plain"):
    """Embedding + Dense layers; "tied" also uses the table as an output projection,
    "two_tables" embeds each half of the ids with its own table, "shared" looks each
    half up separately in one table (its gradient repeats rows the halves share)."""
    inputs = keras.Input(shape=(SEQ,), dtype="int32")
    half = SEQ // 2
    if variant == "two_tables":
        a = keras.layers.Embedding(VOCAB, DIM, name="embedding")(inputs[:, :half])
        b = keras.layers.Embedding(VOCAB * 2, DIM, name="embedding_b")(inputs[:, half:])
        x = keras.layers.Concatenate(axis=1)([a, b])
    elif variant == "shared":
        embedding = keras.layers.Embedding(VOCAB, DIM, name="embedding")
        x = keras.layers.Concatenate(axis=1)([embedding(inputs[:, :half]),
                                              embedding(inputs[:, half:])])
    else:
        embedding = keras.layers.Embedding(VOCAB, DIM, name="embedding")
        x = embedding(inputs)
    x = keras.layers.Dense(16, activation="tanh", name="hidden")(keras.layers.Flatten()(x))
    if variant == "tied":
        x = keras.layers.Dense(DIM, name="to_dim")(x)
        x = TiedProjection(embedding, name="tied")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(x))


def weight_path(weight):
    """"layer/variable" for Keras 3 and tf_keras weights alike."""
    return getattr(weight, "path", None) or weight.name.split(":")[0]


def is_table_weight(weight):
    return weight_path(weight).endswith("/embeddings")


def initial_weights(variant, seed=1):
    keras.utils.set_random_seed(seed)
    return build_model(variant).get_weights()


def reference_train(weights, optimizer, ids, y, variant, lazy):
    """Single-device training, batch after batch; returns the model."""
    model = build_model(variant)
    model.set_weights(weights)
    variables = model.trainable_variables
    tables = [v for v in variables if is_table_weight(v)] if lazy else []
    dense = [v for v in variables if not any(v is t for t in tables)]
    opt = OPTIMIZERS[optimizer]()
    lazy_rule = LazyRule(opt, tables) if tables else None
    for step, start in enumerate(range(0, len(ids), GLOBAL_BATCH)):
        x, t = ids[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        grads = dict(zip(map(id, variables), tape.gradient(loss, variables)))
        opt.apply_gradients([(tf.convert_to_tensor(grads[id(v)]), v) for v in dense])
        if lazy_rule:
            lazy_rule.apply([(grads[id(v)], v) for v in tables], step + 1)
    model.compile(loss="mse")  # for evaluate() only
    return model


class LazyRule:
    """Numpy lazy updates: only the rows in a step's gradient, and their slots, move.

    In float32, as the optimizers compute (Adam's bias correction 1 - beta**t
    differs from its float64 value by ~1e-5 relative).
    """

    def __init__(self, optimizer, tables):
        self.config = optimizer.get_config()
        self.kind = type(optimizer).__name__
        self.slots = {id(t): {"m": np.zeros(t.shape, "float32"), "v": np.zeros(t.shape, "float32")}
                      for t in tables}

    def apply(self, grads_and_tables, t):
        c = {k: np.float32(v) for k, v in self.config.items()
             if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        lr, one, t = c["learning_rate"], np.float32(1), np.float32(t)
        for grad, table in grads_and_tables:
            rows, g = _merged_rows(grad)
            w = table.numpy()
            m, v = self.slots[id(table)]["m"], self.slots[id(table)]["v"]
            if self.kind == "SGD":
                m[rows] = c["momentum"] * m[rows] - lr * g
                w[rows] += m[rows]
            elif self.kind == "Adam":
                b1, b2 = c["beta_1"], c["beta_2"]
                m[rows] += (g - m[rows]) * (one - b1)
                v[rows] += (g * g - v[rows]) * (one - b2)
                alpha = lr * np.sqrt(one - b2 ** t) / (one - b1 ** t)
                w[rows] -= alpha * m[rows] / (np.sqrt(v[rows]) + c["epsilon"])
            elif self.kind == "RMSprop":
                rho = c["rho"]
                v[rows] = rho * v[rows] + (one - rho) * g * g
                m[rows] = c["momentum"] * m[rows] + lr * g / np.sqrt(v[rows] + c["epsilon"])
                w[rows] -= m[rows]
            else:
                raise ValueError(f"no lazy reference for {self.kind}")
            table.assign(w)


def _merged_rows(grad):
    rows, positions = np.unique(grad.indices.numpy(), return_inverse=True)
    summed = np.zeros((len(rows),) + tuple(grad.values.shape[1:]), "float32")
    np.add.at(summed, positions, grad.values.numpy())
    return rows, summed


def distributed_train(strategy, weights, optimizer, ids, y, variant):
    """`model.fit` on a tf.data.Dataset under `strategy`; returns the model."""
    with strategy.scope():
        model = build_model(variant)
        model.set_weights(weights)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    return model


# Weights whose largest entry is below this (a bias that stays near zero) are
# compared against it instead, i.e. absolutely at TOLERANCE * WEIGHT_SCALE_FLOOR.
WEIGHT_SCALE_FLOOR = 0.01


def relative_errors(actual, expected):
    """Per weight: max |actual - expected| / max(max |expected|, WEIGHT_SCALE_FLOOR)."""
    return [float(np.max(np.abs(a - e))
                  / max(float(np.max(np.abs(e))), WEIGHT_SCALE_FLOOR))
            for a, e in zip(actual, expected)]


def variable_devices(model):
    """`{path: [devices]}`: a PS table's shard devices, or one per replica if mirrored."""
    out = {}
    for w in model.weights:
        value = raw_variable(w)
        parts = getattr(value, "shards", None) or getattr(value, "values", None)
        out[weight_path(w)] = [p.device for p in parts] if parts else [value.device]
    return out


def raw_variable(weight):
    """What the strategy created: Keras 3 wraps it (`.value`), tf_keras does not."""
    value = getattr(weight, "value", None)
    return weight if value is None or callable(value) else value


def equivalence_case(make_strategy, optimizer, variant, overrides, sparse_update,
                     inference=False):
    """Weights after training against single-device training, where they live, and with
    `inference`, predictions and evaluated loss on held-out data against the reference's.
    """
    # The strategy first: on a cluster it connects this process, and variables
    # made before that would belong to a device that no longer exists.
    strategy = make_strategy(placement_overrides=overrides, sparse_update=sparse_update)
    ids, y = make_data()
    weights = initial_weights(variant)
    lazy = sparse_update == "lazy" and optimizer not in LAZY_IS_EXACT
    reference = reference_train(weights, optimizer, ids, y, variant, lazy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = distributed_train(strategy, weights, optimizer, ids, y, variant)
    out = {
        "relative_errors": dict(zip([weight_path(w) for w in model.weights],
                                    relative_errors(model.get_weights(),
                                                    reference.get_weights()))),
        "devices": variable_devices(model),
        "placement": {r.path: [s.task for s in r.placement.shards] or "mirrored"
                      for r in strategy.placement},
        "placement_table": str(strategy.placement),
        "gradient_types": strategy.gradient_types,
        "ps_aggregated": sorted(strategy.ps_aggregated),
        "warnings": [str(w.message) for w in caught
                     if type(w.message).__name__ == "PlacementWarning"],
    }
    if inference:
        held_out = make_data(GLOBAL_BATCH * 2, seed=5)[0]
        zeros = np.zeros((len(held_out), 1), "float32")
        out["predict_error"] = relative_errors(
            [model.predict(held_out, batch_size=GLOBAL_BATCH, verbose=0)],
            [reference.predict(held_out, batch_size=GLOBAL_BATCH, verbose=0)])[0]
        out["evaluate_loss"] = float(model.evaluate(held_out, zeros, batch_size=GLOBAL_BATCH,
                                                    verbose=0))
        out["reference_loss"] = float(reference.evaluate(held_out, zeros,
                                                         batch_size=GLOBAL_BATCH, verbose=0))
    return out


class SumOfOutputs(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_sum(y_pred, axis=-1)


def _counting_model(n):
    model = keras.Sequential([
        keras.Input(shape=(1,), dtype="int32"),
        keras.layers.Embedding(n, 1, embeddings_initializer="zeros", name="rows"),
        keras.layers.Flatten(),
    ])
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=SumOfOutputs(reduction="sum"))
    return model


def counting_case(make_strategy, source):
    """Trains one epoch where example i touches only row i of a zero table.

    With loss = sum of outputs, each use of an example moves its row by the same
    amount; dividing by the rows of the same epoch on one device gives how many
    times the cluster used each example.
    """
    strategy = make_strategy()
    n = COUNT_EXAMPLES
    ids = np.arange(n, dtype="int32").reshape(n, 1)
    y = np.zeros((n, 1), "float32")
    single_device = _counting_model(n)
    single_device.fit(ids, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    with strategy.scope():
        model = _counting_model(n)
    batches = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append(batch))
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


def large_table_case(make_strategy, rows=100_000, dim=64):
    """Where a 100,000-row table and its slots live, and that it trains."""
    strategy = make_strategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(4,), dtype="int32"),
            keras.layers.Embedding(rows, dim, name="big"),
            keras.layers.Flatten(),
            keras.layers.Dense(1, name="out"),
        ])
        model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    ids = np.random.default_rng(3).integers(0, rows, size=(64, 4)).astype("int32")
    before = model.get_weights()[0]
    model.fit(ids, np.ones((64, 1), "float32"), batch_size=GLOBAL_BATCH, verbose=0)
    after = model.get_weights()[0]
    table = next(w for w in model.weights if weight_path(w).endswith("big/embeddings"))
    table_value = raw_variable(table)
    slot_devices = {}
    for v in model.optimizer.variables:
        value = raw_variable(v)
        if hasattr(value, "shards"):
            slot_devices[weight_path(v)] = [s.device for s in value.shards]
    return {
        "shape": list(after.shape),
        "rows_changed": int((np.abs(after - before).sum(axis=1) > 0).sum()),
        "distinct_ids": int(len(np.unique(ids))),
        "shard_devices": [s.device for s in table_value.shards],
        "shard_rows": [int(s.shape[0]) for s in table_value.shards],
        "slot_devices": slot_devices,
        "placement_table": str(strategy.placement),
    }


def multi_step_case(make_strategy, steps_per_execution=3):
    """`compile(steps_per_execution=3)` trains as one step per call does.

    8 batches make executions of 3, 3 and a final partial one of 2 steps; SGD and
    Adagrad train the plain model (its table on the PS on a cluster) both ways
    from the same weights, and evaluate with the same steps per execution.
    """
    ids, y = make_data()
    held_out = make_data(GLOBAL_BATCH * 2, seed=5)[0]
    zeros = np.zeros((len(held_out), 1), "float32")
    weights = initial_weights("plain")
    out = {}
    for optimizer in ("sgd", "adagrad"):
        runs = {}
        for steps in (1, steps_per_execution):
            strategy = make_strategy()
            with strategy.scope():
                model = build_model()
                model.set_weights(weights)
                model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse",
                              steps_per_execution=steps)
            calls = []
            history = model.fit(ids, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0,
                                callbacks=[keras.callbacks.LambdaCallback(
                                    on_train_batch_end=lambda batch, logs: calls.append(batch))])
            runs[steps] = {
                "calls": len(calls),
                "weights": model.get_weights(),
                "loss": float(history.history["loss"][-1]),
                "evaluate_loss": float(model.evaluate(held_out, zeros,
                                                      batch_size=GLOBAL_BATCH, verbose=0)),
                "table_devices": variable_devices(model)["embedding/embeddings"],
            }
        single, multi = runs[1], runs[steps_per_execution]
        out[optimizer] = {
            "relative_errors": dict(zip([weight_path(w) for w in model.weights],
                                        relative_errors(multi["weights"], single["weights"]))),
            "moved": max(relative_errors(single["weights"], weights)),
            **{key: [single[key], multi[key]]
               for key in ("calls", "loss", "evaluate_loss", "table_devices")},
        }
    return out


def report(make_strategy, cases=CASES):
    out = {name: equivalence_case(make_strategy, *spec, inference=name in INFERENCE_CASES)
           for name, spec in cases.items()}
    for source in ("dataset", "numpy"):
        out[f"count_{source}"] = counting_case(make_strategy, source)
    out["large_table"] = large_table_case(make_strategy)
    out["multi_step"] = multi_step_case(make_strategy)
    return out


def local_cpu_replicas(count):
    """Splits this process's CPU into `count` devices (before TensorFlow uses it); their names.

    None for 0: the scenario runs on a cluster.
    """
    if not count:
        return None
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [f"/cpu:{i}" for i in range(count)]


def strategy_maker(argv, **options):
    """`make_strategy(**kwargs)`: a HybridStrategy with `options`, on this machine's CPU
    replicas given `--local-replicas N` in `argv`, else on TF_CONFIG's cluster."""
    import hybrid_strategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-replicas", type=int, default=0,
                        help="run on this machine alone with this many CPU replicas")
    parser.add_argument("--dense-sum", default="auto",
                        help="HybridStrategy's dense_sum (auto: on the PS, at 2 workers)")
    args = parser.parse_args(argv)
    make_strategy = functools.partial(hybrid_strategy.HybridStrategy,
                                      min_shard_bytes=MIN_SHARD_BYTES,
                                      dense_sum=args.dense_sum, **options)
    if args.local_replicas:
        make_strategy = functools.partial(
            make_strategy, devices=local_cpu_replicas(args.local_replicas))
    return make_strategy


def main(argv):
    json.dump(report(strategy_maker(argv)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
