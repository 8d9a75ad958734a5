"""Keras 3 and tf_keras train asynchronously under HybridStrategy(asynchronous=True).

The training itself is asynchronous/training.py's (`AsyncTrainFunction`: one step
function per worker, run from one thread per worker); the hooks here make Keras use it:
- `make_train_function` makes an `AsyncTrainFunction` of steps traced for each worker
  (multi_step.py's counted steps);
- `make_test_function` and `make_predict_function` make functions that first wait for
  the training steps in flight, then read the synchronous distribution of the data;
- the guard around an epoch's steps (`catch_stop_iteration`) ends it once every step
  handed out has finished;
- checkpoints and weight files wait for the steps in flight: they hold every update.

```python
from hybrid_strategy.keras_integration import asynchronous_hooks
asynchronous_hooks.install(lambda strategy: None)   # HybridStrategy() passes its gate
```
"""

import contextlib
import functools

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.asynchronous import training
from hybrid_strategy.keras_integration import multi_step
from hybrid_strategy.keras_integration import registry


def install(asynchronous_scope):
    """Makes Keras 3 (and tf_keras, when `tf.keras` is it) train asynchronously where it applies.

    Args:
        asynchronous_scope: `asynchronous_scope(strategy)` is the strategy's
            `WorkerScope` if it trains asynchronously, else None.
    """
    _install_keras3(asynchronous_scope)
    _install_saving_waits()
    if versions.legacy_keras() is not None:
        _install_tf_keras(asynchronous_scope)


def _install_keras3(asynchronous_scope):
    # Keras-private: the trainer that makes Keras 3's training, evaluation and
    # prediction functions, and the epoch iterator whose guard ends every epoch
    # (keras.src.backend.tensorflow.trainer).
    from keras.src.backend.tensorflow import trainer as trainer_lib

    def train_function(model, scope):
        return training.AsyncTrainFunction(
            [multi_step.keras3_function(model, model.train_step, trainer_lib, counted=True)
             for _ in range(_num_workers(model))], scope, lambda: model.steps_per_execution,
            lambda: multi_step.keras3_function(model, model.train_step, trainer_lib))

    _install_flavour("", asynchronous_scope, train_function, "_distributed_dataset")


def _install_flavour(prefix, asynchronous_scope, train_function, dataset_attribute):
    """One Keras flavour's patches (their names start with `prefix`): training made
    asynchronous, evaluation and prediction waiting for it, and the join at the end of
    every epoch, evaluation and prediction (the guard of the iterator whose dataset is
    `dataset_attribute`)."""
    registry.install(f"asynchronous_hooks.{prefix}train_asynchronously",
                     lambda make_train: _train_asynchronously(
                         make_train, asynchronous_scope, train_function))
    registry.install(f"asynchronous_hooks.{prefix}test_waits", lambda make: _wait_before(
        make, "test_function", asynchronous_scope))
    registry.install(f"asynchronous_hooks.{prefix}predict_waits", lambda make: _wait_before(
        make, "predict_function", asynchronous_scope))
    registry.install(f"asynchronous_hooks.{prefix}join_at_epoch_end",
                     lambda catch: _join_at_the_end(catch, dataset_attribute))


def _train_asynchronously(make_train, asynchronous_scope, train_function):
    """`make_train_function` that makes `train_function(model, scope)` for a model under
    an asynchronous strategy (whose `WorkerScope` is `scope`), else calls `make_train`."""

    @functools.wraps(make_train)  # keeps the markers of other hooks on the method
    def make_train_function(self, force=False):
        scope = asynchronous_scope(self.distribute_strategy)
        if scope is None or (self.train_function is not None and not force):
            return make_train(self, force=force)
        self.train_function = train_function(self, scope)
        return self.train_function

    return make_train_function


def _num_workers(model):
    return len(model.distribute_strategy.extended.input_hosts)


def _wait_before(make, name, asynchronous_scope):
    """`make_<name>` whose function waits for the steps in flight, then runs on the
    synchronous iterator (Keras 3's prediction takes batches: they pass through)."""

    @functools.wraps(make)
    def make_function(self, force=False):
        make(self, force=force)
        function = getattr(self, name)
        if (asynchronous_scope(self.distribute_strategy) is not None
                and not getattr(function, "_waits_for_steps", False)):
            def wait_then_run(data):
                training.join_all()
                return function(training.synchronous_iterator(data))

            wait_then_run._waits_for_steps = True
            setattr(self, name, wait_then_run)
        return getattr(self, name)

    return make_function


def _join_at_the_end(catch_stop_iteration, dataset_attribute):
    """`catch_stop_iteration` (the guard around an epoch's steps) that waits for every
    step handed out when the dataset it iterates is asynchronous."""

    @functools.wraps(catch_stop_iteration)
    @contextlib.contextmanager
    def joining_at_the_end(self):
        if not isinstance(getattr(self, dataset_attribute, None), training.AsyncDataset):
            with catch_stop_iteration(self):
                yield
            return
        try:
            with catch_stop_iteration(self):
                yield
        except BaseException:
            training.join_all(cancel=True)
            raise
        training.join_all()

    return joining_at_the_end


def _install_saving_waits():
    """Checkpoints and weight files wait for the steps in flight: they hold every update."""
    # TF-private: the saver behind tf.train.Checkpoint (tensorflow.python.checkpoint.
    # functional_saver.MultiDeviceSaver); Keras-private: the functions behind
    # save_weights, save and load_weights (keras.src.saving.saving_lib).
    def waiting(method):
        @functools.wraps(method)
        def wait_then_call(*args, **kwargs):
            if tf.executing_eagerly():
                training.join_all()
            return method(*args, **kwargs)

        return wait_then_call

    for name in ("checkpoint_save_waits", "checkpoint_restore_waits", "save_model_waits",
                 "save_weights_waits", "load_weights_waits"):
        registry.install(f"asynchronous_hooks.{name}", waiting)


def _install_tf_keras(asynchronous_scope):
    # tf_keras-private: the pieces of its training step (as `make_train_function` makes
    # it) and the data handler whose guard ends every epoch.
    from tf_keras.src.engine import training as tf_keras_training

    def train_function(model, scope):
        strategy = model.distribute_strategy

        def one_step_on_data(data):
            def run_step(data):  # as tf_keras' own step runs it
                outputs = model.train_step(data)
                with tf.control_dependencies(tf_keras_training._minimum_control_deps(outputs)):  # pylint: disable=protected-access
                    model._train_counter.assign_add(1)  # pylint: disable=protected-access
                return outputs

            return tf_keras_training.reduce_per_replica(
                strategy.run(run_step, args=(data,)), strategy,
                model.distribute_reduction_method)

        steps = model._steps_per_execution  # pylint: disable=protected-access
        return training.AsyncTrainFunction(
            [multi_step.counted_function(strategy, int(steps.numpy()), one_step_on_data,
                                         multi_step.on_this_process, model.run_eagerly)
             for _ in range(_num_workers(model))], scope, lambda: int(steps.numpy()))

    _install_flavour("tf_keras_", asynchronous_scope, train_function, "_dataset")
