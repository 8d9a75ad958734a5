"""TensorFlow's distributed iterator picks each worker's batch on that worker.

The picking itself is input/end_of_data.py's; this hook makes it the `get_next` of the
distributed iterators of a HybridStrategy that spans several devices or tasks.

```python
from hybrid_strategy.keras_integration import iterator_hooks
iterator_hooks.install(lambda strategy: True)   # HybridStrategy() passes its gate
```
"""

from hybrid_strategy.input import end_of_data
from hybrid_strategy.keras_integration import registry


def install(applies):
    """Makes distributed iterators of `applies(strategy)` pick batches per worker."""

    # TF-private: the distributed iterator's get_next (tensorflow.python.distribute.
    # input_lib), which picks every replica's batch in one conditional on one device.
    def make(get_next):
        def get_next_per_worker(self, name=None):
            if applies(self._strategy) and end_of_data.picks_per_worker(self):
                return end_of_data.get_next_per_worker(self, get_next, name)
            return get_next(self, name)

        return get_next_per_worker

    registry.install("iterator_hooks.get_next_per_worker", make)
