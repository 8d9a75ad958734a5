"""An LM1B-style LSTM language model: word embeddings and softmax weights on parameter servers.

On a cluster of 2 workers and 1 parameter server started on this machine (the launcher
sets TF_CONFIG for this program, which runs as the cluster's chief):

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python keras_examples/language_model.py

On one machine (HybridStrategy over the local devices, tables on the local CPU):

    python keras_examples/language_model.py

The same model and data with TensorFlow's own strategies, for comparison:

    python keras_examples/language_model.py --strategy=mirrored   # tf.distribute.MirroredStrategy
    python keras_examples/language_model.py --strategy=none       # the default strategy

The model is the shape of the LM1B models Parallax trained, scaled down: an input word
embedding (`--vocab` x `--embedding_dim`), one LSTM layer (`--lstm_units`), a Dense
projection back to `--embedding_dim`, and a softmax over the vocabulary whose weights are
a second `--vocab` x `--embedding_dim` matrix plus one bias per word. Training uses a
sampled softmax: each replica draws `--num_sampled` distinct candidate words per step
from a log-uniform (Zipfian) distribution, scores the true next words and the candidates
only, and subtracts the log expected count of each (`tf.random.log_uniform_candidate_sampler`;
accidental hits of a true word among the candidates are removed). Evaluation computes
the full softmax, so the validation perplexity is exp(cross-entropy over the whole
vocabulary).

Both big matrices stay on the parameter servers under HybridStrategy (architecture
"hybrid") and are read by row:

- `embedding/embeddings` is a `keras.layers.Embedding`;
- `softmax/embeddings` and `softmax/bias` belong to `SampledSoftmax`, a subclass of
  `keras.layers.Embedding`, so the strategy places them like any embedding. A training
  step gathers only the rows of the step's true next words and sampled candidates
  (`keras.ops.take`, which is `tf.gather`, which reads a PS table by row); its gradient
  is a `tf.IndexedSlices` over those rows. `tf.nn.sampled_softmax_loss` is not used: it
  converts its weights to one dense tensor, which would move the whole matrix to every
  worker each step.

Evaluation's full softmax reads the whole softmax matrix, on every worker, once per
validation step.

The text is synthetic, generated with numpy: sentences of `--seq_len` + 1 word ids in
[0, `--vocab`), where id k is the k-th most frequent word of a Zipf law (P(k)
proportional to 1 / (k + 1)). Each sentence is about one of 64 topics, and each of its
words is, with probability 1/2, one of the topic's 100 own words (also drawn by a Zipf
law), otherwise any word; a model learns word frequencies, and to infer the topic from
the words so far. The target of each word is the next one. `--batch_size`, `--examples`
and `--validation_examples` count such sequences. With the default vocabulary,
knowing only the word frequencies gives a validation perplexity of about 3,300, and the
best possible model (inferring the topic from the words so far) about 700; a uniform
guess gives 100,000. The
softmax biases start at log P(k) of the sampler's log-uniform distribution (perplexity
about 3,600 before training), a unigram prior, as the ids are sorted by frequency, so
that words training has not reached yet do not flood the full softmax. The program ends
with one line such as

    final: val_perplexity=1220 val_loss=7.107 steps/s=7.32 tokens/s=18747

where steps/s is measured over the training steps of the last epoch (the first epoch
also traces the training function, so it is left out when there is more than one) and
tokens/s is examples/s times `--seq_len`.

`build_model` and `make_dataset` can be imported, e.g. by benchmarks:

    from keras_examples import language_model
    with strategy.scope():
        model = language_model.build_model(vocab=100_000, embedding_dim=128)
    model.fit(language_model.make_dataset(12_800, 128, vocab=100_000, repeat=True), ...)
"""

import math

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
import keras

try:
    from keras_examples import common
except ImportError:  # run as a script: keras_examples/ itself is on sys.path
    import common

FLAGS = flags.FLAGS

ZIPF_EXPONENT = 1.0
# Every sequence is about one of NUM_TOPICS topics; each of its words is, with
# probability TOPIC_PROBABILITY, one of the topic's TOPIC_WORDS own words (ids
# topic + NUM_TOPICS * r for r < TOPIC_WORDS, drawn by a Zipf law over r), else any
# word of the vocabulary.
NUM_TOPICS = 64
TOPIC_WORDS = 100
TOPIC_PROBABILITY = 0.5


