"""Memory of the ps under ids that never repeat: a DynamicEmbedding stays within its capacity.

    python -m benchmarks.dynamic_memory [--capacity 200000] [--dim 32] [--steps 400]
        [--batch 4096] [--min-count 1 2] [--admission exact sketch]
        [--zipf-examples 1000000] [--out ...]

For each --min-count and --admission (a sketch only counts ids waiting for a
min_count of 2 or more), starts a cluster of 1 worker + 1 ps
(`python -m hybrid_strategy.launch`) and runs this file as its chief (`--chief`): a
model of one DynamicEmbedding (capacity --capacity, dim --dim, Adagrad: one slot) and
Dense(1) trains --steps steps of --batch ids that never repeat (step s holds ids
s * batch ... (s + 1) * batch - 1, spread over int64 by splitmix64), while the chief
reads the ps's VmRSS before the model is built and every 10 steps. With min_count 1
every id is admitted, so rows are evicted from the step the table is full; with 2 no
id is ever admitted (but the few a sketch admits early) and the ids waiting for
admission are bounded instead: by max_waiting (the capacity) map entries, or by the
sketch's fixed size. Reported: the ps's RSS at the start, once the table is full and
at the end, the ids the map holds, and the bytes of the waiting ids' counts (map
entries at MAP_ENTRY_BYTES each, an estimate, or the sketch's bytes, exact).

Then, in this process, the admissions of exact counting and of a sketch on one Zipf
stream of raw ids (`raw_id_data.make(--zipf-examples)`'s users, batches of --batch):
exact counting keeping every waiting id, a sketch sized for every id the stream
holds (it never halves: its early admissions against its stated error), and one
sized for an eighth of them (it halves). Results: benchmarks/results/dynamic_memory.json
and .md (--out).
"""

import argparse
import json
import os

import numpy as np

