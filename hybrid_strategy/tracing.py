"""Where state kept while a step is traced lives: per trace or per thread, never shared.

Asynchronous training (asynchronous/training.py) traces every worker's step at the same
time, one thread per worker, over the same model, optimizer, tables and strategy. What
the package keeps while it traces a step must be out of reach of the other traces:

- per trace, keyed by a graph being built (`graphs`), what the threads of one trace
  share (tf.distribute traces each replica on a thread of its own, in the graph its
  caller builds): the step's per-replica batch sizes (`HybridExtended.step_batch_sizes`),
  the mirrored variables an optimizer's rules read once per ps task
  (tables/mirrored_reads.py), the weight decays deferred to a table's update
  (tables/sparse_optimizers.py), the tables' lookups, penalties and whole reads
  (tables/table.py, tables/penalties.py), side effects ordered per task
  (communication/side_effects.py), which worker a trace is for (`WorkerScope`);
- per thread (`threading.local`), what lives within one Python call on one thread: the
  rows an optimizer's rule updates in place of a table (`ShardedTable.rows_view`),
  the lookups a functional model made at once (keras_integration/batched_lookups.py)
  and the tables it read whole ahead (keras_integration/reads_ahead.py),
  the ids an Embedding layer has checked and export tracing (tables/table.py), a loss
  being computed per output (keras_integration/batches.py);
- the placer's handling of a PS table found to get a dense gradient, decided within
  the trace under asynchronous training, not by the chief's first call
  (placement/variables.py);
- and an optimizer's `jit_compile`, which tf_keras reads from the optimizer while
  it traces an update, is turned off while any thread runs a rule on a table's rows
  and on again once none does (tables/sparse_optimizers.py).

What Keras keeps while a step is traced is not the package's to place: the losses
layers add, kept in the layers, and tf_keras' compiled loss and metrics, built in the
first step. For those, asynchronous training traces one `strategy.run` at a time
(`WorkerScope.one_trace_at_a_time`), and the variables a worker's step creates span
every worker (`WorkerScope.of_every_worker`).

Outside a function being built, `graphs()` is the thread's default graph: eager
callers on different threads get different ones too.

```python
import tensorflow as tf
from hybrid_strategy import tracing

@tf.function
def f():
    return tf.cond(tf.constant(True), lambda: len(tracing.graphs()), lambda: 0)

print(f())   # 2: the conditional's branch, then the function's graph
```
"""

import tensorflow as tf


def graphs():
    """The default graph, then each graph it is nested in while a function is built
    (a conditional's branch, a loop's body, a nested function): innermost first,
    the traced function's own graph last."""
    graph = tf.compat.v1.get_default_graph()
    found = [graph]
    while getattr(graph, "building_function", False):
        graph = getattr(graph, "outer_graph", None)
        if not getattr(graph, "building_function", False):
            break
        found.append(graph)
    return found


def outermost():
    """The graph of the function being traced (the thread's default graph outside one)."""
    return graphs()[-1]
