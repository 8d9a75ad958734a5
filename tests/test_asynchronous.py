"""Asynchronous training (`HybridStrategy(architecture="ps", asynchronous=True)`).

tests/async_scenario.py runs once per shape (two at a time): as the chief of a real
2-worker + 1-ps cluster, and on this machine alone with two CPU replicas (one worker,
whose steps run one after the other, so that it must equal single-device training),
under Keras 3 and, on one machine, tf_keras. Its cases for 2 workers also run, under
Keras 3, on tests/test_replicas.py's cluster of 2 workers with 2 replicas each, as part
of that run. Its concurrent case runs alone on 8 workers under Keras 3 and on 4 under
tf_keras: every worker traces its step at once, in fit after fit. Its dynamic case runs
alone on 4 workers + 2 ps under Keras 3: DynamicEmbedding tables trained by every worker
at once keep their id -> row maps consistent and count every id once per step.
"""

import functools
import os

import pytest

import hybrid_strategy
from hybrid_strategy.placement import plan as placement
from runs import FAULTY_CHIEF, Runs, environ, json_report, on_cluster, python
import test_replicas

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "async_scenario.py")
TOLERANCE = 1e-5
STEPS, EPOCHS = 24, 6  # async_scenario.CTR_STEPS, CTR_EPOCHS
LM_STEPS, LM_EPOCHS = 8, 3  # async_scenario.LM_STEPS, LM_EPOCHS
CONCURRENT_STEPS, CONCURRENT_REPEATS = 16, 3  # async_scenario.CONCURRENT_STEPS; fits per run
# (workers, Keras flavour) of the concurrent runs.
CONCURRENT = {"keras3_8_workers": (8, "keras3"), "tf_keras_4_workers": (4, "tf_keras")}


def killed_worker_run():
    """FAULTY_CHIEF, training asynchronously, kills worker 1."""
    chief = FAULTY_CHIEF.replace(
        "HybridStrategy(task_timeout=10)",
        "HybridStrategy(task_timeout=10, architecture='ps', asynchronous=True)")
    assert chief != FAULTY_CHIEF
    return python(on_cluster("-c", chief, "1", "SIGKILL", workers=2, ps=1), env=environ(),
                  timeout=300)


# In the order the tests first need them.
RUNS = Runs({
    "keras3_one_machine": functools.partial(
        json_report, [SCENARIO, "--local-replicas", "2"], "async scenario on one machine"),
    "tf_keras_one_machine": functools.partial(
        json_report, [SCENARIO, "--local-replicas", "2"],
        "async scenario on one machine under tf_keras", flavour="tf_keras"),
    "cluster": functools.partial(json_report, on_cluster(SCENARIO, workers=2, ps=1),
                                 "async scenario on 2 workers"),
    "keras3_replicas": test_replicas.RUNS.job("keras3"),
    "killed_worker": killed_worker_run,
    **{key: functools.partial(
        json_report, on_cluster(SCENARIO, "--concurrent", str(CONCURRENT_REPEATS),
                                workers=workers, ps=1),
        f"async concurrent case on {workers} workers under {flavour}", flavour=flavour)
       for key, (workers, flavour) in CONCURRENT.items()},
    "dynamic": functools.partial(
        json_report, on_cluster(SCENARIO, "--dynamic", workers=4, ps=2),
        "async dynamic tables on 4 workers"),
})
CLUSTERS = ["cluster", "keras3_replicas"]


@pytest.fixture(scope="module")
def cluster():
    return RUNS.result("cluster")


@pytest.fixture(scope="module")
def dynamic():
    """DynamicEmbedding tables trained by 4 workers at once on 2 ps."""
    report = RUNS.result("dynamic")
    assert report["workers"] == 4
    return report["dynamic"]


@pytest.fixture(scope="module")
def killed_worker():
    return RUNS.result("killed_worker")


@pytest.fixture(scope="module")
def keras3_replicas():
    """2 workers of 2 replicas each (and 1 ps)."""
    return RUNS.result("keras3_replicas")[0]["asynchronous"]


@pytest.fixture(scope="module")
def keras3_one_machine():
    return RUNS.result("keras3_one_machine")


@pytest.fixture(scope="module")
def tf_keras_one_machine():
    return RUNS.result("tf_keras_one_machine")