from benchmarks import chief_runs
from benchmarks import machine
from benchmarks import raw_id_data

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ERROR = 0.01   # the sketches' admission_error


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--min-count", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--admission", nargs="+", choices=["exact", "sketch"],
                        default=["exact", "sketch"])
    parser.add_argument("--zipf-examples", type=int, default=1_000_000,
                        help="0: no comparison of admissions on a Zipf stream")
    parser.add_argument("--out", default=os.path.join(RESULTS, "dynamic_memory.json"))
    parser.add_argument("--chief", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps * args.batch < 2 * args.capacity:
        parser.error("--steps x --batch must be at least twice --capacity (the table must "
                     "fill, then turn over)")
    return args


def _rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def run_chief(args):
    """One variant (`--min-count M --admission A`) on this cluster."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import hybrid_strategy  # pylint: disable=import-outside-toplevel
    from hybrid_strategy.layers import dynamic_embedding  # pylint: disable=import-outside-toplevel
    keras = tf.keras

    (min_count,), (admission,) = args.min_count, args.admission
    ps = machine.server_pids()["ps0"]
    strategy = hybrid_strategy.HybridStrategy()
    rss_start = _rss_mib(ps)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((1,), dtype="int64"),
            hybrid_strategy.DynamicEmbedding(args.dim, args.capacity, min_count=min_count,
                                             admission=admission, admission_error=ERROR,
                                             name="ids"),
            keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer="adagrad", loss="mse")
    layer = model.get_layer("ids")
    samples = []

    class Sample(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch % 10 == 0 or batch == args.steps - 1:
                samples.append((batch + 1, _rss_mib(ps)))

    ids = raw_id_data.splitmix64(np.arange(args.steps * args.batch, dtype=np.uint64))
    model.fit(ids[:, None], np.zeros((len(ids), 1), "float32"), batch_size=args.batch,
              shuffle=False, verbose=0, callbacks=[Sample()])
    full = next(step for step, _ in samples if step * args.batch >= args.capacity * 1.2)
    stats = layer.table_stats()
    held = int(sum(int(t.size().numpy()) for t in layer.remap.shards))
    waiting = held - sum(stats["rows_in_use"])
    result = {
        "samples": samples, "full_at_step": full, "rss_start_mib": rss_start,
        "rss_full_mib": dict(samples)[full], "rss_end_mib": samples[-1][1],
        "rss_max_after_full_mib": max(r for s, r in samples if s >= full),
        "ids_held": held, "waiting_in_map": waiting,
        "waiting_bytes": (layer.remap.sketch.nbytes if layer.remap.sketch is not None
                          else waiting * dynamic_embedding.MAP_ENTRY_BYTES),
        "stats": stats}
    print(f"min_count {min_count}, {admission}: ps RSS {result['rss_full_mib']:.0f} MiB at "
          f"step {full}, {result['rss_end_mib']:.0f} MiB at the end; waiting ids' counts "
          f"{result['waiting_bytes']:,} bytes; {stats}", flush=True)
    with open(args.chief, "w") as f:
        json.dump(result, f)


def _first_admissions(remap, batches):
    """{key: the step its id got a row at}, and its count then, over `batches`."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    first = {}
    for step, ids in enumerate(batches):
        distinct, _, counts = tf.unique_with_counts(tf.constant(ids), out_idx=tf.int64)
        rows = remap.train(distinct, counts, lambda rows, keys: []).numpy()
        for key in distinct.numpy()[rows >= 0]:
            first.setdefault(int(key), step)
    return first


def compare_admissions(examples, batch, min_count=2):
    """Exact counting and sketches on raw_id_data's user ids (Zipf, new ids over time),
    each against exact counting that keeps every waiting id."""
    from hybrid_strategy.layers import dynamic_embedding  # pylint: disable=import-outside-toplevel
    from hybrid_strategy.tables import dynamic  # pylint: disable=import-outside-toplevel

    users = raw_id_data.make(examples, seed=0)["user"]
    batches = [users[i:i + batch] for i in range(0, len(users), batch)]
    distinct = len(np.unique(users))

    def remap(admission, max_waiting):  # rows for every id
        return dynamic.Remap(distinct, ["/cpu:0"], min_count, max_waiting=max_waiting,
                             admission=admission, admission_error=ERROR)

    by_exact = _first_admissions(remap("exact", distinct), batches)
    never = distinct - len(by_exact)
    out = {"examples": examples, "batch": batch, "min_count": min_count, "error": ERROR,
           "distinct_ids": distinct, "admitted_exact": len(by_exact),
           "never_admitted_exact": never, "variants": []}
    few = distinct // 8
    # The sketch as large as few exact entries: as many ids as 48 bytes each hold.
    same_bytes = few * dynamic_embedding.MAP_ENTRY_BYTES * distinct // sketch_bytes(
        distinct, min_count)
    for admission, max_waiting in (("sketch", distinct), ("exact", few), ("sketch", few),
                                   ("sketch", same_bytes)):
        counted = remap(admission, max_waiting)
        by_it = _first_admissions(counted, batches)
        early = sum(1 for key, step in by_it.items() if step < by_exact.get(key, 2**62))
        late = sum(1 for key, step in by_exact.items() if by_it.get(key, 2**62) > step)
        sketch = counted.sketch
        out["variants"].append({
            "admission": admission, "max_waiting": max_waiting,
            "bytes": (sketch.nbytes if sketch else
                      max_waiting * dynamic_embedding.MAP_ENTRY_BYTES),
            "layout": sketch and [sketch.depth, sketch.width, sketch.bits],
            "halvings": sketch and int(sketch.halvings.numpy()),
            "admitted": len(by_it), "early": early, "early_rate": early / never,
            "late": late})
        print(f"{admission} for {max_waiting:,} waiting ids ({out['variants'][-1]['bytes']:,} "
              f"bytes): {early:,} of {never:,} ids admitted early, {late:,} late", flush=True)
    return out


def sketch_bytes(max_waiting, min_count):
    from hybrid_strategy.tables import sketch  # pylint: disable=import-outside-toplevel
    return sketch.nbytes(max_waiting, min_count, ERROR)


