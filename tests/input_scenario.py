"""Input on a cluster: files, per-worker input functions, in-memory datasets, arrays.

Run as the chief of a local cluster, it trains a small model with an embedding table
and dense layers (SGD: exact on PS tables) on each kind of input, beside the same model
trained on this process alone on the same global batches, and prints one JSON report:

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python tests/input_scenario.py

Datasets parse or map each example through `tf.print` into a log file, so the report
counts how many times each example was processed across the workers.
"""

import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import tensorflow as tf

import hybrid_strategy
from hybrid_strategy.input import array_input
from hybrid_strategy.input import input_graph

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

ROWS, BATCH, VOCAB = 200, 32, 256   # 6 batches of 32 and a last one of 8 (4 + 4)


def make_arrays(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (rows, 4)).astype(np.int32)
    ids[:, 0] = np.arange(rows) % VOCAB   # column 0 names the example
    dense = rng.normal(size=(rows, 3)).astype(np.float32)
    y = (np.sin(ids.sum(axis=1) / 40.0) + dense[:, 0]).astype(np.float32)[:, None]
    return {"ids": ids, "dense": dense}, y


def build_model():
    ids = keras.Input((4,), dtype="int32", name="ids")
    dense = keras.Input((3,), name="dense")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 8, name="table")(ids))
    x = keras.layers.Concatenate()([x, dense])
    x = keras.layers.Dense(8, activation="tanh", name="hidden")(x)
    model = keras.Model({"ids": ids, "dense": dense}, keras.layers.Dense(1, name="out")(x))
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    return model


def relative_error(model, reference):
    return max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
               for a, b in zip(model.get_weights(), reference.get_weights()))


class Logs:
    """Log files datasets print processed examples' ids into."""

    def __init__(self, directory):
        self.directory = directory

    def logged(self, name, ids):
        """`ids`, once their values are printed into the log `name`."""
        path = os.path.join(self.directory, name + ".log")
        with tf.control_dependencies([tf.print(ids, output_stream=f"file://{path}")]):
            return tf.identity(ids)

    def counts(self, name):
        path = os.path.join(self.directory, name + ".log")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [int(v) for v in f.read().replace("[", " ").replace("]", " ").split()]


def write_files(directory, files, rows):
    """The examples of make_arrays(rows) as TFRecord files of tf.train.Example."""
    features, y = make_arrays(rows)
    paths = [os.path.join(directory, f"part-{i:02d}-of-{files:02d}.tfrecord")
             for i in range(files)]
    for i, path in enumerate(paths):
        with tf.io.TFRecordWriter(path) as writer:
            for row in range(i, rows, files):
                feature = {
                    "ids": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=features["ids"][row])),
                    "dense": tf.train.Feature(float_list=tf.train.FloatList(
                        value=features["dense"][row])),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=y[row])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())
    return paths


