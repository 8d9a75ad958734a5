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
"""

from hybrid_strategy.cluster import ClusterConfig
from hybrid_strategy.cluster import ClusterConfigError
from hybrid_strategy.cluster import TaskUnreachableError
from hybrid_strategy.placement import Placement
from hybrid_strategy.placement import PlacementPlan
from hybrid_strategy.strategy import HybridStrategy
from hybrid_strategy.strategy import PlacementWarning

__all__ = [
    "ClusterConfig",
    "ClusterConfigError",
    "HybridStrategy",
    "Placement",
    "PlacementPlan",
    "PlacementWarning",
    "TaskUnreachableError",
]
