"""Global batches split over replicas: training steps Keras would get wrong are refused.

Keras computes a mean loss ("sum_over_batch_size", the reduction of every built-in
loss) on each replica as the mean over that replica's examples divided by the
number of replicas. Summed over the replicas, that is the mean over the global
batch only if every replica got as many examples as the others. A global batch
that does not split evenly (a final partial batch; a global batch smaller than
the number of replicas, which leaves some without examples) would take another
step than one device does on it, so a training step with a mean loss checks that
the split was even and fails with a clear error otherwise. Sum losses are exact
whatever the split, and `evaluate` weights each replica's mean by its number of
examples, so neither is checked. An empty dataset, and a dataset whose batches are
smaller than the number of replicas, are refused before they are used (an empty one
that tf.data cannot tell from its definition, at the first step: keras_input.py).
"""

import os

import tensorflow as tf

# TF-private: `compute_batch_size` reads a dataset's batch size from its graph, as
# tf.distribute does to split it; `record.could_possibly_record` tells a training
# step (a gradient tape is recording) from evaluation.
from tensorflow.python.data.experimental.ops import distribute as data_distribute
from tensorflow.python.eager import record

# Keras 3's mean reductions (keras.src.losses.loss.reduce_values).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
EMPTY = ("HybridStrategy: the dataset is empty (no batch to train, evaluate or predict "
         "on). Check the files or arrays it reads, and filters or `take`/`skip` that may "
         "drop every example.")


def replica_batch_sizes(args, kwargs, num_replicas):
    """Each replica's number of examples in a step's per-replica inputs, or None.

    Read from the first per-replica tensor of rank >= 1, on its own device.
    """
    if num_replicas < 2:
        return None
    for value in tf.nest.flatten((args, kwargs)):
        components = getattr(value, "values", None)
        if (isinstance(value, tf.distribute.DistributedValues) and components
                and all(isinstance(c, tf.Tensor) and c.shape.rank for c in components)):
            sizes = []
            for component in components:
                with tf.device(component.device):
                    sizes.append(tf.shape(component, out_type=tf.int64)[0])
            return sizes
    return None


def check_dataset(dataset, num_replicas):
    """Refuses an empty dataset, and global batches smaller than the replicas.

    Keras would stop on an empty dataset with a bare StopIteration; a global batch
    smaller than the replicas leaves some without examples in every step.
    """
    if int(dataset.cardinality()) == 0:
        raise ValueError(EMPTY)
    batch_size = int(data_distribute.compute_batch_size(dataset))  # -1: unknown
    if 0 < batch_size < num_replicas:
        raise ValueError(
            f"HybridStrategy: the dataset's batches hold {batch_size} example(s), fewer "
            f"than the {num_replicas} replicas, so some replicas would get no examples "
            "in every step. Batch the dataset with the global batch size (a multiple "
            f"of {num_replicas}): each replica gets an equal share of each batch.")


def _step_sizes():
    """The per-replica batch sizes of the HybridStrategy step being traced, or None."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    return getattr(tf.distribute.get_strategy().extended, "step_batch_sizes", None)


def checked_split(values):
    """`values` (per-example losses), after checking the step split its batch evenly."""
    sizes = _step_sizes()
    if sizes is None or not record.could_possibly_record():
        return values
    stacked = tf.stack(sizes)
    even = tf.reduce_all(tf.equal(stacked, sizes[0]))
    check = tf.debugging.Assert(even, [
        f"HybridStrategy: this training step split its global batch unevenly over "
        f"the {len(sizes)} replicas (examples per replica:", stacked, "). With a mean "
        "loss (reduction 'sum_over_batch_size', the default), Keras divides each "
        "replica's mean by the number of replicas, so the update would differ from "
        "one device's on the same batch. Use a global batch size that is a multiple "
        "of the number of replicas and batch with drop_remainder=True (or pass "
        "steps_per_epoch), or use a loss with reduction='sum'."])
    with tf.control_dependencies([check]):
        return tf.identity(values)


def legacy_keras():
    """The tf_keras module when `tf.keras` is tf_keras (TF_USE_LEGACY_KERAS), else None."""
    # The test by which TensorFlow's lazy loader routes `tf.keras` to tf_keras.
    if os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1"):
        import tf_keras
        return tf_keras
    return None


def install_keras_hooks():
    """Makes Keras 3's and tf_keras' mean loss reductions call `checked_split`."""
    # Keras-private: the function that reduces per-example losses (Keras 3).
    from keras.src.losses import loss as keras_loss

    if not getattr(keras_loss.reduce_values, "_checks_split", False):
        reduce_values = keras_loss.reduce_values

        def reduce_values_checking_split(values, sample_weight=None,
                                         reduction="sum_over_batch_size"):
            if reduction in _MEAN_REDUCTIONS:
                values = checked_split(values)
            return reduce_values(values, sample_weight, reduction)

        reduce_values_checking_split._checks_split = True
        keras_loss.reduce_values = reduce_values_checking_split
    if legacy_keras() is None:
        return
    # tf_keras-private: its counterpart.
    from tf_keras.src.utils import losses_utils

    if not getattr(losses_utils.reduce_weighted_loss, "_checks_split", False):
        reduce_weighted_loss = losses_utils.reduce_weighted_loss
        mean = losses_utils.ReductionV2.SUM_OVER_BATCH_SIZE

        def reduce_weighted_loss_checking_split(weighted_losses, reduction=mean):
            if reduction == mean:
                weighted_losses = checked_split(weighted_losses)
            return reduce_weighted_loss(weighted_losses, reduction)

        reduce_weighted_loss_checking_split._checks_split = True
        losses_utils.reduce_weighted_loss = reduce_weighted_loss_checking_split
