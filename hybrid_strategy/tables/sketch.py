"""Counts of the ids waiting for admission, in a count-min sketch of a fixed size.

With `admission="sketch"`, a dynamic table (dynamic.py) keeps no map entry for an id
that has no row yet: it counts the id's sightings in `depth` rows of `width` counters,
each a few bits wide, on the task taking the table's decisions. An id's counters are
one per row, chosen by a hash of its int64 key (strings are keyed by their
fingerprint first, `dynamic.keys_of`) salted per row, and its count is the least of
them. A step raises each counter of a waiting id to the id's count, if lower
(conservative update), so a count is never below the id's sightings until halved
(below): an id is admitted no later than exact counting would admit it. It may be admitted earlier
when other ids raised all of its counters: an id seen fewer than `min_count` times
is admitted only if each of its `depth` counters is shared with another id, with
odds of at most the product of the rows' shares of nonzero counters. The sketch
keeps that share at most `error ** (1 / depth)` per row on average: when more
counters are nonzero after a step, every counter is halved (an id's count with it,
rounded down) until few enough are, as TinyLFU ages its counts. So at every step,
each waiting id is admitted early with odds of at most `error`, whatever the stream.

Sized for `max_waiting` ids at once, as a Bloom filter is: `depth` =
ceil(log2(1 / error)) rows of `width` = max_waiting / -ln(1 - error ** (1 / depth))
counters (about 9.6 counters per id at error 0.01), each of the fewest bits in 2, 4,
8, 16 that hold `min_count` (counts stop there). About max_waiting distinct ids fill
it up to its limit, so counts halve about as often as exact counting forgets its
oldest waiting ids. `nbytes` is its memory, fixed at construction.

Every update is a function of the step's multiset of ids (a maximum over the
counters each id touches), so N workers write the same counters one device writes.

```python
import tensorflow as tf
from hybrid_strategy.tables import sketch
counts = sketch.WaitingSketch(max_waiting=1000, min_count=3, error=0.01,
                              device="/cpu:0", name="s")
keys = tf.constant([5, 7], tf.int64)
counts.add(keys, tf.constant([2, 1], tf.int64))
print(counts.estimate(keys).numpy(), counts.nbytes)   # [2 1] 2424
```
"""

import math

import numpy as np
import tensorflow as tf

from hybrid_strategy.tables import remap_ops

# Counter widths, in bits: a word of 64 bits holds 64 // bits counters.
_WIDTHS = (2, 4, 8, 16)
_WORD = 64


def layout(max_waiting, min_count, error):
    """(depth, width, bits) of a sketch for `max_waiting` ids, admitting early with odds
    of at most `error`, counting up to `min_count`; refuses what cannot be built."""
    if not 0 < error < 1:
        raise ValueError(f"admission_error={error!r}: give odds between 0 and 1 (0.01: one "
                         "waiting id in a hundred admitted before its min_count).")
    if min_count < 2:
        raise ValueError("admission='sketch' counts ids waiting for their min_count "
                         f"sightings: with min_count={min_count} no id waits; use "
                         "admission='exact'.")
    bits = next((b for b in _WIDTHS if 2**b - 1 >= min_count), None)
    if bits is None:
        raise ValueError(f"admission='sketch' counts up to {2**_WIDTHS[-1] - 1} sightings; "
                         f"min_count={min_count} needs admission='exact'.")
    depth = max(1, math.ceil(math.log2(1 / error) - 1e-9))
    share = error ** (1 / depth)
    fields = _WORD // bits
    width = math.ceil(max_waiting / -math.log1p(-share) / fields) * fields
    return depth, width, bits


def nbytes(max_waiting, min_count, error):
    """The bytes of a sketch (`layout`): its counters, and two int64s (the nonzero
    counters, the times halved)."""
    depth, width, bits = layout(max_waiting, min_count, error)
    return depth * width * bits // 8 + 16


