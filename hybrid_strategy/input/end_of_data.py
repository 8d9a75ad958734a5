"""Each worker's batch stays on its worker while a step checks for the end of the data.

Before each step on a dataset of finite length, TensorFlow's distributed iterator (what
`fit` reads a distributed dataset with) asks whether any replica still has data, and
then picks each replica's batch, or an empty stand-in where the data ran out, in one
conditional: one op, on one device, through which every replica's batch passes (to
the first worker under HybridStrategy's steps, and back): two calls between tasks per
input tensor and worker, and the batch's bytes twice on the wire. Its
`get_next_as_optional`, which the later steps of a call with several steps read, does
the same for every dataset: an optional holds all replicas' batches on one device.

Here each worker's batch, or its empty stand-in, is picked on that worker: only each
worker's count of replicas with data (a scalar) goes to the first worker, and whether
any has data (a boolean) comes back. `get_next_per_worker` is the iterator's
`get_next` doing so (keras_integration/iterator_hooks.py makes it the `get_next` of a
HybridStrategy's iterators); `next_if_any` is the same for a step that runs only while
data is left. The batches, the empty stand-ins and the end of data
(OutOfRangeError once no replica has any) are TensorFlow's own.

```python
from hybrid_strategy.input import end_of_data
has_value, batch = end_of_data.next_if_any(iterator)   # in a tf.function
outputs = tf.cond(has_value, lambda: step(batch()), lambda: previous_outputs)
```
"""

import tensorflow as tf

# TF-private: the distributed iterator, and its helpers for one step's batch (each
# replica's value or an empty stand-in, the count of replicas with data, the
# PerReplica made of them); TensorFlow offers no public way to place them. And the
# strategy scope its get_next enters, and the cardinality of an endless dataset.
from hybrid_strategy.tensorflow_private import cardinality
from hybrid_strategy.tensorflow_private import distribute_lib
from hybrid_strategy.tensorflow_private import input_lib


def picks_per_worker(iterator):
    """Whether `get_next_per_worker` changes `iterator`'s `get_next`: a distributed
    iterator over several workers, read in a function, that checks for the end of data."""
    return iterator._enable_get_next_as_optional and _several_workers(iterator)


def get_next_per_worker(iterator, get_next, name=None):
    """`iterator.get_next(name)` with each worker's batch picked on that worker.

    `get_next(iterator, name)` is the distributed iterator's own, for a call it refuses.
    """
    with distribute_lib.enter_or_assert_strategy(iterator._strategy):
        if tf.distribute.get_replica_context() is not None:
            return get_next(iterator, name)  # its error: called inside a replica's step
        optionals, any_left = _optionals(iterator)
        values = []
        for i, worker in enumerate(iterator._input_workers.worker_devices):
            with tf.device(worker):
                values += tf.cond(
                    tf.identity(any_left),  # crosses once, not once per switch
                    lambda i=i: _value_or_empty(iterator, optionals, i),
                    # No replica has data: get_next raises OutOfRangeError.
                    lambda i=i: iterator._iterators[i].get_next_as_list())
        return _per_replica(iterator, values)


def next_if_any(iterator):
    """(whether any replica has data, a function returning the batch) for a step that
    runs only if so: `iterator.get_next_as_optional()`, but with each worker's batch
    picked on that worker when `iterator` is a distributed iterator over several."""
    if not (isinstance(iterator, input_lib.DistributedIterator)
            and _several_workers(iterator)):
        optional = iterator.get_next_as_optional()
        return optional.has_value(), optional.get_value
    with distribute_lib.enter_or_assert_strategy(iterator._strategy):
        if iterator._cardinality == cardinality.INFINITE:
            batch = iterator._get_next_no_partial_batch_handling()
            return tf.constant(True), lambda: batch
        optionals, any_left = _optionals(iterator)
        values = []
        for i, worker in enumerate(iterator._input_workers.worker_devices):
            with tf.device(worker):
                values += _value_or_empty(iterator, optionals, i)
        batch = _per_replica(iterator, values)
        return any_left, lambda: batch


def endless(iterator):
    """Whether `iterator` is a distributed iterator over an endless dataset (`repeat()`),
    whose every step has a batch: `iterator.get_next()` then checks for no end."""
    return (isinstance(iterator, input_lib.DistributedIterator)
            and iterator._cardinality == cardinality.INFINITE)


def _several_workers(iterator):
    return len(iterator._input_workers.worker_devices) > 1 and not tf.executing_eagerly()


def _optionals(iterator):
    """Each worker's optionals of its replicas' batches, and whether any has a value
    (computed on the current device: the first worker's in HybridStrategy's steps)."""
    optionals = []
    for i, worker in enumerate(iterator._input_workers.worker_devices):
        with tf.device(worker):
            optionals.append(iterator._iterators[i].get_next_as_optional_list())
    any_left = input_lib._calculate_replicas_with_values(
        iterator._strategy, iterator._input_workers, optionals) > 0
    return optionals, any_left


def _value_or_empty(iterator, optionals, i):
    """Worker i's replicas' batches, or empty stand-ins for those whose data ran out."""
    workers = iterator._input_workers
    one_worker = input_lib.InputWorkers(
        [(workers.worker_devices[i], workers.compute_devices_for_worker(i))])
    return input_lib._get_value_or_dummy(one_worker, [optionals[i]], produce_dummy=True)


def _per_replica(iterator, values):
    if iterator._replica_order is not None:
        values = iterator._reorder_replicas(values)
    return input_lib._create_per_replica(values, iterator._strategy)
