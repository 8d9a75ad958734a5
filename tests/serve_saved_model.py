"""Serves SavedModels in a plain TensorFlow process: no cluster, no HybridStrategy.

Reads a JSON list of requests, `{"path": a SavedModel directory, "inputs": {input name:
values}}` (inputs in the model's order), loads each directory with
`tf.saved_model.load`, calls every signature it has on the inputs, and prints one JSON
object: per directory, each signature's outputs, the shapes and devices of the
variables it holds, and every device of another job than this process's that its
graph, functions or resources name.

    python tests/serve_saved_model.py REQUESTS_JSON
"""

import json
import os
import sys

# Any import of the strategy's package (by the SavedModel loader, say) fails here.
sys.modules["hybrid_strategy"] = None

import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import saved_model_pb2  # noqa: E402


def feed(signature, inputs):
    """The signature's keyword arguments: each input by its name, or by its place in
    the model's inputs where the export names them `inputs`, `inputs_1`, ..."""
    ordered = list(inputs.values())
    args = {}
    for name, spec in signature.structured_input_signature[1].items():
        if name in inputs:
            value = inputs[name]
        else:
            value = ordered[int(name.rpartition("_")[2]) if "_" in name else 0]
        args[name] = tf.constant(value, spec.dtype)
    return args


def foreign_devices(path):
    """"<where>: <node> on <device>" for each device naming a job other than localhost."""
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        saved.ParseFromString(f.read())
    named = []
    for meta_graph in saved.meta_graphs:
        graph = meta_graph.graph_def
        placed = [("graph", node.name, node.device) for node in graph.node]
        placed += [(function.signature.name, node.name, node.device)
                   for function in graph.library.function for node in function.node_def]
        placed += [(f"object {i}", node.WhichOneof("kind"), getattr(node, node.WhichOneof(
            "kind")).device) for i, node in enumerate(meta_graph.object_graph_def.nodes)
                   if node.WhichOneof("kind") in ("resource", "variable")]
        named += [f"{where}: {name} on {device}" for where, name, device in placed
                  if tf.DeviceSpec.from_string(device).job not in (None, "localhost")]
    return named


def serve(path, inputs):
    loaded = tf.saved_model.load(path)
    outputs = {}
    for key, signature in loaded.signatures.items():
        (output,) = signature(**feed(signature, inputs)).values()
        outputs[key] = output.numpy().tolist()
    variables = {id(v): v for v in tf.train.TrackableView(loaded).descendants()
                 if isinstance(v, tf.Variable)}.values()
    return {
        "outputs": outputs,
        "variable_shapes": sorted(v.shape.as_list() for v in variables),
        "variable_devices": sorted({v.device for v in variables}),
        "foreign_devices": foreign_devices(path),
    }


def main(requests_json):
    with open(requests_json) as f:
        requests = json.load(f)
    report = {r["path"]: serve(r["path"], r["inputs"]) for r in requests}
    report["tf_config"] = os.environ.get("TF_CONFIG")
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
