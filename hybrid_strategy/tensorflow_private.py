"""TensorFlow's private modules the package reaches into, fenced in one place.

`tf.distribute` offers no public way to build a strategy of its own, place per-replica
values, give the gradient tape a table-wide gradient or re-create a dataset on another
task; these modules are how TensorFlow's own strategies do it. Every other module
imports them from here, never from `tensorflow.python`, as Keras' private functions are
patched only through keras_integration/patches.py. `REACHES` names, for each, the names
the package reads from it and why: tests/test_layout.py fails when a module reads a
name not listed here, or when a listed name is gone from the installed TensorFlow.

```python
from hybrid_strategy import tensorflow_private
print(tensorflow_private.REACHES["record"])
```
"""

from tensorflow.python.data.experimental.ops import cardinality
from tensorflow.python.data.experimental.ops import data_service_ops
from tensorflow.python.data.experimental.ops import distribute as data_distribute
from tensorflow.python.data.ops import options as data_options
from tensorflow.python.data.ops import prefetch_op
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import input_ops
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.eager import context
from tensorflow.python.eager import record
from tensorflow.python.eager import tape as tape_lib
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import save_context
from tensorflow.python.training.saving import saveable_object
from tensorflow.python.util import dispatch

# {name in this module: (names the package reads from it, what for)}
REACHES = {
    # The strategy: MirroredStrategy's extended object, which it extends (the public
    # MirroredStrategy refuses remote devices in eager mode), and its plumbing.
    "mirrored_strategy": (("MirroredExtended",), "the class HybridExtended extends"),
    "distribute_lib": (("StrategyExtendedV1", "UpdateContext", "enter_or_assert_strategy"),
                       "the update context of an assignment, a strategy's scope entered "
                       "by an iterator, the extended API's base class"),
    "distribute_utils": (("regroup", "select_replica", "update_regroup"),
                         "one replica's update arguments; replicas' results regrouped "
                         "as merge_call hands them back"),
    "values_lib": (("DistributedValues", "DistributedVariable", "Mirrored",
                    "MirroredVariable"), "per-replica values and mirrored variables"),
    "ps_values": (("AggregatingVariable",),
                  "the variable wrapper of asynchronous steps, as ParameterServerStrategy's"),
    "collective_util": (("Options",), "the collectives' communication options"),
    "cross_device_ops": (("ReductionToOneDevice", "get_devices_from"),
                         "the devices a reduction's destination names; the fallback "
                         "reduction"),
    "cross_device_utils": (("CollectiveReplicaLauncher",),
                           "one device's collective launcher (group and instance keys)"),
    "device_util": (("resolve",), "a device string resolved as MirroredStrategy does"),
    "numpy_dataset": (("SingleDevice",), "where numpy inputs are placed"),
    "control_flow_util_v2": (("in_while_loop_defun",),
                             "whether a graph is a tf.while_loop body (steps_per_execution)"),
    # Tables: reads the gradient tape sees as one table-wide read.
    "record": (("could_possibly_record", "record_operation", "stop_recording"),
               "the tape kept off the raw per-shard reads, given the table-wide gradient"),
    "tape_lib": (("variable_accessed",), "a table read as the tape sees a variable read"),
    "gen_resource_variable_ops": (("read_variable_op", "resource_gather"),
                                  "the raw per-shard reads"),
    "resource_variable_ops": (("ResourceVariable", "UninitializedVariable",
                               "write_object_proto_for_resource_variable"),
                              "variables made outside the strategy's variable creator; a "
                              "table's SavedModel record"),
    "dispatch": (("register_dispatchable_type",),
                 "tf.nn.embedding_lookup of a table dispatched to its row lookup"),
    "save_context": (("in_save_context",), "whether tf.saved_model.save is tracing"),
    "saveable_object": (("SaveSpec",), "a checkpoint tensor built lazily on its ps"),
    "auto_control_deps": (("op_is_stateful",), "which ops a task's side effects order"),
    "context": (("async_wait", "context", "context_safe"),
                "waits for eager ops; this process's task; whether its runtime has started "
                "(before the launcher forks servers)"),
    # Input: TensorFlow's distribution of a dataset over workers.
    "input_lib": (("DistributedIterator", "InputWorkers", "_calculate_replicas_with_values",
                   "_create_per_replica", "_get_value_or_dummy"),
                  "distributed iterators, and the per-replica values of a partial batch"),
    "input_ops": (("auto_shard_dataset",), "a dataset sharded for one worker"),
    "input_util": (("get_distributed_dataset",), "a dataset distributed over workers"),
    "data_distribute": (("_RemoteDataset",), "a dataset re-created on a worker from its graph"),
    "data_options": (("ExternalStatePolicy",), "the option a dataset is serialized with"),
    "prefetch_op": (("_PrefetchDataset",), "whether a dataset already prefetches"),
    "cardinality": (("INFINITE",), "the cardinality of an endless dataset"),
    "data_service_ops": (("_DataServiceDatasetV2",),
                         "a dataset read from a tf.data service, whose job name is checked"),
}

__all__ = ["REACHES", *REACHES]
