"""A PS table trains under mixed_float16 and mixed_bfloat16 as on one device, by its rows.

`tests/mixed_precision_scenario.py` runs as the chief of a real cluster of 2 workers
and 1 ps (Keras 3): under each policy it trains a model with a table on the ps, and
the same model from the same weights on one device, whose first step overflows
float16 (Keras' LossScaleOptimizer skips it and halves its scale). The weights must
agree within about one rounding of the policy's compute dtype, the table's gradient
must stay row-sparse, and no traced step may hold a tensor with the table's rows:
Keras 3's loss scaling checks gradients for non-finite values with a dense boolean
copy of every `IndexedSlices` (loss_scaling.py), which made a step cost the table.
"""

import os

import pytest

from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mixed_precision_scenario.py")
TABLE = "item/embeddings"
# float16 keeps 11 significant bits (a rounding of ~5e-4), bfloat16 8 (~4e-3); the
# replicas' halves of a batch are rounded apart, the one device's batch at once.
TOLERANCES = {"mixed_float16": 2e-3, "mixed_bfloat16": 8e-3}

RUNS = Runs({"report": lambda: json_report(on_cluster(SCRIPT, workers=2, ps=1),
                                           "mixed_precision_scenario", timeout=300)})


@pytest.fixture(scope="module")
def report():
    return RUNS.result("report")


@pytest.mark.parametrize("policy", sorted(TOLERANCES))
def test_weights_match_one_device_training_under_the_same_policy(report, policy):
    case = report[policy]
    errors = case["relative_errors"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCES[policy], f"{policy}: {worst} off by {errors[worst]:.2e}"
    assert case["moved"] > 1e-3, f"{policy}: the table did not train"
    assert case["optimizer"] == case["reference_optimizer"], policy
    if policy == "mixed_float16":
        # The first step overflowed and was skipped, on both sides.
        assert case["optimizer"] == {"class": "LossScaleOptimizer", "loss_scale": 2.0 ** 14}


@pytest.mark.parametrize("policy", sorted(TOLERANCES))
def test_table_stays_on_the_ps_and_is_updated_by_row(report, policy):
    case = report[policy]
    assert case["table_devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"], policy
    assert case["gradient_types"][TABLE] == "sparse", policy
    assert case["ps_aggregated"] == [TABLE], policy
    assert case["table_sized_ops"] == [], policy
