"""AdamW, Ftrl, MultiOptimizer and a LossScaleOptimizer train a recommender's PS tables.

`tests/optimizer_scenario.py` runs as the chief of a real cluster of 2 workers and
2 ps (Keras 3, and tf_keras), and of 4 workers of two CPU replicas each and 2 ps
(Keras 3: each worker's rows and sums gathered on it first; one exact and one lazy case,
the optimizers' own rules being checked on 2 workers), two runs at a time: each case
trains the recommender's three tables, split over both ps tasks, and
its MLP with `model.fit`, and compares every weight and every optimizer slot of the
tables with single-device training (dense gradients for exact mode, the lazy rule for
lazy mode).
"""

import functools
import os

import pytest

from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "optimizer_scenario.py")
TOLERANCE = 1e-5
TABLES = ["category/embeddings", "item/embeddings", "user/embeddings"]
PS = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
# name -> (Keras flavour, workers, CPU replicas per worker, cases)
SHAPES = {"keras3": ("keras3", 2, 1, ["adamw_exact", "adamw_lazy", "ftrl_exact",
                                      "multi_exact", "loss_scale_lamb_lazy"]),
          "tf_keras": ("tf_keras", 2, 1, ["adamw_exact", "adamw_lazy", "ftrl_exact"]),
          "keras3_4workers_of_2_replicas": ("keras3", 4, 2,
                                            ["adamw_exact", "loss_scale_lamb_lazy"])}


RUNS = Runs({shape: functools.partial(
    json_report, on_cluster(SCRIPT, ",".join(cases), workers=workers, ps=2,
                            devices_per_worker=devices),
    f"optimizer_scenario ({shape})", flavour)
    for shape, (flavour, workers, devices, cases) in SHAPES.items()})


@pytest.fixture(scope="module", params=list(SHAPES))
def report(request):
    """(replica devices, {case: report}) of the scenario on shape `request.param`."""
    _, workers, devices, cases = SHAPES[request.param]
    result = RUNS.result(request.param)
    assert sorted(result) == sorted(cases)
    return [f"/job:worker/replica:0/task:{i}/device:CPU:{d}"
            for i in range(workers) for d in range(devices)], result


def test_tables_and_their_slots_match_single_device_training(report):
    for name, case in report[1].items():
        errors = case["relative_errors"]
        slots = [p for p in errors if p not in case["devices"]]
        # Adam, AdamW and Ftrl keep two slots per table, Adagrad one, Lamb two.
        assert len(slots) >= 4, (name, slots)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{name}: {worst} off by {errors[worst]:.2e}"
        assert min(case["moved"][t] for t in TABLES) > 1e-2, f"{name}: tables did not train"
        if name.endswith("_lazy"):
            assert case["exact_reference_error"] > 1e-3, name


def test_tables_and_slots_on_both_ps_tasks_dense_weights_on_every_worker(report):
    replicas, cases = report
    for name, case in cases.items():
        for path, devices in case["devices"].items():
            expected = PS if path in TABLES else replicas
            assert sorted(devices) == expected, (name, path, devices)
        assert all(sorted(d) == PS for d in case["slot_devices"].values()), name
        # Each worker's rows are summed on the ps, not all-gathered among workers.
        assert case["ps_aggregated"] == TABLES, name
