"""Models written the ways users write them: every table on the PS, training exact.

`tests/user_models.py` trains four models (tables inside a wrapping layer, in a
subclassed model, as a custom layer's own weight read by row, three layers deep)
with SGD and Adagrad, once per shape (two at a time): on one machine with two
CPU replicas, beside `tf.distribute.MirroredStrategy` on the same replicas; on a
real cluster of 2 workers and 2 ps started by the launcher; under tf_keras on one
machine. The in-process tests below check placement overrides on one device.
"""

import functools
import os
import warnings

import numpy as np
import pytest

import user_models
from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "user_models.py")
TOLERANCE = 1e-5
CASES = [f"{model}/{optimizer}" for model in user_models.MODELS
         for optimizer in user_models.OPTIMIZERS]
# name -> (arguments after python, Keras flavour, ps tasks)
SHAPES = {
    "one_machine": ([SCRIPT, "--local-replicas", "2"], "keras3", 0),
    "2workers_2ps": (on_cluster(SCRIPT, workers=2, ps=2), "keras3", 2),
    "tf_keras_one_machine": ([SCRIPT, "--local-replicas", "2"], "tf_keras", 0),
}


# One machine only: MirroredStrategy has no cluster mode to compare with.
MIRRORED_SHAPES = [shape for shape, (_, _, num_ps) in SHAPES.items() if num_ps == 0]
# Keras 3 under MirroredStrategy applies the all-gathered rows of an IndexedSlices one
# by one: its Adagrad is not single-device training (1.6 relative on the text
# classifier), so only the exact pairs are compared with it.
MIRRORED_PAIRS = [(shape, case) for shape in MIRRORED_SHAPES for case in CASES
                  if not (SHAPES[shape][1] == "keras3" and case.endswith("/adagrad"))]

def shape_report(shape):
    """(shape, flavour, ps tasks, report) of `tests/user_models.py` on `shape`."""
    arguments, flavour, num_ps = SHAPES[shape]
    return shape, flavour, num_ps, json_report(arguments, f"user_models on {shape}", flavour,
                                               timeout=1800)


RUNS = Runs({shape: functools.partial(shape_report, shape) for shape in SHAPES})


@pytest.fixture(scope="module", params=list(SHAPES))
def report(request):
    return RUNS.result(request.param)


def read_by_row(path, flavour):
    """Whether the weight at `path` is read by row, so belongs on the PS.

    tf_keras layers hold their own weights as plain TensorFlow variables, which a
    row read cannot move: there, only `Embedding` weights go to the PS.
    """
    return path.endswith("/embeddings") or (flavour == "keras3" and path.endswith("/table"))


@pytest.mark.parametrize("case", CASES)
def test_every_weight_placed_under_its_keras_path(report, case):
    _, flavour, num_ps, result = report
    result = result[case]
    if flavour == "keras3" or not case.startswith("bags/"):
        assert sorted(result["placement"]) == sorted(result["weights"])
    # else tf_keras names the weights of layers built by a direct build() call
    # without their layer ("table"), and the plan says "bag_gather/table".
    for path in result["placement"]:
        placed = result["placement"][path]
        if not read_by_row(path, flavour):
            assert placed == "mirrored", path
            continue
        assert placed != "mirrored", f"{path} is mirrored: {result['reasons'][path]}"
        if num_ps:
            assert set(placed) <= set(range(num_ps)), path
            assert all(d.startswith("/job:ps/") for d in result["devices"][path]), path
        else:
            assert placed == [None], path
        assert result["gradient_types"][path] == "sparse", path


def test_optimizer_slots_live_beside_their_tables(report):
    _, flavour, _, result = report
    for model in user_models.MODELS:
        case = result[f"{model}/adagrad"]
        tables = [p for p in case["placement"] if read_by_row(p, flavour)]
        # Adagrad keeps one accumulator per variable.
        assert len(case["slots_on_ps"]) == len(tables), (model, case["slots_on_ps"])


def test_a_custom_training_loop_moves_row_read_weights_and_trains_exactly(report):
    _, _, _, result = report
    for optimizer in user_models.OPTIMIZERS:
        errors = result[f"bags/{optimizer}"]["custom_loop_vs_single_device"]
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, (optimizer, worst, errors[worst])


def test_paths_are_those_of_model_weights(report):
    _, flavour, _, result = report
    weights = {case: set(result[case]["weights"]) for case in CASES}
    assert {"token_and_position/token_emb/embeddings",
            "token_and_position/position_emb/embeddings"} <= weights["text_classifier/sgd"]
    if flavour == "keras3":
        assert "nested/features/query/embedding/embeddings" in weights["nested/sgd"]
        assert "recommender/item_emb/embeddings" in weights["recommender/sgd"]


