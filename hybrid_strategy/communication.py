"""Sparse gradient aggregation: per-worker local sums, then one sum on the PS.

Dense gradients take TensorFlow's collective all-reduce (see the strategy); this
module holds what TensorFlow has no op for: summing `tf.IndexedSlices` the
Parallax way. Each worker first merges its replicas' slices (duplicate rows summed
once), so only its distinct rows cross the network; the PS that holds the table
then sums the workers' partial sums, again merging duplicate rows, so the
optimizer sees each row once, exactly as a dense gradient would give it.

```python
import tensorflow as tf
from hybrid_strategy import communication
g = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([4, 1, 4]), tf.constant([5, 2]))
print(communication.merge_duplicates(g).indices)   # [4 1]; row 4 summed twice
```
"""

import collections

import tensorflow as tf


def merge_duplicates(slices):
    """Returns `slices` with each row index once and its values summed."""
    unique, positions = tf.unique(slices.indices)
    values = tf.math.unsorted_segment_sum(slices.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def concat_slices(slices_list):
    if len(slices_list) == 1:
        return slices_list[0]
    return tf.IndexedSlices(
        tf.concat([s.values for s in slices_list], 0),
        tf.concat([s.indices for s in slices_list], 0),
        slices_list[0].dense_shape,
    )


def host_of(device):
    """'/job:worker/replica:0/task:1/device:GPU:0' -> its task's CPU device."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def sum_sparse(replica_slices, replica_devices, device, scale=None):
    """Sums per-replica `IndexedSlices` into one `IndexedSlices` placed on `device`.

    Args:
        replica_slices: One `IndexedSlices` per replica.
        replica_devices: The device each replica runs on (same order).
        device: Where the sum is needed (the PS holding the table).
        scale: Optional factor applied to the summed values (1/N for a mean).
    """
    by_host = collections.OrderedDict()
    for slices, replica_device in zip(replica_slices, replica_devices):
        by_host.setdefault(host_of(replica_device), []).append(slices)
    partial_sums = []
    for host, host_slices in by_host.items():
        with tf.device(host), tf.name_scope("local_aggregation"):
            partial_sums.append(merge_duplicates(concat_slices(host_slices)))
    with tf.device(device), tf.name_scope("ps_aggregation"):
        total = merge_duplicates(concat_slices(partial_sums))
        if scale is not None:
            total = tf.IndexedSlices(total.values * scale, total.indices,
                                     total.dense_shape)
    return total
