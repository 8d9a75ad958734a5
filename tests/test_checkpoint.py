"""Checkpoints of PS tables round-trip on real clusters, across ps counts, and without one.

The chief programs are phases of this file, run as subprocesses that print a JSON
report (one cluster run does every case):
- `save` on 1 worker + 2 ps: trains a model whose large table is dealt over both ps
  (and a small one stays whole), saves it with tf.train.Checkpoint (CheckpointManager),
  Checkpoint.write, save_weights (.weights.h5), model.save (.keras) and
  BackupAndRestore, keeps the saved values in an npz, restores each format into a
  new model over zeroed weights, trains the saved and a restored model on (they must
  stay equal), and saves to and restores from paths a task cannot write or see;
- `restore` on 1 worker + 3 ps, and on one machine (HybridStrategy without
  TF_CONFIG), which then saves again;
- `plain`: a Keras model without any strategy restores both the 2-ps and the
  one-machine saves (for export);
- weights files that point outside themselves (crafted_h5.py, crafted in `save`): the
  `save` and one-machine phases must refuse each as `plain` does, Keras' own error, with
  and without PS tables, and load the valid ones exactly, streaming a large table;
- under tf_keras (TF_USE_LEGACY_KERAS=1), `save` on 2 ps and `restore` on 3 ps with
  tf.train.Checkpoint (while the Keras 3 phases run).
Restored weights, optimizer slots and iterations must equal the saved ones exactly.
"""

import contextlib
import json
import os
import sys

import numpy as np
import pytest

import crafted_h5
from runs import Runs, json_report, new_directory, on_cluster

pytestmark = pytest.mark.cluster

VOCAB, SMALL_VOCAB, DIM, SEQ, BATCH, EPOCHS = 1001, 37, 8, 3, 32, 2
# Small enough that the 32 KB table is dealt over every ps; the 592-byte one stays whole.
MIN_SHARD_BYTES = 1024
_CHIEF_ONLY_FD = 987
FORMATS = ("manager", "write", "weights_h5", "keras", "backup")
# tf_keras writes its own h5 files (not streamed; see README's limits).
TF_KERAS_FORMATS = ("manager", "write")


def _tf_keras():
    return os.environ.get("TF_USE_LEGACY_KERAS") == "1"


def _formats():
    return TF_KERAS_FORMATS if _tf_keras() else FORMATS


# The chief programs ---------------------------------------------------------------


def _build(keras):
    ids = keras.Input(shape=(SEQ,), dtype="int32")
    big = keras.layers.Embedding(VOCAB, DIM, name="big")(ids)
    small = keras.layers.Embedding(SMALL_VOCAB, 4, name="small")(ids % SMALL_VOCAB)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(big), keras.layers.Flatten()(small)])
    x = keras.layers.Dense(4, activation="tanh", name="hidden")(x)
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.2), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(4 * BATCH, SEQ)).astype("int32")
    return ids, np.sin(ids.sum(axis=1, keepdims=True) / 300.0).astype("float32")


def _optimizer_variables(model):
    variables = model.optimizer.variables
    return list(variables() if callable(variables) else variables)  # tf_keras: a method


def _state(model):
    return ([np.asarray(w) for w in model.get_weights()]
            + [np.asarray(v.numpy()) for v in _optimizer_variables(model)])


def _zero(model):
    for v in list(model.weights) + _optimizer_variables(model):
        v.assign(np.zeros(v.shape, getattr(v.dtype, "as_numpy_dtype", v.dtype)))


def _compare(model, reference):
    state = _state(model)
    if len(state) != len(reference):
        return {"error": f"{len(state)} values restored, {len(reference)} saved"}
    return {"max_error": max(float(np.max(np.abs(a.astype("float64") - b.astype("float64"))))
                             for a, b in zip(state, reference)),
            "iterations": int(model.optimizer.iterations.numpy()),
            "table_shards": _shards(model)}


def _shards(model):
    embeddings = model.get_layer("big").embeddings
    return getattr(getattr(embeddings, "_value", embeddings), "num_shards", None)


def _paths(directory):
    return {"manager": os.path.join(directory, "manager"),
            "write": os.path.join(directory, "written", "ckpt"),
            "weights_h5": os.path.join(directory, "model.weights.h5"),
            "keras": os.path.join(directory, "model.keras"),
            "backup": os.path.join(directory, "backup")}


def _save_all(tf, keras, model, directory):
    paths = _paths(directory)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    tf.train.CheckpointManager(checkpoint, paths["manager"], max_to_keep=1).save()
    checkpoint.write(paths["write"])
    if not _tf_keras():
        model.save_weights(paths["weights_h5"])
        model.save(paths["keras"])


