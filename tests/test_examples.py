"""keras_examples: importable together, the text classifier's data and learning, a run.

The programs run in the background, two at a time.
"""

import glob
import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

from runs import Runs, new_directory

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ("recommender", "language_model", "decoder_lm", "cnn", "text_classifier", "criteo")


def test_examples_import_into_one_process():
    # As the benchmarks import them: their flags share names, so importing defines none.
    for name in EXAMPLES:
        module = importlib.import_module(f"keras_examples.{name}")
        assert callable(module.build_model) and callable(module.make_dataset)


def test_zipf_ids_are_skewed_ids_of_the_table():
    from keras_examples import common
    ids = common.zipf_ids(np.random.default_rng(0), 1000, 20_000, exponent=1.1)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 1000
    counts = np.bincount(ids, minlength=1000)
    assert counts.max() > 0.1 * len(ids) and np.median(counts) < 10


def test_text_classifier_dataset():
    from keras_examples import text_classifier
    ids, labels = next(iter(text_classifier.make_dataset(64, 32, vocab_size=500, doc_len=8)))
    assert ids.shape == (32, 8) and ids.dtype.name == "int32"
    assert labels.shape == (32,) and labels.dtype.name == "float32"
    again, _ = text_classifier.make_arrays(64, vocab_size=500, doc_len=8)
    np.testing.assert_array_equal(ids, again[:32])  # deterministic for a seed
    other, _ = text_classifier.make_arrays(64, vocab_size=500, doc_len=8, seed=1)
    assert not np.array_equal(other, again)
    _, many_labels = text_classifier.make_arrays(4096, vocab_size=500)
    assert 0.3 < many_labels.mean() < 0.7  # both classes are common


def test_text_classifier_learns_within_a_few_dozen_steps():
    import keras
    from keras_examples import text_classifier
    keras.utils.set_random_seed(0)
    model = text_classifier.build_model()
    history = model.fit(text_classifier.make_dataset(256 * 40, 256), epochs=1,
                        validation_data=text_classifier.make_dataset(2048, 256, seed=1),
                        shuffle=False, verbose=0)
    assert history.history["val_auc"][-1] > 0.57


def text_classifier_program():
    command = [sys.executable, os.path.join(REPO, "keras_examples", "text_classifier.py"),
               "--strategy=none", "--epochs=1", "--steps_per_epoch=2", "--verbose=0",
               "--vocab_size=1000", "--batch_size=64", "--examples=128",
               "--validation_examples=64"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          check=False)


def criteo_programs(data_dir):
    """Criteo's writing run, then its training runs, each if the one before succeeded;
    and the training files written."""
    # Smaller: 26 tables of 50 rows, 2 shards of 128 records, 2 steps on one machine,
    # then with dynamic tables on 2 workers (one shard each) + 1 ps.
    command = [sys.executable, os.path.join(REPO, "keras_examples", "criteo.py"),
               f"--data_dir={data_dir}", "--table_sizes=" + ",".join(["50"] * 26)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    training = ["--epochs=1", "--steps_per_epoch=2", "--verbose=0", "--batch_size=64",
                "--hidden_units=16"]
    cluster = [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
               "--"]
    results = []
    for run in (command + ["--write_files", "--files=2", "--examples=256",
                           "--validation_examples=128"],
                command + training,
                cluster + command + training + ["--dynamic", "--min_count=2",
                                                "--admission=sketch"]):
        results.append(subprocess.run(run, capture_output=True, text=True,
                                      timeout=300, env=env, cwd=REPO, check=False))
        if results[-1].returncode != 0:
            break
    return results, len(glob.glob(os.path.join(data_dir, "train", "*.tfrecord")))


def readme_main_job():
    # README's first command, smaller: the recommender on 2 workers + 1 ps.
    command = [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
               "--", sys.executable, os.path.join(REPO, "keras_examples", "recommender.py"),
               "--epochs=1", "--steps_per_epoch=3", "--verbose=0", "--batch_size=64",
               "--examples=256", "--validation_examples=64"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO, check=False)


RUNS = Runs({"text_classifier": text_classifier_program,
             "criteo": lambda: criteo_programs(new_directory("criteo")),
             "readme_job": readme_main_job})


@pytest.fixture
def text_classifier():
    return RUNS.result("text_classifier")


@pytest.fixture
def criteo():
    return RUNS.result("criteo")


@pytest.fixture
def readme_job():
    return RUNS.result("readme_job")


def test_text_classifier_runs_as_a_program(text_classifier):
    assert text_classifier.returncode == 0, text_classifier.stderr[-2000:]
    assert text_classifier.stdout.splitlines()[-1].startswith("final: val_auc=")


def test_criteo_writes_its_shards_then_trains_from_them(criteo):
    results, train_files = criteo
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    assert len(results) == 3
    assert train_files == 2
    for result in results[1:]:
        assert result.stdout.splitlines()[-1].startswith("final: val_auc=")
    # Then with a DynamicEmbedding per feature, each worker reading its own shard.
    dynamic = [line for line in results[-1].stdout.splitlines() if line.startswith("dynamic ")]
    assert len(dynamic) == 26, results[-1].stdout[-3000:]


def test_readme_main_job_trains_on_a_local_cluster_and_exits_quietly(readme_job):
    assert readme_job.returncode == 0, readme_job.stderr[-3000:]
    assert readme_job.stdout.splitlines()[-1].startswith("final: val_auc=")
    # TensorFlow cannot release functions that run on remote tasks; the strategy
    # skips those releases at exit instead of logging one line per function.
    assert "releasing multi-device function handle" not in readme_job.stderr
