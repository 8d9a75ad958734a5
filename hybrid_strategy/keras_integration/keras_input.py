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
from hybrid_strategy.input import worker_input
from hybrid_strategy.keras_integration import batches
from hybrid_strategy.keras_integration import registry

# The strategy a Keras 3 epoch iterator is being made for, while it makes its dataset.
_iterator_strategy = contextvars.ContextVar("iterator_strategy", default=None)


def install(applies):
    """Installs the hooks in Keras 3 (and tf_keras when `tf.keras` is it), once.

    Args:
        applies: `applies(strategy)`: whether `strategy` is a HybridStrategy.
    """
    _install_keras3(applies)
    if versions.legacy_keras():
        _install_tf_keras(applies)


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
    def make_symbolic_build(symbolic_build):
        def symbolic_build_from_spec(self, iterator=None, data_batch=None):
            if iterator is not None and applies(self.distribute_strategy):
                data_batch = one_replica_spec(iterator._distributed_dataset.element_spec)
                iterator = None
            return symbolic_build(self, iterator=iterator, data_batch=data_batch)
        return symbolic_build_from_spec

    registry.install("keras_input.build_from_element_spec", make_symbolic_build)

    def make_iterator_init(make_iterator):
        def make_iterator_for(self, distribute_strategy=None, *args, **kwargs):
            token = _iterator_strategy.set(distribute_strategy)
            try:
                make_iterator(self, distribute_strategy, *args, **kwargs)
            finally:
                _iterator_strategy.reset(token)
        return make_iterator_for

    registry.install("keras_input.note_iterator_strategy", make_iterator_init)

    def make_next(next_steps):
        def next_counted(self):
            self._hybrid_steps_begun = getattr(self, "_hybrid_steps_begun", 0) + 1
            return next_steps(self)
        return next_counted

    registry.install("keras_input.count_steps", make_next)

    def make_catch(catch_stop_iteration):
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
        return catch_refusing_empty

    # Outermost of the guard's wrappers: it sees the OutOfRangeError first.
    registry.install("keras_input.refuse_empty_dataset", make_catch)

    def make_get_tf_dataset(get_tf_dataset):
        def tf_dataset_of_shares(self):
            strategy = _iterator_strategy.get()
            if _on_cluster(strategy, applies) and array_input.supported(self._inputs):
                import keras  # pylint: disable=import-outside-toplevel  (Keras 3)
                # As Keras does: tf.data would stack a list of arrays (outputs' targets).
                return array_input.distribute_arrays(
                    strategy.extended.input_hosts, strategy.distribute_datasets_from_function,
                    keras.tree.lists_to_tuples(self._inputs), self._batch_size,
                    self._shuffle, floatx=keras.backend.floatx())
            return get_tf_dataset(self)
        return tf_dataset_of_shares

    registry.install("keras_input.arrays_as_worker_shares", make_get_tf_dataset)


def _install_tf_keras(applies):
    # tf_keras-private: the adapter that makes a dataset of arrays (whole), and the
    # data handler that adds class weights to it and distributes it.
    from tf_keras.src import backend as tf_keras_backend
    from tf_keras.src.engine import data_adapter

    def make_slice_inputs(slice_inputs):
        def slice_inputs_kept(self, indices_dataset, inputs):
            self._hybrid_inputs = inputs
            return slice_inputs(self, indices_dataset, inputs)
        return slice_inputs_kept

    registry.install("keras_input.keep_array_inputs", make_slice_inputs)

    def make_configure(configure):
        def configure_shares(self, strategy, x, steps_per_epoch, class_weight, distribute):
            inputs = getattr(self._adapter, "_hybrid_inputs", None)
            if (not distribute or inputs is None or not _on_cluster(strategy, applies)
                    or not array_input.supported(inputs)):
                return configure(self, strategy, x, steps_per_epoch, class_weight, distribute)
            # tf_keras infers the steps (from the adapter's size) and checks them; its
            # dataset of the whole arrays, left undistributed, gives way to the shares.
            configure(self, strategy, x, steps_per_epoch, class_weight, False)
            self._dataset = array_input.distribute_arrays(
                strategy.extended.input_hosts, strategy.distribute_datasets_from_function,
                inputs, self._adapter.batch_size(), self._adapter._shuffle,
                passes=self._epochs - self._initial_epoch,
                transform=(data_adapter._make_class_weight_map_fn(class_weight)
                           if class_weight else None),
                floatx=tf_keras_backend.floatx())
            return None
        return configure_shares

    registry.install("keras_input.tf_keras_arrays_as_worker_shares", make_configure)
