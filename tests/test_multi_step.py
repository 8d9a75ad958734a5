"""Keras' steps on a HybridStrategy (hybrid_strategy/keras_integration/multi_step.py): calls on one iterator."""

import tensorflow as tf

from hybrid_strategy.keras_integration import multi_step


class CountingFunction:
    """A tf.function that counts the calls that went through it (each flattens its
    arguments)."""

    def __init__(self, function):
        self.function, self.calls = tf.function(function), 0

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)

    def get_concrete_function(self, *args):
        return self.function.get_concrete_function(*args)


def test_later_calls_on_an_iterator_read_on_from_it_without_flattening_it_again():
    total = tf.Variable(0, dtype=tf.int64)

    def step(iterator):
        value = iterator.get_next()
        total.assign_add(value)
        return value * 10

    counting = CountingFunction(step)
    calls = multi_step.CallsOnIterator(counting)
    first = iter(tf.data.Dataset.range(5))
    assert [int(calls(first)) for _ in range(3)] == [0, 10, 20]
    assert counting.calls == 1
    second = iter(tf.data.Dataset.range(100, 103))
    assert [int(calls(second)) for _ in range(2)] == [1000, 1010]
    assert int(calls(first)) == 30  # the first iterator read on where it stopped
    assert counting.calls == 3
    assert int(total.numpy()) == 0 + 1 + 2 + 100 + 101 + 3
    del first
    assert calls._flat is None  # pylint: disable=protected-access
