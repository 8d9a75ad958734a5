"""Numpy arrays and in-memory tensors given to `fit`, each worker receiving only its share.

Keras turns arrays into a dataset that holds them whole as a graph constant, which
TensorFlow serializes and sends to every worker: several copies of the arrays on this
process, every worker holding them all, and no more than 2 GiB in all (a GraphDef's
limit). Under a HybridStrategy with a cluster, `distribute_arrays` instead sends each
worker its rows, in chunks of at most `CHUNK_BYTES` (so this process holds one chunk at
a time beside the arrays), as tensors that live on that worker; each worker then
gathers its batches from them. A worker's rows are its blocks of every global batch
(input_plan.worker_rows): without shuffling, each global batch holds the rows it holds
on one device, in the same order over the replicas; with `shuffle=True`, each worker
shuffles its own rows at every epoch (one shuffle per worker, not one global shuffle),
and `shuffle="batch"` shuffles within each worker's block of a batch.

```python
dataset = distribute_arrays(strategy.extended.input_hosts,
                            strategy.distribute_datasets_from_function, (x, y),
                            batch_size=64, shuffle=True)
model.fit(dataset, epochs=3)       # what Keras does with fit(x, y, batch_size=64)
```
"""

import numpy as np
import tensorflow as tf

# TF-private: waits until this process's asynchronous eager operations are done.
from hybrid_strategy.tensorflow_private import context

from hybrid_strategy.input import input_graph
from hybrid_strategy.input import input_plan
from hybrid_strategy.input import worker_input

CHUNK_BYTES = 64 << 20


def supported(arrays):
    """Whether every leaf of `arrays` is None, a numpy array or a dense in-memory tensor."""
    def dense(leaf):
        if leaf is None or isinstance(leaf, np.ndarray):
            return True
        return (isinstance(leaf, tf.Tensor) and not isinstance(leaf, tf.SparseTensor)
                and tf.executing_eagerly())
    return all(dense(leaf) for leaf in tf.nest.flatten(arrays))


def distribute_arrays(hosts, distribute_from_function, arrays, batch_size, shuffle, passes=1,
                      transform=None, floatx="float32"):
    """A distributed dataset of `arrays`' rows in global batches of `batch_size`.

    Args:
        hosts: `(input device, its replicas' devices)` of every worker of a
            HybridStrategy whose replicas span workers.
        distribute_from_function: The strategy's `distribute_datasets_from_function`.
        arrays: A structure of arrays (numpy, tensors; None leaves stay None) with the
            same number of rows: Keras' (x, y, sample_weight).
        batch_size: The global batch size.
        shuffle: False, True (each worker shuffles its rows at every pass) or "batch".
        passes: Passes over the rows each iteration of the dataset makes (tf_keras
            iterates once over all epochs).
        transform: A function applied to each worker's batches (tf_keras class weights).
        floatx: The dtype float arrays are given (Keras' floatx).
    """
    leaves = tf.nest.flatten(arrays)
    rows = {len(leaf) for leaf in leaves if leaf is not None}
    if len(rows) != 1:
        raise ValueError(f"HybridStrategy: the arrays have different numbers of rows "
                         f"({sorted(rows)}); give every array one row per example.")
    num_rows = rows.pop()
    replicas = len(hosts[0][1])
    worker_batches = input_plan.worker_batch_sizes(batch_size, len(hosts), replicas)

    def worker_dataset(input_context):
        worker = input_context.input_pipeline_id
        starts, lengths = input_plan.worker_rows(
            num_rows, batch_size, worker, len(hosts), replicas, drop_remainder=False)
        share = [None if leaf is None else _send(_as_numpy(leaf), starts, lengths,
                                                 hosts[worker][0], floatx)
                 for leaf in leaves]
        dataset = _batches(tf.nest.pack_sequence_as(arrays, share), sum(lengths),
                           worker_batches[worker], shuffle, passes)
        if transform is not None:
            dataset = dataset.map(transform)
        return worker_input.split_over_replicas(dataset, replicas).prefetch(
            tf.data.AUTOTUNE)

    return distribute_from_function(worker_dataset)


def _as_numpy(leaf):
    """`leaf` as a numpy array: a view of a numpy array or an in-memory tensor."""
    array = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)
    return array.astype(str) if array.dtype == object else array


def _send(array, starts, lengths, device, floatx):
    """The rows (starts, lengths) of `array` as one tensor on `device`, sent in chunks.

    Floats are cast to `floatx` chunk by chunk, as Keras casts them.
    """
    dtype = floatx if np.issubdtype(array.dtype, np.floating) else array.dtype
    chunk_rows = max(1, CHUNK_BYTES // max(1, array[:1].nbytes))
    chunks = []
    for blocks in _chunks(starts, lengths, chunk_rows):
        local = tf.constant(input_graph.take_rows(array, *zip(*blocks)).astype(
            dtype, copy=False))
        with tf.device(device):
            chunks.append(tf.identity(local))
        # The copy must be done before the next chunk is made: one chunk at a time here.
        context.async_wait()
        del local
    with tf.device(device):
        if not chunks:
            return tf.zeros((0,) + array.shape[1:], dtype=dtype)
        return chunks[0] if len(chunks) == 1 else tf.concat(chunks, axis=0)


def _chunks(starts, lengths, chunk_rows):
    """The blocks (start, length) cut into lists of blocks of `chunk_rows` rows in all
    (the last fewer), in order: a block longer than that is split."""
    blocks, size = [], 0
    for start, length in zip(starts, lengths):
        while length:
            take = min(length, chunk_rows - size)
            blocks.append((start, take))
            start, length, size = start + take, length - take, size + take
            if size == chunk_rows:
                yield blocks
                blocks, size = [], 0
    if blocks:
        yield blocks


def _batches(share, num_rows, batch_size, shuffle, passes):
    """The worker's batches of `batch_size` rows of `share` (tensors on the worker)."""
    def index_batches(_):
        indices = tf.range(num_rows, dtype=tf.int64)
        if shuffle and shuffle != "batch":
            indices = tf.random.shuffle(indices)
        full = num_rows // batch_size
        batches = tf.data.Dataset.from_tensor_slices(
            tf.reshape(indices[:full * batch_size], [full, batch_size]))
        if num_rows % batch_size:
            batches = batches.concatenate(
                tf.data.Dataset.from_tensors(indices[full * batch_size:]))
        return batches

    indices = tf.data.Dataset.range(passes).flat_map(index_batches)
    if shuffle == "batch":
        indices = indices.map(tf.random.shuffle)

    def gather(batch):
        # Workers end with batches of different sizes: the batch dimension is unknown.
        batch = tf.compat.v1.placeholder_with_default(batch, [None])
        return tf.nest.map_structure(
            lambda t: None if t is None else tf.gather(t, batch), share)

    dataset = indices.map(gather, num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    # As Keras does for arrays: the rows are captured by the map, and optimizing the
    # pipeline would serialize them into a graph.
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_external_state_policy = (
        tf.data.experimental.ExternalStatePolicy.IGNORE)
    return dataset.with_options(options)
