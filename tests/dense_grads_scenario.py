"""Tables with dense gradients or penalties, in models shaped as Keras model libraries build them.

Two models, written here, reproduce idioms of popular model libraries:
- `lm`: a GPT-style decoder: token and position embeddings, causal self-attention, a
  feed-forward layer, and logits `h @ transpose(token table)`: the token table is tied
  to the output projection, so its gradient is dense;
- `ctr`: a wide & deep click model whose every table carries a regularizer: an l2
  `embeddings_regularizer` on each deep and each linear (one-wide) table, and a custom
  one-wide weight read by row (`tf.gather`) with a custom row-wise regularizer
  (`ctr_norm`: one deep table carries a norm penalty instead, not a sum over rows).
Each case trains with `model.fit` (or a custom loop: `tf.function` + `strategy.run`)
under HybridStrategy, and reports how far the weights are from single-device training
with dense gradients on the same global batches (and from MirroredStrategy, on one
machine), where every weight landed and why, the gradient types and the warnings.
Works with Keras 3 and, under TF_USE_LEGACY_KERAS=1, with tf_keras. Prints JSON:

    python tests/dense_grads_scenario.py --local-replicas 2
    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/dense_grads_scenario.py

`--second-model` trains instead the decoder twice under one strategy, with SGD then
with Adam (as a rerun or a search does), and reports each model's run; `--saved-plan
PATH` trains it twice under two strategies, the second given the placement plan the
first ended with (saved to PATH).
"""

import argparse
import json
import sys
import warnings

import numpy as np
import tensorflow as tf

import scenario
import user_models

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
KERAS3 = hasattr(keras, "ops")

VOCAB, SEQ, DIM = 64, 6, 8
CTR_VOCABS, CTR_DIM = (40, 30, 20), 4
HASHED_ROWS = 50
GLOBAL_BATCH, STEPS = 16, 5
MIN_SHARD_BYTES = 256
L2 = 1e-3


class SumOfSquares(keras.regularizers.Regularizer):
    """A custom regularizer that is a sum over rows (as l2, by another name)."""

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return self.factor * tf.reduce_sum(x * x)

    def get_config(self):
        return {"factor": self.factor}


class NormPenalty(keras.regularizers.Regularizer):
    """The table's Frobenius norm: not a sum over rows."""

    def __call__(self, x):
        return 0.01 * tf.sqrt(tf.reduce_sum(tf.square(x)))


class AddPositions(keras.layers.Layer):
    """Adds a learned vector per position (an `Embedding` of the positions)."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.positions = keras.layers.Embedding(length, dim, name="position")

    def call(self, x):
        return x + self.positions(tf.range(self.length))


class TiedLogits(keras.layers.Layer):
    """Scores every token of the vocabulary with the token table itself."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        if KERAS3:
            return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True)


