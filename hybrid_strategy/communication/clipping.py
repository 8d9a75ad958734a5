"""Gradient clipping of the global batch's gradient, after the replicas' gradients are summed.

On one device, `clipnorm`, `global_clipnorm` and `clipvalue` clip the gradient of
the whole batch. Keras 3 optimizers under a `tf.distribute` strategy clip each
replica's share of it instead, before the cross-replica sum, which is another
update (two replicas whose gradients are each just under `clipnorm` sum to twice
it). Under HybridStrategy, Keras 3 optimizers clip the summed gradient instead, as
one device would (`clips`, `clip_summed`, called from
keras_integration/clipping_hooks.py); tf_keras optimizers already sum, then clip.

The summed gradient of a PS table stays where it was summed, one part per shard
on its PS: norms are added up from each shard's own sum of squares, and each
shard's rows are scaled or clipped on its PS, so clipping moves no table rows.
"""

import tensorflow as tf

from hybrid_strategy.sharding import rows as sharding


def clip(grads, clipnorm=None, global_clipnorm=None, clipvalue=None):
    """Clips summed gradients as Keras does on one device (the first option set wins).

    Args:
        grads: Gradients (tensors, `tf.IndexedSlices` with distinct rows, PS
            table sums from `sharding.shard_summed`, or None).
        clipnorm: Each gradient is scaled to an L2 norm of at most this.
        global_clipnorm: All gradients are scaled together to a joint L2 norm of
            at most this.
        clipvalue: Each entry is clipped to [-clipvalue, clipvalue].
    """
    if clipnorm and clipnorm > 0:
        return [None if g is None else _scaled(g, _norm_factor(_squared_norm(g), clipnorm))
                for g in grads]
    if global_clipnorm and global_clipnorm > 0:
        present = [g for g in grads if g is not None]
        if not present:
            return list(grads)
        norm = tf.sqrt(tf.add_n([_squared_norm(g) for g in present]))
        # Keras' formula: NaN for an infinite or NaN norm, 1 for a zero one.
        scale = (global_clipnorm * tf.minimum(1.0 / norm, 1.0 / global_clipnorm)
                 + (norm - norm))
        return [None if g is None else _scaled(g, scale) for g in grads]
    if clipvalue and clipvalue > 0:
        return [None if g is None else
                _map_values(g, lambda v: tf.clip_by_value(v, -clipvalue, clipvalue))
                for g in grads]
    return list(grads)


def _norm_factor(squared_norm, clipnorm):
    return clipnorm / tf.maximum(tf.sqrt(squared_norm), clipnorm)


def _parts(gradient):
    """(part, device) pairs: a PS table's per-shard sums, else the gradient itself."""
    sums = sharding.shard_sums_of(gradient)
    if sums is None:
        return [(gradient, None)]
    shards = sharding.table_of_sum(gradient).shards
    return [(part, shard.device) for part, shard in zip(sums, shards)]


def _values(part):
    return part.values if isinstance(part, tf.IndexedSlices) else part


def _squared_norm(gradient):
    squares = []
    for part, device in _parts(gradient):
        with tf.device(device):
            squares.append(tf.reduce_sum(tf.square(_values(part))))
    return tf.add_n(squares) if len(squares) > 1 else squares[0]


def _scaled(gradient, factor):
    return _map_values(gradient, lambda v: v * tf.cast(factor, v.dtype))


def _map_values(gradient, fn):
    """`gradient` with `fn` applied to its values, each part on its own device."""
    parts = []
    for part, device in _parts(gradient):
        with tf.device(device):
            if isinstance(part, tf.IndexedSlices):
                parts.append(tf.IndexedSlices(fn(part.values), part.indices, part.dense_shape))
            else:
                parts.append(fn(part))
    if sharding.shard_sums_of(gradient) is None:
        return parts[0]
    return sharding.shard_summed(parts, sharding.table_of_sum(gradient))


def clips(optimizer):
    """Whether a Keras optimizer clips its gradients (any of its three options set)."""
    return bool(optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue)


def clip_summed(optimizer, grads_and_vars):
    """The cross-replica sums `grads_and_vars`, clipped as `optimizer` clips on one device."""
    grads = clip([g for g, _ in grads_and_vars], clipnorm=optimizer.clipnorm,
                 global_clipnorm=optimizer.global_clipnorm, clipvalue=optimizer.clipvalue)
    return [(g, v) for g, (_, v) in zip(grads, grads_and_vars)]
