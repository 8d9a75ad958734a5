"""A lock on a PS task around part of a traced step: concurrent steps take it one at a time.

Asynchronous training runs several workers' steps at once against the same PS tasks. A
dynamic table's step (dynamic_exchange.py) finds its ids on every shard of its map,
decides on the first and writes every shard: another step's writes landing between
one step's finds and its writes would give an id two rows, or lose a count. `holding`
makes the ops a block of a traced step adds wait for a `StepLock` (TensorFlow's
`MutexLock` op, which `tf.CriticalSection` is built on), and releases it once every
stateful op of the block has run, whichever task it runs on.

```python
import tensorflow as tf
from hybrid_strategy.tables import step_lock
lock = step_lock.StepLock("/cpu:0", "counter")
counter = tf.Variable(0)

@tf.function
def step():
    with step_lock.holding([lock]):
        counter.assign(counter.read_value() + 1)  # a read and a write, one step at a time

step()
print(counter.numpy())  # 1
```
"""

import contextlib
import uuid

import tensorflow as tf


class StepLock:
    """A mutex on `device`, taken by traced steps within `holding`.

    Not trackable: it holds no state to save, and a SavedModel captures none of it.
    """

    def __init__(self, device, name):
        self.device = device
        # A name of its own on the task: another process's lock of the same name is
        # another lock. Locks are taken in the order of their names.
        self.name = f"{name}_{uuid.uuid4().hex}"
        with tf.init_scope(), tf.device(device):
            self.handle = tf.raw_ops.MutexV2(shared_name=self.name)


@contextlib.contextmanager
def holding(locks, after=()):
    """Within, in a function being traced: every op made waits for every lock of `locks`,
    taken once the tensors `after` are computed (the block's inputs: a step would
    otherwise hold the locks while they come), and each lock is released once every
    stateful op made within has run.

    The locks are taken one after the other in the order of their names, so that two
    steps holding some of the same locks never wait for each other in a circle. The
    ops made within whose inputs are made outside wait for the last lock (TensorFlow
    sends a control edge to another task once per source op and task: graph_partition.cc's
    `DupRecvTable`), and the release waits for one op per device grouping that
    device's stateful ops, so that the lock crosses once each way between its task
    and each other task of the block. Outside a traced function, or with no locks,
    nothing is locked: eager ops of one caller run in order.
    """
    if not locks or not tf.inside_function():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    locks, taken = sorted(locks, key=lambda lock: lock.name), []
    for lock in locks:
        with tf.device(lock.device), tf.control_dependencies(taken[-1:] or list(after)):
            taken.append(tf.raw_ops.MutexLock(mutex=lock.handle))
    before = set(graph.get_operations())
    with tf.control_dependencies([taken[-1]]):
        yield
    made = [op for op in graph.get_operations() if op not in before]
    done = []
    # The public `op_def.is_stateful` of each op made: writes and reads of state.
    stateful = [op for op in made if op.op_def.is_stateful]
    for device in sorted({op.device for op in stateful}):
        with tf.device(device):
            done.append(tf.group(*[op for op in stateful if op.device == device]))
    for lock, held in zip(locks, taken):
        with tf.device(lock.device), tf.control_dependencies(done):
            tf.raw_ops.ConsumeMutexLock(mutex_lock=held)
