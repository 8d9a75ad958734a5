"""Serves SavedModels in a plain TensorFlow process: no cluster, no HybridStrategy.

Loads each directory with `tf.saved_model.load`, runs its `serving_default`
signature on the ids given, and prints one JSON object: per directory, the outputs
and the shapes of the variables it holds.

    python tests/serve_saved_model.py IDS_JSON DIR [DIR ...]
"""

import json
import os
import sys

# Any import of the strategy's package (by the SavedModel loader, say) fails here.
sys.modules["hybrid_strategy"] = None

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def serve(path, ids):
    loaded = tf.saved_model.load(path)
    serving = loaded.signatures["serving_default"]
    (output,) = serving(tf.constant(ids)).values()
    variables = {id(v): v for v in tf.train.TrackableView(loaded).descendants()
                 if isinstance(v, tf.Variable)}.values()
    return {
        "outputs": output.numpy().tolist(),
        "variable_shapes": sorted(v.shape.as_list() for v in variables),
        "variable_devices": sorted({v.device for v in variables}),
    }


def main(ids_json, paths):
    ids = np.asarray(json.loads(ids_json), dtype="int32")
    report = {path: serve(path, ids) for path in paths}
    report["tf_config"] = os.environ.get("TF_CONFIG")
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
