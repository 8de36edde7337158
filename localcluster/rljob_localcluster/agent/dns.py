"""Cluster DNS names as hosts-file lines: the local agent's stand-in for CoreDNS.

Records follow the Kubernetes DNS specification (kubernetes/dns docs/specification.md), computed
from EndpointSlices (written by the real endpointslice controller in kube-controller-manager):
- a Service ``S`` in namespace ``N`` resolves to the addresses of its ready endpoints
  (headless: the pod IPs, as CoreDNS answers; ClusterIP: also the pod IPs, because there is no
  kube-proxy here to route the ClusterIP, so a client must use a port the pod listens on);
- an endpoint with a ``hostname`` (a pod with ``spec.hostname`` and ``spec.subdomain == S``, S
  headless) resolves as ``<hostname>.S.N.svc.<cluster domain>``. Endpoints are ready when the pod
  is ready or the Service sets ``publishNotReadyAddresses``, as with CoreDNS.

hosts files have no search path, so each record is written under several names:
``X.N.svc.<domain>``, ``X.N.svc``, ``X.N``, and in a pod of namespace N also plain ``X``.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DnsRecord",
    "hosts_lines",
    "pod_hosts_file",
    "record_names",
    "records_from_endpoint_slices",
    "replace_managed_block",
    "resolv_conf",
]

LABEL_SERVICE_NAME = "kubernetes.io/service-name"


@dataclass(frozen=True, order=True)
class DnsRecord:
    """``name`` (``S`` or ``<hostname>.S``) in ``namespace`` resolves to ``ip``."""

    namespace: str
    name: str
    ip: str


def records_from_endpoint_slices(slices: Iterable[dict]) -> list[DnsRecord]:
    """DNS records for Services and hostname endpoints from EndpointSlice dicts (IPv4 only).

    An endpoint counts when ``conditions.ready`` is not false (nil means ready, per the API).
    """
    out: set[DnsRecord] = set()
    for s in slices:
        if s.get("addressType", "IPv4") != "IPv4":
            continue
        meta = s.get("metadata") or {}
        svc = (meta.get("labels") or {}).get(LABEL_SERVICE_NAME)
        if not svc:
            continue
        ns = meta.get("namespace", "default")
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for ip in ep.get("addresses") or []:
                out.add(DnsRecord(ns, svc, ip))
                if ep.get("hostname"):
                    out.add(DnsRecord(ns, f"{ep['hostname']}.{svc}", ip))
    return sorted(out)


def record_names(record: DnsRecord, cluster_domain: str, local_namespace: str | None = None) -> list[str]:
    """Every hosts-file name of ``record``; plain ``X`` only for pods in ``local_namespace``."""
    base = f"{record.name}.{record.namespace}"
    names = [f"{base}.svc.{cluster_domain}", f"{base}.svc", base]
    if local_namespace == record.namespace:
        names.append(record.name)
    return names


def hosts_lines(records: Iterable[DnsRecord], cluster_domain: str, local_namespace: str | None = None) -> list[str]:
    """``<ip>\\t<names...>`` lines, one per address, sorted by address then name."""
    by_ip: dict[str, list[str]] = defaultdict(list)
    for r in sorted(records):
        for n in record_names(r, cluster_domain, local_namespace):
            if n not in by_ip[r.ip]:
                by_ip[r.ip].append(n)
    return [f"{ip}\t{' '.join(names)}" for ip, names in sorted(by_ip.items(), key=lambda kv: ipaddress.ip_address(kv[0]))]


def pod_hosts_file(pod: dict, pod_ip: str, records: Iterable[DnsRecord], cluster_domain: str) -> str:
    """The /etc/hosts a pod sees: kubelet's managed content (localhost, the pod's own
    ``<hostname>[.<subdomain>.<ns>.svc.<domain>]``, hostAliases) plus the cluster names."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    ns = meta.get("namespace", "default")
    hostname = spec.get("hostname") or meta.get("name", "")
    lines = [
        "# Kubernetes-managed hosts file (rljob local node agent).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
    ]
    if spec.get("subdomain"):
        lines.append(f"{pod_ip}\t{hostname}.{spec['subdomain']}.{ns}.svc.{cluster_domain}\t{hostname}")
    else:
        lines.append(f"{pod_ip}\t{hostname}")
    aliases = spec.get("hostAliases") or []
    if aliases:
        lines.append("")
        lines.append("# Entries added by HostAliases.")
        for a in aliases:
            names = "\t".join(a.get("hostnames") or [])
            lines.append(f"{a['ip']}\t{names}")
    lines.append("")
    lines.append("# Cluster DNS names (rljob local node agent; stands in for CoreDNS).")
    lines += hosts_lines(records, cluster_domain, ns)
    return "\n".join(lines) + "\n"


def resolv_conf() -> str:
    """A pod's /etc/resolv.conf: no reachable name server, so a name missing from /etc/hosts fails
    at once (the pod network has no route to the host's resolver) instead of timing out."""
    return "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def replace_managed_block(text: str, lines: list[str], tag: str) -> str:
    """``text`` (a hosts file) with the block between ``# BEGIN <tag>`` and ``# END <tag>``
    replaced by ``lines``; the block is appended when absent and removed when ``lines`` is empty.
    Everything outside the block is kept byte for byte."""
    begin, end = f"# BEGIN {tag}", f"# END {tag}"
    kept: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\n")
        if stripped == begin:
            inside = True
            continue
        if inside and stripped == end:
            inside = False
            continue
        if not inside:
            kept.append(line)
    out = "".join(kept)
    if lines:
        if out and not out.endswith("\n"):
            out += "\n"
        out += "\n".join([begin, *lines, end]) + "\n"
    return out
