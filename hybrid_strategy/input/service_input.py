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
epoch early and drop elements (Keras 3), or end training (tf_keras). Under HybridStrategy
it runs every epoch of such a dataset (`varies_per_epoch`) to its end instead
(keras_integration/data_service_hooks.py).

```python
dataset = tf.data.Dataset.range(1000).map(preprocess).batch(64)
dataset = dataset.apply(tf.data.experimental.service.distribute(
    processing_mode="distributed_epoch", service=hybrid_strategy.data_service_address(),
    job_name="train"))
model.fit(dataset, epochs=3)   # every element once per epoch
```
"""

import tensorflow as tf

# TF-private: the dataset class that reads from a tf.data service, whose job name we check.
from hybrid_strategy.tensorflow_private import data_service_ops


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


def varies_per_epoch(dataset):
    """Whether `dataset`'s number of batches may change from epoch to epoch."""
    return isinstance(dataset, tf.data.Dataset) and bool(job_names(dataset))
