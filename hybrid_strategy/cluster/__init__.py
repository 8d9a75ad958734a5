"""Cluster: TF_CONFIG, the task servers, the local launcher and liveness.

Imports no TensorFlow at import time, so that `python -m hybrid_strategy.server`
and `python -m hybrid_strategy.launch` check their arguments before it loads.
"""
