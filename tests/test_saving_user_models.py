"""A subclassed model with a layer wrapping Embedding: saved, restored and exported."""

import numpy as np
import tensorflow as tf

import hybrid_strategy

keras = tf.keras


class _Tokens(keras.layers.Layer):
    """Sums a token and a position embedding, as transformer inputs do."""

    def __init__(self, vocab, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.token = keras.layers.Embedding(vocab, dim, name="token")
        self.position = keras.layers.Embedding(length, dim, name="position")

    def call(self, ids):
        return self.token(ids) + self.position(tf.range(tf.shape(ids)[-1]))


class _Classifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = _Tokens(300, 4, 8, name="tokens")
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(1, name="out")

    def call(self, ids):
        return self.out(self.pool(self.tokens(ids)))


def _trained(strategy, ids, y):
    with strategy.scope():
        model = _Classifier(name="classifier")
        model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    model.fit(ids, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


def test_subclassed_model_with_a_wrapping_layer_checkpoints_and_exports(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, (64, 4)).astype("int32")
    y = rng.normal(size=(64, 1)).astype("float32")
    strategy = hybrid_strategy.HybridStrategy(table_shards={"*token/embeddings": 2})
    model = _trained(strategy, ids, y)
    assert str(strategy.placement["classifier/tokens/token/embeddings"].placement) == \
        "2 shards on ps"
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        str(tmp_path / "ckpt"))

    restored = _trained(hybrid_strategy.HybridStrategy(), ids[:16], y[:16])
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
        path).assert_existing_objects_matched()
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Every slot (the tables' on their shards) and the iteration count.
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    assert int(restored.optimizer.iterations.numpy()) == 8  # 2 epochs of 4 steps

    model.export(str(tmp_path / "served"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(served.serve(ids).numpy(), model.predict(ids, verbose=0),
                               rtol=1e-5, atol=1e-6)
