"""Row-sparse update rules of Keras optimizers, applied to one shard of a table at a time.

A PS table is updated on the parameter server that holds it, one row shard at a
time. Keras's own `optimizer.update_step(grad, var)` densifies an `IndexedSlices`
gradient (Adagrad divides by the whole accumulator, Adam decays every row of its
moments), so its cost grows with the table. `row_updater(optimizer)` returns a
`RowUpdater` holding the same update rule written for rows: in "lazy" mode it
gathers the gradient's rows of the variable and of each slot, applies the rule to
them and scatters them back, so a step costs O(rows in the gradient); in "exact"
mode it reproduces Keras's dense update, where every row's slots move.

Supported: `keras.optimizers.SGD` (with or without momentum and nesterov),
`Adagrad`, `Adam` (amsgrad too) and `RMSprop` (centered or not, with or without
momentum), and the same four classes of `tf_keras.optimizers` (the optimizers of
`tf_keras/src/optimizers/`, including Adam's `adaptive_epsilon`). Anything else,
and settings the row rules cannot honour (weight decay, EMA, gradient
accumulation), raise `UnsupportedOptimizerError`. Gradient clipping and
`loss_scale_factor` are fine: Keras applies them before `update_step`, so the
gradient handed to `RowUpdater.apply` is already clipped and unscaled.

```python
import keras
import tensorflow as tf
from hybrid_strategy import sparse_optimizers

table = keras.Variable(tf.ones((6, 2)))
optimizer = keras.optimizers.Adam(learning_rate=0.1)
optimizer.build([table])
updater = sparse_optimizers.row_updater(optimizer)
slots = updater.slots(optimizer, table)          # {"momentum": ..., "velocity": ...}
grad = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([1, 4]), tf.constant([6, 2]))
updater.apply(optimizer, table, slots, grad, mode="lazy")   # only rows 1 and 4 move
optimizer.iterations.assign_add(1)               # as Keras does after a step
print(table.numpy())
```
"""

import sys

import tensorflow as tf

MODES = ("lazy", "exact")

_KERAS = "keras"
_TF_KERAS = "tf_keras"
_SUPPORTED_NAMES = ("SGD", "Adagrad", "Adam", "RMSprop")
_SUPPORTED_TEXT = (
    "keras.optimizers.SGD/Adagrad/Adam/RMSprop and "
    "tf_keras.optimizers.SGD/Adagrad/Adam/RMSprop")
_WHAT_TO_DO = (
    "To train this table with it anyway, place the table 'mirrored' (for example "
    "HybridStrategy(placement_overrides={'<layer>/embeddings': 'mirrored'})), or "
    "use one of the supported optimizers.")


class UnsupportedOptimizerError(TypeError):
    """The optimizer, or one of its settings, has no row-sparse update rule here.

    ```python
    import keras
    from hybrid_strategy import sparse_optimizers
    try:
        sparse_optimizers.row_updater(keras.optimizers.Nadam())
    except sparse_optimizers.UnsupportedOptimizerError as e:
        print(e)
    ```
    """


def row_updater(optimizer):
    """Returns the `RowUpdater` that applies `optimizer`'s update rule to rows.

    Accepts `keras.optimizers.SGD`, `Adagrad`, `Adam`, `RMSprop` and the same
    classes of `tf_keras.optimizers` (exactly these classes, not subclasses,
    which may change the rule). Raises `UnsupportedOptimizerError`, naming the
    optimizer and what to do, for any other optimizer (Nadam, Adamax, Ftrl,
    AdamW, Lion, LossScaleOptimizer, the `tf_keras.optimizers.legacy` ones, ...)
    and for these settings:

    * `weight_decay` other than None or 0: Keras shrinks every weight of every
      variable each step (`var -= lr * wd * var`), which touches every row.
    * `use_ema=True`: Keras averages every row into a moving average each step
      and may overwrite the variable with it.
    * `gradient_accumulation_steps` (Keras 3): gradients are summed into dense
      buffers and the update happens only every N-th step.
    * a DTensor `mesh` (tf_keras).

    `clipnorm`, `clipvalue`, `global_clipnorm` and `loss_scale_factor` are
    accepted: Keras applies them to the gradients before `update_step`, and
    `RowUpdater.apply` takes the gradient `update_step` would receive.

    ```python
    import keras
    from hybrid_strategy import sparse_optimizers
    updater = sparse_optimizers.row_updater(keras.optimizers.RMSprop(centered=True))
    print(updater.slot_names)       # ('velocity', 'average_gradient')
    ```
    """
    flavour = _flavour_of(optimizer)
    cls = type(optimizer)
    name = cls.__name__
    if flavour is None:
        raise UnsupportedOptimizerError(
            f"{_describe(optimizer)} has no row-sparse update rule: supported are "
            f"{_SUPPORTED_TEXT}. {_WHAT_TO_DO}")
    if flavour == "tf_keras_legacy":
        raise UnsupportedOptimizerError(
            f"{_describe(optimizer)} is a legacy tf_keras optimizer (OptimizerV2), "
            f"which has no row-sparse update rule: supported are {_SUPPORTED_TEXT}. "
            f"Use tf_keras.optimizers.{name} (the non-legacy class) instead. "
            f"{_WHAT_TO_DO}")
    _check_settings(optimizer, flavour)
    updater_cls = {"SGD": _SGD, "Adagrad": _Adagrad, "Adam": _Adam,
                   "RMSprop": _RMSprop}[name]
    return updater_cls(optimizer, flavour)