class HashedLinear(keras.layers.Layer):
    """A one-wide weight per hashed id, read by row, with a regularizer of its own."""

    def __init__(self, rows, regularizer, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.weight_regularizer = rows, regularizer

    def build(self, input_shape):
        self.table = self.add_weight(
            shape=(self.rows, 1), name="table", regularizer=self.weight_regularizer,
            initializer=keras.initializers.RandomNormal(stddev=0.1))
        super().build(input_shape)

    def call(self, ids):
        rows = tf.gather(self.table, (tf.cast(ids, "int32") * 7) % self.rows)
        return tf.reduce_sum(rows, axis=1)


def lm():
    ids = keras.Input((SEQ,), dtype="int32")
    token = keras.layers.Embedding(VOCAB, DIM, name="token")
    x = AddPositions(SEQ, DIM, name="add_positions")(token(ids))
    attended = keras.layers.MultiHeadAttention(2, 4, name="attention")(
        x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="norm")(x + attended)
    x = keras.layers.Dense(DIM, activation="tanh", name="ffn")(x)
    return keras.Model(ids, TiedLogits(token, name="logits")(x), name="lm")


def ctr(deep_regularizers=None):
    ids = keras.Input((len(CTR_VOCABS),), dtype="int32")
    deep_regularizers = deep_regularizers or [keras.regularizers.L2(L2)] * len(CTR_VOCABS)
    deep, wide = [], []
    for f, (rows, regularizer) in enumerate(zip(CTR_VOCABS, deep_regularizers)):
        field = ids[:, f]
        deep.append(keras.layers.Embedding(rows, CTR_DIM, name=f"deep_{f}",
                                           embeddings_regularizer=regularizer)(field))
        wide.append(keras.layers.Embedding(rows, 1, name=f"wide_{f}",
                                           embeddings_regularizer=keras.regularizers.L2(L2))(
            field))
    x = keras.layers.Concatenate(name="concat")(deep)
    x = keras.layers.Dense(8, activation="relu", name="hidden",
                           kernel_regularizer=keras.regularizers.L2(L2))(x)
    hashed = HashedLinear(HASHED_ROWS, SumOfSquares(L2), name="hashed")(ids)
    logit = keras.layers.Add(name="logit")(
        [keras.layers.Dense(1, name="deep_out")(x), hashed] + wide)
    return keras.Model(ids, logit, name="ctr")


def ctr_norm():
    return ctr([NormPenalty()] + [keras.regularizers.L2(L2)] * (len(CTR_VOCABS) - 1))


MODELS = {"lm": lm, "ctr": ctr, "ctr_norm": ctr_norm}
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    # Adam divides by sqrt(v) + epsilon: a larger epsilon keeps float summation order
    # from growing into 1e-5 relative differences.
    "adam": lambda: keras.optimizers.Adam(0.01, epsilon=1e-3),
    "adagrad": lambda: keras.optimizers.Adagrad(0.2),
    # Clipping sees the summed gradient, penalties included.
    "adagrad_clip": lambda: keras.optimizers.Adagrad(0.2, global_clipnorm=0.5),
}
# name -> (model, optimizer, how it trains, HybridStrategy arguments); "evaluate, fit"
# evaluates before `fit` too, so that an evaluation function exists before any move.
CASES = {
    "lm/momentum": ("lm", "momentum", "evaluate, fit", {}),
    "ctr/adagrad_clip": ("ctr", "adagrad_clip", "fit", {}),
    "ctr/loop": ("ctr", "adam", "loop", {}),
    "ctr_norm/adagrad": ("ctr_norm", "adagrad", "fit", {}),
}


def make_data(model, num_examples=GLOBAL_BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    if model == "lm":
        tokens = np.minimum(rng.zipf(1.3, size=(num_examples, SEQ + 1)) - 1, VOCAB - 1)
        return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    ids = np.stack([np.minimum(rng.zipf(1.3, size=num_examples) - 1, rows - 1)
                    for rows in CTR_VOCABS], axis=1).astype("int32")
    y = (np.sin(ids.sum(axis=1, keepdims=True)) > 0).astype("float32")
    return ids, y


def loss_object(model, reduction="sum_over_batch_size"):
    if model == "lm":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                          reduction=reduction)
    return keras.losses.BinaryCrossentropy(from_logits=True, reduction=reduction)


def reference_weights(model_name, weights, optimizer, x, y):
    """Single-device training with dense gradients, penalties included."""
    model = MODELS[model_name]()
    model.set_weights(weights)
    opt, loss = OPTIMIZERS[optimizer](), loss_object(model_name)
    for start in range(0, len(x), GLOBAL_BATCH):
        batch, target = x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            total = loss(target, model(batch, training=True)) + tf.add_n(
                [tf.constant(0.0)] + model.losses)
        grads = tape.gradient(total, model.trainable_variables)
        opt.apply_gradients([(tf.convert_to_tensor(g), v)
                             for g, v in zip(grads, model.trainable_variables)])
    return model


