"""A PS table in row order, block by block: row ranges read and written across its shards.

Shard k of S holds rows k::S, so a contiguous range of table rows [start, stop) is
spread over every shard. `read_rows` slices each shard's part on its own ps and
interleaves them; `write_rows` picks each shard's rows out where the values are and
writes them on the shard's ps. `serialize` and `restore` are a table's
`tf.train.Checkpoint` entries: S contiguous row blocks sized like the shards, block j
assembled and written on shard j's ps (see checkpointing.py for the rest).

Works on anything with a table's `shards`, `num_shards`, `shape`, `dtype` and `path`,
so that table.py and checkpointing.py both build on it.

```python
import tensorflow as tf
from hybrid_strategy.tables import row_blocks
from hybrid_strategy.tables import table
shards = [tf.Variable(tf.reshape(tf.range(8.0), (4, 2))), tf.Variable(tf.ones((3, 2)))]
t = table.ShardedTable(shards, "emb/embeddings")   # rows 0, 2, 4, 6 and 1, 3, 5
print(row_blocks.read_rows(t, 2, 5))               # rows 2, 3, 4
```
"""

import contextlib

import numpy as np
import tensorflow as tf

# TF-private: `SaveSpec` is how `_serialize_to_tensors` gives a tensor built lazily on a
# device of its choice (the block, on its ps).
from hybrid_strategy.tensorflow_private import saveable_object

from hybrid_strategy.sharding.rows import shard_rows

VARIABLE_VALUE = "VARIABLE_VALUE"


def row_blocks(num_rows, num_blocks):
    """Contiguous `(start, stop)` row ranges, block j as many rows as shard j."""
    bounds = np.cumsum([0] + shard_rows(num_rows, num_blocks)).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _rows_in_range(start, stop, k, num_shards):
    """Shard k's rows within table rows [start, stop) (int64 tensors).

    Returns (offset of the first one from `start`, its row within the shard, count).
    """
    first = start + tf.math.floormod(k - start, num_shards)
    return first - start, first // num_shards, tf.maximum((stop - 1 - first) // num_shards + 1, 0)


# Reading and writing row ranges ------------------------------------------------------


def read_rows(table, start, stop):
    """Table rows [start, stop) in row order; each shard's part is sliced on its own ps.

    `start` and `stop` may be tensors (one traced function serves every block). The
    parts are interleaved where the caller's device scope puts the result.
    """
    num_shards = table.num_shards
    start, stop = tf.cast(start, tf.int64), tf.cast(stop, tf.int64)
    parts, positions = [], []
    for k, shard in enumerate(table.shards):
        offset, local, count = _rows_in_range(start, stop, k, num_shards)
        with tf.device(shard.device):
            value = tf.raw_ops.ReadVariableOp(resource=shard.handle, dtype=table.dtype)
            parts.append(value[local:local + count])
        positions.append(tf.cast(offset + num_shards * tf.range(count), tf.int32))
    return tf.dynamic_stitch(positions, parts)


def write_rows(table, start, values):
    """Writes `values`, table rows [start, start + len(values)), into the shards.

    Each shard's rows are picked out where `values` lives and written on the shard's
    own ps. Returns the assignments (None each, eagerly).
    """
    values = tf.convert_to_tensor(values, dtype=table.dtype)
    if values.shape.rank is None or values.shape[0] is None:
        raise ValueError(f"rows written into table {table.path} need a known row count.")
    start = tf.constant(start, tf.int64)
    num_shards = table.num_shards
    assignments = []
    for k, shard in enumerate(table.shards):
        offset, local, count = _rows_in_range(start, start + int(values.shape[0]), k,
                                              num_shards)
        with _on(values):
            part = values[offset:offset + count * num_shards:num_shards]
        with tf.device(shard.device):
            assignments.append(tf.raw_ops.ResourceStridedSliceAssign(
                ref=shard.handle, begin=[local], end=[local + count], strides=[1],
                value=part))
    return assignments


def _on(tensor):
    """A device scope on `tensor`'s device: a block is cut up where it is, not moved whole."""
    return tf.device(tensor.device) if tensor.device else contextlib.nullcontext()


# tf.train.Checkpoint --------------------------------------------------------------


def _block_spec(table, start, stop):
    shape = table.shape.as_list()
    return tf.Variable.SaveSliceInfo(
        full_name=table.path, full_shape=shape, var_offset=[start] + [0] * (len(shape) - 1),
        var_shape=[stop - start] + shape[1:]).spec


def serialize(table):
    """`ShardedTable._serialize_to_tensors`: the table's row blocks, each on its ps.

    A table of one shard is saved as that shard, exactly as a `tf.Variable` is.
    """
    if table.num_shards == 1:
        return table.shards[0]._serialize_to_tensors()  # pylint: disable=protected-access
    blocks = {}
    for shard, (start, stop) in zip(table.shards, row_blocks(table.shape[0], table.num_shards)):
        spec = _block_spec(table, start, stop)
        blocks[spec] = saveable_object.SaveSpec(
            lambda start=start, stop=stop: read_rows(table, start, stop), spec,
            name=table.path, dtype=table.dtype, device=shard.device)
    return {VARIABLE_VALUE: blocks}


def restore(table, restored_tensors):
    """`ShardedTable._restore_from_tensors`: deals each restored block's rows to the shards.

    `restored_tensors[VARIABLE_VALUE]` holds the blocks `serialize` asked for (by slice
    spec), or the whole table when a single tensor was restored.
    """
    restored = restored_tensors[VARIABLE_VALUE]
    if not isinstance(restored, dict):
        if table.num_shards == 1:
            shard = table.shards[0]
            return shard._restore_from_tensors(restored_tensors)  # pylint: disable=protected-access
        restored = {"": restored}
        ranges = {"": (0, table.shape[0])}
    else:
        ranges = {_block_spec(table, start, stop): (start, stop)
                  for start, stop in row_blocks(table.shape[0], table.num_shards)}
    assignments = []
    for spec, block in restored.items():
        start, stop = ranges[spec]
        with _on(block):
            block = tf.ensure_shape(block, [stop - start] + table.shape.as_list()[1:])
        assignments += write_rows(table, start, block)
    return tf.group(assignments) if not tf.executing_eagerly() else None