class RowUpdater:
    """Applies one optimizer's update rule to the rows a sparse gradient touches.

    Built by `row_updater(optimizer)`. `slot_names` are the optimizer's own
    names for its per-variable state (Keras 3 Adam: `("momentum", "velocity")`,
    tf_keras Adam: `("m", "v")`); `slots()` finds those variables, `apply()`
    updates a variable (or one row shard of it) and its slots.

    ```python
    import keras
    import tensorflow as tf
    from hybrid_strategy import sparse_optimizers
    table = keras.Variable(tf.zeros((4, 3)))
    optimizer = keras.optimizers.Adagrad(learning_rate=0.5)
    optimizer.build([table])
    updater = sparse_optimizers.row_updater(optimizer)
    shard = tf.Variable(table.numpy()[2:])             # rows 2..3 of the table
    shard_slots = {name: tf.Variable(slot.numpy()[2:])
                   for name, slot in updater.slots(optimizer, table).items()}
    grad = tf.IndexedSlices(tf.ones((1, 3)), tf.constant([1]))   # table row 3
    updater.apply(optimizer, shard, shard_slots, grad)
    print(shard.numpy())
    ```
    """

    slot_names = ()
    # Whether the lazy rule is Keras's dense rule (rows without gradient keep
    # their variable and slots bit for bit), so "exact" can use it too.
    _lazy_is_exact = False

    def __init__(self, optimizer, flavour):
        self._class = type(optimizer)
        self._flavour = flavour
        self.slot_names = self._slot_names(optimizer)

    def __repr__(self):
        return (f"<RowUpdater for {self._flavour}.optimizers.{self._class.__name__}"
                f" slots={self.slot_names}>")

    # Slots -------------------------------------------------------------------

    def slots(self, optimizer, variable):
        """Returns `{slot name: slot variable}` for `variable`, as `optimizer` stores them.

        `variable` is one the optimizer was built with: a `keras.Variable` (or
        its `.value`) for Keras 3, a `tf.Variable` for tf_keras. The values are
        the optimizer's own objects (Keras 3: `keras.Variable`s; tf_keras:
        `tf.Variable`s), not copies.

        ```python
        import keras
        from hybrid_strategy import sparse_optimizers
        w = keras.Variable([[1.0, 2.0]])
        optimizer = keras.optimizers.SGD(momentum=0.9)
        optimizer.build([w])
        slots = sparse_optimizers.row_updater(optimizer).slots(optimizer, w)
        print(slots["momentum"] is optimizer.momentums[0])   # True
        ```
        """
        self._check_optimizer(optimizer)
        if not self.slot_names:
            return {}
        index = _variable_index(optimizer, variable, self._flavour)
        return {name: getattr(optimizer, attr)[index]
                for name, attr in zip(self.slot_names, self._slot_attrs(optimizer))}

    # Update ------------------------------------------------------------------

    def apply(self, optimizer, variable, slots, grad, mode="lazy", concurrent=False):
        """Updates `variable` and its `slots` with `grad` by `optimizer`'s rule.

        `variable` is a `tf.Variable` (or a `keras.Variable`), typically one row
        shard of a table; `slots` maps every name of `slot_names` to a variable
        of the same shape (the matching shard of each slot). `grad` is either a
        `tf.IndexedSlices` whose indices are unique and local to `variable`
        (rows `0..shape[0]-1`), or a dense tensor of the variable's shape; it
        is the gradient Keras would hand to `update_step` (already clipped and
        divided by `loss_scale_factor`). Duplicate indices are not merged: sum
        them first. A variable's `constraint`, which Keras applies after
        `update_step`, is not applied here.

        `mode="lazy"` changes only the gradient's rows, of the variable and of
        every slot, with the LazyAdam-style rule (Adam's bias correction still
        uses the global step); it gathers those rows, computes and scatters
        them back, so its cost is O(rows in `grad`). `mode="exact"` gives
        Keras's dense update, where rows without gradient still decay their
        slots and move under momentum, Adam and RMSprop; it costs O(rows of
        `variable`). For Adagrad and for SGD without momentum both modes are
        the same update and take the lazy path. A dense `grad` touches every
        row, so both modes apply Keras's dense update.

        The learning rate (a float, variable, callable or
        `LearningRateSchedule`) and the step (`optimizer.iterations + 1`) are
        read from `optimizer`, in `variable`'s dtype, as Keras reads them
        before incrementing `iterations`; the caller increments it after the
        step, as Keras does. Works eagerly and inside `tf.function`.

        `concurrent=True` (asynchronous training: other steps may update the
        same rows meanwhile) writes each new value as its difference from the
        value read, added with the variable's own atomic operation, so that no
        step's update overwrites another's.

        Returns an int32 scalar tensor, the number of rows written, that runs
        after every update (use it as a control dependency in graph code).

        ```python
        import tensorflow as tf
        import tf_keras
        from hybrid_strategy import sparse_optimizers
        w = tf.Variable(tf.ones((5, 2)))
        optimizer = tf_keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        optimizer.build([w])
        updater = sparse_optimizers.row_updater(optimizer)
        grad = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([0, 3]))
        updater.apply(optimizer, w, updater.slots(optimizer, w), grad, mode="exact")
        print(w.numpy())
        ```
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._check_optimizer(optimizer)
        variable = _tf_variable(variable)
        slot_vars = self._check_slots(slots, variable)
        dtype = variable.dtype.base_dtype
        with tf.name_scope(f"{self._class.__name__}_row_update"):
            hyper = self._hyper(optimizer, dtype)
            if isinstance(grad, tf.IndexedSlices):
                if mode == "lazy" or self._lazy_is_exact:
                    ops, rows = self._apply_rows(hyper, variable, slot_vars, grad, concurrent)
                else:
                    dense = _densify(grad, variable)
                    ops, rows = self._apply_dense(hyper, variable, slot_vars, dense, concurrent)
            else:
                dense = tf.cast(tf.convert_to_tensor(grad), dtype)
                if variable.shape.is_fully_defined() and dense.shape.is_fully_defined():
                    if dense.shape != variable.shape:
                        raise ValueError(
                            f"dense gradient of shape {dense.shape} for a variable "
                            f"of shape {variable.shape}")
                ops, rows = self._apply_dense(hyper, variable, slot_vars, dense, concurrent)
            with tf.control_dependencies([op for op in ops if op is not None]):
                return tf.identity(rows)

    def _apply_rows(self, hyper, variable, slots, grad, concurrent):
        """Gathers grad's rows of variable and slots, applies the rule, scatters back."""
        indices = grad.indices
        g = tf.cast(grad.values, variable.dtype)
        w = variable.sparse_read(indices)
        rows = {name: slot.sparse_read(indices) for name, slot in slots.items()}
        new_w, new_rows = self._rule(hyper, w, rows, g)

        def write(target, new, old):
            if concurrent:
                return _op(target.scatter_add(tf.IndexedSlices(new - old, indices)))
            return _op(target.scatter_update(tf.IndexedSlices(new, indices)))

        ops = [write(slots[name], new_rows[name], rows[name])
               for name in self.slot_names if name in new_rows]
        ops.append(write(variable, new_w, w))
        return ops, tf.size(indices, out_type=tf.int32)

    def _apply_dense(self, hyper, variable, slots, g, concurrent):
        """Keras's dense update on the whole variable and slots."""
        w = variable.read_value()
        full = {name: slot.read_value() for name, slot in slots.items()}
        new_w, new_full = self._rule(hyper, w, full, g)

        def write(target, new, old):
            if concurrent:
                return target.assign_add(new - old, read_value=False)
            return target.assign(new, read_value=False)

        ops = [write(slots[name], new_full[name], full[name])
               for name in self.slot_names if name in new_full]
        ops.append(write(variable, new_w, w))
        return ops, tf.shape(variable, out_type=tf.int32)[0]

    # Per-optimizer parts -----------------------------------------------------

    def _slot_names(self, optimizer):
        raise NotImplementedError

    def _slot_attrs(self, optimizer):
        """The optimizer attributes (lists indexed like its variables) of each slot."""
        raise NotImplementedError

    def _hyper(self, optimizer, dtype):
        """Tensors and numbers the rule needs, read from the optimizer now."""
        return {"lr": _learning_rate(optimizer, self._flavour, dtype)}

    def _rule(self, h, w, slots, g):
        """(new variable rows, {slot: new rows}) from rows (or whole tensors) w, slots, g."""
        raise NotImplementedError

    # Checks ------------------------------------------------------------------

    def _check_optimizer(self, optimizer):
        if type(optimizer) is not self._class:
            raise ValueError(
                f"this RowUpdater was made for {self._class.__name__}, "
                f"got {_describe(optimizer)}")

    def _check_slots(self, slots, variable):
        slots = dict(slots or {})
        if set(slots) != set(self.slot_names):
            raise ValueError(
                f"slots must have exactly the keys {self.slot_names}, "
                f"got {tuple(sorted(slots))}")
        out = {}
        for name in self.slot_names:
            slot = _tf_variable(slots[name])
            if (slot.shape.is_fully_defined() and variable.shape.is_fully_defined()
                    and slot.shape != variable.shape):
                raise ValueError(
                    f"slot {name!r} has shape {slot.shape}, the variable {variable.shape}")
            out[name] = slot
        return out


