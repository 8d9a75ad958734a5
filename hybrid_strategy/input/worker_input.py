"""Datasets distributed over the workers so that each worker builds only its own batches.

`distribute_dataset` is what `HybridStrategy.experimental_distribute_dataset` (and so
Keras' `fit`, `evaluate` and `predict`) does with a `tf.data.Dataset` on a cluster of
several workers: it reads the dataset's graph (input_graph.py), lets input_plan.py decide
how each worker gets its share, and either gives each worker its own version of the
graph (the SHARE plan: the worker's blocks of every global batch, batched on the
worker, split over its replicas) or hands the dataset to TensorFlow's own distribution
(sharding by file, OFF, HINT, and what the share cannot be taken in).

```python
strategy = hybrid_strategy.HybridStrategy()       # 2 workers in TF_CONFIG
dataset = tf.data.Dataset.from_tensor_slices((x, y)).map(augment).batch(64)
for batch in strategy.experimental_distribute_dataset(dataset):
    ...  # each worker sliced, mapped and batched only its 32 examples of each batch
```
"""

import random
import warnings

import tensorflow as tf

# TF-private: a dataset re-created on a device from a serialized graph, as TensorFlow's
# `replicate` makes it on each worker.
from hybrid_strategy.tensorflow_private import data_distribute
# TF-private: TensorFlow's distribution of a dataset over workers.
from hybrid_strategy.tensorflow_private import input_lib
from hybrid_strategy.tensorflow_private import input_util
# TF-private: the class of `dataset.prefetch(n)`, to see that a dataset already keeps
# batches ready.
from hybrid_strategy.tensorflow_private import prefetch_op

from hybrid_strategy.input import input_graph
from hybrid_strategy.input import input_plan


class InputShardingWarning(UserWarning):
    """How a dataset is split over the workers, when the user may want it otherwise."""


_shown = set()


def show_once(message):
    """Warns with `message` (an InputShardingWarning) once per process."""
    if message and message not in _shown:
        _shown.add(message)
        warnings.warn(message, InputShardingWarning, stacklevel=3)


def distribute_dataset(hosts, dataset, options, tensorflow_distribute, from_function):
    """`dataset` distributed over the workers of `hosts`.

    Args:
        hosts: `(input device, its replicas' devices)` of every worker.
        dataset: A batched `tf.data.Dataset` (global batches).
        options: The `tf.distribute.InputOptions` given, or None.
        tensorflow_distribute: `tensorflow_distribute(dataset, options)`, TensorFlow's
            own distribution of a dataset.
        from_function: `from_function(dataset_fn, options)`, the strategy's
            distribution of each worker's dataset made by `dataset_fn(InputContext)`.
    Raises:
        input_plan.ShardingError: The auto_shard_policy FILE cannot be honoured.
    """
    replicas = {len(devices) for _, devices in hosts}
    per_replica = options is not None and (options.experimental_replication_mode
                                           == tf.distribute.InputReplicationMode.PER_REPLICA)
    if len(hosts) < 2 or len(replicas) != 1 or per_replica:  # (TensorFlow refuses PER_REPLICA)
        return tensorflow_distribute(dataset, options)
    decided, worker_dataset = shares(dataset, [host for host, _ in hosts], replicas.pop())
    if worker_dataset is None:
        if decided.tf_policy != dataset.options().experimental_distribute.auto_shard_policy.name:
            dataset = dataset.with_options(_policy_options(decided.tf_policy))
        return tensorflow_distribute(dataset, options)
    return from_function(lambda context: worker_dataset(context.input_pipeline_id), options)


def own_iterators(hosts, options):
    """The options under which each worker reads its batches with its dataset's own iterator.

    TensorFlow reads a worker's batches through a MultiDeviceIterator (a background
    thread and a function call per batch) that copies them to the worker's replicas'
    devices. Where every worker has one replica, on its host, there is nothing to copy:
    PER_REPLICA input not fetched to the device reads the dataset's iterator itself, and
    `prefetched` keeps a batch ready as the MultiDeviceIterator did. Every dataset a
    strategy distributes must be read one way: TensorFlow's function cache takes an
    iterator of either kind for the other (their specs differ only in options), and a
    function traced for one fails on the other.

    Args:
        hosts: (input device, its replicas' devices) of every worker.
        options: The `tf.distribute.InputOptions` given, or None.
    Returns:
        `options` (or the default ones) made PER_REPLICA without fetching to the device,
        or None where they ask for another replication or for placing the dataset on
        the device, or a worker has several replicas or one off its host.
    """
    options = options or tf.distribute.InputOptions()
    if (options.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER
            or options.experimental_place_dataset_on_device  # refused by TensorFlow
            or not all(len(devices) == 1 and tf.DeviceSpec.from_string(devices[0])
                       == tf.DeviceSpec.from_string(host) for host, devices in hosts)):
        return None
    return options._replace(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False)


