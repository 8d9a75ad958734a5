"""A fastText-style bag-of-words classifier: one large embedding table on parameter servers.

On a cluster of 2 workers and 1 parameter server started on this machine (the launcher
sets TF_CONFIG for this program, which runs as the cluster's chief):

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python keras_examples/text_classifier.py

On one machine (HybridStrategy over the local devices, the table on the local CPU):

    python keras_examples/text_classifier.py

The same model and data with TensorFlow's own strategies, for comparison:

    python keras_examples/text_classifier.py --strategy=mirrored   # tf.distribute.MirroredStrategy
    python keras_examples/text_classifier.py --strategy=none       # the default strategy

The model averages the embeddings (`--vocab_size` x `--embedding_dim`) of a document's
`--doc_len` token ids, then has one hidden ReLU layer (`--dense_units`) and one sigmoid
unit, trained with plain SGD on the binary cross-entropy. The design document measures
HybridStrategy's per-step overhead with this model: a step computes little beside
reading and updating, on the parameter servers, the table rows of the batch's tokens,
and all-reducing the small dense layers.

The data is synthetic and generated with numpy: documents of `--doc_len` token ids whose
frequencies follow a Zipf law (P(rank k) proportional to 1 / (k + 1) ** 1.1: a few
tokens are very frequent, most are rare), and a label drawn from a fixed random "true"
sentiment score of every token: a document is positive with probability sigmoid(8 x the
mean score of its tokens). The task is learnable (the true scores reach a validation
AUC of about 0.85), and validation AUC tells whether training works. The program ends
with one line such as

    final: val_auc=0.6777 val_loss=0.6646 val_accuracy=0.6062 steps/s=59.73 examples/s=15290

where steps/s is measured over the training steps of the last epoch (the first epoch
also traces the training function, so it is left out when there is more than one).

`build_model` and `make_dataset` can be imported, e.g. by benchmarks:

    from keras_examples import text_classifier
    with strategy.scope():
        model = text_classifier.build_model(vocab_size=200_000, embedding_dim=64)
    model.fit(text_classifier.make_dataset(25_600, 256, repeat=True), ...)
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

ZIPF_EXPONENT = 1.1
# A document's label logit is SENTIMENT_SCALE times the mean true score of its tokens.
SENTIMENT_SCALE = 8.0
# The true scores depend on this seed only, so training and validation sets drawn with
# different seeds share them.
TRUE_MODEL_SEED = 1234


def _true_scores(vocab_size):
    """The "true" sentiment score of every token, drawn from N(0, 1)."""
    rng = np.random.default_rng(TRUE_MODEL_SEED)
    return rng.normal(0.0, 1.0, size=vocab_size).astype(np.float32)


def make_arrays(num_examples, vocab_size=200_000, doc_len=16, seed=0):
    """Synthetic documents as numpy arrays: ids int32 [N, doc_len], labels float32 [N]."""
    rng = np.random.default_rng(seed)
    ids = common.zipf_ids(rng, vocab_size, num_examples * doc_len, ZIPF_EXPONENT)
    ids = ids.reshape(num_examples, doc_len)
    logits = SENTIMENT_SCALE * _true_scores(vocab_size)[ids].mean(axis=1)
    labels = rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logits))
    return ids, labels.astype(np.float32)


def make_dataset(num_examples, batch_size, vocab_size=200_000, doc_len=16, seed=0,
                 repeat=False):
    """A batched, deterministic `tf.data.Dataset` of (token ids, label).

    ids: int32 [batch_size, doc_len]; label: float32 [batch_size], 1 for positive.
    `batch_size` is the global batch: a distribution strategy splits each batch across
    its replicas. Partial batches are dropped so every step has the same shape.
    """
    ids, labels = make_arrays(num_examples, vocab_size, doc_len, seed)
    return common.batched_dataset((ids, labels), batch_size, repeat)


def build_model(vocab_size=200_000, embedding_dim=64, dense_units=256, learning_rate=2.0):
    """Mean of the tokens' embeddings, a hidden Dense layer, a sigmoid unit; SGD.

    Args:
        vocab_size: Tokens in the vocabulary (rows of the embedding table).
        embedding_dim: Width of the embedding table.
        dense_units: Width of the hidden Dense layer.
        learning_rate: SGD's learning rate. Large, as the mean over a document divides
            each token's gradient by the document's length.
    """
    tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, embedding_dim, name="embedding")(tokens)
    x = keras.layers.GlobalAveragePooling1D(name="mean")(x)
    x = keras.layers.Dense(dense_units, activation="relu", name="hidden")(x)
    output = keras.layers.Dense(1, activation="sigmoid", name="positive")(x)
    model = keras.Model(inputs=tokens, outputs=output, name="text_classifier")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=learning_rate),
                  loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc")])
    return model


def define_flags():
    """This program's flags: the examples' common ones, with its defaults, and its own."""
    common.define_training_flags(batch_size=256, examples=256 * 150,
                                 validation_examples=4096)
    flags.adopt_module_key_flags(common)  # so that --help lists them
    flags.DEFINE_integer("vocab_size", 200_000, "Tokens in the vocabulary: rows of the "
                         "embedding table.")
    flags.DEFINE_integer("embedding_dim", 64, "Width of the embedding table.")
    flags.DEFINE_integer("doc_len", 16, "Tokens per document.")
    flags.DEFINE_integer("dense_units", 256, "Width of the hidden Dense layer.")
    flags.DEFINE_float("learning_rate", 2.0, "SGD learning rate.")


def main(argv):
    del argv
    strategy = common.start()

    train = make_dataset(FLAGS.examples, FLAGS.batch_size, FLAGS.vocab_size, FLAGS.doc_len,
                         seed=FLAGS.seed, repeat=True)
    validation = make_dataset(FLAGS.validation_examples, FLAGS.batch_size, FLAGS.vocab_size,
                              FLAGS.doc_len, seed=FLAGS.seed + 1)
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights in every run
    with strategy.scope():
        model = build_model(FLAGS.vocab_size, FLAGS.embedding_dim, FLAGS.dense_units,
                            FLAGS.learning_rate)
    common.print_strategy(strategy)

    last, steps_per_second = common.train(model, train, validation)
    common.print_final(last, ["val_auc", "val_loss", "val_accuracy"], steps_per_second,
                       FLAGS.batch_size)


if __name__ == "__main__":
    define_flags()
    app.run(main)