# Data ---------------------------------------------------------------------------------

def make_arrays(num_sequences, vocab=100_000, seq_len=20, seed=0):
    """(tokens, next_tokens): int32 arrays [num_sequences, seq_len] of word ids in [0, vocab).

    Each sequence is seq_len + 1 words about one topic, drawn uniformly; tokens are its
    first seq_len words and next_tokens its last seq_len. A word is, with probability
    TOPIC_PROBABILITY, the topic's: topic + NUM_TOPICS * r with r drawn by a Zipf law;
    otherwise it is drawn by a Zipf law over the whole vocabulary (id k has probability
    proportional to 1 / (k + 1), so id 0 is the most frequent word).
    """
    rng = np.random.default_rng(seed)
    length = seq_len + 1
    count = num_sequences * length
    num_topics = min(NUM_TOPICS, vocab)
    words = common.zipf_ranks(rng, vocab, count, ZIPF_EXPONENT)
    topics = np.repeat(rng.integers(0, num_topics, num_sequences, dtype=np.int32), length)
    topic_words = topics + num_topics * common.zipf_ranks(
        rng, min(TOPIC_WORDS, vocab // num_topics), count, ZIPF_EXPONENT)
    words = np.where(rng.random(count) < TOPIC_PROBABILITY, topic_words, words)
    sequences = words.reshape(num_sequences, length)
    return sequences[:, :-1], sequences[:, 1:]


def make_dataset(num_sequences, batch_size, vocab=100_000, seq_len=20, seed=0,
                 repeat=False):
    """A batched, deterministic `tf.data.Dataset` of (tokens, next_tokens).

    Both are int32 [batch_size, seq_len]. `num_sequences` sequences of `seq_len`
    consecutive tokens come from `make_arrays`.
    `batch_size` is the global batch in sequences: a distribution strategy splits each
    batch across its replicas. Partial batches are dropped so every step has the same
    shape.
    """
    inputs, targets = make_arrays(num_sequences, vocab, seq_len, seed)
    return common.batched_dataset((inputs, targets), batch_size, repeat)


# Model --------------------------------------------------------------------------------

def log_uniform_probabilities(vocab):
    """P(k) of `tf.random.log_uniform_candidate_sampler` over range_max=vocab."""
    k = np.arange(vocab, dtype=np.float64)
    return (np.log(k + 2.0) - np.log(k + 1.0)) / math.log(vocab + 1.0)


class LogUniformPrior(keras.initializers.Initializer):
    """Initializes a [vocab] bias to log P(k) of the log-uniform (Zipfian) distribution."""

    def __call__(self, shape, dtype=None):
        (vocab,) = shape
        return tf.constant(np.log(log_uniform_probabilities(vocab)),
                           dtype=dtype or "float32")


class SampledSoftmax(keras.layers.Embedding):
    """Softmax weights over a vocabulary: a [vocab, dim] matrix and a [vocab] bias.

    It subclasses `keras.layers.Embedding` (whose `embeddings` are the output word
    vectors) so that HybridStrategy keeps both weights on the parameter servers, and
    reads them only by row in training:

    - `sampled_logits(hidden, labels)`: logits of each true label (column 0) and of
      `num_sampled` candidates drawn for the batch, corrected by their log expected
      counts; only the labels' and candidates' rows are gathered.
    - `logits(hidden)`: the full [N, vocab] logits (reads the whole matrix).

    Calling the layer on word ids returns their output vectors, like `Embedding`.
    """

    def __init__(self, vocab, dim, num_sampled=1024, remove_accidental_hits=True,
                 **kwargs):
        kwargs.setdefault("embeddings_initializer",
                          keras.initializers.RandomNormal(stddev=dim ** -0.5))
        super().__init__(vocab, dim, **kwargs)
        if not 0 < num_sampled <= vocab:
            raise ValueError(f"num_sampled={num_sampled} must be in [1, vocab={vocab}].")
        self.num_sampled = num_sampled
        self.remove_accidental_hits = remove_accidental_hits

    def build(self, input_shape=None):
        super().build(input_shape)
        self.bias = self.add_weight(shape=(self.input_dim,), initializer=LogUniformPrior(),
                                    name="bias")

    def sampled_logits(self, hidden, labels):
        """Sampled-softmax logits [N, 1 + num_sampled]; the true class is column 0.

        Args:
            hidden: float [N, dim], the model's output vectors.
            labels: int [N], the true next words.
        """
        labels = tf.cast(labels, tf.int64)
        sampled, true_expected, sampled_expected = tf.random.log_uniform_candidate_sampler(
            true_classes=labels[:, None], num_true=1, num_sampled=self.num_sampled,
            unique=True, range_max=self.input_dim)
        # One gather per weight for the true and the sampled words: row reads only.
        ids = tf.concat([labels, sampled], 0)
        rows = keras.ops.take(self.embeddings, ids, axis=0)
        biases = keras.ops.take(self.bias, ids, axis=0)
        n = tf.shape(labels)[0]
        true_logits = (tf.reduce_sum(hidden * rows[:n], axis=-1) + biases[:n]
                       - tf.math.log(true_expected[:, 0]))
        sampled_logits = (tf.matmul(hidden, rows[n:], transpose_b=True) + biases[n:]
                          - tf.math.log(sampled_expected))
        if self.remove_accidental_hits:
            hits = tf.equal(labels[:, None], sampled[None, :])
            sampled_logits = tf.where(hits, tf.constant(-1e9, sampled_logits.dtype),
                                      sampled_logits)
        return tf.concat([true_logits[:, None], sampled_logits], axis=1)

    def logits(self, hidden):
        """Full-softmax logits [N, vocab] of output vectors `hidden` [N, dim]."""
        return tf.matmul(hidden, keras.ops.convert_to_tensor(self.embeddings),
                         transpose_b=True) + keras.ops.convert_to_tensor(self.bias)

    def get_config(self):
        config = super().get_config()
        config.update(vocab=config.pop("input_dim"), dim=config.pop("output_dim"),
                      num_sampled=self.num_sampled,
                      remove_accidental_hits=self.remove_accidental_hits)
        return config


class LanguageModel(keras.Model):
    """Embedding -> LSTM -> Dense projection; sampled softmax to train, full to evaluate.

    `model(tokens)` returns the output vectors [batch, seq_len, embedding_dim];
    `model.logits(tokens)` the full-softmax logits [batch, seq_len, vocab]. `fit` takes
    (tokens, next_tokens); its loss is the sampled-softmax cross-entropy, and
    `evaluate`'s loss the full-softmax one (its exp is the perplexity).
    """

    def __init__(self, vocab=100_000, embedding_dim=128, lstm_units=256, num_sampled=1024,
                 **kwargs):
        super().__init__(**kwargs)
        self.vocab = vocab
        self.embedding_dim = embedding_dim
        self.lstm_units = lstm_units
        self.num_sampled = num_sampled
        self.embedding = keras.layers.Embedding(vocab, embedding_dim, name="embedding")
        self.lstm = keras.layers.LSTM(lstm_units, return_sequences=True, name="lstm")
        self.projection = keras.layers.Dense(embedding_dim, name="projection")
        self.softmax = SampledSoftmax(vocab, embedding_dim, num_sampled, name="softmax")
        self.cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(self, input_shape):
        # Built from shapes, inside the strategy's scope, without running the model.
        self.embedding.build(input_shape)
        self.lstm.build(tuple(input_shape) + (self.embedding_dim,))
        self.projection.build(tuple(input_shape) + (self.lstm_units,))
        self.softmax.build()

    def call(self, tokens, training=False):
        return self.projection(self.lstm(self.embedding(tokens), training=training))

    def logits(self, tokens):
        hidden = self(tokens)
        flat = self.softmax.logits(tf.reshape(hidden, [-1, self.embedding_dim]))
        return tf.reshape(flat, tf.concat([tf.shape(tokens), [self.vocab]], 0))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        hidden = tf.reshape(y_pred, [-1, self.embedding_dim])
        targets = tf.reshape(y, [-1])
        if training:
            logits = self.softmax.sampled_logits(hidden, targets)
            labels = tf.zeros_like(targets)  # the true word is column 0
        else:
            logits, labels = self.softmax.logits(hidden), targets
        # A Keras loss divides by the number of replicas, as fit's gradients need.
        return self.cross_entropy(labels, logits)

    def get_config(self):
        return {"vocab": self.vocab, "embedding_dim": self.embedding_dim,
                "lstm_units": self.lstm_units, "num_sampled": self.num_sampled,
                "name": self.name}


def build_model(vocab=100_000, embedding_dim=128, lstm_units=256, num_sampled=1024,
                learning_rate=0.003, seq_len=None):
    """A built and compiled `LanguageModel` (call it inside the strategy's scope).

    Args:
        vocab: Words in the vocabulary (rows of the embedding and softmax matrices).
        embedding_dim: Width of the input embedding, the projection and the softmax.
        lstm_units: Units of the LSTM.
        num_sampled: Candidates of the sampled softmax per replica and step.
        learning_rate: Adam's learning rate. Adam rather than LM1B's Adagrad: in the
            few hundred steps of a demonstration, the rows of a large table get
            gradients too small for Adagrad or SGD to move them much, while Adam
            scales each row's step to its own gradients. Adam runs without momentum
            (beta_1=0): a row that a step does not touch then does not move, so
            HybridStrategy's row-sparse ("lazy") update of the PS tables and Keras's
            dense update on one machine agree (but for the decay of the second
            moments of untouched rows).
        seq_len: Sequence length to build for (None: any).
    """
    model = LanguageModel(vocab, embedding_dim, lstm_units, num_sampled,
                          name="language_model")
    model.build((None, seq_len))
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate, beta_1=0.0))
    return model