def markdown(report):
    args = report["arguments"]
    lines = ["# Memory of the ps under ids that never repeat", "",
             f"Generated by `{report['command']}`", "",
             machine.summary(report["machine"]) + ".", "",
             f"1 worker + 1 ps, a new cluster per row; DynamicEmbedding(capacity "
             f"{args['capacity']:,}, dim {args['dim']}), Adagrad; {args['steps']} steps of "
             f"{args['batch']:,} ids that never repeat ({args['steps'] * args['batch']:,} "
             f"ids, {args['steps'] * args['batch'] / args['capacity']:.1f}x the capacity). "
             "The ps's VmRSS before the model, then every 10 steps; 'full': the first "
             "sample after 1.2x the capacity of ids went through. Waiting ids' counts: "
             "their map entries at the end (48 bytes each, an estimate), or the sketch's "
             f"bytes (exact; admission_error {ERROR}, max_waiting the capacity).", "",
             "| min_count | admission | ps RSS at start (MiB) | when full | max after | at "
             "the end | ids in the map at the end | waiting ids' counts (bytes) | admitted "
             "| evicted |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["results"].items():
        s = r["stats"]
        min_count, admission = name.split("-")
        lines.append(f"| {min_count} | {admission} | {r['rss_start_mib']:.0f} | "
                     f"{r['rss_full_mib']:.0f} | {r['rss_max_after_full_mib']:.0f} | "
                     f"{r['rss_end_mib']:.0f} | {r['ids_held']:,} | {r['waiting_bytes']:,} | "
                     f"{s['admissions']:,} | {s['evictions']:,} |")
    z = report.get("admissions")
    if z:
        lines += ["", f"Admissions at min_count {z['min_count']} on a Zipf stream (in one "
                  f"process): `raw_id_data.make({z['examples']:,})`'s user ids in batches "
                  f"of {z['batch']:,}, {z['distinct_ids']:,} distinct, rows for all. "
                  f"Exact counting that keeps every waiting id admits "
                  f"{z['admitted_exact']:,} of them; each row below against it. 'Early': "
                  "ids admitted at a step where it had not admitted them (a sketch admits "
                  f"each waiting id early with odds of at most admission_error "
                  f"{z['error']}), of the {z['never_admitted_exact']:,} ids it never "
                  "admits; 'late': ids admitted after it admitted them (counts forgotten "
                  "or halved). Bytes: what the waiting ids' counts may take (exact: 48 "
                  "bytes per entry, an estimate, times max_waiting; sketch: exact).", "",
                  "| admission | max_waiting | bytes | rows x counters x bits | halvings | "
                  "admitted | early | early rate | late |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
        for v in z["variants"]:
            layout = " x ".join(f"{n:,}" for n in v["layout"]) if v["layout"] else ""
            lines.append(f"| {v['admission']} | {v['max_waiting']:,} | {v['bytes']:,} | "
                         f"{layout} | {v['halvings'] if v['layout'] else ''} | "
                         f"{v['admitted']:,} | {v['early']:,} | {v['early_rate']:.4f} | "
                         f"{v['late']:,} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    chief_runs.main(argv, parse_args, run_chief, run_all)


def run_all(args, argv):
    """Every variant on a cluster of its own; the Zipf comparison; the report."""
    # The flags this run's chiefs share; each gets one variant.
    shared = [f"--capacity={args.capacity}", f"--dim={args.dim}", f"--steps={args.steps}",
              f"--batch={args.batch}"]
    results = {}
    for min_count in args.min_count:
        for admission in args.admission:
            if admission == "sketch" and min_count < 2:
                continue  # nothing waits
            results[f"{min_count}-{admission}"] = machine.run_as_chief(
                "benchmarks.dynamic_memory", shared + ["--min-count", str(min_count),
                                                       "--admission", admission], args.out)
    report = {"command": " ".join(["python -m benchmarks.dynamic_memory", *argv]),
              "machine": machine.describe(), "arguments": vars(args), "results": results}
    if args.zipf_examples:
        report["admissions"] = compare_admissions(args.zipf_examples, args.batch)
    machine.write_results(args.out, report, markdown(report))


if __name__ == "__main__":
    main()
