"""Keras 3 functional models look up every PS table their inputs index at once.

A functional model (a Sequential one runs as one too) knows, before it runs a layer,
which of its `Embedding` layers take their ids straight from its inputs. Under a
HybridStrategy, each such layer's lookup of a PS table is an exchange with every
PS task holding rows of it: the ids go, the rows come back, each by a call between
tasks of its own. `install` makes the model look those tables up together when it
starts running (`table.lookup_many`): one exchange per PS task whatever the number
of tables (a click-through model with 26 categorical features: 2 calls per worker
and step instead of 52). Each layer then returns its rows when it is called: the
same ids checks, rows, masks and gradients (one `IndexedSlices` per table) as the
layer's own lookup. Only plain `keras.layers.Embedding` layers take part (not
subclasses, which may look up otherwise, nor quantized or LoRA ones).

In a call of several steps on an endless dataset (keras_integration/multi_step.py), the
next step's lookups of those layers ride with this step's push instead
(`next_lookups`, communication/rows_ahead.py), and the next step's calls return the
rows that came back with this step's dense sum.

In training, the model's `DynamicEmbedding` layers that read its inputs (and are called
nowhere else: a layer's calls train one after the other) train their tables together
the same way (`dynamic_embedding.train_together`): their ids cross to each PS task in
one tensor, and their admissions, evictions and rows come back in one, whatever the
number of tables, instead of an exchange per table.

```python
import keras
import hybrid_strategy
strategy = hybrid_strategy.HybridStrategy()     # installs it
with strategy.scope():
    a, b = keras.Input((), dtype="int32"), keras.Input((), dtype="int32")
    rows = [keras.layers.Embedding(100, 4)(a), keras.layers.Embedding(50, 4)(b)]
    model = keras.Model([a, b], keras.layers.Concatenate()(rows))
print(model([keras.ops.ones((2,), "int32"), keras.ops.zeros((2,), "int32")]).shape)
```
"""

import functools
import threading
import weakref

import tensorflow as tf

# TF-private: one replica's part of a batch, as the strategy hands it to the replica.
from hybrid_strategy.tensorflow_private import distribute_utils

from hybrid_strategy.keras_integration import registry
from hybrid_strategy.tables import table as table_lib

# {(id of an Embedding or DynamicEmbedding layer, id of its ids tensor): (ids tensor,
# its output)} of the functional models running on this thread.
_LOOKED_UP = threading.local()
# Table layers that train their tables in their calls -> `train_together` of their kind.
_TRAINED_TOGETHER = {}
# graph of an ids tensor -> {(id of an Embedding layer, the ids' ref): (request, rows)}:
# rows looked up by the step before (`use_rows_ahead`).
_AHEAD = weakref.WeakKeyDictionary()


def install(applies):
    """Makes Keras 3 functional models look their tables up at once while `applies()`."""

    def make_run_through_graph(run_through_graph):
        @functools.wraps(run_through_graph)
        def run_looking_up_at_once(self, inputs, operation_fn=lambda op: op, call_fn=None):
            rows = {}
            if call_fn is None and applies():
                rows = _look_up(self, inputs)
            if not rows:
                return run_through_graph(self, inputs, operation_fn=operation_fn,
                                         call_fn=call_fn)
            outer = getattr(_LOOKED_UP, "rows", {})
            _LOOKED_UP.rows = {**outer, **rows}
            try:
                return run_through_graph(self, inputs, operation_fn=operation_fn,
                                         call_fn=call_fn)
            finally:
                _LOOKED_UP.rows = outer

        return run_looking_up_at_once

    def make_call(call):
        # Keras reads which arguments `call` takes from its signature: Embedding.call's.
        @functools.wraps(call)
        def call_with_rows_looked_up(self, inputs):
            rows = looked_up(self, inputs)
            return call(self, inputs) if rows is None else rows

        return call_with_rows_looked_up

    # Keras-private: `Function._run_through_graph`, the graph runner of functional
    # models, which Keras offers no public way into.
    registry.install("batched_lookups.run_at_once", make_run_through_graph)
    # After the id checks (table_hooks): rows looked up at once are returned before
    # them, their ids having been checked by `_look_up`.
    registry.install("batched_lookups.rows_looked_up", make_call)


def looked_up(layer, inputs):
    """What the model running on this thread looked up at once for `layer`'s call on
    `inputs`, or None."""
    rows = getattr(_LOOKED_UP, "rows", {}).get((id(layer), id(inputs)))
    return rows[1] if rows is not None and rows[0] is inputs else None


