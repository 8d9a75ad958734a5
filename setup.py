"""Installs hybrid_strategy: `pip install -e .[test]` brings TensorFlow 2.21 (CPU) and the rest."""
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
        "tensorflow-cpu>=2.21,<2.22",
        "numpy",
        "absl-py",
    ],
    extras_require={
        "test": ["pytest>=8"],
        # Plots of benchmarks/results (python -m benchmarks.report).
        "bench": ["matplotlib"],
    },
)
