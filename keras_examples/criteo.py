"""A click-through model fed from Criteo-like TFRecord files: 13 dense and 26 categorical
features per record, parsed with `tf.io.parse_example`, one embedding table per feature.

Write the files once (synthetic records, in shards), then train on a cluster of 2 workers
and 1 parameter server started on this machine; each worker reads only its own files:

    python keras_examples/criteo.py --write_files --data_dir=/tmp/criteo
    python -m hybrid_strategy.launch --workers 2 --ps 1 -- \\
        python keras_examples/criteo.py --data_dir=/tmp/criteo

Each record holds what a line of Criteo's click logs holds: `label` (0 or 1), `I1` ...
`I13` (counts, float) and `C1` ... `C26` (categorical ids, already hashed into each
feature's table: `--table_sizes`). The ids follow a Zipf-like law (a few ids very
frequent), the counts a log-normal one, and the label a fixed random logistic "true"
model of both, so validation AUC tells whether training works. The pipeline is the one
tf.data recommends for files: list the shards, interleave their readers, batch the
serialized records and parse each batch at once:

    list_files -> interleave(TFRecordDataset) -> batch -> map(parse_example) -> prefetch

Under HybridStrategy with at least as many shards as workers, each worker reads and
parses only its own shards (auto-sharding by file); with fewer, every worker reads all
of them and parses only its share of each batch (a notice says so).

With `--dynamic`, every table is a `hybrid_strategy.layers.DynamicEmbedding` of
`--table_sizes` rows keyed by the raw int64 ids of the files, no vocabulary given: an
id gets a row at its `--min_count`-th sighting, counted exactly or, with
`--admission=sketch`, in a count-min sketch of a fixed size (docs/dynamic_vocabularies.md),
and rows of ids not seen lately go when they run out. The files are the same:

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- \\
        python keras_examples/criteo.py --data_dir=/tmp/criteo --dynamic \\
        --min_count=2 --admission=sketch

The program ends with a line such as

    final: val_auc=0.7420 val_loss=0.5105 steps/s=30.12 examples/s=15421
"""

import glob
import os

from absl import app
from absl import flags
import numpy as np
import keras
import tensorflow as tf

try:
    from keras_examples import common
    from keras_examples import recommender
except ImportError:  # run as a script: keras_examples/ itself is on sys.path
    import common
    import recommender

FLAGS = flags.FLAGS

NUM_DENSE, NUM_CATEGORICAL = 13, 26
DENSE = [f"I{i + 1}" for i in range(NUM_DENSE)]
CATEGORICAL = [f"C{i + 1}" for i in range(NUM_CATEGORICAL)]
# A few large tables and many small ones, as Criteo's 26 features have.
DEFAULT_TABLE_SIZES = (100_000,) * 2 + (20_000,) * 4 + (5_000,) * 8 + (500,) * 12
ZIPF_EXPONENT = 1.1
TRUE_MODEL_SEED = 1234   # the labels' model, the same for every shard


def _true_model(table_sizes):
    rng = np.random.default_rng(TRUE_MODEL_SEED)
    id_effects = [rng.normal(0.0, 0.6, size=size).astype(np.float32) for size in table_sizes]
    dense_weights = rng.normal(0.0, 0.3, size=NUM_DENSE).astype(np.float32)
    return id_effects, dense_weights


def make_records(num_records, table_sizes=DEFAULT_TABLE_SIZES, seed=0):
    """Synthetic records as columns: {"label", "I1".., "C1"..: numpy array per feature}."""
    rng = np.random.default_rng(seed)
    id_effects, dense_weights = _true_model(table_sizes)
    columns = {}
    logits = np.full(num_records, -1.0, dtype=np.float32)
    for name, size, effects in zip(CATEGORICAL, table_sizes, id_effects):
        ids = common.zipf_ids(rng, size, num_records, ZIPF_EXPONENT)
        columns[name] = ids.astype(np.int64)
        logits += effects[ids]
    counts = np.floor(rng.lognormal(1.0, 1.2, size=(num_records, NUM_DENSE)))
    logits += np.log1p(counts).astype(np.float32) @ dense_weights - 0.5
    for i, name in enumerate(DENSE):
        columns[name] = counts[:, i].astype(np.float32)
    columns["label"] = (rng.random(num_records) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    return columns


def write_files(data_dir, files, records_per_file, table_sizes=DEFAULT_TABLE_SIZES,
                seed=0):
    """Writes `files` TFRecord shards of `records_per_file` records; returns their paths."""
    os.makedirs(data_dir, exist_ok=True)
    paths = []
    for shard in range(files):
        columns = make_records(records_per_file, table_sizes, seed=[seed, shard])
        path = os.path.join(data_dir, f"part-{shard:05d}-of-{files:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in range(records_per_file):
                feature = {name: _feature(values[row]) for name, values in columns.items()}
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())
        paths.append(path)
    return paths


def _feature(value):
    if isinstance(value, np.floating):
        return tf.train.Feature(float_list=tf.train.FloatList(value=[value]))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


FEATURES = dict(
    {"label": tf.io.FixedLenFeature([], tf.int64)},
    **{name: tf.io.FixedLenFeature([], tf.float32, default_value=0.0) for name in DENSE},
    **{name: tf.io.FixedLenFeature([], tf.int64, default_value=0) for name in CATEGORICAL})


def parse_batch(records, id_dtype=tf.int32):
    """A batch of serialized records -> (model inputs, labels), ids as `id_dtype`."""
    parsed = tf.io.parse_example(records, FEATURES)
    inputs = {name: tf.cast(parsed[name], id_dtype) for name in CATEGORICAL}
    inputs["dense"] = tf.math.log1p(tf.stack([parsed[name] for name in DENSE], axis=1))
    return inputs, tf.cast(parsed["label"], tf.float32)


def make_dataset(pattern, batch_size, repeat=False, readers=4, id_dtype=tf.int32):
    """Batches of `batch_size` records parsed from the files matching `pattern`.

    `batch_size` is the global batch: a distribution strategy splits each batch over its
    replicas. Partial batches are dropped so every step has the same shape. Ids come as
    `id_dtype` (tf.int64: raw ids, for dynamic tables).
    """
    files = tf.data.Dataset.list_files(pattern, shuffle=False)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=readers,
                               num_parallel_calls=tf.data.AUTOTUNE)
    if repeat:
        records = records.repeat()
    return (records.batch(batch_size, drop_remainder=True)
            .map(lambda batch: parse_batch(batch, id_dtype),
                 num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE))


