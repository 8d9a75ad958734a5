"""Time to accuracy: every contender trains the same model on the same data to a target
validation metric; wall time, steps and examples to the target, and curves over time.

    python -m benchmarks.time_to_accuracy --model recommender,lm \\
        --contenders hybrid,allreduce,ps,ps-async,mwms,pss,single --workers 4 --ps 1 \\
        --link-gbit 1

Throughput (benchmarks/run.py) says how fast a contender steps; this says how soon it
trains, which is what asynchronous training trades (its steps compute on variables that
other workers' steps changed meanwhile, so it may need more of them, or diverge).

For each model and contender, in turn, a fresh cluster of real processes is started as
benchmarks/run.py starts it (one network namespace per task where possible, `--link-gbit`
on every link; loopback otherwise), and the contender's training program (this module,
`--trainer SPEC.json`) trains the model of keras_examples/ with its own optimizer, from
the same initial weights, on the same training set (`--train-batches` global batches,
read in order and repeated) with the same global batch:

- every `--eval-every` steps (a step is one global batch, also for the asynchronous
  contenders, whose epochs of that many steps end once every step has finished), the
  trainer that reports (the chief; worker 0 under MultiWorkerMirroredStrategy) copies
  the weights into a plain Keras model on its own CPU and computes the validation
  metric on held-out data (`--validation-examples`, drawn with another seed) exactly,
  with the same code for every contender: the recommender's AUC (by ranks, over every
  validation example) and log loss, the language model's perplexity (exp of the
  full-softmax cross-entropy per token);
- the clock runs from the start of `fit` (tracing the first steps included) and stops
  while the validation runs: *time to target* is training time only;
- a contender stops at the first validation that reaches the target, when its training
  time passes `--time-limit`, or when its loss or metric is no longer finite
  (diverged).

Results go to benchmarks/results/time_to_accuracy/<model>-w<W>-p<P>-<network>.json (or
`--json`), and `python -m benchmarks.time_to_accuracy --report` (run after every
measurement kept there too) writes
benchmarks/results/time_to_accuracy.md with a table per run and, with matplotlib, the
validation metric and training loss against time and against steps, one curve per
contender (PNG beside it). A contender is any of benchmarks/contenders.py's, including
HybridStrategy ones with more options: `hybrid:sparse_update='exact'`. With
`--machine-cpus C` (`--quota-period-ms`, `--colocate`) every emulated machine has its own
CPU share, as in benchmarks/run.py (benchmarks/cpu_groups.py).
"""

import argparse
import datetime
import glob
import json
import math
import os
import shlex
import sys
import tempfile
import time

import numpy as np

from benchmarks import contenders as contenders_lib
from benchmarks import cpu_groups
from benchmarks import machine as machine_lib
from benchmarks import run as run_lib

RESULTS_DIR = os.path.join(run_lib.RESULTS_DIR, "time_to_accuracy")
REPORT = os.path.join(run_lib.RESULTS_DIR, "time_to_accuracy.md")
SCHEMA = 1


# What each model is trained to ------------------------------------------------------


class Target:
    """A validation metric and the value that counts as trained."""

    def __init__(self, metric, value, higher_is_better, label):
        self.metric, self.value = metric, value
        self.higher_is_better, self.label = higher_is_better, label

    def reached(self, measured):
        if self.higher_is_better:
            return measured >= self.value
        return measured <= self.value

    def describe(self, value=None):
        sign = ">=" if self.higher_is_better else "<="
        return f"{self.label} {sign} {self.value if value is None else value:g}"


# Defaults: single-process training reaches them in about a minute on a 2-core machine.
TARGETS = {
    "recommender": Target("val_auc", 0.80, True, "validation AUC"),
    "lm": Target("val_perplexity", 1000.0, False, "validation perplexity"),
}
DEFAULTS = {  # eval_every, train_batches, validation_examples, time_limit
    "recommender": (100, 1000, 16_384, 400.0),
    "lm": (50, 1000, 512, 600.0),
}


def validation(model_name, module, examples):
    """Held-out data (seed 1; training uses seed 0) as numpy arrays."""
    if model_name == "recommender":
        return module.make_arrays(examples, seed=1)
    spec = contenders_lib.MODELS[model_name]
    return module.make_arrays(examples, seed=1, **spec.data)


