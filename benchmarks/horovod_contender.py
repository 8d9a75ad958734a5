"""Horovod as a contender of benchmarks/run.py: its virtualenv, its ranks' environment,
its rendezvous server and its trainer.

    python -m benchmarks.run --model lm --contenders hybrid,horovod --workers 4 --ps 1 \\
        --link-gbit 1

The virtualenv. Horovod is no dependency of this project (DESIGN.md: TF collectives are
its all-reduce engine), and its last release, 0.28.1, does not compile against
TensorFlow 2.21 as published, so `ensure_venv` builds, once, a virtualenv at
~/.cache/hybrid_strategy_bench/horovod-venv with `packages()`: the tensorflow and
tf_keras versions of the Python running it (those every other contender runs),
cmake < 4, and Horovod 0.28.1 compiled from its PyPI sdist, CPU only, with Gloo and
without MPI, PyTorch or MXNet (BUILD_ENV).
Before compiling it changes two lines of the unpacked sdist (PATCHES):

- horovod/tensorflow/xla_mpi_ops.cc, line 23 (DESIGN.md), guards its XLA custom-call
  code, which includes XLA headers that have since moved out of TensorFlow's, with
  `TENSORFLOW_VERSION >= 2006000000` only; adding `&& HAVE_GPU` leaves that code (XLA's
  GPU path) out of a CPU build, which then compiles.
- horovod/common/gloo/gloo_context.cc, line 282: the Gloo context of a process set
  (that of all ranks included, which carries every collective) takes the network
  interface from its own, empty, `gloo_iface_` instead of the global context's
  (HOROVOD_GLOO_IFACE), so Gloo binds it to the address this machine's hostname
  resolves to. Between machines that is each machine's own address; between the
  harness's network namespaces, which share one hostname, it is 127.0.0.1 in every one,
  and rank 1 fails to connect to rank 0 ("connect [127.0.0.1]:...: Connection
  refused"). Taking the global context's interface binds it to eth0's address.

cmake comes from PyPI below 4 because Horovod's bundled gloo and flatbuffers ask for
CMake 2.8, which CMake 4 refuses. The venv is reused while the record it keeps there
(installed.json) names the same packages and build; otherwise it is made again (about
600 MB to download, then minutes of compiling). If a step fails, `ensure_venv` returns
the command and its last lines instead, and benchmarks.run records horovod as not run
with that reason, running the other contenders.

The ranks. benchmarks.run starts one process per rank, task `worker<i>` as mwms's (no
chief, no ps), through the same `ContenderRun._spawn` as every other task (its network
namespace, rate-limited link and CPU group), with the venv's python running this module
and PYTHONPATH at this repository, without horovodrun: `gloo_environment` gives each rank
what horovodrun's Gloo launcher (horovod/runner/gloo_run.py) would, every rank a host of
its own with one slot, and Horovod's rendezvous server (`--rendezvous HOSTS`, the
RendezvousServer gloo_run starts, initialised with the plan horovodrun would make for
those hosts) runs as a process of the run, in worker0's namespace (or on loopback), until
the run stops. The ranks use it in `hvd.init()` only, before the measured window.

The trainer is benchmarks.contenders' (`run`, `Trainer`, its timer, phase markers and
heartbeats, the same models and data) under tf_keras (TF_USE_LEGACY_KERAS=1: with Keras
3, Horovod 0.28.1's DistributedOptimizer silently does not average across ranks), with
`horovod.tensorflow.keras`: `hvd.init()`, the example's optimizer wrapped in
`hvd.DistributedOptimizer` (its default: dense gradients all-reduced, embedding
gradients all-gathered, both averaged), `BroadcastGlobalVariablesCallback(0)`, and each
rank reading its 1/W part of every global batch (as the HybridStrategy contenders'
workers do). Rank 0 writes the results. Nothing of `hybrid_strategy` loads: the examples
import the package, whose `__init__` only names its modules.
"""

import collections
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

from benchmarks import contenders as contenders_lib
from benchmarks import tfra_contender