def distributed_by_tensorflow(dataset, hosts, strategy, num_replicas_in_sync, options):
    """TensorFlow's own distribution of `dataset` over `hosts`, read as `own_iterators` says.

    Args:
        dataset: A batched `tf.data.Dataset` (global batches).
        hosts: (input device, its replicas' devices) of every worker reading it.
        strategy: The strategy.
        num_replicas_in_sync: The replicas of `hosts` a global batch is split over.
        options: The `tf.distribute.InputOptions` given, or None.
    """
    reading = own_iterators(hosts, options)
    distributed = input_util.get_distributed_dataset(
        dataset, input_lib.InputWorkers(hosts), strategy,
        num_replicas_in_sync=num_replicas_in_sync, options=reading or options)
    if reading is not None:
        # TF-private: the dataset each worker reads.
        distributed._cloned_datasets = [  # pylint: disable=protected-access
            prefetched(worker_dataset, reading)
            for worker_dataset in distributed._cloned_datasets]  # pylint: disable=protected-access
    return distributed


def prefetched(dataset, options):
    """`dataset` keeping batches ready, as TensorFlow's MultiDeviceIterator keeps them."""
    if isinstance(dataset, prefetch_op._PrefetchDataset):  # pylint: disable=protected-access
        return dataset
    # TF-private: the dataset's tensor, on the device its prefetch must run on (a
    # function given to distribute_datasets_from_function may make it anywhere).
    with tf.device(dataset._variant_tensor.device):  # pylint: disable=protected-access
        return dataset.prefetch(options.experimental_per_replica_buffer_size)


def shares(dataset, devices, replicas_per_worker):
    """How `dataset` reaches one worker per device of `devices`.

    Returns:
        (the `input_plan.Plan`, `worker_dataset(i)`: worker i's dataset of per-replica
        batches, made on `devices[i]`), the function None unless the plan is SHARE.
    """
    policy = dataset.options().experimental_distribute.auto_shard_policy.name
    graph = input_graph.DatasetGraph(dataset)
    pipeline = graph.pipeline(policy, lambda graph_def, spec: _count(devices[0], graph_def,
                                                                     spec))
    decided = input_plan.plan(pipeline, len(devices), replicas_per_worker)
    show_once(decided.notice)
    element_spec = unknown_batch_size(dataset.element_spec)
    if decided.how != input_plan.SHARE:
        return decided, None
    if element_spec is None:  # elements without a batch dimension
        return input_plan.Plan(input_plan.TENSORFLOW, tf_policy=input_plan.DATA,
                               notice=decided.notice), None
    graph.prepare(decided, seed=random.SystemRandom().randrange(1, 1 << 62))
    graphs = [graph]

    def worker_dataset(worker):
        serialized = graphs[0].worker_graph(worker)
        if worker == len(devices) - 1:
            graphs.clear()  # TensorFlow keeps this function: let go of the graph's data
        shared = data_distribute._RemoteDataset(  # pylint: disable=protected-access
            serialized, devices[worker], element_spec)
        return split_over_replicas(shared, replicas_per_worker)

    return decided, worker_dataset


def split_over_replicas(dataset, replicas):
    """Each batch of `dataset` as `replicas` consecutive batches, as even as can be.

    The larger ones first, as TensorFlow splits a batch over replicas (and as
    input_plan.block_bounds counts), for full and partial batches alike.
    """
    if replicas == 1:
        return dataset

    def parts(*components):
        # tf.data passes a tuple element's items as arguments: make the element again.
        batch = tf.nest.pack_sequence_as(dataset.element_spec, tf.nest.flatten(components))
        size = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]

        def part(replica):
            start, end = input_plan.block_bounds(size, replicas, replica, 1,
                                                 minimum=tf.minimum)
            return tf.nest.map_structure(lambda t: t[start:end], batch)

        return tf.data.Dataset.range(replicas).map(part)

    return dataset.flat_map(parts)


def unknown_batch_size(spec):
    """`spec` with an unknown batch dimension, or None if a component has no batch dimension."""
    try:
        # TF-private: how TensorFlow itself makes a batch dimension unknown.
        return tf.nest.map_structure(
            lambda s: s._unbatch()._batch(None), spec)  # pylint: disable=protected-access
    except ValueError:
        return None


def _policy_options(policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy)
    return options


def _count(device, graph_def, spec):
    """Elements of the dataset `graph_def` makes (file names), counted on `device`."""
    try:
        with tf.device(device):
            names = data_distribute._RemoteDataset(  # pylint: disable=protected-access
                graph_def, device, spec)
            count = int(names.cardinality())
            if count == tf.data.UNKNOWN_CARDINALITY:
                count = int(names.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
    except tf.errors.OpError:
        return None
    return count if count >= 0 else None
