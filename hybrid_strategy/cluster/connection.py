"""Connects the chief to a cluster, once per process, and finds every worker's replicas.

```python
from hybrid_strategy.cluster import config as cluster_lib, connection
config = cluster_lib.from_environment()          # TF_CONFIG
worker_devices, ps_devices = connection.devices(config, "hybrid", None, timeout=60)
```
"""

import tensorflow as tf

# TF-private: resolves a device string the way MirroredStrategy does.
from hybrid_strategy.tensorflow_private import device_util

from hybrid_strategy.cluster import config as cluster_lib
from hybrid_strategy.cluster import liveness

LOCAL_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
_CHIEF_JOB = "chief"
# The cluster this process is connected to: TensorFlow keeps one per process.
_connected_cluster = None


def devices(config, architecture, local_devices, timeout):
    """(worker replica devices, ps devices): this machine's when `config` is None,
    else the cluster's, after checking it and connecting this process to it."""
    if config is None:
        return _local_devices(local_devices), [LOCAL_CPU]
    if local_devices is not None:
        raise ValueError(
            "devices= is for single-machine mode; with a cluster, the "
            "replicas are every worker's devices. Remove devices= or unset "
            "TF_CONFIG.")
    _check_cluster(config, architecture)
    return _connect(config, timeout)


def connected_jobs():
    """The job names of the cluster this process is connected to, its own (chief)
    included; empty when it is connected to none."""
    return frozenset({*_connected_cluster, _CHIEF_JOB}) if _connected_cluster else frozenset()


def _local_devices(devices):
    if devices:
        return [device_util.resolve(d) for d in devices]
    return [g.name for g in tf.config.list_logical_devices("GPU")] or [LOCAL_CPU]


def _check_cluster(config, architecture):
    if config.task_type not in (None, _CHIEF_JOB):
        raise cluster_lib.ClusterConfigError(
            f"This process is /job:{config.task_type}/task:{config.task_index} in "
            "TF_CONFIG, but the training program runs on the chief only. Start "
            f"{config.task_type} tasks with `python -m hybrid_strategy.server` and "
            "run this program with TF_CONFIG's task set to {\"type\": \"chief\", "
            "\"index\": 0}.")
    if config.num_workers < 1:
        raise cluster_lib.ClusterConfigError(
            "The cluster has no `worker` task: HybridStrategy replicates training on "
            "workers. Add at least one worker address to TF_CONFIG's cluster.")
    if architecture in ("hybrid", "ps") and config.num_ps < 1:
        raise cluster_lib.ClusterConfigError(
            f"architecture={architecture!r} needs at least one `ps` task, but the "
            f"cluster has {config.num_workers} worker(s) and no ps. Add ps addresses "
            "to TF_CONFIG's cluster, or use architecture='allreduce'.")


def _connect(config, timeout):
    """Connects this process to the cluster; returns (worker devices, ps devices)."""
    global _connected_cluster
    spec = config.as_cluster_spec_dict()
    if _connected_cluster is None:
        cluster_lib.wait_until_servers_forgot_previous_chief()
        cluster_lib.wait_for_tasks(config, timeout)
        tf.config.experimental_connect_to_cluster(
            tf.train.ClusterSpec(spec), job_name=_CHIEF_JOB, task_index=0,
            protocol="grpc", make_master_device_default=False)
        liveness.install_lost_task_hooks(config)
        _connected_cluster = spec
    elif _connected_cluster != spec:
        raise RuntimeError(
            "This process is already connected to another cluster "
            f"({_connected_cluster}); TensorFlow supports one per process. Create "
            "every HybridStrategy of a program with the same cluster.")
    worker_devices = _replica_devices(config.num_workers, tf.config.list_logical_devices())
    ps_devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0"
                  for i in range(config.num_ps)]
    return worker_devices, ps_devices


def _replica_devices(num_workers, devices):
    """Each worker's replicas: its GPUs, else every CPU device its server exposes.

    A server exposes one CPU device unless started with `--cpu-devices N`. Every
    worker must have as many replicas (tf.distribute splits each global batch so).
    """
    per_worker = []
    for index in range(num_workers):
        on_task = [tf.DeviceSpec.from_string(d.name) for d in devices
                   if d.name.startswith(f"/job:worker/replica:0/task:{index}/")]
        gpus = [d for d in on_task if d.device_type == "GPU"]
        cpus = [d for d in on_task if d.device_type == "CPU"]
        chosen = sorted(gpus or cpus, key=lambda d: d.device_index)
        per_worker.append([d.to_string() for d in chosen] or [
            f"/job:worker/replica:0/task:{index}/device:CPU:0"])
    counts = [len(replicas) for replicas in per_worker]
    if len(set(counts)) > 1:
        listed = ", ".join(f"worker {i}: {n}" for i, n in enumerate(counts))
        raise cluster_lib.ClusterConfigError(
            f"The workers have different numbers of replicas ({listed}); every worker needs "
            "as many. Start every worker's server with the same --cpu-devices, or give "
            "every worker as many GPUs.")
    return [device for replicas in per_worker for device in replicas]
