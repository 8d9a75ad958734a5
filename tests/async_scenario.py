"""Asynchronous training scenarios (`HybridStrategy(architecture="ps", asynchronous=True)`).

Run as the chief of a local cluster, or on this machine alone with two CPU replicas
(one worker: its steps run one after the other, so training is exactly sequential),
under Keras 3 or, with TF_USE_LEGACY_KERAS=1, tf_keras; prints its report as JSON:

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python tests/async_scenario.py
    python tests/async_scenario.py --local-replicas 2

Cases:
- equivalence (one worker only): the scenario.py models, trained asynchronously,
  against single-device training, as tests/test_equivalence.py checks synchronous ones;
- counting: every example of an epoch is used once (scenario.py's counting case);
- linear: a model whose gradients do not depend on its weights (a table and a Dense
  layer summed, SGD), so that asynchronous training must end exactly where
  single-device training does, whatever order the workers' steps ran in (one and
  three steps per call);
- convergence: a click-through model (two tables, an MLP, Adagrad, AUC) learns, the
  optimizer counts every step, epochs end after every step, and a checkpoint (and a
  Keras 3 weights file) written in the middle of an epoch holds every step handed out
  before it;
- language_model: an LSTM language model (a table, an LSTM whose gradients leave a
  while loop, a softmax over the vocabulary, Adam) trains and counts every step;
- transfers (on a cluster): the tensors one worker's step of the click-through model
  sends between tasks (benchmarks/step_transfers.py).

With `--dynamic` it runs the dynamic case alone: two DynamicEmbedding tables (one with
room for every id, admitting at the second sighting; one of 24 rows, evicting all the
time) trained by every worker at once, Adagrad; it reports each map's invariants (distinct
ids, no row held twice, every row held or free once) at the end and in a Keras 3 weights
file saved mid-epoch, with its counters and counts, and whether every id of the roomy
table is counted once per step it came in.

With `--concurrent REPEATS` it runs the concurrent case alone instead: every worker
traces its step at the same time, REPEATS times over, each time with a new model and
optimizer (Adagrad, Adam, SGD in turn, one or three steps per call), on the linear
model with a frozen layer that adds a loss: every fit runs to its end, counts every
step and every example (a metric of the labels), SGD ends where one device ends and
Adagrad's accumulators hold what one device's hold (sums of squared gradients, which
no order changes).
"""

import argparse
import json
import os
import sys
import tempfile

import h5py
import numpy as np
import tensorflow as tf

import scenario
from benchmarks import step_transfers
from hybrid_strategy import versions

keras = tf.keras
LEGACY = versions.legacy_keras() is not None  # tf.keras is tf_keras

EQUIVALENCE_CASES = {name: scenario.CASES[name] for name in ("adagrad", "adam_exact")}
LINEAR_ROWS, LINEAR_FEATURES, LINEAR_BATCH, LINEAR_STEPS, LINEAR_EPOCHS = 300, 5, 32, 8, 3
CTR_TABLES, CTR_FEATURES, CTR_BATCH, CTR_STEPS, CTR_EPOCHS = (2000, 300), 4, 64, 24, 6
SAVE_AT_BATCH = 5  # the mid-epoch checkpoint is written after this batch of epoch 1


def linear_model(penalized=False):
    """sum(table[ids]) + Dense(features): each weight's gradient is fixed by the data.

    `penalized`: plus a frozen Dense(features) whose activity regularizer adds a loss
    (which Keras keeps in the layer while a step is traced) that no trained weight
    changes.
    """
    ids = keras.Input((scenario.SEQ,), dtype="int32", name="ids")
    features = keras.Input((LINEAR_FEATURES,), name="features")
    rows = keras.layers.Embedding(LINEAR_ROWS, 1, name="table")(ids)
    summed = keras.layers.Flatten()(rows)
    terms = [keras.layers.Dense(1, name="sum")(summed),
             keras.layers.Dense(1, name="dense")(features)]
    if penalized:
        frozen = keras.layers.Dense(1, name="penalized",
                                    activity_regularizer=keras.regularizers.L2(0.01))
        frozen.trainable = False
        terms.append(frozen(features))
    out = keras.layers.Add()(terms)
    model = keras.Model({"ids": ids, "features": features}, out)
    # A fixed "sum" layer: its kernel is frozen at ones, so the output is linear in the table.
    model.get_layer("sum").trainable = False
    return model


