"""What a dynamic table's id -> row map (dynamic.py) and its admission sketch (sketch.py) share.

A 64-bit mix of int64 keys, bookkeeping variables placed on one device, and a
`tf.cond` of a branch taken rarely that a traced step does not pay for when not taken.
"""

import tensorflow as tf

# TF-private: the value of the attribute that keeps an If op a function call (`rarely`).
from tensorflow.core.framework import attr_value_pb2
# TF-private: a variable created directly as a ResourceVariable bypasses the
# distribution strategy's variable creator; a map's bookkeeping lives on one
# device and is written once per step, not mirrored.
from hybrid_strategy.tensorflow_private import resource_variable_ops


def mix(keys, salt=0):
    """splitmix64's finaliser of int64 `keys` ^ `salt`, as uint64: a hash whose every bit
    depends on every bit of the key."""
    shift, xor = tf.bitwise.right_shift, tf.bitwise.bitwise_xor
    x = xor(tf.bitcast(keys, tf.uint64), tf.constant(salt, tf.uint64))
    x = xor(x, shift(x, tf.constant(30, tf.uint64))) * tf.constant(0xBF58476D1CE4E5B9, tf.uint64)
    x = xor(x, shift(x, tf.constant(27, tf.uint64))) * tf.constant(0x94D049BB133111EB, tf.uint64)
    return xor(x, shift(x, tf.constant(31, tf.uint64)))


def top_bits(x, bits):
    """The top `bits` bits of uint64 `x`, as int64."""
    return tf.bitcast(tf.bitwise.right_shift(x, tf.constant(64 - bits, tf.uint64)), tf.int64)


def rarely(pred, true_fn, false_fn):
    """`tf.cond` of a branch a step takes rarely (an eviction pass): in a traced function,
    one op that runs the branch taken, as a function of its own. TensorFlow otherwise
    lowers a cond to the ops of both branches, and the step passes the dead ones through
    the executor one by one, every time: about 270 ops of each table's step."""
    out = tf.cond(pred, true_fn, false_fn)
    if not tf.executing_eagerly():
        op = tf.nest.flatten(out)[0].op
        while op.type not in ("If", "StatelessIf"):  # through the outputs' identities
            op = op.inputs[0].op
        # TF-private: the attribute that tells TensorFlow to lower an If op
        # (`control_flow_util_v2.maybe_set_lowering_attr`); tf.cond has no argument for it.
        op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    return out


def variable(value, device, name):
    """A non-trainable variable of `value` on `device`, outside any strategy."""
    with tf.device(device):
        return resource_variable_ops.ResourceVariable(value, trainable=False, name=name)
