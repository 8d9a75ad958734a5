"""Models written the ways users write them, trained under HybridStrategy.

Each model keeps its tables somewhere else: inside a layer that wraps two
`Embedding`s, in a subclassed `keras.Model`, as a custom layer's own weight read
by row, three layers deep. For each model and optimizer, the report gives where
every weight landed (`strategy.placement`, by the paths of `model.weights`) and
how far the weights trained with `model.fit` under HybridStrategy (and, on one
machine, under `tf.distribute.MirroredStrategy` on the same replicas) are from
single-device training with dense gradients on the same global batches.
Works with Keras 3 and, under TF_USE_LEGACY_KERAS=1, with tf_keras. Prints the
report as JSON:

    python tests/user_models.py --local-replicas 2
    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/user_models.py
"""

import argparse
import json
import sys
import warnings

import numpy as np
import tensorflow as tf

import scenario

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
KERAS3 = hasattr(keras, "ops")

VOCAB, SEQ, DIM = 300, 5, 6
GLOBAL_BATCH, STEPS = 16, 6
MIN_SHARD_BYTES = 1024
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.2),
    "adagrad": lambda: keras.optimizers.Adagrad(0.2),
}
# Row reads a custom layer may use on its own weight.
ROW_READS = ("gather", "take", "embedding_lookup") if KERAS3 else ("gather", "embedding_lookup")


class TokenAndPosition(keras.layers.Layer):
    """Adds a learned position vector to each token's vector: one layer, two tables."""

    def __init__(self, vocab, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.token_emb = keras.layers.Embedding(vocab, dim, name="token_emb")
        self.position_emb = keras.layers.Embedding(length, dim, name="position_emb")

    def call(self, ids):
        return self.token_emb(ids) + self.position_emb(tf.range(self.length))


def text_classifier():
    """A transformer-style scorer: token + position vectors, self-attention, pooling."""
    ids = keras.Input(shape=(SEQ,), dtype="int32")
    x = TokenAndPosition(VOCAB, SEQ, DIM, name="token_and_position")(ids)
    attended = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x + attended)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="score")(x))


class Recommender(keras.Model):
    """Scores a (user, item, category) triple; every table made in `__init__`."""

    def __init__(self):
        super().__init__(name="recommender")
        self.user_emb = keras.layers.Embedding(VOCAB, DIM, name="user_emb")
        self.item_emb = keras.layers.Embedding(2 * VOCAB, DIM, name="item_emb")
        self.category_emb = keras.layers.Embedding(20, DIM, name="category_emb")
        self.tower = keras.layers.Dense(8, activation="tanh", name="tower")
        self.score = keras.layers.Dense(1, name="score")

    def call(self, ids):
        user, item = self.user_emb(ids[:, 0]), self.item_emb(ids[:, 1])
        category = self.category_emb(ids[:, 2] % 20)
        return self.score(self.tower(tf.concat([user * item, category], axis=-1)))