def _restore(tf, keras, fmt, directory, make_model, scope):
    """A model restored from `fmt` in `directory` (over zeroed weights where it exists)."""
    paths = _paths(directory)
    if fmt == "keras":
        with scope():
            return keras.models.load_model(paths["keras"])
    with scope():
        model = make_model()
    _zero(model)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    if fmt == "manager":
        latest = tf.train.latest_checkpoint(paths["manager"])
        checkpoint.restore(latest).assert_existing_objects_matched()
    elif fmt == "write":
        checkpoint.read(paths["write"]).assert_existing_objects_matched()
    elif fmt == "weights_h5":
        model.load_weights(paths["weights_h5"])
    else:  # BackupAndRestore resumes after the saved epochs: fit runs no step.
        ids, y = _data()
        model.fit(ids, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(paths["backup"], delete_checkpoint=False)])
    return model


def _restore_all(tf, keras, directories, make_model, scope):
    out = {}
    for name, directory in directories.items():
        reference = list(np.load(os.path.join(directory, "reference.npz")).values())
        for fmt in _formats():
            if fmt == "backup" and not os.path.isdir(_paths(directory)["backup"]):
                continue
            model = _restore(tf, keras, fmt, directory, make_model, scope)
            out[f"{name}/{fmt}"] = _compare(model, reference)
    return out


def _storage_errors(tf, model, directory):
    """Saves to paths the chief can use but a ps task cannot write, or does not share,
    and restores from a path only the chief sees."""
    # /proc/self/fd/N is this process's open directory; in a ps task it is nothing.
    own = os.path.join(directory, "chief_only")
    os.makedirs(own)
    os.dup2(os.open(own, os.O_RDONLY), _CHIEF_ONLY_FD)
    out = {}
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    # ram:// is each process's own memory: a ps task's files there are not the chief's.
    for name, path in (("unwritable", f"/proc/self/fd/{_CHIEF_ONLY_FD}/ckpt"),
                       ("not_shared", "ram://hybrid_checkpoint_test/ckpt")):
        out[name] = _error_of(lambda: checkpoint.write(path))
    saved = checkpoint.write(os.path.join(directory, "readable", "ckpt"))
    for f in tf.io.gfile.glob(saved + "*"):
        tf.io.gfile.copy(f, "ram://hybrid_checkpoint_read/" + os.path.basename(f))
    out["not_shared_read"] = _error_of(
        lambda: checkpoint.read("ram://hybrid_checkpoint_read/ckpt"))
    return out


def _crafted(directory):
    return os.path.join(directory, "crafted")


def _error_of(operation):
    try:
        operation()
    except Exception as error:  # pylint: disable=broad-except
        return {"type": type(error).__name__, "error": str(error)}
    return {"error": None}


