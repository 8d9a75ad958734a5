"""Installs hybrid_strategy: `pip install -e .[test]` brings TensorFlow 2.21 and the rest."""
from setuptools import find_packages, setup

setup(
    name="hybrid_strategy",
    version="0.1.0",
    description=(
        "A tf.distribute strategy for Keras: dense variables mirrored and "
        "all-reduced, embedding tables on parameter servers."
    ),
    packages=find_packages(include=["hybrid_strategy", "hybrid_strategy.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The one name every TensorFlow 2.21 build answers to (CPU-only machines and
        # GPUs alike, `tensorflow[and-cuda]` included), and the one tf-keras requires:
        # depending on `tensorflow-cpu` would put a second copy beside it.
        "tensorflow>=2.21,<2.22",
        # Keras' TensorBoard callback and the profiler's viewer need it; TensorFlow
        # itself no longer installs it.
        "tensorboard>=2.21,<2.22",
        # The Keras 3 releases the run-time patches were checked against (versions.py
        # says the same and CI runs both ends): TensorFlow 2.21 accepts >=3.12, whose
        # 3.12 and 3.13 lack targets HybridStrategy patches; 3.16 is not yet checked.
        "keras>=3.14,<3.16",
        "numpy",
        "absl-py",
    ],
    extras_require={
        # tf_keras (TF_USE_LEGACY_KERAS=1): the tests run under it as well as Keras 3;
        # matplotlib: they check the plots of the time-to-accuracy report.
        "test": ["pytest>=8", "tf-keras>=2.21,<2.22", "matplotlib"],
        # Plots of benchmarks/results (python -m benchmarks.report).
        "bench": ["matplotlib"],
    },
)
