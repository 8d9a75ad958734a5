"""What crosses between tasks in a step, and bfloat16 rows on the wire, on a real cluster.

Run as the chief of a 2-worker + 2-ps cluster (tests/test_wire.py), it prints a JSON
report of three cases, all on a click-through model whose Embedding layers read the
model's inputs: a user table and an item table split over both ps tasks, the item
layer used on two inputs, a masked sequence feature, float ids.

- "exact": HybridStrategy training against single-device training with dense
  gradients (relative errors per weight), and the tensors one training step sends
  between tasks (benchmarks/step_transfers.py), with `optimizer.iterations` and each
  of its copies after training.
- "bfloat16": one SGD step with `wire_dtype="bfloat16"` against the same step in
  float32 (relative error of each weight's update).
- "convergence": the training loss of 40 Adagrad steps, in float32 and in bfloat16.
- "reads": the tensors one Adam step sends between tasks (Adam reads the learning
  rate and the step count for every table it updates); "exact_reads": the same with
  `sparse_update="exact"`, whose update takes every row of each shard.
- "multi_step": two epochs of 7 batches with `steps_per_execution=3` (calls of 3, 3
  and 1 steps) against single-device training, and the tensors its calls send.
- "reading_ahead": the same on the dataset repeated, two epochs of 6 steps, each step's
  push carrying the next step's lookups (communication/rows_ahead.py); "bad_id_ahead":
  an id out of range in a batch whose lookup rides with the step before;
  "reading_ahead_variants": the same with AdamW in exact mode, l2-penalized tables and a
  short batch inside a call; "tied_ahead": decoder_lm's tied token table, which moves to
  mirrored after its first step, reading ahead meanwhile.
- "examples": two models of keras_examples, small, each trained 20 SGD steps in
  float32 and with bfloat16 rows from the same weights: decoder_lm's decoder, whose
  token table is its output projection (a dense gradient: mirrored after the first
  step), and recommender's model with an l2 penalty on every table (computed on the
  tables' ps). Each reports its first step's update against float32's, its losses,
  and where its tables ended and why.

    python -m hybrid_strategy.launch --workers 2 --ps 2 -- python tests/wire_scenario.py
"""

import contextlib
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import hybrid_strategy
from benchmarks import step_transfers
from hybrid_strategy.communication import rows_ahead
from keras_examples import decoder_lm, language_model, recommender

USERS, ITEMS, TAGS, BUCKETS, TAGS_PER_EXAMPLE = 300, 200, 50, 10, 3
GLOBAL_BATCH = 32
MIN_SHARD_BYTES = 1024  # splits the user and item tables over both ps tasks


def make_data(steps, seed=0):
    rng = np.random.default_rng(seed)
    n = steps * GLOBAL_BATCH

    def skewed(size, shape=(n,)):
        return np.minimum(rng.zipf(1.3, size=shape) - 1, size - 1).astype("int32")

    x = {"user": skewed(USERS), "item": skewed(ITEMS), "seen": skewed(ITEMS),
         # 0 is padding (masked), but for the first tag: a mean over no tag is NaN.
         "tags": np.maximum(skewed(TAGS, (n, TAGS_PER_EXAMPLE)), [1, 0, 0]).astype("int32"),
         "bucket": skewed(BUCKETS).astype("float32"),
         "dense": rng.normal(size=(n, 2)).astype("float32")}
    y = np.sin(x["user"] / 30.0) + np.cos(x["item"] / 20.0) + 0.5 * x["dense"][:, 0]
    return x, y[:, None].astype("float32")


def build_model(l2=0.0):
    penalty = keras.regularizers.L2(l2) if l2 else None
    inputs = {name: keras.Input((), dtype="int32", name=name)
              for name in ("user", "item", "seen")}
    inputs["tags"] = keras.Input((TAGS_PER_EXAMPLE,), dtype="int32", name="tags")
    inputs["bucket"] = keras.Input((), dtype="float32", name="bucket")
    inputs["dense"] = keras.Input((2,), name="dense")
    items = keras.layers.Embedding(ITEMS, 4, name="item_embedding",
                                   embeddings_regularizer=penalty)
    tags = keras.layers.Embedding(TAGS, 4, mask_zero=True, name="tag_embedding")
    parts = [keras.layers.Embedding(USERS, 8, name="user_embedding",
                                    embeddings_regularizer=penalty)(inputs["user"]),
             items(inputs["item"]), items(inputs["seen"]),
             keras.layers.GlobalAveragePooling1D()(tags(inputs["tags"])),
             keras.layers.Embedding(BUCKETS, 2, name="bucket_embedding")(inputs["bucket"]),
             inputs["dense"]]
    x = keras.layers.Concatenate()(parts)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(x))


def initial_weights():
    keras.utils.set_random_seed(1)
    return build_model().get_weights()


def dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def trained(weights, make_optimizer, x, y, epochs=1, steps_per_execution=1, endless=False,
            l2=0.0, **strategy_options):
    """(model, training losses) after `epochs` on (x, y) under HybridStrategy; `endless`:
    from the dataset repeated, `steps_per_epoch` = the whole batches in (x, y)."""
    strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES,
                                              **strategy_options)
    with strategy.scope():
        model = build_model(l2)
        model.set_weights(weights)
        model.compile(optimizer=make_optimizer(), loss="mse",
                      steps_per_execution=steps_per_execution)
    losses = []
    data, steps = dataset(x, y), None
    if endless:
        data, steps = data.repeat(), len(y) // GLOBAL_BATCH
    model.fit(data, epochs=epochs, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[
        keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))])
    return model, losses


def single_device(weights, optimizer, x, y, epochs=1, endless=False, l2=0.0):
    """Training on one device with dense gradients (each row once per step), on the
    batches `trained` takes."""
    model = build_model(l2)
    model.set_weights(weights)
    variables = model.trainable_variables
    starts = range(0, len(y), GLOBAL_BATCH)
    steps = len(y) // GLOBAL_BATCH if endless else len(starts)
    for step in range(epochs * steps):
        start = starts[step % len(starts)]
        batch = {k: v[start:start + GLOBAL_BATCH] for k, v in x.items()}
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(batch) - y[start:start + GLOBAL_BATCH]))
            loss += sum(model.losses)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients([(tf.convert_to_tensor(g), v)
                                   for g, v in zip(grads, variables)])
    return model


def relative_errors(model, actual, expected):
    return {w.path: float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 0.01))
            for w, a, e in zip(model.weights, actual, expected)}


def exact_case(steps=6, epochs=1, steps_per_execution=1, endless=False):
    x, y = make_data(steps)
    weights = initial_weights()
    reference = single_device(weights, keras.optimizers.Adagrad(0.1), x, y, epochs)
    with step_transfers.RunMetadata() as metadata:
        model, losses = trained(weights, lambda: keras.optimizers.Adagrad(0.1), x, y,
                                epochs, steps_per_execution, endless)
    iterations = model.optimizer.iterations
    return {
        "relative_errors": relative_errors(model, model.get_weights(),
                                           reference.get_weights()),
        "transfers": step_transfers.count_transfers(metadata.result, names=True),
        "iterations": int(iterations.numpy()),
        "iteration_copies": [int(v.numpy()) for v in iterations.value.values],
        "calls": len(losses),
    }


def bad_id_ahead_case(steps_per_execution=3):
    """An id out of range in the second batch of a call whose steps read ahead: the
    error's message."""
    x, y = make_data(steps_per_execution)
    x["user"][GLOBAL_BATCH + 3] = USERS + 7
    try:
        trained(initial_weights(), lambda: keras.optimizers.SGD(0.1), x, y,
                steps_per_execution=steps_per_execution, endless=True)
    except tf.errors.InvalidArgumentError as error:
        return {"error": error.message}
    return {"error": None}


@contextlib.contextmanager
def steps_reading_ahead():
    """A list that counts the steps traced whose push carried the next step's ids."""
    traced, send_ids = [], rows_ahead.Ahead.send_ids

    def counted(self, push, devices):
        sent = send_ids(self, push, devices)
        if sent:
            traced.append(sent)
        return sent

    rows_ahead.Ahead.send_ids = counted
    try:
        yield traced
    finally:
        rows_ahead.Ahead.send_ids = send_ids


def reading_ahead_variants_case(steps=6, short=22, l2=0.01):
    """Two epochs of `steps` from the dataset repeated, 3 steps per call: AdamW in exact
    mode on l2-penalized tables, the data's last batch `short` examples short, so that a
    short batch falls inside a call and shifts the second epoch's batches."""
    x, y = make_data(steps + 1)
    kept = (steps + 1) * GLOBAL_BATCH - short
    x, y = {k: v[:kept] for k, v in x.items()}, y[:kept]
    weights = initial_weights()

    def adamw():
        return keras.optimizers.AdamW(0.01, weight_decay=0.05)

    reference = single_device(weights, adamw(), x, y, epochs=2, endless=True, l2=l2)
    with steps_reading_ahead() as traced:
        model, losses = trained(weights, adamw, x, y, epochs=2, steps_per_execution=3,
                                endless=True, l2=l2, sparse_update="exact")
    return {"relative_errors": relative_errors(model, model.get_weights(),
                                               reference.get_weights()),
            "steps_reading_ahead": len(traced), "calls": len(losses)}


