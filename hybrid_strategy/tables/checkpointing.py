"""Checkpoints of PS tables: every ps task writes and reads its own rows; the chief holds none.

`tf.train.Checkpoint` (and `CheckpointManager`): a table of R rows dealt over S shards is
saved under the key a `tf.Variable` of its shape would use (`VARIABLE_VALUE`), as S
contiguous row blocks (slices of the table in row order) sized like the shards. Block j
is assembled on shard j's ps task from the rows every shard holds in its range and
written there by TensorFlow's own SaveV2 (the saver runs it on the device of the block's
`SaveSpec`). Restoring reads each block on the ps task of the shard with its number and
deals its rows to the shards that hold them. Since what is saved is the table in row
order:
- a checkpoint restores into any number of ps tasks (TensorFlow assembles any row range
  from the saved slices), on one machine, and into a plain Keras model or `tf.Variable`;
- a plain model's checkpoint restores into a table.
Every task that holds variables writes its part of the checkpoint itself, so every task
must see the checkpoint path (a shared filesystem, or gs:// / s3:// through TensorFlow's
filesystems); `CheckpointStorageError` says which task cannot.

Keras 3 `.weights.h5` / `.keras` files are written by the chief alone (one h5 file): a
table is streamed into its h5 dataset and back by blocks of `BLOCK_BYTES`, so the chief
holds one block at a time and the file stays an ordinary Keras weights file.

Row blocks themselves are read and written by row_blocks.py; this module checks the
storage and hooks TensorFlow's saver and Keras' h5 files.

```python
import tensorflow as tf
from hybrid_strategy.tables import checkpointing
from hybrid_strategy.tables import table
shards = [tf.Variable(tf.reshape(tf.range(8.0), (4, 2))), tf.Variable(tf.ones((3, 2)))]
t = table.ShardedTable(shards, "emb/embeddings")   # rows 0, 2, 4, 6 and 1, 3, 5
checkpointing.install_hooks()
tf.train.Checkpoint(emb=t).write("/tmp/emb")        # two row blocks
```
"""

import functools
import os
import time

import numpy as np
import tensorflow as tf

# TF-private: `saveable_object_util.TrackableSaveable` and `functional_saver.MultiDeviceSaver`
# are patched below (see `install_hooks`).
from tensorflow.python.checkpoint import functional_saver
from tensorflow.python.training.saving import saveable_object_util

from hybrid_strategy.tables import table as table_lib
from hybrid_strategy.tables.row_blocks import read_rows, write_rows
# Bytes of a table the chief holds at once while streaming it to or from an h5 file.
BLOCK_BYTES = 4 << 20
_PROBE_PREFIX = ".hybrid_strategy_probe"
_hooks_installed = False


class CheckpointStorageError(OSError):
    """A task cannot write or read the checkpoint path the chief uses."""


# Row arithmetic ------------------------------------------------------------------


def _restore_every_slice(original):
    """TrackableSaveable.restore that hands `_restore_from_tensors` every slice of a name.

    TensorFlow's adapter pairs one restored tensor with each local name, so a name
    saved as several slices (a table's row blocks) would get its first slice only;
    this passes `{slice_spec: tensor}` for such names, as `MultiDeviceSaver` does.
    """

    def restore_fn(self, restored_tensors, restored_shapes):
        if len(self.specs) == len(self._local_names):
            return original(self, restored_tensors, restored_shapes)
        grouped = {}
        for spec, tensor in zip(self.specs, restored_tensors):
            grouped.setdefault(spec.name, {})[spec.slice_spec] = tensor
        by_name = {}
        for local_name, slices in zip(self._local_names, grouped.values()):
            by_name[local_name] = slices[""] if list(slices) == [""] else slices
        result = self._trackable._restore_from_tensors(by_name)  # pylint: disable=protected-access
        return result if result is not None else tf.no_op()

    return restore_fn


def _remote_tasks(saver):
    """`/job:x/replica:0/task:i` of each worker or ps task writing part of `saver`'s files."""
    tasks = set()
    for task in saver._shardable_tensors_by_task:  # pylint: disable=protected-access
        if task.job in ("worker", "ps"):
            tasks.add(f"/job:{task.job}/replica:0/task:{task.task or 0}")
    return sorted(tasks)


_STORAGE_ADVICE = (
    "Every task holding variables (each ps task, and the first worker) writes and reads "
    "its own part of a checkpoint, so the checkpoint path must be storage every task of "
    "the cluster sees: a shared filesystem mounted at the same path, or gs:// / s3:// "
    "through TensorFlow's filesystems.")


