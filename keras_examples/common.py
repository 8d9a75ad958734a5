"""What the examples share: their common flags, the strategy, datasets, training and its
final line, step timing and Zipf-like ids.

```python
from keras_examples import common

def define_flags():   # called under `if __name__ == "__main__":`, before app.run(main)
    common.define_training_flags(batch_size=512, examples=512 * 50,
                                 validation_examples=8192)
    flags.adopt_module_key_flags(common)              # so that --help lists them
    ...                                               # the example's own flags

strategy = common.start()   # in main: --strategy, --architecture, flags checked
train = common.batched_dataset((x, y), FLAGS.batch_size, repeat=True)   # numpy arrays in
last, steps_per_second = common.train(model, train, validation)   # fit, with --epochs ...
common.print_final(last, ["val_auc", "val_loss"], steps_per_second, FLAGS.batch_size)
ids = common.zipf_ids(np.random.default_rng(0), size=1000, count=64, exponent=1.1)
```
"""

import functools
import time

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

import hybrid_strategy

FLAGS = flags.FLAGS

# Fixes which ids `zipf_ids` makes frequent, the same for every data seed.
PERMUTATION_SEED = 1234


def define_training_flags(*, batch_size, examples, validation_examples):
    """Defines the flags every example has, with the running example's defaults.

    Only a program's main module defines flags, before `app.run`: importing an example
    defines none, so several can be imported into one process (as the benchmarks do)
    although their flags share names.
    """
    flags.DEFINE_enum("strategy", "hybrid", ["hybrid", "mirrored", "none"],
                      "hybrid: HybridStrategy (the cluster in TF_CONFIG, else this "
                      "machine); mirrored: tf.distribute.MirroredStrategy on this machine; "
                      "none: TensorFlow's default strategy.")
    flags.DEFINE_enum("architecture", "hybrid", ["hybrid", "allreduce", "ps"],
                      "HybridStrategy only: hybrid (embedding tables on PS, the rest "
                      "mirrored), allreduce (everything mirrored) or ps (everything on "
                      "PS).")
    flags.DEFINE_integer("epochs", 3, "Training epochs.", lower_bound=1)
    flags.DEFINE_integer("steps_per_epoch", 50, "Training steps per epoch.", lower_bound=1)
    flags.DEFINE_integer("batch_size", batch_size, "Global batch size in examples, split "
                         "across replicas.", lower_bound=1)
    flags.DEFINE_integer("examples", examples, "Training examples generated (the data "
                         "repeats if training needs more).", lower_bound=1)
    flags.DEFINE_integer("validation_examples", validation_examples,
                         "Held-out examples generated.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the training data (validation uses seed + 1).")
    flags.DEFINE_integer("verbose", 1, "Keras verbosity: 0 silent, 1 progress bar, 2 one "
                         "line per epoch.")


def quiet_logs():
    """Shows TensorFlow's and absl's warnings and errors only (call it in main)."""
    # Their INFO messages (one per cross-device reduction, and the session config logged
    # when connecting to a cluster) would bury the progress bar. absl sets its level when
    # parsing flags, hence in main.
    tf.get_logger().setLevel("WARNING")
    logging.set_verbosity(logging.WARNING)


def start():
    """An example's main begins here: quiet logs, its batch flags checked, its strategy.

    The strategy is made before anything else: on a cluster, connecting to it
    invalidates variables made before.
    """
    quiet_logs()
    if FLAGS.validation_examples < FLAGS.batch_size:
        raise app.UsageError("--validation_examples must be at least --batch_size "
                             "(partial batches are dropped).")
    return make_strategy(FLAGS.strategy, FLAGS.architecture)


def make_strategy(name, architecture):
    """"hybrid": HybridStrategy; "mirrored": tf.distribute.MirroredStrategy; else none."""
    if name == "hybrid":
        return hybrid_strategy.HybridStrategy(architecture=architecture)
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def print_strategy(strategy):
    """Prints the strategy's class and replicas, and HybridStrategy's variable placement."""
    print(f"strategy: {type(strategy).__name__}, "
          f"{strategy.num_replicas_in_sync} replica(s)")
    if isinstance(strategy, hybrid_strategy.HybridStrategy):
        print(strategy.placement)


def batched_dataset(arrays, batch_size, repeat=False):
    """`arrays` (numpy, any nesting) as a deterministic dataset of `batch_size` batches.

    Partial batches are dropped, so every step has the same shape; with `repeat` the
    examples repeat without end.
    """
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.batch(batch_size, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = True
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def train(model, train_data, validation_data, callbacks=()):
    """Fits for --epochs x --steps_per_epoch; returns the last epoch's logs and steps/s."""
    rate = StepRate()
    history = model.fit(train_data, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
                        validation_data=validation_data, shuffle=False,
                        callbacks=[rate, *callbacks], verbose=FLAGS.verbose)
    return {name: values[-1] for name, values in history.history.items()}, rate.rates[-1]


def print_final(logs, names, steps_per_second, units_per_step, unit="examples"):
    """Prints the line every example ends with: the named logs, then its throughput."""
    fields = [f"{name}={logs[name]:.4g}" for name in names]
    fields += [f"steps/s={steps_per_second:.2f}",
               f"{unit}/s={steps_per_second * units_per_step:.0f}"]
    print("final: " + " ".join(fields), flush=True)


class StepRate(keras.callbacks.Callback):
    """Training steps per second of each epoch, validation excluded."""

    def __init__(self):
        super().__init__()
        self.rates = []
        self._start = self._end = None
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        # Keras hands this (not async-safe) callback the step's logs as Python numbers,
        # so the step has finished when the clock is read.
        self._end = time.perf_counter()
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        # Runs after validation; the clock stopped at the last training step.
        if self._steps:
            self.rates.append(self._steps / (self._end - self._start))


@functools.lru_cache(maxsize=8)
def _zipf_cdf(size, exponent):
    ranks = np.arange(1, size + 1, dtype=np.float64)
    probabilities = ranks ** -exponent
    return np.cumsum(probabilities / probabilities.sum())


def zipf_ranks(rng, size, count, exponent):
    """`count` ranks in [0, size) drawn from a Zipf law truncated to `size`.

    Rank k has probability proportional to 1 / (k + 1) ** exponent: rank 0 is the most
    frequent.
    """
    drawn = np.searchsorted(_zipf_cdf(size, exponent), rng.random(count))
    return np.minimum(drawn, size - 1).astype(np.int32)


def zipf_ids(rng, size, count, exponent):
    """`zipf_ranks` mapped to ids through a fixed permutation of [0, size).

    The frequent ids are spread over the table rather than at its start (and so over
    the shards of a table split by rows).
    """
    permutation = np.random.default_rng([PERMUTATION_SEED, size]).permutation(size)
    return permutation[zipf_ranks(rng, size, count, exponent)].astype(np.int32)
