"""Routes a step's gradients: PS tables' to their PS, mirrored variables' to the all-reduce.

```python
reduced = routing.batch_reduce(topology, tf.distribute.ReduceOp.SUM, pairs, options,
                               collective_reduce, dense_sum)
print(reduced.values, reduced.aggregated)
```
"""

import tensorflow as tf

# TF-private: per-replica values and regrouping replicas' results into one.
from hybrid_strategy.tensorflow_private import distribute_utils
from hybrid_strategy.tensorflow_private import values_lib

from hybrid_strategy.communication import aggregation as communication
from hybrid_strategy.communication import hierarchical_allreduce
from hybrid_strategy.communication import riders
from hybrid_strategy.communication import rows_ahead
from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.sharding import wire
from hybrid_strategy.tables import penalties
from hybrid_strategy.tables import table as table_lib


class Reduced:
    """`batch_reduce`'s result: the reduced values, and what the step showed of the tables.

    Attributes:
        values: One reduced value per (value, destination) pair, in order.
        gradient_types: `[(table, sparse)]`: each PS table's gradient, sparse or dense.
        aggregated: The PS tables whose gradients were summed per worker and on their PS.
    """

    def __init__(self, values, gradient_types, aggregated):
        self.values = values
        self.gradient_types = gradient_types
        self.aggregated = aggregated


def batch_reduce(topology, reduce_op, value_destination_pairs, options, collective_reduce,
                 dense_sum=None):
    """The strategy's `_batch_reduce_to`: each gradient summed where it is cheapest.

    A PS table's gradient, sparse or dense, is summed per worker and on its shards' PS
    tasks (aggregation.py); a mirrored variable's dense gradient is summed on the
    `topology`'s reducer PS (sliced over the PS tasks while reading ahead, `_reducers`) in
    the same exchange where that pays (`dense_sum.sum_on_ps_pays`),
    else all-reduced by `dense_sum` (hierarchical_allreduce.py) where it takes it, else by
    `collective_reduce` (TensorFlow's). Every worker sends each PS task one tensor.

    Args:
        topology: The step's `Topology` (placement/topology.py).
        dense_sum: A `HierarchicalAllReduce` over the topology's replicas, or None.
    Returns:
        A `Reduced`.
    """
    devices = topology.replica_devices
    pairs = list(value_destination_pairs)
    results = [None] * len(pairs)
    push = communication.Push(devices)
    mirrored, sparse, dense, penalty_of, gradient_types = [], {}, {}, {}, []
    for i, (value, destinations) in enumerate(pairs):
        table = _table_of_gradient(value)
        if table is None:
            mirrored.append(i)
            continue
        parts = components(value)
        is_sparse = isinstance(parts[0], tf.IndexedSlices)
        gradient_types.append((table, is_sparse))
        if is_sparse:
            parts, penalty = penalties.without_markers(parts, table)
            sparse[i] = (table, push.add_sparse(parts, table))
            if penalty is not None:
                penalty_of[i] = push.put_per_worker(
                    penalty, [shard.device for shard in table.shards])
        else:
            dense[i] = (table, push.add_dense(parts, table))
    # A PS table as destination (tf_keras names the variables) would make TF
    # reduce value by value; its update reads one replica's copy anyway.
    for i in mirrored:
        value, destinations = pairs[i]
        pairs[i] = (value, value if table_lib.is_table(destinations) else destinations)
    summable = [i for i in mirrored if dense_sum is not None
                and dense_sum.accepts(components(pairs[i][0]), pairs[i][1])]
    on_ps = _summed_on_ps(topology, [components(pairs[i][0]) for i in summable])
    # Where the dense sum is all-reduced the next step's rows would come back alone: the
    # language model measured no gain from that (benchmarks/results/steps-reading-ahead).
    ahead = rows_ahead.current() if push.destinations or on_ps else None
    if ahead is not None and (summable and not on_ps or not ahead.send_ids(push, devices)):
        ahead = None
    if on_ps:
        worker_sums = dense_sum.sum_per_worker([components(pairs[i][0]) for i in summable])
        reducers = _reducers(topology, ahead, dense_sum.leaders, worker_sums)
        tickets = [[_put_sliced(push, leader, reducers, total)
                    for leader, total in zip(dense_sum.leaders, totals)]
                   for totals in worker_sums.per_dtype]
    carried = _riding(push, topology)
    push.deliver()
    carried()
    if ahead is not None:
        ahead.ids_arrived(push.delivered)
    aggregated = []
    for i, (table, number) in list(sparse.items()) + list(dense.items()):
        sums = push.sparse_sums(number) if i in sparse else push.dense_sums(number)
        if i in penalty_of:
            sums = penalties.with_gradient(
                sums, [[push.arrived(t) for t in penalty_of[i][shard.device]]
                       for shard in table.shards], table)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            sums = [_scaled(s, 1.0 / topology.num_replicas) for s in sums]
        total = sharding.shard_summed(sums, table)
        results[i] = values_lib.Mirrored((total,) * topology.num_replicas)
        aggregated.append(table.path)
    if on_ps:
        reduced = dense_sum.to_replicas(reduce_op, worker_sums,
                                        _summed_on(reducers, push, tickets,
                                                   dense_sum.leaders, ahead))
        _regrouped(results, summable, reduced)
    elif summable and dense_sum.replaces_collectives:
        _regrouped(results, summable, dense_sum.all_reduce(
            reduce_op, [components(pairs[i][0]) for i in summable], options))
    else:
        summable = []
    collective = [i for i in mirrored if i not in summable]
    if collective:
        reduced = collective_reduce(reduce_op, [pairs[i] for i in collective], options)
        for i, value in zip(collective, reduced):
            results[i] = _merge_duplicate_rows(value)
    return Reduced(results, gradient_types, aggregated)


