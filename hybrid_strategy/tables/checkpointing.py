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
storage and streams tables to and from Keras' h5 files, for the hooks of TensorFlow's
saver and Keras' h5 files (keras_integration/checkpoint_hooks.py).

```python
import tensorflow as tf
import hybrid_strategy
from hybrid_strategy.tables import table
hybrid_strategy.HybridStrategy()                     # installs the hooks
shards = [tf.Variable(tf.reshape(tf.range(8.0), (4, 2))), tf.Variable(tf.ones((3, 2)))]
t = table.ShardedTable(shards, "emb/embeddings")   # rows 0, 2, 4, 6 and 1, 3, 5
tf.train.Checkpoint(emb=t).write("/tmp/emb")        # two row blocks
```
"""

import functools
import os
import time

import numpy as np
import tensorflow as tf

from hybrid_strategy.tables import table as table_lib
from hybrid_strategy.tables.row_blocks import read_rows, write_rows

# Bytes of a table the chief holds at once while streaming it to or from an h5 file.
BLOCK_BYTES = 4 << 20
_PROBE_PREFIX = ".hybrid_strategy_probe"


class CheckpointStorageError(OSError):
    """A task cannot write or read the checkpoint path the chief uses."""


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
            # The probe's other op fails too; its error, left pending on the task, would
            # surface in the caller's next call there instead of here.
            tf.experimental.async_clear_error()
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


def streamed(dataset):
    """`StoredRows` of an h5 dataset large enough to be streamed (one of more than
    `BLOCK_BYTES` holding rows, not one of Keras' own typed ones), else None."""
    if (dataset is not None and getattr(dataset, "ndim", 0) >= 2
            and dataset.size * dataset.dtype.itemsize > BLOCK_BYTES
            and "dtype" not in dataset.attrs):
        return StoredRows(dataset)
    return None


def has_tables(model):
    """Whether any variable of `model` or of its optimizer is or wraps a PS table."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    variables += list(getattr(optimizer, "variables", None) or [])
    return any(table_lib.table_behind(v) is not None for v in variables)
