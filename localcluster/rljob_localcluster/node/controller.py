"""The local nodes' small controller, one process for the host (``python -m rljob_localcluster.node.controller``):

- **PersistentVolume provisioner** for the default StorageClass ``rljob-local`` (provisioner
  ``rljob.dev/local-hostpath``, ``volumeBindingMode: Immediate``, reclaim ``Delete``): for a Pending claim of
  that class it makes ``<root>/<pv-name>`` (mode 0777, so non-root pods can write) and a ``hostPath``
  PersistentVolume there with a claimRef; kube-controller-manager's PV controller binds them. Every node
  of the local cluster is this host, so the PVs carry no node affinity and a volume written by a pod on one
  node is read by a pod on another. A Released PV of this provisioner is deleted with its directory.
  (rancher's local-path-provisioner does the same per node.)
- **Fake GPUs**: every node named on the command line gets ``nvidia.com/gpu`` capacity and allocatable,
  patched into its status with a JSON patch as Kubernetes documents for extended resources
  (``PATCH /api/v1/nodes/<name>/status``), and patched again whenever it is missing (a kubelet that
  re-registered a recreated node zeroes extended resources).

It polls the API every second (a handful of objects), so it survives API-server restarts without watch
bookkeeping. It prints "controller ready" once the StorageClass exists.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from .configs import GPU, PROVISIONED_BY, PROVISIONER

STORAGE_CLASS = "rljob-local"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"

log = logging.getLogger("rljob-node-controller")


def ensure_storage_class(storage: client.StorageV1Api) -> None:
    """Create StorageClass ``rljob-local``; the default class unless another class already is."""
    classes = storage.list_storage_class().items
    if any(c.metadata.name == STORAGE_CLASS for c in classes):
        return
    has_default = any((c.metadata.annotations or {}).get(DEFAULT_CLASS_ANNOTATION) == "true" for c in classes)
    body = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS, "annotations": {} if has_default else {DEFAULT_CLASS_ANNOTATION: "true"}},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }
    try:
        storage.create_storage_class(body)
    except ApiException as e:
        if e.status != 409:
            raise


def pv_for_claim(claim: dict, root: Path) -> dict:
    """The hostPath PersistentVolume that satisfies ``claim`` (pure; ``claim`` as the API returns it)."""
    meta, spec = claim["metadata"], claim.get("spec") or {}
    name = f"pvc-{meta['uid']}"
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "annotations": {PROVISIONED_BY: PROVISIONER}},
        "spec": {
            "capacity": {"storage": ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "hostPath": {"path": str(root / name), "type": "DirectoryOrCreate"},
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                         "name": meta["name"], "uid": meta["uid"]},
        },
    }


def gpu_patch(node: dict, gpus: int) -> list[dict]:
    """JSON-patch operations that set ``nvidia.com/gpu`` capacity and allocatable to ``gpus`` ([] when set)."""
    status = node.get("status") or {}
    ops = []
    for field in ("capacity", "allocatable"):
        if str((status.get(field) or {}).get(GPU)) != str(gpus):
            if field not in status:
                ops.append({"op": "add", "path": f"/status/{field}", "value": {}})
            ops.append({"op": "add", "path": f"/status/{field}/nvidia.com~1gpu", "value": str(gpus)})
    return ops


class Controller:
    """The provisioner and the GPU advertiser over one API client.

    Args:
        api: a client of the cluster (admin: it creates PersistentVolumes and patches node status).
        root: host dir of the volumes it provisions (``<nodes state dir>/pv``); it removes a released
            volume's directory only when it lies under ``root``.
        nodes: the nodes to give fake GPUs.
        gpus: ``nvidia.com/gpu`` capacity per node.
    """

    def __init__(self, api: client.ApiClient, root: Path, nodes: list[str], gpus: int) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.storage = client.StorageV1Api(api)
        self.root = root
        self.nodes = nodes
        self.gpus = gpus

    def _dict(self, obj) -> dict:
        return self.api.sanitize_for_serialization(obj)

    def provision(self) -> None:
        """One pass: a directory and a PersistentVolume for each Pending claim of ``rljob-local``; released
        volumes of this provisioner deleted with their directory. Raises ApiException on API errors but
        409 (already made) and 404 (already gone)."""
        for c in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            claim = self._dict(c)
            spec, status = claim.get("spec") or {}, claim.get("status") or {}
            if spec.get("volumeName") or status.get("phase") != "Pending" or spec.get("storageClassName") != STORAGE_CLASS:
                continue
            pv = pv_for_claim(claim, self.root)
            d = self.root / pv["metadata"]["name"]
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o777)
            try:
                self.core.create_persistent_volume(pv)
                log.info("provisioned %s for claim %s/%s", pv["metadata"]["name"], claim["metadata"]["namespace"],
                         claim["metadata"]["name"])
            except ApiException as e:
                if e.status != 409:
                    raise
        for v in self.core.list_persistent_volume().items:
            pv = self._dict(v)
            meta, spec = pv["metadata"], pv.get("spec") or {}
            if (meta.get("annotations") or {}).get(PROVISIONED_BY) != PROVISIONER:
                continue
            if (pv.get("status") or {}).get("phase") != "Released" or spec.get("persistentVolumeReclaimPolicy") != "Delete":
                continue
            path = Path((spec.get("hostPath") or {}).get("path") or "/")
            if path.resolve().is_relative_to(self.root.resolve()) and path.resolve() != self.root.resolve():
                shutil.rmtree(path, ignore_errors=True)  # not another run's dir: clean_host deleted that one
            try:
                self.core.delete_persistent_volume(meta["name"])
                log.info("deleted released %s", meta["name"])
            except ApiException as e:
                if e.status != 404:
                    raise

    def advertise_gpus(self) -> None:
        """One pass: patch ``nvidia.com/gpu`` capacity and allocatable into the status of each registered node
        that lacks them. Raises ApiException on API errors but 404 (node not registered yet)."""
        for name in self.nodes:
            try:
                node = self._dict(self.core.read_node_status(name))
            except ApiException as e:
                if e.status == 404:
                    continue  # not registered yet
                raise
            ops = gpu_patch(node, self.gpus)
            if ops:
                self.core.patch_node_status(name, ops)
                log.info("node %s: %s=%d", name, GPU, self.gpus)

    def run(self, stop: threading.Event, interval: float = 1.0) -> None:
        """Create the StorageClass (retrying each second), print "controller ready", then run both passes every
        ``interval`` seconds until ``stop`` is set; API errors are logged and retried, never raised."""
        self.root.mkdir(parents=True, exist_ok=True)
        while not stop.is_set():
            try:
                ensure_storage_class(self.storage)
                break
            except Exception as e:  # noqa: BLE001 - API not there yet
                log.warning("StorageClass not created yet: %s", e)
                stop.wait(1)
        print("controller ready", flush=True)
        while not stop.is_set():
            for step in (self.advertise_gpus, self.provision):
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - keep going; the API may be restarting
                    log.warning("%s: %s", step.__name__, e)
            stop.wait(interval)


def main(argv: list[str] | None = None) -> int:
    """The controller's command line (see ``--help``); runs until SIGTERM or SIGINT, then returns 0."""
    p = argparse.ArgumentParser(prog="python -m rljob_localcluster.node.controller", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--pv-root", required=True, type=Path, help="host dir of the provisioned volumes")
    p.add_argument("--node", action="append", default=[], help="node to give fake GPUs (repeatable)")
    p.add_argument("--gpus-per-node", type=int, default=4)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    api = config.new_client_from_config(config_file=args.kubeconfig)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Controller(api, args.pv_root, args.node, args.gpus_per_node).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
