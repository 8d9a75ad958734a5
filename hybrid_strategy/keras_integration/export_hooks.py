"""SavedModels written by a chief connected to a cluster name no device of that cluster.

An op traced on the chief keeps the device it was given: a `tf.device` scope of the
strategy (a dynamic table's map looks ids up on its PS task), or TensorFlow's own
colocation with a resource that lives on a PS task (a `MutableHashTable`'s find,
export and import ops are colocated with its handle, and a traced function places
them on the handle's device). A SavedModel keeps those devices; a serving process
without the cluster cannot place an op pinned to `/job:ps/...` and fails at its first
call (an op reading the resource follows the restored resource; any other does not).

`tf.saved_model.save` (which Keras 3's `model.export` and tf_keras' saving call)
builds the MetaGraph, then writes it; the wrap here clears, in between, every device
that names a job of the connected cluster: in the graph, in every function of its
library and on resources. Serving places those ops itself, reading resources where
they are restored. Variable devices, which a SavedModel records only when asked
(`SaveOptions(experimental_variable_policy=SAVE_VARIABLE_DEVICES)`), are the user's
request, not cleared: such an export is refused, naming them.

```python
import hybrid_strategy
hybrid_strategy.HybridStrategy()   # calls export_hooks.install()
```
"""

import functools

import tensorflow as tf

from hybrid_strategy.cluster import connection
from hybrid_strategy.keras_integration import registry


def install():
    """Makes SavedModels written on a cluster's chief name none of its devices."""

    # TF-private: `save._build_meta_graph` fills the MetaGraph that `tf.saved_model.save`
    # writes next; no option of the public API clears devices of traced functions.
    def make(build_meta_graph):
        @functools.wraps(build_meta_graph)
        def build_meta_graph_off_the_cluster(obj, signatures, options, meta_graph_def=None):
            built = build_meta_graph(obj, signatures, options, meta_graph_def)
            jobs = connection.connected_jobs()
            if jobs:
                refuse_variable_devices(built[0], jobs)
                clear_cluster_devices(built[0], jobs)
            return built

        return build_meta_graph_off_the_cluster

    registry.install("export_hooks.no_cluster_devices", make)


def _on_cluster(device, jobs):
    return bool(device) and tf.DeviceSpec.from_string(device).job in jobs


def clear_cluster_devices(meta_graph_def, jobs):
    """Clears each device of `meta_graph_def` (its graph's nodes, its functions' nodes
    and its resources) that names one of `jobs`; returns how many it cleared."""
    graph = meta_graph_def.graph_def
    nodes = [*graph.node, *(node for function in graph.library.function
                            for node in function.node_def)]
    placed = [*nodes, *(node.resource for node in meta_graph_def.object_graph_def.nodes
                        if node.WhichOneof("kind") == "resource")]
    cleared = 0
    for item in placed:
        if _on_cluster(item.device, jobs):
            item.device = ""
            cleared += 1
    return cleared


def refuse_variable_devices(meta_graph_def, jobs):
    """Raises ValueError naming the variables `meta_graph_def` records on one of `jobs`."""
    named = [f"{node.variable.name} on {node.variable.device}"
             for node in meta_graph_def.object_graph_def.nodes
             if node.WhichOneof("kind") == "variable"
             and _on_cluster(node.variable.device, jobs)]
    if named:
        raise ValueError(
            "This SavedModel would record the devices of variables on the training "
            f"cluster ({'; '.join(named[:5])}{'; ...' if len(named) > 5 else ''}), which "
            "a serving process does not have. Save without "
            "SaveOptions(experimental_variable_policy=SAVE_VARIABLE_DEVICES).")
