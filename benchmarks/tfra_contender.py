"""TensorFlow Recommenders-Addons' dynamic embedding on raw int64 ids, as a contender.

    python -m benchmarks.tfra_contender [--examples 200000] [--batch 1024] [--dim 16]
        [--modes single ps ps-inprocess] [--out benchmarks/results/tfra_contender.json]

TFRA (PyPI: tensorflow-recommenders-addons) keys its tables by raw ids with no
vocabulary: the contender of the dynamic-vocabulary comparison. Its 0.8.1 wheel for
CPython 3.11 (x86_64) requires tensorflow >= 2.11, <= 2.16.2 and builds on Keras 2, so
this creates, once, a virtualenv at ~/.cache/hybrid_strategy_bench/tfra-venv with
PACKAGES (tensorflow 2.16.2, tf_keras 2.16.0 to match, TFRA 0.8.1), reused while the
record it keeps there (installed.json) names the same PACKAGES; if pip fails, the results
say so ("not_run", pip's last lines) and the command still exits 0.

Each mode then runs in that venv as a separate process, this file with `--train
SPEC.json` (TF_USE_LEGACY_KERAS=1), which imports benchmarks/raw_id_data.py by path and
nothing else of this repository. The model: a user embedding and an item embedding
(`tfra.dynamic_embedding.keras.layers.Embedding`, dim --dim each, keyed by the raw int64
ids), the item ids of a row (PAD dropped) summed, both concatenated into Dense(1,
sigmoid); binary cross-entropy; `de.DynamicEmbeddingOptimizer(legacy Adam)`; tf_keras
`fit` over one pass of the training part (the first 90% of
`raw_id_data.make(--examples)` in time order), in whole batches of --batch. Modes:

  single        one process, no strategy.
  ps            tf.distribute.experimental.ParameterServerStrategy, the trainer the
                coordinator of 1 worker + 1 ps, each a tf.distribute.Server process
                with TFRA imported (as TFRA's movielens-1m-keras-ps demo runs them); the
                tables placed on the ps with `devices=`.
  ps-inprocess  the same, the two servers started inside the coordinator's process.

Timing: a first `fit` runs the warm-up steps (--warmup-steps, tracing included); a second
`fit` runs the rest of the pass and is timed from its epoch's start (its input iterators
made) until it returns (under the strategy: once every scheduled step has finished).
Then the validation part's AUC, by tf_keras' AUC metric in `evaluate` and exactly (numpy)
from `predict`, and the number of keys in each table. A mode that fails is recorded with
its exception's type, first lines and the stage it reached, not raised. Results:
benchmarks/results/tfra_contender.json and .md (with the load average before and after
each mode: another job on the machine slows every figure; the timed windows of a small
run last seconds, so compare figures of runs under the same load).
"""

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
VENV = os.path.join(os.path.expanduser("~"), ".cache", "hybrid_strategy_bench", "tfra-venv")
PACKAGES = ("tensorflow==2.16.2", "tf_keras==2.16.0", "tensorflow-recommenders-addons==0.8.1")
INSTALLED = "installed.json"  # in the venv: PACKAGES and the versions pip installed
REPORTED = ("tensorflow", "tf-keras", "tensorflow-recommenders-addons", "numpy", "protobuf")


# The virtualenv ---------------------------------------------------------------------


def _python(venv):
    return os.path.join(venv, "bin", "python")


def run_logged(command, tail, env=None, out=None, width=None):
    """Runs `command` (in `env`, default this process's), printing its output to `out`
    (default stdout) as it comes, each line cut to `width` characters if given, and
    keeping its last lines whole in `tail` (a deque); returns the exit code."""
    out = out or sys.stdout
    print("$", shlex.join(command), file=out, flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ if env is None else env,
                                                   PIP_PROGRESS_BAR="off"))
    for line in process.stdout:
        shown = line.rstrip("\n")
        if width and len(shown) > width:
            shown = shown[:width] + " ..."
        print("  " + shown, file=out, flush=True)
        if not line.startswith(("WARNING: Location", "Looking in")):  # pip's index notes
            tail.append(line.rstrip("\n"))
    return process.wait()


