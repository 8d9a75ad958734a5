"""Row-sparse optimizer rules against Keras's own dense updates and a numpy reference.

Error metric (`rel_err`): elementwise relative error, max_i |x_i - r_i| / d_i with
d_i = max(|r_i|, 1e-3 * max_j |r_j|): a plain relative error, except that an element
that cancels to nearly zero is judged against 1/1000 of its tensor's scale rather
than against its own tiny magnitude. Tolerance 1e-5 everywhere.

The tf_keras cases are skipped when tf_keras is not installed (the `test` extra
installs it).
"""

import inspect
import re
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from hybrid_strategy import sparse_optimizers as so

try:
    import tf_keras
except ImportError:  # pragma: no cover - depends on the environment
    tf_keras = None

needs_tf_keras = pytest.mark.skipif(tf_keras is None, reason="tf_keras not installed")

ROWS, DIM, STEPS, TOL = 12, 3, 5, 1e-5

# Hyperparameters of every supported configuration; `make` turns one into an optimizer.
CONFIGS = {
    "sgd": dict(kind="sgd", lr=0.1, momentum=0.0, nesterov=False),
    "sgd_momentum": dict(kind="sgd", lr=0.1, momentum=0.9, nesterov=False),
    "sgd_nesterov": dict(kind="sgd", lr=0.1, momentum=0.9, nesterov=True),
    "sgd_momentum_schedule": dict(kind="sgd", lr="schedule", momentum=0.5, nesterov=False),
    "adagrad": dict(kind="adagrad", lr=0.1, initial=0.1, epsilon=1e-7),
    "adagrad_init": dict(kind="adagrad", lr=0.3, initial=0.5, epsilon=1e-3),
    "adam": dict(kind="adam", lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False),
    "adam_amsgrad": dict(kind="adam", lr=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6,
                         amsgrad=True),
    "adam_schedule": dict(kind="adam", lr="schedule", beta_1=0.9, beta_2=0.999,
                          epsilon=1e-7, amsgrad=False),
    "rmsprop": dict(kind="rmsprop", lr=0.01, rho=0.9, momentum=0.0, epsilon=1e-7,
                    centered=False),
    "rmsprop_momentum": dict(kind="rmsprop", lr=0.01, rho=0.8, momentum=0.5,
                             epsilon=1e-7, centered=False),
    "rmsprop_centered": dict(kind="rmsprop", lr=0.01, rho=0.9, momentum=0.0,
                             epsilon=1e-7, centered=True),
    "rmsprop_centered_momentum": dict(kind="rmsprop", lr=0.01, rho=0.9, momentum=0.3,
                                      epsilon=1e-5, centered=True),
}
TF_KERAS_ONLY = {
    "adam_adaptive_epsilon": dict(kind="adam", lr=0.01, beta_1=0.9, beta_2=0.999,
                                  epsilon=1e-3, amsgrad=False, adaptive_epsilon=True),
}
# Schedule: lr(t) = 0.1 * 0.5 ** (t / 2) at iterations t (before the increment).
SCHEDULE = dict(initial_learning_rate=0.1, decay_steps=2, decay_rate=0.5)


def schedule_lr(cfg, t):
    return 0.1 * 0.5 ** (t / 2) if cfg["lr"] == "schedule" else cfg["lr"]


def make(flavour, cfg):
    opts = keras.optimizers if flavour == "keras" else tf_keras.optimizers
    lr = cfg["lr"]
    if lr == "schedule":
        lr = opts.schedules.ExponentialDecay(**SCHEDULE)
    kind = cfg["kind"]
    if kind == "sgd":
        return opts.SGD(learning_rate=lr, momentum=cfg["momentum"], nesterov=cfg["nesterov"])
    if kind == "adagrad":
        return opts.Adagrad(learning_rate=lr, initial_accumulator_value=cfg["initial"],
                            epsilon=cfg["epsilon"])
    if kind == "adam":
        extra = {"adaptive_epsilon": True} if cfg.get("adaptive_epsilon") else {}
        return opts.Adam(learning_rate=lr, beta_1=cfg["beta_1"], beta_2=cfg["beta_2"],
                         epsilon=cfg["epsilon"], amsgrad=cfg["amsgrad"], **extra)
    return opts.RMSprop(learning_rate=lr, rho=cfg["rho"], momentum=cfg["momentum"],
                        epsilon=cfg["epsilon"], centered=cfg["centered"])


