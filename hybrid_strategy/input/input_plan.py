"""How each worker gets its own share of a dataset: the decision, in pure Python.

A dataset distributed over W workers (each with R replicas) is described by its chain of
tf.data ops from its output down to the op that produced its examples (`Pipeline`, read
from the dataset's graph by input_graph.py). `plan()` decides, honouring the dataset's
`auto_shard_policy`:

- **files**: a pipeline reading at least W files (AUTO or FILE) is sharded by file, by
  TensorFlow: each worker reads its own files.
- **share**: otherwise (AUTO, DATA; and AUTO with fewer files than workers, after a
  notice), each worker takes its block of every global batch of examples as low in the
  pipeline as the ops allow, and batches only its block: block i of each group of B
  examples holds the examples i * B/W ... (i + 1) * B/W - 1 (sizes as TensorFlow splits a
  batch over replicas), so each global batch holds the examples it holds on one device,
  in the same order over the replicas. The block is taken just above the first op (going
  down from the batch) that does not act on examples one by one; the ops above it (maps,
  filters, shuffles, repeats) run on the worker's examples only. An in-memory source
  (`from_tensor_slices` of constants) is cut to the worker's rows instead, so a worker
  receives and touches only those.
- **tensorflow**: OFF, HINT, tf.data service pipelines, and pipelines the share cannot
  be taken in (no batch op, an op after the batch that is not known to act on whole
  batches, a batch smaller than the workers) go through TensorFlow's own distribution.

FILE with fewer files than workers, or with no file reader, is refused before training.

```python
pipeline = Pipeline(ops=("PrefetchDataset", "BatchDatasetV2", "MapDataset",
                         "TensorSliceDataset"), batch_size=64, drop_remainder=True,
                    source_rows=1000)
plan(pipeline, num_workers=2, replicas_per_worker=1)
# Plan(how='share', split=3, worker_batches=(32, 32), ..., slice_source=True)
worker_rows(100, 64, worker=1, num_workers=2, replicas_per_worker=1,
            drop_remainder=False)
# ([32, 82], [32, 18]): rows 32-63, then 82-99 of the last batch of 36
```
"""

import dataclasses

AUTO, FILE, DATA, HINT, OFF = "AUTO", "FILE", "DATA", "HINT", "OFF"
POLICIES = (AUTO, FILE, DATA, HINT, OFF)

TENSORFLOW, FILES, SHARE = "tensorflow", "files", "share"

# Batching ops: (index of the batch_size input, index of drop_remainder, -1 = last).
BATCH_OPS = {
    "BatchDataset": (1, None),
    "BatchDatasetV2": (1, -1),
    "PaddedBatchDataset": (1, None),
    "PaddedBatchDatasetV2": (1, -1),
    "ParallelBatchDataset": (1, -1),
}
# Ops after the batch that act on whole batches, whatever their size.
_OPTIONS_OPS = frozenset({
    "OptionsDataset", "ModelDataset", "OptimizeDataset", "OptimizeDatasetV2",
    "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset", "ThreadPoolDataset",
    "FinalizeDataset", "AssertNextDataset", "NonSerializableDataset",
})
BATCH_WISE = _OPTIONS_OPS | {
    "PrefetchDataset", "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2",
    "TakeDataset", "SkipDataset", "RepeatDataset", "CacheDataset", "CacheDatasetV2",
    "IgnoreErrorsDataset",
}
# Ops below the batch that the share passes, by what they do to the examples: one out
# for one in, in order; one out for one in (a permutation); some or all, in order.
ONE_TO_ONE = _OPTIONS_OPS | {
    "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2", "PrefetchDataset",
    "CacheDataset", "CacheDatasetV2",
}
PERMUTING = frozenset({"ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3"})
SUBSETTING = frozenset({"FilterDataset", "ParallelFilterDataset", "IgnoreErrorsDataset"})
REPEATING = frozenset({"RepeatDataset"})
ELEMENT_WISE = ONE_TO_ONE | PERMUTING | SUBSETTING | REPEATING
# TensorFlow's own readers, the ones its auto-sharding can shard by file.
FILE_READERS = ("ArrayRecordDataset", "FixedLengthRecordDataset", "RecordIODataset",
                "SSTableDataset", "TextLineDataset", "TFRecordDataset")
