"""How far one-device Keras training with sparse gradients is from the exact (dense) step.

An embedding's gradient is a `tf.IndexedSlices` with one slice per looked-up id, so
an id repeated in a batch repeats its row. Trains the tests' Embedding + Dense
model (`tests/scenario.py`: Zipf ids, 8 global batches of 32) on one device, once
with the IndexedSlices the tape gives (what `model.fit` does) and once with the
same gradients made dense (each row once, summed: the exact step, which
HybridStrategy's `sparse_update="exact"` and the tests reproduce), and prints, per
optimizer, the largest difference between the two tables relative to the table's
largest entry. Run with TF_USE_LEGACY_KERAS=1 for tf_keras.

    python -m benchmarks.duplicate_rows
"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
import scenario  # noqa: E402  (the tests' model and data)


def train(weights, optimizer, ids, y, dense):
    model = scenario.build_model()
    model.set_weights(weights)
    variables = model.trainable_variables
    for start in range(0, len(ids), scenario.GLOBAL_BATCH):
        x, t = ids[start:start + scenario.GLOBAL_BATCH], y[start:start + scenario.GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        grads = tape.gradient(loss, variables)
        if dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, variables))
    return model.get_layer("embedding").get_weights()[0]


def main():
    ids, y = scenario.make_data()
    weights = scenario.initial_weights("plain")
    repeats = [len(b) - len(np.unique(b)) for b in
               (ids[s:s + scenario.GLOBAL_BATCH].ravel()
                for s in range(0, len(ids), scenario.GLOBAL_BATCH))]
    flavour = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "Keras 3"
    print(f"{flavour}, TensorFlow {tf.__version__}; ids repeated in a batch of "
          f"{scenario.GLOBAL_BATCH * scenario.SEQ}: {min(repeats)} to {max(repeats)}")
    print(f"{'optimizer':<10} max |sparse - dense| / max |dense| (embedding table)")
    for name, make in scenario.OPTIMIZERS.items():
        dense = train(weights, make(), ids, y, dense=True)
        sparse = train(weights, make(), ids, y, dense=False)
        print(f"{name:<10} {np.max(np.abs(sparse - dense)) / np.max(np.abs(dense)):.2e}")


if __name__ == "__main__":
    main()