def check_storage(file_prefix, tasks, mode):
    """Raises `CheckpointStorageError` unless each of `tasks` sees `file_prefix` as the chief does.

    mode "write": each task writes a probe file beside the checkpoint that the chief
    must read back; mode "read": each task must find the checkpoint's index file.
    """
    prefix = file_prefix.numpy().decode() if tf.is_tensor(file_prefix) else str(file_prefix)
    directory = os.path.dirname(prefix) or "."
    for task in tasks:
        where = f"{task}/device:CPU:0"
        name = task.replace("/job:", "").replace("/replica:0/task:", "_")
        if mode == "read":
            with tf.device(where):
                found = tf.io.matching_files(prefix + ".index")
            if int(tf.size(found)) == 0:
                raise CheckpointStorageError(
                    f"Checkpoint {prefix} is missing for task {task}, which must read its "
                    f"part of it: it finds no {prefix}.index. {_STORAGE_ADVICE}")
            continue
        probe = os.path.join(directory, f"{_PROBE_PREFIX}_{name}_{os.getpid()}_{time.time_ns()}")
        try:
            with tf.device(where):
                tf.io.write_file(probe, probe)
                # Reading the count back waits for the (asynchronous) remote write.
                written = int(tf.size(tf.io.matching_files(probe)))
        except tf.errors.OpError as error:
            raise CheckpointStorageError(
                f"Task {task} cannot write the checkpoint directory {directory}: "
                f"{error.message.splitlines()[0]}. {_STORAGE_ADVICE}") from None
        if not (written and tf.io.gfile.exists(probe)
                and tf.io.read_file(probe).numpy().decode() == probe):
            raise CheckpointStorageError(
                f"Task {task} writes the checkpoint directory {directory} on storage the "
                f"chief does not see (a file it wrote there is missing on the chief). "
                f"{_STORAGE_ADVICE}")
        tf.io.gfile.remove(probe)


def _checked(method, mode):
    """A MultiDeviceSaver method that first checks every remote task sees the path."""

    def checked(self, file_prefix, options=None):
        # With an io device, that device alone writes and reads the files.
        tasks = [] if getattr(options, "experimental_io_device", None) else _remote_tasks(self)
        if tasks and tf.executing_eagerly():
            check_storage(file_prefix, tasks, mode)
        return method(self, file_prefix, options)

    return checked


def _restore_with_shape(original):
    """Keras 3 `Variable._restore_from_tensors` given a tensor of known shape.

    On a cluster TensorFlow restores inside a tf.function, where RestoreV2's output
    has no static shape; Keras' `assign` would fail taking its length. Slices (a
    table's blocks) pass through untouched.
    """

    def restore_fn(self, restored_tensors):
        restored_tensors = {
            key: tf.ensure_shape(value, self.shape)
            if tf.is_tensor(value) and value.shape.rank is None else value
            for key, value in restored_tensors.items()}
        return original(self, restored_tensors)

    return restore_fn


def _table_of(value):
    """The ShardedTable `value` is or wraps (a Keras 3 variable), else None."""
    if table_lib.is_table(value):
        return value
    inner = getattr(value, "_value", None)
    return inner if table_lib.is_table(inner) else None



# Keras 3 h5 files -------------------------------------------------------------------


