"""Each worker's version of a dataset's graph (input/input_graph.py, worker_input.shares).

Every worker's dataset is made here, on this process's CPU, from the graph a worker would
receive: stepping all of them together must give the global batches of the original
dataset (the examples each holds on one device, in the same order over the replicas),
or, where the pipeline shuffles or filters, every example once.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

from hybrid_strategy.input import input_plan
from hybrid_strategy.input import worker_input

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


def global_batches(dataset, workers, replicas=1):
    """The plan for `dataset`, and its global batches as the workers' replicas make them."""
    decided, worker_dataset = worker_input.shares(dataset, [CPU] * workers, replicas)
    assert decided.how == input_plan.SHARE, decided
    iterators = [iter(worker_dataset(w)) for w in range(workers)]
    steps = []
    while True:
        parts = [next(it, None) for it in iterators for _ in range(replicas)]
        parts = [p for p in parts if p is not None]
        if not parts:
            return decided, steps
        steps.append(tf.nest.map_structure(lambda *p: np.concatenate(p), *parts))


def flat(batches):
    return [tf.nest.map_structure(lambda t: t.tolist(), b) for b in batches]


def original(dataset):
    return flat(tf.nest.map_structure(lambda t: t.numpy(), b) for b in dataset)


@pytest.mark.parametrize("workers, replicas", [(2, 1), (3, 2), (4, 1)])
def test_in_memory_source_gives_the_global_batches_of_one_device(workers, replicas):
    features = {"ids": np.arange(101, dtype=np.int32), "x": np.arange(202.0).reshape(101, 2)}
    dataset = (tf.data.Dataset.from_tensor_slices((features, np.arange(101) % 7))
               .map(lambda f, y: (f, y * 2)).batch(24).prefetch(2))
    decided, steps = global_batches(dataset, workers, replicas)
    assert decided.slice_source
    assert flat(steps) == original(dataset)


def test_generated_source_gives_the_global_batches_of_one_device():
    dataset = tf.data.Dataset.range(50).map(lambda i: (i * 3, tf.cast(i, tf.float32))) \
        .batch(8, drop_remainder=True).map(lambda a, b: (a + 1, b))
    decided, steps = global_batches(dataset, 2)
    assert not decided.slice_source and decided.drop_remainder_at_split
    assert flat(steps) == original(dataset)
    assert len(steps) == 6


def test_repeat_of_a_multiple_of_the_global_batch_gives_one_devices_batches():
    dataset = tf.data.Dataset.from_tensor_slices(np.arange(32)).repeat().batch(16)
    _, steps = global_batches(dataset.take(7), 2)
    assert flat(steps) == original(dataset.take(7))


def test_each_worker_maps_only_its_examples(tmp_path):
    log = tmp_path / "mapped.txt"

    def logged(x):
        with tf.control_dependencies([tf.print(x, output_stream=f"file://{log}")]):
            return tf.identity(x)

    dataset = tf.data.Dataset.from_tensor_slices(np.arange(40)).map(logged).batch(8)
    _, worker_dataset = worker_input.shares(dataset, [CPU, CPU], 1)
    assert len(list(worker_dataset(1))) == 5
    calls = collections.Counter(int(line) for line in log.read_text().split())
    # Worker 1's block of each batch of 8 is its examples 4 to 7.
    assert sorted(calls) == [k for k in range(40) if k % 8 >= 4]
    assert set(calls.values()) == {1}


def test_each_worker_graph_holds_only_its_rows():
    rows = np.random.default_rng(0).normal(size=(4096, 64)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(64)
    whole = len(dataset._as_serialized_graph().numpy())  # pylint: disable=protected-access
    graph = worker_input.input_graph.DatasetGraph(dataset)
    decided = input_plan.plan(graph.pipeline(), 4, 1)
    graph.prepare(decided, seed=1)
    sizes = [len(graph.worker_graph(w)) for w in range(4)]
    assert all(size < 0.26 * whole for size in sizes)


@pytest.mark.parametrize("global_seed", [None, 7])
def test_a_shuffle_below_a_take_shuffles_alike_on_every_worker(global_seed):
    # With a global seed (keras.utils.set_random_seed), an unseeded shuffle gets op
    # seeds and a seed generator of this process.
    tf.random.set_seed(global_seed)
    try:
        dataset = tf.data.Dataset.range(100).shuffle(100).take(40).batch(8)
        _, steps = global_batches(dataset, 2)
    finally:
        tf.random.set_seed(None)
    seen = [int(x) for step in steps for x in step]
    assert len(seen) == 40 and len(set(seen)) == 40


def test_shuffle_and_filter_use_every_example_once():
    dataset = (tf.data.Dataset.from_tensor_slices(np.arange(90)).shuffle(90)
               .filter(lambda x: x % 3 > 0).batch(10))
    _, steps = global_batches(dataset, 2)
    seen = sorted(int(x) for step in steps for x in step)
    assert seen == [x for x in range(90) if x % 3 > 0]


def test_padded_batches_of_one_file(tmp_path):
    path = str(tmp_path / "records.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(30):
            writer.write(tf.io.serialize_tensor(tf.range(i % 5 + 1)).numpy())
    dataset = tf.data.TFRecordDataset([path]).map(
        lambda r: tf.ensure_shape(tf.io.parse_tensor(r, tf.int32), [None])).padded_batch(6)
    with pytest.warns(worker_input.InputShardingWarning, match="reads 1 file"):
        _, worker_dataset = worker_input.shares(dataset, [CPU, CPU], 1)
    # Each worker pads its own block: compare the examples without padding.
    parts = zip(*(worker_dataset(w) for w in range(2)))
    unpadded = [[row[row > 0].tolist() for part in step for row in part.numpy()]
                for step in parts]
    assert unpadded == [[row[row > 0].tolist() for row in batch.numpy()]
                        for batch in dataset]


def test_file_policy_with_one_file_is_refused(tmp_path):
    path = str(tmp_path / "one.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"x")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.FILE
    dataset = tf.data.TFRecordDataset([path]).batch(2).with_options(options)
    with pytest.raises(input_plan.ShardingError, match="reads 1 file"):
        worker_input.shares(dataset, [CPU, CPU], 1)


def test_many_files_are_left_to_tensorflow(tmp_path):
    paths = [str(tmp_path / f"{i}.tfrecord") for i in range(4)]
    for path in paths:
        with tf.io.TFRecordWriter(path) as writer:
            writer.write(b"x")
    dataset = tf.data.Dataset.list_files(paths).interleave(tf.data.TFRecordDataset).batch(2)
    decided, worker_dataset = worker_input.shares(dataset, [CPU, CPU], 1)
    assert decided.how == input_plan.FILES and worker_dataset is None


@pytest.mark.parametrize("structure", [lambda x: x, lambda x: (x,), lambda x: {"x": (x, x)}])
def test_replicas_of_a_worker_split_its_batches_larger_first(structure):
    batches = tf.data.Dataset.range(13).map(structure).batch(5)
    split = worker_input.split_over_replicas(batches, 2)
    assert split.element_spec == worker_input.unknown_batch_size(batches.element_spec)
    assert [tf.nest.flatten(b)[0].numpy().tolist() for b in split] == \
        [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9], [10, 11], [12]]
