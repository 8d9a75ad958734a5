"""Edge cases of HybridStrategy training, run as one program; prints a JSON report.

- clipping: `clipnorm`, `global_clipnorm` and `clipvalue` against single-device
  training with dense gradients on the same global batches;
- bad ids: negative, too large and fractional ids, with the table on the PS or
  mirrored;
- an empty dataset;
- Keras features that check the strategy's or the weights' type: BackupAndRestore
  (interrupted, then resumed), h5 weights and models, mixed_float16 (its final
  weights are compared with `--mirrored-reference`, the same training under
  tf.distribute.MirroredStrategy over two local CPUs).
Works with Keras 3 and, under TF_USE_LEGACY_KERAS=1, with tf_keras (`tf.keras`):

    python -m hybrid_strategy.launch --workers 2 --ps 1 -- python tests/edge_scenario.py OUT
    python tests/edge_scenario.py --mirrored-reference OUT
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow as tf

import scenario

keras = scenario.keras
GLOBAL_BATCH = scenario.GLOBAL_BATCH
CLIPPING = {"clipnorm": 0.05, "global_clipnorm": 0.05, "clipvalue": 0.002}


def sgd(**clip):
    return keras.optimizers.SGD(0.5, **clip)


def dataset(ids, y):
    return tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)


def trained(strategy, weights, optimizer, ids, y, epochs=1, callbacks=()):
    with strategy.scope():
        model = scenario.build_model()
        model.set_weights(weights)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(dataset(ids, y), epochs=epochs, verbose=0,
              callbacks=list(callbacks))
    return model


def single_device(weights, optimizer, ids, y):
    """Single-device training with dense gradients, batch after batch: the exact step."""
    model = scenario.build_model()
    model.set_weights(weights)
    variables = model.trainable_variables
    for start in range(0, len(ids), GLOBAL_BATCH):
        x, t = ids[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(
            [(tf.convert_to_tensor(g), v) for g, v in zip(grads, variables)])
    return model


def max_error(actual, expected):
    return max(scenario.relative_errors(actual.get_weights(), expected.get_weights()))


def error_of(run):
    """The message of the exception `run()` raises, or None."""
    try:
        run()
    except Exception as error:  # pylint: disable=broad-except
        return f"{type(error).__name__}: {error}"
    return None


def clipping_case(strategy, kind):
    ids, y = scenario.make_data()
    weights = scenario.initial_weights("plain")
    clip = {kind: CLIPPING[kind]}
    model = trained(strategy, weights, sgd(**clip), ids, y)
    clipped = single_device(weights, sgd(**clip), ids, y)
    unclipped = single_device(weights, sgd(), ids, y)
    return {"relative_error": max_error(model, clipped),
            # How far clipping moves the result: the comparison above can fail.
            "clipping_effect": max_error(unclipped, clipped),
            "sparse_gradient": strategy.gradient_types.get("embedding/embeddings")}


def bad_ids_case(strategy, on_ps):
    with strategy.scope():
        model = scenario.build_model()
        model.compile(optimizer=sgd(), loss="mse")
        inputs = keras.Input(shape=(scenario.SEQ,), dtype="float32")
        embedding = keras.layers.Embedding(scenario.VOCAB, scenario.DIM, name="float_ids")
        float_model = keras.Model(inputs, embedding(inputs))
    ids = np.zeros((4, scenario.SEQ), "int32")
    out = {}
    for name, bad in (("negative", -1), ("too_large", scenario.VOCAB)):
        wrong = ids.copy()
        wrong[1, 2] = bad
        out[f"{name}_predict"] = error_of(lambda x=wrong: model.predict(x, verbose=0))
        out[f"{name}_fit"] = error_of(lambda x=wrong: model.fit(
            x, np.zeros((4, 1), "float32"), batch_size=4, verbose=0))
    whole = np.arange(4 * scenario.SEQ).reshape(4, scenario.SEQ).astype("float32")
    out["fractional"] = error_of(lambda: float_model.predict(whole + 0.5, verbose=0))
    expected = embedding.get_weights()[0][whole.astype("int64")]
    out["whole_floats_error"] = float(np.max(np.abs(
        float_model.predict(whole, verbose=0) - expected)))
    if on_ps:
        table = scenario.raw_variable(model.get_layer("embedding").embeddings)
        out["lookup_float"] = error_of(
            lambda: tf.nn.embedding_lookup(table, tf.constant([0.5])))
    return out


def empty_dataset_case(strategy):
    weights = scenario.initial_weights("plain")
    ids, y = scenario.make_data(GLOBAL_BATCH)
    return error_of(lambda: trained(strategy, weights, sgd(), ids[:0], y[:0]))


class _Interrupt(keras.callbacks.Callback):
    """Stops training at the end of an epoch, as a lost machine would."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def backup_case(strategy, out_dir):
    weights = scenario.initial_weights("plain")
    ids, y = scenario.make_data()
    whole = trained(strategy, weights, sgd(), ids, y, epochs=3)
    backup_dir = os.path.join(out_dir, "backup")
    interrupted = error_of(lambda: trained(
        strategy, weights, sgd(), ids, y, epochs=3,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir), _Interrupt(1)]))
    epochs_run = []
    resumed = trained(strategy, weights, sgd(), ids, y, epochs=3, callbacks=[
        keras.callbacks.BackupAndRestore(backup_dir),
        keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_run.append(e))])
    return {"interrupted": interrupted, "epochs_run_after_restore": epochs_run,
            "relative_error": max_error(resumed, whole)}


