"""Single-device references for optimizers on tables: dense-gradient steps and lazy steps.

`train` trains variables on one device without any strategy, each table with an
optimizer of its own (optimizers update each variable on its own, so this is the
step one optimizer takes) and the other variables with one more:
- exact: every gradient made dense (each row once, summed), the optimizer's own
  update, as `sparse_update="exact"` documents;
- lazy: a table's `IndexedSlices` gradient updates a variable holding only the
  step's rows, with the optimizer's state for those rows (`lazy_step`), and the
  other rows keep theirs: the rule `sparse_update="lazy"` documents.
Works with Keras 3 and tf_keras optimizers.
"""

import keras
import numpy as np
import tensorflow as tf


def scaled(optimizer, loss):
    """The loss a Keras 3 LossScaleOptimizer expects gradients of."""
    return optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss


def train(variables, tables, loss_of, batches, factory, lazy):
    """Trains `variables` (`tables` among them) on `batches` with `loss_of(batch)`.

    Returns `{id(table): its optimizer}`.
    """
    table_ids = {id(t) for t in tables}
    others = [v for v in variables if id(v) not in table_ids]
    optimizers = {id(t): factory() for t in tables}
    for table in tables:
        optimizers[id(table)].build([table])
    other_optimizer = factory()
    other_optimizer.build(others)
    for batch in batches:
        with tf.GradientTape() as tape:
            loss = scaled(other_optimizer, loss_of(batch))
        grads = tape.gradient(loss, variables)
        other_optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads, variables) if id(v) not in table_ids])
        for grad, variable in zip(grads, variables):
            if id(variable) not in table_ids:
                continue
            if lazy and isinstance(grad, tf.IndexedSlices):
                lazy_step(factory, optimizers[id(variable)], variable, grad)
            else:
                optimizers[id(variable)].apply_gradients(
                    [(tf.convert_to_tensor(grad), variable)])
    return optimizers


def lazy_step(factory, optimizer, table, grad):
    """`optimizer`'s step on a variable of the gradient's rows only, at its own step."""
    rows, positions = tf.unique(grad.indices)
    summed = tf.math.unsorted_segment_sum(grad.values, positions, tf.shape(rows)[0])
    variable_class = keras.Variable if isinstance(table, keras.Variable) else tf.Variable
    # Named like a table: Muon takes AdamW's step for paths holding "embedding".
    sub = variable_class(tf.gather(values(table), rows), name="embeddings")
    sub_optimizer = factory()
    sub_optimizer.build([sub])
    pairs = list(zip(sub_optimizer.variables, optimizer.variables))
    for mine, whole in pairs:
        mine.assign(tf.gather(values(whole), rows) if whole.shape == table.shape else whole)
    sub_optimizer.apply_gradients([(summed, sub)])
    for mine, whole in pairs + [(sub, table)]:
        if whole.shape == table.shape:
            tf_variable(whole).scatter_update(tf.IndexedSlices(values(mine), rows))
        else:
            whole.assign(mine)


def values(variable):
    return np.array(tf.convert_to_tensor(variable))


def tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def error(actual, expected):
    """max |actual - expected| over max(max |expected|, 0.01)."""
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 0.01))
