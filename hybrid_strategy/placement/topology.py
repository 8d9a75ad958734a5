"""`StepTopology`: the devices a step runs on and how its gradients travel, as one value.

The strategy hands it to the executors that build a step's exchange (communication/),
instead of itself: they read devices and options from it and return what they learn.

```python
from hybrid_strategy.placement.topology import StepTopology
topology = StepTopology(
    replica_devices=("/job:worker/replica:0/task:0/device:CPU:0",
                     "/job:worker/replica:0/task:1/device:CPU:0"),
    ps_devices=("/job:ps/replica:0/task:0/device:CPU:0",))
print(topology.num_workers, topology.dense_sum)      # 2 auto
```
"""

import dataclasses

# Where the dense gradients of mirrored variables are summed across workers.
DENSE_SUMS = ("auto", "ps", "allreduce")


@dataclasses.dataclass(frozen=True)
class StepTopology:
    """The devices of one step and the choices that shape its exchange.

    Args:
        replica_devices: Every replica's device, in replica order (under an asynchronous
            step, its one worker's).
        ps_devices: The PS tasks' devices (the local CPU on one machine).
        dense_sum: "auto" (a PS task sums small dense gradients in the step's
            exchange, communication/hierarchical_allreduce.py `sum_on_ps_pays`),
            "ps" (always, on a cluster) or "allreduce" (never).
        on_cluster: Whether the devices are tasks of a cluster.
    """

    replica_devices: tuple
    ps_devices: tuple
    dense_sum: str = "auto"
    on_cluster: bool = True

    def __post_init__(self):
        if self.dense_sum not in DENSE_SUMS:
            raise ValueError(f"dense_sum={self.dense_sum!r}; use one of {DENSE_SUMS}.")
        object.__setattr__(self, "replica_devices", tuple(self.replica_devices))
        object.__setattr__(self, "ps_devices", tuple(self.ps_devices))

    @property
    def num_replicas(self):
        return len(self.replica_devices)

    @property
    def num_workers(self):
        """The tasks the replicas run on."""
        return len({_task(device) for device in self.replica_devices})

    @property
    def reducer(self):
        """The PS task that sums dense gradients in the step's exchange, or None."""
        return self.ps_devices[0] if self.on_cluster and self.ps_devices else None


def _task(device):
    """'/job:worker/replica:0/task:1/device:CPU:0' -> '/job:worker/replica:0/task:1'."""
    return device.rsplit("/device:", 1)[0]
