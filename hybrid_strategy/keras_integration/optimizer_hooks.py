"""Keras optimizers refuse PS tables they cannot update, and update them by rows.

- `compile` (Keras 3's `Trainer`, tf_keras' `Model`) checks the model's tables if it
  has its variables by then; a model that makes them later (a subclassed model not
  yet built) is checked when its optimizer is built (`build`): Keras 3 builds it
  when `fit` starts, before it traces a step, tf_keras while it traces the first
  one (`sparse_optimizers.check`).
- Keras 3's Muon, whose weight decay assigns each variable in each replica (a table
  would decay once per replica), decays tables through the strategy as the other
  optimizers do (`sparse_optimizers.decay_tables_once`).
- A mirrored variable (learning rate, step count, loss scale) that the rules of one
  step read on a PS task is sent there once (`mirrored_reads.reading_once`), or not at
  all where its value rode there with the step's gradients (communication/riders.py).

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls optimizer_hooks.install()
```
"""

import functools
import sys

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.communication import riders
from hybrid_strategy.keras_integration import registry
from hybrid_strategy.tables import mirrored_reads
from hybrid_strategy.tables import sparse_optimizers


def install():
    """Installs the optimizer checks, Muon's decay of tables and the mirrored reads."""
    # Keras-private (and tf_keras-private): the base classes whose `build` every
    # optimizer calls and whose `compile` every model's is (loading a `.keras` file
    # compiles a model only if its `compile` is that very function).
    registry.install("optimizer_hooks.tables_checked_when_built", _checking_tables_when_built)
    registry.install("optimizer_hooks.tables_checked_when_compiled",
                     _checking_tables_when_compiled)
    registry.install("optimizer_hooks.muon_decays_tables_once", _decaying_tables_once)
    # Also when tf_keras is imported without being `tf.keras`: its models may still be
    # built under a HybridStrategy, and must still refuse what cannot update a table.
    if versions.legacy_keras() is not None or "tf_keras" in sys.modules:
        registry.install("optimizer_hooks.tables_checked_when_built_tf_keras",
                         _checking_tables_when_built)
        registry.install("optimizer_hooks.tables_checked_when_compiled_tf_keras",
                         _checking_tables_when_compiled)
    # TF-private: the class of mirrored variables, whose conversion to a tensor is
    # where a read away from their copies is made.
    registry.install("optimizer_hooks.mirrored_read_once", _reading_once)


def _checking_tables_when_built(build):
    @functools.wraps(build)
    def build_checking_tables(self, var_list, *args, **kwargs):
        sparse_optimizers.check_built(self, var_list)
        return build(self, var_list, *args, **kwargs)

    return build_checking_tables


def _checking_tables_when_compiled(compile_model):
    @functools.wraps(compile_model)
    def compile_checking_tables(self, *args, **kwargs):
        result = compile_model(self, *args, **kwargs)
        if self.optimizer is not None:
            sparse_optimizers.check_model(self.optimizer, self.trainable_variables)
        return result

    return compile_checking_tables


def _decaying_tables_once(apply_weight_decay):
    @functools.wraps(apply_weight_decay)
    def apply_weight_decay_to_tables_once(self, variables):
        sparse_optimizers.decay_tables_once(apply_weight_decay, self, variables)

    return apply_weight_decay_to_tables_once


def _reading_once(dense_var_to_tensor):
    @functools.wraps(dense_var_to_tensor)
    def dense_var_to_tensor_read_once(self, dtype=None, name=None, as_ref=False):
        device = mirrored_reads.reading_on()
        copy = None if device is None or as_ref else riders.copy_on(self.ref(), device)
        if copy is not None:  # it rode with the step's gradients to this PS task
            return tf.cast(copy, dtype or copy.dtype)
        return mirrored_reads.read(dense_var_to_tensor, self, dtype=dtype, name=name,
                                   as_ref=as_ref)

    return dense_var_to_tensor_read_once
