"""An emulated network for benchmark clusters: one network namespace per task.

Where this process may create network namespaces (root, `ip netns`), every task of a
benchmark cluster (chief, each worker, each ps) runs in its own namespace
`hsb-<run>-<task>`, with one interface `eth0` holding 10.77.0.<k>/24. Its other end
(`p-<task>`) is a port of the bridge `hsb-br` inside the namespace `hsb-<run>-net`, so the
tasks reach each other only through that bridge, and nothing else: the namespaces have
no route anywhere else, and the machine's own namespace is not touched. With
`link_gbit`, a `tc ... tbf` qdisc limits both ends of every veth pair to that rate (each
task has a full-duplex link of that speed into a switch), so communication costs what it
costs between machines even when all tasks share two cores.

Bytes on the wire are the bridge ports' counters, read for every task at once by one
`ip -s -j link` in the bridge's namespace: what a task sends is what its port receives.
They count whole Ethernet frames (TCP/IP and Ethernet headers included). IPv6 is off in
every namespace, so no neighbour discovery or router solicitation adds to them.

    with Network(["chief", "worker0", "ps0"], link_gbit=1) as net:
        subprocess.Popen(net.exec_prefix("worker0") + [sys.executable, "-m", ...])
        before = net.counters()

`python -m benchmarks.netem --cleanup` removes every namespace whose name starts with
`hsb-` (with the processes still running inside, which only this harness starts there):
leftovers of a run that was killed with SIGKILL.
"""

import argparse
import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "hsb-"
SUBNET = "10.77.0"  # a /24 used only inside this module's own namespaces
BRIDGE = "hsb-br"
TASK_IFNAME = "eth0"
NETNS_DIR = "/var/run/netns"  # where `ip netns add` names its namespaces
_IP_TIMEOUT = 20.0  # seconds any single ip/tc command may take


class NetemError(RuntimeError):
    """Setting up the emulated network failed."""


def _run(argv, check=True, timeout=_IP_TIMEOUT):
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                         f"{done.stderr.strip()}")
    return done