class HashedBag(keras.layers.Layer):
    """Mean of rows of its own `table` weight, read with `read` (no Embedding layer)."""

    def __init__(self, rows, dim, read, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.dim, self.read = rows, dim, read

    def build(self, input_shape):
        self.table = self.add_weight(
            shape=(self.rows, self.dim), name="table",
            initializer=keras.initializers.RandomNormal(stddev=0.3))
        self.scale = self.add_weight(shape=(self.dim,), name="scale", initializer="ones")
        super().build(input_shape)

    def call(self, ids):
        ids = tf.cast(ids, "int32")  # Keras builds subclassed models on float inputs
        if self.read == "gather":
            rows = tf.gather(self.table, ids)
        elif self.read == "take":
            rows = keras.ops.take(self.table, ids, axis=0)
        else:
            rows = tf.nn.embedding_lookup(self.table, ids)
        return tf.reduce_mean(rows, axis=1) * self.scale


def custom_weights():
    """One `HashedBag` per row read, side by side."""
    ids = keras.Input(shape=(SEQ,), dtype="int32")
    bags = [HashedBag(VOCAB, DIM, read, name=f"bag_{read}")(ids) for read in ROW_READS]
    x = keras.layers.Concatenate()(bags)
    return keras.Model(ids, keras.layers.Dense(1, name="score")(x))


class Bags(keras.Model):
    """`HashedBag`s in a subclassed model that builds its layers itself."""

    def __init__(self):
        super().__init__(name="bags")
        self.bags = [HashedBag(VOCAB, DIM, read, name=f"bag_{read}") for read in ROW_READS]
        self.score = keras.layers.Dense(1, name="score")

    def build(self, input_shape):
        for bag in self.bags:
            bag.build(input_shape)
        self.score.build((None, DIM * len(self.bags)))
        super().build(input_shape)

    def call(self, ids):
        return self.score(tf.concat([bag(ids) for bag in self.bags], axis=-1))


class FieldEncoder(keras.layers.Layer):
    """Embeds one id field and projects it; builds its sublayers in `build`."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(vocab, DIM, name="embedding")
        self.project = keras.layers.Dense(4, name="project")

    def build(self, input_shape):
        self.embedding.build(input_shape)
        self.project.build(tuple(input_shape) + (DIM,))
        super().build(input_shape)

    def call(self, ids):
        return self.project(self.embedding(ids))


class FeatureBlock(keras.layers.Layer):
    """Two field encoders, one per half of the ids."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = FieldEncoder(VOCAB, name="query")
        self.context = FieldEncoder(VOCAB // 2, name="context")

    def call(self, ids):
        return tf.concat([self.query(ids[:, :2]), self.context(ids[:, 2:] % (VOCAB // 2))],
                         axis=1)


class Nested(keras.Model):
    """A model holding a layer holding layers holding `Embedding`s."""

    def __init__(self):
        super().__init__(name="nested")
        self.features = FeatureBlock(name="features")
        self.score = keras.layers.Dense(1, name="score")

    def call(self, ids):
        return self.score(tf.reduce_mean(self.features(ids), axis=1))


MODELS = {
    "text_classifier": text_classifier,
    "recommender": Recommender,
    "custom_weights": custom_weights,
    "bags": Bags,
    "nested": Nested,
}


def make_data(num_examples=GLOBAL_BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    # Skewed ids: batches repeat rows within and across replicas.
    ids = np.minimum(rng.zipf(1.3, size=(num_examples, SEQ)) - 1, VOCAB - 1).astype("int32")
    y = np.cos(ids.sum(axis=1, keepdims=True) / 40.0).astype("float32")
    return ids, y


def built(name, ids):
    """The model with its weights: functional ones have them at once, subclassed
    ones after their own `build`, or else a call (Keras 3 then builds sublayers
    on symbolic inputs and creates their weights later, outside `add_weight`)."""
    model = MODELS[name]()
    if "build" in type(model).__dict__:
        model.build((None, SEQ))
    elif not model.built:
        model(ids[:2])
    return model


def reference_weights(name, weights, optimizer, ids, y):
    """Single-device training with dense gradients (the exact arithmetic)."""
    model = built(name, ids)
    model.set_weights(weights)
    opt = OPTIMIZERS[optimizer]()
    for start in range(0, len(ids), GLOBAL_BATCH):
        x, t = ids[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients([(tf.convert_to_tensor(g), v)
                             for g, v in zip(grads, model.trainable_variables)])
    return model.get_weights()


def fit_weights(strategy, name, weights, optimizer, ids, y):
    """`model.fit` under `strategy`: (model, PlacementWarning messages).

    The optimizer is built before training, as restoring a checkpoint does: a
    weight moved to the PS at its first row read takes its slots along.
    """
    with strategy.scope():
        model = built(name, ids)
        model.set_weights(weights)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
        model.optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    return model, [str(w.message) for w in caught
                   if type(w.message).__name__ == "PlacementWarning"]


def custom_loop_weights(strategy, name, weights, optimizer, ids, y):
    """A custom training loop (`strategy.run` in a `tf.function`): the weights."""
    with strategy.scope():
        model = built(name, ids)
        model.set_weights(weights)
        opt = OPTIMIZERS[optimizer]()
        opt.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH))

    def replica_step(x, t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - t)) / GLOBAL_BATCH
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    step = tf.function(lambda x, t: strategy.run(replica_step, (x, t)))
    for x, t in dataset:
        step(x, t)
    return model.get_weights()


def errors_by_path(model, actual, expected):
    return dict(zip([scenario.weight_path(w) for w in model.weights],
                    scenario.relative_errors(actual, expected)))


def model_case(make_hybrid, make_mirrored, name, optimizer):
    strategy = make_hybrid()
    ids, y = make_data()
    keras.utils.set_random_seed(1)
    weights = built(name, ids).get_weights()
    reference = reference_weights(name, weights, optimizer, ids, y)
    model, warned = fit_weights(strategy, name, weights, optimizer, ids, y)
    trained = model.get_weights()
    out = {
        "weights": [scenario.weight_path(w) for w in model.weights],
        "placement": {r.path: [s.task for s in r.placement.shards] or "mirrored"
                      for r in strategy.placement},
        "reasons": {r.path: r.reason for r in strategy.placement},
        "devices": scenario.variable_devices(model),
        "gradient_types": strategy.gradient_types,
        "warnings": warned,
        "vs_single_device": errors_by_path(model, trained, reference),
        "slots_on_ps": sorted(scenario.weight_path(v) for v in model.optimizer.variables
                              if hasattr(scenario.raw_variable(v), "shards")),
    }
    if name == "bags":
        out["custom_loop_vs_single_device"] = errors_by_path(
            model, custom_loop_weights(make_hybrid(), name, weights, optimizer, ids, y),
            reference)
    if make_mirrored is not None:
        mirrored, _ = fit_weights(make_mirrored(), name, weights, optimizer, ids, y)
        out["mirrored_vs_single_device"] = errors_by_path(
            model, mirrored.get_weights(), reference)
        out["vs_mirrored"] = errors_by_path(model, trained, mirrored.get_weights())
    return out


def two_strategies_case(make_hybrid, make_mirrored):
    """A HybridStrategy and a MirroredStrategy in one process, trained in turns."""
    hybrid, mirrored = make_hybrid(), make_mirrored()
    ids, y = make_data()
    keras.utils.set_random_seed(2)
    weights = built("recommender", ids).get_weights()
    reference = reference_weights("recommender", weights, "sgd", ids, y)
    out = {}
    for turn, strategy in (("hybrid", hybrid), ("mirrored", mirrored),
                           ("hybrid_again", hybrid), ("mirrored_again", mirrored)):
        model, _ = fit_weights(strategy, "recommender", weights, "sgd", ids, y)
        out[turn] = max(scenario.relative_errors(model.get_weights(), reference))
    return out


def report(make_hybrid, make_mirrored=None):
    out = {f"{name}/{optimizer}": model_case(make_hybrid, make_mirrored, name, optimizer)
           for name in MODELS for optimizer in OPTIMIZERS}
    if make_mirrored is not None:
        out["two_strategies"] = two_strategies_case(make_hybrid, make_mirrored)
    return out


def main(argv):
    import hybrid_strategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-replicas", type=int, default=0,
                        help="run on this machine alone with this many CPU replicas, "
                             "and compare with MirroredStrategy on them")
    args = parser.parse_args(argv)
    devices = scenario.local_cpu_replicas(args.local_replicas)

    def make_hybrid():
        return hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES,
                                              devices=devices)

    # One for the whole run: TensorFlow's MirroredStrategy instances all start
    # their collective keys at the same number, so two of them collide.
    mirrored = tf.distribute.MirroredStrategy(devices) if devices else None

    def make_mirrored():
        return mirrored

    json.dump(report(make_hybrid, make_mirrored if devices else None), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
