"""Pod networking: a Linux bridge on the host and one network namespace per pod, joined to it by a
veth pair, as the CNI ``bridge`` + ``host-local`` plugins set it up on a real node.

Layout (cluster CIDR 10.244.0.0/16 by default): the bridge ``rljob0`` holds the cluster CIDR's
first address (10.244.0.1/16); it is every pod's default gateway and the nodes' InternalIP (all
nodes are this one host). Node ``i`` gets podCIDR number ``i + 1`` of size /24 (10.244.1.0/24, ...)
and its pods take addresses from it. Every pod namespace gets ``lo`` up, ``eth0`` with the pod IP
and a default route via the bridge, so the host reaches every pod IP, pods reach each other, and
each pod has its own port space (servers may bind 0.0.0.0). ``eth0``'s MAC is derived from the pod IP
(:func:`pod_mac`), so a new pod that reuses a released address is reachable at once from neighbour
caches that still hold the old pod's entry.

Everything goes through ``ip`` (iproute2); failures raise :class:`NetworkError` with its stderr.
"""

from __future__ import annotations

import hashlib
import ipaddress
import subprocess
import threading
from dataclasses import dataclass

__all__ = ["Bridge", "IPAllocator", "NetworkError", "PodSandboxNet", "bridge_address", "node_pod_cidrs", "pod_mac"]


class NetworkError(RuntimeError):
    """An ``ip`` command failed (the message carries the command and its stderr)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


def bridge_address(cluster_cidr: str) -> ipaddress.IPv4Interface:
    """The bridge's address: the first host of ``cluster_cidr`` with its prefix (10.244.0.1/16)."""
    net = ipaddress.ip_network(cluster_cidr)
    return ipaddress.ip_interface(f"{next(net.hosts())}/{net.prefixlen}")


def pod_mac(ip: str) -> str:
    """The MAC of the pod interface that holds IPv4 address ``ip``: ``0a:58:`` + the address's four bytes
    (locally administered; the scheme of ovn-kubernetes and of the CNI plugins' former ``hwaddr`` package).

    The allocator hands a released address to the next pod. With a random MAC per pod, the host (probes, the
    log server) and the other pods keep sending to the old pod's MAC from their neighbour caches until the
    entry is re-validated — measured here as 10–25 s in which a managed Redis pod's readiness probe and its
    clients time out. With the MAC a function of the address the cached entry stays right.

    Raises:
        ValueError: ``ip`` is not an IPv4 address.
    """
    packed = ipaddress.IPv4Address(ip).packed
    return "0a:58:" + ":".join(f"{b:02x}" for b in packed)


def node_pod_cidrs(cluster_cidr: str, count: int, prefixlen: int = 24) -> list[str]:
    """podCIDRs of nodes 0..count-1: subnets 1..count of ``cluster_cidr`` (subnet 0 holds the bridge).

    Raises:
        ValueError: the cluster CIDR has too few subnets of that size.
    """
    subnets = ipaddress.ip_network(cluster_cidr).subnets(new_prefix=prefixlen)
    next(subnets)
    out = []
    for _ in range(count):
        try:
            out.append(str(next(subnets)))
        except StopIteration:
            raise ValueError(f"cluster CIDR {cluster_cidr} has room for fewer than {count + 1} /{prefixlen} subnets") from None
    return out


class IPAllocator:
    """Pod IPs from one podCIDR, keyed by pod UID: skips the network address, the first host
    (gateway by convention) and the broadcast address; hands out the lowest free address.
    Thread-safe (pod workers allocate concurrently)."""

    def __init__(self, cidr: str) -> None:
        self.network = ipaddress.ip_network(cidr)
        hosts = list(self.network.hosts())
        self._free = [str(h) for h in hosts[1:]]
        self._used: dict[str, str] = {}
        self._lock = threading.Lock()

    def allocate(self, key: str, prefer: str | None = None) -> str:
        """The address for ``key`` (the same one again while it holds it): ``prefer`` when it is
        free (a pod keeps its address across an agent restart), else the lowest free one.

        Raises:
            NetworkError: the range is exhausted.
        """
        with self._lock:
            if key in self._used:
                return self._used[key]
            if not self._free:
                raise NetworkError(f"no free pod IP left in {self.network}")
            ip = self._free.pop(self._free.index(prefer) if prefer in self._free else 0)
            self._used[key] = ip
            return ip

    def release(self, key: str) -> None:
        with self._lock:
            ip = self._used.pop(key, None)
            if ip is not None:
                self._free.append(ip)
                self._free.sort(key=ipaddress.ip_address)


