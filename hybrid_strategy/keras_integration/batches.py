"""Global batches split over replicas: any split trains as one device on the global batch.

A step's global batch reaches the replicas split by rows, evenly or not: an odd batch
size, a final partial batch, or a batch smaller than the number of replicas (some
replicas then get no rows). Keras makes each replica's loss its mean over its own rows
divided by the number of replicas N, which adds up to the global mean only when every
replica holds B/N of the B rows (tf.distribute.MirroredStrategy trains so). Under a
HybridStrategy, replica r's share is weighted by w_r = n_r / B instead, n_r being its
rows and B the global batch (both read from the shapes of the step's per-replica
inputs, however they were made):

- a mean over the replica's rows (a mean loss, an activity regularizer: Keras divides
  it by the batch size) times w_r adds up over the replicas to the global batch's mean;
- a term every replica computes alike (a weight penalty) adds up to itself (the w_r add
  up to 1);
- a mean whose divisor depends on the data (masked elements, whose count Keras divides
  by, or the sum of sample weights of reduction "mean_with_sample_weight") divides the
  replica's sum by the global divisor: its replicas' divisors summed by one scalar
  all-reduce;
- a sum loss adds up as it is.

So the summed gradient is one device's. The logged loss is too: Keras weights each
replica's loss by n_r in its loss tracker, after multiplying it by N (Keras 3) or as is
(tf_keras); it is divided by w_r instead, and a tf_keras sum loss is passed through as
a mean loss of that value. Metrics add up their state over the replicas (`PackedLogs`
in multi_step.py reads it). A replica with no rows has weight 0: Keras' mean reductions
divide with `divide_no_nan`, so it adds nothing.

A replica with no rows runs every op of the step on zero rows. Two kinds of layer cannot:
- BatchNormalization computing statistics per replica (`synchronized=False`): over zero
  rows they are NaN (Keras 3), which would spoil every weight through the gradient; it
  gets a clear error suggesting `synchronized=True`, whose statistics are the global
  batch's, exact whatever the split (tf_keras sets their update aside on an empty
  replica, as under MirroredStrategy; its synchronized layer then updates on every
  replica, for the moving statistics to come out as one device's);
- convolutions on CPU: TensorFlow 2.21's oneDNN kernels return their input unchanged for
  zero rows (a wrong shape that fails later, in another op); they get a clear error.

An empty dataset is refused before it is used (one that tf.data cannot tell empty from
its definition, at the first step: keras_input.py).
"""

import threading

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.keras_integration import registry

# Set while Keras 3 computes a compiled loss, in the thread tracing a replica.
_per_output_losses = threading.local()
_PER_REPLICA_STATISTICS = (
    "BatchNormalization layer {} computes its statistics per replica (synchronized="
    "False): over zero rows they are NaN, and would spoil every weight. Use "
    "BatchNormalization(synchronized=True): its statistics are those of the global "
    "batch, whatever the split (training then equals that on one device).")
EMPTY = ("HybridStrategy: the dataset is empty (no batch to train, evaluate or predict "
         "on). Check the files or arrays it reads, and filters or `take`/`skip` that may "
         "drop every example.")


def replica_batch_sizes(args, kwargs, num_replicas):
    """Each replica's number of rows in a step's per-replica inputs, or None.

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


def check_dataset(dataset):
    """Refuses an empty dataset: Keras would stop on it with a bare StopIteration."""
    if int(dataset.cardinality()) == 0:
        raise ValueError(EMPTY)


def _step_sizes():
    """The per-replica batch sizes of the HybridStrategy step being traced, or None."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    return getattr(tf.distribute.get_strategy().extended, "step_batch_sizes", None)


def replica_weight(dtype):
    """This replica's share n_r / B of the step's global batch, or None outside a step
    whose inputs were split over several replicas."""
    sizes = _step_sizes()
    if sizes is None:
        return None
    return tf.math.divide_no_nan(tf.cast(sizes[_replica()], dtype),
                                 tf.cast(tf.add_n(sizes), dtype))


def _replica():
    """The index of the replica being traced."""
    return tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)


def _global_sum(value):
    """`value` summed over the replicas of the step (a scalar divisor, no gradient).

    Each replica launches its part of the all-reduce itself: with `merge_call` the other
    replicas' threads would run in between, and Keras keeps the losses layers add
    (activity regularizers) in the layer objects, for one thread at a time.
    """
    return tf.distribute.get_strategy().extended.replica_sum(tf.stop_gradient(value))


