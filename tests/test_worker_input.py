"""Each worker builds only its own batches, on real clusters (tests/input_scenario.py).

One cluster of 2 workers + 1 ps runs every case under Keras 3, another, at the same
time, the cases of arrays, in-memory datasets and per-worker input functions under
tf_keras, and one more, of 4 workers with two CPU replicas each, the cases of files and
in-memory datasets under Keras 3; the tests read their reports. Examples
are counted where the workers process them (a log each dataset's map writes), and
training is compared with one device on the same global batches.
"""

import collections
import functools
import os

import pytest
import tensorflow as tf

from hybrid_strategy.input import worker_input
from runs import Runs, json_report, on_cluster

pytestmark = pytest.mark.cluster

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(HERE, "input_scenario.py")
TOLERANCE = 1e-5
ROWS = 200
# name -> (Keras flavour, the scenario's arguments, workers, CPU replicas per worker)
RUN_SHAPES = {"keras3": ("keras3", (), 2, 1),
              "tf_keras": ("tf_keras", ("one_file,in_memory,function,numpy",), 2, 1),
              "keras3_4workers_of_2_replicas": ("keras3", ("files,one_file,in_memory",), 4, 2)}


BOTH = pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
KERAS3 = pytest.mark.parametrize("flavour", ["keras3"])
# Cases whose reading depends on the number of workers: also on 4.
WORKERS = pytest.mark.parametrize(
    "flavour", ["keras3", "keras3_4workers_of_2_replicas"])
BOTH_AND_WORKERS = pytest.mark.parametrize("flavour", list(RUN_SHAPES))


RUNS = Runs({name: functools.partial(
    json_report, on_cluster(SCENARIO, *arguments, workers=workers,
                            devices_per_worker=devices),
    f"input scenario ({name})", flavour)
    for name, (flavour, arguments, workers, devices) in RUN_SHAPES.items()})


@pytest.fixture(scope="module")
def case():
    """`case(run, name)`: that case's report; one cluster run per run of RUN_SHAPES."""
    return lambda run, name: RUNS.result(run)[name]


def uses(ids):
    """How many times each example was processed: {times: number of examples}."""
    return collections.Counter(collections.Counter(ids).values())


@WORKERS
def test_files_are_read_once_per_epoch_with_nothing_read_and_dropped(case, flavour):
    files = case(flavour, "files")
    # 8 files on 2 or 4 workers: each record parsed exactly once in the epoch (no batch
    # read to build the model), and each validation record once.
    assert uses(files["parsed"]) == {1: files["records"]}
    assert uses(files["validation_parsed"]) == {1: files["validation_records"]}


@BOTH_AND_WORKERS
def test_one_file_is_sharded_by_example_after_a_notice_and_trains_exactly(case, flavour):
    one_file = case(flavour, "one_file")
    assert uses(one_file["parsed"]) == {1: ROWS}
    assert one_file["relative_error"] <= TOLERANCE
    (notice,) = one_file["notices"]   # once, for two datasets read from one file
    workers = RUN_SHAPES[flavour][2]
    assert f"reads 1 file(s), fewer than the {workers} workers" in notice


@KERAS3
def test_file_policy_with_too_few_files_is_refused_before_training(case, flavour):
    refused = case(flavour, "file_policy")
    assert "auto_shard_policy is FILE, but it reads 1 file(s) for 2 workers" in \
        refused["error"]
    assert refused["weights_unchanged"] and refused["parsed"] == []


@BOTH_AND_WORKERS
def test_in_memory_dataset_each_worker_maps_only_its_examples(case, flavour):
    in_memory = case(flavour, "in_memory")
    assert uses(in_memory["mapped"]) == {1: ROWS}
    assert in_memory["relative_error"] <= TOLERANCE


@KERAS3
def test_off_policy_gives_every_worker_the_whole_dataset(case, flavour):
    # TensorFlow's OFF, honoured: every worker processes examples of the whole dataset.
    off = case(flavour, "in_memory_off")
    assert max(uses(off["mapped"])) >= 2


