"""TensorFlow's and Keras 3's checkpoints save and restore PS tables by rows.

- TensorFlow: restore hands a table all its row blocks (`every_slice_restored`);
  saving and restoring on a cluster first checks that every task sees the path
  (`checkpointing.check_storage`).
- Keras 3: restoring a variable inside a tf.function gets a tensor of known shape;
  h5 files stream tables by blocks (the store's `__setitem__` / `__getitem__`,
  `Variable.assign`, the optimizer's `save_own_variables`), and `.keras` files of
  models with tables are built on disk, not in memory. A dataset is streamed only
  after Keras' own checks of it passed: loading refuses what Keras refuses.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls checkpoint_hooks.install()
```
"""

import functools

import numpy as np
import tensorflow as tf

from hybrid_strategy.keras_integration import registry
from hybrid_strategy.tables import checkpointing
from hybrid_strategy.tables import table as table_lib


def install():
    """Lets TensorFlow's and Keras 3's checkpoints save and restore tables by rows."""
    # TF-private: `saveable_object_util.TrackableSaveable` and
    # `functional_saver.MultiDeviceSaver`; Keras-private: `saving_lib.H5IOStore`,
    # `saving_lib.is_memory_sufficient` and `BaseOptimizer.save_own_variables`.
    registry.install("checkpoint_hooks.every_slice_restored", _restore_every_slice)
    registry.install("checkpoint_hooks.storage_checked_on_save",
                     functools.partial(_checked, mode="write"))
    registry.install("checkpoint_hooks.storage_checked_on_restore",
                     functools.partial(_checked, mode="read"))
    registry.install("checkpoint_hooks.restored_shape", _restore_with_shape)
    registry.install("checkpoint_hooks.h5_streamed_assign", _assign_streaming)
    registry.install("checkpoint_hooks.h5_streamed_write", _store_setitem)
    registry.install("checkpoint_hooks.h5_streamed_read", _store_getitem)
    registry.install("checkpoint_hooks.optimizer_tables_unread", _save_tables_unread)
    registry.install("checkpoint_hooks.keras_file_on_disk", _not_in_memory_if_tables)


def _restore_every_slice(original):
    """TrackableSaveable.restore that hands `_restore_from_tensors` every slice of a name.

    TensorFlow's adapter pairs one restored tensor with each local name, so a name
    saved as several slices (a table's row blocks) would get its first slice only;
    this passes `{slice_spec: tensor}` for such names, as `MultiDeviceSaver` does.
    """

    @functools.wraps(original)
    def restore(self, restored_tensors, restored_shapes):
        if len(self.specs) == len(self._local_names):
            return original(self, restored_tensors, restored_shapes)
        grouped = {}
        for spec, tensor in zip(self.specs, restored_tensors):
            grouped.setdefault(spec.name, {})[spec.slice_spec] = tensor
        by_name = {}
        for local_name, slices in zip(self._local_names, grouped.values()):
            by_name[local_name] = slices[""] if list(slices) == [""] else slices
        result = self._trackable._restore_from_tensors(by_name)  # pylint: disable=protected-access
        return result if result is not None else tf.no_op()

    return restore


def _remote_tasks(saver):
    """`/job:x/replica:0/task:i` of each worker or ps task writing part of `saver`'s files."""
    tasks = set()
    for task in saver._shardable_tensors_by_task:  # pylint: disable=protected-access
        if task.job in ("worker", "ps"):
            tasks.add(f"/job:{task.job}/replica:0/task:{task.task or 0}")
    return sorted(tasks)


def _checked(method, mode):
    """A MultiDeviceSaver method that first checks every remote task sees the path."""

    @functools.wraps(method)
    def checked(self, file_prefix, options=None):
        # With an io device, that device alone writes and reads the files.
        tasks = [] if getattr(options, "experimental_io_device", None) else _remote_tasks(self)
        if tasks and tf.executing_eagerly():
            checkpointing.check_storage(file_prefix, tasks, mode)
        return method(self, file_prefix, options)

    return checked