def fit_model(strategy, model_name, weights, optimizer, x, y, evaluate_first=False):
    with strategy.scope():
        model = MODELS[model_name]()
        model.set_weights(weights)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss_object(model_name))
    if evaluate_first:
        model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    return model, model.optimizer


def loop_model(strategy, model_name, weights, optimizer, x, y):
    """A custom training loop: `strategy.run` in a `tf.function`, as TF's guides write it."""
    with strategy.scope():
        model = MODELS[model_name]()
        model.set_weights(weights)
        opt = OPTIMIZERS[optimizer]()
        opt.build(model.trainable_variables)
    loss = loss_object(model_name, reduction="none")
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    def replica_step(batch, target):
        with tf.GradientTape() as tape:
            per_example = loss(target, model(batch, training=True))
            if model_name == "lm":
                per_example = tf.reduce_mean(per_example, axis=1)
            total = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            if model.losses:
                total += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(total, variables), variables))

    step = tf.function(lambda batch, target: strategy.run(replica_step, (batch, target)))
    for batch, target in dataset:
        step(batch, target)
    with strategy.scope():
        model.compile(loss=loss_object(model_name))  # for evaluate() only
    return model, opt


def errors(model, actual, expected):
    return dict(zip([scenario.weight_path(w) for w in model.weights],
                    scenario.relative_errors(actual, expected)))


def table_slots_on_ps(optimizer):
    """Paths of the optimizer's variables that live on the PS (as table slots do)."""
    return sorted(scenario.weight_path(v) for v in optimizer.variables
                  if hasattr(scenario.raw_variable(v), "shards"))