@BOTH
def test_per_worker_input_function_fit_evaluate_predict(case, flavour):
    function = case(flavour, "function")
    assert function["contexts"] == [[2, 0, 16], [2, 1, 16]]
    assert function["relative_error"] <= TOLERANCE
    loss, reference = function["evaluate"]
    assert loss == pytest.approx(reference, rel=TOLERANCE)
    assert function["predicted_ids"] == list(range(ROWS))
    assert function["predictions_per_id"] == [1]
    assert function["predict_error"] <= 1e-5


CPU = "/job:worker/replica:0/task:{}/device:CPU:0"


def test_one_cpu_replica_per_worker_reads_its_datasets_iterator_with_the_options_given():
    hosts = [(CPU.format(0), (CPU.format(0),)), (CPU.format(1), (CPU.format(1),))]
    given = tf.distribute.InputOptions(experimental_per_replica_buffer_size=3)
    reading = worker_input.own_iterators(hosts, given)
    assert reading.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA
    assert not reading.experimental_fetch_to_device
    assert reading.experimental_per_replica_buffer_size == 3
    assert worker_input.own_iterators(hosts, None) == reading._replace(
        experimental_per_replica_buffer_size=1)


@pytest.mark.parametrize("hosts, options", [
    ([(CPU.format(0), (CPU.format(0), "/job:worker/replica:0/task:0/device:CPU:1"))], None),
    ([(CPU.format(0), ("/job:worker/replica:0/task:0/device:GPU:0",))], None),
    ([(CPU.format(0), (CPU.format(0),))], tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)),
    ([(CPU.format(0), (CPU.format(0),))], tf.distribute.InputOptions(
        experimental_place_dataset_on_device=True)),
], ids=["two_replicas", "gpu", "per_replica_given", "placed_on_device"])
def test_other_workers_or_options_keep_tensorflows_reading(hosts, options):
    assert worker_input.own_iterators(hosts, options) is None


@KERAS3
def test_each_worker_reads_its_one_cpu_replicas_batches_with_the_datasets_own_iterator(
        case, flavour):
    # No MultiDeviceIterator (a thread and a function call per batch) where each worker's
    # one replica runs on its host: sharded by TensorFlow, by the workers' shares, from
    # a function, from arrays, with options given.
    readers = case(flavour, "readers")
    for name in ("files", "in_memory", "function", "arrays", "options_given"):
        assert readers[name] == ["OwnedIterator", "OwnedIterator"], name


@BOTH
def test_arrays_reach_each_worker_as_its_share_and_train_exactly(case, flavour):
    arrays = case(flavour, "numpy")
    # Every array was sent to each worker as its half of the rows, nothing more.
    per_worker = collections.defaultdict(list)
    for device, rows, whole in arrays["sent"]:
        assert whole == ROWS
        per_worker[device].append(rows)
    assert sorted(per_worker) == ["/job:worker/replica:0/task:0/device:CPU:0",
                                  "/job:worker/replica:0/task:1/device:CPU:0"]
    assert all(set(rows) == {ROWS // 2} for rows in per_worker.values())
    # In chunks of at most CHUNK_BYTES (200 there), a worker's block of 256 bytes split.
    assert 0 < arrays["largest_chunk_bytes"] <= 200
    if flavour == "keras3":
        # No dataset held the arrays whole on the chief (Keras 3's adapter makes one, a
        # copy of them; tf_keras' adapter holds them as tensors already).
        assert arrays["whole_array_datasets"] == 0
    assert arrays["relative_error"] <= TOLERANCE
    assert arrays["predict_error"] <= 1e-5          # in order
    loss, reference = arrays["evaluate"]
    assert loss == pytest.approx(reference, rel=TOLERANCE)
    assert arrays["shuffled_loss"] > 0
