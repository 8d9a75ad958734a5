"""Keras layers of HybridStrategy: `DynamicEmbedding`, keyed by raw int64 or string ids."""

from hybrid_strategy.layers.dynamic_embedding import DynamicEmbedding

__all__ = ["DynamicEmbedding"]