CASES = ([pytest.param("keras", name, id=f"keras-{name}") for name in CONFIGS]
         + [pytest.param("tf_keras", name, id=f"tf_keras-{name}", marks=needs_tf_keras)
            for name in {**CONFIGS, **TF_KERAS_ONLY}])


def config(name):
    return {**CONFIGS, **TF_KERAS_ONLY}[name]


class Setup:
    """A variable, its optimizer (built the normal way) and the optimizer's slots."""

    def __init__(self, flavour, cfg, init):
        self.flavour = flavour
        self.optimizer = make(flavour, cfg)
        if flavour == "keras":
            self.variable = keras.Variable(init)
        else:
            self.variable = tf.Variable(init)
        self.optimizer.build([self.variable])
        self.updater = so.row_updater(self.optimizer)
        self.slots = self.updater.slots(self.optimizer, self.variable)

    def tf_variable(self):
        return so._tf_variable(self.variable)

    def values(self):
        out = {"var": np.array(self.tf_variable().numpy())}
        for name, slot in self.slots.items():
            out[name] = np.array(so._tf_variable(slot).numpy())
        return out

    def increment(self):
        self.optimizer.iterations.assign_add(1)

    def keras_dense_step(self, dense):
        if self.flavour == "keras":
            self.optimizer.apply([dense], [self.variable])
        else:
            self.optimizer.apply_gradients([(dense, self.variable)])


def rel_err(x, r):
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    if x.size == 0:
        return 0.0
    floor = 1e-3 * np.max(np.abs(r))
    denominator = np.maximum(np.abs(r), floor)
    diff = np.abs(x - r)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.where(diff == 0, 0.0, diff / denominator)
    return float(np.max(err))


def seed(*words):
    return zlib.crc32(" ".join(words).encode())


def random_init(rng):
    return rng.normal(size=(ROWS, DIM)).astype(np.float32)


def random_slices(rng, rows=ROWS):
    n = int(rng.integers(1, rows - 1))
    indices = rng.permutation(rows)[:n].astype(np.int64)
    values = (0.5 * rng.normal(size=(n, DIM))).astype(np.float32)
    return indices, values


def as_slices(indices, values, rows=ROWS):
    return tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                            tf.constant([rows, DIM], tf.int64))


def applier(setup, mode, use_function):
    """apply(indices, values) for `setup`, eager or traced once in a tf.function."""
    variable = setup.tf_variable()

    def run(indices, values):
        grad = tf.IndexedSlices(values, indices, tf.constant([ROWS, DIM], tf.int64))
        return setup.updater.apply(setup.optimizer, variable, setup.slots, grad, mode=mode)

    if use_function:
        run = tf.function(run, input_signature=[
            tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, DIM], tf.float32)])
    return lambda i, v: run(tf.constant(i), tf.constant(v))


WORST = {}


def record(key, err):
    WORST[key] = max(WORST.get(key, 0.0), err)


# Exact mode: the same optimizer's own dense update -------------------------------

@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("flavour,name", CASES)
def test_exact_mode_matches_keras_dense_update(flavour, name, use_function):
    rng = np.random.default_rng(seed(flavour, name))
    init = random_init(rng)
    ours, theirs = Setup(flavour, config(name), init), Setup(flavour, config(name), init)
    apply = applier(ours, "exact", use_function)
    for _ in range(STEPS):
        indices, values = random_slices(rng)
        apply(indices, values)
        ours.increment()
        theirs.keras_dense_step(tf.convert_to_tensor(as_slices(indices, values)))
    got, want = ours.values(), theirs.values()
    assert set(got) == set(want) == {"var", *ours.updater.slot_names}
    for key in want:
        err = rel_err(got[key], want[key])
        record(f"exact {flavour}-{name}", err)
        assert err <= TOL, (key, err)
    assert int(ours.optimizer.iterations.numpy()) == STEPS


# Lazy mode: a numpy reference ------------------------------------------------------

