"""Keras integration: every run-time patch of Keras, tf_keras and TensorFlow.

registry.py lists each patch with its target, kind, gate and the versions it was
checked against; `python -m hybrid_strategy.keras_integration` prints the list.
"""