def _look_up(function, inputs):
    """What the tables of `function` indexed by one of its inputs give, looked up at
    once, keyed as `_LOOKED_UP.rows`: the rows of every plain Embedding, and in
    training the outputs of every DynamicEmbedding; {} for kinds with fewer than two."""
    import keras  # pylint: disable=import-outside-toplevel

    values = keras.tree.flatten(inputs)
    if not all(isinstance(value, tf.Tensor) for value in values):
        return {}  # symbolic (KerasTensor) or eager inputs: no step being traced
    fixed, dynamic = [], []
    training = _training()
    for node, position in _fed_by_inputs(function, len(values)):
        layer, ids = node.operation, values[position]
        if training and _trains_together(layer, node):
            dynamic.append((layer, ids))
        elif _takes_part(layer, keras):
            fixed.append((layer, ids))
    looked_up = {}
    for layer, ids in fixed:
        ahead = _rows_ahead(layer, ids)
        if ahead is not None:
            looked_up[(id(layer), id(ids))] = (ids, tf.cast(ahead, layer.compute_dtype))
    fixed = [(layer, ids) for layer, ids in fixed if (id(layer), id(ids)) not in looked_up]
    if len(fixed) > 1:
        requests = []
        for layer, ids in fixed:
            checked = table_lib.checked_layer_ids(layer, ids)
            if not checked.dtype.is_integer:
                checked = tf.cast(checked, tf.int32)  # as Embedding.call does
            requests.append((layer.embeddings._value, checked))
        rows = table_lib.lookup_many(requests, checked=True)
        looked_up.update({(id(layer), id(ids)): (ids, tf.cast(r, layer.compute_dtype))
                          for (layer, ids), r in zip(fixed, rows)})
    by_class = {}
    for layer, ids in dynamic:
        by_class.setdefault(_registered(layer), []).append((layer, ids))
    for cls, calls in by_class.items():
        if len(calls) > 1:
            outputs = _TRAINED_TOGETHER[cls](calls)
            looked_up.update({(id(layer), id(ids)): (ids, output)
                              for (layer, ids), output in zip(calls, outputs)})
    return looked_up


def next_lookups(model, batch, devices):
    """The lookups of `model`'s next step on `batch` that can ride with this step's push
    (communication/rows_ahead.py `Ahead`): those of its plain Embedding layers that take
    their ids straight from a model input, as Keras 3's `train_step` hands it the
    batch, on each replica's device of `devices`."""
    import keras  # pylint: disable=import-outside-toplevel

    function = model if _runs_graph(model) else getattr(model, "_functional", None)
    if not _runs_graph(function):
        return []  # a subclassed model: its layers are known only as it runs
    fed = [(node.operation, position) for node, position in _fed_by_inputs(function)
           if _takes_part(node.operation, keras)]
    lookups = []
    for replica, device in enumerate(devices) if fed else ():
        x, _, _ = keras.utils.unpack_x_y_sample_weight(
            distribute_utils.select_replica(replica, batch))
        given = keras.tree.flatten(x)
        with tf.device(device):
            values = function._standardize_inputs(x)
        for layer, position in fed:
            ids = values[position]
            if not any(ids is value for value in given):
                continue  # changed on its way in: the step's own ids are not these
            with tf.device(device):
                checked = table_lib.checked_layer_ids(layer, ids)
                if not checked.dtype.is_integer:
                    checked = tf.cast(checked, tf.int32)  # as Embedding.call does
            lookups.append(((id(layer), ids.ref()), device,
                            layer.embeddings._value, checked))
    return lookups


def use_rows_ahead(rows):
    """Makes the next step's calls of Embedding layers on the ids `rows` (`Ahead.rows`
    of `next_lookups`) return the rows gathered for them."""
    for key, (request, value) in rows.items():
        _AHEAD.setdefault(key[1].deref().graph, {})[key] = (request, value)


def _rows_ahead(layer, ids):
    """The rows of `layer`'s lookup of `ids` gathered by the step before, or None."""
    if not hasattr(ids, "graph"):
        return None
    entry = _AHEAD.get(ids.graph, {}).get((id(layer), ids.ref()))
    return None if entry is None else table_lib.rows_looked_up_ahead(*entry)


def _fed_by_inputs(function, given=None):
    """(node, position of its input among `function`'s inputs) of every call of a layer
    in `function` on one of its inputs alone (of the first `given`)."""
    positions = {id(x): p for p, x in enumerate(function.inputs[:given])}
    return [(node, positions[id(node.input_tensors[0])])
            for nodes in function._nodes_by_depth.values() for node in nodes
            if len(node.input_tensors) == 1 and id(node.input_tensors[0]) in positions]


def _runs_graph(function):
    return function is not None and hasattr(function, "_nodes_by_depth") and hasattr(
        function, "_standardize_inputs")


def _training():
    """The `training` argument of the model call being run (Keras passes it down)."""
    # Keras-private: the call context, where Keras keeps the outermost call's
    # `training` for the layers it calls; a graph runner has no other way to it.
    from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel
    context = global_state.get_global_attribute("current_call_ctx")
    return bool(context is not None and context.get_value("training"))


def trained_together(layer_class, train_together):
    """Registers `layer_class` (a table layer that trains its table in its call, such as
    `DynamicEmbedding`) with `train_together([(layer, ids)]) -> [outputs]`, which trains
    the tables of several such calls at once."""
    _TRAINED_TOGETHER[layer_class] = train_together


def _trains_together(layer, node):
    """Whether `layer` is of a class registered with `trained_together`, called by the
    node as its model is (no `training` argument of its own), which then trains its
    table, and called nowhere else: a layer's calls train its table one after the other,
    each seeing the decisions of the one before, in the model's order."""
    return (_registered(layer) is not None
            and len(layer._inbound_nodes) == 1  # Keras-private: the layer's calls
            and "training" not in node.arguments.kwargs and not table_lib.exporting())


def _registered(layer):
    """The class `layer` is an instance of that `trained_together` registered, or None."""
    return next((cls for cls in _TRAINED_TOGETHER if isinstance(layer, cls)), None)


def _takes_part(layer, keras):
    return (type(layer) is keras.layers.Embedding  # pylint: disable=unidiomatic-typecheck
            and not layer.lora_enabled and not layer.quantization_mode
            and table_lib.table_behind(layer.embeddings) is not None)