def available():
    """(True, "") if namespaces, veth pairs, a bridge and tbf work here; else (False, why)."""
    if not sys.platform.startswith("linux"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK)
                   for d in os.environ.get("PATH", "/usr/sbin:/sbin").split(os.pathsep)
                   + ["/usr/sbin", "/sbin"]):
            return False, f"`{tool}` not found (apt-get install -y iproute2)"
    probe = Network(["a"], link_gbit=1, run_id="probe" + secrets.token_hex(2))
    try:
        probe.start()
    except (NetemError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot create a namespace with a veth pair, bridge and tbf: {e}"
    finally:
        probe.close()
    return True, ""


def _tbf(rate_gbit):
    """tc arguments of a token bucket at `rate_gbit`: 4 ms of burst, 50 ms of queue."""
    rate_bytes = rate_gbit * 1e9 / 8
    burst = max(int(rate_bytes * 0.004), 64 * 1024)
    return ["tbf", "rate", f"{rate_gbit * 1000:g}mbit", "burst", str(burst),
            "latency", "50ms"]


class Network:
    """Namespaces, veth pairs and a bridge for `tasks` (names such as "worker0").

    `start()` builds it (and removes it again if that fails); `close()` kills what
    still runs inside its namespaces and deletes them, which deletes the veths and
    the bridge too. `close` runs at interpreter exit as well, and is safe to call twice.
    """

    def __init__(self, tasks, link_gbit=None, run_id=None):
        if len(tasks) > 250:
            raise ValueError("at most 250 tasks fit in one /24")
        if link_gbit is not None and link_gbit <= 0:
            raise ValueError(f"link_gbit must be positive, got {link_gbit}")
        self.tasks = list(tasks)
        self.link_gbit = link_gbit
        self.run_id = run_id or secrets.token_hex(2)
        self.bridge_ns = f"{PREFIX}{self.run_id}-net"
        self._addresses = {task: f"{SUBNET}.{k + 1}" for k, task in enumerate(self.tasks)}
        self._created = []  # namespaces, in creation order
        self._closed = False

    # Names -------------------------------------------------------------------

    def namespace(self, task):
        return f"{PREFIX}{self.run_id}-{task}"

    def address(self, task):
        """The task's IPv4 address inside the emulated network."""
        return self._addresses[task]

    def port(self, task):
        """The bridge-side end of the task's veth pair (in the bridge namespace)."""
        return f"p-{task}"[:15]

    def exec_prefix(self, task):
        """argv prefix running a command in the task's namespace (it execs, same pid).

        `nsenter` enters the network namespace alone, where util-linux has it: `ip netns
        exec` also remounts /sys for the namespace, which hides the cgroup file system
        under it, so a server could not read its CPU quota (hybrid_strategy.server sizes
        its thread pools for it)."""
        if shutil.which("nsenter"):
            return ["nsenter", f"--net={NETNS_DIR}/{self.namespace(task)}", "--"]
        return ["ip", "netns", "exec", self.namespace(task)]

    @property
    def namespaces(self):
        return [self.bridge_ns] + [self.namespace(t) for t in self.tasks]

    # Set-up and tear-down ------------------------------------------------------

    def start(self):
        atexit.register(self.close)
        try:
            self._add_namespace(self.bridge_ns)
            _run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up"])
            for task in self.tasks:
                self._add_task(task)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name):
        if name in list_namespaces():
            raise NetemError(f"namespace {name} exists already; remove leftovers with "
                             "`python -m benchmarks.netem --cleanup`")
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        for key in ("all", "default"):
            _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
                  f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)

    def _add_task(self, task):
        ns, port = self.namespace(task), self.port(task)
        self._add_namespace(ns)
        _run(["ip", "link", "add", port, "netns", self.bridge_ns, "type", "veth",
              "peer", "name", TASK_IFNAME, "netns", ns])
        _run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", BRIDGE])
        _run(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(task)}/24", "dev", TASK_IFNAME])
        _run(["ip", "-n", ns, "link", "set", TASK_IFNAME, "up"])
        if self.link_gbit:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", TASK_IFNAME, "root"]
                 + _tbf(self.link_gbit))
            _run(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", port, "root"]
                 + _tbf(self.link_gbit))

    def close(self):
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for ns in reversed(self._created):
            remove_namespace(ns)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.close()

    # Measurement ---------------------------------------------------------------

    def counters(self):
        """{task: {"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}} as the task sees
        them (its port's rx is the task's tx), all read in one call."""
        done = _run(["ip", "-n", self.bridge_ns, "-s", "-j", "link", "show"])
        by_port = {}
        for link in json.loads(done.stdout):
            stats = link.get("stats64") or link.get("stats")
            if stats:
                by_port[link["ifname"]] = stats
        result = {}
        for task in self.tasks:
            stats = by_port[self.port(task)]
            result[task] = {"tx_bytes": stats["rx"]["bytes"], "rx_bytes": stats["tx"]["bytes"],
                            "tx_packets": stats["rx"]["packets"],
                            "rx_packets": stats["tx"]["packets"]}
        return result

    def qdisc(self, task):
        """`tc qdisc show` of the task's interface (for the record)."""
        return _run(["tc", "-n", self.namespace(task), "qdisc", "show", "dev", TASK_IFNAME],
                    check=False).stdout.strip()


def list_namespaces():
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _namespace_pids(name):
    done = _run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def remove_namespace(name, grace=5.0):
    """Stops the processes inside namespace `name` (SIGTERM, SIGKILL after `grace` s),
    then deletes it; the interfaces inside go with it."""
    pids = _namespace_pids(name)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    for _ in range(50):  # bounded: a namespace is busy until its last process is reaped
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            return
        if name not in list_namespaces():
            return
        time.sleep(0.1)


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def cleanup(prefix=PREFIX):
    """Removes every namespace whose name starts with `prefix`; returns their names."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"only names starting with {PREFIX!r} are this harness's")
    removed = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    for ns in removed:
        remove_namespace(ns)
    return removed


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netem",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cleanup", action="store_true",
                        help=f"remove every namespace named {PREFIX}* and what runs inside")
    parser.add_argument("--check", action="store_true",
                        help="say whether the emulated network can be built here")
    options = parser.parse_args(argv)
    if options.cleanup:
        removed = cleanup()
        print(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}"
                                                        if removed else ""))
        return 0
    ok, why = available()
    print("network namespaces: available" if ok else f"network namespaces: unavailable ({why})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