VENV = os.path.join(os.path.expanduser("~"), ".cache", "hybrid_strategy_bench",
                    "horovod-venv")
HOROVOD = "horovod==0.28.1"
INSTALLED = "installed.json"  # in the venv: what it holds and how Horovod was built
BUILD_ENV = {"HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITHOUT_MPI": "1",
             "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_PYTORCH": "1",
             "HOROVOD_WITHOUT_MXNET": "1", "HOROVOD_CPU_OPERATIONS": "gloo"}
# Lines of the sdist changed before compiling (the module's docstring says why): each
# line's text, stripped, must be "from"; "from" becomes "to" in it.
PATCHES = (
    {"file": "horovod/tensorflow/xla_mpi_ops.cc", "line": 23,
     "from": "#if TENSORFLOW_VERSION >= 2006000000",
     "to": "#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU"},
    {"file": "horovod/common/gloo/gloo_context.cc", "line": 282,
     "from": "device_attr.iface = gloo_iface_;",
     "to": "device_attr.iface = global_context.gloo_iface_;"},
)
REPORTED = ("tensorflow", "tf-keras", "keras", "horovod", "cmake", "numpy")
# Seconds a rank waits in hvd.init() for the others (Horovod's default, 30, is shorter
# than TensorFlow's import on a machine of a fraction of a core).
GLOO_TIMEOUT_SECONDS = 300
_SERVING = "rendezvous serving on port "
# Characters shown of a line of the build's output: enough for cmake's progress, not
# its compiler command lines (whole in the error record, if the build fails).
_SHOWN_WIDTH = 160


# The virtualenv ---------------------------------------------------------------------


def venv_python(venv=VENV):
    return os.path.join(venv, "bin", "python")


def packages():
    """What the venv holds: this Python's tensorflow and tf_keras, cmake, Horovod."""
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    tensorflow = metadata.version("tensorflow")
    try:
        tf_keras = f"tf_keras=={metadata.version('tf-keras')}"
    except metadata.PackageNotFoundError:
        tf_keras = "tf_keras~={}.{}.0".format(*tensorflow.split(".")[:2])
    return (f"tensorflow=={tensorflow}", tf_keras, "cmake>=3.13,<4", HOROVOD)


def _build():
    """How Horovod is built: what the record must name for the venv to be reused (as
    JSON holds it)."""
    return json.loads(json.dumps({"sdist": HOROVOD, "env": BUILD_ENV, "patches": PATCHES}))


def patch_sdist(source):
    """Applies PATCHES to the unpacked sdist at `source`; raises ValueError, changing
    nothing, if a line is not the one expected."""
    changed = {}
    for patch in PATCHES:
        path = os.path.join(source, patch["file"])
        if path not in changed:
            with open(path) as f:
                changed[path] = f.read().split("\n")
        lines, index = changed[path], patch["line"] - 1
        if index >= len(lines) or lines[index].strip() != patch["from"]:
            found = lines[index] if index < len(lines) else "past its end"
            raise ValueError(f"{patch['file']}:{patch['line']} is {found!r}, "
                             f"not {patch['from']!r}")
        lines[index] = lines[index].replace(patch["from"], patch["to"])
    for path, lines in changed.items():
        with open(path, "w") as f:
            f.write("\n".join(lines))


def _failure(packages_, command, code, tail):
    return {"packages": list(packages_), "build": _build(),
            "error": {"command": command, "exit_code": code,
                      "last_lines": list(tail)[-15:]}}


