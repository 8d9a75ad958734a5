"""Plain Keras work outside the strategy's scope is bit for bit the same before and after one exists.

Creating a `HybridStrategy` replaces functions of Keras, tf_keras and TensorFlow for
good; each replacement must act only under the strategy or on its tables. Each Keras
flavour runs `tests/plain_keras_scenario.py` once, alone in a fresh process (both
flavours side by side): it does the same seeded work before and after creating the
strategy, outside its scope, and reports both runs, which must be equal field by field:

- training with SGD and with Adam: initial and trained weights (sha256 of their bytes),
  every epoch's loss (exact float), optimizer variables and iterations, predictions;
- a model whose Embedding table (20000 x 64 float32) is over 4 MiB saved and loaded back
  as `.keras` (weights, optimizer state, predictions, one more epoch of training),
  `.weights.h5` (the file's datasets and the weights and optimizer state read back into a
  fresh model) and legacy full-model `.h5` (the file's datasets and the weights read
  back). Both flavours write and read all three; Keras 3 loads the `.h5` with
  `compile=False`, as it cannot deserialize that file's loss;
- `tf.shape` of a `tf.Variable` and of the table inside a `tf.function`;
- a `tf.function`'s side effects: `assign_add`/`assign`/`assign_sub` on variables, values
  appended by `tf.py_function`, lines written by `tf.print`, its trace count, and (Keras 3
  only, tf_keras has no such class) a `keras.Variable` counter.

The report also names the Keras and TensorFlow attributes the strategy replaced, so the
comparison cannot pass because no patch was in place.
"""

import functools
import os

import pytest

from runs import Runs, json_report

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "plain_keras_scenario.py")
FLAVOURS = ("keras3", "tf_keras")
SECTIONS = ("sgd", "adam", "tf_shape", "side_effects", "in_strategy_scope")

# Attributes the training and saving paths go through; at least one must be replaced for
# the second run to have exercised the strategy's patches.
TRAINING_PATH = ("keras.Model.make_train_function", "keras.Model.compile",
                 "keras.layers.Embedding.call", "keras.optimizers.Optimizer.build")

RUNS = Runs({flavour: functools.partial(json_report, [SCENARIO],
                                        f"plain Keras scenario ({flavour})", flavour)
             for flavour in FLAVOURS})


@pytest.fixture(scope="module", params=FLAVOURS)
def report(request):
    return RUNS.result(request.param)


def differences(before, after, path=""):
    """The paths (like `adam.saved.keras_file.weights[0]`) where two reports differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            where = f"{path}.{key}" if path else key
            if key not in before or key not in after:
                found.append(f"{where} (only {'after' if key in after else 'before'})")
            else:
                found += differences(before[key], after[key], where)
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after))
                for d in differences(b, a, f"{path}[{i}]")]
    return [] if before == after else [f"{path}: {before!r} before, {after!r} after"]


def test_the_strategy_was_created_and_replaced_keras_functions(report):
    assert set(TRAINING_PATH) & set(report["patched"]), (
        f"{report['flavour']}: creating the strategy replaced none of {TRAINING_PATH} "
        f"(it replaced {report['patched']}), so the second run proves nothing")
    assert report["strategy"] == {"type": "HybridStrategy", "is_distribute_strategy": True,
                                  "replicas": 1}


def test_each_run_saved_and_loaded_its_trained_weights(report):
    # Guards the comparison against equal but empty or wrong results.
    for run in ("before", "after"):
        assert set(report[run]) == set(SECTIONS), f"{run}: sections not compared"
        assert not report[run]["in_strategy_scope"]
        for optimizer in ("sgd", "adam"):
            result = report[run][optimizer]
            trained, saved = result["weights"], result["saved"]
            assert len(trained) == 5 and result["initial_weights"] != trained
            assert trained[0].startswith("float32[20000, 64]:")
            assert saved["keras_file"]["weights"] == trained, f"{run} {optimizer} .keras"
            assert saved["keras_file"]["optimizer_variables"] == result["optimizer_variables"]
            assert saved["weights_h5_file"]["weights"] == trained, f"{run} {optimizer} .weights.h5"
            assert saved["h5_file"]["weights"] == trained, f"{run} {optimizer} .h5"
        assert report[run]["side_effects"]["counter"] == 5
        assert len(report[run]["side_effects"]["appended"]) == 5


@pytest.mark.parametrize("section", SECTIONS)
def test_plain_keras_work_is_bit_for_bit_equal_after_the_strategy_exists(report, section):
    before, after = report["before"][section], report["after"][section]
    found = differences(before, after, section)
    if found:
        pytest.fail(f"{report['flavour']}: plain Keras work outside the strategy differs once "
                    f"a HybridStrategy exists, at:\n  " + "\n  ".join(found[:20]))
