"""Installs every run-time patch (patches.py), once, after checking every target.

`HybridStrategy()` calls `install_all(HybridStrategy, connected)`: the versions in use are
checked against the supported ranges, every patch's target against what it was
written for, and only then is anything changed. Each patch acts only under its
gate; the gates below tell a HybridStrategy from any other strategy.

```python
from hybrid_strategy import HybridStrategy
from hybrid_strategy.keras_integration import install
install.install_all(HybridStrategy, connected=False)   # what HybridStrategy() does alone
```
"""

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.keras_integration import asynchronous_hooks
from hybrid_strategy.keras_integration import batched_lookups
from hybrid_strategy.keras_integration import batches
from hybrid_strategy.keras_integration import checkpoint_hooks
from hybrid_strategy.keras_integration import clipping_hooks
from hybrid_strategy.keras_integration import data_service_hooks
from hybrid_strategy.keras_integration import dynamic_hooks
from hybrid_strategy.keras_integration import exit_hooks
from hybrid_strategy.keras_integration import export_hooks
from hybrid_strategy.keras_integration import increments
from hybrid_strategy.keras_integration import iterator_hooks
from hybrid_strategy.keras_integration import keras_input
from hybrid_strategy.keras_integration import layer_hooks
from hybrid_strategy.keras_integration import loss_scaling_hooks
from hybrid_strategy.keras_integration import mirroring_hooks
from hybrid_strategy.keras_integration import multi_step
from hybrid_strategy.keras_integration import optimizer_hooks
from hybrid_strategy.keras_integration import penalty_hooks
from hybrid_strategy.keras_integration import push_hooks
from hybrid_strategy.keras_integration import reads_ahead
from hybrid_strategy.keras_integration import registry
from hybrid_strategy.keras_integration import side_effect_hooks
from hybrid_strategy.keras_integration import table_hooks
from hybrid_strategy.tables import table as table_lib


class Gates:
    """When patches act: tests of the current strategy, for the strategy class given."""

    def __init__(self, strategy_class):
        self._strategy_class = strategy_class

    def is_hybrid(self, strategy):
        return isinstance(strategy, self._strategy_class)

    def under_hybrid_strategy(self):
        return tf.distribute.has_strategy() and self.is_hybrid(tf.distribute.get_strategy())

    def in_replica_of_hybrid_strategy(self):
        return self.under_hybrid_strategy() and not tf.distribute.in_cross_replica_context()

    def spans_devices(self, strategy):
        return self.is_hybrid(strategy) and strategy.extended.spans_devices

    def pushes(self, strategy):
        return self.is_hybrid(strategy) and strategy.extended.pushes

    def placer(self, strategy):
        return strategy.extended.placer if self.is_hybrid(strategy) else None

    def asynchronous_scope(self, strategy):
        """The `WorkerScope` of a HybridStrategy that trains asynchronously, else None."""
        return strategy.extended.worker_scope if self.is_hybrid(strategy) else None

    def move_to_ps_on_row_read(self, keras_variable):
        """The table a Keras 3 variable read by row now wraps, if its strategy moved it."""
        strategy = getattr(keras_variable._value, "_distribute_strategy", None)
        if self.is_hybrid(strategy):
            return strategy.extended.placer.move_to_ps(keras_variable)
        return None


def install_all(strategy_class, connected):
    """Checks the versions and every patch's target, then installs every patch once.

    `connected`: whether this process is connected to a cluster (the chief).
    Raises `versions.UnsupportedVersionError` (naming the installed and supported
    versions, and every target that differs) before anything is changed.
    """
    versions.check_installed()
    registry.verify()
    gates = Gates(strategy_class)
    table_hooks.install()
    table_lib.on_row_read(gates.move_to_ps_on_row_read)
    mirroring_hooks.install(gates.placer)
    layer_hooks.install()
    checkpoint_hooks.install()
    multi_step.install(gates.spans_devices)
    asynchronous_hooks.install(gates.asynchronous_scope)
    clipping_hooks.install(gates.under_hybrid_strategy)
    push_hooks.install(gates.pushes)
    loss_scaling_hooks.install(gates.under_hybrid_strategy)
    side_effect_hooks.order_per_task()
    optimizer_hooks.install()
    batches.install_keras_hooks()
    data_service_hooks.install(gates.is_hybrid)
    keras_input.install(gates.is_hybrid)
    increments.install(gates.is_hybrid)
    iterator_hooks.install(gates.spans_devices)
    penalty_hooks.install()
    table_hooks.install_id_checks(gates.under_hybrid_strategy)
    # After the id checks: a table looked up at once returns its rows before them.
    batched_lookups.install(gates.in_replica_of_hybrid_strategy)
    # Around the lookups: the tables read whole cross in their own exchange.
    reads_ahead.install(gates.in_replica_of_hybrid_strategy)
    dynamic_hooks.install()
    export_hooks.install()
    if connected:
        exit_hooks.install()
