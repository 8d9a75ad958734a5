"""Makes the repository and tests/ importable, keeps TensorFlow's logs short, and drops
the background chief programs (tests/runs.py) no test is left to read."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_sessionfinish():
    import runs  # pylint: disable=import-outside-toplevel
    runs.drop_queued()