def _riding(push, topology):
    """Puts what rides with the push (riders.py) in it; returns what to call once it is
    delivered."""
    summed, sent = riders.taken_by_push()
    destinations = push.destinations
    if not destinations:
        return lambda: None
    sent_tickets = [(key, destination, push.put(push.first_worker, destination, tensor))
                    for key, tensor in sent.items() for destination in destinations]
    if topology.reducer is None:
        summed = []
    summed_tickets = [[push.put_per_worker(group, [topology.reducer])[topology.reducer]
                       for group in state.read()] for state in summed]

    def arrived():
        for key, destination, ticket in sent_tickets:
            riders.arrived(key, destination, push.arrived(ticket))
        for state, groups in zip(summed, summed_tickets):
            with tf.device(topology.reducer), tf.name_scope("ps_state_sum"):
                state.deliver([tf.add_n([push.arrived(t) for t in tickets])
                               for tickets in groups])

    return arrived


def _summed_on_ps(topology, per_replica_values):
    """Whether the dense values (one tensor per replica each) are summed on the reducer."""
    if not per_replica_values or topology.reducer is None or topology.dense_sum == "allreduce":
        return False
    if topology.dense_sum == "ps":
        return True
    dense_bytes = sum(values[0].shape.num_elements() * values[0].dtype.size
                      if values[0].shape.is_fully_defined() else float("inf")
                      for values in per_replica_values)
    return hierarchical_allreduce.sum_on_ps_pays(topology.num_workers, dense_bytes)


def _reducers(topology, ahead, leaders, worker_sums):
    """The PS tasks that sum the dense gradients (`worker_sums`), each a slice of them.

    The topology's reducer alone, unless the step reads ahead: then every PS task whose
    next rows go back to every worker anyway sums a slice, which crosses in the tensors
    that cross already, so no one task's link and CPU take every worker's gradients.
    """
    if ahead is None or not all(total.shape.is_fully_defined()
                                for totals in worker_sums.per_dtype for total in totals):
        return [topology.reducer]
    return ahead.returning_to_all(topology.ps_devices, leaders) or [topology.reducer]


def _put_sliced(push, leader, reducers, total):
    """Puts `total` (a vector on `leader`) in `push` in one slice per reducer, nearly
    equal, in order; their tickets."""
    if len(reducers) == 1:
        return [push.put(leader, reducers[0], total)]
    count, n = len(reducers), total.shape[0]
    with tf.device(leader):
        parts = tf.split(total, [n // count + (k < n % count) for k in range(count)])
    return [push.put(leader, reducer, part) for reducer, part in zip(reducers, parts)]


def _summed_on(reducers, push, tickets, leaders, ahead=None):
    """The workers' vectors that arrived on `reducers` (tickets per dtype, per worker, per
    reducer's slice), each slice summed on its reducer and sent back to each worker's
    first device, where the slices are joined: with the next step's rows when `ahead`
    (rows_ahead.py) has them come back later."""
    back = wire.Outbox()
    returned = []
    for group in tickets:
        returned.append([])
        for k, reducer in enumerate(reducers):
            with tf.device(reducer), tf.name_scope("ps_dense_sum"):
                arrived = [push.arrived(slices[k]) for slices in group]
                total = tf.add_n(arrived) if len(arrived) > 1 else arrived[0]
            returned[-1].append([(back.put(reducer, leader, total), total)
                                 for leader in leaders])
    if ahead is not None:
        delivered = ahead.returned_later(back, returned)
    else:
        tensors = back.deliver()
        delivered = [[[tensors[ticket] for ticket, _ in to_leaders] for to_leaders in group]
                     for group in returned]
    joined = []
    for slices in delivered:
        joined.append([])
        for w, leader in enumerate(leaders):
            parts = [to_leaders[w] for to_leaders in slices]
            with tf.device(leader):
                joined[-1].append(tf.concat(parts, 0) if len(parts) > 1 else parts[0])
    return joined


def _regrouped(results, positions, reduced):
    for i, values in zip(positions, reduced):
        results[i] = distribute_utils.regroup(tuple(values), values_lib.Mirrored)


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
            merged.append(sharding.merge_duplicates(component))
    return values_lib.Mirrored(tuple(merged))
