"""A HybridStrategy's all-reduce launchers fix their collective instance keys when traced.

By default TensorFlow feeds every all-reduce a new instance key at every call: a
tensor made on this process and sent to every worker, each step, so that workers
tracing at different times agree. Here one process traces every replica, so keys
fixed at trace time agree as well, and none crosses the network. Only the
strategy's own launchers change; TensorFlow's other strategies keep theirs.

```python
from hybrid_strategy.tensorflow_private import collective_util, cross_device_utils
from hybrid_strategy.keras_integration import collective_hooks
keys = cross_device_utils.CollectiveKeys()
launcher = cross_device_utils.CollectiveReplicaLauncher(
    keys.get_group_key(["/cpu:0"]), 1, keys, "/cpu:0", collective_util.Options())
collective_hooks.fix_instance_keys([launcher])   # what HybridStrategy() does to its own
```
"""

from hybrid_strategy.keras_integration import registry


def fix_instance_keys(launchers):
    """Makes each of `launchers` (CollectiveReplicaLauncher) keep its trace-time keys."""
    for launcher in launchers:
        registry.install_on("collective_hooks.instance_keys_when_traced", launcher,
                            lambda use_unique_instance_key: lambda: False)