def main(argv):
    import tensorflow as tf

    keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
    phase, directory = argv[0], argv[1]
    make_model = lambda: _build(keras)  # noqa: E731
    if phase == "plain":
        restored = _restore_all(tf, keras, {"two_ps": os.path.join(directory, "two_ps"),
                                            "one_machine": os.path.join(directory, "one_machine")},
                                make_model, contextlib.nullcontext)
        print(json.dumps({"restored": restored, "keras": keras.__version__,
                          "crafted": crafted_h5.attempts(keras, _crafted(directory),
                                                         contextlib.nullcontext)}))
        return
    import hybrid_strategy

    strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES)
    scope = strategy.scope
    report = {}
    if phase == "save":
        target = os.path.join(directory, "two_ps")
        with scope():
            model = make_model()
        ids, y = _data()
        backup = [] if _tf_keras() else [keras.callbacks.BackupAndRestore(
            _paths(target)["backup"], delete_checkpoint=False)]
        model.fit(ids, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=backup)
        os.makedirs(target, exist_ok=True)
        np.savez(os.path.join(target, "reference.npz"), *_state(model))
        _save_all(tf, keras, model, target)
        report["saved_shards"] = _shards(model)
        written = os.path.dirname(_paths(target)["write"])
        report["data_file_bytes"] = sorted(
            os.path.getsize(os.path.join(written, f)) for f in os.listdir(written)
            if ".data-" in f)
        report["restored"] = _restore_all(tf, keras, {"two_ps": target}, make_model, scope)
        # Training resumed from the checkpoint goes on exactly as the saved model does.
        resumed = _restore(tf, keras, "write", target, make_model, scope)
        for m in (model, resumed):
            m.fit(ids, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        report["resumed_max_error"] = max(
            float(np.max(np.abs(a - b))) for a, b in zip(_state(model), _state(resumed)))
        if not _tf_keras():
            report["storage"] = _storage_errors(tf, model, directory)
            crafted_h5.craft(keras, _crafted(directory))  # plain files: no scope
            report["crafted"] = crafted_h5.attempts(keras, _crafted(directory), scope)
    elif phase == "restore":
        report["restored"] = _restore_all(
            tf, keras, {"two_ps": os.path.join(directory, "two_ps")}, make_model, scope)
        if strategy.cluster is None:
            # One machine saves again, for the plain model to restore.
            target = os.path.join(directory, "one_machine")
            model = _restore(tf, keras, "write", os.path.join(directory, "two_ps"),
                             make_model, scope)
            os.makedirs(target, exist_ok=True)
            np.savez(os.path.join(target, "reference.npz"), *_state(model))
            _save_all(tf, keras, model, target)
            report["crafted"] = crafted_h5.attempts(keras, _crafted(directory), scope)
    print(json.dumps(report))


# The tests ---------------------------------------------------------------------------


def _phase(phase, directory, ps=None, tf_keras=False):
    command = [os.path.abspath(__file__), phase, directory]
    if ps is not None:
        command = on_cluster(*command, workers=1, ps=ps)
    return json_report(command, f"checkpoint phase {phase} (ps={ps}, tf_keras={tf_keras})",
                       "tf_keras" if tf_keras else "keras3")


def _keras3_phases(directory):
    return {"save": _phase("save", directory, ps=2),
            "three_ps": _phase("restore", directory, ps=3),
            "one_machine": _phase("restore", directory),
            "plain": _phase("plain", directory)}


def _tf_keras_phases(directory):
    return {"save": _phase("save", directory, ps=2, tf_keras=True),
            "three_ps": _phase("restore", directory, ps=3, tf_keras=True)}


# The phases of each flavour, one after the other; both flavours at once.
RUNS = Runs({"reports": lambda: _keras3_phases(new_directory("checkpoints")),
             "tf_keras_reports": lambda: _tf_keras_phases(new_directory("tf_keras_checkpoints"))})


@pytest.fixture(scope="module")
def reports():
    return RUNS.result("reports")


@pytest.fixture(scope="module")
def tf_keras_reports():
    return RUNS.result("tf_keras_reports")


def _assert_equal_to_saved(restored, keys, shards):
    assert sorted(restored) == sorted(keys)
    for key in keys:
        case = restored[key]
        assert "error" not in case, f"{key}: {case['error']}"
        assert case["max_error"] == 0.0, f"{key}: restored values differ by {case['max_error']}"
        assert case["iterations"] == 4 * EPOCHS, f"{key}: iterations {case['iterations']}"
        assert case["table_shards"] == shards, key


def test_round_trip_on_the_cluster(reports):
    assert reports["save"]["saved_shards"] == 2
    _assert_equal_to_saved(reports["save"]["restored"],
                           [f"two_ps/{f}" for f in FORMATS], shards=2)


def test_training_resumed_from_a_checkpoint_goes_on_as_before(reports):
    assert reports["save"]["resumed_max_error"] <= 1e-6


def test_tf_keras_training_resumed_from_a_checkpoint_goes_on_as_before(tf_keras_reports):
    assert tf_keras_reports["save"]["resumed_max_error"] <= 1e-6


def test_each_ps_writes_its_own_rows(reports):
    # SaveV2 writes one data file per task: each ps's holds half the table and its slot.
    table_and_slot = 2 * VOCAB * DIM * 4
    files = reports["save"]["data_file_bytes"]
    assert len(files) >= 3, files
    assert all(size >= 0.45 * table_and_slot for size in files[-2:]), files
    assert sum(files[:-2]) < 0.1 * table_and_slot, files


def test_restore_on_three_ps_reshards(reports):
    _assert_equal_to_saved(reports["three_ps"]["restored"],
                           [f"two_ps/{f}" for f in FORMATS], shards=3)


def test_restore_on_one_machine(reports):
    _assert_equal_to_saved(reports["one_machine"]["restored"],
                           [f"two_ps/{f}" for f in FORMATS], shards=1)


def test_restore_without_a_strategy(reports):
    restored = reports["plain"]["restored"]
    # The one-machine run saved no BackupAndRestore state.
    keys = [f"two_ps/{f}" for f in FORMATS] + [f"one_machine/{f}" for f in FORMATS
                                               if f != "backup"]
    _assert_equal_to_saved(restored, keys, shards=None)


def test_tf_keras_round_trip_and_reshard(tf_keras_reports):
    keys = [f"two_ps/{f}" for f in TF_KERAS_FORMATS]
    _assert_equal_to_saved(tf_keras_reports["save"]["restored"], keys, shards=2)
    _assert_equal_to_saved(tf_keras_reports["three_ps"]["restored"], keys, shards=3)


STRATEGY_PHASES = ["save", "one_machine"]  # on 1 worker + 2 ps, and on one machine


@pytest.mark.parametrize("phase", STRATEGY_PHASES)
@pytest.mark.parametrize("defect", crafted_h5.DEFECTS)
def test_a_weights_file_pointing_outside_itself_is_refused_as_keras_refuses_it(
        reports, phase, defect):
    plain = reports["plain"]["crafted"]
    if defect not in crafted_h5.refused(reports["plain"]["keras"]):
        assert not any(f"/{defect}/" in case for case in plain)
        return  # this Keras reads it: crafted_h5.refused
    for model in crafted_h5.MODELS:
        for entry in crafted_h5.ENTRIES:
            case = f"{model}/{defect}/{entry}"
            assert plain[case]["type"] == "ValueError", f"plain Keras loaded {case}"
            assert "Not allowed: H5" in plain[case]["error"], case
            assert reports[phase]["crafted"][case] == plain[case], case


@pytest.mark.parametrize("phase, shards", [("save", 2), ("one_machine", 1), ("plain", None)])
def test_large_weights_files_load_exactly_streaming_tables(reports, phase, shards):
    # Each large variable is over checkpointing.BLOCK_BYTES: a table streams it by blocks.
    assert crafted_h5.ROWS * crafted_h5.WIDTH * 4 > 4 << 20
    for model in crafted_h5.MODELS:
        for entry in crafted_h5.ENTRIES:
            case = f"{model}/valid/{entry}"
            outcome = reports[phase]["crafted"][case]
            assert outcome["error"] is None, f"{case}: {outcome['error']}"
            assert outcome["max_error"] == 0.0, case
            assert outcome["table_shards"] == (shards if model == "table" else None), case


@pytest.mark.parametrize("phase", STRATEGY_PHASES)
def test_safe_mode_refuses_a_lambda_under_a_strategy_as_without(reports, phase):
    expected = reports["plain"]["crafted"]["lambda/safe_mode/keras"]
    assert expected["type"] == "ValueError" and "safe_mode=False" in expected["error"]
    assert reports[phase]["crafted"]["lambda/safe_mode/keras"] == expected


@pytest.mark.parametrize("rows, saved, restored", [(7, 3, 2), (10, 2, 3), (5, 1, 4),
                                                    (9, 4, 1), (3, 2, 3)])
def test_row_blocks_restore_into_any_sharding_and_a_plain_variable(tmp_path, rows, saved,
                                                                   restored):
    import tensorflow as tf
    from hybrid_strategy.keras_integration import checkpoint_hooks
    from hybrid_strategy.tables import table as table_lib

    checkpoint_hooks.install()
    whole = np.arange(rows * 2, dtype="float32").reshape(rows, 2)

    def dealt(values, shards):
        return table_lib.ShardedTable([tf.Variable(values[k::shards]) for k in range(shards)],
                                      "t/embeddings")

    path = tf.train.Checkpoint(t=dealt(whole, saved)).write(str(tmp_path / "ckpt"))
    target = dealt(np.zeros_like(whole), restored)
    tf.train.Checkpoint(t=target).read(path).assert_consumed()
    np.testing.assert_array_equal(target.numpy(), whole)
    plain = tf.Variable(np.zeros_like(whole))
    tf.train.Checkpoint(t=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), whole)
    # A plain variable's checkpoint restores into a table.
    path = tf.train.Checkpoint(t=tf.Variable(whole + 1)).write(str(tmp_path / "plain"))
    tf.train.Checkpoint(t=target).read(path).assert_consumed()
    np.testing.assert_array_equal(target.numpy(), whole + 1)


@pytest.mark.parametrize("case, says", [
    ("unwritable", "cannot write the checkpoint directory"),
    ("not_shared", "on storage the chief does not see"),
    ("not_shared_read", "it finds no ram://hybrid_checkpoint_read/ckpt.index"),
])
def test_a_path_a_task_cannot_use_is_a_clear_error(reports, case, says):
    error = reports["save"]["storage"][case]
    assert error["error"] is not None, f"using the {case} path did not fail"
    assert error["type"] == "CheckpointStorageError"
    assert says in error["error"]
    assert "/job:ps/replica:0/task:0" in error["error"]
    assert "shared filesystem" in error["error"]


if __name__ == "__main__":
    main(sys.argv[1:])