def auc(scores, labels):
    """Area under the ROC curve by ranks (ties share their mean rank), exact."""
    scores, positive = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    for start, count in zip(first, counts):
        if count > 1:
            ranks[order[start:start + count]] = start + (count + 1) / 2
    pos, neg = positive.sum(), (~positive).sum()
    return float((ranks[positive].sum() - pos * (pos + 1) / 2) / (pos * neg))


def measure(model_name, model, data, tf):
    """{metric: value} of `model` (a plain Keras model on this process) on `data`."""
    # Called directly, not by predict: inside a strategy's fit, Keras would distribute it.
    if model_name == "recommender":
        features, labels = data
        scores = np.concatenate([
            model({k: v[start:start + 4096] for k, v in features.items()}).numpy()[:, 0]
            for start in range(0, len(labels), 4096)])
        scores = np.clip(scores, 1e-7, 1 - 1e-7)
        log_loss = -np.mean(labels * np.log(scores) + (1 - labels) * np.log(1 - scores))
        return {"val_auc": auc(scores, labels), "val_loss": float(log_loss)}
    tokens, targets = data
    total = 0.0
    for start in range(0, len(tokens), 64):
        hidden = model(tokens[start:start + 64])
        logits = model.softmax.logits(tf.reshape(hidden, [-1, model.embedding_dim]))
        total += float(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(targets[start:start + 64], [-1]), logits=logits)))
    loss = total / targets.size
    return {"val_perplexity": math.exp(min(loss, 700.0)), "val_loss": loss}


# The training program ------------------------------------------------------------------


