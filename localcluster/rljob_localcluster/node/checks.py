"""What the local nodes need from the host before they start, and what on the host they must not take over."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from . import host
from .cleanup import EGRESS_CHAIN
from .configs import CNI_BIN_DIR

if TYPE_CHECKING:
    from ..controlplane import ControlPlane

__all__ = ["CNI_PLUGINS", "REQUIRED_HOST_BINARIES", "host_conflicts", "missing_requirements"]

REQUIRED_HOST_BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "iptables-save",
                          "iptables-restore", "ip", "conntrack")
#: The CNI plugins the nodes' conflist uses, in :data:`configs.CNI_BIN_DIR`.
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")


def missing_requirements(cp: ControlPlane) -> list[str]:
    """What is missing for local nodes on this host with control plane ``cp`` (one sentence each): root,
    the binaries, the CNI plugins, kubelet/kube-proxy/coredns in the control plane's bin dir, and an
    advertise address that pods can reach."""
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (cgroups, network, mounts)")
    problems += [f"'{b}' not found on PATH" for b in REQUIRED_HOST_BINARIES if not shutil.which(b)]
    problems += [f"CNI plugin {CNI_BIN_DIR}/{p} missing" for p in CNI_PLUGINS
                 if not os.access(f"{CNI_BIN_DIR}/{p}", os.X_OK)]
    if not cp.bin_dir:
        problems.append("the control plane is not started")
    else:
        problems += [f"{b} missing in {cp.bin_dir} (run localcluster/build-go-tools.sh)"
                     for b in ("kubelet", "kube-proxy", "coredns") if not (Path(cp.bin_dir) / b).exists()]
    if cp.advertise_address in ("127.0.0.1", "::1", "localhost"):
        problems.append("the control plane advertises a loopback address; kubelets and pods cannot use it: "
                        "start it with ControlPlane(**node_control_plane_options())")
    return problems


def host_conflicts(cidrs: Iterable[str]) -> list[str]:
    """What on this host the nodes would take from someone else (one sentence each): KUBE-* iptables chains
    (another kubelet or kube-proxy: ours would rewrite the same chains, KUBE-SERVICES and the rest), an nftables
    ``kube-proxy`` table (another kube-proxy in nftables mode: ours, in iptables mode, deletes that table when
    it starts), the nodes' own egress chain (nodes of another state dir not cleaned), and routes into
    ``cidrs`` (the Service and pod ranges, which the nodes route to their sink) but the default route."""
    problems = []
    if kube := host.iptables_chains(("KUBE-",)):
        problems.append(f"KUBE-* iptables chains exist already ({', '.join(kube[:6])}{' ...' if len(kube) > 6 else ''})"
                        ": another kubelet or kube-proxy runs in this network namespace, or local nodes were not "
                        "cleaned")
    if ours := host.iptables_chains((EGRESS_CHAIN,)):
        problems.append(f"{', '.join(ours)} exists: local nodes of another state dir were not cleaned")
    if shutil.which("nft"):
        tables = host.run(["nft", "list", "tables"]).stdout.splitlines()
        if kp := [t.strip() for t in tables if t.split()[-1:] == ["kube-proxy"]]:
            problems.append(f"nftables {', '.join(kp)} exists: another kube-proxy (nftables mode) runs here, and "
                            "ours would delete its table")
    for cidr in cidrs:
        if routes := host.routes_over(cidr):
            problems.append(f"the host routes into {cidr}, which the nodes use ({'; '.join(routes)})")
    return problems