def ensure_venv(venv=VENV, packages=PACKAGES):
    """The venv's record {"packages": [...], "versions": {...}}, installing it first
    unless its record names `packages`; or {"error": the command and pip's last lines}."""
    record_path = os.path.join(venv, INSTALLED)
    try:
        with open(record_path) as f:
            record = json.load(f)
        if record.get("packages") == list(packages):
            print(f"Reusing the virtualenv at {venv} ({', '.join(packages)})", flush=True)
            return record
    except (OSError, ValueError):
        pass
    print(f"Creating a virtualenv at {venv} with {', '.join(packages)} (about 700 MB "
          "to download; minutes)", flush=True)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    steps = ([sys.executable, "-m", "venv", "--clear", venv],
             [_python(venv), "-m", "pip", "install", "--upgrade", "pip"],
             [_python(venv), "-m", "pip", "install", *packages])
    started = time.monotonic()
    for command in steps:
        tail = collections.deque(maxlen=30)  # this command's last lines
        code = run_logged(command, tail)
        if code != 0:
            return {"packages": list(packages),
                    "error": {"command": shlex.join(command), "exit_code": code,
                              "last_lines": list(tail)[-15:]}}
    listed = subprocess.run([_python(venv), "-m", "pip", "list", "--format=json"],
                            stdout=subprocess.PIPE, text=True, check=True).stdout
    versions = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed)}
    record = {"packages": list(packages),
              "versions": {name: versions.get(name) for name in REPORTED},
              "python": subprocess.run([_python(venv), "-c", "import platform; "
                                        "print(platform.python_version())"],
                                       stdout=subprocess.PIPE, text=True).stdout.strip(),
              "install_seconds": round(time.monotonic() - started, 1)}
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"Installed in {record['install_seconds']:.0f} s: {record['versions']}", flush=True)
    return record


# The trainer (in the venv) ---------------------------------------------------------


def _load_data_module(path):
    """benchmarks/raw_id_data.py, imported by path (this repository's package is not on
    the venv's path: nothing of it may pull in the project's TensorFlow code)."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    spec = importlib.util.spec_from_file_location("raw_id_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_tfra():
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # TFRA 0.8 builds on tf_keras (Keras 2)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras  # pylint: disable=import-outside-toplevel
    import tensorflow_recommenders_addons as tfra  # pylint: disable=import-outside-toplevel
    from tensorflow_recommenders_addons import dynamic_embedding as de  # pylint: disable=import-outside-toplevel

    return tf, tf_keras, tfra, de


def _model_class(tf, tf_keras, de, pad):
    class RawIdModel(tf_keras.Model):
        """A user embedding and a summed multi-hot item embedding, both TFRA dynamic
        embeddings keyed by the raw int64 ids, concatenated, then Dense(1, sigmoid)."""

        def __init__(self, dim, devices):
            super().__init__()
            self.user_embedding = de.keras.layers.Embedding(
                dim, initializer=tf_keras.initializers.RandomNormal(0.0, 0.01, seed=1),
                devices=devices, name="user_embedding")
            self.item_embedding = de.keras.layers.Embedding(
                dim, initializer=tf_keras.initializers.RandomNormal(0.0, 0.01, seed=2),
                devices=devices, name="item_embedding")
            self.out = tf_keras.layers.Dense(1, activation="sigmoid")

        def call(self, features):
            user = self.user_embedding(tf.reshape(features["user"], [-1]))
            items = features["items"]
            valid = tf.not_equal(items, pad)  # PAD fills rows: it never reaches a table
            rows = tf.cast(tf.where(valid)[:, 0], tf.int32)
            looked_up = self.item_embedding(tf.boolean_mask(items, valid))
            summed = tf.math.unsorted_segment_sum(looked_up, rows, tf.shape(items)[0])
            return self.out(tf.concat([user, summed], axis=1))

    return RawIdModel


_SERVERS = []  # the trainer's server processes, stopped once its results are written
_IN_PROCESS = []  # the servers of mode ps-inprocess
_STAGE = ["importing TensorFlow and TFRA"]  # what the trainer was doing, for its errors


def _serve(job, index, cluster):
    """A tf.distribute.Server for `job`:`index` of `cluster`, with TFRA's ops loaded."""
    tf, _, _, _ = _import_tfra()
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                                  task_index=index, protocol="grpc")
    print(f"{job}{index} serving at {server.target}", flush=True)
    server.join()


