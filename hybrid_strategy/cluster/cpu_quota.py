"""The CPU share a process may use, from its cgroup's quota, and thread pools sized for it.

    quota = cpu_quota()            # e.g. 0.33 in a container limited to a third of a core
    intra, inter = pool_sizes(quota)

TensorFlow sizes its thread pools for the cores the process may be scheduled on, not for
a CFS quota (Kubernetes' CPU limit, `docker --cpus`): a server limited to a third of a core
on a 2-core host then runs two intra-op threads and more inter-op threads, which spend the
quota in bursts and wait for the next period. Measured with benchmarks/quota_study.py.
"""

import math
import os

V2_MOUNT = "/sys/fs/cgroup"
V1_MOUNTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpuacct,cpu")
# TensorFlow's inter-op pool runs whole ops, some of which block until others have run:
# with one thread ParameterServerStrategy-style steps never finish.
MIN_INTER_OP_THREADS = 2


def cpu_quota(proc_cgroup="/proc/self/cgroup", v2_mount=V2_MOUNT, v1_mounts=V1_MOUNTS):
    """Cores' worth of CPU time per period this process's cgroup and its ancestors allow
    (the least of their quotas), or None where none is set or it cannot be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            quotas += _along(v2_mount, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in v1_mounts:
                if os.path.isdir(mount):
                    quotas += _along(mount, path, _v1_quota)
                    break
    return min(quotas) if quotas else None


def pool_sizes(quota):
    """(intra-op, inter-op) threads for a machine of `quota` cores: ceil(quota), at least
    1; inter-op at least MIN_INTER_OP_THREADS."""
    threads = max(1, math.ceil(quota - 1e-9))
    return threads, max(MIN_INTER_OP_THREADS, threads)


def _along(mount, path, read):
    """The quotas of the group at `path` under `mount` and of each ancestor; a process in
    a cgroup namespace sees its own group as the root, so the mount itself is tried too."""
    quotas = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        quota = read(os.path.join(mount, *parts[:depth]))
        if quota is not None:
            quotas.append(quota)
    return quotas


def _v2_quota(group):
    try:
        with open(os.path.join(group, "cpu.max")) as f:
            quota, period = f.read().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(group):
    try:
        with open(os.path.join(group, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(group, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
