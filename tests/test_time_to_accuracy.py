"""The time-to-accuracy benchmark: its exact metric, its contenders' options, its report,
and one real run to a target."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import contenders
from benchmarks import time_to_accuracy as tta

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pairwise_auc(scores, labels):
    """P(score of a positive > score of a negative), ties counting one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def test_auc_by_ranks_is_exact_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 500) / 20.0  # many ties
    labels = (rng.random(500) < 0.3 + 0.5 * scores).astype("float32")
    assert tta.auc(scores, labels) == pytest.approx(pairwise_auc(scores, labels), abs=1e-12)
    assert tta.auc([0.1, 0.2, 0.9], [0, 0, 1]) == 1.0
    assert tta.auc([0.5, 0.5], [0, 1]) == 0.5


def test_targets_count_in_their_direction():
    auc = tta.Target("val_auc", 0.8, True, "validation AUC")
    perplexity = tta.Target("val_perplexity", 1000.0, False, "validation perplexity")
    assert auc.reached(0.8) and not auc.reached(0.79)
    assert perplexity.reached(999.0) and not perplexity.reached(1001.0)
    assert perplexity.describe() == "validation perplexity <= 1000"


def test_hybrid_contenders_take_options():
    assert contenders.hybrid_options("ps-async") == {"architecture": "ps", "asynchronous": True}
    assert contenders.hybrid_options("hybrid:sparse_update='exact':task_timeout=None") == {
        "architecture": "hybrid", "sparse_update": "exact", "task_timeout": None}
    with pytest.raises(ValueError, match="options follow one of"):
        contenders.hybrid_options("mwms:x=1")
    with pytest.raises(ValueError, match="is not key=<Python literal>"):
        contenders.hybrid_options("hybrid:sparse_update=exact")


@pytest.mark.parametrize("argv, message", [
    (["--contenders", "nope"], "unknown contender 'nope'"),
    (["--contenders", "hybrid:sparse_update=exact"], "is not key=<Python literal>"),
    (["--model", "cnn"], "unknown model 'cnn'"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--time-limit", "-1"], "--time-limit must be positive"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        tta.parse(argv)
    assert message in capsys.readouterr().err


def a_run(contenders_results):
    return {"schema": 1, "model": "recommender", "date": "2025-01-01T00:00:00+00:00",
            "command": "python -m benchmarks.time_to_accuracy --model recommender",
            "machine": {"cpu": "test cpu", "nproc": 2}, "code": {},
            "network": {"mode": "loopback", "link_gbit": None},
            "config": {"workers": 2, "ps": 1, "global_batch": 512,
                       "target": vars(tta.TARGETS["recommender"]), "eval_every": 100,
                       "train_batches": 1000, "validation_examples": 16384,
                       "time_limit": 300.0},
            "contenders": contenders_results}


def a_contender(name, seconds, synchronous=True, reached=True):
    points = [{"seconds": seconds * (i + 1) / 2, "steps": 100 * (i + 1), "loss": 0.6 - i / 10,
               "val_auc": 0.79 + i / 100, "val_loss": 0.5, "examples": 51200 * (i + 1)}
              for i in range(2)]
    return {"contender": name, "status": "ok", "keras": "keras 3", "synchronous": synchronous,
            "outcome": "reached" if reached else "time limit", "points": points,
            "to_target": ({"seconds": seconds, "steps": 200, "examples": 102400}
                          if reached else None),
            "best": 0.80 if reached else 0.79, "setup_seconds": 9.0, "loadavg_before": 1.0,
            "per_task": {"chief": {"job": "chief", "cpu_seconds": 20.0, "peak_rss_mib": 1,
                                   "bytes": 0}}}


def test_report_tables_and_plots(tmp_path):
    results = tmp_path / "time_to_accuracy"
    results.mkdir()
    run = a_run([a_contender("single", 40.0), a_contender("ps-async", 20.0, False),
                 a_contender("mwms", 300.0, reached=False)])
    (results / "recommender-w2-p1-loopback.json").write_text(json.dumps(run))
    report = tta.write_report(str(results), str(tmp_path / "time_to_accuracy.md"))
    text = open(report).read()
    assert "Target: validation AUC >= 0.8" in text
    assert "| ps-async | keras 3 | asynchronous | 20.0 | 0.50x | 200 | 102,400 | reached |" in text
    assert "| mwms | keras 3 | synchronous | n/a |  | n/a | n/a | time limit | 0.7900 |" in text
    assert os.path.exists(tmp_path / "recommender-w2-p1-loopback-tta.png")


def test_one_process_trains_to_a_target(tmp_path):
    # The whole path: harness, training program, validation, clock and result file.
    out = tmp_path / "run.json"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.time_to_accuracy", "--model", "recommender",
         "--contenders", "single", "--loopback", "--target", "0.7", "--eval-every", "20",
         "--train-batches", "40", "--validation-examples", "2048", "--time-limit", "120",
         "--json", str(out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (single,) = json.loads(out.read_text())["contenders"]
    assert single["status"] == "ok" and single["outcome"] == "reached", single
    points = single["points"]
    assert [p["steps"] for p in points] == [20 * (i + 1) for i in range(len(points))]
    assert points[-1]["val_auc"] >= 0.7 > max(p["val_auc"] for p in points[:-1] or [{"val_auc": 0}])
    assert single["to_target"]["steps"] == points[-1]["steps"]
    assert single["to_target"]["examples"] == points[-1]["steps"] * 512
    seconds = [p["seconds"] for p in points]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert single["per_task"]["chief"]["cpu_seconds"] > 0