def _scale(original):
    def scale_by_replica_weight(value):
        weight = replica_weight(value.dtype)
        return original(value) if weight is None else value * weight
    return scale_by_replica_weight


def _with_rows(tensor, problem):
    """`tensor`, checked to have rows when it runs (in a step split over replicas).

    `problem` says why it must (no apostrophes: TensorFlow escapes them in the message).
    """
    sizes = _step_sizes()
    if sizes is None:
        return tensor
    check = tf.debugging.Assert(tf.shape(tensor)[0] > 0, [
        f"HybridStrategy: a replica got no rows in this step (a global batch of fewer rows "
        f"than the {len(sizes)} replicas, often the last one), and {problem} Make every "
        f"global batch at least {len(sizes)} rows: batch with drop_remainder=True, or "
        "choose a batch size (and, for predict, a number of examples) whose last batch "
        "is that large."])
    # A control input of the consumer: TensorFlow still fuses it with its neighbours.
    with tf.control_dependencies([check]):
        return tf.identity(tensor)


def install_keras_hooks():
    """Makes Keras 3 and tf_keras (if `tf.keras` is it) weight replicas by their rows.

    Also refuses empty replicas where layers cannot take them. (Keras 3 builds the model
    from one replica's element spec, not from a first batch: keras_input.py.)
    """
    _install_keras3()
    _install_convolution_checks()
    legacy = versions.legacy_keras()
    if legacy is not None:
        _install_tf_keras()


def _install_convolution_checks():
    # TF-private: the raw convolution ops every Keras convolution layer (and tf.nn's
    # convolutions) ends in (tensorflow.python.ops.gen_nn_ops); TensorFlow has no public
    # hook on them.
    problem = ("the oneDNN convolutions of TensorFlow 2.21 on CPU return a wrong shape for "
               "zero rows.")

    def make_checked(convolution):
        def convolution_of_rows(input, *args, **kwargs):  # pylint: disable=redefined-builtin
            if _on_cpu_replica():
                input = _with_rows(input, problem)
            return convolution(input, *args, **kwargs)
        return convolution_of_rows

    for name in ("conv2d", "conv3d", "depthwise_conv2d_native"):
        registry.install(f"batches.{name}_rows", make_checked)


def _on_cpu_replica():
    if _step_sizes() is None:
        return False
    device = tf.distribute.get_strategy().extended.worker_devices[_replica()]
    return tf.DeviceSpec.from_string(device).device_type == "CPU"


def _install_keras3():
    # Keras-private: the functions that reduce and scale losses for a strategy (Keras 3
    # has no public way to change them).
    from keras.src.losses import loss as keras_loss

    registry.install("batches.scale_loss_by_replica_weight", _scale)

    def make_unscale(original):
        def unscale_by_replica_weight(value):
            weight = replica_weight(value.dtype)
            if weight is None or getattr(_per_output_losses, "active", False):
                return original(value)
            return tf.math.divide_no_nan(value, weight)
        return unscale_by_replica_weight

    registry.install("batches.unscale_loss_by_replica_weight", make_unscale)

    # Keras-private: the compiled loss, whose per-output loss trackers Keras weights by
    # a static batch size: that of a split batch is unknown (weight 1 for each replica's
    # value), or its split even; either way the replicas' losses times N add up exactly.
    def make_compiled_loss(call):
        def call_unscaling_by_replicas(self, *args, **kwargs):
            _per_output_losses.active = True
            try:
                return call(self, *args, **kwargs)
            finally:
                _per_output_losses.active = False
        return call_unscaling_by_replicas

    registry.install("batches.per_output_losses", make_compiled_loss)

    def make_reduce(original):
        def reduce_over_the_global_batch(values, sample_weight=None, mask=None,
                                         reduction="sum_over_batch_size", dtype=None):
            divides_by_data = (
                (reduction == "mean_with_sample_weight" and sample_weight is not None)
                or (reduction in ("sum_over_batch_size", "mean") and mask is not None))
            if not divides_by_data or _step_sizes() is None:
                return original(values, sample_weight, mask, reduction, dtype)
            total = original(values, sample_weight, mask, "sum", dtype)
            divisor = _keras3_divisor(keras_loss, values, sample_weight, mask, reduction,
                                      total.dtype)
            return tf.math.divide_no_nan(total, _global_sum(divisor))
        return reduce_over_the_global_batch

    registry.install("batches.reduce_over_global_batch", make_reduce)

    # Keras-private: the layer's statistics of a batch, computed only when training.
    def make_moments(moments):
        def moments_of_rows(self, inputs, mask):
            if not self.synchronized:
                inputs = _with_rows(inputs, _PER_REPLICA_STATISTICS.format(self.name))
            return moments(self, inputs, mask)
        return moments_of_rows

    registry.install("batches.batch_normalization_rows", make_moments)


