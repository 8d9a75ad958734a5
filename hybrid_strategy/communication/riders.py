"""What rides with a step's gradients to the PS tasks, so that it takes no message of its own.

Two kinds of values cross between tasks in a synchronous step besides the gradients,
each by a message of its own where nothing else carries it:
- state every replica holds a part of, summed for the step's logs (the metrics'
  variables): registered with `summed_with_push(read)`, it rides with each worker's
  push to the reducer PS, which sums it; `.result()` is the sum there.
- values of the first replica that the PS tasks' updates read (the learning rate,
  the step count): registered with `sent_with_push(key, tensor)` by the first replica,
  they ride with worker 0's push to every PS task of the step; `copy_on(key, device)`
  is the copy that arrived there.

Both are kept per traced function (the graph they were registered in) and used by the
push of the same graph only (`communication/routing.py`): a push inside a conditional
(a loss-scaled step) carries nothing, and the values cross as before.

```python
import tensorflow as tf
from hybrid_strategy.communication import riders

@tf.function
def step():
    state = riders.summed_with_push(lambda: [[tf.ones(3), tf.ones(3)]])  # 2 replicas
    # ... a HybridStrategy step on a cluster: its push sums the state on the first PS ...
    print(state.result())          # None here: no push took it
    return tf.constant(0)

step()
```
"""

import threading
import weakref

import tensorflow as tf

from hybrid_strategy.sharding import wire

_STEPS = weakref.WeakKeyDictionary()  # graph -> _Step
_LOCK = threading.Lock()


class _Step:
    def __init__(self):
        self.summed = []     # Summed registered in the graph
        self.sent = {}       # key -> tensor of replica 0
        self.copies = {}     # (key, device) -> tensor on that device


def _step(graph=None, create=False):
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    with _LOCK:
        step = _STEPS.get(graph)
        if step is None and create:
            step = _STEPS[graph] = _Step()
        return step


class Summed:
    """State summed over every replica on the reducer PS by the step's push.

    `read()` is called when the push is built (after the step's updates of the state
    traced so far): a list of groups, each a list of one 1-D tensor per replica, of
    one dtype and length.
    """

    def __init__(self, read):
        self.read = read
        self._result = None

    def deliver(self, sums):
        self._result = sums

    def result(self):
        """One tensor per group on the reducer PS, or None if no push carried it."""
        return self._result


def summed_with_push(read):
    """Registers state to sum with the push of the function being traced; a `Summed`."""
    summed = Summed(read)
    if not tf.executing_eagerly():
        _step(create=True).summed.append(summed)
    return summed


def sent_with_push(key, tensor):
    """Registers `tensor` (the first replica's value of `key`, hashable) to ride with the
    push of the function being traced to every PS task it reaches."""
    if not tf.executing_eagerly():
        _step(create=True).sent[key] = tensor


def taken_by_push():
    """What the push of the function being traced carries: (`Summed`s, {key: tensor})."""
    step = _step()
    if step is None:
        return [], {}
    summed, step.summed = step.summed, []
    return summed, dict(step.sent)


def arrived(key, device, tensor):
    """Notes `tensor`, `key`'s value as it arrived on `device` with the push."""
    _step(create=True).copies[(key, wire.canonical(device))] = tensor


def copy_on(key, device):
    """The copy of `key`'s value that rode to `device` with the push of the function being
    traced, or None."""
    step = _step()
    if step is None:
        return None
    return step.copies.get((key, wire.canonical(device)))
