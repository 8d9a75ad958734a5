"""Keras 3 functional models read every PS table their layers read whole at once.

Under `architecture="ps"` (asynchronous training included) a Dense kernel, a bias, a
normalization's scale are PS tables that a layer reads whole: one tensor crossing from
the PS task to the worker per table, each a call between the two tasks (0.6-0.9 ms of
CPU on each side, benchmarks/results/transfer_cost.md). `install` makes a functional
model (a Sequential one runs as one too) read those tables together when it starts
running (`table.reading_ahead`): what each PS task holds of them crosses as one
tensor, and each layer reads its tables from there when it is called, with the same
values and gradients as its own reads. A table written while the model runs (a
moving mean) is read anew after the write.

Which tables: those of the model's layers that the functions traced so far read
whole and never by row (`table.reads_whole`). Keras 3 traces the model once before
the first step of `fit`, `evaluate` or `train_on_batch` (building the compiled loss
and metrics), so under `fit` they are known by the first step; a function traced
before any trace of the model reads its tables where its layers do. A table a layer
looks up by row (an Embedding's) is never read whole ahead. A layer that reads a
table in a graph of its own (a loop's body, a nested function) reads it there, as
without this: the value read ahead goes unused.

```python
import keras
import hybrid_strategy
strategy = hybrid_strategy.HybridStrategy(architecture="ps")     # installs it
with strategy.scope():
    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.Dense(1)(keras.layers.Dense(8)(x)))
print(model(keras.ops.ones((2, 4))).shape)
```
"""

import functools

import tensorflow as tf

from hybrid_strategy.keras_integration import registry
from hybrid_strategy.tables import table as table_lib


def install(applies):
    """Makes Keras 3 functional models read their tables whole at once while `applies()`."""

    def make_run_through_graph(run_through_graph):
        @functools.wraps(run_through_graph)
        def run_reading_ahead(self, inputs, operation_fn=lambda op: op, call_fn=None):
            device = _step_device(inputs) if call_fn is None and applies() else None
            tables = _read_whole(self) if device is not None else []
            if not tables:
                return run_through_graph(self, inputs, operation_fn=operation_fn,
                                         call_fn=call_fn)
            with table_lib.reading_ahead(tables, device):
                return run_through_graph(self, inputs, operation_fn=operation_fn,
                                         call_fn=call_fn)

        return run_reading_ahead

    # Keras-private: `Function._run_through_graph`, the graph runner of functional
    # models, which Keras offers no public way into.
    registry.install("reads_ahead.run_reading_ahead", make_run_through_graph)


def _step_device(inputs):
    """The device the model's inputs are on, when they are a traced step's tensors."""
    import keras  # pylint: disable=import-outside-toplevel

    values = keras.tree.flatten(inputs)
    if not values or not all(isinstance(value, tf.Tensor) for value in values):
        return None  # symbolic (KerasTensor) inputs: no step being traced
    if tf.executing_eagerly():
        return None
    return values[0].device


def _read_whole(function):
    """The PS tables of `function`'s layers that are read whole (`table.reads_whole`)."""
    tables = {}
    for nodes in function._nodes_by_depth.values():
        for node in nodes:
            for weight in getattr(node.operation, "weights", ()):
                table = table_lib.table_behind(weight)
                if table is not None and table_lib.reads_whole(table):
                    tables[id(table)] = table
    return list(tables.values())