ROLES = {  # the flavour's slot name of each role in the reference rules
    "keras": {"sgd_m": "momentum", "m": "momentum", "v": "velocity", "vhat": "velocity_hat"},
    "tf_keras": {"sgd_m": "m", "m": "m", "v": "v", "vhat": "vhat"},
}


def reference_rows(flavour, cfg, t, w, s, g):
    """One update of float32 rows w (and slot rows s) by gradient rows g, at iterations t."""
    lr = np.float32(schedule_lr(cfg, t))
    kind, names = cfg["kind"], ROLES[flavour]
    if kind == "sgd":
        name = names["sgd_m"]
        if name not in s:
            return w - lr * g
        mu = cfg["momentum"]
        s[name] = mu * s[name] - lr * g
        return w + (mu * s[name] - lr * g if cfg["nesterov"] else s[name])
    if kind == "adagrad":
        s["accumulator"] = s["accumulator"] + g * g
        return w - lr * g / np.sqrt(s["accumulator"] + cfg["epsilon"])
    if kind == "adam":
        step = t + 1
        b1, b2 = cfg["beta_1"], cfg["beta_2"]
        m, v = names["m"], names["v"]
        s[m] = s[m] + (g - s[m]) * (1 - b1)
        s[v] = s[v] + (g * g - s[v]) * (1 - b2)
        denominator_v = s[v]
        if cfg["amsgrad"]:
            s[names["vhat"]] = np.maximum(s[names["vhat"]], s[v])
            denominator_v = s[names["vhat"]]
        # Keras forms the bias correction in the variable's dtype: in float32,
        # 1 - 0.999 ** 1 is 0.00099998713, not 0.001.
        f32 = np.float32
        b1_power, b2_power = f32(b1) ** f32(step), f32(b2) ** f32(step)
        alpha = f32(lr) * np.sqrt(f32(1) - b2_power) / (f32(1) - b1_power)
        eps = cfg["epsilon"]
        if cfg.get("adaptive_epsilon"):
            eps = eps * np.sqrt(f32(1) - b2_power)
        return w - s[m] * alpha / (np.sqrt(denominator_v) + eps)
    rho, eps = cfg["rho"], cfg["epsilon"]
    s["velocity"] = rho * s["velocity"] + (1 - rho) * g * g
    if cfg["centered"]:
        s["average_gradient"] = rho * s["average_gradient"] + (1 - rho) * g
        denominator = s["velocity"] - s["average_gradient"] ** 2 + eps
    else:
        denominator = s["velocity"] + eps
    increment = lr * g / np.sqrt(denominator)
    if cfg["momentum"] > 0:
        s["momentum"] = cfg["momentum"] * s["momentum"] + increment
        return w - s["momentum"]
    return w - increment


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("flavour,name", CASES)
def test_lazy_mode_matches_reference_and_leaves_other_rows_alone(flavour, name, use_function):
    rng = np.random.default_rng(seed(flavour, name, "lazy"))
    cfg = config(name)
    setup = Setup(flavour, cfg, random_init(rng))
    reference = setup.values()   # float32, like the variables
    apply = applier(setup, "lazy", use_function)
    for t in range(STEPS):
        indices, values = random_slices(rng)
        before = setup.values()
        written = apply(indices, values)
        setup.increment()
        after = setup.values()
        assert int(written.numpy()) == len(indices)
        untouched = np.setdiff1d(np.arange(ROWS), indices)
        for key in after:
            np.testing.assert_array_equal(after[key][untouched], before[key][untouched],
                                          err_msg=f"untouched rows of {key} changed")
        rows = {k: v[indices] for k, v in reference.items() if k != "var"}
        reference["var"][indices] = reference_rows(
            flavour, cfg, t, reference["var"][indices], rows, values)
        for k, v in rows.items():
            reference[k][indices] = v
        for key in after:
            err = rel_err(after[key], reference[key])
            record(f"lazy {flavour}-{name}", err)
            assert err <= TOL, (t, key, err)