def ensure_venv(venv=VENV, packages_=None, out=None):
    """The venv's record {"packages", "build", "versions", ...}, building the venv first
    unless its record names `packages_` (default `packages()`) and this build; or, if a
    step fails, {"error": {"command", "exit_code", "last_lines"}}. Progress goes to `out`
    (default stderr)."""
    out = out or sys.stderr
    packages_ = list(packages_ or packages())
    record_path = os.path.join(venv, INSTALLED)
    try:
        with open(record_path) as f:
            record = json.load(f)
        if record.get("packages") == packages_ and record.get("build") == _build():
            print(f"horovod: reusing the virtualenv at {venv}", file=out, flush=True)
            return record
    except (OSError, ValueError):
        pass
    print(f"horovod: building a virtualenv at {venv} with {', '.join(packages_)} "
          "(Horovod compiled from its sdist, patched; about 600 MB to download and "
          "minutes to compile)", file=out, flush=True)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    python = venv_python(venv)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TF_CONFIG", "KERAS_BACKEND", "TF_USE_LEGACY_KERAS")}
    # Horovod's setup.py runs `make -j8` unless MAKEFLAGS says otherwise: more compilers
    # of TensorFlow's headers than a small machine has cores or memory for.
    build_env = dict(env, **BUILD_ENV, MAKEFLAGS=f"-j{os.cpu_count() or 1}",
                     PATH=os.pathsep.join([os.path.dirname(python), env.get("PATH", "")]))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="horovod-build-") as build_dir:
        source = os.path.join(build_dir, HOROVOD.replace("==", "-"))
        steps = [
            ("venv", [sys.executable, "-m", "venv", "--clear", venv], env),
            ("pip", [python, "-m", "pip", "install", "--upgrade", "pip"], env),
            # Horovod's setup.py imports TensorFlow for its compiler flags: it builds
            # without isolation, against these.
            ("tensorflow", [python, "-m", "pip", "install", *packages_[:-1],
                            "setuptools", "wheel"], env),
            ("download", [python, "-m", "pip", "download", "--no-deps", "--no-binary",
                          ":all:", HOROVOD, "-d", build_dir], env),
            ("build", [python, "-m", "pip", "install", "--no-build-isolation",
                       "--no-cache-dir", "-v", source], build_env),
            ("check", [python, "-c", "import horovod, horovod.tensorflow.keras as hvd; "
                       "assert hvd.gloo_built(), 'built without Gloo'; "
                       "print('horovod', horovod.__version__, 'with Gloo')"],
             dict(env, TF_USE_LEGACY_KERAS="1")),
        ]
        seconds = {}
        for name, command, step_env in steps:
            tail = collections.deque(maxlen=30)  # this command's last lines
            step_started = time.monotonic()
            code = tfra_contender.run_logged(command, tail, env=step_env, out=out,
                                             width=_SHOWN_WIDTH)
            seconds[name] = round(time.monotonic() - step_started, 1)
            if code != 0:
                return _failure(packages_, shlex.join(command), code, tail)
            if name == "download":
                try:
                    with tarfile.open(source + ".tar.gz") as archive:
                        archive.extractall(build_dir, filter="data")
                    patch_sdist(source)
                except (OSError, tarfile.TarError, ValueError) as e:
                    return _failure(packages_, f"unpacking and patching {source}.tar.gz",
                                    None, [f"{type(e).__name__}: {e}"])
                print("horovod: patched " + ", ".join(
                    f"{p['file']}:{p['line']} to {p['to']!r}" for p in PATCHES)
                    + "; compiling", file=out, flush=True)
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], env=env,
                            stdout=subprocess.PIPE, text=True, check=True).stdout
    versions = {p["name"].lower().replace("_", "-"): p["version"]
                for p in json.loads(listed)}
    record = {"packages": packages_, "build": _build(),
              "versions": {name: versions.get(name) for name in REPORTED},
              "python": subprocess.run([python, "-c", "import platform; "
                                        "print(platform.python_version())"],
                                       stdout=subprocess.PIPE, text=True).stdout.strip(),
              "install_seconds": round(time.monotonic() - started, 1),
              "compile_seconds": seconds["build"], "step_seconds": seconds}
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"horovod: virtualenv ready in {record['install_seconds']:.0f} s (Horovod "
          f"compiled in {record['compile_seconds']:.0f} s): {record['versions']}",
          file=out, flush=True)
    return record


def not_run_reason(record):
    """One line saying why a venv record that failed has no Horovod (for a report)."""
    error = record["error"]
    last = " / ".join(line.strip() for line in error["last_lines"][-3:] if line.strip())
    code = "" if error["exit_code"] is None else f" exited {error['exit_code']}"
    return (f"not run: building Horovod's virtualenv failed: `{error['command']}`{code}: "
            f"{last}").replace("|", "/")


