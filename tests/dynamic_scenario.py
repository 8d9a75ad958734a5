"""DynamicEmbedding tables trained on a cluster, against the same model trained on one device.

The model: a user table keyed by raw int64 ids (admitted at their second sighting,
counted exactly while they wait, least recently seen evicted first, capacity below
the ids in the stream), an item table keyed by strings, multi-hot with padding and a
mean combiner (admitted at their second sighting, counted in a sketch small enough
to be halved during the epoch; least often seen evicted first, and every id unseen
for 4 steps), and a dense tower. The stream brings new ids every step; its last batch
holds one example, so one worker's share is empty. Each case trains it with
`model.fit` under HybridStrategy (the rows on the PS tasks, the id -> row maps split
over them) and the same model on one device from the same weights on the same global
batches, and reports, per table, whether both hold the same ids with the same counts
and last steps (and the same sketch), the relative error of each id's row and
optimizer slots, and of the dense weights, admissions, evictions, where rows and maps
live, and the tensors a training step sends between tasks
(benchmarks/step_transfers.py). One more case reads the examples from TFRecord files
on disk, 8 shards, each worker only its own (each record parsed once, which the
report counts), beside one device reading each worker's files in turn. Keras 3 and,
under TF_USE_LEGACY_KERAS=1, tf_keras. (Exports of dynamic tables are served in
tests/test_serving.py.) Prints the report as JSON:

    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/dynamic_scenario.py [CASES]

CASES: the optimizer cases to run, comma-separated (default: every one); the case read
from files always runs.
"""

import json
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

import optimizer_references as references
from benchmarks import step_transfers
from optimizer_scenario import devices, path

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

DIM, GLOBAL_BATCH, STEPS = 4, 24, 11
USER_CAPACITY, ITEM_CAPACITY = 40, 60
TABLES = ("user", "item")


def cases():
    """name -> (optimizer factory, sparse_update)."""
    o = keras.optimizers
    # Ftrl's slots do not start at zero (accumulators at 0.1): a fresh row's must restart
    # at that; AdamW's decay reaches rows the step did not see, in exact mode.
    return {"sgd_momentum_exact": (lambda: o.SGD(0.3, momentum=0.5), "exact"),
            "adagrad": (lambda: o.Adagrad(0.3), "lazy"),
            "adam_exact": (lambda: o.Adam(0.05, epsilon=1e-4), "exact"),
            "adamw_exact": (lambda: o.AdamW(0.05, weight_decay=0.05, epsilon=1e-4), "exact"),
            "ftrl_exact": (lambda: o.Ftrl(0.2, l1_regularization_strength=0.001,
                                          l2_regularization_strength=0.001), "exact")}


def build_model():
    from hybrid_strategy.layers import DynamicEmbedding

    user = keras.Input(shape=(1,), dtype="int64", name="user_id")
    items = keras.Input(shape=(3,), dtype="string", name="item_ids")
    u = keras.layers.Flatten()(DynamicEmbedding(
        DIM, USER_CAPACITY, min_count=2, eviction="lru", name="user",
        embeddings_initializer="normal", seed=5)(user))
    i = DynamicEmbedding(DIM, ITEM_CAPACITY, key_dtype="string", min_count=2,
                         admission="sketch", max_waiting=20, admission_error=0.05,
                         eviction="lfu", max_age=4, combiner="mean", pad_id="", name="item",
                         seed=6)(items)
    x = keras.layers.Concatenate()([u, i, u * i])
    x = keras.layers.Dense(8, activation="relu", name="tower")(x)
    return keras.Model([user, items], keras.layers.Dense(1, name="logit")(x))


def make_data():
    rng = np.random.default_rng(7)
    n = GLOBAL_BATCH * (STEPS - 1) + 1
    # Raw 64-bit ids, popular ones coming back, the set growing with time.
    universe = rng.integers(-2**62, 2**62, 400, dtype=np.int64)
    step = np.arange(n) // GLOBAL_BATCH
    user = universe[np.minimum(rng.zipf(1.4, n) - 1 + 6 * step, 399)][:, None]
    item = np.array([f"item-{k}" for k in range(300)], dtype=object)
    picks = np.minimum(rng.zipf(1.3, (n, 3)) - 1 + 10 * step[:, None], 299)
    items = item[picks]
    items[rng.random((n, 3)) < 0.3] = ""  # padding
    clicks = (rng.random((n, 1)) < 0.4).astype("float32")
    return (user, items.astype(bytes)), clicks


FILES, FILE_EXAMPLES = 8, 30   # 240 examples: 10 global batches of 24


def write_files(directory):
    """make_data's first 240 examples as TFRecord files: example r in file r % FILES."""
    (user, items), clicks = make_data()
    paths = [os.path.join(directory, f"part-{i}.tfrecord") for i in range(FILES)]
    for i, path in enumerate(paths):
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(i, FILES * FILE_EXAMPLES, FILES):
                features = {
                    "example": tf.train.Feature(int64_list=tf.train.Int64List(value=[r])),
                    "user": tf.train.Feature(int64_list=tf.train.Int64List(value=user[r])),
                    "items": tf.train.Feature(bytes_list=tf.train.BytesList(value=items[r])),
                    "click": tf.train.Feature(float_list=tf.train.FloatList(value=clicks[r]))}
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=features)).SerializeToString())
    return os.path.join(directory, "part-*.tfrecord")