@pytest.mark.parametrize("flavour,name", [
    pytest.param("keras", "sgd", id="keras-sgd"),
    pytest.param("keras", "adagrad_init", id="keras-adagrad"),
    pytest.param("tf_keras", "adagrad", id="tf_keras-adagrad", marks=needs_tf_keras),
])
def test_exact_equals_lazy_where_the_rule_is_row_local(flavour, name):
    """SGD without momentum and Adagrad: both modes give bit-identical results."""
    rng = np.random.default_rng(7)
    init = random_init(rng)
    a, b = Setup(flavour, config(name), init), Setup(flavour, config(name), init)
    for _ in range(STEPS):
        indices, values = random_slices(rng)
        applier(a, "lazy", False)(indices, values)
        applier(b, "exact", False)(indices, values)
        a.increment()
        b.increment()
    for key, value in a.values().items():
        np.testing.assert_array_equal(value, b.values()[key])


# Dense gradients ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", so.MODES)
@pytest.mark.parametrize("flavour,name", CASES)
def test_dense_gradient_matches_keras_dense_update(flavour, name, mode):
    rng = np.random.default_rng(seed(flavour, name, mode))
    init = random_init(rng)
    ours, theirs = Setup(flavour, config(name), init), Setup(flavour, config(name), init)
    for _ in range(3):
        dense = (0.5 * rng.normal(size=(ROWS, DIM))).astype(np.float32)
        dense[rng.permutation(ROWS)[:3]] = 0.0      # some rows without gradient
        ours.updater.apply(ours.optimizer, ours.variable, ours.slots, tf.constant(dense),
                           mode=mode)
        ours.increment()
        theirs.keras_dense_step(tf.constant(dense))
    want = theirs.values()
    for key, value in ours.values().items():
        err = rel_err(value, want[key])
        record(f"dense {flavour}-{name}", err)
        assert err <= TOL, (key, err)


# Cost: lazy apply reads only the gradient's rows -----------------------------------

def _ops_on_handle(graph, handle):
    return sorted(op.type for op in graph.get_operations()
                  if any(t is handle for t in op.inputs))


LAZY_IS_EXACT = {("keras", "sgd"), ("keras", "adagrad"), ("tf_keras", "adagrad")}


@pytest.mark.parametrize("flavour,name", [
    pytest.param("keras", n, id=f"keras-{n}") for n in ("sgd", "sgd_nesterov", "adagrad",
                                                         "adam_amsgrad",
                                                         "rmsprop_centered_momentum")
] + [
    pytest.param("tf_keras", n, id=f"tf_keras-{n}", marks=needs_tf_keras)
    for n in ("sgd", "adagrad", "adam_amsgrad", "rmsprop_centered_momentum")
])
def test_lazy_graph_gathers_and_scatters_rows_only(flavour, name):
    setup = Setup(flavour, config(name), np.zeros((ROWS, DIM), np.float32))
    modes = so.MODES if (flavour, name) in LAZY_IS_EXACT else ("lazy",)
    for mode in modes:
        variable = setup.tf_variable()

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                      tf.TensorSpec([None, DIM], tf.float32)])
        def step(indices, values):
            return setup.updater.apply(setup.optimizer, variable, setup.slots,
                                       tf.IndexedSlices(values, indices), mode=mode)

        graph = step.get_concrete_function().graph
        captured = {id(external): internal for external, internal in graph.captures}
        tables = [variable] + [so._tf_variable(s) for s in setup.slots.values()]
        for table in tables:
            internal = captured[id(table.handle)]
            kinds = _ops_on_handle(graph, internal)
            assert kinds == ["ResourceGather", "ResourceScatterUpdate"], (mode, table.name,
                                                                          kinds)


def test_exact_mode_reads_whole_variable_when_rows_without_gradient_move():
    """The contrast to the test above: exact Adam must read and write every row."""
    setup = Setup("keras", config("adam"), np.zeros((ROWS, DIM), np.float32))
    variable = setup.tf_variable()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([None, DIM], tf.float32)])
    def step(indices, values):
        return setup.updater.apply(setup.optimizer, variable, setup.slots,
                                   tf.IndexedSlices(values, indices), mode="exact")

    graph = step.get_concrete_function().graph
    captured = {id(external): internal for external, internal in graph.captures}
    kinds = _ops_on_handle(graph, captured[id(variable.handle)])
    assert "ReadVariableOp" in kinds and "AssignVariableOp" in kinds


