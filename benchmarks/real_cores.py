"""The performance targets on a host with real cores, in the order they matter, within a time budget.

    python -m benchmarks.real_cores --budget 520 --out DIR [--only NAMES | --skip NAMES]
        [--repeats 3] [--dry-run]

A host lent for minutes (../shared/device/README.md carries TensorFlow to one) should spend
them on the runs the claims lead with. This runs `python -m benchmarks.run` once per target
below, most important first, every task on an emulated machine of 2 real cores (1.5 on the
language model's 9 machines) on loopback, each contender given the same examples per worker
per step with 8 steps per call. Each target's JSON goes to DIR/<name>.json. A target whose
estimated time no longer fits what is left of the budget is skipped and named, never cut off
halfway; the estimates are what each contender's run (cluster start-up included) took on a
16-core host. Copy the JSON files into benchmarks/results/real-cores/ and run
`python -m benchmarks.report` to show them. Set HSB_CODE_COMMIT where the code was unpacked
from `git archive`, so each run records its commit.

Example (prints the plan, runs nothing):

    python -m benchmarks.real_cores --budget 520 --out /tmp/out --skip recommender-pwb512 --dry-run
"""

import argparse
import collections
import os
import subprocess
import sys
import time

from benchmarks import cpu_groups
from benchmarks import run

Target = collections.namedtuple("Target", "name cpus seconds_per_run contenders args")

_RECOMMENDER = ("--model", "recommender", "--workers", "4", "--ps", "1")
_CALLS = ("--steps-per-execution", "8", "--warmup", "24", "--steps", "240")
_LM_CALLS = ("--steps-per-execution", "8", "--warmup", "8", "--steps", "48",
             "--per-worker-batch", "128")
TARGETS = (
    Target("recommender-pwb512", 2, 55, ("hybrid", "pss"),
           _RECOMMENDER + _CALLS + ("--per-worker-batch", "512")),
    Target("recommender-pwb128", 2, 60, ("hybrid", "pss"),
           _RECOMMENDER + _CALLS + ("--per-worker-batch", "128")),
    Target("criteo-pwb512", 2, 65, ("hybrid", "pss"),
           ("--model", "criteo", "--workers", "4", "--ps", "1") + _CALLS
           + ("--per-worker-batch", "512")),
    Target("lm-w8", 1.5, 90, ("hybrid", "pss"),
           ("--model", "lm", "--workers", "8", "--ps", "1") + _LM_CALLS),
    Target("lm-w1", 1.5, 45, ("hybrid",),
           ("--model", "lm", "--workers", "1", "--ps", "1") + _LM_CALLS),
    Target("parallax", 2, 60, ("hybrid", "pss"),
           ("--model", "recommender", "--workers", "4", "--ps", "4", "--colocate") + _CALLS
           + ("--per-worker-batch", "128")),
    Target("single-pwb512", 2, 30, ("single",),
           _RECOMMENDER + _CALLS + ("--per-worker-batch", "512")),
)
NAMES = tuple(t.name for t in TARGETS)


def command(target, out_dir, repeats, timeout):
    """benchmarks.run's argv for one target."""
    return ([sys.executable, "-m", "benchmarks.run", "--machine-cpus", f"{target.cpus:g}",
             "--contenders", ",".join(target.contenders), *target.args,
             "--repeats", str(repeats), "--loopback", "--timeout", str(int(timeout)),
             "--stall-timeout", "40", "--json", os.path.join(out_dir, f"{target.name}.json")])


def machines(target):
    """Emulated machines the target's largest contender takes, laid out as benchmarks.run
    lays them out (the chief's included)."""
    count = {flag: int(target.args[target.args.index(flag) + 1])
             for flag in ("--workers", "--ps")}
    colocate = "--colocate" in target.args
    return max(len(set(cpu_groups.layout(
        [t.name for t in run.cluster_tasks(name, count["--workers"], count["--ps"])],
        colocate).values())) for name in target.contenders)


def estimate(target, repeats):
    return target.seconds_per_run * len(target.contenders) * repeats


def chosen(only, skip):
    """The targets to run, in TARGETS' order; an unknown name is refused."""
    for name in (*only, *skip):
        if name not in NAMES:
            raise ValueError(f"no target named {name!r}; the targets are {', '.join(NAMES)}")
    return [t for t in TARGETS if (not only or t.name in only) and t.name not in skip]


def _names(text):
    return [n for n in text.split(",") if n] if text else []


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_cores",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--budget", type=float, required=True, metavar="SECONDS",
                        help="seconds all the runs may take; a target that no longer fits "
                             "is skipped")
    parser.add_argument("--out", required=True, help="directory of the JSON results")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--only", default="", help="comma-separated targets to run: "
                       + ", ".join(NAMES))
    group.add_argument("--skip", default="", help="comma-separated targets to leave out")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every contender, in rounds (default 3: the median)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and the commands, run nothing")
    options = parser.parse_args(argv)
    if options.budget <= 0 or options.repeats < 1:
        parser.error("--budget must be positive and --repeats at least 1")
    try:
        options.targets = chosen(_names(options.only), _names(options.skip))
    except ValueError as e:
        parser.error(str(e))
    return options


def main(argv=None):
    options = parse(sys.argv[1:] if argv is None else argv)
    cores = os.cpu_count() or 1
    start, planned = time.monotonic(), 0.0  # planned: the estimates a dry run counts as spent
    ran, skipped = [], []
    for target in options.targets:
        need = machines(target) * target.cpus
        if need > cores:
            skipped.append(f"{target.name} (its machines take {need:g} cores, this host "
                           f"has {cores})")
            continue
        left = options.budget - (time.monotonic() - start) - planned
        cost = estimate(target, options.repeats)
        if cost > left:
            skipped.append(f"{target.name} (about {cost:.0f} s, {left:.0f} s left)")
            continue
        argv = command(target, options.out, options.repeats, timeout=min(left, 300))
        print(f"=== {target.name}, about {cost:.0f} s of {left:.0f} s left: "
              + " ".join(argv[1:]), flush=True)
        if options.dry_run:
            ran.append(target.name)
            planned += cost
            continue
        os.makedirs(options.out, exist_ok=True)
        t0 = time.monotonic()
        done = subprocess.run(argv)
        ran.append(target.name)
        print(f"=== {target.name}: exit {done.returncode} after "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    print(f"{'would run' if options.dry_run else 'ran'}: {', '.join(ran) or 'nothing'}")
    print(f"skipped: {'; '.join(skipped) or 'nothing'}")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
