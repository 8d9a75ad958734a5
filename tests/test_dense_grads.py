"""Tables whose gradient is dense move to mirrored; table penalties are computed on their PS.

`tests/dense_grads_scenario.py` trains a GPT-style decoder whose token table is its
output projection, and a wide & deep click model whose every table is regularized,
once per shape (two at a time): on one machine with two CPU replicas (beside
`tf.distribute.MirroredStrategy`), on a real cluster of 2 workers and 2 ps started
by the launcher under Keras 3 and under tf_keras, and on 2 workers of two CPU
replicas each (summed on their worker first) and 1 ps under Keras 3; and the regularized model once more
in tf_keras' mixed_float16 with loss scaling, beside MirroredStrategy. The in-process
tests below check what no cluster is needed for.

`--second-model` trains the decoder a second time under the same strategy (SGD, then
Adam), on one machine under Keras 3 and tf_keras and on 2 workers and 1 ps under Keras 3:
the second model's table is a new variable of the same path, checked afresh.
"""

import functools
import os
import tempfile
import warnings

import numpy as np
import pytest

import dense_grads_scenario as scenario
from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dense_grads_scenario.py")
TOLERANCE = 1e-5
MOVED = "dense gradient (moved after the first step)"
TABLES = ["deep_0/embeddings", "deep_1/embeddings", "deep_2/embeddings",
          "wide_0/embeddings", "wide_1/embeddings", "wide_2/embeddings"]
# name -> (arguments after python, Keras flavour, replicas, ps tasks)
SHAPES = {
    "one_machine": ([SCRIPT, "--local-replicas", "2"], "keras3", 2, 0),
    "2workers_2ps": (on_cluster(SCRIPT, workers=2, ps=2), "keras3", 2, 2),
    "tf_keras_2workers_2ps": (on_cluster(SCRIPT, workers=2, ps=2), "tf_keras", 2, 2),
    "2workers_of_2_replicas_1ps": (
        on_cluster(SCRIPT, workers=2, ps=1, devices_per_worker=2), "keras3", 4, 1),
}


def shape_report(shape):
    """(flavour, replicas, ps tasks, report) of the scenario on `shape`."""
    arguments, flavour, replicas, num_ps = SHAPES[shape]
    return flavour, replicas, num_ps, json_report(
        arguments, f"dense_grads_scenario on {shape}", flavour, timeout=1800)


# name -> (arguments after python, Keras flavour, replicas, ps tasks)
SECOND_MODEL = {
    "second_model_one_machine": (
        [SCRIPT, "--local-replicas", "2", "--second-model"], "keras3", 2, 0),
    "second_model_tf_keras_one_machine": (
        [SCRIPT, "--local-replicas", "2", "--second-model"], "tf_keras", 2, 0),
    "second_model_2workers_1ps": (
        on_cluster(SCRIPT, "--second-model", workers=2, ps=1), "keras3", 2, 1),
}


def second_model_report(key):
    arguments, flavour, replicas, num_ps = SECOND_MODEL[key]
    return flavour, replicas, num_ps, json_report(arguments, key, flavour, timeout=1800)


RUNS = Runs({**{shape: functools.partial(shape_report, shape) for shape in SHAPES},
             **{key: functools.partial(second_model_report, key) for key in SECOND_MODEL},
             "saved_plan": lambda: json_report(
                 [SCRIPT, "--local-replicas", "2", "--saved-plan",
                  os.path.join(tempfile.mkdtemp(prefix="saved_plan_"), "plan.json")],
                 "dense_grads_scenario with a saved placement plan", timeout=1800),
             "mixed_precision": functools.partial(
                 json_report, [SCRIPT, "--local-replicas", "2", "--mixed-precision"],
                 "dense_grads_scenario in mixed_float16", "tf_keras", timeout=1800)})


@pytest.fixture(scope="module", params=list(SHAPES))
def report(request):
    return RUNS.result(request.param)


@pytest.fixture(scope="module")
def mixed_precision():
    return RUNS.result("mixed_precision")


def on_ps(devices, num_ps):
    if num_ps:
        return all(d.startswith("/job:ps/") for d in devices)
    return devices == ["/job:localhost/replica:0/task:0/device:CPU:0"]


