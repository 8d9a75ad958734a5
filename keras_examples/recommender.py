"""A Criteo-style click-through model: embedding tables on parameter servers, MLP all-reduced.

On a cluster of 2 workers and 1 parameter server started on this machine (the launcher
sets TF_CONFIG for this program, which runs as the cluster's chief):

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python keras_examples/recommender.py

On one machine (HybridStrategy over the local devices, tables on the local CPU):

    python keras_examples/recommender.py

The same model and data with TensorFlow's own strategies, for comparison:

    python keras_examples/recommender.py --strategy=mirrored   # tf.distribute.MirroredStrategy
    python keras_examples/recommender.py --strategy=none       # the default strategy

The data is synthetic and generated with numpy: several categorical features whose ids
follow a Zipf-like distribution (a few ids are very frequent, most are rare, as in
Criteo's logs), a few dense float features, and a click label drawn from a fixed random
"true" model of the ids and dense features, so the task is learnable and validation AUC
tells whether training works. The program ends with one line such as

    final: val_auc=0.7129 val_loss=0.6069 val_accuracy=0.6665 steps/s=40.75 examples/s=20865

where steps/s is measured over the training steps of the last epoch (the first epoch
also traces the training function, so it is left out when there is more than one).
"""


from absl import app
from absl import flags
import numpy as np
import keras

try:
    from keras_examples import common
except ImportError:  # run as a script: keras_examples/ itself is on sys.path
    import common

FLAGS = flags.FLAGS

DEFAULT_TABLE_SIZES = (100_000, 20_000, 5_000, 1_000)
ZIPF_EXPONENT = 1.1
# The "true" model behind the labels depends on this seed only, so training and
# validation sets drawn with different seeds share it.
TRUE_MODEL_SEED = 1234


def _true_model(table_sizes, num_dense):
    """Per-id logit contributions for each table, dense weights and a bias."""
    rng = np.random.default_rng(TRUE_MODEL_SEED)
    id_effects = [rng.normal(0.0, 1.0, size=size).astype(np.float32)
                  for size in table_sizes]
    dense_weights = rng.normal(0.0, 0.5, size=num_dense).astype(np.float32)
    return id_effects, dense_weights, np.float32(-0.5)


def make_arrays(num_examples, table_sizes=DEFAULT_TABLE_SIZES, num_dense=8, seed=0):
    """Synthetic Criteo-like examples as numpy arrays: (features dict, labels)."""
    rng = np.random.default_rng(seed)
    id_effects, dense_weights, bias = _true_model(table_sizes, num_dense)
    features = {}
    logits = np.full(num_examples, bias, dtype=np.float32)
    for i, size in enumerate(table_sizes):
        ids = common.zipf_ids(rng, size, num_examples, ZIPF_EXPONENT)
        features[f"sparse_{i}"] = ids
        logits += id_effects[i][ids]
    dense = rng.normal(0.0, 1.0, size=(num_examples, num_dense)).astype(np.float32)
    features["dense"] = dense
    logits += dense @ dense_weights
    # One interaction, so the MLP has something beyond a linear model to learn.
    last_ids = features[f"sparse_{len(table_sizes) - 1}"]
    logits += 0.5 * dense[:, 0] * id_effects[-1][last_ids]
    labels = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logits)))
    return features, labels.astype(np.float32)


def make_dataset(num_examples, batch_size, table_sizes=DEFAULT_TABLE_SIZES, num_dense=8,
                 seed=0, repeat=False):
    """A batched, deterministic `tf.data.Dataset` of ({"sparse_i": ids, "dense": x}, label).

    `batch_size` is the global batch: a distribution strategy splits each batch across
    its replicas. Partial batches are dropped so every step has the same shape.
    """
    features, labels = make_arrays(num_examples, table_sizes, num_dense, seed)
    return common.batched_dataset((features, labels), batch_size, repeat)