class _SGD(RowUpdater):
    """w -= lr*g; with momentum mu: m = mu*m - lr*g, w += m (nesterov: w += mu*m - lr*g).

    tf_keras always keeps the slot "m" and updates it even when momentum is 0
    (then m = -lr*g, which does not move w); Keras 3 has no slot without momentum.
    """

    def _slot_names(self, optimizer):
        if self._flavour == _TF_KERAS or optimizer.momentum != 0:
            return ("momentum",) if self._flavour == _KERAS else ("m",)
        return ()

    def _slot_attrs(self, optimizer):
        return ("momentums",)

    @property
    def _lazy_is_exact(self):
        return not self.slot_names

    def _hyper(self, optimizer, dtype):
        h = super()._hyper(optimizer, dtype)
        h["momentum"] = _cast(optimizer.momentum, dtype)
        h["nesterov"] = bool(optimizer.nesterov)
        return h

    def _rule(self, h, w, slots, g):
        lr = h["lr"]
        if not self.slot_names:
            return w - g * lr, {}
        name = self.slot_names[0]
        mu = h["momentum"]
        m = slots[name] * mu - g * lr
        if h["nesterov"]:
            return w + (m * mu - g * lr), {name: m}
        return w + m, {name: m}


class _Adagrad(RowUpdater):
    """acc += g^2; w -= lr*g / sqrt(acc + eps) (both flavours: eps inside the root)."""

    _lazy_is_exact = True

    def _slot_names(self, optimizer):
        return ("accumulator",)

    def _slot_attrs(self, optimizer):
        return ("_accumulators",)

    def _hyper(self, optimizer, dtype):
        h = super()._hyper(optimizer, dtype)
        h["epsilon"] = _cast(optimizer.epsilon, dtype)
        return h

    def _rule(self, h, w, slots, g):
        acc = slots["accumulator"] + tf.square(g)
        return w - (h["lr"] * g) / tf.sqrt(acc + h["epsilon"]), {"accumulator": acc}


