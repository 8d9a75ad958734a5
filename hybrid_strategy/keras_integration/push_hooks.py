"""Keras 3 steps send the PS tasks what their updates read, and their logs' state, with the push.

On a cluster with PS tasks, a synchronous step's gradients reach each PS task in one
tensor per worker (communication/aggregation.py `Push`); these hooks give it the rest of
what would otherwise cross on its own (communication/riders.py):
- Keras 3's own `train_step` updates the metrics before it applies the gradients
  (neither reads what the other writes), so that the metrics' state, summed over
  the replicas for the step's logs, rides with the gradients to the reducer PS instead
  of crossing from every worker to the first one (keras_integration/multi_step.py
  reads the sum there). Only where the model keeps Keras' `compute_metrics`: one of
  its own might read the weights the update changes.
- The learning rate and the step count that the first replica reads ride with the
  first worker's gradients to every PS task of the step, where the tables' update
  rules read them.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls push_hooks.install(gates.pushes)
```
"""

import functools
import threading

import tensorflow as tf

from hybrid_strategy.communication import riders
from hybrid_strategy.keras_integration import registry

# The optimizers whose `apply_gradients` waits, on this thread, with what it was given.
_DEFERRED = threading.local()


def install(pushes):
    """Installs the hooks for Keras 3 models under a strategy for which `pushes(strategy)`
    (a HybridStrategy on a cluster with PS tasks, training synchronously)."""
    # Keras-private: Keras 3's trainer, whose `compute_metrics` a model may override.
    from keras.src.trainers import trainer as base_trainer  # pylint: disable=import-outside-toplevel

    own_compute_metrics = base_trainer.Trainer.compute_metrics

    def make_train_step(train_step):
        @functools.wraps(train_step)
        def train_step_metrics_first(self, data):
            if (self.optimizer is None or not pushes(self.distribute_strategy)
                    or getattr(type(self), "compute_metrics", None) is not own_compute_metrics):
                return train_step(self, data)
            waiting = []
            outer = getattr(_DEFERRED, "calls", None)
            _DEFERRED.calls = (self.optimizer, waiting)
            try:
                logs = train_step(self, data)
            finally:
                _DEFERRED.calls = outer
            for grads_and_vars in waiting:
                self.optimizer.apply_gradients(grads_and_vars)
            return logs

        return train_step_metrics_first

    def make_apply_gradients(apply_gradients):
        @functools.wraps(apply_gradients)
        def apply_gradients_when_due(self, grads_and_vars):
            deferred = getattr(_DEFERRED, "calls", None)
            if deferred is None or deferred[0] is not self:
                return apply_gradients(self, grads_and_vars)
            deferred[1].append(list(grads_and_vars))
            return self.iterations

        return apply_gradients_when_due

    def make_update_step(update_step):
        @functools.wraps(update_step)
        def update_step_sending_reads(self, grads, trainable_variables, learning_rate):
            context = tf.distribute.get_replica_context()
            if (context is not None and pushes(tf.distribute.get_strategy())
                    and tf.get_static_value(context.replica_id_in_sync_group) == 0):
                if isinstance(learning_rate, tf.Tensor):  # a schedule's, or a callable's
                    riders.sent_with_push(learning_rate.ref(), learning_rate)
                for variable in (self._iterations, self._learning_rate):
                    value = getattr(variable, "value", None)
                    if isinstance(value, tf.Variable):
                        riders.sent_with_push(value.ref(), tf.convert_to_tensor(value))
            return update_step(self, grads, trainable_variables, learning_rate)

        return update_step_sending_reads

    registry.install("push_hooks.metrics_before_update", make_train_step)
    registry.install("push_hooks.update_waits_for_metrics", make_apply_gradients)
    registry.install("push_hooks.update_reads_sent", make_update_step)