def _free_ports(count):
    import socket  # pylint: disable=import-outside-toplevel

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _start_cluster(spec):
    """Servers of 1 worker + 1 ps (this venv's python running this file with --serve);
    returns (cluster, processes)."""
    chief, worker, ps = (f"localhost:{p}" for p in _free_ports(3))
    cluster = {"chief": [chief], "worker": [worker], "ps": [ps]}
    processes = []
    for job in ("ps", "worker"):
        log_path = f"{spec['out']}.{job}0.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", job, "0",
                 json.dumps(cluster)], stdout=log, stderr=subprocess.STDOUT)
        process.task, process.log_path = f"{job}0", log_path
        processes.append(process)
    return cluster, processes


def _in_process_cluster(tf):
    """1 worker + 1 ps as tf.distribute.Servers in this process (kept alive in
    _IN_PROCESS); returns the cluster, whose chief is this process as coordinator."""
    chief, worker, ps = (f"localhost:{p}" for p in _free_ports(3))
    cluster = {"chief": [chief], "worker": [worker], "ps": [ps]}
    for job in ("ps", "worker"):
        _IN_PROCESS.append(tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                                                task_index=0, protocol="grpc", start=True))
    return cluster


def _train(spec):
    """Builds, trains and evaluates the model of `spec["mode"]`; returns its results."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    tf, tf_keras, tfra, de = _import_tfra()
    data_module = _load_data_module(spec["data_module"])
    started = time.perf_counter()
    train, validation = data_module.split(
        data_module.make(spec["examples"], seed=spec["seed"]), spec["validation_fraction"])
    print(f"data: {len(train['label'])} training, "
          f"{len(validation['label'])} validation examples "
          f"({time.perf_counter() - started:.1f} s)", flush=True)
    batch = spec["batch"]
    steps = len(train["label"]) // batch  # one pass, whole batches only
    warmup = min(spec["warmup_steps"], steps // 4)
    if steps - warmup < 2:
        raise ValueError(f"{steps} steps of {batch}: too few to time after a warm-up")

    def dataset(part, skip=0, take=-1, drop_remainder=True):
        features = {"user": part["user"], "items": part["items"]}
        ds = tf.data.Dataset.from_tensor_slices((features, part["label"][:, None]))
        return ds.batch(batch, drop_remainder=drop_remainder).skip(skip).take(take) \
            .prefetch(2)

    _STAGE[0] = "building the strategy"
    if spec["mode"] == "single":
        strategy = tf.distribute.get_strategy()
        devices = None
    else:
        if spec["mode"] == "ps-inprocess":
            cluster = _in_process_cluster(tf)
        else:
            cluster, _SERVERS[:] = _start_cluster(spec)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        devices = ["/job:ps/replica:0/task:0/device:CPU:0"]
    _STAGE[0] = "building the model"
    with strategy.scope():
        model = _model_class(tf, tf_keras, de, spec["pad"])(spec["dim"], devices)
        optimizer = de.DynamicEmbeddingOptimizer(
            tf_keras.optimizers.legacy.Adam(spec["learning_rate"]))
        model.compile(optimizer=optimizer, loss="binary_crossentropy",
                      metrics=[tf_keras.metrics.AUC(num_thresholds=2000, name="auc")])

    class Clock(tf_keras.callbacks.Callback):
        start = None

        def on_epoch_begin(self, epoch, logs=None):  # the input is ready by now
            self.start = time.perf_counter()

    _STAGE[0] = "training (warm-up)"
    started = time.perf_counter()
    model.fit(dataset(train, take=warmup), epochs=1, steps_per_epoch=warmup, verbose=0)
    warmup_s = time.perf_counter() - started
    print(f"warm-up: {warmup} steps in {warmup_s:.1f} s", flush=True)
    clock = Clock()
    _STAGE[0] = "training (measured)"
    model.fit(dataset(train, skip=warmup), epochs=1, steps_per_epoch=steps - warmup,
              verbose=0, callbacks=[clock])
    measured_s = time.perf_counter() - clock.start
    measured = steps - warmup
    print(f"measured: {measured} steps in {measured_s:.1f} s, "
          f"{measured * batch / measured_s:,.0f} examples/s", flush=True)

    _STAGE[0] = "evaluating"
    eval_steps = -(-len(validation["label"]) // batch)
    logs = model.evaluate(dataset(validation, drop_remainder=False), steps=eval_steps,
                          verbose=0, return_dict=True)
    result = {
        "training_examples": len(train["label"]),
        "validation_examples": len(validation["label"]),
        "steps": steps, "warmup_steps": warmup, "measured_steps": measured,
        "warmup_seconds": round(warmup_s, 3), "measured_seconds": round(measured_s, 3),
        "examples_per_second": round(measured * batch / measured_s, 1),
        "validation_auc_keras": round(float(logs["auc"]), 4),
        "validation_loss": round(float(logs["loss"]), 4),
        "keys": {"user_embedding": int(model.user_embedding.params.size()),
                 "item_embedding": int(model.item_embedding.params.size())},
        "distinct_ids_in_training": {
            "user_embedding": int(len(np.unique(train["user"]))),
            "item_embedding": int(len(np.unique(
                train["items"][train["items"] != spec["pad"]])))},
        "hidden_model_validation_auc": round(
            data_module.auc(validation["label"], validation["logit"]), 4),
    }
    _STAGE[0] = "predicting"
    try:
        scores = model.predict(dataset(validation, drop_remainder=False),
                               steps=eval_steps, verbose=0)
        result["validation_auc"] = round(
            data_module.auc(validation["label"], np.ravel(scores)), 4)
    except Exception as e:  # pylint: disable=broad-except
        result["validation_auc"] = None
        result["predict_error"] = _error(e)
    result["versions_imported"] = {"tensorflow": tf.__version__,
                                   "tf_keras": tf_keras.__version__,
                                   "tensorflow-recommenders-addons": tfra.__version__}
    result["placement"] = {
        "user_embedding": list(model.user_embedding.params.devices),
        "item_embedding": list(model.item_embedding.params.devices)}
    return result


def _error(exception):
    lines = str(exception).strip().splitlines()
    return {"type": f"{type(exception).__module__}.{type(exception).__qualname__}",
            "message": "\n".join(lines[:8])}


def train_main(spec_path):
    """`--train SPEC.json`: one mode's run, its results (or error) written to spec["out"]."""
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = {"mode": spec["mode"], **_train(spec)}
    except Exception as e:  # pylint: disable=broad-except
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        result = {"mode": spec["mode"], "error": dict(_error(e), stage=_STAGE[0])}
    for process in _SERVERS:
        process.kill()
        process.wait()
        if "error" in result:
            with open(process.log_path) as f:
                result.setdefault("server_logs", {})[process.task] = \
                    f.read().splitlines()[-10:]
    with open(spec["out"], "w") as f:
        json.dump(result, f, indent=1)
    sys.stdout.flush()
    # Exit now: TensorFlow's teardown would try to reach the servers just stopped.
    os._exit(0)  # pylint: disable=protected-access