@pytest.mark.parametrize("case", list(scenario.CASES))
def test_trained_weights_match_single_device(report, case):
    errors = report[3][case]["vs_single_device"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (
        f"{case}: {worst} differs from single-device training by {errors[worst]:.2e}")


def test_trained_weights_match_mirrored_strategy():
    result = RUNS.result("one_machine")[3]
    # Keras 3 under MirroredStrategy: no Adam (see the scenario).
    compared = {"lm/momentum", "ctr/adagrad_clip", "ctr_norm/adagrad"}
    assert {case for case in result if "vs_mirrored" in result[case]} == compared
    for case in compared:
        errors = result[case]["vs_mirrored"]
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, (
            f"{case}: {worst} differs from MirroredStrategy by {errors[worst]:.2e}")


def test_a_tied_table_moves_to_mirrored_with_its_slots_after_the_first_step(report):
    flavour, replicas, num_ps, result = report
    case = result["lm/momentum"]
    # Evaluated before and after `fit`: the second evaluation reads the trained table.
    assert case["evaluate_loss"] == pytest.approx(case["reference_loss"], rel=TOLERANCE)
    assert case["gradient_types"]["token/embeddings"] == "dense"
    position = "add_positions/position/embeddings"
    assert case["gradient_types"][position] == "sparse"
    assert on_ps(case["devices"][position], num_ps)
    if flavour == "tf_keras":
        # tf_keras layers hold the variable itself: the table stays, and trains exactly.
        assert case["placement"]["token/embeddings"][1] == "Embedding layer"
        assert on_ps(case["devices"]["token/embeddings"], num_ps)
        (warning,) = case["warnings"]
        assert "'token/embeddings' is on a PS but gets a dense gradient" in warning
        return
    assert case["placement"]["token/embeddings"] == ["mirrored", MOVED]
    devices = case["devices"]["token/embeddings"]
    assert len(devices) == replicas and not any("/job:ps/" in d for d in devices)
    assert devices == case["devices"]["ffn/kernel"]
    # Its momentum moved with it; the position table's stays beside its table.
    assert case["slots_on_ps"] and all("position" in slot for slot in case["slots_on_ps"])
    assert case["warnings"] == []
    assert case["ps_aggregated"] == [position]


@pytest.mark.parametrize("case", ["ctr/adagrad_clip", "ctr/loop"])
def test_regularized_tables_stay_on_the_ps_with_sparse_gradients(report, case):
    flavour, _, num_ps, result = report
    result = result[case]
    tables = TABLES + (["hashed/table"] if flavour == "keras3" else [])
    for path in tables:
        assert result["placement"][path][0] != "mirrored", (path, result["placement"][path])
        assert on_ps(result["devices"][path], num_ps), path
        assert result["gradient_types"][path] == "sparse", path
    assert result["ps_aggregated"] == sorted(tables)
    assert result["warnings"] == []
    # The loss includes every penalty, computed on the PS: as on one device.
    assert result["evaluate_loss"] == pytest.approx(result["reference_loss"], rel=TOLERANCE)


def test_loss_scaling_reaches_the_penalties_gradients(mixed_precision):
    """tf_keras' mixed_float16 unscales each replica's gradient before the sum: the
    penalty's share has to be unscaled with it (it would be 32,768 times too big)."""
    result = mixed_precision["ctr/mixed_float16"]
    assert result["optimizer"] == "LossScaleOptimizerV3"
    assert all(result["gradient_types"][path] == "sparse" for path in TABLES)
    assert result["moved"] > 1.0
    errors = result["vs_mirrored"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])


def test_a_regularizer_that_is_not_a_sum_over_rows_warns_and_trains(report):
    flavour, _, num_ps, result = report
    case = result["ctr_norm/adagrad"]
    warning = case["warnings"][0]
    assert "regularizer of PS table 'deep_0/embeddings' (NormPenalty) is not a sum" in warning
    assert "placement_overrides={'deep_0/embeddings': 'mirrored'}" in warning
    assert case["gradient_types"]["deep_0/embeddings"] == "dense"
    if flavour == "keras3":
        assert case["placement"]["deep_0/embeddings"] == ["mirrored", MOVED]
        assert len(case["warnings"]) == 1
    else:
        assert on_ps(case["devices"]["deep_0/embeddings"], num_ps)
    assert case["gradient_types"]["deep_1/embeddings"] == "sparse"


@pytest.fixture(scope="module", params=list(SECOND_MODEL))
def second_model(request):
    return RUNS.result(request.param)


