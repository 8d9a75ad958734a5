"""How each worker gets its share of a dataset: the decisions (input/input_plan.py, pure Python)."""

import pytest

from hybrid_strategy.input import input_plan
from hybrid_strategy.input.input_plan import Pipeline, plan

IN_MEMORY = ("PrefetchDataset", "BatchDatasetV2", "MapDataset", "ShuffleDatasetV3",
             "RepeatDataset", "TensorSliceDataset")
FILES = ("PrefetchDataset", "MapDataset", "BatchDatasetV2", "MapDataset",
         "ParallelInterleaveDatasetV4")


def test_blocks_split_like_tensorflow_larger_first():
    # 7 examples over 3 replicas: 3, 2, 2 (tf.data's batch_sizes_for_worker).
    assert [input_plan.block_bounds(7, 3, r, 1) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert input_plan.worker_batch_sizes(7, num_workers=3, replicas_per_worker=1) == (3, 2, 2)
    # 2 workers x 2 replicas: replicas 3, 3, 2, 2 -> workers 6 and 4.
    assert input_plan.worker_batch_sizes(10, num_workers=2, replicas_per_worker=2) == (6, 4)


@pytest.mark.parametrize("num_rows, batch, workers, replicas, drop", [
    (100, 64, 2, 1, False), (100, 64, 2, 1, True), (97, 32, 3, 2, False),
    (5, 8, 4, 1, False), (64, 64, 2, 1, False)])
def test_worker_rows_are_the_blocks_of_every_global_batch_once(
        num_rows, batch, workers, replicas, drop):
    rows = [input_plan.worker_rows(num_rows, batch, w, workers, replicas, drop)
            for w in range(workers)]
    taken = sorted(r for starts, lengths in rows
                   for s, n in zip(starts, lengths) for r in range(s, s + n))
    kept = num_rows - (num_rows % batch if drop else 0)
    assert taken == list(range(kept))
    for starts, lengths in rows:  # one block per global batch, each inside it
        assert all(s // batch == (s + n - 1) // batch for s, n in zip(starts, lengths))
    # The last, partial batch is split as evenly as a full one.
    if num_rows % batch and not drop:
        last = [lengths[-1] for starts, lengths in rows if starts
                and starts[-1] >= num_rows // batch * batch]
        assert max(last) - min(last) <= replicas


def test_worker_rows_of_the_docstring_example():
    assert input_plan.worker_rows(100, 64, 1, 2, 1, False) == ([32, 82], [32, 18])


def test_in_memory_pipeline_is_shared_by_cutting_its_source():
    decided = plan(Pipeline(IN_MEMORY, batch_size=64, source_rows=1000), 2, 1)
    assert decided.how == input_plan.SHARE
    assert decided.split == len(IN_MEMORY) - 1 and decided.slice_source
    assert decided.worker_batches == (32, 32) and decided.notice is None
    # A repeat between: the last batch of a pass is not dropped before the blocks.
    assert not plan(Pipeline(IN_MEMORY, batch_size=64, drop_remainder=True,
                             source_rows=1000), 2, 1).drop_remainder_at_split


def test_drop_remainder_is_applied_before_the_blocks_when_every_op_keeps_every_example():
    ops = ("BatchDatasetV2", "MapDataset", "ShuffleDatasetV3", "RangeDataset")
    assert plan(Pipeline(ops, batch_size=8, drop_remainder=True), 2, 1) \
        .drop_remainder_at_split
    filtered = ("BatchDatasetV2", "FilterDataset", "RangeDataset")
    assert not plan(Pipeline(filtered, batch_size=8, drop_remainder=True), 2, 1) \
        .drop_remainder_at_split


def test_share_stops_at_the_first_op_that_does_not_act_example_by_example():
    ops = ("BatchDatasetV2", "MapDataset", "TakeDataset", "ShuffleDatasetV3",
           "TensorSliceDataset")
    # input_graph stops the chain at TakeDataset: it is the split.
    decided = plan(Pipeline(ops[:3], batch_size=8), 2, 1)
    assert decided.how == input_plan.SHARE and decided.split == 2
    assert not decided.slice_source


@pytest.mark.parametrize("files, how", [(8, input_plan.FILES), (2, input_plan.FILES),
                                        (None, input_plan.FILES), (1, input_plan.SHARE)])
def test_auto_shards_files_by_file_when_every_worker_gets_one(files, how):
    decided = plan(Pipeline(FILES, batch_size=64, files=files, reads_files=True), 2, 1)
    assert decided.how == how
    if files == 1:
        assert "reads 1 file(s), fewer than the 2 workers" in decided.notice
        assert "at least 2 files" in decided.notice and "DATA" in decided.notice


def test_file_policy_with_too_few_files_or_none_is_refused_before_training():
    with pytest.raises(input_plan.ShardingError, match="reads 1 file.*for 2 workers"):
        plan(Pipeline(FILES, batch_size=64, files=1, reads_files=True,
                      policy=input_plan.FILE), 2, 1)
    with pytest.raises(input_plan.ShardingError, match="reads no files"):
        plan(Pipeline(IN_MEMORY, batch_size=64, policy=input_plan.FILE), 2, 1)
    assert plan(Pipeline(FILES, batch_size=64, files=4, reads_files=True,
                         policy=input_plan.FILE), 2, 1).how == input_plan.FILES


def test_data_policy_shares_file_pipelines_too():
    decided = plan(Pipeline(FILES, batch_size=64, files=8, reads_files=True,
                            policy=input_plan.DATA), 2, 1)
    assert decided.how == input_plan.SHARE and decided.notice is None


@pytest.mark.parametrize("pipeline", [
    Pipeline(IN_MEMORY, batch_size=64, policy=input_plan.OFF),
    Pipeline(IN_MEMORY, batch_size=64, policy=input_plan.HINT),
    Pipeline(IN_MEMORY, batch_size=64, data_service=True),
])
def test_off_hint_and_the_data_service_are_tensorflows(pipeline):
    decided = plan(pipeline, 2, 1)
    assert decided.how == input_plan.TENSORFLOW and decided.tf_policy == pipeline.policy


@pytest.mark.parametrize("pipeline", [
    Pipeline(("MapDataset", "ZipDataset")),                           # no batch
    Pipeline(("FilterDataset", "BatchDatasetV2", "RangeDataset"), batch_size=8),
    Pipeline(IN_MEMORY, batch_size=None),                             # batch size unknown
    Pipeline(IN_MEMORY, batch_size=1),                                # fewer than workers
])
def test_what_the_share_cannot_be_taken_in_goes_to_tensorflow_by_data(pipeline):
    decided = plan(pipeline, 2, 1)
    assert decided.how == input_plan.TENSORFLOW and decided.tf_policy == input_plan.DATA


def test_one_worker_is_tensorflows():
    assert plan(Pipeline(IN_MEMORY, batch_size=64), 1, 2).how == input_plan.TENSORFLOW


def test_readers_are_recognised_in_every_version():
    assert input_plan.is_reader("TFRecordDatasetV2")
    assert input_plan.is_reader("FixedLengthRecordDataset")
    assert not input_plan.is_reader("TFRecordDatasetFoo")
    assert not input_plan.is_reader("CSVDatasetV2")
