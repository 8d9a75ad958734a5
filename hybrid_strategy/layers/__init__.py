"""Keras layers of HybridStrategy: `DynamicEmbedding`, keyed by raw int64 or string ids, and
`DynamicTableLogger`, a callback reporting its tables' rows, admissions and evictions."""

from hybrid_strategy.layers.dynamic_embedding import DynamicEmbedding
from hybrid_strategy.layers.table_logger import DynamicTableLogger

__all__ = ["DynamicEmbedding", "DynamicTableLogger"]
