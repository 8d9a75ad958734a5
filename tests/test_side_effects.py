"""Side effects ordered per task (hybrid_strategy/communication/side_effects.py, registered by
keras_integration/side_effect_hooks.py), read from a traced graph."""

import tensorflow as tf

from hybrid_strategy.keras_integration import side_effect_hooks

WORKER = "/job:worker/replica:0/task:{}/device:CPU:0"


def _traced_checks():
    """The Assert ops of a function checking on task 0, task 1, then task 0 again."""
    side_effect_hooks.order_per_task()

    @tf.function
    def checks(x):
        for task in (0, 1, 0):
            with tf.device(WORKER.format(task)):
                tf.debugging.Assert(tf.reduce_all(x > 0), ["x must be positive"])
        return x

    graph = checks.get_concrete_function(tf.TensorSpec([2])).graph
    return [op for op in graph.get_operations() if op.type == "Assert"]


def test_checks_on_one_task_stay_in_order_and_wait_for_no_other_task():
    first, other_task, second = _traced_checks()
    assert first in second.control_inputs
    assert not other_task.control_inputs
    assert other_task not in second.control_inputs


def test_outputs_wait_for_this_process_only_and_every_check_still_runs():
    side_effect_hooks.order_per_task()

    @tf.function
    def checks(x):
        for device in (WORKER.format(1), "/job:localhost/replica:0/task:0/device:CPU:0"):
            with tf.device(device):
                tf.debugging.Assert(tf.reduce_all(x > 0), ["x must be positive"])
        return x + 1

    graph = checks.get_concrete_function(tf.TensorSpec([2])).graph
    remote, local = [op for op in graph.get_operations() if op.type == "Assert"]
    waits = [op for output in graph.outputs for op in output.op.control_inputs]
    assert [op.control_inputs for op in waits] == [[local]]
    assert {remote, local} <= set(graph.control_outputs)


def test_a_check_still_fails_the_function():
    side_effect_hooks.order_per_task()

    @tf.function
    def check(x):
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            tf.debugging.Assert(tf.reduce_all(x > 0), ["x must be positive"])
        return x + 1

    assert check(tf.constant([1.0])).numpy().tolist() == [2.0]
    try:
        check(tf.constant([-1.0]))
    except tf.errors.InvalidArgumentError as e:
        assert "x must be positive" in str(e)
    else:
        raise AssertionError("the check did not fail the function")