# The ranks' environment and the rendezvous server ---------------------------------


def gloo_environment(rank, hosts, rendezvous_address, rendezvous_port, interface):
    """What horovodrun's Gloo launcher would set for rank `rank` of `hosts` (one host
    name per rank, one slot each), its rendezvous server at `rendezvous_address`:
    `rendezvous_port`, Gloo bound to `interface`."""
    size = len(hosts)
    return {
        # gloo_run.create_slot_env_vars, for host `hosts[rank]` with one slot
        "HOROVOD_HOSTNAME": hosts[rank],
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(rank),
        "HOROVOD_CROSS_SIZE": str(size),
        # gloo_run.create_run_env_vars
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": interface,
        "NCCL_SOCKET_IFNAME": interface,
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_SECONDS),
    }


def rendezvous_port(log_text):
    """The port a `--rendezvous` process said it serves on, or None (not yet)."""
    for line in log_text.splitlines():
        if line.startswith(_SERVING):
            return int(line[len(_SERVING):])
    return None


def serve_rendezvous(hosts):
    """Horovod's rendezvous server for `hosts` (one slot each), as gloo_run starts it;
    prints its port, then serves until this process is stopped."""
    from horovod.runner.common.util import hosts as hosts_lib  # pylint: disable=import-outside-toplevel
    from horovod.runner.http.http_server import RendezvousServer  # pylint: disable=import-outside-toplevel

    plan = hosts_lib.get_host_assignments(
        hosts_lib.parse_hosts(",".join(f"{host}:1" for host in hosts)), len(hosts))
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # the server's threads inherit it
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    print(f"{_SERVING}{port}", flush=True)
    signal.sigwait(stop)
    server.stop()
    return 0


# The trainer (in the venv) -----------------------------------------------------------


class HorovodTrainer(contenders_lib.Trainer):
    """benchmarks.contenders' Trainer under tf_keras and no strategy, with Horovod: the
    example's optimizer wrapped in `hvd.DistributedOptimizer`, this rank's part of
    every global batch, rank 0's variables broadcast."""

    def __init__(self, contender, model_name, num_ps):
        super().__init__(contender, model_name, num_ps)
        import horovod  # pylint: disable=import-outside-toplevel
        import horovod.tensorflow.keras as hvd  # pylint: disable=import-outside-toplevel
        hvd.init()
        self.hvd, self.version = hvd, horovod.__version__

    @property
    def strategy_name(self):
        return f"horovod {self.version} (Gloo, DistributedOptimizer)"

    @property
    def replicas(self):
        return self.hvd.size()

    def build_model(self, seed=0, strategy=None):
        model = super().build_model(seed, strategy)
        # The example compiled the model with its optimizer; before the first step the
        # same optimizer, wrapped, can replace it without compiling again.
        model.optimizer = self.hvd.DistributedOptimizer(model.optimizer)
        return model

    def fit(self, model, examples, batch, callbacks=(), **fit_kwargs):
        from keras_examples import common  # pylint: disable=import-outside-toplevel

        arrays = self.module.make_arrays(examples, seed=0, **self.model_spec.data)
        share = contenders_lib.worker_share(arrays, batch, self.hvd.rank(), self.hvd.size())
        data = common.batched_dataset(share, batch // self.hvd.size(), repeat=True)
        callbacks = [self.hvd.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks]
        return model.fit(data, verbose=0, shuffle=False, callbacks=callbacks, **fit_kwargs)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 2 and argv[0] == "--rendezvous":
        return serve_rendezvous(argv[1].split(","))
    if len(argv) != 1:
        print("usage: python -m benchmarks.horovod_contender SPEC.json | "
              "--rendezvous HOST,HOST,...", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    contenders_lib.run(spec, HorovodTrainer)
    # Every rank leaves Horovod's background loop, which exchanges its state with the
    # others' all the time, before any rank exits.
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