# The benchmark ----------------------------------------------------------------------


MODES = {
    "single": "one process: the tables and the dense layer in the trainer itself",
    "ps": "tf.distribute.experimental.ParameterServerStrategy, this process the "
          "coordinator of 1 worker + 1 ps (tf.distribute.Server processes on loopback, "
          "TFRA imported in each, as TFRA's movielens-1m-keras-ps demo runs them); the "
          "tables on the ps (`devices=`), tf_keras fit",
    "ps-inprocess": "the same strategy and model, the worker and ps servers "
                    "(tf.distribute.Server) started inside the coordinator's process",
}


def run_mode(mode, args):
    """Runs one mode in the venv; its results, or {"error": ...} if the trainer died."""
    import tempfile  # pylint: disable=import-outside-toplevel

    from benchmarks import raw_id_data  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="tfra_contender.") as tmp:
        spec = {"mode": mode, "examples": args.examples, "batch": args.batch,
                "dim": args.dim, "seed": args.seed, "warmup_steps": args.warmup_steps,
                "learning_rate": args.learning_rate,
                "validation_fraction": args.validation_fraction, "pad": raw_id_data.PAD,
                "data_module": os.path.abspath(raw_id_data.__file__),
                "out": os.path.join(tmp, "result.json")}
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        for name in ("PYTHONPATH", "TF_CONFIG", "KERAS_BACKEND"):
            env.pop(name, None)
        command = [_python(args.venv), os.path.abspath(__file__), "--train",
                   os.path.join(tmp, "spec.json")]
        print(f"--- {mode}: {MODES[mode]}", flush=True)
        tail = collections.deque(maxlen=40)
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=env, cwd=tmp, start_new_session=True)
        timer = threading.Timer(args.timeout, lambda: os.killpg(process.pid, 9))
        timer.start()
        try:
            for line in process.stdout:
                tail.append(line.rstrip("\n"))
                print(f"  [{mode}] {line.rstrip()}", flush=True)
            code = process.wait()
        finally:
            timer.cancel()
            try:  # servers the trainer started and left behind (its group: its session)
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass
        elapsed = time.monotonic() - started
        try:
            with open(spec["out"]) as f:
                result = json.load(f)
        except (OSError, ValueError):
            reason = (f"killed after the {args.timeout:.0f} s timeout" if elapsed >=
                      args.timeout else f"the trainer exited {code} without results")
            result = {"mode": mode, "error": {"type": "TrainerDied", "message": reason,
                                              "last_lines": list(tail)[-15:]}}
        result["wall_seconds"] = round(elapsed, 1)
        result["loadavg_1_5_15_after"] = list(os.getloadavg())
        return result


