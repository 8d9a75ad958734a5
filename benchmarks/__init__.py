"""Benchmarks of HybridStrategy against TensorFlow's own strategies."""
