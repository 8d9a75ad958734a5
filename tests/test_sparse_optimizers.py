"""Every Keras optimizer on a PS table split in three shards, in one process, both modes.

Each case trains an Embedding (16 x 3, its table dealt over 3 shards) and a Dense
layer for 4 steps whose batches repeat ids and leave rows out, under
HybridStrategy on this machine, with its optimizer's slots sharded like the table,
and compares the table, the table's slots and the Dense weights with references on
one device without any strategy:
- exact mode: the optimizer's own update with dense gradients (each row once per
  step, summed);
- lazy mode: the documented rule, the optimizer's own update applied to a variable
  holding only the step's rows (and slot rows), the other rows kept, at the global
  step; for Adafactor and Muon's own update, whose statistics span the whole
  table, the exact update.
Error: max |actual - expected| over max(max |expected|, 0.01), per tensor; 1e-5.
"""

import inspect
import re
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import hybrid_strategy
import optimizer_references as references
from hybrid_strategy.tables import sparse_optimizers as so
from hybrid_strategy.tables import table as table_lib
from optimizer_references import error, scaled, values

ROWS, DIM, SEQ, BATCH, STEPS, SHARDS = 16, 3, 3, 4, 4, 3
TOLERANCE = 1e-5
K3, TFK = keras.optimizers, tf_keras.optimizers

# name -> (flavour, optimizer factory, the table also read whole: a dense gradient)
CASES = {
    "sgd": ("keras", lambda: K3.SGD(0.1), False),
    "sgd_nesterov": ("keras", lambda: K3.SGD(0.05, momentum=0.9, nesterov=True), False),
    # Adam divides by sqrt(v) + epsilon: with 1e-7, a row whose summed gradient
    # nearly cancels turns float summation order into 1e-5 differences.
    "adam_amsgrad": ("keras", lambda: K3.Adam(0.02, epsilon=1e-4, amsgrad=True), False),
    "adam_schedule": ("keras", lambda: K3.Adam(K3.schedules.ExponentialDecay(0.05, 2, 0.5),
                                               epsilon=1e-4), False),
    "adam_tied": ("keras", lambda: K3.Adam(0.02, epsilon=1e-4), True),
    "adamw": ("keras", lambda: K3.AdamW(0.02, weight_decay=0.2, epsilon=1e-4), False),
    "adagrad": ("keras", lambda: K3.Adagrad(0.1, initial_accumulator_value=0.2,
                                            weight_decay=0.1), False),
    "rmsprop": ("keras", lambda: K3.RMSprop(0.01, momentum=0.5, centered=True,
                                            epsilon=1e-4), False),
    "adadelta": ("keras", lambda: K3.Adadelta(1.0, epsilon=1e-4), False),
    "adamax": ("keras", lambda: K3.Adamax(0.02), False),
    "nadam": ("keras", lambda: K3.Nadam(0.02, epsilon=1e-4), False),
    "ftrl": ("keras", lambda: K3.Ftrl(0.1, l1_regularization_strength=0.01,
                                      l2_regularization_strength=0.01,
                                      l2_shrinkage_regularization_strength=0.01,
                                      beta=0.1), False),
    "lion": ("keras", lambda: K3.Lion(0.01, weight_decay=0.1), False),
    "adafactor": ("keras", lambda: K3.Adafactor(0.1), False),
    "lamb": ("keras", lambda: K3.Lamb(0.05, epsilon=1e-4), False),
    "muon": ("keras", lambda: K3.Muon(0.02, epsilon=1e-4), False),
    "muon_own": ("keras", lambda: K3.Muon(0.02, exclude_embeddings=False), False),
    "schedule_free": ("keras", lambda: K3.ScheduleFreeAdamW(0.02, warmup_steps=2,
                                                             weight_decay=0.1,
                                                             epsilon=1e-4), False),
    "loss_scale": ("keras", lambda: K3.LossScaleOptimizer(K3.Adam(0.02, epsilon=1e-4)),
                   False),
    "multi": ("keras", lambda: K3.MultiOptimizer(K3.OptimizerMap(
        K3.Adam(0.02, epsilon=1e-4), {".*embedding.*": K3.Ftrl(0.2)})), False),
    "tf_keras_sgd": ("tf_keras", lambda: TFK.SGD(0.05, momentum=0.9), False),
    "tf_keras_adam": ("tf_keras", lambda: TFK.Adam(0.02, epsilon=1e-4, amsgrad=True), False),
    "tf_keras_adam_tied": ("tf_keras", lambda: TFK.Adam(0.02, epsilon=1e-4), True),
    "tf_keras_adamw": ("tf_keras", lambda: TFK.AdamW(0.02, weight_decay=0.2,
                                                     epsilon=1e-4), False),
    "tf_keras_adagrad": ("tf_keras", lambda: TFK.Adagrad(0.1), False),
    "tf_keras_rmsprop": ("tf_keras", lambda: TFK.RMSprop(0.01, momentum=0.5, centered=True,
                                                         epsilon=1e-4), False),
    "tf_keras_adadelta": ("tf_keras", lambda: TFK.Adadelta(1.0, epsilon=1e-4), False),
    "tf_keras_adamax": ("tf_keras", lambda: TFK.Adamax(0.02), False),
    "tf_keras_ftrl": ("tf_keras", lambda: TFK.Ftrl(0.1, l1_regularization_strength=0.01,
                                                   l2_shrinkage_regularization_strength=0.01),
                      False),
    "tf_keras_lion": ("tf_keras", lambda: TFK.Lion(0.01), False),
    "tf_keras_adafactor": ("tf_keras", lambda: TFK.Adafactor(0.1), False),
}
# Their statistics span the whole table: lazy mode is the exact update.
WHOLE_TABLE = ("adafactor", "muon_own", "tf_keras_adafactor")


