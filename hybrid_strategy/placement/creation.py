"""What the strategy's variable creator knows about the variable being created.

Keras 3 makes a layer weight in `Layer.add_weight` as a `keras.Variable`, whose
`_initialize` creates the TensorFlow variable: at once, or, for sublayers built
inside `compute_output_spec` (subclassed models, layers wrapping layers), later
from `initialize_all_variables()`, with no layer on the stack. Both times the
`keras.Variable` is on the stack with its path, shape and initializer, and
`add_weight` tags it with its layer's classes (`tag_layer_classes`, called from
keras_integration/layer_hooks.py). tf_keras creates every weight inside
`add_weight`, whose frame names the layer.
"""

import inspect
import sys
import typing

import tensorflow as tf

from hybrid_strategy.placement import plan as placement_lib

# Set by `tag_layer_classes` on each Keras 3 layer weight: its layer's class names.
_LAYER_CLASSES = "_hybrid_layer_classes"


class CreationContext(typing.NamedTuple):
    """The variable being created, as the stack tells it.

    `layer_classes` is None for variables that are not layer weights (optimizer
    slots and counters, metrics); `shape` is None when unknown.
    """

    owner: object = None
    keras_variable: object = None
    path: str | None = None
    shape: tuple | None = None
    initializer: object = None
    layer_classes: tuple | None = None


def tag_layer_classes(variable, layer):
    """Tags a Keras 3 weight made by `layer.add_weight` with the layer's classes.

    A variable whose creation Keras defers keeps the tag until it is created, so
    placement can follow the layer without the layer on the stack.
    """
    setattr(variable, _LAYER_CLASSES, _layer_classes(layer))


def creation_context():
    """Reads the variable being created from the innermost Keras frames on the stack.

    The innermost `keras.Variable` being initialized gives path, shape and
    initializer; the innermost `add_weight` / `add_variable` gives the owner (a
    layer, or a Keras 3 optimizer making a slot).
    """
    variable_class = getattr(_keras3(), "Variable", None)
    keras_variable = value = initializer = None
    code = owner = shape = None
    frame = inspect.currentframe()
    try:
        while frame.f_back is not None:
            frame = frame.f_back
            name, local = frame.f_code.co_name, frame.f_locals
            this = local.get("self")
            if variable_class is not None and isinstance(this, variable_class):
                if keras_variable is None and name == "_initialize":
                    keras_variable, value = this, local.get("value")
                elif this is keras_variable and name == "_initialize_with_initializer":
                    initializer = local.get("initializer")
            elif name in ("add_weight", "add_variable"):
                code, owner, shape = name, this, local.get("shape")
                initializer = initializer or local.get("initializer")
                break
    finally:
        del frame
    layer_classes = _layer_classes(owner) if code == "add_weight" else None
    if keras_variable is not None:
        # An array initial value is set before the Keras variable knows its shape.
        known = keras_variable._shape
        shape = known if known is not None else getattr(value, "shape", None)
        return CreationContext(owner, keras_variable, keras_variable.path,
                               _shape_of(shape), initializer,
                               getattr(keras_variable, _LAYER_CLASSES, layer_classes))
    if code == "add_weight":
        return CreationContext(owner, None, None, _shape_of(shape or ()), initializer,
                               layer_classes)
    return CreationContext(owner, None, None, None, initializer, None)


def describe_variable(kwargs, context):
    """The `VariableInfo` of the variable being created with `kwargs` in `context`."""
    dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
    name = str(kwargs.get("name") or "variable")
    layer = context.owner if context.layer_classes else None
    path = context.path or _tf_variable_path(name, layer)
    return placement_lib.VariableInfo(
        path=path, shape=context.shape, itemsize=dtype.size,
        layer_classes=context.layer_classes or (),
        trainable=bool(kwargs.get("trainable", True)))


def _layer_classes(owner):
    """The class names of `owner` if it is a layer (not a metric, not an optimizer)."""
    if owner is None or not hasattr(owner, "add_weight") or hasattr(owner, "apply_gradients"):
        return None
    names = tuple(c.__name__ for c in type(owner).__mro__)
    # tf_keras metrics are layers too, but their weights are counters.
    return None if "Metric" in names else names


def _tf_variable_path(name, layer):
    """The name TensorFlow gives a variable created here, as tf_keras weights show it.

    A tf_keras layer built outside any name scope (its `build` called directly)
    gives its weights bare names, which collide: "layer/variable" then.
    """
    scope = tf.get_current_name_scope()
    if scope:
        return f"{scope}/{name}"
    return f"{layer.name}/{name}" if layer is not None else name


def _shape_of(shape):
    """A shape as a tuple of ints; None when not fully known."""
    shape = tf.TensorShape(shape)
    return tuple(int(d) for d in shape.as_list()) if shape.is_fully_defined() else None


def _keras3():
    """The Keras 3 module if it is loaded (tf_keras programs may not load it)."""
    keras = sys.modules.get("keras")
    return keras if hasattr(keras, "Variable") else None
