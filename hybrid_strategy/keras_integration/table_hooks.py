"""Keras 3 variables that wrap a PS table are read by row, and Embedding layers check their ids.

- `tf.gather(params, ids)` calls `params.sparse_read(ids)` when it exists. Keras 3
  variables have none, so their gather would read the whole table first; `install`
  adds one that exists only for variables wrapping a PS table (or made one by a
  `table.on_row_read` handler).
- `tf.nn.embedding_lookup` of such a variable takes the same route (TensorFlow
  would convert it to one dense tensor first).
- `tf.shape` of a Keras 3 variable (Keras' `ops.take` asks for it) is answered
  from the static shape instead of converting, i.e. reading, the variable.
- Keras' SavedModel export (`model.export`, `keras.export.ExportArchive`) traces
  its endpoints for export, reading tables whole (`table.tracing_for_export`).
- `install_id_checks` makes Embedding layers (Keras 3 and tf_keras) check their
  ids under a HybridStrategy (`table.call_checking_ids`).

```python
import hybrid_strategy
from hybrid_strategy.keras_integration import table_hooks
hybrid_strategy.HybridStrategy()   # calls table_hooks.install() and install_id_checks(...)
```
"""

import functools

import tensorflow as tf

from hybrid_strategy import versions
from hybrid_strategy.keras_integration import registry
from hybrid_strategy.tables import table as table_lib


def install():
    """Lets Keras 3 variables that wrap a PS table use the table's row reads."""
    import keras  # pylint: disable=import-outside-toplevel  (Keras 3, whatever tf.keras is)

    def make_write_out(write_out):
        def write_out_reading_tables_whole(self, *args, **kwargs):
            with table_lib.tracing_for_export():
                return write_out(self, *args, **kwargs)

        return functools.wraps(write_out)(write_out_reading_tables_whole)

    # Keras-private: the SavedModel export archive, whose `write_out` traces the
    # endpoints before it calls `tf.saved_model.save`.
    registry.install("table_hooks.export_reads_tables_whole", make_write_out)
    registry.install("table_hooks.sparse_read", lambda _: property(_sparse_read))
    # TF-private: `dispatch.register_dispatchable_type`; dispatch on a type (the two
    # handlers below, which reach `tf.nn.embedding_lookup` and `tf.shape` before they
    # would convert the variable to one dense tensor) needs the type registered first.
    registry.install("table_hooks.dispatchable_variable",
                     lambda register: register(keras.Variable))
    registry.install("table_hooks.static_shape", lambda shape: tf.experimental.dispatch_for_api(
        shape, {"input": keras.Variable})(table_lib.keras_variable_shape))
    registry.install("table_hooks.embedding_lookup",
                     lambda embedding_lookup: tf.experimental.dispatch_for_api(
                         embedding_lookup, {"params": keras.Variable})(
                             table_lib.keras_variable_embedding_lookup))


def _sparse_read(keras_variable):
    """The row read of the table `keras_variable` wraps; AttributeError (no such
    attribute, for `tf.gather`) when it wraps none."""
    value = table_lib.table_for_row_read(keras_variable)
    if value is None:
        raise AttributeError("sparse_read")
    return value.sparse_read


def install_id_checks(applies):
    """Makes Embedding layers (Keras 3, and tf_keras when `tf.keras` is it) check
    their ids while `applies()` (under a HybridStrategy)."""

    def make_call(call):
        # Keras reads which arguments `call` takes from its signature: this one's is
        # Embedding.call's own, (self, inputs), in Keras 3 and tf_keras.
        @functools.wraps(call)
        def call_checking_ids(self, inputs):
            if not applies():
                return call(self, inputs)
            return table_lib.call_checking_ids(call, self, inputs)

        return call_checking_ids

    registry.install("table_hooks.embedding_ids", make_call)
    if versions.legacy_keras() is not None:
        registry.install("table_hooks.embedding_ids_tf_keras", make_call)