class _Adam(RowUpdater):
    """m += (g-m)(1-b1); v += (g^2-v)(1-b2); [amsgrad: vh = max(vh, v)];
    w -= m*alpha / (sqrt(v or vh) + eps), alpha = lr*sqrt(1-b2^t)/(1-b1^t), t = iterations+1.

    tf_keras's `adaptive_epsilon=True` uses eps*sqrt(1-b2^t) instead of eps.
    """

    def _slot_names(self, optimizer):
        if self._flavour == _KERAS:
            names = ("momentum", "velocity")
            return names + ("velocity_hat",) if optimizer.amsgrad else names
        return ("m", "v", "vhat") if optimizer.amsgrad else ("m", "v")

    def _slot_attrs(self, optimizer):
        return ("_momentums", "_velocities", "_velocity_hats")[:len(self.slot_names)]

    def _hyper(self, optimizer, dtype):
        h = super()._hyper(optimizer, dtype)
        step = tf.cast(tf.convert_to_tensor(optimizer.iterations) + 1, dtype)
        beta_1, beta_2 = _value(optimizer.beta_1), _value(optimizer.beta_2)
        beta_1_power = tf.pow(_cast(beta_1, dtype), step)
        beta_2_power = tf.pow(_cast(beta_2, dtype), step)
        h["alpha"] = h["lr"] * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        h["one_minus_beta_1"] = _one_minus(beta_1, dtype)
        h["one_minus_beta_2"] = _one_minus(beta_2, dtype)
        epsilon = _cast(optimizer.epsilon, dtype)
        if self._flavour == _TF_KERAS and getattr(optimizer, "adaptive_epsilon", False):
            epsilon = epsilon * tf.sqrt(1 - beta_2_power)
        h["epsilon"] = epsilon
        return h

    def _rule(self, h, w, slots, g):
        m_name, v_name = self.slot_names[:2]
        m = slots[m_name] + (g - slots[m_name]) * h["one_minus_beta_1"]
        v = slots[v_name] + (tf.square(g) - slots[v_name]) * h["one_minus_beta_2"]
        new = {m_name: m, v_name: v}
        if len(self.slot_names) == 3:
            vh_name = self.slot_names[2]
            v = tf.maximum(slots[vh_name], v)
            new[vh_name] = v
        return w - (m * h["alpha"]) / (tf.sqrt(v) + h["epsilon"]), new