def h5_case(strategy, out_dir):
    weights = scenario.initial_weights("plain")
    ids, y = scenario.make_data()
    model = trained(strategy, weights, sgd(), ids, y)
    weights_path = os.path.join(out_dir, "model.weights.h5")
    model.save_weights(weights_path)
    with strategy.scope():
        loaded = scenario.build_model()
    loaded.load_weights(weights_path)
    model_path = os.path.join(out_dir, "model.h5")
    model.save(model_path)
    reloaded = keras.models.load_model(model_path, compile=False)
    # The reloaded model predicts on this process's device, on the whole batch: so does
    # the trained model's copy it is held against. The cluster's predictions split the
    # batch over the replicas, whose matmuls may round apart by the CPU's instruction set.
    on_one_device = scenario.build_model()
    on_one_device.set_weights(model.get_weights())
    held_out = scenario.make_data(GLOBAL_BATCH, seed=5)[0]
    return {"weights_error": max_error(loaded, model),
            "model_weights_error": max_error(reloaded, model),
            "model_predict_error": float(np.max(np.abs(
                reloaded.predict(held_out, verbose=0)
                - on_one_device.predict(held_out, verbose=0))))}


def mixed_precision_weights(strategy):
    """Trains with mixed_float16 under `strategy`; returns the final weights."""
    weights = scenario.initial_weights("plain")
    ids, y = scenario.make_data()
    with strategy.scope():
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = trained(strategy, weights, keras.optimizers.SGD(0.5), ids, y)
            policy = {"compute_dtype": str(model.get_layer("hidden").compute_dtype),
                      "optimizer": type(model.optimizer).__name__}
        finally:
            keras.mixed_precision.set_global_policy("float32")
    return [w.tolist() for w in model.get_weights()], policy


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--mirrored-reference", action="store_true",
                        help="train mixed_float16 under MirroredStrategy on two local CPUs")
    args = parser.parse_args(argv)
    if args.mirrored_reference:
        strategy = tf.distribute.MirroredStrategy(scenario.local_cpu_replicas(2))
        weights, policy = mixed_precision_weights(strategy)
        json.dump({"mixed_precision_weights": weights, "policy": policy}, sys.stdout)
        sys.stdout.write("\n")
        return

    import hybrid_strategy

    # Two shards of the table on one PS task: clipping adds up per-shard norms.
    strategy = hybrid_strategy.HybridStrategy(
        min_shard_bytes=scenario.MIN_SHARD_BYTES, table_shards={"embedding/embeddings": 2})
    mirrored_table = hybrid_strategy.HybridStrategy(
        placement_overrides={"embedding": "mirrored", "float_ids": "mirrored"})
    weights, policy = mixed_precision_weights(strategy)
    report = {
        "replicas": strategy.num_replicas_in_sync,
        "clipping": {kind: clipping_case(strategy, kind) for kind in CLIPPING},
        "bad_ids": {"ps": bad_ids_case(strategy, on_ps=True),
                    "mirrored": bad_ids_case(mirrored_table, on_ps=False)},
        "empty_dataset": empty_dataset_case(strategy),
        "backup_and_restore": backup_case(strategy, args.out_dir),
        "h5": h5_case(strategy, args.out_dir),
        "mixed_precision_weights": weights,
        "policy": policy,
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
