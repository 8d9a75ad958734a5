"""Fewer tensors between tasks per step, and bfloat16 rows on the wire, on a real cluster.

`tests/wire_scenario.py` runs once as the chief of a 2-worker + 2-ps cluster (in the
background, tests/runs.py); the tests read its report: its own click model, and with
bfloat16 rows, a decoder with a tied token table and a recommender with l2-regularized
tables (from keras_examples). The rest runs in this process.
"""

import functools
import os

import numpy as np
import pytest
import tensorflow as tf

from hybrid_strategy.sharding import wire
from runs import Runs, json_report, on_cluster
from test_dense_grads import MOVED

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "wire_scenario.py")
TOLERANCE = 1e-5
# bfloat16 keeps 8 significant bits: each row rounds by at most 2**-9 of its size
# on its way, once looked up and once as a gradient. One step's update of every
# weight stays within this of the float32 step's (relative to its largest entry).
BFLOAT16_STEP_TOLERANCE = 0.01


# In the background with the session's other chief programs (tests/runs.py): run from a
# module fixture, it started only when this module's tests came up, and the session
# ended on it alone with one core idle.
RUNS = Runs({"report": functools.partial(json_report, on_cluster(SCENARIO, workers=2, ps=2),
                                         "the wire scenario")})


@pytest.fixture(scope="module")
def report():
    return RUNS.result("report")


def assert_within_tolerance(errors, tolerance=TOLERANCE):
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst} differs by {errors[worst]:.2e}"


def assert_exchanges(transfers, sent, from_ps):
    """Each worker sent each ps task `sent` tensors and got `from_ps` from ps0 and ps1."""
    for worker in ("worker0", "worker1"):
        for ps, got in zip(("ps0", "ps1"), from_ps):
            assert transfers[f"{ps}->{worker}"] == got, transfers
            assert transfers[f"{worker}->{ps}"] == sent, transfers


def test_training_with_tables_looked_up_at_once_equals_single_device(report):
    errors = report["exact"]["relative_errors"]
    assert len(errors) == 8, errors
    assert_within_tolerance(errors)


def test_a_worker_exchanges_two_tensors_with_each_ps_task_per_step(report):
    # Four tables, two of them split over both ps tasks: 6 shards, 7 lookups. Each worker
    # sends each ps task its ids of every table, then its gradients of every table (ps0,
    # which sums the dense gradients, gets those too, and from worker 0 the optimizer's
    # learning rate and step count); each ps task sends back the rows, ps0 the dense sum.
    assert_exchanges(report["exact"]["transfers"]["transfers"], sent=2, from_ps=(2, 1))


def test_no_batch_step_counter_or_id_check_crosses_between_workers(report):
    names = report["exact"]["transfers"]["names"]
    between_workers = names.get("worker0->worker1", []) + names.get("worker1->worker0", [])
    crossing = [name for name in between_workers
                if any(part in name for part in ("IteratorGetNext", "cond/output",
                                                 "OptionalGetValue", "AssignVariableOp",
                                                 "group_deps", "Assert"))]
    assert not crossing, between_workers


def test_the_chief_receives_the_steps_logs_alone(report):
    # The step's outputs wait for the chief's own side effects only: no task sends it
    # a control tensor; ps0, where the metrics' state rode with the gradients, sends the
    # logs' vector.
    names = report["exact"]["transfers"]["names"]
    to_chief = {pair: edges for pair, edges in names.items() if pair.endswith("->chief0")}
    assert list(to_chief) == ["ps0->chief0"] and len(to_chief["ps0->chief0"]) == 1, to_chief


def test_the_optimizers_variables_ride_with_the_gradients(report):
    # Adam reads the learning rate and the step count (mirrored, on the workers) for
    # each of the 4 tables (6 shards, 3 on each ps): they ride with worker 0's gradients.
    # In exact mode too: each shard's shape is read on its own ps.
    for case in ("reads", "exact_reads"):
        transfers = report[case]["transfers"]["transfers"]
        for ps in ("ps0", "ps1"):
            assert transfers["worker0->" + ps] == 2, (case, transfers)


def test_the_step_counter_has_every_step_in_every_copy(report):
    assert report["exact"]["iterations"] == 6
    assert report["exact"]["iteration_copies"] == [6, 6]