@pytest.mark.parametrize("model", ["custom_weights", "bags"])
def test_row_read_weights_move_at_their_first_read(report, model):
    _, flavour, _, result = report
    case = result[f"{model}/adagrad"]
    tables = [p for p in case["placement"] if p.endswith("/table")]
    reads = {"gather", "take", "embedding_lookup"} - ({"take"} if flavour == "tf_keras" else set())
    assert {p.split("/")[-2].removeprefix("bag_") for p in tables} == reads
    if flavour == "keras3":
        assert {case["reasons"][p] for p in tables} == {"read by row (moved at its first read)"}
        assert case["warnings"] == []
    else:
        # Training stays exact; the strategy says what would be cheaper.
        for path in tables:
            assert any(f"'{path}' is mirrored but gets a sparse" in w for w in case["warnings"])


def test_embedding_models_get_no_placement_warning(report):
    _, _, _, result = report
    for model in ("text_classifier", "recommender", "nested"):
        for optimizer in user_models.OPTIMIZERS:
            assert result[f"{model}/{optimizer}"]["warnings"] == [], model


@pytest.mark.parametrize("case", CASES)
def test_trained_weights_match_single_device(report, case):
    _, _, _, result = report
    errors = result[case]["vs_single_device"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"{case}: {worst} differs from single-device training by {errors[worst]:.2e}")


@pytest.mark.parametrize("shape,case", MIRRORED_PAIRS)
def test_trained_weights_match_mirrored_strategy(shape, case):
    errors = RUNS.result(shape)[3][case]["vs_mirrored"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"{case}: {worst} differs from MirroredStrategy by {errors[worst]:.2e}")


@pytest.mark.parametrize("shape", MIRRORED_SHAPES)
def test_both_strategies_train_in_one_process(shape):
    turns = RUNS.result(shape)[3]["two_strategies"]
    assert set(turns) == {"hybrid", "mirrored", "hybrid_again", "mirrored_again"}
    assert max(turns.values()) <= TOLERANCE, turns


# In-process checks of placement overrides, on this process's single device ----


def _fit(overrides, build):
    import hybrid_strategy
    import tensorflow as tf

    strategy = hybrid_strategy.HybridStrategy(placement_overrides=overrides)
    ids, y = user_models.make_data(32)
    with strategy.scope():
        model = build()
        model.compile(optimizer=user_models.OPTIMIZERS["adagrad"](), loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(16), verbose=0)
    messages = [str(w.message) for w in caught
                if type(w.message).__name__ == "PlacementWarning"]
    return strategy, model, messages


def test_an_override_matching_nothing_warns_at_the_first_step_listing_paths():
    strategy, model, messages = _fit({"embeddings": "mirrored"}, user_models.text_classifier)
    (message,) = [m for m in messages if "match no variable" in m]
    assert "['embeddings']" in message
    assert "token_and_position/token_emb/embeddings" in message
    assert strategy.placement["token_and_position/token_emb/embeddings"].placement.kind == "ps"
    assert np.isfinite(model.get_weights()[0]).all()


def test_overrides_match_keras_paths_and_layer_names_and_pin_row_reads():
    overrides = {"nested/features/query/embedding/embeddings": "mirrored",
                 "context": "mirrored"}
    strategy, _, messages = _fit(overrides, user_models.Nested)
    kinds = {r.path: r.placement.kind for r in strategy.placement}
    assert kinds["nested/features/query/embedding/embeddings"] == "mirrored"
    assert kinds["nested/features/context/embedding/embeddings"] == "mirrored"
    assert not any("match no variable" in m for m in messages)
    # A pinned weight read by row stays where the override put it.
    strategy, _, messages = _fit({"bag_gather": "mirrored"}, user_models.custom_weights)
    assert strategy.placement["bag_gather/table"].placement.kind == "mirrored"
    assert strategy.placement["bag_take/table"].placement.kind == "ps"
    assert any("'bag_gather/table' is mirrored but gets a sparse" in m for m in messages)


class _Temperature(user_models.keras.layers.Layer):
    """Divides by a learned scalar."""

    def build(self, input_shape):
        self.temperature = self.add_weight(shape=(), name="temperature", initializer="ones")

    def call(self, x):
        return x / self.temperature


def test_a_ps_override_on_a_variable_without_rows_is_a_clear_error():
    import hybrid_strategy

    strategy = hybrid_strategy.HybridStrategy(placement_overrides={"*temperature": "ps"})
    keras = user_models.keras
    with pytest.raises(ValueError) as error:
        with strategy.scope():
            keras.Sequential([keras.Input((3,)), _Temperature(name="temp")], name="scaled")
    message = str(error.value)
    assert "placement_overrides['*temperature'] = 'ps'" in message
    assert "'scaled/temp/temperature'" in message and "needs at least one dimension" in message
