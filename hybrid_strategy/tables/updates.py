"""Updates of PS tables: an optimizer's step or weight decay on the PS, or an assignment.

```python
result = updates.update_table(topology, table, fn, args, kwargs, copy_on)
```
"""

import inspect

import tensorflow as tf

# TF-private: picks one replica's update arguments, as MirroredExtended's own update
# does, and the update context an assignment runs in.
from hybrid_strategy.tensorflow_private import distribute_lib
from hybrid_strategy.tensorflow_private import distribute_utils

from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.tables import penalties
from hybrid_strategy.tables import sparse_optimizers


def update_table(topology, table, fn, args, kwargs, copy_on=None):
    """The strategy's `_update` of a PS table; an optimizer's step runs on its ps tasks.

    Its rule is sparse_optimizers.py's for that optimizer, in the `topology`'s
    `sparse_update` mode. Other updates (assignments) run `fn` on the table itself, whose
    methods write each shard on its own device. `copy_on(tensor, device)`: a copy of an
    argument already on a ps task (communication/riders.py), or None. Returns the update.
    """
    args = distribute_utils.select_replica(0, args)
    kwargs = distribute_utils.select_replica(0, kwargs)
    optimizer = _optimizer_of(fn)
    grad = args[0] if args else None
    if optimizer is not None and isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
        sparse_optimizers.check(optimizer, table.path)
        # Not in an update context: writes of mirrored optimizer state (tf_keras'
        # Adafactor and Nadam) then reach every replica's copy.
        return sparse_optimizers.update_table(
            optimizer, fn, table, shard_gradients(grad, table), args[1:], kwargs,
            mode=topology.sparse_update, concurrent=topology.asynchronous, copy_on=copy_on)
    if optimizer is not None and not args and sparse_optimizers.is_weight_decay(fn):
        sparse_optimizers.check(optimizer, table.path)
        return sparse_optimizers.decay_table(optimizer, fn, table, mode=topology.sparse_update,
                                             concurrent=topology.asynchronous)
    with distribute_lib.UpdateContext(0):
        return fn(table, *args, **kwargs)


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


def shard_gradients(grad, table):
    """The step's gradient of `table`, one part per shard with shard-local rows."""
    sums = sharding.shard_sums_of(grad)
    if sums is not None:
        return list(sums)
    if isinstance(grad, tf.IndexedSlices):
        (grad,), penalty = penalties.without_markers([grad], table)
        parts = sharding.split_slices(sharding.merge_duplicates(grad), table.num_shards)
        return penalties.with_gradient(
            parts, None if penalty is None else [penalty] * table.num_shards, table)
    penalties.check_not_dropped(table)
    return sharding.split_dense(grad, table.num_shards)