def test_a_second_model_under_the_same_strategy_moves_its_own_tied_table(second_model):
    flavour, replicas, num_ps, result = second_model
    for optimizer, case in result.items():
        errors = case["vs_single_device"]
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, (
            f"{optimizer}: {worst} differs from single-device training by {errors[worst]:.2e}")
        assert case["gradient_types"]["token/embeddings"] == "dense", optimizer
        if flavour == "tf_keras":
            # The table stays on its PS: each model's is warned about.
            assert on_ps(case["devices"]["token/embeddings"], num_ps), optimizer
            (warning,) = case["warnings"]
            assert "'token/embeddings' is on a PS but gets a dense gradient" in warning
            continue
        assert case["placement"]["token/embeddings"] == ["mirrored", MOVED], optimizer
        devices = case["devices"]["token/embeddings"]
        assert len(devices) == replicas and not any("/job:ps/" in d for d in devices)
        assert case["warnings"] == [], optimizer
    if flavour == "keras3":
        # Adam's slots of the second table moved with it; the position table's stayed.
        slots = result["adam"]["slots_on_ps"]
        assert slots and all("position" in slot for slot in slots)


def test_a_saved_plan_places_the_tied_table_at_once_and_trains_as_the_first_run():
    result = RUNS.result("saved_plan")
    first, second = result["first"], result["second"]
    # The first run moved the tied table after its first step; the second one, given
    # the plan it ended with, created it mirrored and moved nothing.
    assert first["revisions"] == [["token/embeddings", "ps (local CPU)", "mirrored"]]
    assert second["revisions"] == []
    assert second["placement"]["token/embeddings"] == ["mirrored", f"saved plan: {MOVED}"]
    assert second["devices"] == first["devices"]
    errors = result["vs_first"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{worst} differs from the first run by {errors[worst]:.2e}"


# In-process checks, on this process's single device ------------------------------


def test_penalties_that_are_sums_over_rows_are_recognised():
    import tensorflow as tf
    from hybrid_strategy.tables import penalties

    keras = scenario.keras
    sums = [keras.regularizers.L1(0.1), keras.regularizers.L2(0.1),
            keras.regularizers.L1L2(0.1, 0.2), scenario.SumOfSquares(0.3)]
    others = [scenario.NormPenalty(), lambda x: tf.reduce_mean(tf.square(x)),
              lambda x: tf.reduce_sum(x) ** 2, lambda x: "not a number"]
    assert [penalties.is_sum_over_rows(r, (4, 2)) for r in sums] == [True] * 4
    assert [penalties.is_sum_over_rows(r, (4,)) for r in others] == [False] * 4


def test_a_table_too_big_to_mirror_stays_and_the_warning_says_why():
    import hybrid_strategy

    strategy = hybrid_strategy.HybridStrategy(max_mirrored_bytes=1000)
    x, y = scenario.make_data("lm", scenario.GLOBAL_BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scenario.fit_model(strategy, "lm", scenario.lm().get_weights(), "adam", x, y)
    (warning,) = [str(w.message) for w in caught
                  if type(w.message).__name__ == "PlacementWarning"]
    # 64 x 8 floats, with Adam's two slots, on one replica.
    assert ("'token/embeddings' is on a PS but gets a dense gradient: the whole variable "
            "crosses the network every step. It stays on the PS: mirrored, it and its "
            f"optimizer slots would take {64 * 8 * 4 * 3:,} bytes on each worker, more "
            "than max_mirrored_bytes=1,000") in warning
    record = strategy.placement["token/embeddings"]
    assert (record.placement.kind, record.reason) == ("ps", "Embedding layer")
    assert strategy.gradient_types["token/embeddings"] == "dense"


def test_a_penalty_gradient_lost_to_a_dense_gradient_is_a_clear_error():
    """A custom loop computing the penalties before the forward pass reads the tied
    table whole after them: the tape's dense gradient has lost the penalty's."""
    import hybrid_strategy
    import tensorflow as tf

    keras = scenario.keras
    strategy = hybrid_strategy.HybridStrategy()
    with strategy.scope():
        model = scenario.lm()
        embedding = model.get_layer("token")
        embedding.embeddings.regularizer = keras.regularizers.L2(1e-3)
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    x, y = scenario.make_data("lm", scenario.GLOBAL_BATCH)
    loss = scenario.loss_object("lm")

    def replica_step(batch, target):
        with tf.GradientTape() as tape:
            penalty = tf.add_n(model.losses)
            total = loss(target, model(batch)) + penalty
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(total, variables), variables))

    step = tf.function(lambda batch, target: strategy.run(replica_step, (batch, target)))
    with pytest.raises(ValueError) as error:
        step(tf.constant(x), tf.constant(y))
    message = str(error.value)
    assert "gradient of PS table token/embeddings reached the optimizer as a dense" in message
    assert "placement_overrides={'token/embeddings': 'mirrored'}" in message
    assert np.isfinite(model.get_weights()[0]).all()