def _cell(value, fmt="{:,}"):
    return "" if value is None else fmt.format(value)


def markdown(results):
    host, lines = results["machine"], []
    lines.append("# TensorFlow Recommenders-Addons: dynamic embedding on raw int64 ids\n")
    lines.append(f"Generated by `{results['command']}`\n")
    from benchmarks import machine  # pylint: disable=import-outside-toplevel

    lines.append(f"On {machine.summary(host)}; code: commit {results['code']['commit']}.\n")
    venv = results["venv"]
    if "error" in venv:
        lines.append(f"**Not run**: installing {', '.join(venv['packages'])} failed: "
                     f"`{venv['error']['command']}` exited {venv['error']['exit_code']}:\n")
        lines.append("```\n" + "\n".join(venv["error"]["last_lines"]) + "\n```")
        return "\n".join(lines) + "\n"
    hidden = next((f" The hidden model's own validation AUC, {r[key]:.4f}, bounds what "
                   "any model reaches; keys: the tables' sizes after training (the "
                   "training part has {u:,} distinct users and {i:,} distinct items, "
                   "the last partial batch unused)."
                   .format(u=r["distinct_ids_in_training"]["user_embedding"],
                           i=r["distinct_ids_in_training"]["item_embedding"])
                   for r in results["modes"].values()
                   for key in ["hidden_model_validation_auc"] if key in r), "")
    versions = ", ".join(f"{k} {v}" for k, v in venv["versions"].items())
    data = results["data"]
    lines.append(f"Installed in a virtualenv of its own (Python {venv['python']}): "
                 f"{versions}. Data: `benchmarks.raw_id_data.make({data['examples']}, "
                 f"seed={data['seed']})` (raw splitmix64 ids, Zipf 1.1, a growing id "
                 f"universe), the last {data['validation_fraction']:.0%} for validation; "
                 f"batch {data['batch']}, embedding dim {data['dim']} per table, "
                 f"Dense(1, sigmoid), TFRA's DynamicEmbeddingOptimizer(legacy Adam "
                 f"{data['learning_rate']}); one pass; examples/s over the steps after "
                 f"the first {data['warmup_steps']} (warm-up).{hidden}\n")
    lines.append("| mode | examples/s | timed | validation AUC | keras AUC "
                 "| user keys | item keys | load after (1 min) | outcome |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for mode, r in results["modes"].items():
        keys = r.get("keys", {})
        timed = (f"{r['measured_steps']} steps, {r['measured_seconds']:.2f} s"
                 if "measured_seconds" in r else "")
        error = r.get("error")
        outcome = ("ok" if not error else
                   f"{error['type']}: {error['message'].splitlines()[0][:160]}")
        lines.append(
            f"| {mode} | {_cell(r.get('examples_per_second'), '{:,.0f}')} "
            f"| {timed} "
            f"| {_cell(r.get('validation_auc'), '{:.4f}')} "
            f"| {_cell(r.get('validation_auc_keras'), '{:.4f}')} "
            f"| {_cell(keys.get('user_embedding'))} | {_cell(keys.get('item_embedding'))} "
            f"| {r['loadavg_1_5_15_after'][0]:.2f} | {outcome.replace('|', '/')} |")
    lines.append("")
    for mode, text in MODES.items():
        if mode in results["modes"]:
            lines.append(f"- `{mode}`: {text}.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=16, help="embedding dim of each table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds one mode may take before it is killed")
    parser.add_argument("--venv", default=VENV)
    parser.add_argument("--out", default=os.path.join(RESULTS, "tfra_contender.json"))
    parser.add_argument("--train", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=3, metavar=("JOB", "INDEX", "CLUSTER"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train:
        return train_main(args.train)
    if args.serve:
        return _serve(args.serve[0], int(args.serve[1]), json.loads(args.serve[2]))

    from benchmarks import machine  # pylint: disable=import-outside-toplevel

    host = machine.describe()
    results = {"command": shlex.join(["python", "-m", "benchmarks.tfra_contender",
                                      *(argv if argv is not None else sys.argv[1:])]),
               "contender": "tensorflow-recommenders-addons dynamic_embedding",
               "machine": host, "code": machine.code_version(),
               "data": {"module": "benchmarks/raw_id_data.py", "examples": args.examples,
                        "seed": args.seed, "validation_fraction": args.validation_fraction,
                        "batch": args.batch, "dim": args.dim,
                        "warmup_steps": args.warmup_steps,
                        "learning_rate": args.learning_rate},
               "venv": dict(ensure_venv(args.venv),
                            path=args.venv.replace(os.path.expanduser("~"), "~", 1)),
               "modes": {}}
    if "error" in results["venv"]:
        results["not_run"] = ("installing the contender's packages failed: "
                              + " / ".join(results["venv"]["error"]["last_lines"][-3:]))
        print(f"Not run: {results['not_run']}", file=sys.stderr)
    else:
        for mode in args.modes:
            results["modes"][mode] = run_mode(mode, args)
    results["loadavg_1_5_15_after"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    md_path = os.path.splitext(args.out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(markdown(results))
    print(f"Wrote {args.out} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
