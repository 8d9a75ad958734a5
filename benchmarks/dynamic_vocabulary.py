"""Raw-id tables side by side: DynamicEmbedding, Hashing, an offline vocabulary, a fixed table.

    python -m benchmarks.dynamic_vocabulary [--examples 1000000] [--batch 1024] [--dim 16]
        [--capacity-fraction 0.5] [--chunks 5] [--target-auc 0.75]
        [--variants dynamic hashing lookup fixed] [--where local cluster] [--ps 1]
        [--min-shard-bytes N] [--tfra]

The data is `benchmarks.raw_id_data.make(--examples)`: a user id and up to 5 item ids
per example, raw int64 hashes, Zipf-distributed over a universe that grows with time
(new ids keep coming), and a click from a hidden logistic model; the last 10% (in time
order) is validation. Every variant trains the same model, a user vector and the sum of
the item vectors (dim --dim each, PAD dropped), concatenated into Dense(1, sigmoid), with
Adam(0.01) on batches of --batch, one pass in --chunks chunks, and differs only in how
ids become rows:

  dynamic  `hybrid_strategy.layers.DynamicEmbedding` keyed by the raw ids, capacity
           --capacity-fraction of the training part's distinct ids (LRU eviction);
  hashing  `keras.layers.Hashing(num_bins)` + `Embedding(num_bins)`, the same number
           of rows (the same memory): distinct ids that share a bucket share a row
           (collisions counted);
  lookup   `keras.layers.IntegerLookup` with every training id as its vocabulary,
           built offline before training: the upper bound (unbounded memory, the
           future's ids known);
  fixed    ids mapped to [0, V) offline (numpy), a plain `Embedding(V + 1)`: the
           throughput of today's table on the same ids.

--where local trains in this process; --where cluster under a HybridStrategy of
1 worker + --ps ps tasks (`python -m hybrid_strategy.launch`, this file as its chief):
the tables on the ps tasks, each placed as placement decides (whole, or split over the
tasks when at least twice `min_shard_bytes`, --min-shard-bytes: by default
HybridStrategy's, 1 MiB). The variants take their chunks in turn
(chunk 1 of each, then chunk 2 of each, ...), so that load from elsewhere falls on all
alike. Per variant: examples/s over the chunks after the first (which holds the
tracing), validation AUC (exact, numpy) after each chunk, the training time until it
first reaches --target-auc, collisions or admissions/evictions. --tfra adds
TensorFlow Recommenders-Addons (benchmarks/tfra_contender.py, in its own virtualenv
with TensorFlow 2.16.2) on the same data, batch and dim, in the same run. Results:
benchmarks/results/dynamic_vocabulary.json and .md.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks import chief_runs
from benchmarks import machine
from benchmarks import raw_id_data

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = ("dynamic", "hashing", "lookup", "fixed")
WHERE = ("local", "cluster")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--capacity-fraction", type=float, default=0.5)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--target-auc", type=float, default=0.75)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--where", nargs="+", choices=WHERE, default=list(WHERE))
    parser.add_argument("--ps", type=int, default=1, help="ps tasks of --where cluster")
    parser.add_argument("--min-shard-bytes", type=int, default=None,
                        help="HybridStrategy's min_shard_bytes for --where cluster")
    parser.add_argument("--tfra", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS, "dynamic_vocabulary.json"))
    parser.add_argument("--chief", help=argparse.SUPPRESS)  # JSON file a cluster run writes
    args = parser.parse_args(argv)
    if args.examples < 10 * args.batch * args.chunks:
        parser.error("--examples must give each chunk at least 10 batches of training data")
    if args.ps < 1:
        parser.error("--ps must be at least 1")
    if not 0.0 < args.capacity_fraction <= 1.0:
        parser.error("--capacity-fraction must be in (0, 1]")
    return args


# Models ---------------------------------------------------------------------------------


def _sizes(train, fraction):
    users = len(np.unique(train["user"]))
    items = len(np.unique(train["items"][train["items"] != raw_id_data.PAD]))
    return {"users": users, "items": items,
            "user_rows": max(1, int(users * fraction)), "item_rows": max(1, int(items * fraction))}


def _model(variant, sizes, dim, train):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras = tf.keras
    from hybrid_strategy.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    user = keras.Input((1,), dtype="int64", name="user")
    items = keras.Input((train["items"].shape[1],), dtype="int64", name="items")
    mask = keras.ops.expand_dims(keras.ops.cast(keras.ops.not_equal(items, raw_id_data.PAD),
                                                "float32"), -1)
    if variant == "dynamic":
        u = DynamicEmbedding(dim, sizes["user_rows"], name="user_table")(user)
        i = DynamicEmbedding(dim, sizes["item_rows"], combiner="sum", pad_id=raw_id_data.PAD,
                             name="item_table")(items)
        u = keras.layers.Flatten()(u)
    else:
        if variant == "hashing":
            user_rows, item_rows = sizes["user_rows"], sizes["item_rows"]
            user_ids = keras.layers.Hashing(user_rows, name="user_hash")(user)
            item_ids = keras.layers.Hashing(item_rows, name="item_hash")(items)
        elif variant == "lookup":
            user_vocabulary = np.unique(train["user"])
            item_vocabulary = np.unique(train["items"][train["items"] != raw_id_data.PAD])
            user_rows, item_rows = len(user_vocabulary) + 1, len(item_vocabulary) + 1
            user_ids = keras.layers.IntegerLookup(vocabulary=user_vocabulary)(user)
            item_ids = keras.layers.IntegerLookup(vocabulary=item_vocabulary)(items)
        else:  # fixed: the inputs are already rows
            user_rows, item_rows = sizes["users"] + 1, sizes["items"] + 1
            user_ids, item_ids = user, items
        u = keras.layers.Flatten()(keras.layers.Embedding(user_rows, dim, name="user_table")(
            user_ids))
        i = keras.ops.sum(keras.layers.Embedding(item_rows, dim, name="item_table")(item_ids)
                          * mask, axis=1)
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Concatenate()([u, i]))
    return keras.Model([user, items], out)


def _fixed_ids(train, validation):
    """Both parts' ids as rows 1..V of the training part's ids (0: unseen, PAD kept 0)."""
    out = []
    for part in (train, validation):
        converted = dict(part)
        for key in ("user", "items"):
            vocabulary = np.unique(train[key][train[key] != raw_id_data.PAD])
            rows = np.searchsorted(vocabulary, part[key])
            known = (rows < len(vocabulary)) & (vocabulary[np.minimum(
                rows, len(vocabulary) - 1)] == part[key]) & (part[key] != raw_id_data.PAD)
            converted[key] = np.where(known, rows + 1, 0).astype(np.int64)
        out.append(converted)
    return out


def _collisions(model, train):
    """Share of distinct training ids whose Hashing bucket another id shares."""
    out = {}
    for key, layer in (("user", "user_hash"), ("items", "item_hash")):
        ids = np.unique(train[key][train[key] != raw_id_data.PAD])
        buckets = np.asarray(model.get_layer(layer)(ids[:, None])).ravel()
        _, inverse, counts = np.unique(buckets, return_inverse=True, return_counts=True)
        out[key] = float((counts[inverse] > 1).mean())
    return out


def run_variants(args, data, strategy=None):
    """Every variant's training and figures, their chunks taken in turn (chunk 1 of each
    variant, then chunk 2 of each, ...), so that load from elsewhere falls on all alike."""
    import contextlib  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras = tf.keras

    sizes = _sizes(data[0], args.capacity_fraction)
    parts, models = {}, {}
    for variant in args.variants:
        parts[variant] = _fixed_ids(*data) if variant == "fixed" else data
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            models[variant] = _model(variant, sizes, args.dim, parts[variant][0])
            models[variant].compile(optimizer=keras.optimizers.Adam(0.01),
                                    loss="binary_crossentropy")
    whole = len(data[0]["label"]) // args.batch
    bounds = np.linspace(0, whole, args.chunks + 1).astype(int) * args.batch
    chunks = {variant: [] for variant in args.variants}
    for start, end in zip(bounds[:-1], bounds[1:]):
        for variant in args.variants:
            (train, validation), model = parts[variant], models[variant]
            began = time.perf_counter()
            model.fit([train["user"][start:end, None], train["items"][start:end]],
                      train["label"][start:end], batch_size=args.batch, epochs=1,
                      shuffle=False, verbose=0)
            seconds = time.perf_counter() - began
            scores = model.predict([validation["user"][:, None], validation["items"]],
                                   batch_size=4096, verbose=0).ravel()
            done = chunks[variant]
            done.append({"examples": int(end - start), "seconds": seconds,
                         "trained": seconds + (done[-1]["trained"] if done else 0.0),
                         "auc": raw_id_data.auc(validation["label"], scores)})
            print(f"  {variant}: chunk {len(done)}/{args.chunks}: {end - start} examples in "
                  f"{seconds:.1f} s, validation AUC {done[-1]['auc']:.4f}", flush=True)
    return {variant: _figures(variant, chunks[variant], models[variant], parts[variant][0],
                              sizes, args) for variant in args.variants}


def _figures(variant, chunks, model, train, sizes, args):
    timed = chunks[1:]
    bounded = variant in ("dynamic", "hashing")
    out = {"examples_per_s": sum(c["examples"] for c in timed) / sum(c["seconds"] for c in timed),
           "auc": chunks[-1]["auc"], "chunks": chunks,
           "to_target_s": next((c["trained"] for c in chunks if c["auc"] >= args.target_auc),
                               None),
           "rows": {"user": sizes["user_rows"] if bounded else sizes["users"] + 1,
                    "items": sizes["item_rows"] if bounded else sizes["items"] + 1}}
    if variant == "hashing":
        out["collisions"] = _collisions(model, train)
    if variant == "dynamic":
        out["tables"] = {name: model.get_layer(f"{name}_table").table_stats()
                         for name in ("user", "item")}
    return out


# Runs -------------------------------------------------------------------------------------


def _data(args):
    return raw_id_data.split(raw_id_data.make(args.examples, seed=0), 0.1)


def run_local(args, data):
    return run_variants(args, data)


def run_chief(args):
    """As the chief of a local cluster: every variant under one HybridStrategy."""
    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    options = {} if args.min_shard_bytes is None else {"min_shard_bytes": args.min_shard_bytes}
    strategy = hybrid_strategy.HybridStrategy(**options)
    results = run_variants(args, _data(args), strategy)
    print(strategy.placement, flush=True)
    with open(args.chief, "w") as f:
        json.dump(results, f)


def run_cluster(args, argv):
    return machine.run_as_chief("benchmarks.dynamic_vocabulary", argv, args.out, ps=args.ps)


def run_tfra(args):
    out = args.out.replace(".json", "-tfra.json")
    subprocess.run([sys.executable, "-m", "benchmarks.tfra_contender", "--examples",
                    str(args.examples), "--batch", str(args.batch), "--dim", str(args.dim),
                    "--modes", "single", "ps", "--out", out], check=True)
    with open(out) as f:
        return json.load(f)


def markdown(report):
    args = report["arguments"]
    lines = [
        "# Raw-id tables side by side: DynamicEmbedding, Hashing, an offline vocabulary, "
        "a fixed table", "",
        f"Generated by `{report['command']}`", "", machine.summary(report["machine"]) + ".", "",
        f"Data: `raw_id_data.make({args['examples']})`: {report['sizes']['users']:,} "
        f"distinct users and {report['sizes']['items']:,} distinct items in the training "
        f"part; dynamic and hashing tables of {report['sizes']['user_rows']:,} and "
        f"{report['sizes']['item_rows']:,} rows ({args['capacity_fraction']:.0%} of them); "
        f"batch {args['batch']}, dim {args['dim']}, Adam(0.01), one pass in "
        f"{args['chunks']} chunks; examples/s over chunks 2 to {args['chunks']}; AUC on the "
        f"last 10% (exact); time to AUC {args['target_auc']}: training seconds until a "
        "chunk ends at or above it. The hidden model's own AUC: "
        f"{report['hidden_auc']:.4f}.", "",
        "| where | variant | examples/s | vs fixed | validation AUC | to target AUC (s) "
        "| rows (user / item) | notes |",
        "|---|---|---:|---:|---:|---:|---:|---|"]
    for where, results in report["results"].items():
        fixed = results.get("fixed", {}).get("examples_per_s")
        if where == "cluster":
            where = f"cluster (1 worker + {args.get('ps', 1)} ps)"
        for variant, r in results.items():
            notes = ""
            if "collisions" in r:
                notes = (f"ids sharing a row: {r['collisions']['user']:.1%} of users, "
                         f"{r['collisions']['items']:.1%} of items")
            if "tables" in r:
                notes = "; ".join(f"{name}: {t['admissions']:,} admitted, "
                                  f"{t['evictions']:,} evicted"
                                  for name, t in r["tables"].items())
            ratio = f"{r['examples_per_s'] / fixed:.2f}x" if fixed else ""
            target = "-" if r["to_target_s"] is None else f"{r['to_target_s']:.1f}"
            lines.append(f"| {where} | {variant} | {r['examples_per_s']:,.0f} | {ratio} | "
                         f"{r['auc']:.4f} | {target} | {r['rows']['user']:,} / "
                         f"{r['rows']['items']:,} | {notes} |")
    tfra = report.get("tfra")
    if tfra:
        lines += ["", "TensorFlow Recommenders-Addons 0.8.1 (TensorFlow 2.16.2, tf_keras; "
                  "benchmarks/tfra_contender.py) on the same data, batch and dim, in the same "
                  "run (its model: the same tables, summed items, Dense(1, sigmoid), Adam):", "",
                  "| mode | examples/s | validation AUC | outcome |", "|---|---:|---:|---|"]
        for mode, r in tfra.get("modes", {}).items():
            if "examples_per_second" in r:
                lines.append(f"| {mode} | {r['examples_per_second']:,.0f} | "
                             f"{r['validation_auc']:.4f} | ok |")
            else:
                lines.append(f"| {mode} | - | - | {r.get('error', r)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    chief_runs.main(argv, parse_args, run_chief, run_all)


def run_all(args, argv):
    """Every variant wherever --where says (and TFRA's with --tfra); the report."""
    data = _data(args)
    report = {"command": " ".join(["python -m benchmarks.dynamic_vocabulary", *argv]),
              "machine": machine.describe(), "arguments": vars(args),
              "sizes": _sizes(data[0], args.capacity_fraction),
              "hidden_auc": raw_id_data.auc(data[1]["label"], data[1]["logit"]),
              "results": {}}
    for where in args.where:
        print(f"{where}:", flush=True)
        report["results"][where] = run_local(args, data) if where == "local" else \
            run_cluster(args, argv)
    if args.tfra:
        report["tfra"] = run_tfra(args)
    machine.write_results(args.out, report, markdown(report))


if __name__ == "__main__":
    main()