class Bridge:
    """The host bridge all pod veths attach to."""

    def __init__(self, name: str, address: ipaddress.IPv4Interface) -> None:
        self.name = name
        self.address = address
        self.created = False

    def exists(self) -> bool:
        return _ip("link", "show", "dev", self.name, check=False).returncode == 0

    @property
    def mac(self) -> str:
        """A fixed, locally administered MAC derived from the name. Without one, Linux gives a bridge the lowest
        MAC of its ports, so it changes as pod veths come and go, and pods keep sending to the old gateway MAC
        (a black hole for the ~30 s until their ARP entry is re-validated)."""
        digest = hashlib.sha1(self.name.encode()).hexdigest()[:10]
        return "02:" + ":".join(digest[i:i + 2] for i in range(0, 10, 2))

    def ensure(self) -> None:
        """Create the bridge (unless it exists) with its fixed MAC and its address, and bring it up."""
        if not self.exists():
            _ip("link", "add", self.name, "address", self.mac, "type", "bridge")
            self.created = True
        else:
            _ip("link", "set", "dev", self.name, "address", self.mac)
        self.add_address(str(self.address))
        _ip("link", "set", self.name, "up")

    def add_address(self, cidr: str) -> None:
        """Add ``cidr`` (e.g. the ``kubernetes`` Service IP as /32) to the bridge; idempotent."""
        proc = _ip("addr", "add", cidr, "dev", self.name, check=False)
        if proc.returncode != 0 and "File exists" not in proc.stderr:
            raise NetworkError(f"ip addr add {cidr} dev {self.name}: {proc.stderr.strip()}")

    def delete(self) -> None:
        _ip("link", "del", self.name, check=False)


@dataclass(frozen=True)
class PodSandboxNet:
    """One pod's network namespace (``/run/netns/<netns>``) and host-side veth."""

    netns: str
    veth: str
    ip: str

    @classmethod
    def for_pod(cls, uid: str, ip: str) -> PodSandboxNet:
        digest = hashlib.sha1(uid.encode()).hexdigest()[:10]
        return cls(netns=f"rljob-{digest}", veth=f"rjv{digest}", ip=ip)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def create(self, bridge: Bridge) -> None:
        """Namespace + veth pair (``eth0`` inside, its MAC :func:`pod_mac` of the pod IP) + address + default
        route via the bridge.

        Raises:
            NetworkError: an ``ip`` step failed (what was made is removed again).
        """
        peer = "rjp" + self.veth[3:]
        prefix = bridge.address.network.prefixlen
        try:
            _ip("netns", "add", self.netns)
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", self.netns)
            _ip("-n", self.netns, "link", "set", peer, "name", "eth0", "address", pod_mac(self.ip))
            _ip("-n", self.netns, "addr", "add", f"{self.ip}/{prefix}", "dev", "eth0")
            _ip("-n", self.netns, "link", "set", "lo", "up")
            _ip("-n", self.netns, "link", "set", "eth0", "up")
            _ip("-n", self.netns, "route", "add", "default", "via", str(bridge.address.ip))
            _ip("link", "set", self.veth, "master", bridge.name, "up")
        except NetworkError:
            self.delete()
            raise

    def delete(self) -> None:
        """Remove the namespace and the veth (idempotent; the processes must be gone)."""
        _ip("netns", "del", self.netns, check=False)
        _ip("link", "del", self.veth, check=False)
