"""PS tables in one process: sharded lookups, no whole-table reads, weights and checkpoints."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import hybrid_strategy
from hybrid_strategy.sharding import rows as sharding
from hybrid_strategy.tables import sparse_optimizers
from hybrid_strategy.tables import table as table_lib

keras = tf.keras


@pytest.fixture(autouse=True)
def one_machine(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def sharded_model(rows=100, shards=3, optimizer="adagrad"):
    strategy = hybrid_strategy.HybridStrategy(table_shards={"emb": shards})
    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(4,), dtype="int32"),
            keras.layers.Embedding(rows, 8, name="emb"),
            keras.layers.Flatten(),
            keras.layers.Dense(1, name="out"),
        ])
        model.compile(optimizer=optimizer, loss="mse")
    return strategy, model


def test_lookup_stitches_rows_from_every_shard_in_order():
    whole = np.arange(20.0).reshape(10, 2)
    # Shard k holds rows k, k + 3, ...: 4, 3 and 3 rows.
    shards = [tf.Variable(whole[k::3]) for k in range(3)]
    table = table_lib.ShardedTable(shards, "t/embeddings")
    ids = np.array([[9, 0, 4], [4, 3, 7]])
    np.testing.assert_array_equal(tf.gather(table, ids).numpy(), whole[ids])
    np.testing.assert_array_equal(tf.nn.embedding_lookup(table, ids).numpy(), whole[ids])
    np.testing.assert_array_equal(tf.convert_to_tensor(table).numpy(), whole)
    assert tf.shape(table).numpy().tolist() == [10, 2]


def test_rows_standing_in_for_a_table_are_this_threads_alone():
    # Asynchronous workers trace their steps at once: the rows one thread's optimizer
    # rule reads and writes in place of a table are not what another thread reads.
    whole = np.arange(6.0, dtype="float32").reshape(3, 2)
    table = table_lib.ShardedTable([tf.Variable(whole[0::2]), tf.Variable(whole[1::2])],
                                   "t/embeddings")
    rows = sparse_optimizers.RowsView(table, [0], [tf.constant([1])])  # table row 2
    meanwhile, elsewhere = threading.Barrier(2, timeout=30), {}

    def read_elsewhere():
        meanwhile.wait()
        elsewhere["view"] = table.rows_view
        elsewhere["value"] = tf.convert_to_tensor(table).numpy()
        meanwhile.wait()

    thread = threading.Thread(target=read_elsewhere)
    thread.start()
    with table_lib.rows_standing_in([rows]):
        table.assign_add(tf.fill((1, 2), 5.0))
        meanwhile.wait()
        meanwhile.wait()
        assert table.rows_view is rows
    thread.join()
    assert elsewhere["view"] is None and table.rows_view is None
    np.testing.assert_array_equal(elsewhere["value"], whole)
    np.testing.assert_array_equal(rows.read().numpy(), whole[[2]] + 5.0)


def test_rows_are_dealt_over_the_shards_and_joined_back():
    whole = np.arange(14.0).reshape(7, 2)
    parts = sharding.split_dense(tf.constant(whole), 3)
    assert [p.numpy()[:, 0].tolist() for p in parts] == [[0, 6, 12], [2, 8], [4, 10]]
    np.testing.assert_array_equal(sharding.join_dense(parts).numpy(), whole)
    table = table_lib.ShardedTable([tf.Variable(p) for p in parts], "t/embeddings")
    np.testing.assert_array_equal(table.numpy(), whole)
    table.assign(whole + 1)
    np.testing.assert_array_equal(tf.convert_to_tensor(table).numpy(), whole + 1)
    slices = tf.IndexedSlices(tf.constant([[1.0], [2.0], [3.0]]), tf.constant([4, 3, 6]))
    local = sharding.split_slices(slices, 3)
    assert [p.indices.numpy().tolist() for p in local] == [[1, 2], [1], []]  # 3, 6 | 4 | -
    joined = sharding.join_slices(local, [7, 1])
    assert sorted(zip(joined.indices.numpy().tolist(), joined.values.numpy()[:, 0])) == [
        (3, 2.0), (4, 1.0), (6, 3.0)]


def test_shards_that_cannot_hold_dealt_rows_are_refused():
    with pytest.raises(ValueError, match=r"shards of \[3, 4\] rows"):
        table_lib.ShardedTable([tf.Variable(tf.ones((3, 2))), tf.Variable(tf.ones((4, 2)))],
                               "t/embeddings")


def test_gradient_is_one_table_wide_indexed_slices_with_rows_merged():
    table = table_lib.ShardedTable(
        [tf.Variable(tf.ones((4, 2))), tf.Variable(tf.ones((3, 2)))], "t/embeddings")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [5, 1, 5]) * [[1.0, 2.0]])
    (grad,) = tape.gradient(loss, [table])
    assert isinstance(grad, tf.IndexedSlices)
    assert grad.indices.numpy().tolist() == [5, 1]
    np.testing.assert_array_equal(grad.values.numpy(), [[2.0, 4.0], [1.0, 2.0]])


def test_a_training_step_never_reads_a_table_whole():
    strategy, model = sharded_model(rows=1000, shards=1)
    layer = model.get_layer("emb")

    @tf.function
    def lookup(ids):
        return strategy.run(layer, args=(ids,))

    graph = lookup.get_concrete_function(tf.zeros((8, 4), tf.int32)).graph
    reads = [op.name for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert reads == []


def test_sharded_table_trains_and_returns_whole_weights():
    strategy, model = sharded_model()
    table = model.get_layer("emb").embeddings.value
    assert [int(s.shape[0]) for s in table.shards] == [34, 33, 33]
    before = model.get_weights()[0]
    ids = np.array([[0, 33, 34, 99]] * 8, "int32")
    model.fit(ids, np.ones((8, 1)), batch_size=8, verbose=0)
    after = model.get_weights()[0]
    assert after.shape == (100, 8)
    changed = np.flatnonzero(np.abs(after - before).sum(axis=1))
    assert changed.tolist() == [0, 33, 34, 99]
    model.set_weights([np.zeros_like(after)] + model.get_weights()[1:])
    assert not model.get_weights()[0].any()


def test_weights_and_checkpoints_round_trip(tmp_path):
    _, model = sharded_model()
    ids = np.random.default_rng(0).integers(0, 100, (32, 4)).astype("int32")
    model.fit(ids, np.ones((32, 1)), batch_size=8, verbose=0)
    weights = model.get_weights()
    model.save_weights(str(tmp_path / "m.weights.h5"))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    _, from_h5 = sharded_model()
    from_h5.load_weights(str(tmp_path / "m.weights.h5"))
    for a, b in zip(weights, from_h5.get_weights()):
        np.testing.assert_array_equal(a, b)

    _, restored = sharded_model()
    restored.fit(ids[:8], np.ones((8, 1)), batch_size=8, verbose=0)  # builds the slots
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        path).assert_existing_objects_matched()
    for a, b in zip(weights, restored.get_weights()):
        np.testing.assert_array_equal(a, b)
    slots = [[v.numpy() for v in m.optimizer.variables if "emb" in v.path]
             for m in (model, restored)]
    assert len(slots[0]) == 1
    np.testing.assert_array_equal(slots[0][0], slots[1][0])


@pytest.mark.parametrize("make_initializer", [
    lambda: keras_initializer("RandomUniform", seed=3),
    lambda: keras_initializer("RandomNormal"),
    lambda: keras_initializer("TruncatedNormal"),
])
def test_random_initializers_draw_different_rows_for_every_shard(make_initializer):
    # A seeded Keras initializer repeats its values for a repeated shape: each shard
    # gets a seed of its own, and the same one again under the same random seed.
    def table_values():
        tf.keras.utils.set_random_seed(7)
        initializer = make_initializer()
        parts = table_lib.shard_initial_values(None, initializer, (9, 4), tf.float32, 3)
        return [part().numpy() for part in parts]

    values = table_values()
    for a in range(3):
        for b in range(a + 1, 3):
            assert not np.allclose(values[a][:3], values[b][:3]), (a, b)
    for again, first in zip(table_values(), values):
        np.testing.assert_array_equal(again, first)


def keras_initializer(name, **kwargs):
    """`tf.keras.initializers.NAME`: Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1."""
    return getattr(tf.keras.initializers, name)(**kwargs)


class ReadWrittenReadAgain(keras.layers.Layer):
    """`x * w + x * (w + 1)`, w read, incremented, and read again in one call."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        before = x * self.w
        self.w.assign_add(keras.ops.ones_like(self.w))
        return before + x * self.w