def linear_data(seed=0):
    rng = np.random.default_rng(seed)
    n = LINEAR_BATCH * LINEAR_STEPS
    x = {"ids": np.minimum(rng.zipf(1.3, (n, scenario.SEQ)) - 1, LINEAR_ROWS - 1).astype("int32"),
         "features": rng.normal(size=(n, LINEAR_FEATURES)).astype("float32")}
    return x, np.zeros((n, 1), "float32")


def mean_output(y_true, y_pred):
    return y_pred[:, 0]


def linear_case(make_strategy, steps_per_execution=1):
    """Asynchronous SGD on the linear model against one device: equal up to float order.

    With several steps per call, a call whose worker runs out of batches leaves its
    other steps to another worker: every batch still trains once.
    """
    strategy = make_strategy()
    x, y = linear_data()
    keras.utils.set_random_seed(2)
    reference = linear_model()
    reference.get_layer("sum").set_weights([np.ones((scenario.SEQ, 1), "float32"),
                                            np.zeros(1, "float32")])
    weights = reference.get_weights()
    # Gradients are multiples of 1/32 and the rate a power of two: the table's updates
    # add exactly in float32, in any order.
    reference.compile(optimizer=keras.optimizers.SGD(0.125), loss=mean_output)
    reference.fit(x, y, batch_size=LINEAR_BATCH, epochs=LINEAR_EPOCHS, shuffle=False, verbose=0)
    with strategy.scope():
        model = linear_model()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.125), loss=mean_output,
                      steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=LINEAR_BATCH, epochs=LINEAR_EPOCHS, shuffle=False, verbose=0)
    held_out = linear_data(seed=4)[0]
    return {
        "relative_errors": dict(zip([scenario.weight_path(w) for w in model.weights],
                                    scenario.relative_errors(model.get_weights(),
                                                             reference.get_weights()))),
        "moved": max(scenario.relative_errors(reference.get_weights(), weights)),
        "iterations": int(model.optimizer.iterations.numpy()),
        "evaluate": [float(model.evaluate(held_out, np.zeros((len(held_out["ids"]), 1)),
                                          batch_size=LINEAR_BATCH, verbose=0)),
                     float(reference.evaluate(held_out, np.zeros((len(held_out["ids"]), 1)),
                                              batch_size=LINEAR_BATCH, verbose=0))],
        "devices": scenario.variable_devices(model),
    }


# (optimizer, steps per call) of each concurrent fit, in turn.
CONCURRENT_FITS = (("adagrad", 1), ("adam", 3), ("sgd", 3), ("adagrad", 3), ("sgd", 1))
CONCURRENT_BATCH, CONCURRENT_STEPS = 16, 16
CONCURRENT_OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.125),
                         "adagrad": lambda: keras.optimizers.Adagrad(0.125),
                         "adam": lambda: keras.optimizers.Adam(0.01)}


def label_mean(y_true, y_pred):
    """A metric the weights do not change: the mean label of the epoch's examples."""
    return tf.reduce_mean(y_true)


def linear_gradient_sums(x, batch):
    """`{path: (sum of its steps' gradients, sum of their squares)}` of the trained
    weights of the linear model, trained on `x` in steps of `batch` examples: the loss
    is the batch's mean output, so a table row's gradient is its count in the batch's
    ids over `batch`, the dense kernel's the features' mean, the bias's 1."""
    sums = {path: [0.0, 0.0] for path in ("table/embeddings", "dense/kernel", "dense/bias")}
    for start in range(0, len(x["ids"]), batch):
        ids, features = x["ids"][start:start + batch], x["features"][start:start + batch]
        gradients = {"table/embeddings": np.bincount(ids.ravel(), minlength=LINEAR_ROWS)[
                         :, None] / batch,
                     "dense/kernel": features.mean(axis=0)[:, None],
                     "dense/bias": np.ones(1)}
        for path, gradient in gradients.items():
            sums[path][0] = sums[path][0] + gradient
            sums[path][1] = sums[path][1] + gradient ** 2
    return sums


