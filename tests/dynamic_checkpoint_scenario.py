"""DynamicEmbedding tables saved in the middle of an epoch and restored onto other PS counts.

`save DIR`: trains dynamic_scenario.py's model with exact Adam for the first half of
the epoch, saves it (Keras 3: `save_weights` to DIR/dynamic.weights.h5; tf_keras:
`tf.train.Checkpoint` of the model and its optimizer in DIR), then trains the second
half. `restore DIR`: builds the model on this cluster, restores the save and trains
the second half. Both print, as JSON, every id's count, last step, row and optimizer
slots, the item table's admission sketch and the dense weights at the end, and the
number of PS tasks: a restore onto any number of PS tasks must end where the
uninterrupted run ended.

    python -m hybrid_strategy.launch --workers 2 --ps 2 -- \
        python tests/dynamic_checkpoint_scenario.py save DIR
    python -m hybrid_strategy.launch --workers 2 --ps 3 -- \
        python tests/dynamic_checkpoint_scenario.py restore DIR
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import dynamic_scenario as scenario
import optimizer_references as references
from optimizer_scenario import devices, path

keras = tf.keras
KERAS3 = hasattr(keras, "ops")
HALF = scenario.STEPS // 2


def _model(strategy):
    with strategy.scope():
        model = scenario.build_model()
        model.compile(optimizer=keras.optimizers.Adam(0.05, epsilon=1e-4),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def _state(model, strategy):
    tables = {}
    for name in scenario.TABLES:
        layer = model.get_layer(name)
        tables[name] = {str(k): [count, last] + ([] if row is None else [
            row.tolist(), [s.tolist() for s in slots]])
            for k, (count, last, row, slots) in scenario.per_id(layer).items()}
    dense = {path(w): references.values(w).tolist() for w in model.weights
             if path(w).split("/")[0] not in scenario.TABLES}
    return {"tables": tables, "dense": dense,
            "iterations": int(np.asarray(model.optimizer.iterations)),
            "num_ps": len(strategy.extended.ps_devices),
            "remap_devices": {n: list(model.get_layer(n).remap.devices)
                              for n in scenario.TABLES},
            "rows_devices": {n: devices(model.get_layer(n).embeddings)
                             for n in scenario.TABLES},
            "sketches": {n: scenario.sketch_state(model.get_layer(n)) for n in scenario.TABLES}}


def main(phase, directory):
    import hybrid_strategy

    keras.utils.set_random_seed(3)
    inputs, clicks = scenario.make_data()
    dataset = tf.data.Dataset.from_tensor_slices((inputs, clicks)).batch(scenario.GLOBAL_BATCH)
    strategy = hybrid_strategy.HybridStrategy(min_shard_bytes=256, sparse_update="exact")
    model = _model(strategy)
    weights = os.path.join(directory, "dynamic.weights.h5")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    if phase == "save":
        model.fit(dataset.take(HALF), epochs=1, verbose=0)
        if KERAS3:
            model.save_weights(weights)
        else:
            checkpoint.write(os.path.join(directory, "dynamic"))
    elif KERAS3:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
        model.load_weights(weights)
    else:
        checkpoint.read(os.path.join(directory, "dynamic")).assert_existing_objects_matched()
    model.fit(dataset.skip(HALF), epochs=1, verbose=0)
    json.dump(_state(model, strategy), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
