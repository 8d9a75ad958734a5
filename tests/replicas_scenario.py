"""Several replicas per worker, and input from the tf.data service: a chief program.

Run by tests/test_replicas.py as the chief of a launcher cluster of 2 workers with 2 CPU
devices each, 1 ps and a tf.data service of 2 workers; prints its report as JSON (one line):

    python -m hybrid_strategy.launch --workers 2 --devices-per-worker 2 --ps 1 \\
        --data-service-workers 2 -- python tests/replicas_scenario.py

- equivalence: scenario.py's cases (tables on the PS, dense layers, optimizers with
  slots) on the 4 replicas, against single-device training;
- aggregation: where a traced step sums a table's sparse gradients (per worker, then
  on the ps) and a dense kernel's (per worker, then all-reduced across workers, or with
  the strategy's default, summed on the ps);
- counting: every example used once in an epoch with a final partial batch;
- the tf.data service: a dataset preprocessed by the service's workers, 3 epochs, each
  element used once per epoch (counted), and the steps each epoch took;
- asynchronous (Keras 3): tests/async_scenario.py's cases for 2 workers, trained
  asynchronously (`architecture="ps", asynchronous=True`), each worker's step split over
  its 2 replicas (tests/test_asynchronous.py reads them).

It prints the report, then kills the dispatcher and trains on: the chief must then exit
with code 75 (the strategy's health monitor probes the dispatcher), which the launcher
passes on.
"""

import collections
import functools
import json
import os
import signal
import sys

import numpy as np
import tensorflow as tf

import async_scenario
import scenario
from hybrid_strategy.communication import hierarchical_allreduce

keras = tf.keras
EQUIVALENCE = ("adagrad", "adam_lazy")
SERVICE_EXAMPLES = 131  # a final partial batch; workers get different numbers of batches
SERVICE_BATCH = 8
SERVICE_EPOCHS = 3


def aggregation_case(make_strategy, dense_sum="allreduce"):
    """Devices of the ops that sum a table's sparse gradient and a dense kernel's gradient
    over the replicas in a traced step."""
    strategy = make_strategy(dense_sum=dense_sum)
    with strategy.scope():
        model = scenario.build_model()
    table = scenario.raw_variable(model.get_layer("embedding").embeddings)
    kernel = scenario.raw_variable(model.get_layer("hidden").kernel)
    ids = scenario.make_data(scenario.GLOBAL_BATCH)[0]
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(ids).batch(scenario.GLOBAL_BATCH))))

    @tf.function
    def summed(batch):
        def gradients(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            return tape.gradient(loss, [table, kernel])

        per_replica = strategy.run(gradients, args=(batch,))
        return strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, list(zip(per_replica, [table, kernel])))

    ops = {}
    for op in summed.get_concrete_function(batch).graph.get_operations():
        for scope, op_type in (("local_aggregation", "ConcatV2"), ("ps_aggregation", "ConcatV2"),
                               ("local_sum", "AddN"), ("exchange", "AddV2"),
                               ("ps_dense_sum", "AddN"), ("", "CollectiveReduceV2")):
            if scope in op.name and op.type == op_type:
                ops.setdefault(scope or op_type, []).append(
                    [op.device, len(op.inputs) - (op_type == "ConcatV2")])  # less the axis

    @tf.function
    def summed_large():
        elements = hierarchical_allreduce.SMALL_BYTES // 4 + 1  # float32
        per_replica = strategy.run(lambda: tf.zeros([elements]))
        return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM,
                                                 [(per_replica, kernel)])

    large = collections.Counter(op.type for op in
                                summed_large.get_concrete_function().graph.get_operations()
                                if op.type == "CollectiveReduceV2" or "doubling" in op.name)
    return {"replicas": list(strategy.extended.worker_devices), "ops": ops,
            "large": dict(large)}


class SumOfOutputs(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_sum(y_pred, axis=-1)


def service_case(make_strategy):
    """3 epochs of a dataset read from the tf.data service; uses of each element per epoch.

    Example i moves only row i of a zero table, by exactly -1 per use (SGD at rate 1 on
    the sum of outputs), so each epoch's change of the table counts the uses.
    """
    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    strategy = make_strategy()
    n = SERVICE_EXAMPLES
    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(1,), dtype="int64"),
            keras.layers.Embedding(n, 1, embeddings_initializer="zeros", name="rows"),
            keras.layers.Flatten(),
        ])
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=SumOfOutputs(reduction="sum"))
    dataset = tf.data.Dataset.range(n).map(
        lambda i: (tf.reshape(i, [1]), tf.zeros([1]))).batch(SERVICE_BATCH)
    dataset = dataset.apply(tf.data.experimental.service.distribute(
        processing_mode="distributed_epoch", service=hybrid_strategy.data_service_address(),
        job_name="count"))
    tables, steps = [model.get_weights()[0][:, 0]], [0]

    def epoch_end(epoch, logs):
        tables.append(model.get_weights()[0][:, 0])
        steps.append(0)

    def batch_end(batch, logs):
        steps[-1] += 1

    model.fit(dataset, epochs=SERVICE_EPOCHS, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(on_train_batch_end=batch_end, on_epoch_end=epoch_end)])
    uses = [np.round(before - after, 6).tolist() for before, after in zip(tables, tables[1:])]
    return {"uses_per_epoch": uses, "steps_per_epoch": steps[:-1],
            "pids": os.environ["HYBRID_STRATEGY_SERVER_PIDS"]}


def lose_the_dispatcher(make_strategy):
    """Kills the tf.data service dispatcher and trains on: the chief must exit with 75."""
    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    strategy = make_strategy(task_timeout=5)
    with strategy.scope():
        model = keras.Sequential([keras.Input(shape=(1,), dtype="int64"),
                                  keras.layers.Embedding(10, 1), keras.layers.Flatten()])
        model.compile(optimizer="sgd", loss="mse")
    dataset = tf.data.Dataset.range(10).map(
        lambda i: (tf.reshape(i, [1]), tf.zeros([1]))).repeat().batch(SERVICE_BATCH)
    dataset = dataset.apply(tf.data.experimental.service.distribute(
        processing_mode="distributed_epoch", service=hybrid_strategy.data_service_address(),
        job_name="lost"))
    # Servers in launcher order: workers, ps, the dispatcher, tf.data service workers.
    dispatcher = int(os.environ["HYBRID_STRATEGY_SERVER_PIDS"].split(",")[3])

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                os.kill(dispatcher, signal.SIGKILL)

    model.fit(dataset, epochs=1, steps_per_epoch=100_000, verbose=0, callbacks=[Kill()])
    print("training went on without the dispatcher", flush=True)


def main():
    import hybrid_strategy  # pylint: disable=import-outside-toplevel

    make_strategy = functools.partial(hybrid_strategy.HybridStrategy,
                                      min_shard_bytes=scenario.MIN_SHARD_BYTES)
    report = {name: scenario.equivalence_case(make_strategy, *scenario.CASES[name])
              for name in EQUIVALENCE}
    report["count"] = scenario.counting_case(make_strategy, "dataset")
    report["aggregation"] = aggregation_case(make_strategy)
    report["aggregation_on_ps"] = aggregation_case(make_strategy, dense_sum="auto")
    report["service"] = service_case(make_strategy)
    if not async_scenario.LEGACY:
        report["asynchronous"] = async_scenario.report(
            functools.partial(make_strategy, architecture="ps", asynchronous=True), workers=2)
    print(json.dumps(report), flush=True)
    lose_the_dispatcher(make_strategy)


if __name__ == "__main__":
    main()
