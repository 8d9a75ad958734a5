"""Makes the repository and tests/ importable and keeps TensorFlow's logs short."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
