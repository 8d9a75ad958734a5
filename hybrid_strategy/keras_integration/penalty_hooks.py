"""Keras 3 and tf_keras compute the regularizers of PS tables on the tables' PS tasks.

- Keras 3 computes `layer.losses` from each trainable weight's `regularizer` in
  `Layer._get_regularization_losses`: there, a weight wrapping a PS table is
  regularized by `penalties.weight_penalty`, i.e. `penalties.penalty`.
- tf_keras adds `add_loss(lambda: regularizer(variable))` when `add_weight` makes a
  regularized weight (`_handle_weight_regularization`): a PS table's regularizer
  is `penalties.table_penalty` instead.
Both fall back to Keras' own computation where `penalty` returns None.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls penalty_hooks.install()
```
"""

import functools

from hybrid_strategy import versions
from hybrid_strategy.keras_integration import registry
from hybrid_strategy.tables import penalties
from hybrid_strategy.tables import table as table_lib


def install():
    """Makes Keras 3 (and tf_keras, when `tf.keras` is it) compute the regularizers
    of PS tables with `penalties.penalty`."""
    # Keras-private: whether Keras is computing losses statelessly (symbolic
    # builds), where weights are not read.
    from keras.src.backend import in_stateless_scope  # pylint: disable=import-outside-toplevel

    def make_regularization_losses(regularization_losses):
        @functools.wraps(regularization_losses)
        def _get_regularization_losses(self):
            if in_stateless_scope():
                return regularization_losses(self)
            weights = list(self.trainable_weights)
            if not any(_penalized(weight) for weight in weights):
                return regularization_losses(self)
            return regularization_losses(_WithTablePenalties(self, [
                _TablePenalty(weight) if _penalized(weight) else weight
                for weight in weights]))

        return _get_regularization_losses

    registry.install("penalty_hooks.table_penalties", make_regularization_losses)
    if versions.legacy_keras() is not None:
        registry.install("penalty_hooks.table_penalties_tf_keras", _make_handle_regularization)


def _penalized(weight):
    return (weight.regularizer is not None
            and table_lib.table_behind(weight) is not None)


class _WithTablePenalties:
    """A layer as `Layer._get_regularization_losses` reads it, with the given
    trainable weights (those wrapping a PS table stood in for by `_TablePenalty`)."""

    def __init__(self, layer, trainable_weights):
        self._layer = layer
        self.trainable_weights = trainable_weights

    def __getattr__(self, name):
        return getattr(self._layer, name)


class _TablePenalty:
    """A weight wrapping a PS table, whose `regularizer(...)` is its `penalties.weight_penalty`.

    Keras calls the regularizer with the weight (this stand-in); the penalty is
    computed from the weight itself.
    """

    def __init__(self, weight):
        self._weight = weight

    def regularizer(self, _):
        return penalties.weight_penalty(self._weight)

    def __getattr__(self, name):
        return getattr(self._weight, name)


def _make_handle_regularization(handle):
    @functools.wraps(handle)
    def _handle_weight_regularization(self, name, variable, regularizer):
        if table_lib.is_table(variable):
            regularizer = functools.partial(penalties.table_penalty, regularizer)
        return handle(self, name, variable, regularizer)

    return _handle_weight_regularization