def _restore_with_shape(original):
    """Keras 3 `Variable._restore_from_tensors` given a tensor of known shape.

    On a cluster TensorFlow restores inside a tf.function, where RestoreV2's output
    has no static shape; Keras' `assign` would fail taking its length. Slices (a
    table's blocks) pass through untouched.
    """

    @functools.wraps(original)
    def restore_from_tensors(self, restored_tensors):
        restored_tensors = {
            key: tf.ensure_shape(value, self.shape)
            if tf.is_tensor(value) and value.shape.rank is None else value
            for key, value in restored_tensors.items()}
        return original(self, restored_tensors)

    return restore_from_tensors


def _assign_streaming(original):
    """Keras 3 `Variable.assign` that streams a `StoredRows` into the table it wraps."""

    @functools.wraps(original)
    def assign(self, value):
        if isinstance(value, checkpointing.StoredRows):
            table = table_lib.table_behind(self)
            if table is not None:
                checkpointing.read_h5(value.dataset, table)
                return self
            value = np.asarray(value)
        return original(self, value)

    return assign


def _store_setitem(original):
    """H5IOStore `store[key] = value` that streams a table into its dataset by blocks."""

    @functools.wraps(original)
    def setitem(self, key, value):
        table = table_lib.table_behind(value)
        if table is None or self.mode not in ("w", "a"):
            return original(self, key, value)
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        checkpointing.write_h5(self._h5_entry_group, key, table)
        return None

    return setitem


def _store_getitem(original):
    """H5IOStore `store[key]` that hands large datasets over unread (`StoredRows`), once
    they passed the checks Keras makes before it reads one."""
    checked = _checked_dataset()

    @functools.wraps(original)
    def getitem(self, key):
        rows = checkpointing.streamed(checked(self, key))
        return original(self, key) if rows is None else rows

    return getitem


def _checked_dataset():
    """`checked(store, key)`: the h5 dataset `store[key]` reads, after the installed
    Keras' own checks of it, which raise Keras' own errors.

    A weights file must not make the loading machine read other files: Keras refuses
    soft and external links, datasets stored in external files or mapped from other
    files (virtual), and, from 3.15, datasets declaring far more bytes than they store
    (a decompression bomb). Keras 3.14.0 checks only for external storage, in the store.
    """
    # Keras-private: the function (Keras 3.14.1 and later) or store method (3.14.0)
    # with which `H5IOStore.__getitem__` checks a dataset before reading it.
    from keras.src.saving import saving_lib  # pylint: disable=import-outside-toplevel

    safe_get = getattr(saving_lib, "safe_get_h5_dataset", None)
    if safe_get is not None:
        return lambda store, key: safe_get(store._h5_entry_group, key)
    return lambda store, key: store._verify_dataset(store._h5_entry_group[key])


def _save_tables_unread(save_own_variables):
    """`BaseOptimizer.save_own_variables` that passes tables to the store unread.

    Keras' own stores `variable.numpy()` of each variable, which would bring a whole
    table to the chief; it is given the optimizer with each table-wrapping variable
    standing in as its own `numpy()`, for the store to stream (`_store_setitem`).
    """

    @functools.wraps(save_own_variables)
    def save_tables_unread(self, store):
        variables = list(self.variables)
        if not any(table_lib.table_behind(v) is not None for v in variables):
            return save_own_variables(self, store)
        return save_own_variables(_WithVariables(self, [
            _Unread(v) if table_lib.table_behind(v) is not None else v for v in variables]),
            store)

    return save_tables_unread


class _WithVariables:
    """An optimizer as `save_own_variables` reads it, with the given `variables`."""

    def __init__(self, optimizer, variables):
        self._optimizer = optimizer
        self.variables = variables

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


class _Unread:
    """A variable wrapping a table, whose `numpy()` is the variable itself, unread."""

    def __init__(self, variable):
        self._variable = variable

    def numpy(self):
        return self._variable

    def __getattr__(self, name):
        return getattr(self._variable, name)


def _not_in_memory_if_tables(original):
    """`.keras` files of models with tables go through a temporary h5 file on disk.

    Keras would otherwise build the whole h5 file in the chief's memory.
    """

    @functools.wraps(original)
    def is_memory_sufficient(model):
        return False if checkpointing.has_tables(model) else original(model)

    return is_memory_sufficient
