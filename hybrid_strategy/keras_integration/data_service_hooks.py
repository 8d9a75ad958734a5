"""Keras runs every epoch of a dataset read from the tf.data service to its end.

With dynamic sharding the number of batches of such a dataset changes from one epoch to
the next (input/service_input.py); Keras takes a dataset of unknown length to have as
many steps in every epoch as in its first one: it would stop an epoch early and drop
elements (Keras 3), or end training (tf_keras). The guard around an epoch's steps here
forgets the steps an epoch took, for such a dataset under a HybridStrategy.

```python
from hybrid_strategy.keras_integration import data_service_hooks
data_service_hooks.install(lambda strategy: True)   # HybridStrategy() passes its gate
```
"""

import contextlib

from hybrid_strategy import versions
from hybrid_strategy.input import service_input
from hybrid_strategy.keras_integration import registry


def install(applies):
    """Makes Keras 3 and tf_keras run every epoch of a dataset read from the tf.data
    service to its end, while `applies(strategy)` holds for the model's strategy."""
    # Keras-private: Keras 3's epoch iterator keeps the first epoch's number of steps
    # for a dataset of unknown length. The adapter's dataset as the user gave it
    # (Keras' TFDatasetAdapter), not get_tf_dataset(): for arrays that would build a
    # new dataset of them, a copy.
    registry.install(
        "data_service_hooks.forget_epoch_steps",
        lambda catch_stop_iteration: _forgetting_steps(
            catch_stop_iteration, "_num_batches",
            lambda self: applies(self._distribute_strategy)
            and service_input.varies_per_epoch(getattr(self.data_adapter, "_dataset", None))))
    if versions.legacy_keras() is None:
        return
    # tf_keras-private: its DataHandler does the same, and ends training when a later
    # epoch is shorter.
    registry.install(
        "data_service_hooks.tf_keras_forget_epoch_steps",
        lambda catch_stop_iteration: _forgetting_steps(
            catch_stop_iteration, "_inferred_steps",
            lambda self: applies(self._model.distribute_strategy)
            and service_input.varies_per_epoch(getattr(self._adapter, "_dataset", None))))


def _forgetting_steps(catch_stop_iteration, attribute, varies):
    """`catch_stop_iteration` that forgets the number of steps an epoch took (`attribute`
    set by Keras when a dataset of unknown length runs out) where `varies(self)`."""

    @contextlib.contextmanager
    def forgetting(self):
        with catch_stop_iteration(self):
            yield
        if getattr(self, attribute) is not None and _remembered_varies(self, varies):
            setattr(self, attribute, None)

    return forgetting


def _remembered_varies(self, varies):
    """`varies(self)`, computed once per iterator (it walks the dataset's inputs)."""
    if not hasattr(self, "_hybrid_varies_per_epoch"):
        self._hybrid_varies_per_epoch = bool(varies(self))
    return self._hybrid_varies_per_epoch
