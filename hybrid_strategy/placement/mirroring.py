"""PS tables whose gradient turns out dense become mirrored after Keras' first training step.

A table read by lookup and also whole (a tied output projection,
`ops.matmul(h, ops.transpose(table))`) gets a dense gradient: left on a PS, every
worker would read the whole table and push a dense gradient of it each step, where
an all-reduce moves less (Parallax's rule: a variable whose gradient is dense is
all-reduced). The gradient's type is known only once the step is traced, after the
table's reads were traced into it, so Keras 3's training function
(`moving_after_first_call`, which keras_integration/mirroring_hooks.py puts around
it) runs its first call as traced, then asks the strategy to move such tables
(`Placer.mirror_dense_tables`: values and optimizer slots, the Keras
variables wrap mirrored variables from then on) and, if any moved, makes its
training, evaluation and prediction functions again, which trace the mirrored
variables. The first step is correct either way: a PS table's dense gradient is
all-reduced and applied on its PS.

Custom training loops (`tf.function` + `strategy.run`) keep what they traced: there
the strategy warns instead. tf_keras layers hold the TensorFlow variable itself,
which cannot be replaced under them: there too a table stays, with a warning.

```python
import keras, hybrid_strategy

class TiedLogits(keras.layers.Layer):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))

strategy = hybrid_strategy.HybridStrategy()
with strategy.scope():
    ids = keras.Input((8,), dtype="int32")
    embedding = keras.layers.Embedding(1000, 16)
    logits = TiedLogits(embedding)(keras.layers.Dense(16)(embedding(ids)))
    model = keras.Model(ids, logits)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
# After model.fit's first step, print(strategy.placement) says
# "mirrored  dense gradient (moved after the first step)" for the table.
```
"""

# TF-private: the MirroredVariable class MirroredStrategy's variable creator makes.
from hybrid_strategy.tensorflow_private import values_lib


class MirroredTable(values_lib.MirroredVariable):
    """A mirrored variable that took a PS table's place.

    Keras 3 optimizers know a variable by its TensorFlow variable's `_unique_id`;
    this one keeps the table's, so the optimizer still finds its slots.
    """

    def __init__(self, mirrored, replaced_id):
        super().__init__(mirrored.distribute_strategy, mirrored.values, mirrored.aggregation)
        self._replaced_id = replaced_id

    @property
    def _unique_id(self):
        return self._replaced_id


def mirrored_copy(create_mirrored, table, replaced_id=None):
    """A mirrored variable on every replica holding `table`'s current value, made by
    `create_mirrored(**kwargs)` (the strategy's, without placement).

    The first replica's copy reads the shards from their PS (the chief does not
    hold the table); the others copy it. With `replaced_id`, the copy answers to
    that `_unique_id`. Call it eagerly (under `tf.init_scope()`).
    """
    mirrored = create_mirrored(
        initial_value=table.read_value, dtype=table.dtype, trainable=table.trainable,
        name=table.path.rsplit("/", 1)[-1], aggregation=table.aggregation,
        synchronization=table.synchronization)
    return mirrored if replaced_id is None else MirroredTable(mirrored, replaced_id)


def moving_after_first_call(model, function, placer):
    """`function`, whose first call is followed by the placer's moves, if any.

    Args:
        model: The Keras 3 model whose training function `function` is.
        function: `model.train_function`, as Keras made it.
        placer: The model's strategy's `Placer` (placement/variables.py).
    """

    def first_call(data):
        try:
            with placer.mirroring_after_step():
                return function(data)
        finally:
            if placer.mirror_dense_tables():
                # Every function traced so far reads the tables' old variables.
                model.test_function = model.predict_function = None
                model.make_train_function(force=True)
            else:
                model.train_function = function

    return first_call