def test_several_steps_per_call_end_each_epoch_and_keep_batches_on_their_worker(report):
    # Two epochs of 7 batches, 3 steps per call: calls of 3, 3 and 1 steps each.
    case = report["multi_step"]
    assert case["calls"] == 6
    assert case["iterations"] == 14
    assert case["iteration_copies"] == [14, 14]
    assert_within_tolerance(case["relative_errors"])
    names = case["transfers"]["names"]
    between_workers = names.get("worker0->worker1", []) + names.get("worker1->worker0", [])
    crossing = [name for name in between_workers
                if any(part in name for part in ("IteratorGetNext", "Optional", "cond/output"))]
    assert not crossing, between_workers


def test_steps_reading_ahead_on_endless_data_train_as_one_device(report):
    # Two epochs of 6 batches of a repeated dataset, 3 steps per call: each step's push
    # carries the next step's ids, whose rows come back with the dense sum.
    case = report["reading_ahead"]
    assert case["calls"] == 4
    assert case["iterations"] == 12
    assert case["iteration_copies"] == [12, 12]
    assert_within_tolerance(case["relative_errors"])


def test_steps_reading_ahead_exchange_once_with_each_ps_task_per_step(report):
    # A call of 3 steps: the first step's lookup, then each step's push (with the next
    # step's ids) and what comes back (the next step's rows, and from ps0 the dense sum):
    # 4 tensors each way where steps standing alone take 6.
    assert_exchanges(report["reading_ahead"]["transfers"]["transfers"], sent=4,
                     from_ps=(4, 3))


def test_steps_reading_ahead_sum_a_slice_of_the_dense_gradients_on_each_ps_task(report):
    # Both ps tasks send every worker its next rows: each sums a slice of the dense
    # gradients, in the tensors above. Steps standing alone sum them all on ps0.
    assert set(report["reading_ahead"]["transfers"]["dense_sums"]) == {"ps0", "ps1"}
    assert set(report["exact"]["transfers"]["dense_sums"]) == {"ps0"}


def test_steps_reading_ahead_with_adamw_on_l2_tables_and_a_short_batch_train_as_one_device(
        report):
    # The data's seventh batch is short: the second epoch starts with it, inside a call,
    # then goes on from the first batch. AdamW in exact mode, l2 penalties on two tables.
    case = report["reading_ahead_variants"]
    assert case["calls"] == 4
    assert case["steps_reading_ahead"] > 0
    assert_within_tolerance(case["relative_errors"])


def test_a_tied_table_read_ahead_until_it_moves_to_mirrored_trains_as_one_device(report):
    case = report["tied_ahead"]
    assert case["steps_reading_ahead"] > 0
    assert case["placement"]["token_embedding/embeddings"] == ["mirrored", MOVED]
    assert_within_tolerance(case["relative_errors"])


def test_an_id_out_of_range_read_ahead_names_its_table(report):
    error = report["bad_id_ahead"]["error"]
    assert error is not None, "training with an id out of range did not fail"
    assert ("embedding id out of range for table user_embedding/embeddings (300 rows): "
            "ids must be in [0, 300)") in error, error


def test_a_bfloat16_step_is_the_float32_step_within_bfloat16_rounding(report):
    errors = report["bfloat16"]["update_errors"]
    assert len(errors) == 8, errors
    assert_within_tolerance(errors, BFLOAT16_STEP_TOLERANCE)
    # The rows did cross in bfloat16: the tables' updates are not float32's.
    assert max(v for k, v in errors.items() if k.endswith("/embeddings")) > 1e-5


def test_training_with_bfloat16_rows_converges_as_float32_does(report):
    float32, bfloat16 = report["convergence"]["None"], report["convergence"]["bfloat16"]
    assert len(float32) == len(bfloat16) == 40
    assert np.mean(bfloat16[-5:]) < 0.5 * bfloat16[0]
    assert abs(np.mean(bfloat16[-5:]) - np.mean(float32[-5:])) < 0.02 * np.mean(float32[-5:])


