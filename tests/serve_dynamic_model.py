"""Serves a SavedModel of DynamicEmbedding tables in plain TensorFlow: no cluster, no strategy.

Loads the SavedModel `dynamic_scenario.py` exported, feeds its held-out user ids
(int64) and item ids (strings) to the `serving_default` signature, and prints one JSON
object: the outputs, and whether TF_CONFIG was set.

    python tests/serve_dynamic_model.py EXPORT_JSON
"""

import json
import os
import sys

# Any import of the strategy's package (by the SavedModel loader, say) fails here.
sys.modules["hybrid_strategy"] = None

import tensorflow as tf  # noqa: E402


def main(export_json):
    with open(export_json) as f:
        export = json.load(f)
    serving = tf.saved_model.load(export["path"]).signatures["serving_default"]
    feed = {name: tf.constant(export["user"] if spec.dtype == tf.int64 else export["items"],
                              spec.dtype)
            for name, spec in serving.structured_input_signature[1].items()}
    (output,) = serving(**feed).values()
    json.dump({"outputs": output.numpy().tolist(), "tf_config": os.environ.get("TF_CONFIG")},
              sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