# A table split in row shards, each updated with local indices ----------------------

@pytest.mark.parametrize("mode", so.MODES)
def test_row_shards_updated_separately_equal_whole_table(mode):
    rng = np.random.default_rng(3)
    init = random_init(rng)
    whole = Setup("keras", config("adam_amsgrad"), init)
    owner = Setup("keras", config("adam_amsgrad"), init)   # its slots seed the shards
    bounds = [(0, 5), (5, ROWS)]
    shards = []
    for lo, hi in bounds:
        shards.append((tf.Variable(init[lo:hi]),
                       {k: tf.Variable(so._tf_variable(s).numpy()[lo:hi])
                        for k, s in owner.slots.items()}))
    for _ in range(STEPS):
        indices, values = random_slices(rng)
        whole.updater.apply(whole.optimizer, whole.variable, whole.slots,
                            as_slices(indices, values), mode=mode)
        for (lo, hi), (var, slots) in zip(bounds, shards):
            mine = (indices >= lo) & (indices < hi)
            grad = tf.IndexedSlices(tf.constant(values[mine]),
                                    tf.constant(indices[mine] - lo))
            owner.updater.apply(owner.optimizer, var, slots, grad, mode=mode)
        whole.increment()
        owner.increment()
    got = {"var": np.concatenate([v.numpy() for v, _ in shards])}
    for name in owner.updater.slot_names:
        got[name] = np.concatenate([s[name].numpy() for _, s in shards])
    for key, value in whole.values().items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7)


# Slots -------------------------------------------------------------------------------

def test_slots_are_the_optimizers_own_variables_keras():
    w = keras.Variable(np.ones((4, 2), np.float32))
    optimizer = keras.optimizers.Adam(amsgrad=True)
    optimizer.build([keras.Variable(np.ones((3,), np.float32)), w])
    updater = so.row_updater(optimizer)
    assert updater.slot_names == ("momentum", "velocity", "velocity_hat")
    slots = updater.slots(optimizer, w)
    assert slots["momentum"] is optimizer._momentums[1]
    assert slots["velocity"] is optimizer._velocities[1]
    assert slots["velocity_hat"] is optimizer._velocity_hats[1]
    assert updater.slots(optimizer, w.value)["velocity"] is optimizer._velocities[1]
    assert so.row_updater(keras.optimizers.SGD()).slot_names == ()
    assert so.row_updater(keras.optimizers.RMSprop(momentum=0.1, centered=True)
                          ).slot_names == ("velocity", "momentum", "average_gradient")


@needs_tf_keras
def test_slots_are_the_optimizers_own_variables_tf_keras():
    w = tf.Variable(np.ones((4, 2), np.float32))
    optimizer = tf_keras.optimizers.Adam(amsgrad=True)
    optimizer.build([tf.Variable(np.ones((3,), np.float32)), w])
    updater = so.row_updater(optimizer)
    assert updater.slot_names == ("m", "v", "vhat")
    slots = updater.slots(optimizer, w)
    assert slots["m"] is optimizer._momentums[1]
    assert slots["vhat"] is optimizer._velocity_hats[1]
    # tf_keras keeps SGD's "m" slot even without momentum.
    assert so.row_updater(tf_keras.optimizers.SGD()).slot_names == ("m",)


def test_slots_of_a_variable_the_optimizer_was_not_built_on():
    optimizer = keras.optimizers.Adagrad()
    optimizer.build([keras.Variable(np.ones((2,), np.float32))])
    with pytest.raises(ValueError, match="build the optimizer"):
        so.row_updater(optimizer).slots(optimizer, keras.Variable(np.ones((2,), np.float32)))


def test_apply_checks_mode_slots_and_optimizer():
    setup = Setup("keras", config("adam"), np.zeros((ROWS, DIM), np.float32))
    grad = as_slices(np.array([1]), np.ones((1, DIM), np.float32))
    with pytest.raises(ValueError, match="mode"):
        setup.updater.apply(setup.optimizer, setup.variable, setup.slots, grad, mode="dense")
    with pytest.raises(ValueError, match="keys"):
        setup.updater.apply(setup.optimizer, setup.variable,
                            {"momentum": setup.slots["momentum"]}, grad)
    with pytest.raises(ValueError, match="made for Adam"):
        setup.updater.apply(keras.optimizers.SGD(), setup.variable, setup.slots, grad)