def test_a_functional_model_reads_its_whole_tables_ahead_and_anew_after_a_write():
    # architecture="ps": the Dense kernel and bias and the layer's weight are tables
    # read whole, read ahead when the model starts; the weight, written in the call,
    # is read anew after the write.
    strategy = hybrid_strategy.HybridStrategy(architecture="ps")
    with strategy.scope():
        inputs = keras.Input((3,))
        written = ReadWrittenReadAgain(name="written")
        model = keras.Model(inputs, written(keras.layers.Dense(3, name="dense")(inputs)))
    # Keras traces a model before its first step (fit's symbolic build): what its
    # layers read whole is known from then on.
    tf.function(model).get_concrete_function(tf.TensorSpec((None, 3)))
    tables = [w._value for w in model.weights]
    assert all(table_lib.is_table(t) and table_lib.reads_whole(t) for t in tables)

    @tf.function
    def call(x):
        return strategy.run(model, args=(x,))

    x = np.arange(6.0, dtype="float32").reshape(2, 3)
    kernel, bias = model.get_layer("dense").get_weights()
    dense = x @ kernel + bias
    np.testing.assert_allclose(call(x).numpy(), dense * 1 + dense * 2, rtol=1e-6)
    np.testing.assert_allclose(call(x).numpy(), dense * 2 + dense * 3, rtol=1e-6)
    np.testing.assert_array_equal(written.w.numpy(), [3.0] * 3)
    # Read ahead once, and anew after the write: two reads of the weight, where the
    # layer's own would make three (before, the increment's, after).
    graph = call.get_concrete_function(x).graph
    handle = dict((id(external), internal) for external, internal in graph.captures)[
        id(written.w._value.shards[0].handle)]
    reads = [op for op in graph.get_operations()
             if op.type == "ReadVariableOp" and op.inputs[0] is handle]
    assert len(reads) == 2, [op.name for op in reads]
