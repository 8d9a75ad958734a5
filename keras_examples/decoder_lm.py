"""A GPT-style decoder language model whose token table is also its output projection.

On a cluster of 2 workers and 1 parameter server started on this machine (the launcher
sets TF_CONFIG for this program, which runs as the cluster's chief):

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python keras_examples/decoder_lm.py

On one machine (HybridStrategy over the local devices):

    python keras_examples/decoder_lm.py

The model is a small decoder as model libraries build them: token embeddings plus
learned position embeddings, one block of causal self-attention and a feed-forward
layer (each with a residual connection and layer normalization), and logits computed
against the token table itself (`h @ transpose(token table)`, the tied output
projection), scored with a full softmax over the vocabulary.

The token table is read by lookup and whole, so its gradient is dense. HybridStrategy
places it on a PS as any `Embedding`, and moves it to mirrored after `fit`'s first
step (its gradient is then all-reduced with the other dense weights): the program
prints the placement after training, where the table's reason is "dense gradient
(moved after the first step)". The position table stays on the PS (read by row).

The text is `language_model.make_arrays`' synthetic Zipfian sentences. The program ends
with one line such as

    final: val_perplexity=1890 val_loss=7.544 steps/s=5.1 tokens/s=6528

`build_model` and `make_dataset` can be imported, e.g. by benchmarks.
"""

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
import keras

try:
    from keras_examples import common
    from keras_examples import language_model
except ImportError:  # run as a script: keras_examples/ itself is on sys.path
    import common
    import language_model

FLAGS = flags.FLAGS


def make_dataset(num_sequences, batch_size, vocab=16_384, seq_len=20, seed=0, repeat=False):
    """A batched, deterministic `tf.data.Dataset` of (tokens, next_tokens), int32
    [batch_size, seq_len] each; `batch_size` is the global batch in sequences."""
    inputs, targets = language_model.make_arrays(num_sequences, vocab, seq_len, seed)
    return common.batched_dataset((inputs, targets), batch_size, repeat)


class AddPositions(keras.layers.Layer):
    """Adds a learned vector per position: an `Embedding` of the positions 0..length-1."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length, self.dim = length, dim
        self.positions = keras.layers.Embedding(length, dim, name="position_embedding")

    def call(self, x):
        return x + self.positions(tf.range(self.length))

    def get_config(self):
        return {**super().get_config(), "length": self.length, "dim": self.dim}


class TiedLogits(keras.layers.Layer):
    """Logits of every word: the output vectors times the transposed token table."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, hidden):
        table = keras.ops.convert_to_tensor(self.embedding.embeddings)
        return tf.matmul(hidden, table, transpose_b=True)


def build_model(vocab=16_384, embedding_dim=128, seq_len=20, num_heads=4,
                learning_rate=1e-3):
    """A compiled decoder (call it inside the strategy's scope).

    Args:
        vocab: Words in the vocabulary: rows of the token table.
        embedding_dim: Width of the token table and of the decoder block.
        seq_len: Tokens per sequence (positions are learned for as many).
        num_heads: Attention heads (each `embedding_dim // num_heads` wide).
        learning_rate: Adam's learning rate.
    """
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    embedding = keras.layers.Embedding(vocab, embedding_dim, name="token_embedding")
    x = AddPositions(seq_len, embedding_dim, name="add_positions")(embedding(tokens))
    attended = keras.layers.MultiHeadAttention(
        num_heads, embedding_dim // num_heads, name="attention")(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="attention_norm")(x + attended)
    hidden = keras.layers.Dense(4 * embedding_dim, activation="gelu", name="ffn_in")(x)
    x = keras.layers.LayerNormalization(name="ffn_norm")(
        x + keras.layers.Dense(embedding_dim, name="ffn_out")(hidden))
    logits = TiedLogits(embedding, name="logits")(x)
    model = keras.Model(tokens, logits, name="decoder_lm")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def define_flags():
    """This program's flags: the examples' common ones, with its defaults, and its own."""
    common.define_training_flags(batch_size=64, examples=64 * 150, validation_examples=1024)
    flags.adopt_module_key_flags(common)  # so that --help lists them
    flags.DEFINE_integer("vocab", 16_384, "Words in the vocabulary.")
    flags.DEFINE_integer("embedding_dim", 128, "Width of the token table and the decoder.")
    flags.DEFINE_integer("seq_len", 20, "Tokens per sequence.")
    flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.")


def main(argv):
    del argv
    strategy = common.start()
    train = make_dataset(FLAGS.examples, FLAGS.batch_size, FLAGS.vocab, FLAGS.seq_len,
                         seed=FLAGS.seed, repeat=True)
    validation = make_dataset(FLAGS.validation_examples, FLAGS.batch_size, FLAGS.vocab,
                              FLAGS.seq_len, seed=FLAGS.seed + 1)
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights in every run
    with strategy.scope():
        model = build_model(FLAGS.vocab, FLAGS.embedding_dim, FLAGS.seq_len,
                            learning_rate=FLAGS.learning_rate)
    last, steps_per_second = common.train(model, train, validation)
    common.print_strategy(strategy)  # after training: the tied table has moved
    last["val_perplexity"] = float(np.exp(last["val_loss"]))
    common.print_final(last, ["val_perplexity", "val_loss"], steps_per_second,
                       FLAGS.batch_size * FLAGS.seq_len, unit="tokens")


if __name__ == "__main__":
    define_flags()
    app.run(main)