def test_an_outbox_delivers_each_part_as_it_was_sent_in_one_tensor_per_pair():
    # One device by two names: the outbox packs what goes from one to the other.
    cpu, other = "/job:localhost/replica:0/task:0/device:CPU:0", "/device:CPU:0"
    square = tf.reshape(tf.cast(tf.range(16), tf.int8), (4, 4))
    parts = [tf.constant([4, 1], tf.int64), tf.reshape(tf.range(6.0), (2, 3)),
             tf.constant(2.5, tf.bfloat16), tf.constant([True, False]),
             tf.zeros((0, 2), tf.int32), square, tf.zeros((2, 0), tf.float16)]

    def cut(part, n):
        # Every dimension of 2 or 4 becomes n (or 2n): unknown when traced.
        if part.shape.rank == 2 and part.shape[0] == part.shape[1] == 4:
            return part[:2 * n, :2 * n]
        return part[:n] if part.shape.rank and part.shape[0] == 2 else part

    @tf.function
    def delivered(n):
        outbox = wire.Outbox()
        tickets = [outbox.put(cpu, other, cut(part, n)) for part in parts]
        arrived = outbox.deliver()
        graph = tf.compat.v1.get_default_graph().get_operations()
        packing = {op for op in graph if op.name.startswith("pack/")}
        unpacking = [op for op in graph if op.name.startswith("unpack/")]
        crossing = {t.op for op in unpacking for t in op.inputs if t.op in packing}
        assert len(crossing) == 1, crossing  # one tensor crosses
        # A bitcast and a reshape (and its shape) for each part on each side, and a few
        # ops for all the sizes: each op costs tracing, and every step.
        assert len(packing) + len(unpacking) <= 10 * len(parts), (
            len(packing), len(unpacking))
        shapes = [arrived[t].shape.as_list() for t in tickets]
        assert shapes == [[None], [None, 3], [], [None], [0, 2], [None, None],
                          [None, 0]], shapes
        return [arrived[t] for t in tickets]

    for n in (2, 0, 1):
        received = delivered(tf.constant(n))
        for got, part in zip(received, parts):
            want = cut(part, n)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_an_outbox_between_one_device_and_itself_sends_nothing():
    outbox = wire.Outbox()
    value = tf.ones((2, 2))
    ticket = outbox.put("/job:localhost/replica:0/task:0/device:CPU:0", "", value)
    assert outbox.deliver()[ticket] is value


def test_rows_cast_to_bfloat16_on_the_wire_come_back_within_rounding():
    values = tf.reshape(tf.range(6.0) / 7, (3, 2))
    rounded = wire.from_wire(wire.to_wire(values, tf.bfloat16), tf.float32)
    assert rounded.dtype == tf.float32
    np.testing.assert_allclose(rounded.numpy(), values.numpy(), rtol=2 ** -8)
    assert not np.array_equal(rounded.numpy(), values.numpy())


def test_a_wire_dtype_other_than_bfloat16_is_refused_with_what_to_use():
    import hybrid_strategy
    with pytest.raises(ValueError, match=r"wire_dtype='float16'.*\('bfloat16',\)"):
        hybrid_strategy.HybridStrategy(wire_dtype="float16")


@pytest.mark.parametrize("example", ["tied_decoder", "l2_recommender"])
def test_bfloat16_rows_train_example_models_as_float32_within_rounding(report, example):
    case = report["examples"][example]
    errors = case["update_errors"]
    assert_within_tolerance(errors, BFLOAT16_STEP_TOLERANCE)
    # The rows did cross in bfloat16: some table's first update is not float32's.
    assert max(v for k, v in errors.items() if k.endswith("/embeddings")) > 1e-5
    float32, bfloat16 = case["losses"]["None"], case["losses"]["bfloat16"]
    assert len(float32) == len(bfloat16) == 20
    assert np.mean(bfloat16[-5:]) < 0.95 * bfloat16[0]
    assert abs(np.mean(bfloat16[-5:]) - np.mean(float32[-5:])) < 0.02 * np.mean(float32[-5:])


def test_a_tied_table_moves_to_mirrored_with_bfloat16_rows_too(report):
    case = report["examples"]["tied_decoder"]
    for wire_dtype in ("None", "bfloat16"):
        placement = case["placement"][wire_dtype]
        assert placement["token_embedding/embeddings"] == ["mirrored", MOVED], wire_dtype
        position = placement["add_positions/position_embedding/embeddings"]
        assert position[0] != "mirrored", wire_dtype
        assert case["gradient_types"][wire_dtype]["token_embedding/embeddings"] == "dense"


def test_l2_regularized_tables_stay_on_the_ps_with_bfloat16_rows(report):
    case = report["examples"]["l2_recommender"]
    for wire_dtype in ("None", "bfloat16"):
        for table in ("embedding_0/embeddings", "embedding_1/embeddings"):
            assert case["placement"][wire_dtype][table][0] != "mirrored", (wire_dtype, table)
            assert case["gradient_types"][wire_dtype][table] == "sparse", (wire_dtype, table)