@pytest.fixture(params=["keras3_one_machine", "tf_keras_one_machine"])
def one_machine(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=CLUSTERS)
def on_cluster_report(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=CLUSTERS + ["keras3_one_machine", "tf_keras_one_machine"])
def report(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", params=sorted(CONCURRENT))
def concurrent(request):
    """Fits whose steps every worker traces at once (async_scenario.concurrent_case)."""
    report = RUNS.result(request.param)
    assert report["workers"] == CONCURRENT[request.param][0]
    return report["fits"]


def worst(errors):
    name = max(errors, key=errors.get)
    return name, errors[name]


@pytest.mark.parametrize("case", ["adagrad", "adam_exact"])
def test_one_worker_trains_exactly_as_one_device(one_machine, case):
    # One worker with two replicas: its steps run in order, each on the whole global
    # batch split over both replicas, counters and slots on the "ps" (the local CPU).
    name, error = worst(one_machine["equivalence"][case]["relative_errors"])
    assert error <= TOLERANCE, f"{case}: {name} differs by {error:.2e}"


@pytest.mark.parametrize("source", ["dataset", "numpy"])
def test_every_example_used_once_per_epoch(report, source):
    counted = report[f"count_{source}"]
    assert counted["uses_per_example"] == [1.0] * 97
    assert counted["batches"] == 4
    assert counted["loss_finite"]


@pytest.mark.parametrize("case", ["linear", "linear_3_steps_per_call"])
def test_every_step_applied_once_whatever_the_order(report, case):
    # Gradients that do not depend on the weights: asynchronous SGD must end where
    # single-device training ends, with every step applied once (none lost, none
    # repeated by a worker that found no data left).
    result = report[case]
    assert result["moved"] > 1.0, "training did not move the weights"
    name, error = worst(result["relative_errors"])
    assert error <= TOLERANCE, f"{case}: {name} differs by {error:.2e}"
    assert result["iterations"] == 24
    trained, reference = result["evaluate"]
    assert trained == pytest.approx(reference, rel=TOLERANCE)


def test_workers_tracing_their_steps_at_once_train_to_the_end_every_time(concurrent):
    # Adagrad, Adam and SGD, one and three steps per call, a layer adding a loss and a
    # metric: Keras and the strategy keep state while a step is traced, which no
    # worker's trace may see of another's.
    assert len(concurrent) == CONCURRENT_REPEATS
    failed = [f"{fit['optimizer']}, {fit['steps_per_execution']} per call: {fit['error']}"
              for fit in concurrent if fit["error"]]
    assert not failed, "\n".join(failed)
    for fit in concurrent:
        assert fit["iterations"] == CONCURRENT_STEPS, fit
        assert fit["finite"], fit
        # Every step's metric update counted, whichever worker ran it.
        trained, expected = fit["label_mean"]
        assert trained == pytest.approx(expected, rel=TOLERANCE), fit


def test_workers_tracing_at_once_apply_every_step_once(concurrent):
    # SGD's weights and Adagrad's accumulators (sums of squared gradients) depend on
    # the gradients' sums alone, which no order of the steps changes.
    checked = 0
    for fit in concurrent:
        for key in ("weights_error", "accumulators_error"):
            if key in fit:
                checked += 1
                assert fit[key] <= TOLERANCE, fit
        if fit["optimizer"] == "adagrad":
            assert fit["accumulators"] == 3, fit  # table, kernel, bias
    assert checked == 2


@pytest.mark.parametrize("shape, replicas", [("cluster", 1), ("keras3_replicas", 2)])
def test_a_workers_step_crosses_between_tasks_in_few_tensors(request, shape, replicas):
    # From the ps: every table its layers read whole in one tensor and the looked-up
    # rows, per replica, and the end of the step's conditional; to it: the ids per
    # replica, every gradient in one tensor, the step's check for data and the
    # conditional's start; to the chief, the steps run and the logs. Nothing crosses
    # to another worker (its metrics are the step's worker's own).
    counted = request.getfixturevalue(shape)["transfers"]
    pairs = counted["transfers"]
    worker = next(pair.split("->")[0] for pair in pairs if pair.endswith("->chief0"))
    assert pairs == {f"ps0->{worker}": 1 + 2 * replicas, f"{worker}->ps0": 3 + replicas,
                     f"{worker}->chief0": 2}, counted["names"]


def test_variables_live_on_the_ps(on_cluster_report):
    for path, devices in on_cluster_report["linear"]["devices"].items():
        assert devices == ["/job:ps/replica:0/task:0/device:CPU:0"], path
    # What synchronous training mirrors is shared on the ps too.
    for path, device in on_cluster_report["convergence"]["optimizer_devices"].items():
        assert device == "/job:ps/replica:0/task:0/device:CPU:0", path
    assert "/job:worker" not in on_cluster_report["convergence"]["placement"]


def test_a_click_model_converges(report):
    result = report["convergence"]
    loss, auc = result["loss"], result["val_auc"]
    # Logistic loss from ~0.58 in the first epoch; validation AUC from ~0.60.
    assert loss[-1] < 0.52 and loss[-1] < loss[0] - 0.05, loss
    assert auc[-1] > 0.70, auc


def test_epochs_end_after_every_step_and_count_them(report):
    result = report["convergence"]
    assert result["iterations"] == STEPS * EPOCHS
    assert result["iterations_at_epoch_end"] == [STEPS * (e + 1) for e in range(EPOCHS)]
    assert result["batch_logs_with_loss"] == STEPS * EPOCHS


def test_a_checkpoint_mid_epoch_holds_every_step_handed_out(report):
    result = report["convergence"]
    assert result["saved_after_steps"] == STEPS + 6
    for saved, iterations in result["saved_iterations"].items():
        assert iterations == STEPS + 6, saved


def test_a_language_model_with_an_lstm_trains(report):
    # The LSTM's gradients leave its while loop unattributed to a table: a worker's
    # step reduces them together, over its own replicas.
    result = report["language_model"]
    loss = result["loss"]
    # Cross-entropy from ~ln(64) = 4.2; the data's own entropy is about 0.6.
    assert loss[-1] < loss[0] - 0.5, loss
    assert result["iterations"] == LM_STEPS * LM_EPOCHS


def test_datasets_from_a_function_are_refused(report):
    message = report["refusals"]["distribute_datasets_from_function"]
    assert "asynchronous=True" in message and "tf.data.Dataset" in message


@pytest.mark.parametrize("kwargs, error, message", [
    ({"asynchronous": True}, ValueError, "asynchronous=True needs architecture='ps'"),
    ({"architecture": "allreduce", "asynchronous": True}, ValueError, "architecture='ps'"),
    ({"architecture": "ps", "asynchronous": "yes"}, TypeError, "True or False"),
    ({"architecture": "ps", "asynchronous": True,
      "placement_overrides": {"dense/*": "mirrored"}}, ValueError,
     r"\['dense/\*'\] place variables 'mirrored'"),
])
def test_bad_options_are_refused_before_connecting(monkeypatch, kwargs, error, message):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(error, match=message):
        hybrid_strategy.HybridStrategy(**kwargs)


def test_placement_shares_what_synchronous_training_mirrors():
    policy = placement.PlacementPolicy("ps", num_ps=2, asynchronous=True)
    layer = ("Dense", "Layer")
    kernel = policy.decide(placement.VariableInfo("dense/kernel", (64, 8), 4, layer))
    scale = policy.decide(placement.VariableInfo("norm/scale", (), 4, layer))
    counter = policy.decide(placement.VariableInfo("adam/iteration", (), 8))
    assert kernel.kind == placement.PS
    assert scale.kind == counter.kind == placement.SHARED
    assert len(scale.shards) == len(counter.shards) == 1
    assert str(scale) == "/job:ps/task:1 (whole)"  # task 0 holds the kernel
    assert policy.plan["norm/scale"].placement == scale
    assert "adam/iteration" not in policy.plan
    synchronous = placement.PlacementPolicy("ps", num_ps=2)
    assert synchronous.decide(placement.VariableInfo("x", (), 4, layer)).kind == "mirrored"


def test_a_killed_worker_ends_the_chief_with_exit_75_naming_it(killed_worker):
    assert killed_worker.returncode == 75, killed_worker.stderr[-3000:]
    assert "training went on" not in killed_worker.stdout
    assert "/job:worker/task:1 at " in killed_worker.stderr, killed_worker.stderr[-3000:]
    assert "Exiting with code 75" in killed_worker.stderr
    assert "Traceback" not in killed_worker.stderr, killed_worker.stderr[-3000:]


DYNAMIC_STEPS, DYNAMIC_SAVE_AT, DYNAMIC_BATCH = 48, 20, 16  # async_scenario.DYNAMIC_*


@pytest.mark.parametrize("table", ["roomy_table", "tight_table"])
def test_concurrent_workers_keep_a_dynamic_tables_map_consistent(dynamic, table):
    # Each worker's step takes its admissions and evictions on the first shard, under
    # the table's lock: whatever order 4 workers' steps ran in, no id is held twice
    # (on two shards of the split table), no row twice, and every row is held or
    # free once; at the end and in a weights file saved while other steps ran.
    assert dynamic["iterations"] == DYNAMIC_STEPS
    result = dynamic[table]
    stats = result["stats"]
    assert stats["steps"] == DYNAMIC_STEPS, stats
    for when in ("end", "mid_epoch"):
        checked = result[when]
        assert checked["distinct_ids"] and checked["no_row_twice"], (when, checked)
        assert checked["rows_and_free_are_every_row_once"], (when, checked)
    assert result["end"]["held"] == stats["admissions"] - stats["evictions"] == sum(
        stats["rows_in_use"]), stats
    assert result["records_name_their_ids"]
    # The saved step counter, admissions and evictions agree with the saved map.
    mid = result["mid_epoch"]
    assert mid["steps"] == DYNAMIC_SAVE_AT + 1 and mid["held"] == mid["admitted_less_evicted"]
    if table == "tight_table":
        # Its 24 rows ran out again and again: rows were evicted and given again.
        assert stats["evictions"] > 100 and result["end"]["free"] == 0, stats
    else:
        assert len(result["remap_devices"]) == 2  # split over both ps


def test_concurrent_workers_count_every_id_once_per_step_it_came_in(dynamic):
    # The roomy table forgets no count: each id's count is the number of steps it came
    # in (each step's ids distinct), which no order of the steps changes; ids seen
    # twice hold a row. In the mid-epoch save, the counts are those of the steps the
    # saved counter counts.
    result = dynamic["roomy_table"]
    assert result["counts_are_sightings"], (result["counts"], result["sightings"])
    assert result["counts"] == result["sightings"] == DYNAMIC_STEPS * DYNAMIC_BATCH
    assert result["admitted_are_seen_twice"]
    assert result["mid_epoch"]["counts"] == result["mid_epoch"]["steps"] * DYNAMIC_BATCH