def parser(logs, log_name):
    spec = {"ids": tf.io.FixedLenFeature([4], tf.int64),
            "dense": tf.io.FixedLenFeature([3], tf.float32),
            "y": tf.io.FixedLenFeature([1], tf.float32)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        ids = tf.cast(example["ids"], tf.int32)
        ids = tf.concat([logs.logged(log_name, ids[:1]), ids[1:]], 0)
        return {"ids": ids, "dense": example["dense"]}, example["y"]

    return parse


class Models:
    """One model under the strategy and one alone, reset to the same weights per case
    (one model each: their traced steps serve every case)."""

    def __init__(self, strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            self.model = build_model()
        self.reference = build_model()
        self.initial = self.model.get_weights()

    def reset(self):
        self.model.set_weights(self.initial)
        self.reference.set_weights(self.initial)
        return self.model, self.reference

    def train_both(self, data, reference_data, **fit_kwargs):
        """The model trained on `data`, the reference alone on `reference_data`."""
        model, reference = self.reset()
        model.fit(data, verbose=0, **fit_kwargs)
        reference.fit(reference_data, verbose=0, **fit_kwargs)
        return model, reference


def case_files(models, strategy, logs, directory):
    """8 files, sharded by file: each record is parsed once per epoch, none dropped."""
    paths = write_files(directory, 8, 256)
    validation = write_files(os.path.join(directory, "validation"), 4, 64)

    def dataset(files, log):
        return (tf.data.Dataset.list_files(files, shuffle=False)
                .interleave(tf.data.TFRecordDataset, cycle_length=2)
                .map(parser(logs, log)).batch(BATCH))

    model, _ = models.reset()
    model.fit(dataset(paths, "files"), validation_data=dataset(validation, "validation"),
              verbose=0)
    return {"parsed": logs.counts("files"), "records": 256,
            "validation_parsed": logs.counts("validation"), "validation_records": 64}


def case_one_file(models, strategy, logs, directory):
    """One file on 2 workers (AUTO): a notice, sharded by example, exact training."""
    (path,) = write_files(directory, 1, ROWS)

    def dataset(log):
        return tf.data.TFRecordDataset([path]).map(parser(logs, log)).batch(BATCH)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, reference = models.train_both(dataset("one_file"),
                                             dataset("one_file_reference"))
    return {"parsed": logs.counts("one_file"), "relative_error": relative_error(model,
                                                                                 reference),
            "notices": [str(w.message) for w in caught
                        if w.category.__name__ == "InputShardingWarning"]}


def case_file_policy(models, strategy, logs, directory):
    """FILE with one file: refused before training."""
    (path,) = write_files(directory, 1, 64)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.FILE)
    dataset = tf.data.TFRecordDataset([path]).map(parser(logs, "file_policy")) \
        .batch(BATCH).with_options(options)
    model, _ = models.reset()
    before = [w.copy() for w in model.get_weights()]
    try:
        model.fit(dataset, verbose=0)
        error = None
    except ValueError as e:
        error = str(e)
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    return {"error": error, "weights_unchanged": unchanged,
            "parsed": logs.counts("file_policy")}


def case_in_memory(models, strategy, logs, policy=None):
    """from_tensor_slices + map + batch: each worker maps only its examples; exact."""
    features, y = make_arrays()
    name = f"in_memory_{policy or 'auto'}"

    def dataset(log):
        def mapped(f, label):
            return dict(f, ids=tf.concat([logs.logged(log, f["ids"][:1]), f["ids"][1:]], 0)), \
                label
        data = tf.data.Dataset.from_tensor_slices((features, y)).map(mapped).batch(BATCH)
        if policy:
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = getattr(
                tf.data.experimental.AutoShardPolicy, policy)
            data = data.with_options(options)
        return data

    model, reference = models.train_both(dataset(name), dataset(name + "_reference"))
    return {"mapped": logs.counts(name), "relative_error": relative_error(model, reference)}


def case_function(models, strategy):
    """distribute_datasets_from_function: fit, evaluate, predict; every example once."""
    features, y = make_arrays()

    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(BATCH)
        return (tf.data.Dataset.from_tensor_slices((features, y))
                .shard(context.num_input_pipelines, context.input_pipeline_id).batch(batch))

    contexts = []

    def recorded(context):
        contexts.append([context.num_input_pipelines, context.input_pipeline_id,
                         context.get_per_replica_batch_size(BATCH)])
        return dataset_fn(context)

    data = strategy.distribute_datasets_from_function(recorded)
    reference_data = tf.data.Dataset.from_tensor_slices((features, y)).batch(BATCH)
    # tf_keras needs the steps of a distributed dataset (and, given them, keeps one
    # iterator over every epoch: one epoch here).
    steps = -(-ROWS // BATCH)
    model, reference = models.train_both(data, reference_data, steps_per_epoch=steps)
    inputs = strategy.distribute_datasets_from_function(
        lambda c: dataset_fn(c).map(lambda f, label: f))
    predicted = model.predict(inputs, steps=steps, verbose=0)
    expected = reference.predict(features, batch_size=BATCH, verbose=0)
    by_id = {}
    for row, value in zip(predicted_ids(strategy, dataset_fn), predicted[:, 0]):
        by_id.setdefault(int(row), []).append(float(value))
    return {
        "contexts": contexts,
        "relative_error": relative_error(model, reference),
        "evaluate": [model.evaluate(data, steps=steps, verbose=0),
                     reference.evaluate(reference_data, verbose=0)],
        "predicted_ids": sorted(by_id),
        "predictions_per_id": sorted({len(v) for v in by_id.values()}),
        "predict_error": max(abs(v[0] - float(expected[i, 0])) for i, v in by_id.items()),
    }


def predicted_ids(strategy, dataset_fn):
    """The example ids in the order `predict` returns its rows: replica after replica."""
    data = strategy.distribute_datasets_from_function(dataset_fn)
    ids = []
    for features, _ in data:
        for part in strategy.experimental_local_results(features):
            ids.extend(part["ids"][:, 0].numpy().tolist())
    return ids


def case_numpy(models, strategy):
    """Arrays: each worker receives only its rows, in chunks of at most CHUNK_BYTES (set
    smaller than a worker's block of a batch, so blocks are split too), and no dataset
    holds them whole; training, evaluate, predict exact."""
    features, y = make_arrays()
    weights = np.linspace(0.5, 1.5, ROWS).astype(np.float32)
    sent, chunk_bytes, whole_datasets, hybrid = [], [], [], [True]
    originals = (array_input._send, array_input.CHUNK_BYTES,  # pylint: disable=protected-access
                 input_graph.take_rows, tf.data.Dataset.from_tensors)

    def recorded_send(array, starts, lengths, device, floatx):
        sent.append([device, int(sum(lengths)), len(array)])
        return originals[0](array, starts, lengths, device, floatx)

    def recorded_take_rows(array, starts, lengths):
        rows = originals[2](array, starts, lengths)
        chunk_bytes.append(rows.nbytes)
        return rows

    def recorded_from_tensors(tensors, name=None):
        # Keras' own dataset of arrays holds them whole: a copy of them on this process.
        whole_datasets.extend(t.shape[0] for t in tf.nest.flatten(tensors) if hybrid[0]
                              and getattr(t, "shape", ())[:1] == (ROWS,))
        return originals[3](tensors, name)

    array_input._send = recorded_send  # pylint: disable=protected-access
    array_input.CHUNK_BYTES = 200   # a worker's block of a batch holds 16 rows of 16 bytes
    input_graph.take_rows = recorded_take_rows
    tf.data.Dataset.from_tensors = recorded_from_tensors
    try:
        model, reference = models.reset()
        model.fit(features, y, batch_size=BATCH, shuffle=False, sample_weight=weights,
                  verbose=0)
        hybrid[0] = False   # the reference on one device takes Keras' way
        reference.fit(features, y, batch_size=BATCH, shuffle=False, sample_weight=weights,
                      verbose=0)
        hybrid[0] = True
        error = relative_error(model, reference)
        predicted = model.predict(features, batch_size=BATCH, verbose=0)
        evaluated = model.evaluate(features, y, batch_size=BATCH, verbose=0)
        # Each worker shuffles its own rows.
        shuffled = model.fit(features, y, batch_size=BATCH, epochs=1, verbose=0)
    finally:
        (array_input._send, array_input.CHUNK_BYTES,  # pylint: disable=protected-access
         input_graph.take_rows, tf.data.Dataset.from_tensors) = originals
    return {
        "relative_error": error,
        "shuffled_loss": shuffled.history["loss"][-1],
        "sent": sent,
        "largest_chunk_bytes": max(chunk_bytes),
        "whole_array_datasets": len(whole_datasets),
        "predict_error": float(np.max(np.abs(
            predicted - reference.predict(features, batch_size=BATCH, verbose=0)))),
        "evaluate": [evaluated, reference.evaluate(features, y, batch_size=BATCH,
                                                   verbose=0)],
    }


def case_readers(models, strategy, logs, directory):
    """How each worker reads each kind of distributed dataset: the class of its iterator."""
    features, y = make_arrays()
    files = tf.data.Dataset.list_files(write_files(directory, 8, 64), shuffle=False) \
        .interleave(tf.data.TFRecordDataset, cycle_length=2).map(parser(logs, "readers"))
    def in_memory(batch=BATCH):
        return tf.data.Dataset.from_tensor_slices((features, y)).batch(batch)

    distributed = {
        "files": strategy.experimental_distribute_dataset(files.batch(BATCH)),
        "in_memory": strategy.experimental_distribute_dataset(in_memory()),
        "function": strategy.distribute_datasets_from_function(
            lambda context: in_memory(context.get_per_replica_batch_size(BATCH))),
        "arrays": array_input.distribute_arrays(
            strategy.extended.input_hosts, strategy.distribute_datasets_from_function,
            (features, y), BATCH, False),
        "options_given": strategy.experimental_distribute_dataset(
            in_memory(), tf.distribute.InputOptions(
                experimental_fetch_to_device=True)),
    }
    # TF-private: a distributed iterator's iterator on each worker, and what that reads.
    return {name: [type(worker._iterator).__name__  # pylint: disable=protected-access
                   for worker in iter(data)._iterators]  # pylint: disable=protected-access
            for name, data in distributed.items()}


CASES = {
    "files": case_files,
    "one_file": case_one_file,
    "file_policy": case_file_policy,
    "in_memory": lambda m, s, logs, d: case_in_memory(m, s, logs),
    "in_memory_off": lambda m, s, logs, d: case_in_memory(m, s, logs, "OFF"),
    "function": lambda m, s, logs, d: case_function(m, s),
    "numpy": lambda m, s, logs, d: case_numpy(m, s),
    "readers": case_readers,
}


def main(argv):
    names = argv[1].split(",") if len(argv) > 1 else list(CASES)
    strategy = hybrid_strategy.HybridStrategy()
    models = Models(strategy)
    report = {"workers": len(strategy.extended.input_hosts)}
    with tempfile.TemporaryDirectory() as directory:
        logs = Logs(directory)
        for name in names:
            case_directory = os.path.join(directory, name)
            os.makedirs(os.path.join(case_directory, "validation"))
            started = time.perf_counter()
            report[name] = CASES[name](models, strategy, logs, case_directory)
            report[name]["seconds"] = time.perf_counter() - started
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv)
