"""`DynamicTableLogger`: each epoch's rows in use, admissions and evictions of DynamicEmbedding tables.

```python
import keras, numpy as np
from hybrid_strategy.layers import DynamicEmbedding, DynamicTableLogger
model = keras.Sequential([keras.Input((1,), dtype="int64"),
                          DynamicEmbedding(4, capacity=8, name="ids"),
                          keras.layers.Flatten(), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
history = model.fit(np.arange(32)[:, None] * 10**12, np.ones((32, 1)), batch_size=8,
                    callbacks=[DynamicTableLogger()], verbose=0)
print(history.history["ids_evicted"])   # [24]: 32 ids went through 8 rows
```
"""

import tensorflow as tf

from hybrid_strategy.layers.dynamic_embedding import DynamicEmbedding


class DynamicTableLogger(tf.keras.callbacks.Callback):
    """Adds, at each epoch's end, `<layer>_rows` (rows in use), `<layer>_admitted` and
    `<layer>_evicted` (during the epoch) of every DynamicEmbedding of the model to the
    epoch's logs: the History and the progress bar show them.

    Args:
        verbose: Also print one line per table and epoch.
    """

    def __init__(self, verbose=False):
        super().__init__()
        self.verbose = verbose
        self._at_epoch_start = {}

    def _tables(self):
        # Keras-private, in Keras 3 and tf_keras alike: every layer, nested ones too.
        return [layer for layer in self.model._flatten_layers()
                if isinstance(layer, DynamicEmbedding) and layer.built]

    def on_epoch_begin(self, epoch, logs=None):
        self._at_epoch_start = {layer.name: layer.table_stats() for layer in self._tables()}

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        for layer in self._tables():
            now = layer.table_stats()
            before = self._at_epoch_start.get(layer.name, {"admissions": 0, "evictions": 0})
            figures = {"rows": sum(now["rows_in_use"]),
                       "admitted": now["admissions"] - before["admissions"],
                       "evicted": now["evictions"] - before["evictions"]}
            for name, value in figures.items():
                logs[f"{layer.name}_{name}"] = value
            if self.verbose:
                print(f"Epoch {epoch + 1}: {layer.name}: {figures['rows']:,} of "
                      f"{now['capacity']:,} rows in use, {figures['admitted']:,} admitted, "
                      f"{figures['evicted']:,} evicted")
