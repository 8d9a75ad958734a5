"""Every run-time patch of Keras, tf_keras and TensorFlow: the one list (registry.py reads it).

An entry declares what changes and when; the code that makes the change sits in
the keras_integration module the entry's name starts with, and applies it with
`registry.install(name, make)`. A patch that is not declared here cannot be
installed. docs/patches.md is generated from this list.

```python
from hybrid_strategy.keras_integration.patches import PATCHES
print(len(PATCHES), "patches")
```
"""

from hybrid_strategy.keras_integration.patch import (
    ADD, ASYNCHRONOUS, AT_EXIT, CLUSTER, DYNAMIC, NO_CHECKS, REGISTER, REPEATED, REPLACE, RUN,
    SPANS, STRATEGY, TABLES, WRAP, Patch)

PATCHES = (
    # --- tables: row reads, ids, penalties, checkpoints, optimizers ---------------
    Patch("table_hooks.export_reads_tables_whole", "keras",
          "keras.src.export.saved_model_export_archive:SavedModelExportArchive.write_out",
          WRAP, TABLES, "Keras' SavedModel export traces its endpoints reading PS tables "
          "whole, so the SavedModel holds each table as one ordinary variable.",
          params=("self", "filepath", "options", "verbose"),
          checks=(RUN, "write_out refuses an archive without endpoints; the patch calls it, "
                       "tracing inside a block that reads tables whole.")),
    Patch("table_hooks.sparse_read", "keras", "keras.src.backend:Variable.sparse_read", ADD,
          TABLES, "tf.gather of a Keras variable wrapping a PS table reads only the rows it "
          "needs (the property exists only for such variables; others raise AttributeError).",
          checks=(NO_CHECKS, "No original: the property is new; tf.gather then reads through "
                             "the table's row lookup, which checks the ids' range itself.")),
    Patch("table_hooks.dispatchable_variable", "tensorflow",
          "tensorflow.python.util.dispatch:register_dispatchable_type", REGISTER, TABLES,
          "Keras variables become a dispatchable type, for the tf.shape and "
          "tf.nn.embedding_lookup handlers.", params=("cls",),
          checks=(NO_CHECKS, "register_dispatchable_type only registers a class; no user input "
                             "passes through it.")),
    Patch("table_hooks.static_shape", "tensorflow", "tensorflow.python.ops.array_ops:shape_v2",
          REGISTER, TABLES, "tf.shape of a Keras variable (Keras' ops.take asks) is its static "
          "shape, same value, without reading a PS table whole.",
          params=("input", "out_type", "name"),
          checks=(REPEATED, "tf.shape refuses an out_type other than int32 and int64; the "
                            "handler answers statically for those only and hands any other to "
                            "tf.shape, for its own error.")),
    Patch("table_hooks.embedding_lookup", "tensorflow",
          "tensorflow.python.ops.embedding_ops:embedding_lookup_v2", REGISTER, TABLES,
          "tf.nn.embedding_lookup of a Keras variable wrapping a PS table reads by row, not "
          "the whole table first.", params=("params", "ids", "max_norm", "name"),
          checks=(RUN, "The handler calls tf.nn.embedding_lookup itself, on the variable's "
                       "table or value, so its checks of ids and max_norm run.")),
    Patch("table_hooks.embedding_ids", "keras", "keras.src.layers.core.embedding:Embedding.call",
          WRAP, STRATEGY, "Embedding ids are checked (in range, whole numbers) before Keras "
          "wraps negative ones or truncates floats, for PS and mirrored tables alike.",
          params=("self", "inputs"),
          checks=(NO_CHECKS, "Embedding.call casts ids and gathers rows, checking nothing "
                             "itself; the patch checks the ids, then calls it.")),
    Patch("table_hooks.embedding_ids_tf_keras", "tf_keras",
          "tf_keras.src.layers.core.embedding:Embedding.call", WRAP, STRATEGY,
          "Embedding ids are checked (in range, whole numbers) before tf_keras truncates "
          "floats, for PS and mirrored tables alike.", params=("self", "inputs"),
          checks=(NO_CHECKS, "Embedding.call casts ids and looks rows up, checking nothing "
                             "itself; the patch checks the ids, then calls it.")),
    Patch("batched_lookups.run_at_once", "keras",
          "keras.src.ops.function:Function._run_through_graph", WRAP, TABLES,
          "A functional model looks up every PS table its inputs index at once: one "
          "exchange per PS task, not one per table.",
          params=("self", "inputs", "operation_fn", "call_fn"),
          checks=(RUN, "_run_through_graph refuses an output not connected to the inputs; the "
                       "patch calls it with the same arguments.")),
    Patch("reads_ahead.run_reading_ahead", "keras",
          "keras.src.ops.function:Function._run_through_graph", WRAP, TABLES,
          "A functional model reads every PS table its layers read whole at once when it "
          "starts: one tensor from each PS task, not one per table.",
          params=("self", "inputs", "operation_fn", "call_fn"),
          after=("batched_lookups.run_at_once",),
          checks=(RUN, "_run_through_graph refuses an output not connected to the inputs; the "
                       "patch calls it with the same arguments.")),
    Patch("batched_lookups.rows_looked_up", "keras",
          "keras.src.layers.core.embedding:Embedding.call", WRAP, TABLES,
          "An Embedding whose rows were looked up at once returns them (ids already checked).",
          params=("self", "inputs"), after=("table_hooks.embedding_ids",),
          checks=(NO_CHECKS, "Embedding.call casts ids and gathers rows, checking nothing; "
                             "rows returned without it were looked up after the same ids check "
                             "as table_hooks.embedding_ids.")),
    Patch("penalty_hooks.table_penalties", "keras",
          "keras.src.layers.layer:Layer._get_regularization_losses", WRAP, TABLES,
          "The regularizer of a weight wrapping a PS table is computed on the table's PS "
          "tasks, one scalar per shard, not from the whole table on every worker.",
          params=("self",),
          checks=(NO_CHECKS, "_get_regularization_losses calls each weight's regularizer, "
                             "checking nothing; the patch calls it, a table's regularizer "
                             "computed by shard.")),
    Patch("penalty_hooks.table_penalties_tf_keras", "tf_keras",
          "tf_keras.src.engine.base_layer:Layer._handle_weight_regularization", WRAP, TABLES,
          "The regularizer of a PS table is computed on the table's PS tasks, one scalar "
          "per shard, not from the whole table on every worker.",
          params=("self", "name", "variable", "regularizer"),
          checks=(NO_CHECKS, "_handle_weight_regularization adds the regularizer's loss, "
                             "checking nothing; the patch calls it with the table's penalty as "
                             "the regularizer.")),
    Patch("checkpoint_hooks.every_slice_restored", "tensorflow",
          "tensorflow.python.training.saving.saveable_object_util:TrackableSaveable.restore",
          WRAP, TABLES, "A table saved as row blocks is handed every block on restore, not "
          "the first only.", params=("self", "restored_tensors", "restored_shapes"),
          checks=(NO_CHECKS, "restore pairs tensors with names and calls the object's "
                             "_restore_from_tensors, checking nothing; for a sliced name the "
                             "patch calls _restore_from_tensors itself.")),
    Patch("checkpoint_hooks.storage_checked_on_save", "tensorflow",
          "tensorflow.python.checkpoint.functional_saver:MultiDeviceSaver.save", WRAP, CLUSTER,
          "Saving first checks that every task writing part of the checkpoint sees its path, "
          "with an error naming the task that does not.",
          params=("self", "file_prefix", "options"),
          checks=(RUN, "save checks what registered savers return; the patch checks every "
                       "task's storage, then calls it.")),
    Patch("checkpoint_hooks.storage_checked_on_restore", "tensorflow",
          "tensorflow.python.checkpoint.functional_saver:MultiDeviceSaver.restore", WRAP,
          CLUSTER, "Restoring first checks that every task reading part of the checkpoint "
          "finds it, with an error naming the task that does not.",
          params=("self", "file_prefix", "options"),
          checks=(RUN, "restore checks the checkpoint's keys and dtypes as it reads; the patch "
                       "checks every task's storage, then calls it.")),
    Patch("checkpoint_hooks.restored_shape", "keras",
          "keras.src.backend:Variable._restore_from_tensors", WRAP, CLUSTER,
          "A tensor restored inside a tf.function (on a cluster) gets the variable's static "
          "shape, which Keras' assign needs.", params=("self", "restored_tensors"),
          checks=(RUN, "_restore_from_tensors assigns, refusing another shape; the patch calls "
                       "it, with tensors of unknown shape given the variable's by "
                       "tf.ensure_shape, which refuses any other.")),
    Patch("checkpoint_hooks.h5_streamed_assign", "keras", "keras.src.backend:Variable.assign",
          WRAP, TABLES, "A PS table is loaded from an h5 file block by block, never whole "
          "on the chief.", params=("self", "value"),
          checks=(REPEATED, "assign refuses a value of another shape; read_h5 refuses "
                            "(ValueError) an h5 dataset of another shape than the table before "
                            "writing a row; any other value goes to assign.")),
    Patch("checkpoint_hooks.h5_streamed_write", "keras",
          "keras.src.saving.saving_lib:H5IOStore.__setitem__", WRAP, TABLES,
          "A PS table is written to an h5 file block by block, never whole on the chief.",
          params=("self", "key", "value"),
          checks=(REPEATED, "__setitem__ refuses a store not opened for writing; the patch "
                            "hands such a store to it, for its error, and streams into a "
                            "writable one only.")),
    Patch("checkpoint_hooks.h5_streamed_read", "keras",
          "keras.src.saving.saving_lib:H5IOStore.__getitem__", WRAP, TABLES,
          "A large h5 dataset is handed over unread, for a PS table to stream it (anything "
          "else reads it as an array).", params=("self", "key"),
          checks=(REPEATED, "Keras refuses soft and external links, external and virtual "
                            "storage (3.14.0: external storage only) and, from 3.15, a "
                            "declared size far over the stored one; the patch makes the "
                            "installed Keras' own check (saving_lib.safe_get_h5_dataset; "
                            "3.14.0: H5IOStore._verify_dataset), with its error, before it "
                            "hands a dataset over unread.")),
    Patch("checkpoint_hooks.optimizer_tables_unread", "keras",
          "keras.src.optimizers.base_optimizer:BaseOptimizer.save_own_variables", WRAP, TABLES,
          "Optimizer slots that are PS tables reach the h5 store unread, to be streamed, "
          "not read whole on the chief.", params=("self", "store"),
          checks=(NO_CHECKS, "save_own_variables stores each variable's numpy(), checking "
                             "nothing; the patch calls it, tables standing in unread.")),
    Patch("checkpoint_hooks.keras_file_on_disk", "keras",
          "keras.src.saving.saving_lib:is_memory_sufficient", WRAP, TABLES,
          "A .keras file of a model with PS tables is built in a file on disk, not in the "
          "chief's memory.", params=("model",),
          checks=(NO_CHECKS, "is_memory_sufficient only estimates memory; False picks Keras' "
                             "own on-disk branch, whose file checks are those of the in-memory "
                             "one.")),
    Patch("optimizer_hooks.tables_checked_when_built", "keras",
          "keras.src.optimizers.base_optimizer:BaseOptimizer.build", WRAP, TABLES,
          "An optimizer that cannot update a PS table is refused when built (a model that "
          "made its variables after compile).", params=("self", "variables"),
          checks=(NO_CHECKS, "build indexes the variables and makes slots, checking nothing of "
                             "them; the patch checks the tables, then calls it.")),
    Patch("optimizer_hooks.tables_checked_when_compiled", "keras",
          "keras.src.trainers.trainer:Trainer.compile", WRAP, TABLES,
          "An optimizer that cannot update a PS table is refused at compile.",
          params=("self", "optimizer", "loss", "loss_weights", "metrics", "weighted_metrics",
                  "run_eagerly", "steps_per_execution", "jit_compile", "auto_scale_loss"),
          checks=(RUN, "compile resolves the optimizer, losses and metrics, refusing unknown "
                       "ones; the patch calls it with the same arguments.")),
    Patch("optimizer_hooks.muon_decays_tables_once", "keras",
          "keras.src.optimizers.muon:Muon._apply_weight_decay", WRAP, TABLES,
          "Muon decays a PS table once per step through the strategy, not once per replica.",
          params=("self", "variables"),
          checks=(NO_CHECKS, "_apply_weight_decay assigns each variable its decayed value, "
                             "checking nothing; the patch calls it for every variable, tables "
                             "through the strategy.")),
    Patch("optimizer_hooks.tables_checked_when_built_tf_keras", "tf_keras",
          "tf_keras.src.optimizers.optimizer:_BaseOptimizer.build", WRAP, TABLES,
          "An optimizer that cannot update a PS table is refused when built (a model that "
          "made its variables after compile).", params=("self", "var_list"),
          checks=(NO_CHECKS, "build indexes the variables and makes slots, checking nothing of "
                             "them; the patch checks the tables, then calls it.")),
    Patch("optimizer_hooks.tables_checked_when_compiled_tf_keras", "tf_keras",
          "tf_keras.src.engine.training:Model.compile", WRAP, TABLES,
          "An optimizer that cannot update a PS table is refused at compile.",
          params=("self", "optimizer", "loss", "metrics", "loss_weights", "weighted_metrics",
                  "run_eagerly", "steps_per_execution", "jit_compile", "pss_evaluation_shards",
                  "kwargs"),
          checks=(RUN, "compile resolves the optimizer, losses and metrics, refusing unknown "
                       "ones and bad arguments; the patch calls it with the same arguments.")),
    Patch("optimizer_hooks.mirrored_read_once", "tensorflow",
          "tensorflow.python.distribute.values:MirroredVariable._dense_var_to_tensor", WRAP,
          TABLES, "A mirrored variable (learning rate, step count) read by the update rules "
          "of PS tables on one PS task is sent there once per step, not once per table.",
          params=("self", "dtype", "name", "as_ref"),
          checks=(RUN, "_dense_var_to_tensor refuses a dtype other than the variable's; the "
                       "patch calls it once per variable, dtype, graph and device, reusing "
                       "that call's tensor for the same request only.")),
    # --- input and steps: keras_input, multi_step, batches, end_of_data, service_input, increments, asynchronous ---
    Patch("keras_input.build_from_element_spec", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build",
          WRAP, STRATEGY, "Builds the model from the distributed dataset's element spec, not "
          "from a first batch every worker would read for nothing.",
          params=("self", "iterator", "data_batch"),
          checks=(RUN, "_maybe_symbolic_build builds the model from a batch, Keras checking "
                       "its structure against the inputs; the patch calls it with the "
                       "dataset's element spec, checked the same.")),
    Patch("keras_input.note_iterator_strategy", "keras",
          "keras.src.backend.tensorflow.trainer:TFEpochIterator.__init__", WRAP, STRATEGY,
          "Tells the array adapter which strategy the epoch iterator makes its dataset for.",
          params=("self", "distribute_strategy", "args", "kwargs"),
          checks=(RUN, "The epoch iterator checks its data through the adapter it makes; the "
                       "patch calls it with the same arguments.")),
    Patch("keras_input.count_steps", "keras",
          "keras.src.backend.tensorflow.trainer:TFEpochIterator.__next__", WRAP, STRATEGY,
          "Counts the steps begun, so that an empty dataset is told from a finished one.",
          params=("self",),
          checks=(NO_CHECKS, "__next__ only takes the next step; the patch counts it and calls "
                             "it.")),
    Patch("keras_input.refuse_empty_dataset", "keras",
          "keras.src.backend.tensorflow.trainer:TFEpochIterator.catch_stop_iteration",
          WRAP, STRATEGY, "Refuses a dataset found empty at the first step with a clear "
          "error, where Keras would end fit having trained nothing.", params=("self",),
          after=("asynchronous_hooks.join_at_epoch_end",
                 "data_service_hooks.forget_epoch_steps"),
          checks=(NO_CHECKS, "catch_stop_iteration turns the end of data into StopIteration, "
                             "checking nothing; the patch calls it and refuses an empty "
                             "dataset.")),
    Patch("keras_input.arrays_as_worker_shares", "keras",
          "keras.src.trainers.data_adapters.array_data_adapter:ArrayDataAdapter.get_tf_dataset",
          REPLACE, CLUSTER, "Arrays reach each worker as its own rows, not as a dataset "
          "holding them whole that every worker receives.", params=("self",),
          why_replaced="the original builds a dataset holding the whole arrays (copied "
          "into it), the very thing avoided; the shares are built from the arrays instead "
          "(outside the gate the original is called).",
          checks=(NO_CHECKS, "get_tf_dataset builds a dataset of arrays that "
                             "ArrayDataAdapter's constructor checked (types, lengths); that "
                             "still runs, and arrays the shares do not support go to the "
                             "original.")),
    Patch("keras_input.keep_array_inputs", "tf_keras",
          "tf_keras.src.engine.data_adapter:TensorLikeDataAdapter.slice_inputs", WRAP,
          CLUSTER, "Keeps the arrays the adapter slices, for the data handler to share "
          "them out by worker.", params=("self", "indices_dataset", "inputs"),
          checks=(NO_CHECKS, "slice_inputs builds a dataset of arrays checked when the adapter "
                             "was made; the patch keeps them and calls it.")),
    Patch("keras_input.tf_keras_arrays_as_worker_shares", "tf_keras",
          "tf_keras.src.engine.data_adapter:DataHandler._configure_dataset_and_inferred_steps",
          WRAP, CLUSTER, "Arrays reach each worker as its own rows (with the class "
          "weights), not as a dataset holding them whole.",
          params=("self", "strategy", "x", "steps_per_epoch", "class_weight", "distribute"),
          checks=(RUN, "_configure_dataset_and_inferred_steps checks steps_per_epoch and the "
                       "data handler; the patch calls it (undistributed) before it replaces "
                       "the dataset.")),
    Patch("multi_step.unrolled_steps", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function", REPLACE,
          SPANS, "Traces the N steps of a call one after the other, inline, with packed logs "
          "and each worker's end of data on that worker.", params=("self", "step_function"),
          why_replaced="every piece of the original is what must differ: it calls the step "
          "as a nested tf.function inside a tf.while_loop (TensorFlow 2.21 loses the "
          "captured inputs of a function called in a loop or conditional that spans "
          "devices), reduces every log on this process, and reads the next batch in one "
          "optional on one device; these are local closures of the original, with no "
          "argument or attribute to change them (outside the gate the original is called).",
          checks=(NO_CHECKS, "_make_function traces Keras' step loop, checking nothing; the "
                             "steps (train_step and its checks) run in the patch's loop.")),
    Patch("multi_step.tf_keras_unrolled_train_steps", "tf_keras",
          "tf_keras.src.engine.training:Model.make_train_function", WRAP, SPANS,
          "Runs steps_per_execution training steps unrolled in one function, around "
          "tf_keras' one-step function.", params=("self", "force"),
          checks=(NO_CHECKS, "make_train_function builds tf_keras' training function, checking "
                             "nothing; the patch calls it for the step it unrolls.")),
    Patch("multi_step.tf_keras_unrolled_test_steps", "tf_keras",
          "tf_keras.src.engine.training:Model.make_test_function", WRAP, SPANS,
          "Runs steps_per_execution evaluation steps unrolled in one function, around "
          "tf_keras' one-step function.", params=("self", "force"),
          checks=(NO_CHECKS, "make_test_function builds tf_keras' evaluation function, "
                             "checking nothing; the patch calls it for the step it unrolls.")),
    Patch("batches.scale_loss_by_replica_weight", "keras",
          "keras.src.losses.loss:scale_loss_for_distribution", REPLACE, SPANS,
          "Scales a replica's loss by its share of the global batch's rows, not 1/N.",
          params=("value",), why_replaced="the weight replaces the original's 1/N; "
          "rescaling its result would round differently from one device.",
          checks=(NO_CHECKS, "It multiplies a loss by 1/N, checking nothing.")),
    Patch("batches.unscale_loss_by_replica_weight", "keras",
          "keras.src.losses.loss:unscale_loss_for_distribution", REPLACE, SPANS,
          "Divides a replica's logged loss by its share of the rows, not multiplies it by N.",
          params=("value",), why_replaced="the weight replaces the original's N; "
          "rescaling its result would round differently from one device.",
          checks=(NO_CHECKS, "It multiplies a loss by N, checking nothing.")),
    Patch("batches.per_output_losses", "keras",
          "keras.src.trainers.compile_utils:CompileLoss.call", WRAP, SPANS,
          "Marks the compiled loss's per-output trackers, whose losses keep Keras' scaling.",
          params=("self", "y_true", "y_pred", "sample_weight"),
          checks=(RUN, "CompileLoss.call checks targets and predictions against the model's "
                       "outputs; the patch calls it with the same arguments.")),
    Patch("batches.reduce_over_global_batch", "keras",
          "keras.src.losses.loss:reduce_weighted_values", WRAP, SPANS,
          "Divides a masked or sample-weighted mean by the global batch's divisor.",
          params=("values", "sample_weight", "mask", "reduction", "dtype"),
          checks=(RUN, "reduce_weighted_values refuses an unknown reduction; the patch calls "
                       "it with the given one, or with sum for a mean it recognized.")),
    Patch("batches.batch_normalization_rows", "keras",
          "keras.src.layers.normalization.batch_normalization:BatchNormalization._moments",
          WRAP, SPANS, "Refuses per-replica statistics over a replica with no rows (NaN).",
          params=("self", "inputs", "mask"),
          checks=(NO_CHECKS, "_moments computes statistics, checking nothing; the patch checks "
                             "the replica has rows, then calls it.")),
    Patch("batches.conv2d_rows", "tensorflow", "tensorflow.python.ops.gen_nn_ops:conv2d",
          WRAP, SPANS, "Refuses a CPU convolution over a replica with no rows (oneDNN "
          "returns a wrong shape).", params=("input", "filter", "strides", "padding",
                                              "use_cudnn_on_gpu", "explicit_paddings",
                                              "data_format", "dilations", "name"),
          checks=(RUN, "The op checks shapes, strides, padding and formats; the patch calls it "
                       "with the same arguments (the input behind a check that it has rows).")),
    Patch("batches.conv3d_rows", "tensorflow", "tensorflow.python.ops.gen_nn_ops:conv3d",
          WRAP, SPANS, "Refuses a CPU convolution over a replica with no rows (oneDNN "
          "returns a wrong shape).", params=("input", "filter", "strides", "padding",
                                              "data_format", "dilations", "name"),
          checks=(RUN, "The op checks shapes, strides, padding and formats; the patch calls it "
                       "with the same arguments (the input behind a check that it has rows).")),
    Patch("batches.depthwise_conv2d_native_rows", "tensorflow",
          "tensorflow.python.ops.gen_nn_ops:depthwise_conv2d_native", WRAP, SPANS,
          "Refuses a CPU convolution over a replica with no rows (oneDNN returns a wrong "
          "shape).", params=("input", "filter", "strides", "padding", "explicit_paddings",
                             "data_format", "dilations", "name"),
          checks=(RUN, "The op checks shapes, strides, padding and formats; the patch calls it "
                       "with the same arguments (the input behind a check that it has rows).")),
    Patch("batches.tf_keras_scale_loss_by_replica_weight", "tf_keras",
          "tf_keras.src.utils.losses_utils:scale_loss_for_distribution", REPLACE, SPANS,
          "Scales a replica's loss by its share of the global batch's rows, not 1/N.",
          params=("loss_value",), why_replaced="the weight replaces the original's 1/N; "
          "rescaling its result would round differently from one device.",
          checks=(NO_CHECKS, "It multiplies a loss by 1/N, checking nothing.")),
    Patch("batches.tf_keras_global_valid_mask", "tf_keras",
          "tf_keras.src.utils.losses_utils:apply_valid_mask", REPLACE, SPANS,
          "Weights unmasked elements by the global batch's count of them.",
          params=("losses", "sw", "mask", "reduction"), why_replaced="the original's "
          "weight is the replica's own count; the global one goes to apply_mask, which the "
          "original calls (outside the gate the original is called).",
          checks=(NO_CHECKS, "It reweights the mask by the valid entries, checking nothing; "
                             "the patch calls apply_mask as the original does.")),
    Patch("batches.tf_keras_sums_as_means", "tf_keras",
          "tf_keras.src.engine.compile_utils:LossesContainer.__call__", WRAP, SPANS,
          "Presents a sum loss as a mean loss of sum / share, exact for gradient and log.",
          params=("self", "y_true", "y_pred", "sample_weight", "regularization_losses"),
          checks=(RUN, "LossesContainer.__call__ checks targets and predictions against the "
                       "losses; the patch calls it with the same arguments.")),
    Patch("batches.tf_keras_synchronized_batch_normalization", "tf_keras",
          "tf_keras.src.layers.normalization.batch_normalization:"
          "BatchNormalizationBase._support_zero_size_input", REPLACE, SPANS,
          "A synchronized layer updates on every replica, empty ones included.",
          params=("self",), why_replaced="the answer (False) is the opposite of the "
          "original's for a synchronized layer (otherwise the original is called).",
          checks=(NO_CHECKS, "It answers whether empty replicas are supported, checking "
                             "nothing.")),
    Patch("increments.assign_add_per_copy", "keras",
          "keras.src.backend.tensorflow.core:Variable.assign_add", REPLACE, STRATEGY,
          "Adds a number to each copy of a mirrored variable where it lives, and to a "
          "variable shared by asynchronous steps atomically.", params=("self", "value"),
          why_replaced="the original reads the variable and assigns the sum, the very "
          "crossing between tasks avoided (otherwise the original is called).",
          checks=(REPEATED, "Its assign refuses a sum of another shape: a number, all the "
                            "patch adds without it, keeps the shape, and a variable shared by "
                            "asynchronous steps adds with TensorFlow's assign_add, which "
                            "refuses another shape.")),
    Patch("increments.assign_sub_per_copy", "keras",
          "keras.src.backend.tensorflow.core:Variable.assign_sub", REPLACE, STRATEGY,
          "Subtracts a number from each copy of a mirrored variable where it lives, and "
          "from a variable shared by asynchronous steps atomically.",
          params=("self", "value"), why_replaced="the original reads the variable and "
          "assigns the difference, the very crossing between tasks avoided (otherwise the "
          "original is called).",
          checks=(REPEATED, "Its assign refuses a difference of another shape: a number, all "
                            "the patch subtracts without it, keeps the shape, and a variable "
                            "shared by asynchronous steps subtracts with TensorFlow's "
                            "assign_sub, which refuses another shape.")),
    Patch("iterator_hooks.get_next_per_worker", "tensorflow",
          "tensorflow.python.distribute.input_lib:DistributedIterator.get_next", REPLACE,
          SPANS, "Picks each worker's batch (or its empty stand-in) on that worker, not "
          "every replica's in one conditional on one device.", params=("self", "name"),
          why_replaced="the original's one conditional over every replica's batch is what "
          "is avoided, and it has no hook to place it per worker; the same TensorFlow "
          "helpers pick the batches (outside the gate the original is called).",
          checks=(REPEATED, "get_next refuses a call inside a replica's step; the patch makes "
                            "the same test and calls get_next there, for its error.")),
    Patch("data_service_hooks.forget_epoch_steps", "keras",
          "keras.src.backend.tensorflow.trainer:TFEpochIterator.catch_stop_iteration",
          WRAP, STRATEGY, "Runs every epoch of a dataset read from the tf.data service to "
          "its end (its length varies by epoch).", params=("self",),
          after=("asynchronous_hooks.join_at_epoch_end",),
          checks=(NO_CHECKS, "catch_stop_iteration turns the end of data into StopIteration, "
                             "checking nothing; the patch calls it.")),
    Patch("data_service_hooks.tf_keras_forget_epoch_steps", "tf_keras",
          "tf_keras.src.engine.data_adapter:DataHandler.catch_stop_iteration", WRAP,
          STRATEGY, "Runs every epoch of a dataset read from the tf.data service to its "
          "end, where tf_keras would end training.", params=("self",),
          after=("asynchronous_hooks.tf_keras_join_at_epoch_end",),
          checks=(NO_CHECKS, "catch_stop_iteration ends an epoch at the end of data, checking "
                             "nothing; the patch calls it.")),
    Patch("asynchronous_hooks.train_asynchronously", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.make_train_function",
          REPLACE, ASYNCHRONOUS, "Makes the training function one step function per "
          "worker, run from a thread per worker.", params=("self", "force"),
          why_replaced="the function the original makes runs every replica in lockstep, "
          "and nothing of it serves a worker's own steps (outside the gate the original "
          "is called).", after=("mirroring_hooks.move_tables_after_first_step",),
          checks=(NO_CHECKS, "make_train_function builds the training function, checking "
                             "nothing; the steps (train_step and its checks) run in the "
                             "patch's functions.")),
    Patch("asynchronous_hooks.test_waits", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.make_test_function",
          WRAP, ASYNCHRONOUS, "Evaluation waits for the training steps in flight.",
          params=("self", "force"),
          checks=(NO_CHECKS, "make_test_function builds the evaluation function, checking "
                             "nothing; the patch calls it.")),
    Patch("asynchronous_hooks.predict_waits", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.make_predict_function",
          WRAP, ASYNCHRONOUS, "Prediction waits for the training steps in flight.",
          params=("self", "force"),
          checks=(NO_CHECKS, "make_predict_function builds the prediction function, checking "
                             "nothing; the patch calls it.")),
    Patch("asynchronous_hooks.join_at_epoch_end", "keras",
          "keras.src.backend.tensorflow.trainer:TFEpochIterator.catch_stop_iteration",
          WRAP, ASYNCHRONOUS, "An epoch ends once every step handed out has finished.",
          params=("self",),
          checks=(NO_CHECKS, "catch_stop_iteration turns the end of data into StopIteration, "
                             "checking nothing; the patch calls it.")),
    Patch("asynchronous_hooks.checkpoint_save_waits", "tensorflow",
          "tensorflow.python.checkpoint.functional_saver:MultiDeviceSaver.save", WRAP,
          ASYNCHRONOUS, "A checkpoint waits for the steps in flight: it holds every update.",
          params=("self", "file_prefix", "options"),
          after=("checkpoint_hooks.storage_checked_on_save",),
          checks=(RUN, "save checks what registered savers return; the patch waits for the "
                       "steps, then calls it.")),
    Patch("asynchronous_hooks.checkpoint_restore_waits", "tensorflow",
          "tensorflow.python.checkpoint.functional_saver:MultiDeviceSaver.restore", WRAP,
          ASYNCHRONOUS, "Restoring a checkpoint waits for the steps in flight.",
          params=("self", "file_prefix", "options"),
          after=("checkpoint_hooks.storage_checked_on_restore",),
          checks=(RUN, "restore checks the checkpoint's keys and dtypes as it reads; the patch "
                       "waits for the steps, then calls it.")),
    Patch("asynchronous_hooks.save_model_waits", "keras",
          "keras.src.saving.saving_lib:save_model", WRAP, ASYNCHRONOUS,
          "Saving a model waits for the steps in flight: it holds every update.",
          params=("model", "filepath", "weights_format", "zipped"),
          checks=(RUN, "save_model checks the path (.keras, zipped, hf://); the patch waits "
                       "for the steps, then calls it.")),
    Patch("asynchronous_hooks.save_weights_waits", "keras",
          "keras.src.saving.saving_lib:save_weights_only", WRAP, ASYNCHRONOUS,
          "Saving weights waits for the steps in flight: they hold every update.",
          params=("model", "filepath", "max_shard_size", "objects_to_skip"),
          checks=(RUN, "save_weights_only checks the model is built and the file's suffix; the "
                       "patch waits for the steps, then calls it.")),
    Patch("asynchronous_hooks.load_weights_waits", "keras",
          "keras.src.saving.saving_lib:load_weights_only", WRAP, ASYNCHRONOUS,
          "Loading weights waits for the steps in flight.",
          params=("model", "filepath", "skip_mismatch", "objects_to_skip"),
          checks=(RUN, "load_weights_only checks the model is built and reads through Keras' "
                       "checked h5 store; the patch waits for the steps, then calls it.")),
    Patch("asynchronous_hooks.tf_keras_train_asynchronously", "tf_keras",
          "tf_keras.src.engine.training:Model.make_train_function", REPLACE, ASYNCHRONOUS,
          "Makes the training function one step function per worker, run from a thread "
          "per worker.", params=("self", "force"),
          why_replaced="the function the original makes runs every replica in lockstep, "
          "and nothing of it serves a worker's own steps (outside the gate the original "
          "is called).", after=("multi_step.tf_keras_unrolled_train_steps",),
          checks=(NO_CHECKS, "make_train_function builds the training function, checking "
                             "nothing; the steps (train_step and its checks) run in the "
                             "patch's functions.")),
    Patch("asynchronous_hooks.tf_keras_test_waits", "tf_keras",
          "tf_keras.src.engine.training:Model.make_test_function", WRAP, ASYNCHRONOUS,
          "Evaluation waits for the training steps in flight.", params=("self", "force"),
          after=("multi_step.tf_keras_unrolled_test_steps",),
          checks=(NO_CHECKS, "make_test_function builds the evaluation function, checking "
                             "nothing; the patch calls it.")),
    Patch("asynchronous_hooks.tf_keras_predict_waits", "tf_keras",
          "tf_keras.src.engine.training:Model.make_predict_function", WRAP, ASYNCHRONOUS,
          "Prediction waits for the training steps in flight.", params=("self", "force"),
          checks=(NO_CHECKS, "make_predict_function builds the prediction function, checking "
                             "nothing; the patch calls it.")),
    Patch("asynchronous_hooks.tf_keras_join_at_epoch_end", "tf_keras",
          "tf_keras.src.engine.data_adapter:DataHandler.catch_stop_iteration", WRAP,
          ASYNCHRONOUS, "An epoch ends once every step handed out has finished.",
          params=("self",),
          checks=(NO_CHECKS, "catch_stop_iteration ends an epoch at the end of data, checking "
                             "nothing; the patch calls it.")),
    # --- placement, communication, cluster: creation, mirroring, clipping, side_effects, collectives ---
    Patch("layer_hooks.tag_layer_classes", "keras",
          "keras.src.layers.layer:Layer.add_weight", WRAP, STRATEGY,
          "Tags each weight with its layer's classes, for placement when Keras creates "
          "the variable later, with no layer on the stack.",
          params=("self", "args", "shape", "initializer", "dtype", "trainable", "autocast",
                  "regularizer", "constraint", "aggregation", "overwrite_with_gradient",
                  "name"),
          checks=(RUN, "add_weight checks shape and dtype and resolves initializer, "
                       "regularizer and constraint by name; the patch calls it with the same "
                       "arguments.")),
    Patch("mirroring_hooks.move_tables_after_first_step", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.make_train_function", WRAP,
          TABLES,
          "Moves PS tables whose gradient turned out dense to mirrored after the first "
          "training step, then remakes the step functions.",
          params=("self", "force"),
          checks=(NO_CHECKS, "make_train_function builds the training function, checking "
                             "nothing; the patch calls it.")),
    Patch("clipping_hooks.defer_replica_clipping", "keras",
          "keras.src.backend.tensorflow.optimizer:TFOptimizer._clip_gradients", WRAP,
          STRATEGY,
          "Leaves each replica's gradients unclipped, for clipping their cross-replica sum "
          "as one device would.",
          params=("self", "grads"),
          checks=(NO_CHECKS, "_clip_gradients clips, checking nothing; the clipping it skips "
                             "in a replica is made on the sum "
                             "(clipping_hooks.clip_summed_gradients).")),
    Patch("clipping_hooks.clip_summed_gradients", "keras",
          "keras.src.backend.tensorflow.optimizer:TFOptimizer._all_reduce_sum_gradients",
          WRAP, STRATEGY,
          "Clips the cross-replica sum of the gradients (PS table sums on their PS), as "
          "one device clips the whole batch's.",
          params=("self", "grads_and_vars"),
          checks=(NO_CHECKS, "_all_reduce_sum_gradients sums, checking nothing; the patch "
                             "calls it.")),
    Patch("push_hooks.metrics_before_update", "keras",
          "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.train_step", WRAP, SPANS,
          "Keras' own step updates the metrics before it applies the gradients, so that "
          "their state rides with the gradients to the PS (models keeping Keras' "
          "compute_metrics, on a cluster with PS tasks).", params=("self", "data"),
          checks=(RUN, "train_step unpacks and checks the batch as the loss and metrics "
                       "do; the patch calls it on every path.")),
    Patch("push_hooks.update_waits_for_metrics", "keras",
          "keras.src.optimizers.base_optimizer:BaseOptimizer.apply_gradients", WRAP, SPANS,
          "Within that step, the optimizer's apply_gradients waits until the metrics are "
          "updated.", params=("self", "grads_and_vars"),
          checks=(RUN, "apply checks the gradients against the optimizer's variables; the "
                       "patch calls it with the same arguments, later in the same step.")),
    Patch("push_hooks.update_reads_sent", "keras",
          "keras.src.backend.tensorflow.optimizer:TFOptimizer._backend_update_step", WRAP,
          SPANS, "The learning rate and step count the first replica reads ride with its "
          "gradients to the PS tasks whose updates read them.",
          params=("self", "grads", "trainable_variables", "learning_rate"),
          checks=(NO_CHECKS, "_backend_update_step sums and applies, checking nothing; the "
                             "patch calls it.")),
    Patch("side_effect_hooks.order_per_task", "tensorflow",
          "tensorflow.python.framework.auto_control_deps:register_acd_resource_resolver",
          REGISTER, CLUSTER,
          "Orders stateful ops that touch no variable among those of the same task, so "
          "that no worker's step waits for another's.",
          params=("f",),
          checks=(NO_CHECKS, "register_acd_resource_resolver only registers a resolver; no "
                             "user input passes through it.")),
    Patch("side_effect_hooks.outputs_wait_for_this_task", "tensorflow",
          "tensorflow.python.eager.polymorphic_function.transform:FUNC_GRAPH_TRANSFORMS",
          REGISTER, CLUSTER,
          "Makes a function's outputs wait for the stateful ops of the calling task only, "
          "not for a tensor from every task each step.",
          checks=(NO_CHECKS, "A list of graph transforms; no user input passes through it.")),
    Patch("collective_hooks.instance_keys_when_traced", "tensorflow",
          "tensorflow.python.distribute.cross_device_utils:"
          "CollectiveReplicaLauncher._use_unique_instance_key", REPLACE, STRATEGY,
          "A HybridStrategy's own all-reduce launchers (not the class) fix their collective "
          "instance keys when the step is traced: one process traces every replica, so no "
          "key need cross the network each step.", params=("self",),
          why_replaced="the original's answer is what changes: it has no argument or "
          "setting for it.",
          checks=(NO_CHECKS, "It answers whether a call takes a new instance key, checking "
                             "nothing.")),
    Patch("exit_hooks.keep_functions_at_exit", "tensorflow",
          "tensorflow.python.eager.polymorphic_function.atomic_function:RUNTIME_FUNCTION_REFS",
          REPLACE, AT_EXIT, "Lets the interpreter exit without releasing traced functions "
          "one by one: TensorFlow 2.21 cannot release one whose parts run on remote tasks, "
          "and logs an UNIMPLEMENTED error for each.",
          why_replaced="it is the registry of functions to release, not a function: "
          "dropping it is how TensorFlow's own teardown skips the releases.",
          checks=(NO_CHECKS, "A registry of functions to release at exit; nothing is checked.")),
    Patch("export_hooks.no_cluster_devices", "tensorflow",
          "tensorflow.python.saved_model.save:_build_meta_graph", WRAP, CLUSTER,
          "A SavedModel names no device of the cluster (ops pinned to a PS task, as a "
          "hash table's are, are cleared before it is written), so it serves without the "
          "cluster; one that would record variables' cluster devices is refused.",
          params=("obj", "signatures", "options", "meta_graph_def"),
          checks=(RUN, "_build_meta_graph checks the signatures and objects it saves; the "
                       "patch calls it, then clears cluster devices from what it built.")),
    # --- mixed precision ---------------------------------------------------------
    Patch("loss_scaling_hooks.finite_check_by_rows", "keras",
          "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer.check_finite", WRAP,
          STRATEGY, "Checks a PS table's gradient for inf/NaN by its rows' values, where Keras "
          "fills a boolean tensor of the whole table each step (mixed_float16).",
          params=("self", "grads"),
          checks=(RUN, "check_finite is itself a check (every gradient finite); the patch "
                       "calls it with an IndexedSlices' values, the only rows with a gradient, "
                       "so it decides the same.")),
    # --- dynamic vocabularies ----------------------------------------------------
    Patch("dynamic_hooks.slots_recorded", "keras",
          "keras.src.optimizers.base_optimizer:BaseOptimizer.add_variable_from_reference",
          WRAP, DYNAMIC, "Records each slot made from a DynamicEmbedding's rows and its initial "
          "row, so that a newly admitted id's slots restart with its row.",
          params=("self", "reference_variable", "name", "initializer"),
          checks=(NO_CHECKS, "add_variable_from_reference makes a slot like its variable, "
                             "checking nothing; the patch calls it and records the slot.")),
    Patch("dynamic_hooks.slots_recorded_tf_keras", "tf_keras",
          "tf_keras.src.optimizers.optimizer:_BaseOptimizer.add_variable_from_reference",
          WRAP, DYNAMIC, "Records each slot made from a DynamicEmbedding's rows and its initial "
          "row, so that a newly admitted id's slots restart with its row.",
          params=("self", "model_variable", "variable_name", "shape", "initial_value"),
          checks=(NO_CHECKS, "add_variable_from_reference makes a slot like its variable, "
                             "checking nothing; the patch calls it and records the slot.")),
    Patch("dynamic_hooks.slots_recorded_tf_keras_legacy", "tf_keras",
          "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2.add_slot",
          WRAP, DYNAMIC, "Records each slot made from a DynamicEmbedding's rows and its initial "
          "row, so that a newly admitted id's slots restart with its row.",
          params=("self", "var", "slot_name", "initializer", "shape"),
          checks=(RUN, "add_slot refuses a slot made under another strategy than its "
                       "variable's; the patch calls it with the same arguments.")),
)