@pytest.fixture(autouse=True)
def one_machine(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


@pytest.fixture(scope="module", params=so.MODES)
def strategy(request):
    return hybrid_strategy.HybridStrategy(table_shards={"embedding*": SHARDS},
                                          sparse_update=request.param)


def batches():
    rng = np.random.default_rng(7)
    ids = np.minimum(rng.zipf(1.4, size=(STEPS, BATCH, SEQ)) - 1, ROWS - 1).astype("int32")
    targets = rng.normal(size=(STEPS, BATCH, 1)).astype("float32")
    return ids, targets


class Model:
    """An Embedding and a Dense layer of one flavour, and their loss."""

    def __init__(self, flavour, tied, weights=None):
        layers = (keras if flavour == "keras" else tf_keras).layers
        self.embedding = layers.Embedding(ROWS, DIM)
        self.dense = layers.Dense(1)
        self.embedding.build((None, SEQ))
        self.dense.build((None, SEQ * DIM))
        self.tied = tied
        self.variables = [self.embedding.embeddings, self.dense.kernel, self.dense.bias]
        if weights is not None:
            for variable, value in zip(self.variables, weights):
                variable.assign(value)

    def loss(self, ids, targets):
        x = tf.reshape(self.embedding(ids), (-1, SEQ * DIM))
        loss = tf.reduce_sum(tf.tanh(self.dense(x)) * targets)
        if self.tied:
            table = tf.convert_to_tensor(self.embedding.embeddings)
            loss += 0.1 * tf.reduce_sum(tf.tanh(tf.matmul(x[:, :DIM], table, transpose_b=True)))
        return loss


def table_slots(optimizer):
    """The optimizer's variables shaped like the table, in its own order."""
    return [v for v in optimizer.variables if tuple(v.shape) == (ROWS, DIM)]


def distributed(strategy, flavour, factory, tied, weights=None):
    """(model, optimizer, traced training step) under `strategy`."""
    with strategy.scope():
        model = Model(flavour, tied, weights)
        optimizer = factory()
        optimizer.build(model.variables)

    @tf.function
    def step(ids, targets):
        def replica_step(ids, targets):
            with tf.GradientTape() as tape:
                loss = scaled(optimizer, model.loss(ids, targets))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.variables),
                                          model.variables))
        strategy.run(replica_step, args=(ids, targets))

    return model, optimizer, step


def train_reference(flavour, factory, tied, weights, ids, targets, lazy):
    model = Model(flavour, tied, weights)
    optimizers = references.train(model.variables, model.variables[:1],
                                  lambda s: model.loss(ids[s], targets[s]), range(STEPS),
                                  factory, lazy)
    return model, optimizers[id(model.variables[0])]


