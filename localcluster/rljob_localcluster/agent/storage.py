"""Local persistent volumes: a tiny external provisioner for the agent's StorageClass, and the host
directory behind a claim (for pods' ``persistentVolumeClaim`` volumes).

Flow (as with rancher's local-path-provisioner, minus node affinity — every node here is this host):
the agent makes StorageClass ``rljob-local`` (``volumeBindingMode: Immediate``, reclaim Delete),
and marks it the default class when the cluster has none, so claims without a class get it. For a
Pending claim of that class the provisioner creates a ``hostPath`` PersistentVolume under
``<state-dir>/pv/<pv-name>`` with a claimRef; the real PV controller (kube-controller-manager)
binds them. When a claim is deleted the controller releases the PV; the provisioner then deletes
the directory and the PV. Pre-created hostPath/local PVs bind the usual way and work as well.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .kube import ApiException, Kube
from .volumes import VolumeError, host_path_dir

__all__ = ["PROVISIONER", "STORAGE_CLASS", "Provisioner", "claim_host_path", "ensure_storage_class"]

log = logging.getLogger(__name__)

STORAGE_CLASS = "rljob-local"
PROVISIONER = "rljob.dev/local-hostpath"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
SC_PATH = "/apis/storage.k8s.io/v1/storageclasses"


def ensure_storage_class(kube: Kube) -> None:
    """Create StorageClass ``rljob-local``; default only when no other class is the default."""
    classes = kube.get(SC_PATH).get("items") or []
    if any(c["metadata"]["name"] == STORAGE_CLASS for c in classes):
        return
    has_default = any(
        (c["metadata"].get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true" for c in classes
    )
    body = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS, "annotations": {} if has_default else {DEFAULT_CLASS_ANNOTATION: "true"}},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }
    try:
        kube.create(SC_PATH, body)
    except ApiException as e:
        if e.status != 409:
            raise


def pv_for_claim(claim: dict, root: Path) -> dict:
    """The hostPath PersistentVolume that satisfies ``claim`` (pure)."""
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


class Provisioner:
    """Handlers for the PVC and PV informers (see the module doc)."""

    def __init__(self, kube: Kube, root: Path) -> None:
        self.kube = kube
        self.root = root

    def on_claim(self, event_type: str, claim: dict) -> None:
        spec, status = claim.get("spec") or {}, claim.get("status") or {}
        if event_type == "DELETED" or spec.get("volumeName") or status.get("phase") != "Pending":
            return
        if spec.get("storageClassName") != STORAGE_CLASS:
            return
        pv = pv_for_claim(claim, self.root)
        (self.root / pv["metadata"]["name"]).mkdir(parents=True, exist_ok=True)
        try:
            self.kube.create("/api/v1/persistentvolumes", pv)
            log.info("provisioned %s for claim %s/%s", pv["metadata"]["name"], claim["metadata"]["namespace"],
                     claim["metadata"]["name"])
        except ApiException as e:
            if e.status != 409:
                raise

    def on_volume(self, event_type: str, pv: dict) -> None:
        meta, spec = pv["metadata"], pv.get("spec") or {}
        if event_type == "DELETED" or (meta.get("annotations") or {}).get(PROVISIONED_BY) != PROVISIONER:
            return
        if (pv.get("status") or {}).get("phase") != "Released" or spec.get("persistentVolumeReclaimPolicy") != "Delete":
            return
        shutil.rmtree(self.root / meta["name"], ignore_errors=True)
        try:
            self.kube.delete(f"/api/v1/persistentvolumes/{meta['name']}")
        except ApiException as e:
            if e.status != 404:
                raise


def claim_host_path(kube: Kube, namespace: str, claim_name: str) -> str:
    """The host directory behind a bound claim: its PV's hostPath (after the hostPath type checks)
    or local path.

    Raises:
        VolumeError: the claim is missing or not bound yet, or its PV is of another kind.
    """
    claim = kube.get_or_none(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim_name}")
    if claim is None:
        raise VolumeError(f'persistentvolumeclaim "{claim_name}" not found')
    pv_name = (claim.get("spec") or {}).get("volumeName")
    if not pv_name or (claim.get("status") or {}).get("phase") != "Bound":
        raise VolumeError(f'persistentvolumeclaim "{claim_name}" is not bound yet')
    pv = kube.get(f"/api/v1/persistentvolumes/{pv_name}")
    spec = pv.get("spec") or {}
    if "hostPath" in spec:
        return host_path_dir(spec["hostPath"], f"persistentvolume {pv_name}")
    if "local" in spec:
        return host_path_dir({"path": spec["local"]["path"], "type": "Directory"}, f"persistentvolume {pv_name}")
    raise VolumeError(f"persistentvolume {pv_name}: only hostPath and local volumes are supported by the local agent")