def tied_ahead_case(steps=6):
    """decoder_lm's tied token table (dense gradient: mirrored after its first step) from
    an endless dataset, 3 steps per call, SGD, against one device."""
    build, loss, make_arrays = EXAMPLES["tied_decoder"]
    tokens, targets = make_arrays(steps)
    keras.utils.set_random_seed(1)
    reference = build()
    weights = reference.get_weights()
    optimizer = keras.optimizers.SGD(0.5)
    for _ in range(2):
        for start in range(0, len(tokens), GLOBAL_BATCH):
            with tf.GradientTape() as tape:
                value = loss(targets[start:start + GLOBAL_BATCH],
                             reference(tokens[start:start + GLOBAL_BATCH]))
            grads = tape.gradient(value, reference.trainable_variables)
            optimizer.apply_gradients([(tf.convert_to_tensor(g), v) for g, v in
                                       zip(grads, reference.trainable_variables)])
    # Summed on a ps, the dense part brings the next step's rows back with it.
    strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES, dense_sum="ps")
    with strategy.scope():
        model = build()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, steps_per_execution=3)
    data = tf.data.Dataset.from_tensor_slices((tokens, targets)).batch(GLOBAL_BATCH).repeat()
    with steps_reading_ahead() as traced:
        model.fit(data, epochs=2, steps_per_epoch=steps, verbose=0, shuffle=False)
    return {"relative_errors": relative_errors(model, model.get_weights(),
                                               reference.get_weights()),
            "steps_reading_ahead": len(traced),
            "placement": {r.path: [str(r.placement), r.reason] for r in strategy.placement}}


def bfloat16_case():
    x, y = make_data(1, seed=2)
    weights = initial_weights()
    updates = {}
    for wire_dtype in (None, "bfloat16"):
        model, _ = trained(weights, lambda: keras.optimizers.SGD(0.5), x, y,
                           wire_dtype=wire_dtype)
        updates[wire_dtype] = [a - w for a, w in zip(model.get_weights(), weights)]
    return {"update_errors": relative_errors(model, updates["bfloat16"], updates[None])}


def reads_case(sparse_update="lazy"):
    x, y = make_data(1, seed=4)
    with step_transfers.RunMetadata() as metadata:
        trained(initial_weights(), lambda: keras.optimizers.Adam(0.01), x, y,
                sparse_update=sparse_update)
    return {"transfers": step_transfers.count_transfers(metadata.result, names=True)}


def convergence_case():
    x, y = make_data(40, seed=3)
    weights = initial_weights()
    return {str(wire_dtype): trained(weights, lambda: keras.optimizers.Adagrad(0.1), x, y,
                                     wire_dtype=wire_dtype)[1]
            for wire_dtype in (None, "bfloat16")}


# name -> (the model, built, its loss, its data for `steps` global batches)
EXAMPLE_STEPS = 20
EXAMPLES = {
    "tied_decoder": (
        lambda: decoder_lm.build_model(vocab=256, embedding_dim=16, seq_len=8, num_heads=2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda steps: language_model.make_arrays(steps * GLOBAL_BATCH, vocab=256, seq_len=8)),
    "l2_recommender": (
        lambda: recommender.build_model(table_sizes=(300, 100), embedding_dim=8,
                                        hidden_units=(16,), num_dense=4, l2=1e-3),
        "binary_crossentropy",
        lambda steps: recommender.make_arrays(steps * GLOBAL_BATCH, (300, 100), num_dense=4)),
}


def example_case(build, loss, make_arrays):
    """EXAMPLE_STEPS SGD steps in float32 and with bfloat16 rows, from the same weights."""
    x, y = make_arrays(EXAMPLE_STEPS)
    keras.utils.set_random_seed(1)
    weights = build().get_weights()
    out = {"losses": {}, "placement": {}, "gradient_types": {}}
    first_updates = {}
    for wire_dtype in (None, "bfloat16"):
        strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=MIN_SHARD_BYTES,
                                                  wire_dtype=wire_dtype)
        with strategy.scope():
            model = build()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
        losses = out["losses"][str(wire_dtype)] = []

        def batch_end(batch, logs, model=model, wire_dtype=wire_dtype, losses=losses):
            losses.append(float(logs["loss"]))
            if batch == 0:
                first_updates[wire_dtype] = [a - w for a, w in zip(model.get_weights(),
                                                                   weights)]

        model.fit(dataset(x, y), verbose=0, shuffle=False, callbacks=[
            keras.callbacks.LambdaCallback(on_train_batch_end=batch_end)])
        out["placement"][str(wire_dtype)] = {r.path: [str(r.placement), r.reason]
                                             for r in strategy.placement}
        out["gradient_types"][str(wire_dtype)] = strategy.gradient_types
    out["update_errors"] = relative_errors(model, first_updates["bfloat16"],
                                           first_updates[None])
    return out


def main():
    # The strategy connects this process to the cluster: before any variable.
    hybrid_strategy.HybridStrategy()
    report = {"exact": exact_case(), "bfloat16": bfloat16_case(),
              "convergence": convergence_case(), "reads": reads_case(),
              "exact_reads": reads_case("exact"),
              "multi_step": exact_case(steps=7, epochs=2, steps_per_execution=3),
              "reading_ahead": exact_case(steps=6, epochs=2, steps_per_execution=3,
                                          endless=True),
              "bad_id_ahead": bad_id_ahead_case(),
              "reading_ahead_variants": reading_ahead_variants_case(),
              "tied_ahead": tied_ahead_case(),
              "examples": {name: example_case(*spec) for name, spec in EXAMPLES.items()}}
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