SLICEABLE_SOURCE = "TensorSliceDataset"


def is_reader(op):
    """Whether `op` is one of TensorFlow's file readers (any version: TFRecordDatasetV2)."""
    return any(op == name or (op.startswith(name) and op[len(name):].lstrip("V").isdigit())
               for name in FILE_READERS)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What `plan` needs to know of a dataset.

    Attributes:
        ops: Op types from the dataset's output down: the ops after the batch, the batch
            op, then the ops below it as long as they act on examples one by one
            (`ELEMENT_WISE`), and last the op below those (the source, for the plan).
            Without a batch op, the ops down to the first one the plan does not know.
        batch_size: The batch op's batch size if it is a constant, else None.
        drop_remainder: The batch op's drop_remainder if it is a constant, else None.
        source_rows: Rows of the last op if it is a `from_tensor_slices` of constants
            that can be cut to each worker's rows, else None.
        files: Files its readers read (the fewest, if several readers), None when it
            has no file reader TensorFlow can shard by file or their number is unknown.
        reads_files: Whether it has a file reader TensorFlow can shard by file.
        data_service: Whether it reads from the tf.data service.
        policy: Its `auto_shard_policy`, by name (`POLICIES`).
    """

    ops: tuple
    batch_size: int = None
    drop_remainder: bool = None
    source_rows: int = None
    files: int = None
    reads_files: bool = False
    data_service: bool = False
    policy: str = AUTO

    @property
    def batch_index(self):
        """Position of the batch op in `ops`, or None."""
        for i, op in enumerate(self.ops):
            if op in BATCH_OPS:
                return i
            if op not in BATCH_WISE:
                return None
        return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a dataset reaches the workers.

    Attributes:
        how: `SHARE` (each worker takes its block of the examples and batches it),
            `FILES` (TensorFlow shards it by file) or `TENSORFLOW` (TensorFlow's own
            distribution, with `tf_policy`).
        tf_policy: The policy TensorFlow applies when it distributes the dataset.
        split: SHARE: the worker's block is taken from the output of `ops[split]`.
        worker_batches: SHARE: examples each worker takes of each full global batch.
        replicas_per_worker: SHARE: each worker's replicas (its blocks split over them).
        drop_remainder_at_split: SHARE: the last, partial global batch is dropped
            before the blocks are taken (the batch drops it and every op between
            keeps each example, in order: the global batches are those of one device).
        slice_source: SHARE: the source's constants are cut to the worker's rows
            (`ops[split]` is the source) instead of taking blocks of its output.
        notice: Something the user should know, shown once.
    """

    how: str
    tf_policy: str = None
    split: int = None
    worker_batches: tuple = ()
    replicas_per_worker: int = 1
    drop_remainder_at_split: bool = False
    slice_source: bool = False
    notice: str = None


class ShardingError(ValueError):
    """The dataset cannot be sharded as its `auto_shard_policy` asks."""


def block_bounds(num_examples, parts, first, count, minimum=min):
    """[start, end) of parts first .. first + count - 1 of `num_examples` split in `parts`.

    The parts are as even as can be, the larger ones first (as TensorFlow splits a
    batch over replicas: floor(n / parts) or one more). `minimum` is `min`, or
    `tf.minimum` for tensors.
    """
    floor, extra = num_examples // parts, num_examples % parts
    return (first * floor + minimum(first, extra),
            (first + count) * floor + minimum(first + count, extra))


def worker_batch_sizes(global_batch, num_workers, replicas_per_worker):
    """Examples of each worker in a global batch: its replicas' parts."""
    replicas = num_workers * replicas_per_worker
    sizes = []
    for worker in range(num_workers):
        start, end = block_bounds(global_batch, replicas, worker * replicas_per_worker,
                                  replicas_per_worker)
        sizes.append(end - start)
    return tuple(sizes)


