"""A dense convolutional image classifier: every weight mirrored and all-reduced.

On a cluster of 2 workers and 1 parameter server started on this machine (the launcher
sets TF_CONFIG for this program, which runs as the cluster's chief):

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python keras_examples/cnn.py

On one machine (HybridStrategy over the local devices):

    python keras_examples/cnn.py

The same model and data with TensorFlow's own strategies, for comparison:

    python keras_examples/cnn.py --strategy=mirrored   # tf.distribute.MirroredStrategy
    python keras_examples/cnn.py --strategy=none       # the default strategy

The model has no embedding, so under HybridStrategy's default architecture ("hybrid")
every variable is mirrored on the workers and every gradient is dense and all-reduced:
the case where the hybrid architecture should cost what plain all-reduce costs (as
Parallax found for ResNet-50). `--architecture=ps` puts every weight on the parameter
servers instead, for comparison.

The data is synthetic and generated with numpy: `--image_size` x `--image_size` RGB
images, each a random low-resolution (8 x 8) pattern enlarged to full size plus pixel
noise, labelled by a fixed random "teacher" network: one random 3 x 3 colour motif per
class, convolved over the low-resolution pattern, ReLU, averaged over positions; the
class whose motif responds most (scores standardised so the classes are about equally
frequent) is the label, and patterns where the best two classes are close are redrawn.
The task is learnable and guessing scores 1 / num_classes, so validation accuracy
tells whether training works. The program ends with one line such as

    final: val_accuracy=0.6797 val_loss=0.8535 steps/s=22.97 examples/s=5881

where steps/s is measured over the training steps of the last epoch (the first epoch
also traces the training function, so it is left out when there is more than one).

`build_model` and `make_dataset` can be imported, e.g. by benchmarks:

    from keras_examples import cnn
    with strategy.scope():
        model = cnn.build_model(image_size=32, num_classes=10)
    model.fit(cnn.make_dataset(12_800, 256, repeat=True), ...)
"""

import functools

from absl import app
from absl import flags
import numpy as np
import keras

try:
    from keras_examples import common
except ImportError:  # run as a script: keras_examples/ itself is on sys.path
    import common

FLAGS = flags.FLAGS

# Side of the low-resolution pattern behind every image, and what the teacher sees.
PATTERN_SIZE = 8
PIXEL_NOISE = 0.3
# Patterns whose best class wins by less than this quantile of the teacher's margins
# are redrawn, so no label hangs on a hair-breadth difference.
MARGIN_QUANTILE = 0.8
# The teacher depends on this seed only, so training and validation sets drawn with
# different seeds share it.
TRUE_MODEL_SEED = 1234


@functools.lru_cache(maxsize=4)
def _teacher(num_classes):
    """The labelling network: (motifs [27, C], biases [C], centre [C], scale [C],
    minimum margin).

    Class c's score is the average over the pattern's positions of
    relu(motif_c . 3x3 patch + bias_c), standardised by (score - centre_c) / scale_c;
    the centres make the classes about equally frequent among the patterns kept.
    """
    rng = np.random.default_rng([TRUE_MODEL_SEED, num_classes])
    motifs = rng.normal(0.0, 1.0 / np.sqrt(27.0), size=(27, num_classes))
    biases = rng.normal(0.0, 0.5, size=num_classes)
    reference = _motif_scores(_patterns(rng, 8192), motifs, biases)
    centre, scale = reference.mean(axis=0), reference.std(axis=0) + 1e-6
    for _ in range(300):
        scores = (reference - centre) / scale
        margins = _margins(scores)
        min_margin = np.quantile(margins, MARGIN_QUANTILE)
        kept = np.argmax(scores[margins >= min_margin], axis=1)
        counts = np.bincount(kept, minlength=num_classes)
        centre += 0.02 * scale * np.log((counts + 1.0) / (len(kept) / num_classes))
    return motifs, biases, centre, scale, min_margin


def _patterns(rng, count):
    return rng.normal(0.0, 1.0, size=(count, PATTERN_SIZE, PATTERN_SIZE, 3))


