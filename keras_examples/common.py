"""What the examples share: choosing the strategy and timing training steps.

```python
from keras_examples import common
strategy = common.make_strategy("hybrid", "hybrid")   # or "mirrored", "none"
rate = common.StepRate()                              # model.fit(..., callbacks=[rate])
```
"""

import time

import keras
import tensorflow as tf

import hybrid_strategy


class StepRate(keras.callbacks.Callback):
    """Training steps per second of each epoch, validation excluded."""

    def __init__(self):
        super().__init__()
        self.rates = []
        self._start = self._end = None
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        # Keras hands this (not async-safe) callback the step's logs as Python numbers,
        # so the step has finished when the clock is read.
        self._end = time.perf_counter()
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        # Runs after validation; the clock stopped at the last training step.
        if self._steps:
            self.rates.append(self._steps / (self._end - self._start))


def make_strategy(name, architecture):
    """"hybrid": HybridStrategy; "mirrored": tf.distribute.MirroredStrategy; else none."""
    if name == "hybrid":
        return hybrid_strategy.HybridStrategy(architecture=architecture)
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()
