"""How many examples each contender's step takes: a global batch, or a batch per worker.

Two ways to size the batches of a benchmark run (benchmarks.run; benchmarks.scaling takes
the second):

- `--global-batch G` (default: the model's own, contenders.MODELS): every contender's step
  takes G examples. A synchronous contender (hybrid, hybrid-bf16, allreduce, ps, mwms,
  horovod) splits them over its W workers, G / W each; an asynchronous one (pss, ps-async)
  runs each step on one worker, which then takes all G; `single` takes G in one process.
- `--per-worker-batch B`: every worker takes B examples per step, whatever the contender:
  a synchronous contender's global batch is W x B (B per worker also with
  `--devices-per-worker D`, split over its D replicas), an asynchronous one's step is B
  (one worker's), and `single`'s step is B. The run's "global_batch" is then the
  synchronous contenders' W x B.

Throughput stays examples (or tokens) per second, so contenders compare directly either
way; each contender's result says its batch per step and per worker, and benchmarks.report
keys series by `label()`, never mixing runs of different per-worker batches.
"""

from benchmarks import contenders


def add_options(parser, global_batch=True):
    """--per-worker-batch, and with `global_batch` --global-batch (the two exclusive)."""
    group = parser.add_mutually_exclusive_group()
    if global_batch:
        group.add_argument("--global-batch", type=int, default=None, metavar="G",
                           help="examples per step of every contender (an asynchronous "
                           "step, pss's and ps-async's, runs all of them on one worker); "
                           "default: the model's (" + ", ".join(
                               f"{name} {spec.global_batch}"
                               for name, spec in contenders.MODELS.items()) + ")")
    group.add_argument("--per-worker-batch", type=int, default=None, metavar="B",
                       help="examples per worker per step, every contender alike: a "
                       "synchronous contender's global batch is W x B, pss's and "
                       "ps-async's step (one worker's) B, single's step B")


def check_options(parser, options):
    """parser.error for a per-worker batch no worker can take."""
    per_worker = options.per_worker_batch
    if per_worker is None:
        return
    if per_worker < 1:
        parser.error("--per-worker-batch must be at least 1")
    devices = getattr(options, "devices_per_worker", 1)
    if per_worker % devices:
        parser.error(f"--per-worker-batch {per_worker} must be a multiple of "
                     f"--devices-per-worker {devices} (each worker splits its batch over "
                     "its replicas)")


def forward(options):
    """The batch options again, as arguments of benchmarks.run."""
    if options.per_worker_batch is None:
        return []
    return ["--per-worker-batch", str(options.per_worker_batch)]


def synchronous_global_batch(model, workers, global_batch=None, per_worker_batch=None):
    """The run's global batch, the synchronous contenders': W x B with a per-worker batch,
    else `global_batch` (default: the model's)."""
    if per_worker_batch is not None:
        return per_worker_batch * workers
    return global_batch or contenders.MODELS[model].global_batch


def runs_on_one_worker(contender):
    """Whether each step of `contender` runs on one process: asynchronous or `single`."""
    return contender == "single" or contenders.is_asynchronous(contender)


def step_batch(contender, workers, global_batch, per_worker_batch=None):
    """Examples in one step of `contender` (the batch its trainer's `fit` takes), in a run
    of `global_batch` (or, given, `per_worker_batch`)."""
    if per_worker_batch is None:
        return global_batch
    return per_worker_batch if runs_on_one_worker(contender) else per_worker_batch * workers


def per_worker(contender, step, workers):
    """Examples one worker takes in a step of `step` examples of `contender`."""
    return step if runs_on_one_worker(contender) else step // workers


def label(config):
    """How a run's batches were sized, as series are keyed: "128 per worker" or "global
    512" (`config`: a results file's "config")."""
    if config.get("per_worker_batch"):
        return f"{config['per_worker_batch']} per worker"
    return f"global {config['global_batch']}"


def phrase(config):
    """The batches of a run, for a report's title."""
    if config.get("per_worker_batch"):
        return (f"{config['per_worker_batch']} examples per worker per step (a synchronous "
                f"global batch of {config['global_batch']}; an asynchronous or single "
                f"step of {config['per_worker_batch']})")
    return f"global batch {config['global_batch']}"


def cell(contender, step, workers):
    """A contender's batch per step, for a table: "512 (4 x 128)", "128 (one worker)",
    "128" (single)."""
    if contender == "single":
        return f"{step}"
    if runs_on_one_worker(contender):
        return f"{step} (one worker)"
    return f"{step} ({workers} x {step // workers})"
