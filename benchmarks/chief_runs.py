"""A benchmark's chief on a local cluster, with this checkout's code or an earlier commit's.

```python
report = chief_runs.report_header("benchmarks.x", argv, options.before)
with chief_runs.packages(options.versions, report["before_commit"]) as code:
    result, error = chief_runs.run(command, code["before"], "x result: ", timeout=600)
chief_runs.save(options.json, report, markdown_text)
```

`command` starts the cluster (`python -m hybrid_strategy.launch ... -- python -m
benchmarks.x --chief ...`), whose chief prints one line starting with the prefix and a
JSON result. "before" is the `hybrid_strategy` package of a commit (default: where this
branch forked from main), exported with `git archive`; "after" is this checkout.
"""

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile

from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv, parse, run_chief, run_all):
    """Parses `argv` (None: the command line), then `run_chief(options)` with --chief,
    else `run_all(options, argv)`; returns what that returns (an exit status or None)."""
    argv = sys.argv[1:] if argv is None else argv
    options = parse(argv)
    if options.chief:
        return run_chief(options)
    return run_all(options, argv)


def add_arguments(parser, timeout, json_path):
    """The options every such benchmark has (and --chief, for the run on the cluster)."""
    parser.add_argument("--versions", nargs="+", default=["before", "after"],
                        choices=["before", "after"])
    parser.add_argument("--before", default=None,
                        help="commit whose package is 'before' (default: merge-base with main)")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--json", default=json_path, help="results; the markdown beside it")
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)


def report_header(module, argv, before=None):
    """The machine, this checkout's code, the 'before' commit and the command run."""
    before = before or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=REPO,
                                      check=True, text=True,
                                      stdout=subprocess.PIPE).stdout.strip()
    return {"machine": machine.describe(), "code": machine.code_version(),
            "before_commit": before, "invocation": shlex.join(["python", "-m", module] + argv)}


def save(json_path, report, text):
    """Writes the report as JSON and `text` (markdown) beside it."""
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(text)


def code_description(report):
    """"before = ...; after = ..." for a report's markdown."""
    code = report["code"]
    return (f"before = the `hybrid_strategy` package of commit {report['before_commit']}; "
            f"after = commit {code['commit']}"
            + (f" with {', '.join(code['modified_files'])} modified"
               if code["modified_files"] else "") + ".")


def export_package(commit, directory):
    """Writes the `hybrid_strategy` package of `commit` into `directory`."""
    archive = os.path.join(directory, "code.tar")
    subprocess.run(["git", "archive", "--format=tar", "-o", archive, commit, "hybrid_strategy"],
                   cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    return directory


@contextlib.contextmanager
def packages(versions, before):
    """{version: the directory whose `hybrid_strategy` package it runs}."""
    with tempfile.TemporaryDirectory(prefix="benchmark_code_") as directory:
        if "before" in versions:
            export_package(before, directory)
        yield {"before": directory, "after": REPO}


def run(command, code_dir, prefix, timeout):
    """Runs `command` with `code_dir`'s package first on the path; (result, error).

    The result is the JSON after `prefix` on the last line that starts with it; on
    failure it is None and the error is the last line of the output that names one.
    """
    # `python -m` puts the working directory first on sys.path: the package under test.
    done = subprocess.run(command, env=machine.environment(code_dir), cwd=code_dir,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    output = done.stdout.splitlines()
    lines = [line for line in output if line.startswith(prefix)]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1][len(prefix):]), None
    errors = [line for line in output if "Error" in line] or output or ["(no output)"]
    return None, errors[-1][:400]
