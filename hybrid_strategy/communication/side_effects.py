"""Side effects of a step ordered within each task, not across tasks.

`tf.function` runs the stateful ops that touch no variable (assertions, prints,
candidate samplers, ...) in the order they were traced. A step replicated over workers
traces replica after replica, so replica r's would wait for replica r - 1's: on another
task, one tensor sent between the two every step, and each worker's step held until the
workers before it reached that point (the ids check of an embedding lookup, the sampler
of a sampled softmax). Replicas are independent programs: with `side_effects_of_task`
registered as a resolver of automatic control dependencies, such ops are ordered among
those placed on the same task only. Every one of them still runs before the function
returns.

The function's outputs, too, waited for every stateful op of every task: automatic
control dependencies give them one control input that depends on all of those, and each
task sent a tensor to the calling process for it at every step. A function that spans
tasks returns only once every task has run its part, so with
`outputs_wait_for_this_task_only` among tf.function's graph transforms the outputs wait
for the stateful ops of the calling process alone. `HybridStrategy()` registers both
(keras_integration/side_effect_hooks.py).

```python
import tensorflow as tf
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # from here on, side effects are ordered per task

@tf.function
def checks(x):
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        tf.debugging.Assert(tf.reduce_all(x > 0), ["x must be positive"])
    return x + 1

print(checks(tf.constant([1.0])))
```
"""

import itertools
import weakref

import tensorflow as tf
# TF-private: automatic control dependencies take resolvers that name the resources an
# op touches; the stand-in resource of a task chains that task's side effects.
from hybrid_strategy.tensorflow_private import auto_control_deps
# TF-private: the task of this process (its context's address space).
from hybrid_strategy.tensorflow_private import context

_tokens = weakref.WeakKeyDictionary()  # graph -> {task: _TaskSideEffects}
_ids = itertools.count(-1, -1)  # below every tensor's id


class _TaskSideEffects:
    """Where automatic control dependencies expect a resource tensor: one task's
    side effects, each ordered after the one traced before it on that task."""

    class op:  # pylint: disable=invalid-name
        type = "TaskSideEffects"  # not a Switch: no branch of a v1 conditional

    def __init__(self):
        self._id = next(_ids)


def outputs_wait_for_this_task_only(func_graph):
    """In a function that spans tasks, keeps of the control inputs of the no-op its
    outputs wait on those placed on this process's task."""
    # pylint: disable=protected-access
    waits = {control for output in func_graph.outputs for control in output.op.control_inputs
             if control.type == "NoOp" and control.graph is func_graph}
    if not waits:
        return
    here = _task(context.context().host_address_space())

    def on_this_task(op):
        return _task(op.device) == here

    # Ops without a device of their own (a variable's update goes where the variable
    # is) are placed later: only those placed here are known to be here.
    if all(on_this_task(op) for op in func_graph.get_operations() if op.device):
        return
    for wait in waits:
        kept = [op for op in wait.control_inputs if op.device and on_this_task(op)]
        if len(kept) < len(wait.control_inputs):
            wait._remove_all_control_inputs()
            wait._add_control_inputs(kept)


def _task(device):
    """(job, replica, task) of a device string, None without a job."""
    spec = tf.DeviceSpec.from_string(device)
    return None if spec.job is None else (spec.job, spec.replica or 0, spec.task or 0)


def side_effects_of_task(op, reads, writes):
    """Adds one task's stand-in resource to `writes` of a stateful op without resources."""
    # What automatic control dependencies chain in trace order: stateful ops that touch
    # no resource, outside v1 control flow.
    # pylint: disable=protected-access
    if (reads or writes or not op.device or op._control_flow_context is not None
            or not auto_control_deps.op_is_stateful(op)):
        return False
    task = _task(op.device)
    if task is None:
        return False
    tokens = _tokens.setdefault(op.graph, {})
    if task not in tokens:
        tokens[task] = _TaskSideEffects()
    writes.add(tokens[task])
    return True
