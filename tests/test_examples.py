"""keras_examples: importable together, the text classifier's data and learning, a run."""

import importlib
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ("recommender", "language_model", "decoder_lm", "cnn", "text_classifier")


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


def test_text_classifier_runs_as_a_program():
    command = [sys.executable, os.path.join(REPO, "keras_examples", "text_classifier.py"),
               "--strategy=none", "--epochs=1", "--steps_per_epoch=2", "--verbose=0",
               "--vocab_size=1000", "--batch_size=64", "--examples=128",
               "--validation_examples=64"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].startswith("final: val_auc=")


def test_readme_main_job_trains_on_a_local_cluster_and_exits_quietly():
    # README's first command, smaller: the recommender on 2 workers + 1 ps.
    command = [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "2", "--ps", "1",
               "--", sys.executable, os.path.join(REPO, "keras_examples", "recommender.py"),
               "--epochs=1", "--steps_per_epoch=3", "--verbose=0", "--batch_size=64",
               "--examples=256", "--validation_examples=64"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                            cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith("final: val_auc=")
    # TensorFlow cannot release functions that run on remote tasks; the strategy
    # skips those releases at exit instead of logging one line per function.
    assert "releasing multi-device function handle" not in result.stderr