@pytest.mark.parametrize("name", list(CASES))
def test_every_optimizer_trains_a_sharded_table_as_documented(strategy, name):
    flavour, factory, tied = CASES[name]
    ids, targets = batches()
    weights = [values(v) for v in Model(flavour, tied).variables]
    lazy = strategy.extended.topology.sparse_update == "lazy" and name not in WHOLE_TABLE
    model, optimizer, step = distributed(strategy, flavour, factory, tied, weights)
    for s in range(STEPS):
        step(ids[s], targets[s])
    reference, reference_optimizer = train_reference(flavour, factory, tied, weights, ids,
                                                     targets, lazy)
    table = table_lib.table_behind(model.embedding.embeddings)
    assert table.num_shards == SHARDS
    slots = table_slots(optimizer)
    assert all(table_lib.table_behind(s).num_shards == SHARDS for s in slots)
    assert table_lib.table_behind(model.dense.kernel) is None  # mirrored
    expected = [values(v) for v in reference.variables + table_slots(reference_optimizer)]
    actual = [values(v) for v in model.variables + slots]
    assert len(actual) == len(expected)
    moved = error(actual[0], weights[0])
    assert moved > 1e-3, f"{name}: the table did not train"
    errors = [error(a, e) for a, e in zip(actual, expected)]
    assert max(errors) <= TOLERANCE, (name, errors)


def test_lazy_steps_move_only_the_steps_rows(strategy):
    ids, targets = batches()
    model, optimizer, step = distributed(strategy, *CASES["adamw"])
    step(ids[0], targets[0])
    before = [values(v) for v in [model.variables[0]] + table_slots(optimizer)]
    step(ids[1], targets[1])
    after = [values(v) for v in [model.variables[0]] + table_slots(optimizer)]
    # Rows with moments from the first step but no gradient in the second.
    resting = np.setdiff1d(ids[0], ids[1])
    assert len(resting) and len(after) == 3
    for b, a in zip(before, after):
        if strategy.extended.topology.sparse_update == "lazy":
            untouched = np.setdiff1d(np.arange(ROWS), ids[1])
            np.testing.assert_array_equal(a[untouched], b[untouched])
        else:
            assert np.all(a[resting] != b[resting])
    # What the step does to each shard's variable: rows gathered and scattered
    # (lazy), or every row read and assigned (exact).
    graph = step.get_concrete_function(ids[0], targets[0]).graph
    captured = {id(external): internal for external, internal in graph.captures}
    ops = set()
    for shard in table_lib.table_behind(model.variables[0]).shards:
        handle = captured[id(shard.handle)]
        ops |= {op.type for op in graph.get_operations()
                if any(t is handle for t in op.inputs)}
    if strategy.extended.topology.sparse_update == "lazy":
        assert ops == {"ResourceGather", "ResourceScatterUpdate"}
    else:
        assert {"ReadVariableOp", "AssignVariableOp"} <= ops


def test_xla_stays_off_until_the_last_rule_on_rows_ends():
    # tf_keras reads jit_compile from the optimizer while it traces an update: with
    # several workers' steps traced at once, two rules on rows overlap.
    optimizer = types.SimpleNamespace(jit_compile=True)
    first, second = so._without_xla(optimizer), so._without_xla(optimizer)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert optimizer.jit_compile is False
    second.__exit__(None, None, None)
    assert optimizer.jit_compile is True


def test_couplings_of_the_shipped_optimizers():
    table = keras.Variable(np.zeros((ROWS, DIM), "float32"), name="embeddings")
    kernel = keras.Variable(np.zeros((ROWS, DIM), "float32"), name="kernel")
    assert so.coupling(K3.SGD(), table) == so.coupling(K3.Adagrad(), table) == so.ROWS_STILL
    assert so.coupling(TFK.SGD(), table) == so.ROWS  # tf_keras keeps a moving slot
    assert so.coupling(K3.SGD(momentum=0.5), table) == so.coupling(K3.AdamW(), table) == so.ROWS
    assert so.coupling(K3.Lamb(), table) == so.ROWS_TOGETHER
    assert so.coupling(K3.Adafactor(), table) == so.coupling(TFK.Adafactor(), table) == so.WHOLE
    assert so.coupling(K3.Muon(), table) == so.ROWS          # AdamW's step for embeddings
    assert so.coupling(K3.Muon(), kernel) == so.WHOLE


class MyAdam(K3.Adam):
    """Keeps Adam's update rule."""


class MyRule(K3.SGD):
    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, gradient * learning_rate * 2)