def _keras3_divisor(keras_loss, values, sample_weight, mask, reduction, dtype):
    """What Keras 3's `reduce_weighted_values` divides this replica's sum by."""
    values = tf.convert_to_tensor(values, dtype)
    if reduction == "mean_with_sample_weight":
        weight = keras_loss.apply_mask(tf.cast(sample_weight, dtype),
                                       None if mask is None else tf.cast(mask, dtype),
                                       dtype=dtype, reduction=reduction)
        _, weight = keras_loss.squeeze_or_expand_to_same_rank(values, weight)
        return tf.reduce_sum(weight)
    # Keras weights each unmasked element by size(mask) / count(unmasked).
    mask = tf.cast(mask, dtype)
    return tf.math.divide_no_nan(tf.reduce_sum(mask) * tf.cast(tf.size(values), dtype),
                                 tf.cast(tf.size(mask), dtype))


def _install_tf_keras():
    # tf_keras-private: its counterparts, and the container that computes a compiled loss.
    from tf_keras.src.utils import losses_utils

    mean = losses_utils.ReductionV2.SUM_OVER_BATCH_SIZE
    registry.install("batches.tf_keras_scale_loss_by_replica_weight", _scale)

    def make_apply_valid_mask(original):
        def apply_global_valid_mask(losses, sw, mask, reduction):
            weight = replica_weight(losses.dtype) if mask is not None else None
            if weight is None or reduction not in (mean, losses_utils.ReductionV2.AUTO):
                return original(losses, sw, mask, reduction)
            # tf_keras weights unmasked elements by size / count(unmasked) on one
            # device; the replica's mean is then weighted by w_r.
            mask = tf.cast(mask, losses.dtype)
            valid = _global_sum(tf.reduce_sum(mask))
            size = tf.cast(tf.size(mask), losses.dtype)
            return losses_utils.apply_mask(
                losses, sw, mask * tf.math.divide_no_nan(size, valid * weight))
        return apply_global_valid_mask

    registry.install("batches.tf_keras_global_valid_mask", make_apply_valid_mask)

    def make_call(original):
        def call_with_sums_as_means(self, y_true, y_pred, *args, **kwargs):
            if _step_sizes() is None:
                return original(self, y_true, y_pred, *args, **kwargs)
            if not self._built:
                self.build(y_pred)
            # tf_keras multiplies a sum loss by N for its tracker and leaves it unscaled
            # for the gradient: as a mean loss of sum / w_r, both come out exact.
            losses = self._losses
            self._losses = [_SumAsMean(loss, mean) if getattr(loss, "reduction", None)
                            == losses_utils.ReductionV2.SUM else loss for loss in losses]
            try:
                return original(self, y_true, y_pred, *args, **kwargs)
            finally:
                self._losses = losses
        return call_with_sums_as_means

    registry.install("batches.tf_keras_sums_as_means", make_call)

    # tf_keras-private: whether its BatchNormalization sets aside the update of an
    # empty replica. A synchronized layer has the global batch's statistics on every
    # replica, so every replica's update is the same (their mean is one device's).
    def make_support(original):
        def support_zero_size_input(self):
            if self.synchronized and _step_sizes() is not None:
                return False
            return original(self)
        return support_zero_size_input

    registry.install("batches.tf_keras_synchronized_batch_normalization", make_support)


class _SumAsMean:
    """A tf_keras sum loss presented as a mean loss whose replica value is sum / w_r."""

    def __init__(self, loss, reduction):
        self._loss = loss
        self.reduction = reduction

    def __call__(self, y_true, y_pred, sample_weight=None):
        value = self._loss(y_true, y_pred, sample_weight=sample_weight)
        return tf.math.divide_no_nan(value, replica_weight(value.dtype))
