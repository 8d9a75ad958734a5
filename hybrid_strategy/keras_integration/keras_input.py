"""What Keras 3 and tf_keras do with datasets and arrays, changed under a HybridStrategy.

- **No batch read for nothing.** Before `fit` and `evaluate`, Keras 3 builds the model
  by reading a first batch from a new iterator over the distributed dataset, and
  averages it onto this process: every worker builds that batch, and what its pipeline
  prefetches, for an iterator then thrown away. Under a HybridStrategy the model is
  built from the dataset's element spec instead; a dataset found empty at the first
  step (one tf.data cannot tell empty from its definition, such as a filter that drops
  every example) is refused with batches.py's clear error, where Keras would end `fit`
  having trained nothing.
- **Arrays** (Keras 3's `ArrayDataAdapter`, tf_keras' `TensorLikeDataAdapter`) given to
  `fit`, `evaluate` or `predict` under a HybridStrategy with a cluster reach each worker
  as its own rows (input/array_input.py), instead of a dataset holding them whole that every
  worker receives. Other inputs (sparse or ragged tensors, generators) take Keras' way.

```python
install(lambda strategy: isinstance(strategy, HybridStrategy))   # strategy.py does it
model.fit(x, y, batch_size=64)     # each worker receives its 32 rows of each batch
```
"""

import contextlib
import contextvars

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.input import array_input
from hybrid_strategy.keras_integration import batches
from hybrid_strategy.input import worker_input

# The strategy a Keras 3 epoch iterator is being made for, while it makes its dataset.
_iterator_strategy = contextvars.ContextVar("iterator_strategy", default=None)
_installed = []


def install(applies):
    """Installs the hooks in Keras 3 (and tf_keras when `tf.keras` is it), once.

    Args:
        applies: `applies(strategy)`: whether `strategy` is a HybridStrategy.
    """
    flavours = (_install_keras3,) + ((_install_tf_keras,) if versions.legacy_keras() else ())
    for hooks in flavours:
        if hooks not in _installed:
            _installed.append(hooks)
            hooks(applies)


def _on_cluster(strategy, applies):
    # Asynchronous training splits one dataset of the arrays among its workers itself.
    return applies(strategy) and strategy.cluster is not None and not strategy.asynchronous


def one_replica_spec(spec):
    """A distributed dataset's element spec for one replica, batch dimension unknown."""
    # TF-private: a PerReplicaSpec holds each replica's spec.
    spec = tf.nest.map_structure(lambda c: getattr(c, "_value_specs", (c,))[0], spec)
    return worker_input.unknown_batch_size(spec) or spec


def _install_keras3(applies):
    # Keras-private: the trainer's model build from a first batch, the epoch iterator
    # that distributes the data, and the adapter that turns arrays into a dataset.
    from keras.src.backend.tensorflow import trainer as keras_trainer
    from keras.src.trainers.data_adapters import array_data_adapter

    trainer_class = keras_trainer.TensorFlowTrainer
    symbolic_build = trainer_class._maybe_symbolic_build

    def symbolic_build_from_spec(self, iterator=None, data_batch=None):
        if iterator is not None and applies(self.distribute_strategy):
            data_batch = one_replica_spec(iterator._distributed_dataset.element_spec)
            iterator = None
        return symbolic_build(self, iterator=iterator, data_batch=data_batch)

    trainer_class._maybe_symbolic_build = symbolic_build_from_spec

    iterator_class = keras_trainer.TFEpochIterator
    make_iterator, next_steps = iterator_class.__init__, iterator_class.__next__
    catch_stop_iteration = iterator_class.catch_stop_iteration

    def make_iterator_for(self, distribute_strategy=None, *args, **kwargs):
        token = _iterator_strategy.set(distribute_strategy)
        try:
            make_iterator(self, distribute_strategy, *args, **kwargs)
        finally:
            _iterator_strategy.reset(token)

    def next_counted(self):
        self._hybrid_steps_begun = getattr(self, "_hybrid_steps_begun", 0) + 1
        return next_steps(self)

    @contextlib.contextmanager
    def catch_refusing_empty(self):
        with catch_stop_iteration(self):
            try:
                yield
            except tf.errors.OutOfRangeError:
                # The first step of this iterator's life found no batch at all.
                if (applies(self._distribute_strategy)
                        and getattr(self, "_hybrid_steps_begun", 0) <= 1):
                    raise ValueError(batches.EMPTY) from None
                raise

    iterator_class.__init__ = make_iterator_for
    iterator_class.__next__ = next_counted
    iterator_class.catch_stop_iteration = catch_refusing_empty

    adapter_class = array_data_adapter.ArrayDataAdapter
    get_tf_dataset = adapter_class.get_tf_dataset

    def tf_dataset_of_shares(self):
        strategy = _iterator_strategy.get()
        if _on_cluster(strategy, applies) and array_input.supported(self._inputs):
            import keras  # pylint: disable=import-outside-toplevel  (Keras 3)
            # As Keras does: tf.data would stack a list of arrays (outputs' targets).
            return array_input.distribute_arrays(
                strategy, keras.tree.lists_to_tuples(self._inputs), self._batch_size,
                self._shuffle, floatx=keras.backend.floatx())
        return get_tf_dataset(self)

    adapter_class.get_tf_dataset = tf_dataset_of_shares


def _install_tf_keras(applies):
    # tf_keras-private: the adapter that makes a dataset of arrays (whole), and the
    # data handler that adds class weights to it and distributes it.
    from tf_keras.src import backend as tf_keras_backend
    from tf_keras.src.engine import data_adapter

    adapter_class = data_adapter.TensorLikeDataAdapter
    slice_inputs = adapter_class.slice_inputs

    def slice_inputs_kept(self, indices_dataset, inputs):
        self._hybrid_inputs = inputs
        return slice_inputs(self, indices_dataset, inputs)

    adapter_class.slice_inputs = slice_inputs_kept

    handler_class = data_adapter.DataHandler
    configure = handler_class._configure_dataset_and_inferred_steps

    def configure_shares(self, strategy, x, steps_per_epoch, class_weight, distribute):
        inputs = getattr(self._adapter, "_hybrid_inputs", None)
        if (not distribute or inputs is None or not _on_cluster(strategy, applies)
                or not array_input.supported(inputs)):
            return configure(self, strategy, x, steps_per_epoch, class_weight, distribute)
        self._dataset = array_input.distribute_arrays(
            strategy, inputs, self._adapter.batch_size(), self._adapter._shuffle,
            passes=self._epochs - self._initial_epoch,
            transform=(data_adapter._make_class_weight_map_fn(class_weight)
                       if class_weight else None),
            floatx=tf_keras_backend.floatx())
        self._inferred_steps = self._infer_steps(steps_per_epoch, self._dataset)
        self._validate_data_handler()
        return None

    handler_class._configure_dataset_and_inferred_steps = configure_shares
