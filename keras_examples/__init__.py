"""Keras 3 examples trained with HybridStrategy."""
