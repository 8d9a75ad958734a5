"""Keras 3 optimizers under HybridStrategy clip the cross-replica sum, not each replica's part.

Keras 3 clips in `_backend_apply_gradients` (`_clip_gradients`) and sums the
replicas' gradients later (`_all_reduce_sum_gradients`): in a replica context
under HybridStrategy, the first leaves the gradients as they are and the second
clips what it summed (communication/clipping.py clips PS table sums on their PS).

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls clipping_hooks.install(gates.under_hybrid_strategy)
```
"""

import tensorflow as tf

from hybrid_strategy.communication import clipping
from hybrid_strategy.keras_integration import registry


def install(applies):
    """Makes Keras 3 optimizers clip summed gradients where `applies()` (under HybridStrategy)."""

    def deferred(optimizer):
        return (clipping.clips(optimizer) and applies()
                and not tf.distribute.in_cross_replica_context())

    # Keras-private: the TensorFlow backend's optimizer base, whose two methods
    # are where Keras clips and where it sums across replicas.
    def make_clip(original):
        def _clip_gradients(self, grads):
            if deferred(self):
                return list(grads)
            return original(self, grads)

        return _clip_gradients

    def make_sum(original):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            reduced = original(self, grads_and_vars)
            if not deferred(self):
                return reduced
            return clipping.clip_summed(self, reduced)

        return _all_reduce_sum_gradients

    registry.install("clipping_hooks.defer_replica_clipping", make_clip)
    registry.install("clipping_hooks.clip_summed_gradients", make_sum)
