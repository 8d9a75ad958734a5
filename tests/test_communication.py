"""Sparse aggregation in one process: one sum per shard, every row once, counts exact."""

import numpy as np
import pytest
import tensorflow as tf

from hybrid_strategy.communication import aggregation as communication
from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.tables import table as table_lib

pytestmark = pytest.mark.cluster

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
IDS = [5, 1, 5, 2]  # a 7-row table: rows 0, 2, 4, 6 on shard 0, rows 1, 3, 5 on shard 1


def shard_sums(prefixes_per_replica):
    """Each replica looks up IDS[:n] for every n of its prefixes; returns
    {shard: {local row: summed gradient}} of `sum_sparse` over the replicas."""
    table = table_lib.ShardedTable(
        [tf.Variable(tf.ones((4, 2))), tf.Variable(tf.ones((3, 2)))], "t/embeddings")

    @tf.function
    def step(ids):
        grads = []
        for prefixes in prefixes_per_replica:
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(tf.gather(table, ids[:n])) for n in prefixes])
            grads.append(tape.gradient(loss, [table])[0])
        sums = communication.sum_sparse([(grads, table)], [CPU] * len(grads))[0]
        return [(s.indices, s.values) for s in sums]

    result = {}
    for shard, (indices, values) in enumerate(step(tf.constant(IDS))):
        indices = indices.numpy().tolist()
        assert len(indices) == len(set(indices)), f"shard {shard} repeats rows {indices}"
        result[shard] = {i: v.tolist() for i, v in zip(indices, values.numpy())}
    return result


@pytest.mark.parametrize("prefixes_per_replica, counts", [
    # One lookup.
    ([[4]], {1: 1, 2: 1, 5: 2}),
    # Two lookups of one table in a step: the tape concatenates their rows.
    ([[4, 2]], {1: 2, 2: 1, 5: 3}),
    # Two replicas on one host.
    ([[4], [4]], {1: 2, 2: 2, 5: 4}),
])
def test_sum_sparse_sums_every_row_once_per_shard(prefixes_per_replica, counts):
    sums = shard_sums(prefixes_per_replica)
    expected = {0: {}, 1: {}}
    for row, count in counts.items():
        shard, local = row % 2, row // 2
        expected[shard][local] = [float(count)] * 2
    assert sums == expected


def test_merge_duplicates_sums_repeated_rows():
    slices = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([3, 0, 3]),
                              tf.constant([5, 1]))
    merged = sharding.merge_duplicates(slices)
    assert merged.indices.numpy().tolist() == [3, 0]
    np.testing.assert_array_equal(merged.values.numpy(), [[5.0], [2.0]])


def test_gpu_workers_of_a_cluster_all_reduce_with_nccl():
    gpus = [f"/job:worker/replica:0/task:{i}/device:GPU:0" for i in (0, 1)]
    nccl = tf.distribute.experimental.CommunicationImplementation.NCCL
    assert communication.dense_options(gpus, on_cluster=True).implementation == nccl
    # TensorFlow's own choice stands on one machine (NCCL, or RING for virtual
    # GPUs), for CPU workers (RING) and for mixed devices.
    assert communication.dense_options(gpus, on_cluster=False) is None
    cpus = [g.replace("GPU", "CPU") for g in gpus]
    assert communication.dense_options(cpus, on_cluster=True) is None
    assert communication.dense_options([gpus[0], cpus[1]], on_cluster=True) is None
