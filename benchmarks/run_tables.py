"""The markdown tables of one `python -m benchmarks.run` result, and their cells.

`benchmarks.run` prints them after its runs; benchmarks/report.py puts every run's in
benchmarks/results/README.md beside the targets and plots.

```python
import json
from benchmarks import run_tables
with open("benchmarks/results/recommender-w4-p1-netns-1gbit.json") as f:
    print(run_tables.markdown(json.load(f)))
```
"""

from benchmarks import batches
from benchmarks import cpu_groups
from benchmarks import trace_summary

# The measured window benchmarks.run takes by default: warm-up and measured steps.
DEFAULT_WINDOW = (5, 30)


# Formatting -----------------------------------------------------------------------


def fmt_bytes(value):
    if value is None:
        return "n/a"
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} B"


def md_escape(text):
    return str(text).replace("|", "\\|").replace("\n", " ")[:300]


def ok_result(run, contender):
    return next((c for c in run["contenders"]
                 if c["contender"] == contender and c.get("status") == "ok"), None)


def modified_files(run):
    """Files that differed from the commit, results excluded (runs write those)."""
    files = [f.split()[-1] for f in (run.get("code") or {}).get("modified_files", [])]
    return [f for f in files if not f.startswith("benchmarks/results/")]


def _loss_cell(c):
    loss = (c.get("last_logs") or {}).get("loss")
    if loss is None:
        return ""
    text = f"{loss:.3f}"
    if c["contender"] == "mwms" and c.get("replicas_in_sync", 1) > 1:
        text += f" (tf_keras logs it x{c['replicas_in_sync']} under MWMS)"
    return text


def _rss_cell(c):
    per_task = c.get("per_task") or {}

    def of(job):
        values = [e["peak_rss_mib"] for e in per_task.values()
                  if e["job"] == job and e.get("peak_rss_mib") is not None]
        return " / ".join(f"{v:,.0f}" for v in values) if values else "-"

    return f"{of('chief')} / {of('worker')} / {of('ps')}"


def title(run):
    cfg = run["config"]
    repeats = cfg.get("repeats", 1)
    return (f"{run['model']}: {cfg['workers']} workers + {cfg['ps']} ps, "
            f"{batches.phrase(cfg)}, {cfg['warmup']} warm-up + {cfg['steps']} measured steps"
            + (f", median of {repeats} runs" if repeats > 1 else "")
            + f"{' (--quick)' if run.get('quick') else ''}"
            + f"{', traced by the profiler (--profile)' if run.get('profiled') else ''}, "
            + run["network"]["description"] + "; "
            + cpu_groups.summary(run.get("machines"), (run.get("machine") or {}).get("nproc")))


def machines_key(run):
    """A run's machines as a plot groups them; None where tasks share cores."""
    return cpu_groups.machines_label(run.get("machines")) or None


def machines_label(run):
    """", machines of 0.5 core" (", colocated"): what a target or plot names."""
    m = run.get("machines")
    return f", machines of {machines_phrase(m)}" if m else ""


def machines_phrase(m):
    """"0.5 core (10 ms period, worker i + ps i colocated)", "0.5 core, ps 1 core (10 ms
    period)" of a run's machines."""
    return (f"{m['cpus']:g} core"
            + (f", ps {m['ps_cpus']:g} core" if m.get("ps_cpus") is not None else "")
            + f" ({m['quota_period_ms']:g} ms period"
            + {"host": ", host-sized thread pools",
               "auto": ", servers' pools sized from their quota"}.get(
                   m.get("thread_sizing"), "")
            + (", worker i + ps i colocated)" if m["colocate"] else ")"))


