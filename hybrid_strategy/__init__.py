"""HybridStrategy: Keras training with dense variables all-reduced and embeddings on PS tasks.

```python
import keras, hybrid_strategy
strategy = hybrid_strategy.HybridStrategy()
with strategy.scope():
    model = keras.Sequential([keras.layers.Embedding(1000, 8),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
```

Names are imported on first use, so that `python -m hybrid_strategy.server` and the
launcher can check their arguments before TensorFlow loads.
"""

import importlib

_EXPORTS = {
    "CheckpointStorageError": "hybrid_strategy.tables.checkpointing",
    "ClusterConfig": "hybrid_strategy.cluster.config",
    "ClusterConfigError": "hybrid_strategy.cluster.config",
    "EXIT_TASK_LOST": "hybrid_strategy.cluster.config",
    "data_service_address": "hybrid_strategy.cluster.data_service",
    "DynamicEmbedding": "hybrid_strategy.layers.dynamic_embedding",
    "DynamicTableLogger": "hybrid_strategy.layers.table_logger",
    "TaskUnreachableError": "hybrid_strategy.cluster.config",
    "Placement": "hybrid_strategy.placement.plan",
    "PlacementPlan": "hybrid_strategy.placement.plan",
    "Shard": "hybrid_strategy.placement.plan",
    "HybridStrategy": "hybrid_strategy.strategy",
    "InputShardingWarning": "hybrid_strategy.input.worker_input",
    "PlacementWarning": "hybrid_strategy.errors",
    "UnsupportedOptimizerError": "hybrid_strategy.tables.sparse_optimizers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybrid_strategy' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return __all__
