"""Node registration and heartbeats, as kubelet does them (pkg/kubelet/kubelet_node_status.go,
pkg/kubelet/nodelease).

A node is ``Ready`` with fake capacity (cpu, memory, pods, ephemeral-storage and the extended
resource ``nvidia.com/gpu``, so GPU requests schedule and over-asks stay Pending). Liveness is the
Lease ``kube-node-lease/<node>``, renewed every ``heartbeat_seconds``; the node lifecycle
controller in kube-controller-manager marks a node NotReady/Unknown once its lease is older than
its grace period, which is what a lost node looks like.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

from .kube import ApiException, Kube
from .podstatus import rfc3339

__all__ = ["GPU_RESOURCE", "NodeSpec", "lease_object", "node_object", "node_status", "register_node", "renew_lease"]

GPU_RESOURCE = "nvidia.com/gpu"
LEASE_NAMESPACE = "kube-node-lease"
AGENT_LABEL = "rljob.dev/local-node-agent"
RUNTIME_VERSION = "rljob-local-agent://0.1.0"


@dataclass
class NodeSpec:
    """One node the agent stands for. Quantities are Kubernetes quantity strings."""

    name: str
    pod_cidr: str
    internal_ip: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    ephemeral_storage: str = "100Gi"
    gpus: int = 0
    kubelet_port: int = 10250
    kubelet_version: str = "v0.0.0"
    labels: dict = field(default_factory=dict)
    ready_since: str = field(default_factory=rfc3339)
    """lastTransitionTime of the node's conditions (they never change while the agent runs it)."""

    def capacity(self) -> dict[str, str]:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods, "ephemeral-storage": self.ephemeral_storage}
        if self.gpus:
            cap[GPU_RESOURCE] = str(self.gpus)
        return cap


def _microtime(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


def node_status(spec: NodeSpec, now: str | None = None) -> dict:
    """The Node ``status``: capacity = allocatable, conditions with fresh heartbeats, addresses,
    the fake kubelet endpoint and nodeInfo."""
    now = now or rfc3339()

    def cond(ctype: str, ok: bool, reason: str, message: str) -> dict:
        return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
                "lastHeartbeatTime": now, "lastTransitionTime": spec.ready_since}

    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {
        "capacity": spec.capacity(),
        "allocatable": spec.capacity(),
        "conditions": [
            cond("MemoryPressure", False, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", False, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", False, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond("Ready", True, "KubeletReady", "rljob local node agent is posting ready status"),
        ],
        "addresses": [{"type": "InternalIP", "address": spec.internal_ip}, {"type": "Hostname", "address": spec.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": spec.kubelet_port}},
        "nodeInfo": {
            "machineID": spec.name,
            "systemUUID": spec.name,
            "bootID": spec.name,
            "kernelVersion": platform.release(),
            "osImage": "rljob local node agent (processes in namespaces; images are not pulled)",
            "containerRuntimeVersion": RUNTIME_VERSION,
            "kubeletVersion": spec.kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": arch,
        },
    }


def node_object(spec: NodeSpec) -> dict:
    """The Node to create: labels like kubelet's (hostname, os, arch), podCIDR, status."""
    status = node_status(spec)
    arch = status["nodeInfo"]["architecture"]
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": arch,
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": arch,
        AGENT_LABEL: "true",
        **spec.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {"podCIDR": spec.pod_cidr, "podCIDRs": [spec.pod_cidr]},
        "status": status,
    }


def lease_object(node: dict, duration_seconds: int) -> dict:
    """The node's Lease in kube-node-lease, owned by the Node (as kubelet makes it)."""
    name = node["metadata"]["name"]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": LEASE_NAMESPACE,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}],
        },
        "spec": {"holderIdentity": name, "leaseDurationSeconds": duration_seconds, "renewTime": _microtime()},
    }


def register_node(kube: Kube, spec: NodeSpec) -> dict:
    """Create the Node (or adopt an existing one of that name), post its status; returns the Node.

    An existing Node keeps its podCIDR (immutable once set); ``spec.pod_cidr`` is updated to it.
    """
    try:
        node = kube.create("/api/v1/nodes", node_object(spec))
    except ApiException as e:
        if e.status != 409:
            raise
        node = kube.get(f"/api/v1/nodes/{spec.name}")
        spec.pod_cidr = (node.get("spec") or {}).get("podCIDR") or spec.pod_cidr
        if not (node.get("spec") or {}).get("podCIDR"):
            node = kube.patch(f"/api/v1/nodes/{spec.name}", {"spec": {"podCIDR": spec.pod_cidr, "podCIDRs": [spec.pod_cidr]}})
    kube.patch(f"/api/v1/nodes/{spec.name}/status", {"status": node_status(spec)})
    return node


def renew_lease(kube: Kube, node: dict, duration_seconds: int) -> None:
    """Renew (or create) the node's Lease."""
    name = node["metadata"]["name"]
    path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}"
    try:
        kube.patch(path, {"spec": {"holderIdentity": name, "renewTime": _microtime()}}, strategic=False)
    except ApiException as e:
        if e.status != 404:
            raise
        kube.create(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", lease_object(node, duration_seconds))