# Training -----------------------------------------------------------------------------

class Perplexity(keras.callbacks.Callback):
    """Adds val_perplexity = exp(val_loss) to each epoch's logs (and progress bar)."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and "val_loss" in logs:
            logs["val_perplexity"] = math.exp(min(logs["val_loss"], 700.0))


def define_flags():
    """This program's flags: the examples' common ones, with its defaults, and its own."""
    common.define_training_flags(batch_size=128, examples=128 * 150,
                                 validation_examples=256)
    flags.adopt_module_key_flags(common)  # so that --help lists them
    flags.DEFINE_integer("validation_batch_size", 32,
                         "Global batch size of evaluation, in sequences: the full softmax "
                         "makes a [batch x seq_len, vocab] logits tensor.")
    flags.DEFINE_integer("vocab", 100_000, "Words in the vocabulary.")
    flags.DEFINE_integer("embedding_dim", 128, "Width of the word embeddings and of the "
                         "softmax weights.")
    flags.DEFINE_integer("lstm_units", 256, "Units of the LSTM layer.")
    flags.DEFINE_integer("seq_len", 20, "Tokens per sequence.")
    flags.DEFINE_integer("num_sampled", 1024, "Candidate words of the sampled softmax, per "
                         "replica and step.")
    flags.DEFINE_float("learning_rate", 0.003, "Adam learning rate.")


def main(argv):
    del argv
    common.quiet_logs()
    if FLAGS.validation_examples < FLAGS.validation_batch_size:
        raise app.UsageError("--validation_examples must be at least "
                             "--validation_batch_size (partial batches are dropped).")
    if not 0 < FLAGS.num_sampled <= FLAGS.vocab:
        raise app.UsageError("--num_sampled must be in [1, --vocab].")
    # First: on a cluster, connecting to it invalidates variables created before.
    strategy = common.make_strategy(FLAGS.strategy, FLAGS.architecture)

    train = common.per_worker_dataset(
        strategy, lambda n, batch, seed: make_dataset(n, batch, FLAGS.vocab, FLAGS.seq_len,
                                                      seed=seed, repeat=True),
        FLAGS.batch_size, FLAGS.examples, FLAGS.seed)
    validation = make_dataset(FLAGS.validation_examples, FLAGS.validation_batch_size,
                              FLAGS.vocab, FLAGS.seq_len, seed=FLAGS.seed + 1)
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights in every run
    with strategy.scope():
        model = build_model(FLAGS.vocab, FLAGS.embedding_dim, FLAGS.lstm_units,
                            FLAGS.num_sampled, FLAGS.learning_rate, FLAGS.seq_len)
    common.print_strategy(strategy)

    last, steps_per_second = common.train(model, train, validation, [Perplexity()])
    common.print_final(last, ["val_perplexity", "val_loss"], steps_per_second,
                       FLAGS.batch_size * FLAGS.seq_len, unit="tokens")


if __name__ == "__main__":
    define_flags()
    app.run(main)