def build_model(table_sizes=DEFAULT_TABLE_SIZES, embedding_dim=16, hidden_units=(256, 128),
                num_dense=8, l2=0.0, feature_names=None, name="recommender", dynamic=False):
    """One Embedding per categorical feature, concatenated with the dense features, an MLP.

    The categorical inputs are named `feature_names` (default sparse_0, sparse_1, ...),
    the dense ones "dense". With `l2` > 0, every table carries an l2
    `embeddings_regularizer` of that factor, as click-through model libraries give their
    tables by default; HybridStrategy computes each table's penalty on its PS. With
    `dynamic` (True, or a dict of `DynamicEmbedding` options such as
    `{"min_count": 2, "admission": "sketch"}`), each table is a
    `hybrid_strategy.layers.DynamicEmbedding` of as many rows, keyed by raw int64 ids
    (with no options, every id gets a row at its first sighting).
    """
    regularizer = keras.regularizers.L2(l2) if l2 else None
    feature_names = feature_names or [f"sparse_{i}" for i in range(len(table_sizes))]
    inputs = {feature: keras.Input(shape=(), dtype="int64" if dynamic else "int32",
                                   name=feature)
              for feature in feature_names}
    inputs["dense"] = keras.Input(shape=(num_dense,), dtype="float32", name="dense")
    embedded = [_table(size, embedding_dim, f"embedding_{i}", regularizer, dynamic)(
                    inputs[feature])
                for i, (feature, size) in enumerate(zip(feature_names, table_sizes))]
    x = keras.layers.Concatenate(name="concat")(embedded + [inputs["dense"]])
    for i, units in enumerate(hidden_units):
        x = keras.layers.Dense(units, activation="relu", name=f"hidden_{i}")(x)
    output = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    model = keras.Model(inputs=inputs, outputs=output, name=name)
    model.compile(optimizer=keras.optimizers.Adagrad(learning_rate=0.05),
                  loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc")])
    return model


def _table(rows, dim, name, regularizer, dynamic):
    if not dynamic:
        return keras.layers.Embedding(rows, dim, name=name, embeddings_regularizer=regularizer)
    from hybrid_strategy.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel
    if regularizer is not None:
        raise ValueError("build_model: dynamic tables take no l2 penalty here.")
    options = dynamic if isinstance(dynamic, dict) else {}
    return DynamicEmbedding(dim, capacity=rows, name=name, **options)


def define_flags():
    """This program's flags: the examples' common ones, with its defaults, and its own."""
    common.define_training_flags(batch_size=512, examples=512 * 50,
                                 validation_examples=8192)
    flags.adopt_module_key_flags(common)  # so that --help lists them
    flags.DEFINE_integer("embedding_dim", 16, "Width of every embedding table.")
    flags.DEFINE_list("table_sizes", ["100000", "20000", "5000", "1000"],
                      "Rows of each categorical feature's embedding table.")
    flags.DEFINE_integer("num_dense", 8, "Dense float features per example.")
    flags.DEFINE_list("hidden_units", ["256", "128"], "Widths of the MLP's hidden layers.")
    flags.DEFINE_float("l2", 0.0, "l2 factor of every table's embeddings_regularizer.")


def main(argv):
    del argv
    strategy = common.start()
    table_sizes = tuple(int(s) for s in FLAGS.table_sizes)
    hidden_units = tuple(int(u) for u in FLAGS.hidden_units)

    train = common.per_worker_dataset(
        strategy, lambda n, batch, seed: make_dataset(n, batch, table_sizes, FLAGS.num_dense,
                                                      seed=seed, repeat=True),
        FLAGS.batch_size, FLAGS.examples, FLAGS.seed)
    validation = make_dataset(FLAGS.validation_examples, FLAGS.batch_size, table_sizes,
                              FLAGS.num_dense, seed=FLAGS.seed + 1)
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights in every run
    with strategy.scope():
        model = build_model(table_sizes, FLAGS.embedding_dim, hidden_units, FLAGS.num_dense,
                            FLAGS.l2)
    common.print_strategy(strategy)

    last, steps_per_second = common.train(model, train, validation)
    common.print_final(last, ["val_auc", "val_loss", "val_accuracy"], steps_per_second,
                       FLAGS.batch_size)


if __name__ == "__main__":
    define_flags()
    app.run(main)
