"""The fewest bytes per step a worker must move in synchronous data-parallel training.

    python -m benchmarks.lower_bound --model recommender --workers 2 [--global-batch N]

For N workers (one replica each) and a model whose variables get either dense gradients
(M bytes in all) or row-sparse ones (embedding tables), per worker and per step, in EACH
direction (a worker sends at least this much, and receives at least this much):

    dense:   2(N-1)/N * M           bandwidth-optimal all-reduce among the workers
                                    (ring; Patarasuk & Yuan 2009): every worker sends
                                    and receives 2(N-1)/N of every dense gradient.
    sparse:  sum over tables t of r_t * row_bytes_t
                                    r_t unique rows of table t that one worker's share of
                                    the global batch touches: pulled before the step
                                    (received) and their gradients pushed after it (sent).
                                    All-reducing the whole table instead would cost
                                    2(N-1)/N * R_t >= R_t >= r_t rows: never less.

So a worker moves at least 2 x (dense + sparse) bytes per step, sent plus received; that
is the figure printed beside the measured sent + received bytes. With rows crossing in
bfloat16 (`HybridStrategy(wire_dtype="bfloat16")`, the `hybrid-bf16` contender), the
sparse term counts 2 bytes per element instead of the table's 4: the compressed bound,
printed beside it (dense gradients still cross in float32). (The bound is often written
as 2(N-1)/N * M + 2 r row_bytes: that counts the all-reduce in one direction and
the rows in both; per direction, as here, the all-reduce term is the same and the rows
count once, and the total counts both directions of both.) With one worker nothing has
to move: the bound is 0.

The dense term is the bound for workers that all-reduce among themselves (hybrid,
allreduce, MultiWorkerMirroredStrategy). Where dense variables live on separate
parameter servers instead, a worker pushes its gradient and pulls the new value, M each
way, which is less than 2(N-1)/N * M once N > 2; the servers then carry N * M / P each
way. So an all-PS layout can read below this bound per worker (`dense_via_ps_per_direction`
gives M for comparison).

Which variables get sparse gradients, and how many unique rows a worker's share touches,
is read from the model itself: one worker's share of each of the first `--samples`
global batches of the model's own `make_dataset` is run through `model.compute_loss`
under a GradientTape (Keras 3, no strategy), and the unique indices of every
`tf.IndexedSlices` gradient are counted (this includes, for the language model, the
candidates its sampled softmax draws each step). r_t is their mean. Input data is not
counted: every worker reads its own share locally. Weight penalties (a `regularizer` on
a variable) are left out of that loss: a penalty is computed where its variable lives
(HybridStrategy computes a table's on its PS), so it moves no bytes; with it, a
regularized table's gradient would be dense.
"""

import argparse
import dataclasses
import json
import os
import sys


@dataclasses.dataclass
class Table:
    name: str
    rows: int             # R: rows of the table
    row_bytes: int        # bytes of one row
    unique_rows: float    # r: mean unique rows one worker's share touches per step
    itemsize: int = 4     # bytes of one element in the table's dtype

    def bytes_per_direction(self, workers, itemsize=None):
        """Rows pulled (or pushed) per step, each element in `itemsize` bytes (default:
        the table's own)."""
        if workers <= 1:
            return 0.0
        return self.unique_rows * self.row_bytes * (itemsize or self.itemsize) / self.itemsize


# Rows crossing in a narrower dtype (HybridStrategy(wire_dtype=...)): its bytes per element.
COMPRESSED_ROWS = ("bfloat16", 2)