def build_model(table_sizes=DEFAULT_TABLE_SIZES, embedding_dim=16, hidden_units=(256, 128),
                dynamic=False):
    """recommender.py's model over the 26 categorical and 13 dense features (`dynamic`:
    as recommender.build_model's)."""
    return recommender.build_model(table_sizes, embedding_dim, hidden_units, NUM_DENSE,
                                   feature_names=CATEGORICAL, name="criteo", dynamic=dynamic)


def define_flags():
    """This program's flags: the examples' common ones, with its defaults, and its own."""
    common.define_training_flags(batch_size=512, examples=512 * 64,
                                 validation_examples=8192)
    flags.adopt_module_key_flags(common)  # so that --help lists them
    flags.DEFINE_string("data_dir", "/tmp/criteo_tfrecords", "Where the shards are: "
                        "train/ and validation/.")
    flags.DEFINE_bool("write_files", False, "Write the shards (--examples training and "
                      "--validation_examples validation records) into --data_dir and exit.")
    flags.DEFINE_integer("files", 16, "Shards --write_files writes, of training and of "
                         "validation records each.", lower_bound=1)
    flags.DEFINE_list("table_sizes", [str(s) for s in DEFAULT_TABLE_SIZES],
                      f"Rows of each of the {NUM_CATEGORICAL} categorical features' tables.")
    flags.DEFINE_integer("embedding_dim", 16, "Width of every embedding table.")
    flags.DEFINE_list("hidden_units", ["256", "128"], "Widths of the MLP's hidden layers.")
    flags.DEFINE_bool("dynamic", False, "DynamicEmbedding tables of --table_sizes rows, "
                      "keyed by the raw ids, instead of Embedding tables.")
    flags.DEFINE_integer("min_count", 1, "--dynamic: sightings before an id gets a row.",
                         lower_bound=1)
    flags.DEFINE_enum("admission", "exact", ["exact", "sketch"], "--dynamic: how ids "
                      "waiting for --min_count are counted (sketch: a count-min sketch of "
                      "a fixed size).")


def main(argv):
    del argv
    common.quiet_logs()
    table_sizes = tuple(int(s) for s in FLAGS.table_sizes)
    if len(table_sizes) != NUM_CATEGORICAL:
        raise app.UsageError(f"--table_sizes needs {NUM_CATEGORICAL} sizes.")
    train_dir = os.path.join(FLAGS.data_dir, "train")
    validation_dir = os.path.join(FLAGS.data_dir, "validation")
    if FLAGS.write_files:
        write_files(train_dir, FLAGS.files, -(-FLAGS.examples // FLAGS.files), table_sizes,
                    seed=FLAGS.seed)
        write_files(validation_dir, FLAGS.files, -(-FLAGS.validation_examples // FLAGS.files),
                    table_sizes, seed=FLAGS.seed + 1)
        print(f"wrote {FLAGS.files} training and {FLAGS.files} validation shards to "
              f"{FLAGS.data_dir}")
        return
    if not glob.glob(os.path.join(train_dir, "*.tfrecord")):
        raise app.UsageError(f"No shards in {train_dir}: write them first with "
                             "--write_files.")
    # First: on a cluster, connecting to it invalidates variables created before.
    strategy = common.make_strategy(FLAGS.strategy, FLAGS.architecture)
    id_dtype = tf.int64 if FLAGS.dynamic else tf.int32
    train = make_dataset(os.path.join(train_dir, "*.tfrecord"), FLAGS.batch_size,
                         repeat=True, id_dtype=id_dtype)
    validation = make_dataset(os.path.join(validation_dir, "*.tfrecord"), FLAGS.batch_size,
                              id_dtype=id_dtype)
    dynamic = FLAGS.dynamic and {"min_count": FLAGS.min_count, "admission": FLAGS.admission}
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights in every run
    with strategy.scope():
        model = build_model(table_sizes, FLAGS.embedding_dim,
                            tuple(int(u) for u in FLAGS.hidden_units), dynamic)
    common.print_strategy(strategy)

    last, steps_per_second = common.train(model, train, validation)
    common.print_final(last, ["val_auc", "val_loss"], steps_per_second, FLAGS.batch_size)


if __name__ == "__main__":
    define_flags()
    app.run(main)