def make_progress(trainer, spec, target, evaluate):
    """The callback that times training, validates every epoch and decides when to stop."""
    keras, tf, strategy = trainer.keras, trainer.tf, trainer.strategy

    class Progress(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points, self.outcome = [], None
            self.started = self.excluded = 0.0

        def on_train_begin(self, logs=None):
            contenders_lib.handshake(spec.get("sync_dir"), "start", spec["task"])
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            paused = time.perf_counter()
            seconds = paused - self.started - self.excluded
            loss = float((logs or {}).get("loss", math.nan))
            outcome = None
            # On every task: under MultiWorkerMirroredStrategy, reading tf_keras' synced
            # metric variables (the "loss" Mean is one of the model's weights) is an
            # all-reduce, which every worker must join.
            weights = self.model.get_weights()
            if spec["write_result"]:
                point = {"seconds": seconds, "steps": (epoch + 1) * spec["eval_every"],
                         "loss": loss, **evaluate(weights)}
                point["examples"] = point["steps"] * spec["global_batch"]
                self.points.append(point)
                print(f"[{spec['contender']}] {json.dumps(point)}", file=sys.stderr, flush=True)
                if not all(math.isfinite(point[k]) for k in ("loss", target.metric)):
                    outcome = "diverged"
                elif target.reached(point[target.metric]):
                    outcome = "reached"
            if outcome is None and seconds >= spec["time_limit"]:
                outcome = "time limit"
            if self._everyone_stops(outcome is not None):
                self.outcome = outcome or "stopped by another worker"
                self.model.stop_training = True
            contenders_lib.heartbeat(spec.get("sync_dir"), spec["task"],
                                     (epoch + 1) * spec["eval_every"] - 1)
            self.excluded += time.perf_counter() - paused

        def _everyone_stops(self, stop):
            if spec["contender"] != "mwms":
                return stop
            # Every MultiWorkerMirroredStrategy worker runs this program: all stop together.
            flag = strategy.run(lambda: tf.constant(1.0 if stop else 0.0))
            return float(strategy.reduce("SUM", flag, axis=None)) > 0

        def on_train_end(self, logs=None):
            contenders_lib.handshake(spec.get("sync_dir"), "end", spec["task"])

    return Progress()


def train(spec):
    """Trains spec's contender until the target, the time limit or divergence."""
    started = time.perf_counter()
    trainer = contenders_lib.Trainer(spec["contender"], spec["model"], spec["num_ps"])
    tf = trainer.tf
    target = Target(**spec["target"])
    model = trainer.build_model()
    # The same weights, copied into a plain model on this process, for validation.
    plain = trainer.build_model(strategy=tf.distribute.get_strategy())
    data = validation(spec["model"], trainer.module, spec["validation_examples"])

    def evaluate(weights):
        plain.set_weights(weights)
        return measure(spec["model"], plain, data, tf)

    progress = make_progress(trainer, spec, target, evaluate)
    setup_seconds = time.perf_counter() - started
    batch = spec["global_batch"]
    trainer.fit(model, batch * spec["train_batches"], batch,
                epochs=spec["max_evaluations"], steps_per_epoch=spec["eval_every"],
                callbacks=[progress])
    reached = next((p for p in progress.points if target.reached(p[target.metric])), None)
    result = {
        "contender": spec["contender"],
        "model": spec["model"],
        "keras": trainer.keras_name,
        "tensorflow": tf.__version__,
        "strategy": type(trainer.strategy).__name__,
        "replicas_in_sync": trainer.strategy.num_replicas_in_sync,
        "synchronous": not trainer.asynchronous,
        "global_batch": batch,
        "target": spec["target"],
        "outcome": progress.outcome or "out of epochs",
        "points": progress.points,
        "to_target": reached and {k: reached[k] for k in ("seconds", "steps", "examples")},
        "best": (max if target.higher_is_better else min)(
            (p[target.metric] for p in progress.points), default=None),
        "training_seconds": progress.points[-1]["seconds"] if progress.points else None,
        "setup_seconds": setup_seconds,
        "chief_vmhwm_kib": contenders_lib.vm_hwm_kib(),
    }
    if spec["write_result"]:
        tmp = spec["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, spec["result"])
    return result


# The harness ----------------------------------------------------------------------------


class TimeToAccuracyRun(run_lib.ContenderRun):
    """One contender's cluster running this module's training program."""

    TRAINER = "benchmarks.time_to_accuracy"

    def trainer_spec(self, task):
        options = self.options
        return {"contender": self.contender, "model": options.model_name,
                "global_batch": self.batch, "num_ps": options.ps,
                "target": vars(options.target), "eval_every": options.eval_every,
                "max_evaluations": options.max_evaluations,
                "train_batches": options.train_batches,
                "validation_examples": options.validation_examples,
                "time_limit": options.time_limit,
                "result": os.path.join(self.workdir, "result.json"),
                "sync_dir": self.sync_dir, "task": task.name,
                "write_result": task.index == 0}

    def _collect(self):
        with open(os.path.join(self.workdir, "result.json")) as f:
            result = json.load(f)
        # CPU seconds and bytes of each task over the whole training, validation included.
        usage = self.task_usage(steps=1)
        result["per_task"] = {
            name: {"job": entry["job"], "peak_rss_mib": entry["peak_rss_mib"],
                   "cpu_seconds": entry.get("cpu_ms_per_step", math.nan) / 1000,
                   "bytes": sum(entry.get(f"{kind}_{way}_per_step", 0)
                                for kind in ("wire",) for way in ("sent", "received"))}
            for name, entry in usage.items()}
        return result


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_accuracy", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="recommender,lm",
                        help="comma-separated: " + ", ".join(TARGETS))
    parser.add_argument("--contenders", default=",".join(contenders_lib.CONTENDERS),
                        help="comma-separated, of " + ", ".join(contenders_lib.CONTENDERS)
                        + " (a HybridStrategy one may add options: NAME:key=value)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="rate limit of every emulated link, Gbit/s (namespaces only)")
    parser.add_argument("--loopback", action="store_true",
                        help="do not use network namespaces even where possible")
    parser.add_argument("--target", type=float, default=None,
                        help="target value of the model's metric (default: "
                        + "; ".join(f"{m}: {t.describe()}" for m, t in TARGETS.items()) + ")")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="steps between validations (default: "
                        + ", ".join(f"{m} {d[0]}" for m, d in DEFAULTS.items()) + ")")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds of training per contender (default: "
                        + ", ".join(f"{m} {d[3]:g}" for m, d in DEFAULTS.items()) + ")")
    parser.add_argument("--train-batches", type=int, default=None,
                        help="global batches in the training set, read in order and "
                        "repeated (default: " + ", ".join(f"{m} {d[1]}"
                                                          for m, d in DEFAULTS.items()) + ")")
    parser.add_argument("--validation-examples", type=int, default=None)
    parser.add_argument("--json", help="results file (default under "
                        "benchmarks/results/time_to_accuracy/)")
    parser.add_argument("--report", action="store_true",
                        help="only write benchmarks/results/time_to_accuracy.md from the "
                        "results there")
    cpu_groups.add_options(parser)
    options = parser.parse_args(argv)
    cpu_groups.check_options(parser, options)
    options.models = [m.strip() for m in options.model.split(",") if m.strip()]
    options.contender_list = [c.strip() for c in options.contenders.split(",") if c.strip()]
    for model in options.models:
        if model not in TARGETS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(TARGETS)}")
    for contender in options.contender_list:
        if contenders_lib.base_of(contender) not in contenders_lib.CONTENDERS:
            parser.error(f"unknown contender {contender!r}; choose from "
                         f"{', '.join(contenders_lib.CONTENDERS)}")
        if ":" in contender:
            try:
                contenders_lib.hybrid_options(contender)
            except ValueError as e:
                parser.error(str(e))
    if options.workers < 1 or options.ps < 1:
        parser.error("--workers and --ps must be at least 1")
    for name in ("eval_every", "train_batches", "validation_examples"):
        if getattr(options, name) is not None and getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if options.time_limit is not None and options.time_limit <= 0:
        parser.error("--time-limit must be positive")
    if options.link_gbit is not None and options.link_gbit <= 0:
        parser.error("--link-gbit must be positive")
    if options.json and len(options.models) > 1:
        parser.error("--json takes one model; run the models one by one")
    return options