def worker_rows(num_rows, global_batch, worker, num_workers, replicas_per_worker,
                drop_remainder):
    """The rows of `num_rows` examples that are `worker`'s blocks, in order.

    Returns (first row, length) of each block: block k is the worker's part of the
    global batch k (rows [k * global_batch, ...)); the last, partial global batch is
    split over the replicas as evenly as a full one (or dropped with `drop_remainder`).
    """
    starts, lengths = [], []
    for first in range(0, num_rows, global_batch):
        size = min(global_batch, num_rows - first)
        if size < global_batch and drop_remainder:
            break
        start, end = block_bounds(size, num_workers * replicas_per_worker,
                                  worker * replicas_per_worker, replicas_per_worker)
        if end > start:
            starts.append(first + start)
            lengths.append(end - start)
    return starts, lengths


def plan(pipeline, num_workers, replicas_per_worker):
    """How `pipeline` reaches `num_workers` workers of `replicas_per_worker` replicas."""
    policy = pipeline.policy
    if policy not in POLICIES:
        raise ValueError(f"auto_shard_policy {policy!r} is not one of {POLICIES}.")
    if num_workers < 2 or policy in (OFF, HINT) or pipeline.data_service:
        return Plan(TENSORFLOW, tf_policy=policy)
    enough_files = pipeline.files is not None and pipeline.files >= num_workers
    if policy == FILE:
        if not pipeline.reads_files:
            raise ShardingError(
                "HybridStrategy: the dataset's auto_shard_policy is FILE, but it reads no "
                "files TensorFlow can shard by file (TFRecordDataset, TextLineDataset, "
                "FixedLengthRecordDataset, ...; from a list of file names or "
                "Dataset.list_files). Read it from files, or use AutoShardPolicy.AUTO "
                "or DATA to shard it by example.")
        if pipeline.files is not None and not enough_files:
            raise ShardingError(
                f"HybridStrategy: the dataset's auto_shard_policy is FILE, but it reads "
                f"{pipeline.files} file(s) for {num_workers} workers: some workers would "
                f"get no file. Write the data in at least {num_workers} files (a "
                f"multiple of {num_workers} balances them), or use AutoShardPolicy.AUTO "
                "or DATA to shard it by example.")
        return Plan(FILES, tf_policy=FILE)
    if policy == AUTO and pipeline.reads_files and (enough_files or pipeline.files is None):
        return Plan(FILES, tf_policy=AUTO)
    notice = None
    if policy == AUTO and pipeline.reads_files:
        notice = (f"HybridStrategy: the dataset reads {pipeline.files} file(s), fewer than "
                  f"the {num_workers} workers, so it is sharded by example: every worker "
                  "reads every file and processes only its share of the examples. To "
                  f"shard it by file (each worker reading only its own files), write the "
                  f"data in at least {num_workers} files (a multiple of {num_workers} "
                  "balances them); to silence this, set the dataset's "
                  "tf.data.Options().experimental_distribute.auto_shard_policy to DATA.")
    share = _share(pipeline, num_workers, replicas_per_worker, notice)
    if share is not None:
        return share
    # TensorFlow's AUTO would try to shard the few files and fail at the first step.
    return Plan(TENSORFLOW, tf_policy=DATA, notice=notice)


def _share(pipeline, num_workers, replicas_per_worker, notice):
    """The SHARE plan, or None where the share cannot be taken inside the pipeline."""
    batch_index = pipeline.batch_index
    if batch_index is None or not pipeline.batch_size:
        return None
    worker_batches = worker_batch_sizes(pipeline.batch_size, num_workers,
                                        replicas_per_worker)
    if min(worker_batches) == 0:
        return None
    split = len(pipeline.ops) - 1
    between = pipeline.ops[batch_index + 1:split]
    if split == batch_index:  # nothing below the batch (the batch is the source)
        return None
    keeps_batches = all(op in ONE_TO_ONE or op in PERMUTING for op in between)
    return Plan(
        SHARE, split=split, worker_batches=worker_batches,
        replicas_per_worker=replicas_per_worker,
        drop_remainder_at_split=bool(pipeline.drop_remainder) and keeps_batches,
        slice_source=(pipeline.source_rows is not None
                      and pipeline.ops[split] == SLICEABLE_SOURCE),
        notice=notice)