def concurrent_case(make_strategy, repeats):
    """Fits of new models and optimizers, each traced by every worker at once.

    Each result: the fit's error (None), its iterations, its label metric against the
    labels' mean, and, for SGD, the trained weights' and for Adagrad, the accumulators'
    largest relative error against their values from the gradients' sums
    (`linear_gradient_sums`), which no order of the steps changes.
    """
    x, _ = linear_data()
    n = CONCURRENT_BATCH * CONCURRENT_STEPS
    x = {key: np.resize(value, (n,) + value.shape[1:]) for key, value in x.items()}
    y = np.random.default_rng(7).random((n, 1)).astype("float32")
    sums = linear_gradient_sums(x, CONCURRENT_BATCH)
    keras.utils.set_random_seed(2)
    start = linear_model(penalized=True)
    start.get_layer("sum").set_weights([np.ones((scenario.SEQ, 1), "float32"),
                                        np.zeros(1, "float32")])
    weights = start.get_weights()
    initial = dict(zip(map(scenario.weight_path, start.weights), weights))
    out = []
    for fit in range(repeats):
        optimizer, steps_per_execution = CONCURRENT_FITS[fit % len(CONCURRENT_FITS)]
        result = {"optimizer": optimizer, "steps_per_execution": steps_per_execution,
                  "error": None}
        out.append(result)
        strategy = make_strategy()
        with strategy.scope():
            model = linear_model(penalized=True)
            model.set_weights(weights)
            model.compile(optimizer=CONCURRENT_OPTIMIZERS[optimizer](), loss=mean_output,
                          metrics=[label_mean], steps_per_execution=steps_per_execution)
        try:
            history = model.fit(x, y, batch_size=CONCURRENT_BATCH, shuffle=False, verbose=0)
        except Exception as e:  # pylint: disable=broad-except  (reported: the test fails)
            result["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            continue
        trained = dict(zip(map(scenario.weight_path, model.weights), model.get_weights()))
        result.update(iterations=int(model.optimizer.iterations.numpy()),
                      label_mean=[float(history.history["label_mean"][-1]), float(np.mean(y))],
                      finite=all(bool(np.isfinite(w).all()) for w in trained.values()))
        if optimizer == "sgd":
            paths = sorted(sums)
            result["weights_error"] = max(scenario.relative_errors(
                [trained[p] for p in paths],
                [initial[p] - 0.125 * sums[p][0] for p in paths]))
        if optimizer == "adagrad":
            # Built in the order of the trained weights.
            accumulators = [np.asarray(v) for v in model.optimizer.variables
                            if "accumulator" in scenario.weight_path(v)]
            result["accumulators_error"] = max(scenario.relative_errors(
                accumulators, [0.1 + sums[scenario.weight_path(w)][1]
                               for w in model.trainable_weights]))
            result["accumulators"] = len(accumulators)
    return out


def ctr_data(n, seed):
    """Ids of two tables (Zipf), dense features, clicks drawn from a fixed true model."""
    truth = np.random.default_rng(1234)
    effects = [truth.normal(0, 1, size) for size in CTR_TABLES]
    weights = truth.normal(0, 0.5, CTR_FEATURES)
    rng = np.random.default_rng(seed)
    ids = [np.minimum(rng.zipf(1.2, n) - 1, size - 1).astype("int32") for size in CTR_TABLES]
    dense = rng.normal(size=(n, CTR_FEATURES)).astype("float32")
    logits = sum(e[i] for e, i in zip(effects, ids)) + dense @ weights - 0.5
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype("float32")
    return {"t0": ids[0], "t1": ids[1], "dense": dense}, clicks


def ctr_model():
    inputs = {"t0": keras.Input((), dtype="int32", name="t0"),
              "t1": keras.Input((), dtype="int32", name="t1"),
              "dense": keras.Input((CTR_FEATURES,), name="dense")}
    embedded = [keras.layers.Embedding(size, 8, name=f"table_{i}")(inputs[f"t{i}"])
                for i, size in enumerate(CTR_TABLES)]
    x = keras.layers.Concatenate()(embedded + [inputs["dense"]])
    x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", name="click")(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


class Observer(keras.callbacks.Callback):
    """Records what callbacks see: iterations at each epoch's end, batch logs, and a
    checkpoint of the optimizer (and, with Keras 3, a weights file) written after
    batch SAVE_AT_BATCH of epoch 1."""

    def __init__(self, workdir):
        super().__init__()
        self.checkpoint = os.path.join(workdir, "mid_epoch")
        self.weights = os.path.join(workdir, "mid_epoch.weights.h5")
        self.epoch = 0
        self.iterations_at_epoch_end, self.batch_logs_with_loss = [], 0
        self.saved_after_steps = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs_with_loss += "loss" in (logs or {})
        if self.epoch == 1 and batch == SAVE_AT_BATCH:
            tf.train.Checkpoint(optimizer=self.model.optimizer).write(self.checkpoint)
            if not LEGACY:  # tf_keras weight files hold no optimizer
                self.model.save_weights(self.weights)
            self.saved_after_steps = CTR_STEPS + batch + 1

    def saved_iterations(self):
        """{"checkpoint": .., "weights file": ..}: the counter in what was written."""
        saved = {"checkpoint": int(tf.train.load_checkpoint(self.checkpoint).get_tensor(
            "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"))}
        if not LEGACY:
            with h5py.File(self.weights) as weights:
                saved["weights file"] = int(weights["optimizer/vars/0"][()])
        return saved

    def on_epoch_end(self, epoch, logs=None):
        self.iterations_at_epoch_end.append(int(self.model.optimizer.iterations.numpy()))


def convergence_case(make_strategy, workdir):
    strategy = make_strategy()
    x, y = ctr_data(CTR_BATCH * CTR_STEPS, seed=0)
    x_val, y_val = ctr_data(2048, seed=1)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = ctr_model()
    observer = Observer(workdir)
    history = model.fit(x, y, batch_size=CTR_BATCH, epochs=CTR_EPOCHS, shuffle=False,
                        verbose=0, validation_data=(x_val, y_val), callbacks=[observer])
    return {
        "loss": history.history["loss"],
        "val_auc": history.history["val_auc"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "iterations_at_epoch_end": observer.iterations_at_epoch_end,
        "batch_logs_with_loss": observer.batch_logs_with_loss,
        "saved_iterations": observer.saved_iterations(),
        "saved_after_steps": observer.saved_after_steps,
        "placement": str(strategy.placement),
        "optimizer_devices": {scenario.weight_path(v): scenario.raw_variable(v).device
                              for v in model.optimizer.variables[:2]},
    }


def transfers_case(make_strategy, workers):
    """The tensors crossing between tasks in a worker's step of the click-through
    model (two steps per worker), by pair of tasks and with their edge names."""
    strategy = make_strategy()
    x, y = ctr_data(CTR_BATCH * 2 * workers, seed=0)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = ctr_model()
    with step_transfers.RunMetadata() as metadata:
        model.fit(x, y, batch_size=CTR_BATCH, shuffle=False, verbose=0)
    return step_transfers.count_transfers(metadata.result, names=True)


LM_VOCAB, LM_SEQ, LM_BATCH, LM_STEPS, LM_EPOCHS = 64, 6, 32, 8, 3


def lm_data(n, seed):
    """Token sequences whose next token is mostly the current one plus one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, LM_VOCAB, (n, LM_SEQ + 1)).astype("int32")
    follows = rng.random((n, LM_SEQ)) < 0.9
    for t in range(LM_SEQ):
        tokens[:, t + 1] = np.where(follows[:, t], (tokens[:, t] + 1) % LM_VOCAB,
                                    tokens[:, t + 1])
    return tokens[:, :-1], tokens[:, 1:]


def language_model_case(make_strategy):
    """Embedding -> LSTM -> softmax over the vocabulary: several dense gradients come
    out of the LSTM's while loop unattributed to a table, and are reduced together."""
    strategy = make_strategy()
    x, y = lm_data(LM_BATCH * LM_STEPS, seed=0)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((LM_SEQ,), dtype="int32"),
            keras.layers.Embedding(LM_VOCAB, 16, name="embedding"),
            keras.layers.LSTM(16, return_sequences=True, name="lstm"),
            keras.layers.Dense(LM_VOCAB, name="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.02),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(LM_BATCH)
    history = model.fit(dataset, epochs=LM_EPOCHS, verbose=0)
    return {"loss": history.history["loss"],
            "iterations": int(model.optimizer.iterations.numpy())}


# The dynamic case: a table with room for every id, ids admitted at their second
# sighting (counts never forgotten), and one of few rows, ids evicting each other.
DYNAMIC_IDS, DYNAMIC_ROOMY, DYNAMIC_TIGHT = 160, 192, 24
DYNAMIC_BATCH, DYNAMIC_STEPS, DYNAMIC_SAVE_AT = 16, 48, 20


def dynamic_data():
    """Per step, DYNAMIC_BATCH distinct ids of the roomy table (so that a step sees each
    once) and two ids per example of the tight one, from DYNAMIC_IDS raw 64-bit ids."""
    rng = np.random.default_rng(11)
    universe = rng.integers(-2**62, 2**62, DYNAMIC_IDS, dtype=np.int64)
    roomy = np.concatenate([rng.choice(universe, DYNAMIC_BATCH, replace=False)
                            for _ in range(DYNAMIC_STEPS)])[:, None]
    tight = universe[rng.integers(0, DYNAMIC_IDS, (DYNAMIC_BATCH * DYNAMIC_STEPS, 2))]
    y = rng.normal(size=(len(roomy), 1)).astype("float32")
    return {"roomy": roomy, "tight": tight}, y


def dynamic_model():
    from hybrid_strategy.layers import DynamicEmbedding

    inputs = {"roomy": keras.Input((1,), dtype="int64", name="roomy"),
              "tight": keras.Input((2,), dtype="int64", name="tight")}
    roomy = DynamicEmbedding(4, DYNAMIC_ROOMY, min_count=2, name="roomy_table")(inputs["roomy"])
    tight = DynamicEmbedding(4, DYNAMIC_TIGHT, combiner="sum", name="tight_table")(
        inputs["tight"])
    x = keras.layers.Concatenate()([keras.layers.Flatten()(roomy), tight])
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def map_invariants(keys, values, free, capacity):
    """What a map's snapshot must hold whatever order concurrent steps ran in: distinct
    ids, no row held twice, rows within the capacity, and every row either held or
    free, once."""
    rows = values[:, 0][values[:, 0] >= 0]
    return {"distinct_ids": len(set(keys.tolist())) == len(keys),
            "no_row_twice": len(set(rows.tolist())) == len(rows),
            "rows_and_free_are_every_row_once": sorted(rows.tolist() + free.tolist())
            == list(range(capacity)),
            "held": int(len(rows)), "free": int(len(free))}


class SnapshotMidEpoch(keras.callbacks.Callback):
    """Saves the weights file after batch DYNAMIC_SAVE_AT (other steps still running)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_batch_end(self, batch, logs=None):
        if batch == DYNAMIC_SAVE_AT:
            self.model.save_weights(self.path)


def dynamic_case(make_strategy, workdir):
    """DynamicEmbedding tables trained by every worker at once: the maps' invariants at
    the end and in a weights file saved mid-epoch, and every id's count (the steps it
    came in) at the end, which no order of the steps changes."""
    strategy = make_strategy()
    x, y = dynamic_data()
    with strategy.scope():
        model = dynamic_model()
        model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    path = os.path.join(workdir, "mid_epoch.weights.h5")
    model.fit(x, y, batch_size=DYNAMIC_BATCH, shuffle=False, verbose=0,
              callbacks=[SnapshotMidEpoch(path)])
    out = {"iterations": int(model.optimizer.iterations.numpy())}
    expected = {}
    for key in x["roomy"][:, 0].tolist():
        expected[key] = expected.get(key, 0) + 1
    # Keras 3 names a weights file's layers by their class, in the model's order.
    dynamic = [layer.name for layer in model.layers if hasattr(layer, "remap")]
    for name, capacity in (("roomy_table", DYNAMIC_ROOMY), ("tight_table", DYNAMIC_TIGHT)):
        index = dynamic.index(name)
        layer = model.get_layer(name)
        snapshot = layer.remap.snapshot()
        keys, values = snapshot["keys"], snapshot["values"]
        record = layer.remap.rows.numpy()
        held = values[:, 0] >= 0
        table = {"end": map_invariants(keys, values, snapshot["free"], capacity),
                 "stats": layer.table_stats(),
                 "records_name_their_ids": bool(np.all(record[values[held, 0], 0] == keys[held])),
                 "remap_devices": list(layer.remap.devices)}
        with h5py.File(path) as saved:
            group = saved[f"layers/dynamic_embedding{f'_{index}' if index else ''}/vars"]
            saved_values = np.asarray(group["remap_values"]).reshape(-1, 3)
            table["mid_epoch"] = map_invariants(
                np.asarray(group["remap_keys"]), saved_values, np.asarray(group["remap_free"]),
                capacity)
            step, admissions, evictions = np.asarray(group["remap_counters"]).tolist()
            table["mid_epoch"].update(steps=step, admitted_less_evicted=admissions - evictions,
                                      counts=int(saved_values[:, 1].sum()))
        if name == "roomy_table":
            counts = dict(zip(keys.tolist(), values[:, 1].tolist()))
            table["counts_are_sightings"] = counts == expected
            table["counts"], table["sightings"] = sum(counts.values()), len(x["roomy"])
            table["admitted_are_seen_twice"] = sorted(keys[held].tolist()) == sorted(
                k for k, n in expected.items() if n >= 2)
        out[name] = table
    return out


def refusals(make_strategy):
    """What asynchronous training refuses, with the first line of each error."""
    strategy = make_strategy()
    out = {}
    try:
        strategy.distribute_datasets_from_function(
            lambda context: tf.data.Dataset.range(8).batch(4))
    except NotImplementedError as e:
        out["distribute_datasets_from_function"] = str(e)
    return out


def report(make_strategy, workers):
    out = {"workers": workers}
    if workers == 1:
        out["equivalence"] = {name: scenario.equivalence_case(make_strategy, *spec)
                              for name, spec in EQUIVALENCE_CASES.items()}
    for source in ("dataset", "numpy"):
        out[f"count_{source}"] = scenario.counting_case(make_strategy, source)
    out["linear"] = linear_case(make_strategy)
    out["linear_3_steps_per_call"] = linear_case(make_strategy, steps_per_execution=3)
    with tempfile.TemporaryDirectory() as workdir:
        out["convergence"] = convergence_case(make_strategy, workdir)
    out["language_model"] = language_model_case(make_strategy)
    if workers > 1:
        out["transfers"] = transfers_case(make_strategy, workers)
    out["refusals"] = refusals(make_strategy)
    return out


def main(argv):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--concurrent", type=int, default=0)
    parser.add_argument("--dynamic", action="store_true")
    args, argv = parser.parse_known_args(argv)
    make_strategy = scenario.strategy_maker(argv, architecture="ps", asynchronous=True)
    workers = len(json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {}).get(
        "worker", [])) or 1
    if args.concurrent:
        out = {"workers": workers, "fits": concurrent_case(make_strategy, args.concurrent)}
    elif args.dynamic:
        with tempfile.TemporaryDirectory() as workdir:
            out = {"workers": workers, "dynamic": dynamic_case(make_strategy, workdir)}
    else:
        out = report(make_strategy, workers)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
