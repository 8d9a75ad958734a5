"""DynamicEmbedding: raw-id tables with admission and eviction, exact on a cluster.

In this process: steps holding a table's lock (asynchronous training) run their blocks
one at a time; one asynchronous worker trains as one device stepping in order; the id ->
row map's decisions (admission at `min_count`, LRU and
LFU eviction, ages, a bounded memory under ids that never repeat), waiting ids
counted in a sketch (admissions against exact counting on a Zipf stream, within the
stated error; a fixed size; checkpoints restored over other shard counts), the layer's
vectors for single- and multi-hot inputs against numpy, rows and optimizer slots
reset on admission, weights files restored over another number of map shards, and
errors. On real clusters of 2 workers and 2 ps (tests/dynamic_scenario.py, Keras 3
and tf_keras): every id's count, last step, row and optimizer slots match training
on one device, with admissions and evictions on, one table's waiting ids counted
exactly and the other's in a sketch that halves its counts (the same sketch as one
device's), also read from sharded TFRecord files, each worker its own (exports of every
placement are served in tests/test_serving.py), both tables crossing in one tensor
per pair of tasks and direction in a step; a save in the middle of an epoch on 2 ps
(Keras 3 weights file restored onto 1 and onto 3 ps, tf_keras TensorFlow checkpoint onto
3) ends training exactly where the uninterrupted run ended, the sketch included
(tests/dynamic_checkpoint_scenario.py). tf_keras runs two of the optimizer cases.
"""

import functools
import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from runs import Runs, json_report, on_cluster

keras = tf.keras

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dynamic_scenario.py")
CHECKPOINT_SCRIPT = os.path.join(HERE, "dynamic_checkpoint_scenario.py")
TOLERANCE = 1e-5
PS = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]


def _layers():
    from hybrid_strategy.layers import DynamicEmbedding
    from hybrid_strategy.tables import dynamic
    return DynamicEmbedding, dynamic


def _remap(**kwargs):
    _, dynamic = _layers()
    return dynamic.Remap(devices=["/cpu:0"] * kwargs.pop("shards", 1), **kwargs)


def _train(remap, ids, reset=None):
    _, dynamic = _layers()
    keys = dynamic.keys_of(tf.constant(ids, tf.int64))
    distinct, position, counts = tf.unique_with_counts(keys, out_idx=tf.int64)
    rows = remap.train(distinct, counts, reset or (lambda rows, keys: []))
    return tf.gather(rows, position).numpy()


def _held(remap):
    snapshot = remap.snapshot()
    return {int(k): tuple(int(x) for x in v)
            for k, v in zip(snapshot["keys"], snapshot["values"])}


# The id -> row map --------------------------------------------------------------------