class _RMSprop(RowUpdater):
    """v = rho*v + (1-rho)*g^2; [centered: a = rho*a + (1-rho)*g, d = v - a^2 + eps;
    else d = v + eps]; inc = lr*g/sqrt(d); [momentum mu > 0: p = mu*p + inc, w -= p;
    else w -= inc]. tf_keras writes inc as lr*g*rsqrt(d)."""

    def _slot_names(self, optimizer):
        names = ("velocity",)
        if optimizer.momentum > 0:
            names += ("momentum",)
        if optimizer.centered:
            names += ("average_gradient",)
        return names

    def _slot_attrs(self, optimizer):
        attrs = {"velocity": "_velocities", "momentum": "_momentums",
                 "average_gradient": "_average_gradients"}
        return tuple(attrs[name] for name in self.slot_names)

    def _hyper(self, optimizer, dtype):
        h = super()._hyper(optimizer, dtype)
        rho = _value(optimizer.rho)
        h["rho"] = _cast(rho, dtype)
        h["one_minus_rho"] = _one_minus(rho, dtype)
        h["momentum"] = _cast(optimizer.momentum, dtype)
        h["epsilon"] = _cast(optimizer.epsilon, dtype)
        return h

    def _rule(self, h, w, slots, g):
        new = {}
        v = h["rho"] * slots["velocity"] + h["one_minus_rho"] * tf.square(g)
        new["velocity"] = v
        if "average_gradient" in self.slot_names:
            a = h["rho"] * slots["average_gradient"] + h["one_minus_rho"] * g
            new["average_gradient"] = a
            denominator = v - tf.square(a) + h["epsilon"]
        else:
            denominator = v + h["epsilon"]
        if self._flavour == _KERAS:
            increment = (h["lr"] * g) / tf.sqrt(denominator)
        else:
            increment = h["lr"] * g * tf.math.rsqrt(denominator)
        if "momentum" in self.slot_names:
            p = h["momentum"] * slots["momentum"] + increment
            new["momentum"] = p
            return w - p, new
        return w - increment, new


# Helpers ----------------------------------------------------------------------


def _flavour_of(optimizer):
    """'keras', 'tf_keras', 'tf_keras_legacy' for the supported classes' kin, else None.

    Only modules already imported are consulted: an optimizer object of a
    flavour implies that flavour is loaded.
    """
    cls = type(optimizer)
    if cls.__name__ not in _SUPPORTED_NAMES:
        return None
    keras_optimizers = _loaded_attr("keras", "optimizers")
    if keras_optimizers is not None and getattr(keras_optimizers, cls.__name__, None) is cls:
        return _KERAS
    tf_keras_optimizers = _loaded_attr("tf_keras", "optimizers")
    if tf_keras_optimizers is not None:
        if getattr(tf_keras_optimizers, cls.__name__, None) is cls:
            return _TF_KERAS
        legacy = getattr(tf_keras_optimizers, "legacy", None)
        if legacy is not None and getattr(legacy, cls.__name__, None) is cls:
            return "tf_keras_legacy"
    return None


