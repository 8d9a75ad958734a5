"""Each worker's batch stays on its worker while a step checks for the end of the data.

Before each step on a dataset of finite length, TensorFlow's distributed iterator (what
`fit` reads a distributed dataset with) asks whether any replica still has data, and
then picks each replica's batch, or an empty stand-in where the data ran out, in one
conditional: one op, on one device, through which every replica's batch passes (to
the first worker under HybridStrategy's steps, and back): two calls between tasks per
input tensor and worker, and the batch's bytes twice on the wire. `install` makes the
iterators of the strategies `applies` accepts pick each worker's batch on that worker:
only each worker's count of replicas with data (a scalar) goes to the first worker,
and whether any has data (a boolean) comes back. The batches, the empty stand-ins and
the end of data (OutOfRangeError once no replica has any) are TensorFlow's own.

```python
import tensorflow as tf
from hybrid_strategy import end_of_data
end_of_data.install(lambda strategy: True)   # HybridStrategy installs it for itself
```
"""

import tensorflow as tf

# TF-private: the distributed iterator, and its helpers for one step's batch (each
# replica's value or an empty stand-in, the count of replicas with data, the
# PerReplica made of them); TensorFlow offers no public way to place them. And the
# strategy scope its get_next enters.
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import input_lib


def install(applies):
    """Makes distributed iterators of `applies(strategy)` pick batches per worker."""
    iterator_class = input_lib.DistributedIterator
    if getattr(iterator_class.get_next, "_per_worker", False):
        return
    get_next = iterator_class.get_next

    def get_next_per_worker(self, name=None):
        if (not applies(self._strategy) or not self._enable_get_next_as_optional
                or len(self._input_workers.worker_devices) < 2 or tf.executing_eagerly()):
            return get_next(self, name)
        with distribute_lib.enter_or_assert_strategy(self._strategy):
            if tf.distribute.get_replica_context() is not None:
                return get_next(self, name)  # its error: called inside a replica's step
            return _next_per_worker(self)

    get_next_per_worker._per_worker = True
    iterator_class.get_next = get_next_per_worker


def _next_per_worker(iterator):
    workers = iterator._input_workers
    optionals = []
    for i, worker in enumerate(workers.worker_devices):
        with tf.device(worker):
            optionals.append(iterator._iterators[i].get_next_as_optional_list())
    # On the device of the step (the first worker's under HybridStrategy).
    any_left = input_lib._calculate_replicas_with_values(
        iterator._strategy, workers, optionals) > 0
    values = []
    for i, worker in enumerate(workers.worker_devices):
        one_worker = input_lib.InputWorkers(
            [(worker, workers.compute_devices_for_worker(i))])
        with tf.device(worker):
            values += tf.cond(
                tf.identity(any_left),  # crosses once, not once per switched tensor
                lambda i=i, one_worker=one_worker: input_lib._get_value_or_dummy(
                    one_worker, [optionals[i]], produce_dummy=True),
                # No replica has data: its iterator's get_next raises OutOfRangeError.
                lambda i=i: iterator._iterators[i].get_next_as_list())
    if iterator._replica_order is not None:
        values = iterator._reorder_replicas(values)
    return input_lib._create_per_replica(values, iterator._strategy)