def words_model(flavour, optimizer, **compile_kwargs):
    """A 10-row table on this machine's PS and a Dense layer, compiled with `optimizer`."""
    k = keras if flavour == "keras" else tf_keras
    with hybrid_strategy.HybridStrategy().scope():
        model = k.Sequential([k.Input(shape=(2,), dtype="int32"),
                              k.layers.Embedding(10, 2, name="words"),
                              k.layers.Flatten(), k.layers.Dense(1, name="out")],
                             name="words_model")
        model.compile(optimizer=optimizer(), loss="mse", **compile_kwargs)
    return model


REFUSED = [
    ("keras", lambda: K3.Adam(use_ema=True), "use_ema=True"),
    ("keras", lambda: K3.Adam(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    ("keras", lambda: MyRule(0.1), "not one shipped with Keras"),
    ("keras", lambda: K3.LossScaleOptimizer(K3.SGD(use_ema=True)), "use_ema=True"),
    ("keras", lambda: K3.MultiOptimizer(K3.OptimizerMap(
        K3.SGD(), {".*words.*": K3.Adagrad(use_ema=True)})), "use_ema=True"),
    ("tf_keras", lambda: TFK.Nadam(), "counts its momentum schedule in Python"),
    ("tf_keras", lambda: TFK.legacy.Adam(), "tf_keras.optimizers.Adam (the non-legacy"),
    ("tf_keras", lambda: TFK.Adam(use_ema=True), "use_ema=True"),
]


@pytest.mark.parametrize("flavour,optimizer,reason", REFUSED,
                         ids=[f"{f}-{r}" for f, _, r in REFUSED])
def test_unsupported_optimizers_are_refused_before_a_step_is_traced(flavour, optimizer,
                                                                      reason):
    """At compile, the model having its variables; else when fit builds the optimizer."""
    with pytest.raises(hybrid_strategy.UnsupportedOptimizerError) as refused:
        words_model(flavour, optimizer)
    message = str(refused.value)
    for words in ("PS table 'words_model/words/embeddings'" if flavour == "keras"
                  else "PS table 'words/embeddings'", reason,
                  "placement_overrides={'"):
        assert words in message, message


def subclassed_words_model(flavour):
    """A subclassed model of `flavour` that makes its variables when it is built."""
    k = keras if flavour == "keras" else tf_keras

    class Words(k.Model):
        def __init__(self):
            super().__init__(name="words_model")
            self.words = k.layers.Embedding(10, 2, name="words")
            self.out = k.layers.Dense(1, name="out")

        def call(self, ids):
            return self.out(tf.reshape(self.words(ids), (-1, 4)))

    return Words()


@pytest.mark.parametrize("flavour,optimizer", [("keras", lambda: K3.Adam(use_ema=True)),
                                               ("tf_keras", lambda: TFK.Nadam())])
def test_an_unbuilt_model_is_refused_when_its_optimizer_is_built(flavour, optimizer):
    """Keras 3 builds it before it traces a step, tf_keras while it traces one: the
    error keeps its type either way."""
    with hybrid_strategy.HybridStrategy().scope():
        model = subclassed_words_model(flavour)
        model.compile(optimizer=optimizer(), loss="mse")
    with pytest.raises(hybrid_strategy.UnsupportedOptimizerError) as refused:
        model.fit(np.array([[1, 2]], "int32"), np.zeros((1, 1), "float32"), verbose=0)
    assert "PS table 'words_model/words/embeddings' with" in str(refused.value)
    assert ("in user code" in str(refused.value)) == (flavour == "tf_keras")


@pytest.mark.parametrize("optimizer", [
    lambda: MyAdam(0.1),
    lambda: K3.MultiOptimizer(K3.OptimizerMap(K3.SGD(use_ema=True),
                                              {".*words.*": K3.Adagrad()})),
])
def test_subclasses_keeping_a_shipped_rule_and_dense_only_settings_are_accepted(optimizer):
    model = words_model("keras", optimizer)
    model.fit(np.array([[1, 2], [3, 3]], "int32"), np.ones((2, 1), "float32"), verbose=0)


def _examples():
    objects = [so, so.UnsupportedOptimizerError, so.check, so.coupling, so.RowsView]
    for obj in objects:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", inspect.getdoc(obj),
                                             re.S)):
            yield pytest.param(block, id=f"{getattr(obj, '__name__', obj)}-{i}")


@pytest.mark.parametrize("block", list(_examples()))
def test_docstring_examples_run(block):
    exec(compile(block, "<docstring>", "exec"), {})