class WaitingSketch:
    """The sketch's counters, on `device` (the decisions' task); see the module's doc.

    Not trackable: the table's snapshot saves it (`state`, `restore`), and a SavedModel,
    which only looks ids up, leaves it out.
    """

    def __init__(self, max_waiting, min_count, error, device, name):
        self.depth, self.width, self.bits = layout(max_waiting, min_count, error)
        self.device = device
        self.cap = int(min_count)
        self.fields = _WORD // self.bits
        self.nbytes = nbytes(max_waiting, min_count, error)
        counters = self.depth * self.width
        # Nonzero counters allowed after a step: the rows' average share of them.
        self.limit = int(error ** (1 / self.depth) * counters)
        self.words = remap_ops.variable(tf.zeros([counters // self.fields], tf.int64),
                                        device, f"{name}_sketch")
        self.occupied = remap_ops.variable(tf.constant(0, tf.int64), device,
                                           f"{name}_sketch_occupied")
        self.halvings = remap_ops.variable(tf.constant(0, tf.int64), device,
                                           f"{name}_sketch_halvings")
        # Row r's salt: distinct odd multiples of the golden ratio's 64 bits.
        self._salts = np.array([(0x9E3779B97F4A7C15 * (2 * r + 1)) % 2**64
                                for r in range(self.depth)], np.uint64).view(np.int64)

    def _counters(self, keys):
        """Each key's counter in each row, [n, depth]: row r's are r * width + [0, width)."""
        hashed = remap_ops.mix(tf.bitwise.bitwise_xor(keys[:, None], self._salts[None, :]))
        # The top 32 bits, scaled to [0, width) (Lemire's multiply-shift).
        column = tf.bitwise.right_shift(
            tf.bitwise.right_shift(hashed, tf.constant(32, tf.uint64))
            * tf.constant(self.width, tf.uint64), tf.constant(32, tf.uint64))
        return tf.bitcast(column, tf.int64) + np.arange(self.depth, dtype=np.int64) * self.width

    def _field(self, words, counters):
        """The values of `counters` held in their `words`."""
        shift = counters % self.fields * self.bits
        return tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, shift),
                                      np.int64(2**self.bits - 1))

    def estimate(self, keys):
        """Each key's count (int64): the least of its counters, at most `min_count`."""
        with tf.device(self.device):
            counters = self._counters(keys)
            words = self.words.sparse_read(counters // self.fields)
            return tf.reduce_min(self._field(words, counters), 1)

    def add(self, keys, counts):
        """Raises the counters of distinct `keys` to their `counts` (each key's count
        so far, this step's sightings included; capped at `min_count`) where lower, then
        halves every counter when too many are nonzero. Returns the times it halved
        them, once written."""
        with tf.device(self.device):
            counters = tf.reshape(self._counters(keys), [-1])
            wanted = tf.repeat(tf.minimum(counts, self.cap), self.depth)
            counters, at = tf.unique(counters, out_idx=tf.int64)
            wanted = tf.math.unsorted_segment_max(wanted, at, tf.size(counters))
            old = self._field(self.words.sparse_read(counters // self.fields), counters)
            new = tf.maximum(old, wanted)
            # Each word's counters are rewritten at once: their bits are disjoint, so a
            # sum of them is their union.
            word, at = tf.unique(counters // self.fields, out_idx=tf.int64)
            shift = counters % self.fields * self.bits
            left = tf.bitwise.left_shift
            cleared = tf.math.unsorted_segment_sum(
                left(tf.fill(tf.shape(new), np.int64(2**self.bits - 1)), shift), at,
                tf.size(word))
            written = tf.math.unsorted_segment_sum(left(new, shift), at, tf.size(word))
            kept = tf.bitwise.bitwise_and(self.words.sparse_read(word),
                                          tf.bitwise.invert(cleared))
            raised = tf.reduce_sum(tf.cast((old == 0) & (new > 0), tf.int64))
            with tf.control_dependencies([
                    self.words.scatter_update(tf.IndexedSlices(
                        tf.bitwise.bitwise_or(kept, written), word)),
                    self.occupied.assign_add(raised, read_value=False)]):
                return remap_ops.rarely(self.occupied.read_value() > self.limit, self._halve,
                                        lambda: tf.constant(0, tf.int64))

    def _halve(self):
        """Halves every counter, as many times as it takes to bring the nonzero ones
        down to the limit (once, unless most counters are at `min_count`); returns how
        many times, once written."""
        words = self.words.read_value()
        histogram = self._histogram(words)
        # at_least[v]: counters of at least v; after h halvings, those of at least 2**h
        # are nonzero.
        at_least = tf.concat([tf.cumsum(histogram, reverse=True), [0]], 0)
        nonzero = tf.gather(at_least, [2**h for h in range(self.bits + 1)])
        times = tf.maximum(tf.reduce_sum(tf.cast(nonzero > self.limit, tf.int64)), 1)
        # After h halvings each counter keeps its low bits - h bits: the rest of the
        # word moved into its top ones.
        keep = np.array([sum(((1 << (self.bits - h)) - 1) << (k * self.bits)
                             for k in range(self.fields)) for h in range(self.bits + 1)],
                        np.uint64).view(np.int64)
        halved = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, times),
                                        tf.gather(keep, times))
        with tf.control_dependencies([
                self.words.assign(halved, read_value=False),
                self.occupied.assign(tf.gather(nonzero, times), read_value=False),
                self.halvings.assign_add(times, read_value=False)]):
            return tf.identity(times)

    def _histogram(self, words):
        """How many counters hold each value, [2**bits] (int64).

        One count of the words' bytes (16-bit units for 16-bit counters): which
        counters a byte of each value holds is known beforehand, so a step traces a
        few ops for it, where a count per counter of a word took hundreds.
        """
        unit = max(8, self.bits)
        units = tf.reshape(tf.bitcast(words, tf.uint8 if unit == 8 else tf.uint16), [-1])
        counts = tf.math.bincount(tf.cast(units, tf.int32), minlength=2**unit,
                                  maxlength=2**unit, dtype=tf.int64)
        if unit == self.bits:
            return counts
        # held[v, u]: the counters of value v in a byte of value u.
        u, mask = np.arange(2**unit), 2**self.bits - 1
        held = sum(np.equal.outer(np.arange(2**self.bits), (u >> shift) & mask)
                   for shift in range(0, unit, self.bits)).astype(np.int64)
        return tf.reduce_sum(held * counts, 1)

    # Snapshots -------------------------------------------------------------------

    def state(self):
        """{"sketch": the counters' words, "sketch_counters": [nonzero counters, times
        halved]}."""
        return {"sketch": self.words.read_value(), "sketch_counters": tf.stack(
            [self.occupied.read_value(), self.halvings.read_value()])}

    def restore(self, snapshot):
        """Writes a `state` back; refuses one of another layout."""
        if "sketch" not in snapshot:
            raise ValueError("The snapshot holds no admission sketch: it was saved with "
                             "admission='exact'; restore it into such a table.")
        message = ("The snapshot's admission sketch has another size than this table's: "
                   "restore it into a table of the same max_waiting, admission_error and "
                   "min_count.")
        with tf.device(self.device):
            words = tf.reshape(tf.convert_to_tensor(snapshot["sketch"], tf.int64), [-1])
            if words.shape[0] is not None and words.shape[0] != self.words.shape[0]:
                raise ValueError(message)
            fits = tf.debugging.assert_equal(
                tf.size(words, out_type=tf.int64), tf.constant(self.words.shape[0], tf.int64),
                message=message)
            counters = tf.reshape(tf.convert_to_tensor(snapshot["sketch_counters"], tf.int64),
                                  [2])
            with tf.control_dependencies([fits]):
                return tf.group(self.words.assign(words, read_value=False),
                                self.occupied.assign(counters[0], read_value=False),
                                self.halvings.assign(counters[1], read_value=False))