def read_files(pattern, batch, log=None, shard=None):
    """Batches of `batch` parsed examples of the files; `shard` (index, count): a
    worker's files alone; `log`: a file each parsed example's number is printed to."""
    spec = {"example": tf.io.FixedLenFeature([1], tf.int64),
            "user": tf.io.FixedLenFeature([1], tf.int64),
            "items": tf.io.FixedLenFeature([3], tf.string),
            "click": tf.io.FixedLenFeature([1], tf.float32)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        parsed = [] if log is None else [tf.print(example["example"],
                                                  output_stream=f"file://{log}")]
        with tf.control_dependencies(parsed):
            return (tf.identity(example["user"]), example["items"]), example["click"]

    files = tf.data.Dataset.list_files(pattern, shuffle=False)
    if shard is not None:
        files = files.shard(shard[1], shard[0])
    return files.interleave(tf.data.TFRecordDataset, cycle_length=2).map(parse).batch(batch)


def one_device_reading_each_workers_files(pattern, workers):
    """The global batches a cluster of `workers` trains on, read on one device: each
    worker's next batch of its own files, one after the other."""
    parts = tuple(read_files(pattern, GLOBAL_BATCH // workers, shard=(w, workers))
                  for w in range(workers))
    return tf.data.Dataset.zip(parts).map(
        lambda *batches: tf.nest.map_structure(lambda *t: tf.concat(t, 0), *batches))


def per_id(layer):
    """{key: (count, last step, row vector, [slot rows])} of a DynamicEmbedding."""
    snapshot = layer.remap.snapshot()
    rows = references.values(layer.embeddings)
    slots = [references.values(slot) for slot, _ in layer.embeddings._hybrid_dynamic_slots]
    out = {}
    for key, (row, count, last) in zip(snapshot["keys"], snapshot["values"]):
        vectors = (rows[row], [s[row] for s in slots]) if row >= 0 else (None, [])
        out[int(key)] = (int(count), int(last), *vectors)
    return out


def sketch_state(layer):
    """The admission sketch of a DynamicEmbedding, as lists ({} without one)."""
    return {k: v.tolist() for k, v in layer.remap.snapshot().items() if k.startswith("sketch")}


def compare(layer, reference):
    mine, theirs = per_id(layer), per_id(reference)
    row_errors, slot_errors = [0.0], [0.0]
    for key, (_, _, row, slots) in mine.items():
        _, _, their_row, their_slots = theirs[key]
        if row is not None:
            row_errors.append(references.error(row, their_row))
            slot_errors += [references.error(a, b) for a, b in zip(slots, their_slots)]
    stats = layer.table_stats()
    return {
        "same_ids": sorted(mine) == sorted(theirs) and all(
            mine[k][:2] == theirs[k][:2] and (mine[k][2] is None) == (theirs[k][2] is None)
            for k in mine),
        "same_sketch": sketch_state(layer) == sketch_state(reference),
        "sketch_bytes": None if layer.remap.sketch is None else layer.remap.sketch.nbytes,
        "rows": sum(v[2] is not None for v in mine.values()),
        "slots": len(layer.embeddings._hybrid_dynamic_slots),
        "row_error": max(row_errors),
        "slot_error": max(slot_errors),
        "stats": stats,
        "reference_stats": reference.table_stats(),
        "rows_devices": devices(layer.embeddings),
        "remap_devices": list(layer.remap.devices),
    }


def case(strategy, weights, make_optimizer, dataset, reference_dataset):
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    with strategy.scope():
        model = build_model()
        model.set_weights(weights)
        model.compile(optimizer=make_optimizer(), loss=loss)
        small = _small_table()
    with step_transfers.RunMetadata() as metadata:
        model.fit(dataset, epochs=1, verbose=0)
    reference = build_model()
    reference.set_weights(weights)
    reference.compile(optimizer=make_optimizer(), loss=loss)
    reference.fit(reference_dataset, epochs=1, verbose=0)
    dense = {path(w): references.error(references.values(w), references.values(r))
             for w, r in zip(model.weights, reference.weights)
             if path(w).split("/")[0] not in TABLES}
    return {"tables": {name: compare(model.get_layer(name), reference.get_layer(name))
                       for name in TABLES},
            "dense_errors": dense,
            "transfers": step_transfers.count_transfers(metadata.result)["transfers"],
            "small_table": {"rows_devices": devices(small.embeddings),
                            "remap_devices": list(small.remap.devices)}}


def _small_table():
    """A table too small to split (16 bytes), built where `case` builds its model."""
    from hybrid_strategy.layers import DynamicEmbedding

    layer = DynamicEmbedding(2, capacity=2, name="small")
    layer.build((None,))
    return layer


def main():
    import hybrid_strategy

    keras.utils.set_random_seed(3)
    weights = build_model().get_weights()
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else list(cases())
    report = {}
    for name in chosen:
        make_optimizer, mode = cases()[name]
        strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=256, sparse_update=mode)
        # Made once the strategy has connected to the cluster, which drops older datasets.
        dataset = tf.data.Dataset.from_tensor_slices(make_data()).batch(GLOBAL_BATCH)
        report[name] = case(strategy, weights, make_optimizer, dataset, dataset)
    with tempfile.TemporaryDirectory() as directory:
        pattern, log = write_files(directory), os.path.join(directory, "parsed.log")
        workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
        make_optimizer, mode = cases()["adagrad"]
        strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=256, sparse_update=mode)
        report["files_adagrad"] = case(
            strategy, weights, make_optimizer, read_files(pattern, GLOBAL_BATCH, log),
            one_device_reading_each_workers_files(pattern, workers))
        with open(log) as f:
            report["files_adagrad"]["parsed"] = sorted(int(v) for v in f.read().replace(
                "[", " ").replace("]", " ").split())
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