# Unsupported optimizers and settings ----------------------------------------------

class MyAdam(keras.optimizers.Adam):
    pass


UNSUPPORTED_KERAS = [
    (lambda: keras.optimizers.Nadam(), ["Nadam"]),
    (lambda: keras.optimizers.Adamax(), ["Adamax"]),
    (lambda: keras.optimizers.Ftrl(), ["Ftrl"]),
    (lambda: keras.optimizers.AdamW(), ["AdamW"]),
    (lambda: keras.optimizers.Lion(), ["Lion"]),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
     ["LossScaleOptimizer"]),
    (lambda: MyAdam(), ["MyAdam"]),
    (lambda: object(), ["object"]),
    (lambda: keras.optimizers.SGD(weight_decay=0.01), ["SGD", "weight_decay=0.01"]),
    (lambda: keras.optimizers.Adam(use_ema=True), ["Adam", "use_ema"]),
    (lambda: keras.optimizers.RMSprop(gradient_accumulation_steps=2),
     ["RMSprop", "gradient_accumulation_steps=2"]),
]
UNSUPPORTED_TF_KERAS = [
    (lambda: tf_keras.optimizers.Nadam(), ["Nadam"]),
    (lambda: tf_keras.optimizers.Adagrad(weight_decay=0.1), ["Adagrad", "weight_decay"]),
    (lambda: tf_keras.optimizers.Adam(use_ema=True), ["Adam", "use_ema"]),
    (lambda: tf_keras.optimizers.legacy.Adam(), ["Adam", "legacy",
                                                  "tf_keras.optimizers.Adam"]),
    (lambda: tf_keras.optimizers.legacy.Ftrl(), ["Ftrl"]),
]


@pytest.mark.parametrize("factory,words", UNSUPPORTED_KERAS + [
    pytest.param(f, w, marks=needs_tf_keras) for f, w in UNSUPPORTED_TF_KERAS])
def test_unsupported_optimizers_and_settings_raise(factory, words):
    with pytest.raises(so.UnsupportedOptimizerError) as info:
        so.row_updater(factory())
    message = str(info.value)
    for word in words + ["SGD/Adagrad/Adam/RMSprop", "mirrored"]:
        assert word in message, (word, message)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("factory", [
    lambda: keras.optimizers.SGD(clipnorm=1.0),
    lambda: keras.optimizers.Adam(global_clipnorm=1.0),
    lambda: keras.optimizers.RMSprop(clipvalue=0.5),
    lambda: keras.optimizers.Adam(loss_scale_factor=128.0),
    lambda: keras.optimizers.Adagrad(weight_decay=0.0),
    pytest.param(lambda: tf_keras.optimizers.Adam(clipnorm=1.0), marks=needs_tf_keras),
    pytest.param(lambda: tf_keras.optimizers.SGD(global_clipnorm=1.0), marks=needs_tf_keras),
])
def test_settings_applied_before_update_step_are_accepted(factory):
    assert isinstance(so.row_updater(factory()), so.RowUpdater)


# Docstring examples run --------------------------------------------------------------

def _examples():
    objects = [so, so.UnsupportedOptimizerError, so.row_updater, so.RowUpdater,
               so.RowUpdater.slots, so.RowUpdater.apply]
    for obj in objects:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", inspect.getdoc(obj),
                                             re.S)):
            marks = [needs_tf_keras] if "tf_keras" in block else []
            yield pytest.param(block, id=f"{getattr(obj, '__name__', obj)}-{i}", marks=marks)


@pytest.mark.parametrize("block", list(_examples()))
def test_docstring_examples_run(block, capsys):
    exec(compile(block, "<docstring>", "exec"), {})


def test_report_worst_errors():
    """Prints the worst relative errors seen above (run with -s to see them)."""
    for key in sorted(WORST):
        print(f"{key:45s} {WORST[key]:.2e}")