def case(make_hybrid, make_mirrored, model_name, optimizer, kind, options):
    strategy = make_hybrid(**options)
    x, y = make_data(model_name)
    keras.utils.set_random_seed(1)
    weights = MODELS[model_name]().get_weights()
    reference = reference_weights(model_name, weights, optimizer, x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "loop":
            model, trained_with = loop_model(strategy, model_name, weights, optimizer, x, y)
        else:
            model, trained_with = fit_model(strategy, model_name, weights, optimizer, x, y,
                                            evaluate_first=kind.startswith("evaluate"))
    held_out, target = make_data(model_name, GLOBAL_BATCH * 2, seed=5)
    out = {
        "vs_single_device": errors(model, model.get_weights(), reference.get_weights()),
        "placement": {r.path: [str(r.placement), r.reason] for r in strategy.placement},
        "devices": scenario.variable_devices(model),
        "gradient_types": strategy.gradient_types,
        "ps_aggregated": sorted(strategy.ps_aggregated),
        "slots_on_ps": table_slots_on_ps(trained_with),
        "warnings": [str(w.message) for w in caught
                     if type(w.message).__name__ == "PlacementWarning"],
        # Penalties included: under HybridStrategy, the value each shard's PS computed.
        "evaluate_loss": float(model.evaluate(held_out, target, batch_size=GLOBAL_BATCH,
                                              verbose=0)),
        "reference_loss": float(loss_object(model_name)(target, reference(held_out))
                                + tf.add_n([tf.constant(0.0)] + reference.losses)),
    }
    # Keras 3 under MirroredStrategy applies the all-gathered rows of a sparse gradient
    # one by one: its Adam is not single-device training (the position table).
    if make_mirrored is not None and kind != "loop" and not (KERAS3 and optimizer == "adam"):
        mirrored, _ = fit_model(make_mirrored(), model_name, weights, optimizer, x, y)
        out["vs_mirrored"] = errors(model, model.get_weights(), mirrored.get_weights())
    return out


def mixed_precision_case(make_hybrid, make_mirrored):
    """tf_keras' mixed_float16, whose LossScaleOptimizer unscales each replica's gradients
    before they are summed: the penalties' marker rows are unscaled with them."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_data("ctr")
        keras.utils.set_random_seed(1)
        weights = ctr().get_weights()
        strategy = make_hybrid()
        hybrid, optimizer = fit_model(strategy, "ctr", weights, "sgd", x, y)
        mirrored, _ = fit_model(make_mirrored(), "ctr", weights, "sgd", x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {"optimizer": type(optimizer).__name__,
            "gradient_types": strategy.gradient_types,
            "vs_mirrored": errors(hybrid, hybrid.get_weights(), mirrored.get_weights()),
            "moved": max(scenario.relative_errors(hybrid.get_weights(), weights))}


def second_model_case(make_hybrid):
    """The decoder trained twice under one strategy: each model's tied table is its own
    variable, of the same path, and is checked and moved (or warned about) afresh."""
    strategy = make_hybrid()
    x, y = make_data("lm")
    keras.utils.set_random_seed(1)
    weights = lm().get_weights()
    out = {}
    for optimizer in ("sgd", "adam"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, trained_with = fit_model(strategy, "lm", weights, optimizer, x, y)
        reference = reference_weights("lm", weights, optimizer, x, y)
        out[optimizer] = {
            "vs_single_device": errors(model, model.get_weights(), reference.get_weights()),
            "placement": {r.path: [str(r.placement), r.reason] for r in strategy.placement},
            "devices": scenario.variable_devices(model),
            "gradient_types": strategy.gradient_types,
            "slots_on_ps": table_slots_on_ps(trained_with),
            "warnings": [str(w.message) for w in caught
                         if type(w.message).__name__ == "PlacementWarning"],
        }
    return out


def saved_plan_case(make_hybrid, path):
    """The decoder trained twice from the same weights, each run under a strategy of its
    own: the second given the plan the first ended with, saved to `path`."""
    x, y = make_data("lm")
    keras.utils.set_random_seed(1)
    weights = lm().get_weights()
    out = {}
    for run, options in (("first", {}), ("second", {"placement_plan": path})):
        strategy = make_hybrid(**options)
        model, _ = fit_model(strategy, "lm", weights, "sgd", x, y)
        if run == "first":
            strategy.placement.save(path)
        out[run] = {
            "weights": model.get_weights(),
            "placement": {r.path: [str(r.placement), r.reason] for r in strategy.placement},
            "revisions": [[r.path, str(r.before), str(r.after)]
                          for r in strategy.placement.revisions],
            "devices": scenario.variable_devices(model),
        }
    second = out.pop("second")
    out["vs_first"] = errors(model, second.pop("weights"), out["first"].pop("weights"))
    out["second"] = second
    return out


def report(make_hybrid, make_mirrored=None):
    return {name: case(make_hybrid, make_mirrored, *spec) for name, spec in CASES.items()}


def main(argv):
    import hybrid_strategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-replicas", type=int, default=0,
                        help="run on this machine alone with this many CPU replicas, "
                             "and compare with MirroredStrategy on them")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="run only the mixed_float16 case (tf_keras, --local-replicas)")
    parser.add_argument("--second-model", action="store_true",
                        help="run only the decoder twice under one strategy")
    parser.add_argument("--saved-plan", metavar="PATH",
                        help="run only the decoder twice, the second run given the "
                             "placement plan the first saved to PATH")
    args = parser.parse_args(argv)
    devices = scenario.local_cpu_replicas(args.local_replicas)

    def make_hybrid(**options):
        return hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES,
                                              devices=devices, **options)

    # One for the whole run: MirroredStrategy instances share collective keys.
    mirrored = tf.distribute.MirroredStrategy(devices) if devices else None
    make_mirrored = (lambda: mirrored) if devices else None
    if args.mixed_precision:
        out = {"ctr/mixed_float16": mixed_precision_case(make_hybrid, make_mirrored)}
    elif args.second_model:
        out = second_model_case(make_hybrid)
    elif args.saved_plan:
        out = saved_plan_case(make_hybrid, args.saved_plan)
    else:
        out = report(make_hybrid, make_mirrored)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
