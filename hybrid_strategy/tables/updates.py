"""Updates of PS tables: an optimizer's step or weight decay on the PS, or an assignment.

```python
result = updates.update_table(extended, table, fn, args, kwargs, group)
```
"""

import inspect

import tensorflow as tf

# TF-private: picks one replica's update arguments and regroups the result, as
# MirroredExtended's own update does.
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils

from hybrid_strategy.communication import riders
from hybrid_strategy.communication import routing
from hybrid_strategy.tables import sparse_optimizers


def update_table(extended, table, fn, args, kwargs, group):
    """The strategy's `_update` of a PS table; an optimizer's step runs on its ps tasks.

    Its rule is sparse_optimizers.py's for that optimizer. Other updates (assignments) run `fn` on the table itself, whose methods
    write each shard on its own device.
    """
    args = distribute_utils.select_replica(0, args)
    kwargs = distribute_utils.select_replica(0, kwargs)
    optimizer = _optimizer_of(fn)
    grad = args[0] if args else None
    if optimizer is not None and isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
        sparse_optimizers.check(optimizer, table.path)
        # Not in an update context: writes of mirrored optimizer state (tf_keras'
        # Adafactor and Nadam) then reach every replica's copy.
        result = sparse_optimizers.update_table(
            optimizer, fn, table, routing.shard_gradients(grad, table), args[1:], kwargs,
            mode=extended.sparse_update, concurrent=extended.worker_scope is not None,
            copy_on=lambda value, device: riders.copy_on(value.ref(), device))
    elif optimizer is not None and not args and sparse_optimizers.is_weight_decay(fn):
        sparse_optimizers.check(optimizer, table.path)
        result = sparse_optimizers.decay_table(optimizer, fn, table,
                                               mode=extended.sparse_update,
                                               concurrent=extended.worker_scope is not None)
    else:
        with distribute_lib.UpdateContext(0):
            result = fn(table, *args, **kwargs)
    return distribute_utils.update_regroup(extended, [result], group)


def _optimizer_of(fn):
    """The optimizer whose update `fn` is: Keras and tf_keras pass a closure over it."""
    fn = inspect.unwrap(fn)  # merge_call wraps it for autograph
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            candidate = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(candidate, "iterations") and hasattr(candidate, "apply_gradients"):
            return candidate
    return None