def block_rows(table):
    """Rows per streamed block: `BLOCK_BYTES` worth, at least one."""
    row_bytes = max(1, int(np.prod(table.shape.as_list()[1:])) * table.dtype.size)
    return max(1, BLOCK_BYTES // row_bytes)


def write_h5(group, key, table):
    """Writes `table` into a new dataset `group[key]`, one block of rows at a time."""
    dataset = group.create_dataset(key, shape=table.shape.as_list(),
                                   dtype=table.dtype.as_numpy_dtype)
    step = block_rows(table)
    read = _block_reader(table)
    with tf.device("/device:CPU:0"):
        for start in range(0, table.shape[0], step):
            stop = min(start + step, table.shape[0])
            dataset[start:stop] = read(tf.constant(start, tf.int64),
                                       tf.constant(stop, tf.int64)).numpy()


def _block_reader(table):
    """`read_rows` as one tf.function: a block costs one call to the cluster, not one per op."""
    return tf.function(functools.partial(read_rows, table), autograph=False,
                       input_signature=[tf.TensorSpec([], tf.int64)] * 2)


def read_h5(dataset, table):
    """Assigns an h5 dataset to `table`, one block of rows at a time."""
    if tuple(dataset.shape) != tuple(table.shape.as_list()):
        raise ValueError(
            f"The weights file holds shape {tuple(dataset.shape)} for table {table.path} "
            f"of shape {tuple(table.shape.as_list())}.")
    step = block_rows(table)
    with tf.device("/device:CPU:0"):
        for start in range(0, table.shape[0], step):
            write_rows(table, start, dataset[start:min(start + step, table.shape[0])])
            _wait_for(table)


def _wait_for(table):
    """Returns once every write sent to `table`'s shards so far has run.

    Remote eager ops run asynchronously, in order on each task: without waiting, the
    chief would read blocks faster than they are sent and hold them all meanwhile.
    """
    for shard in table.shards:
        with tf.device(shard.device):
            tf.raw_ops.VarIsInitializedOp(resource=shard.handle).numpy()


class StoredRows:
    """An h5 dataset handed to `Variable.assign` unread: a table streams it by blocks.

    Anything else reading it gets the array (`np.asarray`, indexing).
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.shape = tuple(dataset.shape)
        self.dtype = dataset.dtype

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.dataset[()], dtype=dtype)

    def __getitem__(self, index):
        return self.dataset[index]

    def __len__(self):
        return self.shape[0]


def _store_setitem(original):
    def setitem(self, key, value):
        table = _table_of(value)
        if table is None or self.mode not in ("w", "a"):
            return original(self, key, value)
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        write_h5(self._h5_entry_group, key, table)

    return setitem


def _store_getitem(original):
    def getitem(self, key):
        dataset = self._h5_entry_group.get(key) if hasattr(self._h5_entry_group, "get") else None
        if (dataset is not None and getattr(dataset, "ndim", 0) >= 2
                and dataset.size * dataset.dtype.itemsize > BLOCK_BYTES
                and "dtype" not in dataset.attrs):
            return StoredRows(dataset)
        return original(self, key)

    return getitem


def _assign_streaming(original):
    def assign(self, value):
        if isinstance(value, StoredRows):
            table = _table_of(self)
            if table is not None:
                read_h5(value.dataset, table)
                return self
            value = np.asarray(value)
        return original(self, value)

    return assign


def _optimizer_save_own_variables(self, store):
    """Keras' `BaseOptimizer.save_own_variables`, with tables passed unread to the store."""
    for i, variable in enumerate(self.variables):
        store[str(i)] = variable if _table_of(variable) is not None else variable.numpy()


def _not_in_memory_if_tables(original):
    """`.keras` files of models with tables go through a temporary h5 file on disk.

    Keras would otherwise build the whole h5 file in the chief's memory.
    """

    def is_memory_sufficient(model):
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        variables += list(getattr(optimizer, "variables", None) or [])
        if any(_table_of(v) is not None for v in variables):
            return False
        return original(model)

    return is_memory_sufficient


def install_hooks():
    """Lets TensorFlow's and Keras 3's checkpoints save and restore tables by rows.

    - TensorFlow: restore hands a table all its row blocks (`_restore_every_slice`);
      saving and restoring on a cluster first checks every task sees the path.
    - Keras 3: restoring a mirrored variable inside a tf.function gets a tensor of
      known shape; h5 files stream tables by blocks (store `__setitem__` /
      `__getitem__`, `Variable.assign`, the optimizer's `save_own_variables`), and
      `.keras` files of models with tables are built on disk, not in memory.
    """
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    saveable = saveable_object_util.TrackableSaveable
    saveable.restore = _restore_every_slice(saveable.restore)
    saver = functional_saver.MultiDeviceSaver
    saver.save = _checked(saver.save, "write")
    saver.restore = _checked(saver.restore, "read")
    try:
        import keras
        from keras.src.optimizers import base_optimizer
        from keras.src.saving import saving_lib
    except ImportError:  # tf_keras only: its tables are restored through TensorFlow's path
        return
    if not hasattr(keras, "Variable"):
        return
    keras.Variable._restore_from_tensors = _restore_with_shape(
        keras.Variable._restore_from_tensors)
    keras.Variable.assign = _assign_streaming(keras.Variable.assign)
    store = saving_lib.H5IOStore
    store.__setitem__ = _store_setitem(store.__setitem__)
    store.__getitem__ = _store_getitem(store.__getitem__)
    base_optimizer.BaseOptimizer.save_own_variables = _optimizer_save_own_variables
    saving_lib.is_memory_sufficient = _not_in_memory_if_tables(saving_lib.is_memory_sufficient)