def markdown(run):
    """The markdown tables of one run (one model, one cluster shape)."""
    bound = run.get("lower_bound") or {}
    single = ok_result(run, "single")
    unit = run["config"].get("unit", "examples")
    lb = bound.get("sent_plus_received")
    lines = [f"### {title(run)}", "",
             f"| contender | Keras | batch per step | {unit}/s | vs single | median step ms | "
             "worker bytes/step (sent+recv) | lower bound | measured / bound | "
             "chief bytes/step | ps bytes/step | peak RSS MiB (chief / workers / ps) | "
             "last loss logged |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for c in run["contenders"]:
        if c.get("status") != "ok":
            reason = c.get("error") or c.get("status")
            lines.append(f"| {c['contender']} | {c.get('keras', '')} | {_batch_cell(run, c)} "
                         f"| **failed**: {md_escape(reason)} | | | | | | | | | |")
            continue
        s = c.get("summary", {})
        alone = c["contender"] == "single"
        ratio = f"{c['units_per_s'] / single['units_per_s']:.2f}x" if single else "n/a"
        step = f"{c['median_step_s'] * 1000:.1f}"
        if c.get("median_step_is_mean"):
            step += " (mean; async)"
        vs = ""
        if s.get("vs_lower_bound") is not None and not alone:
            vs = f"{s['vs_lower_bound']:.2f}"
            if s.get("vs_compressed_bound") is not None:
                vs += f" ({s['vs_compressed_bound']:.2f} of the bound with bfloat16 rows)"
            if not c.get("synchronous", True):
                vs += " (async: a worker runs 1/W of the steps)"
        throughput = f"{c['units_per_s']:,.0f}"
        spread = [v for v in (c.get("repeats") or {}).get("units_per_s", []) if v]
        if len(spread) > 1:
            throughput += f" ({min(spread):,.0f}-{max(spread):,.0f}, {len(spread)} runs)"
        lines.append(
            f"| {c['contender']} | {c.get('keras')} | {_batch_cell(run, c)} | {throughput} | "
            f"{ratio} | "
            f"{step} | {'0' if alone else fmt_bytes(s.get('worker_bytes_per_step_mean'))} | "
            f"{'' if alone else fmt_bytes(lb)} | {vs} | "
            f"{'' if alone else fmt_bytes(s.get('chief_bytes_per_step_mean'))} | "
            f"{'' if alone else fmt_bytes(s.get('ps_bytes_per_step_mean'))} | "
            f"{_rss_cell(c)} | {_loss_cell(c)} |")
    for note in run.get("not_run", []):
        lines.append(f"| {note['contender']} | | | {note['reason']} | | | | | | | | | |")
    lines += ["", bound_line(bound), ""]
    lines += per_task_table(run)
    lines += profile_sections(run)
    return "\n".join(lines)


def step_batch(run, c):
    """Examples in one step of contender result `c` of `run` (files written before the
    harness recorded it: the trainer's "global_batch", else the run's)."""
    cfg = run["config"]
    return (c.get("batch_per_step") or c.get("global_batch")
            or batches.step_batch(c["contender"], cfg["workers"], cfg["global_batch"],
                                  cfg.get("per_worker_batch")))


def per_worker_batch(run, c):
    """Examples one worker takes in a step of contender result `c` of `run`."""
    return batches.per_worker(c["contender"], step_batch(run, c), run["config"]["workers"])


def _batch_cell(run, c):
    return batches.cell(c["contender"], step_batch(run, c), run["config"]["workers"])


def bound_line(bound):
    if not bound:
        return "Lower bound: unavailable."
    if bound.get("error"):
        return f"Lower bound: failed ({md_escape(bound['error'])})."
    tables = ", ".join(f"{name} {fmt_bytes(v)}" for name, v in bound["tables"].items())
    return (f"Lower bound per worker per step (benchmarks/lower_bound.py, "
            f"{bound['worker_share']} examples per worker): dense all-reduce "
            f"{fmt_bytes(bound['dense_per_direction'])} + rows "
            f"{fmt_bytes(bound['sparse_per_direction'])} each way"
            + (f" ({tables})" if tables else "")
            + f", so {fmt_bytes(bound['sent_plus_received'])} sent + received"
            + (f"; with rows in {bound['compressed']['rows_dtype']} (hybrid-bf16): rows "
               f"{fmt_bytes(bound['compressed']['sparse_per_direction'])} each way, "
               f"{fmt_bytes(bound['compressed']['sent_plus_received'])} sent + received."
               if bound.get("compressed") else "."))


def per_task_table(run):
    lines = ["| contender | task | sent/step | received/step | TCP payload sent / received "
             "| CPU ms/step | peak RSS MiB |", "|---|---|---:|---:|---:|---:|---:|"]
    rows = 0
    for c in run["contenders"]:
        if c.get("status") != "ok":
            continue
        for name, e in c["per_task"].items():
            rows += 1
            tcp = (f"{fmt_bytes(e['tcp_payload_sent_per_step'])} / "
                   f"{fmt_bytes(e['tcp_payload_received_per_step'])}"
                   if "tcp_payload_sent_per_step" in e else "n/a")
            lines.append(f"| {c['contender']} | {name} | "
                         f"{fmt_bytes(e.get('wire_sent_per_step'))} | "
                         f"{fmt_bytes(e.get('wire_received_per_step'))} | {tcp} | "
                         f"{_cpu_cell(e)} | {e.get('peak_rss_mib') or 'n/a'} |")
    return lines if rows else []


def _cpu_cell(entry):
    """CPU ms per step, and on machines of their own how often the quota stopped the task's
    machine ("6.1, throttled in 40% of periods, 3.2 ms/step")."""
    cpu = entry.get("cpu_ms_per_step")
    if cpu is None:
        return "n/a"
    if "throttled_periods" not in entry:
        return f"{cpu:.1f}"
    return (f"{cpu:.1f} (throttled in {entry['throttled_periods']:.0%} of periods, "
            f"{entry['throttled_ms_per_step']:.1f} ms/step)")


def profile_sections(run):
    """Per profiled contender: where its step's time goes (benchmarks/trace_summary.py)."""
    lines = []
    for c in run["contenders"]:
        if c.get("status") == "ok" and c.get("profile", {}).get("error"):
            lines += ["", f"No profile of {c['contender']}: {md_escape(c['profile']['error'])}"]
        elif c.get("status") == "ok" and c.get("profile"):
            traced = ("this process" if c["contender"] == "single" else
                      "over gRPC: the chief, worker 0 and every ps")
            lines += ["", f"Where a step's time goes, {c['contender']} (TensorFlow profiler; "
                      f"traced {traced}; tracing slows the step):", "",
                      trace_summary.markdown(c["profile"])]
    return lines


# Targets --------------------------------------------------------------------------------
