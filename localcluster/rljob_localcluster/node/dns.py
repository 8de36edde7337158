"""Cluster DNS objects and a tiny DNS client (readiness checks without dig or nslookup on the host).

CoreDNS runs on the host (host network) and listens on ``<host ip>:<port>``. Pods reach it at the
conventional kube-dns ClusterIP 10.96.0.10:53: a selector-less Service ``kube-system/kube-dns`` and an
EndpointSlice that points at the host address, so kube-proxy routes UDP and TCP 53 there.
"""

from __future__ import annotations

import random
import socket
import struct

from .configs import DNS_SERVICE_IP

__all__ = ["coredns_objects", "query_a"]

COREDNS_USER = "system:coredns"


def coredns_objects(host_ip: str, port: int) -> dict:
    """A v1 List: CoreDNS's RBAC (user ``system:coredns``), the kube-dns Service and its EndpointSlice."""
    labels = {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS", "kubernetes.io/cluster-service": "true"}
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": "system:coredns"},
                "rules": [
                    {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                     "verbs": ["list", "watch"]},
                    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "system:coredns"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": COREDNS_USER}],
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
                "spec": {
                    "clusterIP": DNS_SERVICE_IP,
                    "ports": [
                        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": port},
                        {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": port},
                    ],
                },
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "kube-dns-host",
                    "namespace": "kube-system",
                    "labels": {"kubernetes.io/service-name": "kube-dns",
                               "endpointslice.kubernetes.io/managed-by": "rljob-local-nodes"},
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [host_ip], "conditions": {"ready": True}}],
                "ports": [
                    {"name": "dns", "port": port, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": port, "protocol": "TCP"},
                ],
            },
        ],
    }


def query_a(name: str, server: str = DNS_SERVICE_IP, port: int = 53, timeout: float = 2.0) -> list[str]:
    """IPv4 addresses of ``name`` from ``server``:``port`` over UDP ([] for NXDOMAIN / no answer), waiting up to
    ``timeout`` seconds for the answer. Raises OSError (socket.timeout included) when none comes or it is not
    the answer to this query."""
    qid = random.randrange(65536)
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    q += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(q, (server, port))
        data, _ = s.recvfrom(4096)
    rid, _flags, qd, an, _ns, _ar = struct.unpack(">HHHHHH", data[:12])
    if rid != qid:
        raise OSError("DNS answer with another id")
    off = 12

    def skip_name(o: int) -> int:
        while True:
            n = data[o]
            if n == 0:
                return o + 1
            if n & 0xC0 == 0xC0:
                return o + 2
            o += n + 1

    for _ in range(qd):
        off = skip_name(off) + 4
    out = []
    for _ in range(an):
        off = skip_name(off)
        rtype, _cls, _ttl, rdlen = struct.unpack(">HHIH", data[off:off + 10])
        off += 10
        if rtype == 1 and rdlen == 4:
            out.append(socket.inet_ntoa(data[off:off + 4]))
        off += rdlen
    return out
