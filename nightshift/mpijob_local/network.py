"""The emulated hosts' network: one network namespace per pod, each on a veth to one bridge.

Everything lives in namespaces this module creates: the bridge and the host-side veth ends in a "switch"
namespace of the run, each pod's `eth0` in the pod's namespace. Nothing is added to this machine's own
namespace (no link, address or route), pods have no default route, and their only addresses are in
`10.231.0.0/16` on `eth0`, so traffic stays on the links of the run and cannot reach any other address.

Names: `nsmj<PID>-sw` (the switch, bridge `br0`), `nsmj<PID>-l` (launcher), `nsmj<PID>-w<i>` (worker i),
`nsmj<PID>-s<i>` (service i), where PID is run-mpijob's process id; the host side of pod k's veth is
`v<k>` in the switch namespace. A run killed before it could clean up is cleaned by the next run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nightshift.mpijob_local.errors import HostNotSuitable, ManifestNotSupported

PREFIX = "nsmj"
BRIDGE = "br0"
POD_IFACE = "eth0"
SUBNET_PREFIX_LEN = 16
RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_NETNS_LINE = re.compile(r"^(\S+)")
_STALE = re.compile(rf"^{PREFIX}(\d+)-")


def namespace_name(owner_pid: int, role: str, index: int = 0) -> str:
    """The namespace of a pod: role "launcher", "worker", "service", or "switch"."""
    suffix = {"launcher": "l", "worker": f"w{index}", "service": f"s{index}", "switch": "sw"}[role]
    return f"{PREFIX}{owner_pid}-{suffix}"


def host_veth(slot: int) -> str:
    """The switch-side end of the veth of the pod in `slot` (0: launcher, then workers, then services)."""
    return f"v{slot}"


def address(slot: int) -> str:
    return f"10.231.{slot // 200}.{slot % 200 + 10}"


def parse_rate(rate: str) -> int:
    """A tc rate such as `1gbit` or `100mbit`, in bits per second."""
    match = RATE.fullmatch(rate.strip())
    if not match:
        raise ManifestNotSupported(f"--link-rate {rate!r} must look like 100mbit, 1gbit or 10gbit")
    bits = float(match.group(1)) * RATE_UNITS[match.group(2).lower()]
    if bits < 8000:
        raise ManifestNotSupported(f"--link-rate {rate!r} is below 8kbit")
    return int(bits)


@dataclass(frozen=True)
class LinkShape:
    """What `tc` puts on every link: a rate (both directions), and delay and loss on the way into each host."""

    rate: str | None = None
    delay_ms: float | None = None
    loss_pct: float | None = None

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if self.delay_ms is not None and not 0 <= self.delay_ms <= 60_000:
            raise ManifestNotSupported(f"--link-delay {self.delay_ms} must be between 0 and 60000 ms")
        if self.loss_pct is not None and not 0 <= self.loss_pct <= 100:
            raise ManifestNotSupported(f"--link-loss {self.loss_pct} must be between 0 and 100 percent")

    @property
    def shaped(self) -> bool:
        return bool(self.rate or self.delay_ms or self.loss_pct)


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (CONFIG_NET_SCH_NETEM): tried on the loopback of a throwaway
    network namespace, so nothing of this machine's own network is touched."""
    done = subprocess.run(["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                          capture_output=True, text=True, check=False, timeout=30)
    return done.returncode == 0


@functools.cache
def nft_available() -> bool:
    """Whether nftables' `nft` is installed and the kernel takes a table (tried in a throwaway namespace):
    random loss without netem."""
    if shutil.which("nft") is None:
        return False
    done = subprocess.run(["unshare", "--net", "nft", "add", "table", "inet", "probe"],
                          capture_output=True, text=True, check=False, timeout=30)
    return done.returncode == 0


def nft_loss_rules(loss_pct: float) -> str:
    """An nftables table for a pod's namespace dropping `loss_pct` percent of the packets that arrive on its
    `eth0` at random (numgen, in millionths): netem's `loss` on the way into the host, for kernels without
    netem. It goes with the namespace."""
    threshold = round(loss_pct * 10_000)
    return (f"table inet nightshift_link {{\n"
            f"  chain into_host {{\n"
            f"    type filter hook input priority 0; policy accept;\n"
            f"    iifname \"{POD_IFACE}\" numgen random mod 1000000 < {threshold} drop\n"
            f"  }}\n"
            f"}}\n")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise HostNotSuitable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True,
                          check=False, timeout=30)
    if done.returncode != 0:
        raise HostNotSuitable(f"`tc {' '.join(args)}` in {namespace} failed: {done.stderr.strip()}")


def list_namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [m.group(1) for line in done.stdout.splitlines() if (m := _NETNS_LINE.match(line))]


def namespace_pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def kill_namespaces(namespaces: Iterable[str], *, grace_s: float = 3.0, deadline_s: float = 20.0) -> list[str]:
    """SIGTERM every process in the namespaces, SIGKILL what is left after `grace_s`; the ones still alive.

    Ranks started over ssh outlive their launcher and sshd (ssh does not forward a kill), and a live
    process keeps its namespace and veth after `ip netns del`: they must all be gone first.
    """
    names = list(namespaces)
    start = time.monotonic()
    sig = signal.SIGTERM
    while True:
        alive = {name: namespace_pids(name) for name in names}
        alive = {name: pids for name, pids in alive.items() if pids}
        if not alive:
            return []
        elapsed = time.monotonic() - start
        if elapsed > deadline_s:
            return [f"{name}: pids {pids}" for name, pids in alive.items()]
        if elapsed >= grace_s:
            sig = signal.SIGKILL
        for pids in alive.values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        time.sleep(0.1)


class Network:
    """The switch and the pods' namespaces of one run; `close()` removes all of them."""

    def __init__(self, owner_pid: int) -> None:
        self.owner_pid = owner_pid
        self.switch = namespace_name(owner_pid, "switch")
        self.namespaces: list[str] = []  # pods' namespaces, in creation order

    def create_switch(self) -> None:
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        if name != self.switch:
            self.namespaces.append(name)

    def add_host(self, namespace: str, slot: int) -> str:
        """A namespace with `eth0` on the bridge and its address; returns the address."""
        self._add_namespace(namespace)
        veth = host_veth(slot)
        _ip("-n", self.switch, "link", "add", veth, "type", "veth", "peer", "name", POD_IFACE, "netns", namespace)
        _ip("-n", self.switch, "link", "set", veth, "master", BRIDGE)
        _ip("-n", self.switch, "link", "set", veth, "up")
        # No IPv6 link-local address: a rank must only ever find the pod's IPv4 address on eth0.
        _ip("-n", namespace, "link", "set", POD_IFACE, "addrgenmode", "none", check=False)
        ip = address(slot)
        _ip("-n", namespace, "addr", "add", f"{ip}/{SUBNET_PREFIX_LEN}", "dev", POD_IFACE)
        _ip("-n", namespace, "link", "set", POD_IFACE, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return ip

    def shape(self, namespace: str, slot: int, shape: LinkShape) -> None:
        """Rate on both ends of the host's veth (a full-duplex link); delay and loss into the host (netem on
        the switch side; loss alone on a kernel without netem: an nftables rule inside the pod)."""
        veth = host_veth(slot)
        if shape.rate:
            bits = parse_rate(shape.rate)
            burst = max(bits // 8 // 1000, 16 * 1024)  # 1 ms of traffic: short bursts barely exceed the rate
            tbf = ["tbf", "rate", shape.rate, "burst", str(burst), "latency", "50ms"]
            _tc(self.switch, "qdisc", "add", "dev", veth, "root", "handle", "1:", *tbf)
            _tc(namespace, "qdisc", "add", "dev", POD_IFACE, "root", "handle", "1:", *tbf)
        if shape.loss_pct and not shape.delay_ms and not netem_available():
            done = subprocess.run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=nft_loss_rules(
                shape.loss_pct), capture_output=True, text=True, check=False, timeout=30)
            if done.returncode != 0:
                raise HostNotSuitable(f"nft could not add the loss rule in {namespace}: {done.stderr.strip()}")
        elif shape.delay_ms or shape.loss_pct:
            netem = ["netem", "limit", "100000"]
            if shape.delay_ms:
                netem += ["delay", f"{shape.delay_ms}ms"]
            if shape.loss_pct:
                netem += ["loss", f"{shape.loss_pct}%"]
            parent = ["parent", "1:1", "handle", "10:"] if shape.rate else ["root", "handle", "10:"]
            _tc(self.switch, "qdisc", "add", "dev", veth, *parent, *netem)

    def set_link(self, slot: int, up: bool) -> None:
        """Take the switch side of the pod's veth down or bring it up (a cable pulled, plugged back)."""
        _ip("-n", self.switch, "link", "set", host_veth(slot), "up" if up else "down")

    def link_state(self, namespace: str, slot: int) -> str:
        """"up", or which end is down: "down (switch side)" / "down (pod side)"."""
        switch = _ip("-n", self.switch, "-o", "link", "show", host_veth(slot), check=False).stdout
        pod = _ip("-n", namespace, "-o", "link", "show", POD_IFACE, check=False).stdout
        if not _is_up(switch):
            return "down (switch side)"
        if not _is_up(pod):
            return "down (pod side)"
        return "up"

    def close(self) -> list[str]:
        """Kill every process in the run's namespaces, delete them (links go with them); what could not be."""
        left = kill_namespaces([*self.namespaces, self.switch])
        for name in [*reversed(self.namespaces), self.switch]:
            if name in list_namespaces():
                done = _ip("netns", "del", name, check=False)
                if done.returncode != 0:
                    left.append(f"{name}: {done.stderr.strip()}")
        return left


def _is_up(line: str) -> bool:
    flags = re.search(r"<([^>]*)>", line)
    return flags is not None and "UP" in flags.group(1).split(",") and "state DOWN" not in line


def same_network_namespace(pid: int, namespace_path: str) -> bool:
    """Whether process `pid` is in the network namespace at `namespace_path` (e.g. /run/netns/NAME)."""
    try:
        mine, theirs = os.stat(f"/proc/{pid}/ns/net"), os.stat(namespace_path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def listening(pid: int, port: int, namespace_path: str | None = None) -> bool:
    """Whether a TCP socket listens on `port` in the network namespace of process `pid` (its
    /proc/PID/net/tcp and tcp6): the host accepts connections there, found without connecting (a probe
    connection every second would put a line in sshd's log each time). With `namespace_path`, False while
    `pid` is not in that namespace yet (a pod's process before `ip netns exec` entered it sees this
    machine's own sockets, where an sshd of the machine may listen on the same port)."""
    if namespace_path is not None and not same_network_namespace(pid, namespace_path):
        return False
    local = f":{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[1].endswith(local) and fields[3] == "0A":  # 0A: LISTEN
                return True
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces(existing: Sequence[str] | None = None) -> list[str]:
    """Delete namespaces left by a run-mpijob that died without cleaning up (its PID is gone); their names."""
    stale = []
    for name in existing if existing is not None else list_namespaces():
        match = _STALE.match(name)
        if match and not pid_alive(int(match.group(1))):
            stale.append(name)
    if stale:
        kill_namespaces(stale)
        for name in sorted(stale, key=lambda n: n.endswith("-sw")):
            _ip("netns", "del", name, check=False)
    return stale
