"""How a table's rows are split over its shards, and a gradient's rows with them.

Shard k of an S-shard table holds rows k, k + S, k + 2S, ...: a row's shard is its id
modulo S, its row within the shard the id divided by S. Placement sizes shards with
this, tables read and write them, communication splits and sums gradients with it.

```python
import tensorflow as tf
from hybrid_strategy.sharding import rows
print(rows.shard_rows(7, 3))                       # [3, 2, 2]
g = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([4, 1, 4]), tf.constant([7, 2]))
print([p.indices.numpy() for p in rows.split_slices(rows.merge_duplicates(g), 3)])
# [array([], dtype=int32), array([1, 0], dtype=int32), array([], dtype=int32)]
```
"""

import tensorflow as tf


def shard_rows(rows, num_shards):
    """Rows of each of `num_shards` shards of a `rows`-row table, shard k holding k::S."""
    return [len(range(k, rows, num_shards)) for k in range(num_shards)]


def split_dense(value, num_shards):
    """Splits a dense [rows, ...] tensor into the shards' rows (k::num_shards)."""
    if num_shards == 1:
        return [value]
    return [value[k::num_shards] for k in range(num_shards)]


def join_dense(parts):
    """The inverse of `split_dense`: interleaves the shards' rows into one tensor."""
    if len(parts) == 1:
        return tf.identity(parts[0])
    rows = sum(int(p.shape[0]) for p in parts)
    positions = [tf.range(k, rows, len(parts)) for k in range(len(parts))]
    return tf.dynamic_stitch(positions, parts)


def shard_of(ids, num_shards):
    """(shard, row within the shard) of each global row id."""
    return (tf.cast(ids % num_shards, tf.int32), ids // num_shards)


def split_slices(slices, num_shards):
    """Splits table-wide `IndexedSlices` into per-shard ones with local row ids."""
    if num_shards == 1:
        return [slices]
    shard, local = shard_of(slices.indices, num_shards)
    values = tf.dynamic_partition(slices.values, shard, num_shards)
    indices = tf.dynamic_partition(local, shard, num_shards)
    return [tf.IndexedSlices(v, i, None) for v, i in zip(values, indices)]


def join_slices(parts, dense_shape):
    """The inverse of `split_slices`: one `IndexedSlices` with global row ids."""
    num_shards = len(parts)
    if num_shards == 1:
        return tf.IndexedSlices(parts[0].values, parts[0].indices, dense_shape)
    return tf.IndexedSlices(
        tf.concat([p.values for p in parts], 0),
        tf.concat([p.indices * num_shards + k for k, p in enumerate(parts)], 0),
        dense_shape)


def merge_duplicates(slices):
    """Returns `slices` with each row index once and its values summed."""
    unique, positions = tf.unique(slices.indices)
    values = tf.math.unsorted_segment_sum(slices.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def concat_slices(slices_list):
    if len(slices_list) == 1:
        return slices_list[0]
    return tf.IndexedSlices(
        tf.concat([s.values for s in slices_list], 0),
        tf.concat([s.indices for s in slices_list], 0),
        slices_list[0].dense_shape,
    )


def join_shards(shard_sums, table):
    """One table-wide gradient from per-shard sums (global row ids for slices)."""
    if not isinstance(shard_sums[0], tf.IndexedSlices):
        return join_dense(shard_sums) if len(shard_sums) > 1 else shard_sums[0]
    return join_slices(shard_sums, table.shape)


def shard_summed(shard_sums, table):
    """The table-wide sum, carrying its per-shard parts for `shard_sums_of`.

    The table-wide sum is what an all-reduce promises; the update and clipping
    use the per-shard sums where they are, so the joined one is built only if
    something else reads it.
    """
    total = join_shards(shard_sums, table)
    total._hybrid_shard_sums = tuple(shard_sums)
    total._hybrid_table = table
    return total


def shard_sums_of(gradient):
    """The per-shard sums of a `shard_summed` gradient, else None."""
    return getattr(gradient, "_hybrid_shard_sums", None)


def table_of_sum(gradient):
    """The PS table of a `shard_summed` gradient."""
    return gradient._hybrid_table