def _motif_scores(patterns, motifs, biases):
    """3 x 3 'same' convolution of [N, 8, 8, 3] patterns, ReLU, average over positions."""
    padded = np.pad(patterns, ((0, 0), (1, 1), (1, 1), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(1, 2))
    # windows: [N, 8, 8, 3 channels, 3, 3] -> patches [N, 8, 8, 27]
    patches = windows.transpose(0, 1, 2, 4, 5, 3).reshape(
        len(patterns), PATTERN_SIZE, PATTERN_SIZE, 27)
    return np.maximum(patches @ motifs + biases, 0.0).mean(axis=(1, 2))


def _margins(scores):
    """Best class score minus the second best."""
    top2 = np.sort(scores, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def make_arrays(num_examples, image_size=32, num_classes=10, seed=0):
    """Synthetic labelled images as numpy arrays: float32 [N, size, size, 3], int32 [N]."""
    if image_size % PATTERN_SIZE:
        raise ValueError(f"image_size={image_size} must be a multiple of {PATTERN_SIZE}.")
    rng = np.random.default_rng(seed)
    motifs, biases, centre, scale, min_margin = _teacher(num_classes)
    patterns, labels = [], []
    missing = num_examples
    while missing > 0:
        drawn = _patterns(rng, 8192)
        scores = (_motif_scores(drawn, motifs, biases) - centre) / scale
        keep = _margins(scores) >= min_margin
        patterns.append(drawn[keep][:missing].astype(np.float32))
        labels.append(np.argmax(scores[keep], axis=1)[:missing])
        missing -= len(labels[-1])
    patterns, labels = np.concatenate(patterns), np.concatenate(labels)
    factor = image_size // PATTERN_SIZE
    images = np.repeat(np.repeat(patterns, factor, axis=1), factor, axis=2)
    images += rng.normal(0.0, PIXEL_NOISE, size=images.shape).astype(np.float32)
    return images.astype(np.float32), labels.astype(np.int32)


def make_dataset(num_examples, batch_size, image_size=32, num_classes=10, seed=0,
                 repeat=False):
    """A batched, deterministic `tf.data.Dataset` of (images, labels).

    images: float32 [batch_size, image_size, image_size, 3]; labels: int32
    [batch_size] in [0, num_classes). `batch_size` is the global batch: a distribution
    strategy splits each batch across its replicas. Partial batches are dropped so
    every step has the same shape.
    """
    images, labels = make_arrays(num_examples, image_size, num_classes, seed)
    return common.batched_dataset((images, labels), batch_size, repeat)


def build_model(image_size=32, num_classes=10, filters=(16, 32, 64), dense_units=128,
                learning_rate=0.002):
    """Convolution blocks (3 x 3 conv + ReLU, 2 x 2 max pooling), global average
    pooling, a hidden Dense layer and class logits; compiled with Adam.

    Args:
        image_size: Height and width of the RGB input images.
        num_classes: Number of classes (the output logits).
        filters: Filters of each convolution block.
        dense_units: Width of the hidden Dense layer.
        learning_rate: Adam's learning rate.
    """
    inputs = keras.Input(shape=(image_size, image_size, 3), name="image")
    x = inputs
    for i, count in enumerate(filters):
        x = keras.layers.Conv2D(count, 3, padding="same", activation="relu",
                                name=f"conv_{i}")(x)
        x = keras.layers.MaxPooling2D(2, name=f"pool_{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="global_pool")(x)
    x = keras.layers.Dense(dense_units, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    model = keras.Model(inputs=inputs, outputs=outputs, name="cnn")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def define_flags():
    """This program's flags: the examples' common ones, with its defaults, and its own."""
    common.define_training_flags(batch_size=256, examples=256 * 50,
                                 validation_examples=2048)
    flags.adopt_module_key_flags(common)  # so that --help lists them
    flags.DEFINE_integer("image_size", 32,
                         "Height and width of the images (a multiple of 8).")
    flags.DEFINE_integer("num_classes", 10, "Classes.")
    flags.DEFINE_list("filters", ["16", "32", "64"],
                      "Filters of each convolution block (3 x 3 convolution, ReLU, 2 x 2 "
                      "max pooling).")
    flags.DEFINE_integer("dense_units", 128, "Width of the hidden Dense layer.")
    flags.DEFINE_float("learning_rate", 0.002, "Adam learning rate.")


def main(argv):
    del argv
    common.quiet_logs()
    if FLAGS.validation_examples < FLAGS.batch_size:
        raise app.UsageError("--validation_examples must be at least --batch_size "
                             "(partial batches are dropped).")
    if FLAGS.image_size < PATTERN_SIZE or FLAGS.image_size % PATTERN_SIZE:
        raise app.UsageError(f"--image_size must be a multiple of {PATTERN_SIZE}.")
    if FLAGS.num_classes < 2:
        raise app.UsageError("--num_classes must be at least 2.")
    # First: on a cluster, connecting to it invalidates variables created before.
    strategy = common.make_strategy(FLAGS.strategy, FLAGS.architecture)
    filters = tuple(int(f) for f in FLAGS.filters)

    train = common.per_worker_dataset(
        strategy, lambda n, batch, seed: make_dataset(n, batch, FLAGS.image_size,
                                                      FLAGS.num_classes, seed=seed,
                                                      repeat=True),
        FLAGS.batch_size, FLAGS.examples, FLAGS.seed)
    validation = make_dataset(FLAGS.validation_examples, FLAGS.batch_size, FLAGS.image_size,
                              FLAGS.num_classes, seed=FLAGS.seed + 1)
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights in every run
    with strategy.scope():
        model = build_model(FLAGS.image_size, FLAGS.num_classes, filters,
                            FLAGS.dense_units, FLAGS.learning_rate)
    common.print_strategy(strategy)

    last, steps_per_second = common.train(model, train, validation)
    common.print_final(last, ["val_accuracy", "val_loss"], steps_per_second,
                       FLAGS.batch_size)


if __name__ == "__main__":
    define_flags()
    app.run(main)
