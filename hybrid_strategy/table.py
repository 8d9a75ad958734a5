"""PS tables: variables that live once on a parameter-server task and are read by row.

A PS table is a TensorFlow resource variable created on a PS device and tagged here.
Looking rows up in it (`lookup`) deduplicates the ids on the worker, gathers only
those rows on the PS that holds the table, and expands them back on the worker, so
each distinct row crosses the network once per replica and step. The unique ids
are remembered per graph so that the strategy can recognise the table's gradient
(`table_of_gradient`) and send it to the table's PS instead of all-reducing it.

Keras 3 reads embeddings with `ops.take(variable, ids)`, which TensorFlow routes to
`params.sparse_read(ids)` when the object has one: `install_keras_hook()` gives
Keras variables that wrap a PS table such a method.

```python
import tensorflow as tf
from hybrid_strategy import table
with tf.device("/device:CPU:0"):
    v = tf.Variable(tf.reshape(tf.range(12.0), (4, 3)))
table.mark(v, "emb/embeddings")
print(table.lookup(v, tf.constant([[3, 1], [3, 3]])))   # rows 3, 1, 3, 3
```
"""

import weakref

import tensorflow as tf

_PATH_ATTR = "_hybrid_strategy_table_path"
# graph -> {name of a unique-ids tensor: the table it indexes}
_LOOKUPS = weakref.WeakKeyDictionary()
# Gradient-side ops that keep the rows' identity while reshaping or merging them.
_PASS_THROUGH_OPS = ("Reshape", "Identity", "Cast")


def mark(variable, path):
    """Tags `variable` as a PS table known to users as `path`."""
    setattr(variable, _PATH_ATTR, path)


def is_table(value):
    return getattr(value, _PATH_ATTR, None) is not None


def path_of(variable):
    return getattr(variable, _PATH_ATTR)


def lookup(table, ids, name=None):
    """Returns `table`'s rows for `ids` (any shape), gathered on the table's device.

    Ids outside `[0, rows)` raise an `InvalidArgumentError` naming the table.
    """
    with tf.name_scope(name or "hybrid_lookup"):
        ids = tf.convert_to_tensor(ids)
        unique_ids, positions = tf.unique(tf.reshape(ids, [-1]))
        num_rows = table.shape[0]
        message = (f"embedding id out of range for table {path_of(table)} "
                   f"({num_rows} rows): ids must be in [0, {num_rows})")
        checks = [
            tf.debugging.assert_non_negative(unique_ids, message=message),
            tf.debugging.assert_less(unique_ids, tf.cast(num_rows, unique_ids.dtype),
                                     message=message),
        ]
        with tf.control_dependencies(checks):
            unique_ids = tf.identity(unique_ids)
        _remember(unique_ids, table)
        with tf.device(table.device):
            rows = table.sparse_read(unique_ids)
        out = tf.gather(rows, positions)
        return tf.reshape(out, tf.concat([tf.shape(ids), tf.shape(rows)[1:]], 0))


def _remember(unique_ids, table):
    if tf.executing_eagerly():
        return
    _LOOKUPS.setdefault(unique_ids.graph, {})[unique_ids.name] = table


def table_of_gradient(indices, depth=6):
    """Returns the PS table whose lookups produced gradient `indices`, or None."""
    if tf.executing_eagerly() or not hasattr(indices, "graph"):
        return None
    lookups = _LOOKUPS.get(indices.graph)
    if not lookups:
        return None
    return _resolve(indices, lookups, depth)


def _resolve(tensor, lookups, depth):
    if tensor.name in lookups:
        return lookups[tensor.name]
    if depth == 0:
        return None
    op = tensor.op
    if op.type in _PASS_THROUGH_OPS:
        return _resolve(op.inputs[0], lookups, depth - 1)
    if op.type == "ConcatV2":  # the tape merging several lookups of one table
        tables = {id(t): t for t in
                  (_resolve(x, lookups, depth - 1) for x in op.inputs[:-1])}
        if len(tables) == 1 and None not in tables.values():
            return next(iter(tables.values()))
    return None


def install_keras_hook():
    """Lets `tf.gather` on a Keras 3 variable that wraps a PS table use `lookup`.

    `tf.gather(params, ids)` calls `params.sparse_read(ids)` when it exists. Keras 3
    variables have none, so their gather would read the whole table first; this
    adds one that exists only for variables wrapping a PS table.
    """
    import keras

    variable_class = keras.Variable
    if "sparse_read" in variable_class.__dict__:
        return

    def sparse_read(self):
        value = getattr(self, "_value", None)
        if not is_table(value):
            raise AttributeError("sparse_read")
        return lambda indices, name=None: lookup(value, indices, name=name)

    variable_class.sparse_read = property(sparse_read)
