"""Mirrored variables read once per ps task by the optimizer rules of one step.

An optimizer's rule for a PS table runs on the table's ps task (sparse_optimizers.py)
and reads mirrored variables there: the learning rate, the step count (Adam's bias
correction), a loss scale. Each read of a mirrored variable away from its copies is a
new read of its first copy, on the first worker, and a tensor sent from that worker to
the ps task: per table and variable, every step (Adam, which reads two, sent a ps task
holding 3 tables 6 tensors per step). Under `reading_once(update, device)`, a read of
a mirrored variable on `device` reuses the value read for an earlier table of the same
optimizer update (`update`, the closure Keras makes for one step's update), so each ps
task receives each such variable once per step (Adam: 2). A write to the variable
(`forget`) makes the next read anew. The conversion of mirrored variables calls
`read` (keras_integration/optimizer_hooks.py, installed by `HybridStrategy()`).

```python
import tensorflow as tf
import hybrid_strategy
from hybrid_strategy.tables import mirrored_reads
hybrid_strategy.HybridStrategy()   # installs the conversion hook
strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
with strategy.scope():
    lr = tf.Variable(0.1)
update = lambda: None   # stands for Keras' update closure of one step

@tf.function
def two_reads():
    with mirrored_reads.reading_once(update, "/cpu:0"):
        return tf.identity(lr) * 2.0, tf.identity(lr) * 3.0   # one read of `lr`

print(two_reads())
```
"""

import inspect
import threading
import weakref

import tensorflow as tf

from hybrid_strategy import tracing

_scope = threading.local()  # .reads, .device: set by `reading_once`
# Per trace (the graph of the function being traced; tracing.py): Keras' update
# closure -> {(variable ref, dtype, graph, device): tensor read}.
_READS = weakref.WeakKeyDictionary()


class reading_once:  # pylint: disable=invalid-name
    """Within: mirrored variables converted on `device` are read once per `update`."""

    def __init__(self, update, device):
        # The strategy gets Keras' closure wrapped anew for each variable (autograph).
        trace = _READS.setdefault(tracing.outermost(), weakref.WeakKeyDictionary())
        self._reads = trace.setdefault(inspect.unwrap(update), {})
        self._device = device
        self._outer = None

    def __enter__(self):
        self._outer = (getattr(_scope, "reads", None), getattr(_scope, "device", None))
        _scope.reads, _scope.device = self._reads, self._device
        return self

    def __exit__(self, *exc):
        _scope.reads, _scope.device = self._outer


def reading_on():
    """The device of the `reading_once` block being traced on this thread, or None."""
    return getattr(_scope, "device", None)


def forget(variable):
    """Reads of `variable` (being written) in the function being traced are made anew
    from now on."""
    ref = variable.ref()
    for reads in list(_READS.get(tracing.outermost(), {}).values()):
        for key in [key for key in reads if key[0] == ref]:
            del reads[key]


def read(convert, variable, dtype=None, name=None, as_ref=False):
    """`convert(variable, ...)`, a mirrored variable's conversion to a tensor, made
    once per `reading_once` block's update and device (outside one, every time)."""
    reads = getattr(_scope, "reads", None)
    if reads is None or as_ref:
        return convert(variable, dtype=dtype, name=name, as_ref=as_ref)
    key = (variable.ref(), dtype, tf.compat.v1.get_default_graph(), _scope.device)
    if key not in reads:
        reads[key] = convert(variable, dtype=dtype, name=name, as_ref=as_ref)
    return reads[key]