def configure(options, model):
    """Sets the per-model options (defaults where not given)."""
    eval_every, train_batches, validation_examples, time_limit = DEFAULTS[model]
    default = TARGETS[model]
    options.model_name = model
    options.global_batch = contenders_lib.MODELS[model].global_batch
    # Every contender's step is one global batch (benchmarks/batches.py), one replica per
    # worker: a step of every contender trains the same examples.
    options.per_worker_batch = None
    options.devices_per_worker = 1
    options.target = Target(default.metric, default.value if options.target_arg is None
                            else options.target_arg, default.higher_is_better, default.label)
    options.eval_every = options.eval_every_arg or eval_every
    options.train_batches = options.train_batches_arg or train_batches
    options.validation_examples = options.validation_examples_arg or validation_examples
    options.time_limit = options.time_limit_arg or time_limit
    # Generous: setup, tracing and validations come on top of the training time.
    options.max_evaluations = int(options.time_limit * 100 / options.eval_every) + 1
    options.timeout = 3 * options.time_limit + 600
    options.stall_timeout = run_lib.STALL_TIMEOUT  # between validations, not steps


def run_model(options, model, mode, why, argv):
    configure(options, model)
    if options.global_batch % options.workers:
        raise SystemExit(f"global batch {options.global_batch} must be a multiple of "
                         f"--workers {options.workers}")
    run = {
        "schema": SCHEMA, "model": model,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.time_to_accuracy " + shlex.join(argv),
        "machine": machine_lib.describe(), "code": machine_lib.code_version(),
        "network": {"mode": mode, "link_gbit": options.link_gbit if mode == "netns" else None,
                    "fallback_reason": why if mode == "loopback" else None},
        "config": {"workers": options.workers, "ps": options.ps,
                   "global_batch": options.global_batch, "target": vars(options.target),
                   "eval_every": options.eval_every, "train_batches": options.train_batches,
                   "validation_examples": options.validation_examples,
                   "time_limit": options.time_limit},
        "machines": cpu_groups.describe(options, getattr(options, "cpu_groups", None)),
        "contenders": [],
    }
    workdir = tempfile.mkdtemp(prefix=f"hsb-tta-{model}-")
    try:
        for contender in options.contender_list:
            print(f"[{model}] {contender} ...", file=sys.stderr, flush=True)
            result = TimeToAccuracyRun(contender, options, mode, workdir).run()
            run["contenders"].append(result)
            print(f"[{model}] {contender}: {summary_line(result, options.target)}",
                  file=sys.stderr, flush=True)
    finally:
        run_lib._remove_tree(workdir)  # pylint: disable=protected-access
    network = ("loopback" if mode != "netns" else
               f"netns-{options.link_gbit:g}gbit" if options.link_gbit else "netns-nolimit")
    path = options.json or os.path.join(
        RESULTS_DIR, f"{model}-w{options.workers}-p{options.ps}-{network}"
        f"{cpu_groups.options_label(options)}"
        ".json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(run, f, indent=1)
    print(f"results: {os.path.relpath(path)}", flush=True)
    return run


def summary_line(result, target):
    if result.get("status") != "ok":
        return f"FAILED: {result.get('error')}"
    reached = result.get("to_target")
    if reached:
        return (f"{target.describe()} after {reached['seconds']:.0f} s, {reached['steps']} "
                f"steps ({result['outcome']})")
    return f"{result['outcome']}; best {target.label} {result.get('best')}"


# The report ------------------------------------------------------------------------------


def load_runs(results_dir=RESULTS_DIR):
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            run = json.load(f)
        run["file"] = os.path.basename(path)
        runs.append(run)
    return runs


def _fmt(value, digits=0):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def run_title(run):
    cfg, net = run["config"], run["network"]
    network = (f"1 network namespace per task, {net['link_gbit']:g} Gbit/s links"
               if net["mode"] == "netns" and net.get("link_gbit") else
               "network namespaces, links not limited" if net["mode"] == "netns" else
               "loopback")
    return (f"{run['model']}: {cfg['workers']} workers + {cfg['ps']} ps, global batch "
            f"{cfg['global_batch']}, {network}; "
            + cpu_groups.summary(run.get("machines"), (run.get("machine") or {}).get("nproc")))


def run_table(run):
    cfg = run["config"]
    target = Target(**cfg["target"])
    single = next((c for c in run["contenders"] if c["contender"] == "single"
                   and (c.get("to_target") or {}).get("seconds")), None)
    lines = [f"Target: {target.describe()}; validation every {cfg['eval_every']} steps; "
             f"training set {cfg['train_batches']} global batches (repeated); time limit "
             f"{cfg['time_limit']:g} s of training.", "",
             "| contender | Keras | steps are | time to target (s) | vs single | steps | "
             "examples | outcome | best | CPU s of all tasks | setup s |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for c in run["contenders"]:
        if c.get("status") != "ok":
            lines.append(f"| {c['contender']} | | | | | | | failed: "
                         f"{str(c.get('error'))[:120]} | | | |")
            continue
        reached = c.get("to_target") or {}
        ratio = (f"{reached['seconds'] / single['to_target']['seconds']:.2f}x"
                 if reached and single else "")
        cpu = sum(t["cpu_seconds"] for t in c["per_task"].values()
                  if math.isfinite(t["cpu_seconds"]))
        lines.append(
            f"| {c['contender']} | {c['keras']} | "
            f"{'synchronous' if c['synchronous'] else 'asynchronous'} | "
            f"{_fmt(reached.get('seconds'), 1)} | {ratio} | {_fmt(reached.get('steps'))} | "
            f"{_fmt(reached.get('examples'))} | {c['outcome']} | {_fmt(c.get('best'), 4)} | "
            f"{_fmt(cpu, 0)} | {_fmt(c.get('setup_seconds'), 0)} |")
    return "\n".join(lines)


def plot(run, path):
    """Validation metric and training loss against time and steps, per contender."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    target = Target(**run["config"]["target"])
    figure, axes = pyplot.subplots(2, 2, figsize=(12, 8))
    for c in run["contenders"]:
        points = c.get("points") or []
        if c.get("status") != "ok" or not points:
            continue
        for column, x in enumerate(("seconds", "steps")):
            xs = [p[x] for p in points]
            axes[0][column].plot(xs, [p[target.metric] for p in points], marker=".",
                                 label=c["contender"])
            axes[1][column].plot(xs, [p["loss"] for p in points], marker=".",
                                 label=c["contender"])
    for column, x in enumerate(("training seconds (validation excluded)", "steps")):
        axes[0][column].axhline(target.value, color="grey", linestyle="--", linewidth=1)
        axes[0][column].set_ylabel(target.label)
        axes[1][column].set_ylabel("training loss (mean over the last interval)")
        axes[1][column].set_xlabel(x)
        if not target.higher_is_better:
            axes[0][column].set_yscale("log")
    axes[0][0].legend()
    figure.suptitle(run_title(run))
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
    return path


def write_report(results_dir=RESULTS_DIR, report_path=REPORT):
    sections = [
        "# Time to accuracy", "",
        "Generated by `python -m benchmarks.time_to_accuracy --report` from the JSON files "
        "in `time_to_accuracy/`, each written by one run of `python -m "
        "benchmarks.time_to_accuracy` (its command is given). Every contender trains the "
        "same keras_examples/ model, with its own optimizer, from the same initial "
        "weights, on the same training set in the same order, with the same global "
        "batch, on a fresh cluster of real processes; benchmarks/time_to_accuracy.py "
        "says exactly how.", "",
        "- **Time to target** is training time: the clock starts with `fit` (tracing "
        "included) and stops while the chief validates, every so many steps, on held-out "
        "data, with the same exact code for every contender (a plain Keras model given the "
        "trained weights): so it is known to within one validation interval.",
        "- **Steps** are global batches: a synchronous step trains one global batch over "
        "every replica; an asynchronous one (`ps-async`, `pss`) trains one global batch on "
        "one worker, from variables that other workers' steps may have changed since it "
        "read them. Both take the same number of steps per epoch.",
        "- **Training loss** is the mean over the last interval, as Keras logs it, of each "
        "contender's own loss: the language model trains with a sampled softmax (its "
        "validation is the full softmax), and MultiWorkerMirroredStrategy's tf_keras logs "
        "the loss times the number of replicas.",
        "- **CPU s of all tasks**: user + system CPU time of every process of the "
        "contender's cluster from the start of training to its end (validation included). "
        "All tasks share this machine's cores, so wall times here are upper bounds of a "
        "cluster of machines and depend on the machine's load (named with each run).", ""]
    for run in load_runs(results_dir):
        sections += [f"## {run_title(run)}", "",
                     f"`{run['command']}` ({run['date']}, {run['machine'].get('cpu', '')}, "
                     f"{run['machine'].get('nproc', '?')} cores, load "
                     f"{run['contenders'][0].get('loadavg_before', 0):.1f} before the first "
                     "contender)", "", run_table(run), ""]
        image = plot(run, os.path.join(os.path.dirname(report_path),
                                       run["file"].replace(".json", "-tta.png")))
        if image:
            sections += [f"![{run['model']}: metric and loss against time and steps]"
                         f"({os.path.relpath(image, os.path.dirname(report_path))})", ""]
    with open(report_path, "w") as f:
        f.write("\n".join(sections))
    return report_path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--trainer"]:
        with open(argv[1]) as f:
            train(json.load(f))
        return 0
    if len(argv) == 1 and argv[0].endswith(".json") and os.path.exists(argv[0]):
        with open(argv[0]) as f:  # the harness: python -m benchmarks.time_to_accuracy SPEC
            train(json.load(f))
        return 0
    options = parse(argv)
    if options.report:
        print(f"wrote {os.path.relpath(write_report())}")
        return 0
    options.target_arg, options.eval_every_arg = options.target, options.eval_every
    options.train_batches_arg = options.train_batches
    options.validation_examples_arg = options.validation_examples
    options.time_limit_arg = options.time_limit
    try:  # before any process starts
        options.cpu_groups = cpu_groups.from_options(options)
    except cpu_groups.CpuGroupError as e:
        print(f"python -m benchmarks.time_to_accuracy: error: {e}", file=sys.stderr)
        return 2
    mode, why = run_lib.network_mode(options)
    runs = [run_model(options, model, mode, why, argv) for model in options.models]
    if not options.json:  # results kept under benchmarks/results/
        print(f"wrote {os.path.relpath(write_report())}")
    ok = all(c.get("status") == "ok" for r in runs for c in r["contenders"])
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A process connected to a cluster can hang in interpreter teardown: leave at once.
    os._exit(code)