def _loaded_attr(module_name, attr):
    module = sys.modules.get(module_name)
    return None if module is None else getattr(module, attr, None)


def _describe(optimizer):
    cls = type(optimizer)
    return f"{cls.__qualname__} (from {cls.__module__})"


def _check_settings(optimizer, flavour):
    name = f"{flavour}.optimizers.{type(optimizer).__name__}"
    problems = []
    weight_decay = getattr(optimizer, "weight_decay", None)
    if weight_decay is not None and not (
            isinstance(weight_decay, (int, float)) and weight_decay == 0):
        problems.append(
            f"weight_decay={weight_decay!r} (Keras shrinks every row of the variable "
            "each step, var -= lr * weight_decay * var; set weight_decay=None)")
    if getattr(optimizer, "use_ema", False):
        problems.append(
            "use_ema=True (Keras averages every row into a moving average each "
            "step; set use_ema=False)")
    if flavour == _KERAS and getattr(optimizer, "gradient_accumulation_steps", None):
        problems.append(
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} "
            "(Keras accumulates gradients in dense buffers and updates every N-th "
            "step; leave it None)")
    if flavour == _TF_KERAS and getattr(optimizer, "_mesh", None) is not None:
        problems.append("a DTensor mesh")
    if problems:
        raise UnsupportedOptimizerError(
            f"{name} with {'; '.join(problems)} has no row-sparse update rule. "
            f"Supported are {_SUPPORTED_TEXT} without weight decay, EMA or gradient "
            f"accumulation (clipping and loss_scale_factor are fine). {_WHAT_TO_DO}")


def _variable_index(optimizer, variable, flavour):
    """Position of `variable` in the optimizer's per-variable slot lists."""
    try:
        if flavour == _KERAS:
            return optimizer._get_variable_index(variable)
        return optimizer._index_dict[optimizer._var_key(variable)]
    except (KeyError, AttributeError) as e:
        raise ValueError(
            f"{type(optimizer).__name__} has no slots for {getattr(variable, 'name', variable)!r}:"
            " build the optimizer on it first (optimizer.build([...]) or one training "
            "step)") from e


def _tf_variable(value):
    """The tf.Variable behind a keras.Variable; a tf.Variable itself."""
    if isinstance(value, tf.Variable):
        return value
    for attr in ("value", "_value"):     # `value` may be an autocast tensor
        inner = getattr(value, attr, None)
        if isinstance(inner, tf.Variable):
            return inner
    raise TypeError(f"expected a tf.Variable or keras.Variable, got {type(value).__name__}")


def _learning_rate(optimizer, flavour, dtype):
    if flavour == _TF_KERAS:
        schedules = sys.modules["tf_keras"].optimizers.schedules
        lr = optimizer._learning_rate
        if isinstance(lr, schedules.LearningRateSchedule):
            # tf_keras stores schedule(iterations) in a variable at the start of
            # apply_gradients; compute the same value directly.
            lr = lr(optimizer.iterations)
        else:
            lr = optimizer.learning_rate
    else:
        lr = optimizer.learning_rate     # Keras 3 evaluates schedules and callables
    return tf.cast(tf.convert_to_tensor(lr), dtype)


def _value(hyperparameter):
    return hyperparameter() if callable(hyperparameter) else hyperparameter


def _cast(value, dtype):
    return tf.cast(_value(value), dtype)


def _one_minus(value, dtype):
    """1 - value, in Python arithmetic for numbers (as Keras writes `1 - self.beta_1`)."""
    if isinstance(value, (int, float)):
        return tf.constant(1 - value, dtype)
    return 1 - tf.cast(value, dtype)


def _densify(grad, variable):
    indices = grad.indices
    shape = tf.shape(variable, out_type=indices.dtype)
    values = tf.cast(grad.values, variable.dtype)
    return tf.scatter_nd(tf.expand_dims(indices, -1), values, shape)


def _op(result):
    """The update op behind a scatter's return value (None when eager)."""
    if tf.executing_eagerly():
        return None
    return getattr(result, "op", result)
