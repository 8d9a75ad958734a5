"""Datasets read from a tf.data service under HybridStrategy: each element once per epoch.

The strategy re-creates a dataset on every worker host, each with its own iterator. A
dataset that `tf.data.experimental.service.distribute` sends to the service must then
name its job (`job_name=...`): the workers' iterators join that one job and, with
`processing_mode="distributed_epoch"`, share its elements, each read by one worker
(TensorFlow then turns auto-sharding off, so nothing is dropped). Without a job name
every worker would start a job of its own over the whole dataset, and auto-sharding would
keep an arbitrary share of each: `check_dataset` refuses that with a clear error.

With dynamic sharding the workers' numbers of batches, and so the number of steps of an
epoch, change from one epoch to the next. Keras (3 and tf_keras) takes a dataset of
unknown length to have as many steps in every epoch as in its first one: it would stop an
epoch early and drop elements (Keras 3), or end training (tf_keras). `install_keras_hooks`
makes it run every epoch of such a dataset to its end instead.

```python
dataset = tf.data.Dataset.range(1000).map(preprocess).batch(64)
dataset = dataset.apply(tf.data.experimental.service.distribute(
    processing_mode="distributed_epoch", service=hybrid_strategy.data_service_address(),
    job_name="train"))
model.fit(dataset, epochs=3)   # every element once per epoch
```
"""

import contextlib

import tensorflow as tf

from hybrid_strategy import versions

# TF-private: the dataset class that reads from a tf.data service, whose job name we check.
from tensorflow.python.data.experimental.ops import data_service_ops


def job_names(dataset):
    """The job name of every tf.data service read in `dataset` ("" where it has none)."""
    names, pending, seen = [], [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, data_service_ops._DataServiceDatasetV2):
            names.append(tf.get_static_value(current._job_name).decode())
        # TF-private: a dataset's input datasets.
        pending.extend(current._inputs())
    return names


def check_dataset(dataset, num_input_workers):
    """Refuses a dataset that several workers would each read whole from the service."""
    if num_input_workers < 2 or "" not in job_names(dataset):
        return
    raise ValueError(
        "HybridStrategy: the dataset reads from the tf.data service without a job name, so "
        f"each of the {num_input_workers} workers would start a job of its own over the "
        "whole dataset. Pass job_name to tf.data.experimental.service.distribute (e.g. "
        "job_name=\"train\"; another for each dataset read at the same time, such as "
        "validation data): the workers then share one job, and with "
        "processing_mode=\"distributed_epoch\" each element is read once per epoch.")


def _varies_per_epoch(dataset):
    """Whether `dataset`'s number of batches may change from epoch to epoch."""
    return isinstance(dataset, tf.data.Dataset) and bool(job_names(dataset))


def install_keras_hooks(applies):
    """Makes Keras 3 and tf_keras run every epoch of a dataset read from the tf.data
    service to its end, while `applies(strategy)` holds for the model's strategy."""
    # Keras-private: Keras 3's epoch iterator keeps the first epoch's number of steps
    # for a dataset of unknown length.
    from keras.src.backend.tensorflow import trainer as keras_trainer

    iterator_class = keras_trainer.TFEpochIterator
    if not getattr(iterator_class.catch_stop_iteration, "_hybrid_varies", False):
        # The adapter's dataset as the user gave it (Keras' TFDatasetAdapter), not
        # get_tf_dataset(): for arrays that would build a new dataset of them, a copy.
        iterator_class.catch_stop_iteration = _forgetting_steps(
            iterator_class.catch_stop_iteration, "_num_batches",
            lambda self: applies(self._distribute_strategy)
            and _varies_per_epoch(getattr(self.data_adapter, "_dataset", None)))
    legacy = versions.legacy_keras()
    if legacy is None:
        return
    # tf_keras-private: its DataHandler does the same, and ends training when a later
    # epoch is shorter.
    from tf_keras.src.engine import data_adapter

    handler_class = data_adapter.DataHandler
    if not getattr(handler_class.catch_stop_iteration, "_hybrid_varies", False):
        handler_class.catch_stop_iteration = _forgetting_steps(
            handler_class.catch_stop_iteration, "_inferred_steps",
            lambda self: applies(self._model.distribute_strategy)
            and _varies_per_epoch(getattr(self._adapter, "_dataset", None)))


def _forgetting_steps(catch_stop_iteration, attribute, varies):
    """`catch_stop_iteration` that forgets the number of steps an epoch took (`attribute`
    set by Keras when a dataset of unknown length runs out) where `varies(self)`."""

    @contextlib.contextmanager
    def forgetting(self):
        with catch_stop_iteration(self):
            yield
        if getattr(self, attribute) is not None and _remembered_varies(self, varies):
            setattr(self, attribute, None)

    forgetting._hybrid_varies = True
    return forgetting


def _remembered_varies(self, varies):
    """`varies(self)`, computed once per iterator (it walks the dataset's inputs)."""
    if not hasattr(self, "_hybrid_varies_per_epoch"):
        self._hybrid_varies_per_epoch = bool(varies(self))
    return self._hybrid_varies_per_epoch