def lower_bound(dense_bytes, tables, workers):
    """Per worker per step: {"dense_per_direction", "sparse_per_direction",
    "per_direction", "sent_plus_received", "tables": {name: bytes per direction},
    "compressed": the same with rows in bfloat16}."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    dense = 2 * (workers - 1) / workers * dense_bytes
    per_table = {t.name: t.bytes_per_direction(workers) for t in tables}
    sparse = sum(per_table.values())
    dtype, itemsize = COMPRESSED_ROWS
    compressed = sum(t.bytes_per_direction(workers, itemsize) for t in tables)
    return {"workers": workers, "dense_bytes": dense_bytes,
            "dense_per_direction": dense,
            "dense_via_ps_per_direction": dense_bytes if workers > 1 else 0,
            "sparse_per_direction": sparse,
            "per_direction": dense + sparse, "sent_plus_received": 2 * (dense + sparse),
            "tables": per_table,
            "compressed": {"rows_dtype": dtype, "sparse_per_direction": compressed,
                           "sent_plus_received": 2 * (dense + compressed)}}


def gradient_profile(model, batches):
    """(dense_bytes, [Table]) of a built, compiled Keras 3 model, from its gradients on
    `batches` (an iterable of (x, y) for ONE worker's share)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    variables = list(model.trainable_variables)
    unique = [[] for _ in variables]
    sparse = [None] * len(variables)
    regularizers = [v.regularizer for v in variables]
    for x, y in batches:
        for v in variables:
            v.regularizer = None
        try:
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        finally:
            for v, regularizer in zip(variables, regularizers):
                v.regularizer = regularizer
        grads = tape.gradient(loss, variables)
        for k, grad in enumerate(grads):
            if grad is None:
                continue
            is_sparse = isinstance(grad, tf.IndexedSlices)
            if sparse[k] is None:
                sparse[k] = is_sparse
            if is_sparse:
                unique[k].append(np.unique(grad.indices.numpy()).size)
    dense_bytes, tables = 0, []
    for k, v in enumerate(variables):
        shape = [int(d) for d in v.shape]
        itemsize = np.dtype(v.dtype).itemsize
        size = int(np.prod(shape)) * itemsize
        if sparse[k]:
            row = int(np.prod(shape[1:])) * itemsize
            tables.append(Table(v.path if hasattr(v, "path") else v.name, shape[0], row,
                                float(np.mean(unique[k])), itemsize))
        elif sparse[k] is not None:
            dense_bytes += size
    return dense_bytes, tables


def for_model(model_name, workers, global_batch=None, samples=8):
    """The bound for a model of benchmarks.contenders.MODELS; a JSON-able dict."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import importlib  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from benchmarks import contenders  # pylint: disable=import-outside-toplevel

    tf.get_logger().setLevel("ERROR")
    spec = contenders.MODELS[model_name]
    module = importlib.import_module(spec.module)
    batch = global_batch or spec.global_batch
    share = batch // workers
    keras.utils.set_random_seed(0)
    model = module.build_model(**spec.build)
    data = module.make_dataset(batch * samples, batch, seed=0, **spec.data)
    shares = [(tf.nest.map_structure(lambda t: t[:share], x), y[:share])
              for x, y in data.take(samples)]
    dense_bytes, tables = gradient_profile(model, shares)
    bound = lower_bound(dense_bytes, tables, workers)
    bound.update(model=model_name, global_batch=batch, worker_share=share,
                 samples=len(shares),
                 table_detail=[dataclasses.asdict(t) for t in tables])
    return bound


def describe(bound):
    lines = [f"lower bound, {bound['model']}, {bound['workers']} worker(s), global batch "
             f"{bound['global_batch']} ({bound['worker_share']} per worker), per worker "
             "per step:",
             f"  dense variables {bound['dense_bytes']:,} B -> all-reduce "
             f"{bound['dense_per_direction']:,.0f} B each way"]
    for t in bound["table_detail"]:
        lines.append(f"  table {t['name']}: {t['rows']:,} rows x {t['row_bytes']} B, "
                     f"{t['unique_rows']:,.1f} unique rows -> "
                     f"{bound['tables'][t['name']]:,.0f} B each way")
    lines.append(f"  total: {bound['per_direction']:,.0f} B each way, "
                 f"{bound['sent_plus_received']:,.0f} B sent + received")
    compressed = bound["compressed"]
    lines.append(f"  with rows in {compressed['rows_dtype']}: rows "
                 f"{compressed['sparse_per_direction']:,.0f} B each way, "
                 f"{compressed['sent_plus_received']:,.0f} B sent + received")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lower_bound",
                                     description=__doc__.split("\n", 1)[0])
    from benchmarks import contenders  # pylint: disable=import-outside-toplevel
    parser.add_argument("--model", required=True, choices=sorted(contenders.MODELS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--samples", type=int, default=8,
                        help="global batches sampled to count unique rows (default 8)")
    parser.add_argument("--json", help="also write the bound to this file")
    options = parser.parse_args(argv)
    if options.workers < 1:
        parser.error("--workers must be at least 1")
    bound = for_model(options.model, options.workers, options.global_batch, options.samples)
    print(describe(bound))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(bound, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
