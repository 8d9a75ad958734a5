"""Asynchronous training: each worker steps on its own batches (training.py).
"""
