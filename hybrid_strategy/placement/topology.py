"""`Topology`: the cluster's devices and the step's configuration, as one frozen value.

The strategy builds it once and hands it (or `of_worker(w)`, for one worker's
asynchronous step) to the executors: communication/, tables/, placement/, input/ and
asynchronous/ read devices and options from it, never from the strategy, and return
what they learn.

```python
from hybrid_strategy.placement.topology import Topology
topology = Topology(
    input_hosts=(("/job:worker/replica:0/task:0/device:CPU:0",
                  ("/job:worker/replica:0/task:0/device:CPU:0",)),
                 ("/job:worker/replica:0/task:1/device:CPU:0",
                  ("/job:worker/replica:0/task:1/device:CPU:0",))),
    ps_devices=("/job:ps/replica:0/task:0/device:CPU:0",))
print(topology.num_workers, topology.reducer, topology.of_worker(1).replica_devices)
```
"""

import dataclasses

# Where the dense gradients of mirrored variables are summed across workers.
DENSE_SUMS = ("auto", "ps", "allreduce")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The devices a strategy runs on and the choices that shape its steps.

    Args:
        input_hosts: `(input device, (its replicas' devices))` of every worker, in
            replica order (a worker's input device is its CPU).
        ps_devices: The PS tasks' devices (the local CPU on one machine).
        on_cluster: Whether the devices are tasks of a cluster (else this machine's).
        dense_sum: "auto" (a PS task sums small dense gradients in the step's
            exchange, communication/hierarchical_allreduce.py `sum_on_ps_pays`),
            "ps" (always, on a cluster) or "allreduce" (never).
        wire_dtype: The dtype rows of PS tables cross in (None: their own).
        sparse_update: Which rows a PS table's update moves, "lazy" or "exact".
        asynchronous: Whether each worker steps on its own (asynchronous/).
    """

    input_hosts: tuple
    ps_devices: tuple
    on_cluster: bool = True
    dense_sum: str = "auto"
    wire_dtype: object = None
    sparse_update: str = "lazy"
    asynchronous: bool = False

    def __post_init__(self):
        if self.dense_sum not in DENSE_SUMS:
            raise ValueError(f"dense_sum={self.dense_sum!r}; use one of {DENSE_SUMS}.")
        object.__setattr__(self, "input_hosts", tuple(
            (host, tuple(replicas)) for host, replicas in self.input_hosts))
        object.__setattr__(self, "ps_devices", tuple(self.ps_devices))

    @property
    def replica_devices(self):
        """Every replica's device, in replica order."""
        return tuple(device for _, replicas in self.input_hosts for device in replicas)

    @property
    def num_replicas(self):
        return len(self.replica_devices)

    @property
    def num_workers(self):
        return len(self.input_hosts)

    @property
    def replicas_per_worker(self):
        return max(len(replicas) for _, replicas in self.input_hosts)

    @property
    def reducer(self):
        """The PS task that sums dense gradients in the step's exchange (all of them,
        unless the step reads ahead: communication/routing.py), or None."""
        return self.ps_devices[0] if self.on_cluster and self.ps_devices else None

    def of_worker(self, worker):
        """This topology narrowed to worker `worker`'s replicas (its asynchronous step)."""
        return dataclasses.replace(self, input_hosts=self.input_hosts[worker:worker + 1])
