"""Routes a step's gradients: PS tables' to their PS, mirrored variables' to the all-reduce.

```python
results = routing.batch_reduce(extended, tf.distribute.ReduceOp.SUM, pairs, options,
                               collective_reduce)
```
"""

import tensorflow as tf

# TF-private: per-replica values and regrouping replicas' results into one.
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as values_lib

from hybrid_strategy.communication import aggregation as communication
from hybrid_strategy.tables import penalties
from hybrid_strategy.tables import table as table_lib


def batch_reduce(extended, reduce_op, value_destination_pairs, options, collective_reduce):
    """The strategy's `_batch_reduce_to`: each gradient summed where it is cheapest.

    A PS table's sparse gradient is summed per worker and on its PS (aggregation.py),
    its dense gradient shard by shard; a mirrored variable's is all-reduced, by the
    hierarchical sum where it applies, else by `collective_reduce` (TensorFlow's).
    """
    results = [None] * len(value_destination_pairs)
    collective, sparse, tables, shard_sums, penalty_of = [], [], {}, {}, {}
    for i, (value, destinations) in enumerate(value_destination_pairs):
        tables[i] = table = _table_of_gradient(value)
        if table is None:
            collective.append(i)
            continue
        parts = components(value)
        extended.placer.record_gradient_type(table, isinstance(parts[0], tf.IndexedSlices))
        if isinstance(parts[0], tf.IndexedSlices):
            parts, penalty = penalties.without_markers(parts, table)
            sparse.append((i, (parts, table)))
            penalty_of[i] = penalty
        else:
            shard_sums[i] = communication.sum_dense(parts, extended._devices, table)
    # Every table's rows at once: a worker's parts bound for one PS cross together.
    sums = communication.sum_sparse([pair for _, pair in sparse], extended._devices)
    shard_sums.update((i, penalties.with_gradient(s, penalty_of[i], tables[i]))
                      for (i, _), s in zip(sparse, sums))
    for i, sums in shard_sums.items():
        table = tables[i]
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            sums = [_scaled(s, 1.0 / extended._num_replicas_in_sync) for s in sums]
        total = communication.shard_summed(sums, table)
        results[i] = values_lib.Mirrored((total,) * extended._num_replicas_in_sync)
        extended.ps_aggregated.add(table.path)
    # A PS table as destination (tf_keras names the variables) would make TF
    # reduce value by value; its update reads one replica's copy anyway.
    pairs = {i: (value, value if table_lib.is_table(destinations) else destinations)
             for i, (value, destinations) in
             ((i, value_destination_pairs[i]) for i in collective)}
    dense_sum = extended._dense_all_reduce
    per_worker = [i for i in collective if dense_sum is not None
                  and dense_sum.accepts(components(pairs[i][0]), pairs[i][1])]
    if per_worker:
        reduced = dense_sum.all_reduce(
            reduce_op, [components(pairs[i][0]) for i in per_worker], options)
        for i, values in zip(per_worker, reduced):
            results[i] = distribute_utils.regroup(tuple(values), values_lib.Mirrored)
    collective = [i for i in collective if i not in per_worker]
    if collective:
        reduced = collective_reduce(reduce_op, [pairs[i] for i in collective], options)
        for i, value in zip(collective, reduced):
            results[i] = _merge_duplicate_rows(value)
    return results

def components(value):
    """The replicas' values in `value` (itself, if it is one tensor)."""
    if isinstance(value, values_lib.DistributedValues):
        return value.values
    return (value,)


def _table_of_gradient(value):
    """The PS table every replica's gradient in `value` belongs to, or None."""
    tables = set()
    for component in components(value):
        key = component.indices if isinstance(component, tf.IndexedSlices) else component
        table = table_lib.table_of_gradient(key) if tf.is_tensor(key) else None
        if table is None:
            return None
        tables.add(table.ref())
    return tables.pop().deref() if len(tables) == 1 else None


def _scaled(gradient, factor):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices,
                                gradient.dense_shape)
    return gradient * factor


def _merge_duplicate_rows(value):
    """All-gathered IndexedSlices repeat rows; optimizers like Adagrad need them once."""
    parts = components(value)
    if not isinstance(parts[0], tf.IndexedSlices):
        return value
    merged = []
    for component in parts:
        with tf.device(component.values.device):
            merged.append(communication.merge_duplicates(component))
    return values_lib.Mirrored(tuple(merged))


def shard_gradients(grad, table):
    """The step's gradient of `table`, one part per shard with shard-local rows."""
    sums = communication.shard_sums_of(grad)
    if sums is not None:
        return list(sums)
    if isinstance(grad, tf.IndexedSlices):
        (grad,), penalty = penalties.without_markers([grad], table)
        parts = table_lib.split_slices(communication.merge_duplicates(grad), table.num_shards)
        return penalties.with_gradient(parts, penalty, table)
    penalties.check_not_dropped(table)
    return table_lib.split_dense(grad, table.num_shards)