def test_steps_holding_a_lock_run_their_blocks_one_at_a_time():
    # A read, a pause and a write of a counter, by two threads' steps at once: under
    # the lock no step's write is lost, and each step releases it (none waits forever).
    from hybrid_strategy.tables import step_lock

    lock = step_lock.StepLock("/cpu:0", "counter")
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        with step_lock.holding([lock]):
            paused = tf.numpy_function(lambda v: (time.sleep(0.002), v)[1],
                                       [counter.read_value()], tf.int64)
            counter.assign(paused + 1)

    def steps():
        for _ in range(25):
            step()

    step()  # traced once, before the threads
    threads = [threading.Thread(target=steps) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a step never got the lock"
    assert int(counter.numpy()) == 51


def test_an_id_gets_a_row_at_its_min_count_th_sighting():
    remap = _remap(capacity=8, min_count=3)
    assert list(_train(remap, [5, 5, 6])) == [-1, -1, -1]
    rows = _train(remap, [5, 6, 7])
    assert rows[0] >= 0 and list(rows[1:]) == [-1, -1]
    assert _held(remap)[5][1:] == (3, 2)   # count 3, last seen at step 2
    assert _held(remap)[6] == (-1, 2, 2)


@pytest.mark.parametrize("policy, evicted", [("lru", 1), ("lfu", 2)])
def test_rows_run_out_the_policy_picks_whom_to_evict(policy, evicted):
    remap = _remap(capacity=3, policy=policy, headroom=0)
    _train(remap, [1, 1, 1, 2])   # step 1: 1 seen three times, 2 once
    _train(remap, [3])            # step 2: every row taken
    _train(remap, [2, 3])         # step 3: 1 is the oldest, 2 and 3 the least seen
    assert min(_train(remap, [4])) >= 0
    held = _held(remap)
    assert sorted(held) == sorted({1, 2, 3, 4} - {evicted}), held
    assert int(remap.evictions.numpy()) == 1
    assert sorted(v[0] for v in held.values()) == [0, 1, 2]


def test_ids_seen_in_the_step_are_never_evicted_for_it():
    remap = _remap(capacity=2, headroom=0)
    _train(remap, [1, 2])
    rows = _train(remap, [1, 2, 3])   # no row for 3 without evicting 1 or 2
    assert rows[2] == -1 and min(rows[:2]) >= 0
    assert sorted(_held(remap)) == [1, 2, 3]   # 3 waits, counted
    assert min(_train(remap, [3])) >= 0


def test_ids_unseen_for_max_age_steps_are_evicted():
    remap = _remap(capacity=10, max_age=2)
    _train(remap, [1, 2])
    for _ in range(4):
        _train(remap, [2])
    assert sorted(_held(remap)) == [2]
    assert int(remap.num_free.numpy()) == 9


def test_memory_stays_bounded_under_ids_that_never_repeat():
    remap = _remap(capacity=64, min_count=2, shards=2)
    for step in range(60):
        _train(remap, np.arange(step * 50, step * 50 + 50) * 7919 - 2**40)
        entries = sum(int(t.size().numpy()) for t in remap.shards)
        # At most the capacity of ids waiting for admission, beside the admitted.
        assert entries <= 64 + 64, (step, entries)
    assert int(remap.admissions.numpy()) == 0   # nothing seen twice


def test_decisions_do_not_depend_on_the_order_of_ids_or_the_number_of_shards():
    ids = np.random.default_rng(0).integers(-2**63 + 2, 2**63 - 1, 40, dtype=np.int64)
    stream = [np.concatenate([ids[k:k + 12], ids[:3]]) for k in range(0, 28, 4)]
    # More new ids than rows in every step: which ones get rows must not depend on
    # their order.
    one, three = _remap(capacity=9, headroom=1), _remap(capacity=9, headroom=1, shards=3)
    for batch in stream:
        _train(one, batch)
        _train(three, batch[::-1])
    assert {k: v[1:] for k, v in _held(one).items()} == {
        k: v[1:] for k, v in _held(three).items()}
    assert ({k for k, v in _held(one).items() if v[0] >= 0}
            == {k for k, v in _held(three).items() if v[0] >= 0})


# Waiting ids counted in a sketch ------------------------------------------------------


def _zipf_stream(keys, steps=60, batch=400, seed=0):
    """Batches of ids whose ranks follow Zipf(1.1) over a million ids: int64 ids with
    only their high bits set, or strings."""
    ranks = np.random.default_rng(seed).zipf(1.1, (steps, batch)) % 1_000_000
    if keys == "int64":
        return [r.astype(np.int64) << 32 for r in ranks]
    return [np.array([f"id-{r}" for r in batch_ranks]) for batch_ranks in ranks]


def _first_admissions(remap, stream):
    """{key: the step its id got a row at} over the stream."""
    _, dynamic = _layers()
    first = {}
    for step, ids in enumerate(stream):
        keys = dynamic.keys_of(tf.constant(ids))
        distinct, _, counts = tf.unique_with_counts(keys, out_idx=tf.int64)
        rows = remap.train(distinct, counts, lambda rows, keys: []).numpy()
        for key, row in zip(distinct.numpy(), rows):
            if row >= 0:
                first.setdefault(int(key), step)
    return first


@pytest.mark.parametrize("keys", ["int64", "string"])
def test_a_sketch_admits_as_exact_counting_does_within_its_stated_error(keys):
    # A Zipf stream of 24,000 sightings of 11,625 distinct ids, min_count 2, rows for
    # every id admitted; exact counting forgets no waiting id, and the sketch, sized for
    # 12,000, fills up to near its limit but never halves: no count is below the exact one.
    stream = _zipf_stream(keys)
    error = 0.05
    exact = _remap(capacity=2_000, min_count=2, max_waiting=20_000)
    counted = _remap(capacity=2_000, min_count=2, max_waiting=12_000, admission="sketch",
                     admission_error=error)
    by_exact, by_sketch = _first_admissions(exact, stream), _first_admissions(counted, stream)
    assert int(counted.sketch.halvings.numpy()) == 0
    # Never later than exact counting; earlier only for ids seen fewer than min_count
    # times, each with odds of at most `error`.
    assert all(by_sketch.get(key, 10**9) <= step for key, step in by_exact.items())
    early = sum(1 for key, step in by_sketch.items() if step < by_exact.get(key, 10**9))
    _, dynamic = _layers()
    seen = len(np.unique(dynamic.keys_of(tf.constant(np.concatenate(stream))).numpy()))
    assert seen - len(by_exact) > 10_000 and int(counted.sketch.occupied.numpy()) > (
        0.9 * counted.sketch.limit)
    assert 0 < early <= error * (seen - len(by_exact)), (early, seen, len(by_exact))
    # No map entry for a waiting id: the map holds the admitted ids alone.
    assert int(counted.shards[0].size().numpy()) == len(by_sketch)
    assert int(exact.shards[0].size().numpy()) == seen


def test_a_sketch_keeps_a_fixed_size_and_its_error_under_ids_that_never_repeat():
    _, dynamic = _layers()
    remap = _remap(capacity=4000, min_count=3, max_waiting=500, admission="sketch",
                   admission_error=0.01)
    sketch = remap.sketch
    # 7 rows of 704 two-bit counters (704: 500 / -ln(1 - 0.01 ** (1 / 7)), to a word),
    # and two int64s.
    assert (sketch.depth, sketch.width, sketch.bits) == (7, 704, 2)
    assert sketch.nbytes == 7 * 704 * 2 // 8 + 16 == dynamic.sketch_lib.nbytes(500, 3, 0.01)
    early = 0
    for step in range(40):
        ids = (np.arange(step * 100, step * 100 + 100) * 7919 - 2**40).astype(np.int64)
        early += int(np.sum(_train(remap, np.repeat(ids, 2)) >= 0)) // 2   # each seen twice
        assert int(sketch.occupied.numpy()) <= sketch.limit
        # The map holds admitted ids alone, and the sketch the same words.
        assert int(remap.shards[0].size().numpy()) == early
        assert sketch.words.shape == [7 * 704 // 32]
    assert int(sketch.halvings.numpy()) >= 4   # about every 500 new ids
    assert early <= 0.01 * 4000, early


@pytest.mark.parametrize("min_count,bits", [(3, 2), (10, 4), (200, 8), (60_000, 16)])
def test_a_sketch_halves_its_counters_as_arithmetic_does_at_every_width(min_count, bits):
    # Random counters, most of them nonzero: every counter halved as many times as it
    # takes to bring the nonzero ones down to the limit, at least once.
    _, dynamic = _layers()
    counts = dynamic.sketch_lib.WaitingSketch(max_waiting=3000, min_count=min_count,
                                              error=0.01, device="/cpu:0", name="s")
    assert counts.bits == bits
    rng = np.random.default_rng(bits)
    counters = rng.integers(0, 2**bits, (counts.words.shape[0], 64 // bits), np.uint64)
    counters[rng.random(counters.shape) < 0.2] = 0
    counters[:, 0] = 2**bits - 1   # with these, the widths take 1, 3, 7 and 16 halvings
    shifts = np.arange(64 // bits, dtype=np.uint64) * np.uint64(bits)
    counts.words.assign(np.bitwise_or.reduce(counters << shifts, 1).view(np.int64))
    times = max(1, sum(int(np.sum(counters >> np.uint64(h) > 0)) > counts.limit
                       for h in range(bits + 1)))
    assert int(counts._halve()) == times
    halved = counters >> np.uint64(times)
    np.testing.assert_array_equal(
        counts.words.numpy(), np.bitwise_or.reduce(halved << shifts, 1).view(np.int64))
    assert int(counts.occupied.numpy()) == np.sum(halved > 0)
    assert int(counts.halvings.numpy()) == times


def test_a_sketch_restores_onto_another_number_of_shards_and_goes_on_alike(tmp_path):
    stream = _zipf_stream("int64", steps=16, batch=200, seed=1)

    def made(shards):
        return _remap(capacity=16, min_count=3, max_waiting=400, admission="sketch",
                      admission_error=0.02, shards=shards)

    two, three = made(2), made(3)
    _first_admissions(two, stream[:8])
    assert int(two.sketch.halvings.numpy()) > 0 and int(two.evictions.numpy()) > 0
    path = tf.train.Checkpoint(remap=two).write(str(tmp_path / "remap"))
    tf.train.Checkpoint(remap=three).read(path).assert_consumed()
    snapshot = two.snapshot()
    for remap in (two, three):
        _first_admissions(remap, stream[8:])
    assert _held(three) == _held(two)
    for name, value in two.snapshot().items():
        if name.startswith("sketch"):
            np.testing.assert_array_equal(three.snapshot()[name], value)
    with pytest.raises(ValueError, match="saved with admission='exact'"):
        made(1).restore(_remap(capacity=16, min_count=3).snapshot())
    with pytest.raises(ValueError, match="saved with admission='sketch'"):
        _remap(capacity=16, min_count=3).restore(snapshot)
    with pytest.raises(ValueError, match="same max_waiting, admission_error and min_count"):
        _remap(capacity=16, min_count=3, max_waiting=4000, admission="sketch").restore(
            snapshot)


# The layer ------------------------------------------------------------------------------


def _layer(**kwargs):
    DynamicEmbedding, _ = _layers()
    layer = DynamicEmbedding(**{"output_dim": 3, "capacity": 16, **kwargs})
    layer.build()
    return layer


def test_vectors_of_single_hot_ids_are_their_rows_and_unknown_ids_zeros():
    layer = _layer(min_count=2)
    ids = tf.constant([[11], [2**62], [11]], tf.int64)
    first = layer(ids, training=True).numpy()
    assert first.shape == (3, 1, 3)
    np.testing.assert_array_equal(first[1], 0)           # 2**62 seen once: no row
    assert np.abs(first[0]).max() > 0                   # 11 seen twice: its fresh row
    np.testing.assert_array_equal(first[0], first[2])
    # Prediction reads without counting: 2**62 still has no row.
    np.testing.assert_array_equal(layer(ids).numpy(), first)
    assert layer.table_stats()["admissions"] == 1


def test_an_ids_initial_row_is_the_same_wherever_it_lands():
    a, b = _layer(seed=4), _layer(seed=4)
    a(tf.constant([1, 2, 3], tf.int64), training=True)
    b(tf.constant([3, 9], tf.int64), training=True)
    np.testing.assert_array_equal(a(tf.constant([3], tf.int64)), b(tf.constant([3], tf.int64)))
    values = a(tf.constant([1, 2, 3], tf.int64)).numpy()
    assert np.abs(values).max() <= 0.05 and len({tuple(v) for v in values}) == 3


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_multi_hot_padded_and_ragged_inputs_combine_as_numpy_does(combiner):
    layer = _layer(key_dtype="string", combiner=combiner, pad_id="")
    padded = tf.constant([["a", "b", ""], ["b", "", ""], ["", "", ""]])
    out = layer(padded, training=True).numpy()
    single = {k: layer(tf.ragged.constant([[k]])).numpy()[0] for k in "ab"}
    scale = {"sum": 1.0, "mean": 0.5, "sqrtn": 2 ** -0.5}[combiner]
    np.testing.assert_allclose(out[0], (single["a"] + single["b"]) * scale, rtol=1e-6)
    np.testing.assert_allclose(out[1], single["b"], rtol=1e-6)
    np.testing.assert_array_equal(out[2], 0)
    ragged = layer(tf.ragged.constant([["a", "b"], ["b"], []])).numpy()
    np.testing.assert_allclose(ragged, out, rtol=1e-6)


def test_gradients_reach_admitted_rows_once_each_and_skip_waiting_ids():
    layer = _layer(min_count=2)
    ids = tf.constant([7, 7, 8, 7], tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True))
    grad = tape.gradient(loss, layer.embeddings)
    assert isinstance(grad, tf.IndexedSlices)
    (row,) = layer.remap.lookup(tf.constant([7], tf.int64)).numpy()
    assert list(grad.indices.numpy()) == [row]           # 8 waits: no gradient
    np.testing.assert_array_equal(grad.values.numpy(), np.full((1, 3), 3.0))


def test_an_evicted_id_comes_back_with_a_fresh_row_and_fresh_slots():
    DynamicEmbedding, _ = _layers()
    # The id's gradient depends on its own row alone: the same step from a fresh
    # row and fresh Adagrad accumulators gives the same row again.
    model = keras.Sequential([keras.Input((1,), dtype="int64"),
                              DynamicEmbedding(2, capacity=2, name="ids", seed=1),
                              keras.layers.Flatten(),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                                 trainable=False)])
    model.compile(optimizer=keras.optimizers.Adagrad(0.5, initial_accumulator_value=0.25),
                  loss="mse")
    layer = model.get_layer("ids")
    five = tf.constant([[5]], tf.int64)
    np.testing.assert_array_equal(layer(five).numpy(), 0)   # no row yet
    model.fit(np.array([[5]]), np.ones((1, 1)), verbose=0)
    first = layer(five).numpy()
    model.fit(np.array([[6], [7]]), np.ones((2, 1)), batch_size=2, verbose=0)  # evicts 5
    np.testing.assert_array_equal(layer(five).numpy(), 0)
    model.fit(np.array([[5]]), np.ones((1, 1)), verbose=0)   # evicts 6; 5 from scratch
    assert layer.table_stats()["evictions"] == 2
    np.testing.assert_allclose(layer(five).numpy(), first, rtol=1e-6)
    assert np.abs(first).max() > 0


def test_a_subclassed_model_trains_and_saves_its_tables(tmp_path):
    DynamicEmbedding, _ = _layers()

    class Tower(keras.Model):
        def __init__(self):
            super().__init__()
            self.ids = DynamicEmbedding(4, capacity=8, min_count=2, combiner="mean")
            self.out = keras.layers.Dense(1)

        def call(self, inputs, training=None):
            return self.out(self.ids(inputs, training=training))

    model = Tower()
    model.compile(optimizer="adagrad", loss="mse")
    x = np.repeat(np.arange(12)[:, None] * 10**15, 2, axis=1)   # each row: one id twice
    model.fit(x, np.ones((12, 1)), batch_size=4, epochs=2, verbose=0)
    stats = model.ids.table_stats()
    assert stats["admissions"] > 8 and stats["evictions"] > 0 and stats["steps"] == 6
    path = str(tmp_path / "tower.weights.h5")
    model.save_weights(path)
    again = Tower()
    again(x[:1])
    again.load_weights(path)
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize("admission", ["exact", "sketch"])
def test_weights_files_restore_onto_another_number_of_map_shards(tmp_path, admission):
    DynamicEmbedding, dynamic = _layers()
    options = {"min_count": 2, "admission": admission, "max_waiting": 20}

    def model():
        return keras.Sequential([keras.Input((2,), dtype="int64"),
                                 DynamicEmbedding(4, capacity=20, name="ids", combiner="sum",
                                                  **options),
                                 keras.layers.Dense(1)])

    saved = model()
    saved.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(1).integers(0, 30, (64, 2)) * 10**12
    saved.fit(x, np.ones((64, 1)), batch_size=8, verbose=0)
    path = str(tmp_path / "dynamic.weights.h5")
    saved.save_weights(path)
    restored = model()
    layer = restored.get_layer("ids")
    layer.remap = dynamic.Remap(20, ["/cpu:0"] * 3, **options)
    restored.load_weights(path)
    np.testing.assert_allclose(restored.predict(x, verbose=0), saved.predict(x, verbose=0),
                               rtol=1e-6)
    assert layer.table_stats() == {**saved.get_layer("ids").table_stats(),
                                   "rows_in_use": layer.table_stats()["rows_in_use"]}
    assert sum(layer.table_stats()["rows_in_use"]) == sum(
        saved.get_layer("ids").table_stats()["rows_in_use"])
    # The waiting ids' counts came back too: the next step admits the same ids.
    later = np.random.default_rng(2).integers(0, 30, (8, 2)) * 10**12
    restored.compile(optimizer="adam", loss="mse")
    for trained in (saved, restored):
        trained.fit(later, np.ones((8, 1)), batch_size=8, verbose=0)
    assert _held(layer.remap) == _held(saved.get_layer("ids").remap)


def test_tensorflow_checkpoints_restore_the_map_onto_another_number_of_shards(tmp_path):
    ids = np.arange(40) * 1_000_003 - 2**50
    two, three = _remap(capacity=16, min_count=2, shards=2), _remap(
        capacity=16, min_count=2, shards=3)
    for k in range(0, 40, 8):   # six ids admitted a step (seen twice), two left waiting
        _train(two, np.concatenate([np.repeat(ids[k:k + 6], 2), ids[k + 6:k + 8]]))
    assert int(two.evictions.numpy()) > 0
    path = tf.train.Checkpoint(remap=two).write(str(tmp_path / "remap"))
    tf.train.Checkpoint(remap=three).read(path).assert_consumed()
    assert _held(three) == _held(two)
    assert sorted(three.snapshot()["free"]) == sorted(two.snapshot()["free"])
    later = np.repeat(ids[:12], 2)
    np.testing.assert_array_equal(_train(three, later) >= 0, _train(two, later) >= 0)
    assert {k: v[1:] for k, v in _held(three).items()} == {
        k: v[1:] for k, v in _held(two).items()}


def test_a_functional_models_tables_train_together_as_they_train_one_by_one(monkeypatch):
    import hybrid_strategy
    from hybrid_strategy.tables import dynamic_exchange

    DynamicEmbedding, _ = _layers()

    def model():
        a, b, c, d = (keras.Input((1,), dtype="int64", name=n) for n in "abcd")
        shared = DynamicEmbedding(3, capacity=6, min_count=2, name="shared", seed=1)
        parts = [DynamicEmbedding(3, capacity=5, eviction="lfu", name="a_table", seed=2)(a),
                 DynamicEmbedding(3, capacity=4, max_age=3, name="b_table", seed=3)(b),
                 shared(c), shared(d)]   # called twice: trained call by call
        x = keras.layers.Concatenate()([keras.layers.Flatten()(p) for p in parts])
        built = keras.Model([a, b, c, d], keras.layers.Dense(1)(x))
        built.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        return built

    exchanges = []
    train = dynamic_exchange.train
    monkeypatch.setattr(dynamic_exchange, "train", lambda tables, **kwargs: exchanges.append(
        sorted(t.remap.name for t in tables)) or train(tables, **kwargs))
    rng = np.random.default_rng(0)
    x = [rng.integers(0, 12, (64, 1)) * 10**12 for _ in range(4)]
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    alone = model()
    weights = alone.get_weights()
    alone.fit(x, y, batch_size=8, verbose=0)
    exchanges.clear()
    with hybrid_strategy.HybridStrategy().scope():
        together = model()
    together.set_weights(weights)
    together.fit(x, y, batch_size=8, verbose=0)
    assert ["a_table_remap", "b_table_remap"] in exchanges, exchanges
    assert ["shared_remap"] in exchanges, exchanges
    for name in ("a_table", "b_table", "shared"):
        assert _held(together.get_layer(name).remap) == _held(alone.get_layer(name).remap)
        assert together.get_layer(name).table_stats() == alone.get_layer(name).table_stats()
    np.testing.assert_allclose(together.predict(x, verbose=0), alone.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_one_asynchronous_worker_trains_as_one_device_stepping_in_order(tmp_path):
    # One worker's steps run one after the other, each deciding for its own batch: ids,
    # counts, last steps, the sketch, rows, Adagrad's slots and the dense weights of
    # dynamic_scenario's model (admissions and evictions on) are one device's. Its
    # export serves, and its weights file restores, the trained model's predictions.
    import hybrid_strategy
    import dynamic_scenario
    import optimizer_references as references

    keras.utils.set_random_seed(3)
    reference = dynamic_scenario.build_model()
    weights = reference.get_weights()
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    dataset = tf.data.Dataset.from_tensor_slices(dynamic_scenario.make_data()).batch(
        dynamic_scenario.GLOBAL_BATCH)
    strategy = hybrid_strategy.HybridStrategy(architecture="ps", asynchronous=True)
    with strategy.scope():
        model = dynamic_scenario.build_model()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adagrad(0.3), loss=loss)
    model.fit(dataset, verbose=0)
    reference.compile(optimizer=keras.optimizers.Adagrad(0.3), loss=loss)
    reference.fit(dataset, verbose=0)
    for name in dynamic_scenario.TABLES:
        result = dynamic_scenario.compare(model.get_layer(name), reference.get_layer(name))
        assert result["same_ids"] and result["same_sketch"], name
        assert result["row_error"] <= TOLERANCE and result["slot_error"] <= TOLERANCE, result
        assert result["stats"] == result["reference_stats"], result
        assert result["stats"]["evictions"] > 0 and result["slots"] == 1, result
    for mine, theirs in zip(model.weights, reference.weights):
        assert references.error(references.values(mine), references.values(theirs)) <= (
            TOLERANCE), mine.path
    (users, items), _ = dynamic_scenario.make_data()
    x = [tf.constant(users[:16]), tf.constant(items[:16])]
    predicted = model.predict(x, verbose=0)
    model.export(str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))  # held: serve reads its variables
    np.testing.assert_allclose(served.serve(x), predicted, rtol=TOLERANCE, atol=1e-7)
    model.save_weights(str(tmp_path / "model.weights.h5"))
    with strategy.scope():
        restored = dynamic_scenario.build_model()
    restored.load_weights(str(tmp_path / "model.weights.h5"))
    np.testing.assert_allclose(restored.predict(x, verbose=0), predicted, rtol=TOLERANCE,
                               atol=1e-7)


def test_the_logger_and_the_placement_report_rows_admissions_and_evictions():
    import hybrid_strategy
    from hybrid_strategy.layers import DynamicTableLogger

    DynamicEmbedding, _ = _layers()
    strategy = hybrid_strategy.HybridStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int64"),
                                  DynamicEmbedding(4, capacity=8, name="ids"),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.arange(32)[:, None] * 10**12
    history = model.fit(x, np.ones((32, 1)), batch_size=8, epochs=2, verbose=0,
                        callbacks=[DynamicTableLogger()])
    # 32 ids through 8 rows, 8 ids a step: every step after the first evicts.
    assert history.history["ids_rows"] == [8, 8]
    assert history.history["ids_admitted"][0] == 32
    assert history.history["ids_evicted"][0] == 24
    stats = model.get_layer("ids").table_stats()
    assert stats["admissions"] == sum(history.history["ids_admitted"])
    assert stats["evictions"] == sum(history.history["ids_evicted"])
    plan = str(strategy.placement)
    assert "DynamicEmbedding layer" in plan
    assert (f"capacity 8, rows in use 8 (by id map shard: 8), {stats['admissions']} "
            f"admitted, {stats['evictions']} evicted in 8 steps") in plan


@pytest.mark.parametrize("kwargs, error, match", [
    ({"capacity": 0}, ValueError, "capacity=0"),
    ({"key_dtype": "int32"}, ValueError, "key_dtype"),
    ({"eviction": "fifo"}, ValueError, "eviction"),
    ({"min_count": 0}, ValueError, "min_count"),
    ({"combiner": "max"}, ValueError, "combiner"),
    ({"embeddings_initializer": "orthogonal"}, ValueError, "not supported"),
    ({"capacity": "12 parsecs"}, ValueError, "a size such as"),
    ({"capacity": "100B"}, ValueError, "holds no row of 3 floats"),
    ({"admission": "bloom"}, ValueError, "admission='bloom'"),
    ({"admission": "sketch"}, ValueError, "with min_count=1 no id waits"),
    ({"admission": "sketch", "min_count": 2, "admission_error": 0}, ValueError,
     "admission_error=0"),
    ({"admission": "sketch", "min_count": 70_000}, ValueError, "counts up to 65535"),
])
def test_bad_arguments_are_refused_when_the_layer_is_made(kwargs, error, match):
    DynamicEmbedding, _ = _layers()
    with pytest.raises(error, match=match):
        DynamicEmbedding(**{"output_dim": 3, "capacity": 4, **kwargs})


def test_a_capacity_in_bytes_counts_rows_and_map_entries_waiting_ids_included():
    DynamicEmbedding, _ = _layers()
    entry = 48  # bytes of a map entry; a row of 16 floats is 64 more, its record 32
    assert DynamicEmbedding(16, "1MiB").capacity == 2**20 // (64 + 32 + 2 * entry)
    assert DynamicEmbedding(16, "1 MB", max_waiting=1000).capacity == (
        (10**6 - 1000 * entry) // (64 + 32 + entry))
    layer = DynamicEmbedding(16, "1MiB")
    assert DynamicEmbedding.from_config(layer.get_config()).capacity == layer.capacity
    # A sketch instead of the waiting ids' entries: 2 bits a counter for min_count 2.
    sketched = DynamicEmbedding(16, "1MiB", min_count=2, admission="sketch")
    _, dynamic = _layers()
    rows = sketched.capacity
    assert sketched.admission_bytes == dynamic.sketch_lib.nbytes(rows, 2, 0.01) < rows * 3
    assert rows * (64 + 32 + entry) + sketched.admission_bytes <= 2**20 < (
        (rows + 1) * (64 + 32 + entry) + dynamic.sketch_lib.nbytes(rows + 1, 2, 0.01))
    assert DynamicEmbedding(16, "1 MB", max_waiting=1000, min_count=2, admission="sketch",
                            ).capacity == (10**6 - dynamic.sketch_lib.nbytes(1000, 2, 0.01)
                                           ) // (64 + 32 + entry)


def test_the_config_makes_the_same_layer():
    DynamicEmbedding, _ = _layers()
    layer = DynamicEmbedding(3, 16, key_dtype="string", min_count=2, eviction="lfu",
                             max_age=9, combiner="sqrtn", pad_id="", seed=4,
                             admission="sketch", admission_error=0.02,
                             embeddings_initializer=keras.initializers.RandomNormal(0.1, 0.2))
    again = DynamicEmbedding.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    assert again._initializer == layer._initializer == ("normal", 0.1, 0.2)


def test_ids_of_the_wrong_dtype_are_refused():
    with pytest.raises(TypeError, match="got float32 ids"):
        _layer()(tf.constant([1.0, 2.0]), training=True)
    with pytest.raises(TypeError, match="got int64 ids"):
        _layer(key_dtype="string")(tf.constant([1, 2], tf.int64), training=True)
    with pytest.raises(ValueError, match="2-D input"):
        _layer(combiner="sum")(tf.constant([1, 2], tf.int64), training=True)


# On a cluster ---------------------------------------------------------------------------

FLAVOURS = ("keras3", "tf_keras")


# The ps counts each flavour's mid-epoch save on 2 ps is restored onto. Resharding is
# the same code under both; tf_keras' TensorFlow checkpoint is restored onto the uneven
# split alone.
RESTORES = {"keras3": (1, 3), "tf_keras": (3,)}


def save_and_restore(flavour, directory):
    """The uninterrupted run on 2 ps, and restores of its mid-epoch save (by ps count)."""
    def phase(name, ps):
        return json_report(on_cluster(CHECKPOINT_SCRIPT, name, directory, workers=2, ps=ps),
                           f"dynamic_checkpoint_scenario {name} on {ps} ps ({flavour})",
                           flavour)
    return {"saved": phase("save", 2),
            **{ps: phase("restore", ps) for ps in RESTORES[flavour]}}


CHECKPOINT_RUNS = Runs.in_directories(save_and_restore, FLAVOURS)

# Every optimizer case under Keras 3. tf_keras runs a lazy one and an exact one whose
# slots restart at a value of their own (Ftrl's accumulators); its optimizers' other
# rules are checked on fixed tables on a cluster (tests/test_optimizers_on_cluster.py,
# tests/test_equivalence.py), its slots' reset by the same patch.
TF_KERAS_CASES = ("adagrad", "ftrl_exact")
REPLICA_CASES = ("adagrad", "adam_exact")
RUNS = Runs({
    "keras3": functools.partial(json_report, on_cluster(SCRIPT, workers=2, ps=2),
                                "dynamic_scenario (keras3)", "keras3"),
    "tf_keras": functools.partial(
        json_report, on_cluster(SCRIPT, ",".join(TF_KERAS_CASES), workers=2, ps=2),
        "dynamic_scenario (tf_keras)", "tf_keras"),
    # One lazy and one exact case: the replicas' sums on their worker are what it adds.
    "two_replicas_per_worker": lambda: json_report(
        on_cluster(SCRIPT, ",".join(REPLICA_CASES), workers=2, ps=2, devices_per_worker=2),
        "dynamic_scenario (2 workers of 2 replicas)")})


@pytest.fixture(scope="module", params=FLAVOURS)
def report(request):
    return RUNS.result(request.param)


@pytest.fixture(scope="module", params=["keras3", "tf_keras", "two_replicas_per_worker"])
def exactness(request):
    """(shape, the scenario's report): Keras 3, tf_keras (`TF_KERAS_CASES`), and Keras 3
    with 2 replicas per worker (`REPLICA_CASES`); each with the files' case."""
    return request.param, RUNS.result(request.param)


@pytest.mark.cluster
def test_every_ids_row_and_slots_match_one_device_with_admission_and_eviction(exactness):
    shape, report = exactness
    slots = {"adagrad": 1, "adam_exact": 2, "adamw_exact": 2, "ftrl_exact": 2,
             "sgd_momentum_exact": 1, "files_adagrad": 1}
    expected = {"keras3": list(slots), "tf_keras": [*TF_KERAS_CASES, "files_adagrad"],
                "two_replicas_per_worker": [*REPLICA_CASES, "files_adagrad"]}[shape]
    assert sorted(report) == sorted(expected)
    for name, case in report.items():
        for table, result in case["tables"].items():
            assert result["same_ids"], (name, table)
            assert result["same_sketch"], (name, table)
            assert result["row_error"] <= TOLERANCE, (name, table, result["row_error"])
            assert result["slot_error"] <= TOLERANCE, (name, table, result["slot_error"])
            assert result["slots"] == slots[name], (name, table)
            stats = result["stats"]
            assert stats == result["reference_stats"] | {"rows_in_use": stats["rows_in_use"]}
            assert stats["steps"] == 10 if name == "files_adagrad" else 11, (name, stats)
            # The stream overflows both tables: rows were evicted and given again (read
            # from files, its ids come in another order: the item table's alone).
            if name != "files_adagrad" or table == "item":
                assert stats["evictions"] > 0 and stats["admissions"] > stats["capacity"], (
                    name, table, stats)
            assert (sum(stats["rows_in_use"]) == stats["admissions"] - stats["evictions"]
                    <= stats["capacity"]), stats
        assert max(case["dense_errors"].values()) <= TOLERANCE, name
        # The item table's waiting ids are counted in a sketch on the first PS task,
        # which filled and halved its counts during the epoch (5 rows of 32 two-bit
        # counters for 20 waiting ids at odds 0.05, and two int64s): the same as on
        # one device.
        item = case["tables"]["item"]
        assert item["stats"]["sketch_halvings"] > 0 and item["sketch_bytes"] == 5 * 32 // 4 + 16
        assert case["tables"]["user"]["sketch_bytes"] is None
    # From files: each worker parsed its own files' records alone, each once.
    assert report["files_adagrad"]["parsed"] == list(range(240))


@pytest.mark.cluster
@pytest.mark.parametrize("run", ["keras3", "two_replicas_per_worker"])
def test_a_models_dynamic_tables_share_one_exchange_per_pair_of_tasks(run):
    # Keras 3 functional models train every DynamicEmbedding reading their inputs at
    # once: both tables, split over both ps, cross in one tensor each way between a
    # worker and a ps (the ids out, every row back) and between the two ps (the finds
    # of the second, then the first's decisions). ps1 sums no dense gradient, and
    # worker1 sends no reads of the optimizer (worker0 does): the other tensor worker1
    # sends ps1 is its gradient push.
    for name, case in RUNS.result(run).items():
        transfers = case["transfers"]
        assert transfers["ps0->ps1"] == transfers["ps1->ps0"] == 1, (name, transfers)
        assert transfers["ps1->worker0"] == transfers["ps1->worker1"] == 1, (name, transfers)
        assert transfers["worker1->ps1"] == 2, (name, transfers)


@pytest.mark.cluster
def test_id_maps_are_split_as_their_rows_are(report):
    for case in report.values():
        for result in case["tables"].values():
            assert sorted(result["rows_devices"]) == PS
            assert result["remap_devices"] == result["rows_devices"]
            assert all(n > 0 for n in result["stats"]["rows_in_use"]), result["stats"]
        # A table placed whole keeps its map whole beside it.
        small = case["small_table"]
        assert small["remap_devices"] == small["rows_devices"] and small["rows_devices"][0] in PS
        assert len(small["rows_devices"]) == 1


@pytest.mark.cluster
@pytest.mark.parametrize("flavour, onto", [
    pytest.param(flavour, ps, id=f"{flavour}-onto_{ps}_ps")
    for flavour, counts in RESTORES.items() for ps in counts])
def test_a_mid_epoch_save_restored_onto_other_ps_counts_ends_where_training_ended(
        flavour, onto):
    restored = CHECKPOINT_RUNS.result(flavour)
    saved, resumed = restored["saved"], restored[onto]
    assert (saved["num_ps"], resumed["num_ps"]) == (2, onto)
    # The maps are split as the restored rows are: the larger table's over every ps.
    assert resumed["remap_devices"] == resumed["rows_devices"]
    assert len(resumed["remap_devices"]["item"]) == resumed["num_ps"]
    assert resumed["iterations"] == saved["iterations"]
    for table, ids in saved["tables"].items():
        assert sorted(resumed["tables"][table]) == sorted(ids), table
        for key, state in ids.items():
            mine = resumed["tables"][table][key]
            assert mine[:2] == state[:2], (table, key)
            if len(state) > 2:   # an admitted id: its row and slots
                np.testing.assert_allclose(mine[2], state[2], rtol=TOLERANCE, atol=1e-7)
                np.testing.assert_allclose(mine[3], state[3], rtol=TOLERANCE, atol=1e-7)
    for path, value in saved["dense"].items():
        np.testing.assert_allclose(resumed["dense"][path], value, rtol=TOLERANCE, atol=1e-7)
    # The item table's admission sketch came back and went on as uninterrupted.
    assert resumed["sketches"] == saved["sketches"] and saved["sketches"]["item"]
