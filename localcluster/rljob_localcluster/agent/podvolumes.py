"""One pod's volumes on the host: each volume's directory (made, filled, refreshed, unmounted).

File-backed volumes (configMap, secret, downwardAPI, projected) are written under
``<pod dir>/volumes/<name>`` and refreshed once a minute (ConfigMap/Secret updates, token
rotation, as kubelet's volume manager does); emptyDir is a directory there (a tmpfs for
``medium: Memory``); hostPath and persistentVolumeClaim volumes are host directories used in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from kubernetes.utils import parse_quantity

from . import storage
from .kube import ApiException, Kube
from .mountpoints import mount_tmpfs, unmount
from .node import NodeSpec
from .podenv import ObjectSource
from .volumes import (
    VolumeError,
    VolumeFile,
    downward_files,
    host_path_dir,
    key_files,
    projected_files,
    write_files,
)

__all__ = ["RESYNC_SECONDS", "PodVolumes"]

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0
TOKEN_REFRESH_FRACTION = 0.8
"""A projected token is requested again after this fraction of its lifetime (kubelet: 80%)."""


class PodVolumes:
    """The volumes of one pod.

    Args:
        kube: API access (TokenRequest, claims).
        source: where ConfigMaps and Secrets come from.
        pod_dir: the pod's directory on the host.
        node: the node the pod runs on (host IP, allocatable for the downward API).
        on_tmpfs: called after a tmpfs was mounted (the worker records it for crash cleanup).
    """

    def __init__(self, kube: Kube, source: ObjectSource, pod_dir: Path, node: NodeSpec, on_tmpfs: Callable[[], None]) -> None:
        self.kube = kube
        self.source = source
        self.pod_dir = pod_dir
        self.node = node
        self.on_tmpfs = on_tmpfs
        self.dirs: dict[str, str] | None = None
        """Volume name → host directory, once :meth:`setup` succeeded."""
        self.read_only: set[str] = set()
        """Volumes always mounted read-only (file-backed kinds, read-only claims)."""
        self.tmpfs: list[str] = []
        self._tokens: dict[tuple[str, int], tuple[bytes, float]] = {}
        self._synced = 0.0

    def _token_source(self, pod: dict) -> Callable[[str, int], bytes]:
        meta = pod["metadata"]
        ns, sa = meta["namespace"], (pod.get("spec") or {}).get("serviceAccountName") or "default"

        def token(audience: str, expiration: int) -> bytes:
            cached = self._tokens.get((audience, expiration))
            if cached and time.time() < cached[1]:
                return cached[0]
            body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
                "audiences": [audience] if audience else [], "expirationSeconds": expiration,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
            try:
                resp = self.kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", body)
            except ApiException as e:
                raise VolumeError(f"TokenRequest for service account {ns}/{sa} failed: {e.status} {e.reason}") from e
            value = resp["status"]["token"].encode()
            self._tokens[(audience, expiration)] = (value, time.time() + TOKEN_REFRESH_FRACTION * expiration)
            return value

        return token

    def _files(self, pod: dict, vol: dict, pod_ip: str) -> list[VolumeFile] | None:
        """Files of a file-backed volume, or None for the other kinds."""
        name, ns = vol["name"], pod["metadata"]["namespace"]
        common = {"volume": name, "pod_ip": pod_ip, "host_ip": self.node.internal_ip,
                  "node_allocatable": self.node.capacity()}
        if "configMap" in vol:
            ref = vol["configMap"]
            return key_files("ConfigMap", self.source.config_map(ns, ref.get("name", "")), ref,
                             ref.get("defaultMode"), volume=name, namespace=ns)
        if "secret" in vol:
            ref = vol["secret"]
            return key_files("Secret", self.source.secret(ns, ref.get("secretName", "")), ref,
                             ref.get("defaultMode"), volume=name, namespace=ns)
        if "downwardAPI" in vol:
            d = vol["downwardAPI"]
            return downward_files(pod, d.get("items") or [], d.get("defaultMode"), **common)
        if "projected" in vol:
            return projected_files(pod, vol["projected"], self.source, self._token_source(pod), **common)
        return None

    def setup(self, pod: dict, pod_ip: str) -> None:
        """Make every volume of ``pod``; sets :attr:`dirs` when all are ready.

        Raises:
            VolumeError: a volume cannot be made yet (missing object, unbound claim, ...) or its
                type is not supported; retry later.
            ApiException: the API server failed.
        """
        dirs: dict[str, str] = {}
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            name = vol["name"]
            vdir = self.pod_dir / "volumes" / name
            files = self._files(pod, vol, pod_ip)
            if files is not None:
                write_files(vdir, files)
                self.read_only.add(name)
                dirs[name] = str(vdir)
            elif "emptyDir" in vol:
                vdir.mkdir(parents=True, exist_ok=True)
                ed = vol["emptyDir"] or {}
                if ed.get("medium") == "Memory" and str(vdir) not in self.tmpfs:
                    size = str(int(parse_quantity(ed["sizeLimit"]))) if ed.get("sizeLimit") else "50%"
                    try:
                        mount_tmpfs(str(vdir), size)
                    except OSError as e:
                        raise VolumeError(f"volume {name!r}: {e}") from e
                    self.tmpfs.append(str(vdir))
                    self.on_tmpfs()
                dirs[name] = str(vdir)
            elif "hostPath" in vol:
                dirs[name] = host_path_dir(vol["hostPath"], name)
            elif "persistentVolumeClaim" in vol:
                ref = vol["persistentVolumeClaim"]
                dirs[name] = storage.claim_host_path(self.kube, pod["metadata"]["namespace"], ref["claimName"])
                if ref.get("readOnly"):
                    self.read_only.add(name)
            else:
                kinds = sorted(k for k in vol if k != "name")
                raise VolumeError(f"volume {name!r}: type {kinds} is not supported by the local node agent")
        self.dirs = dirs
        self._synced = time.monotonic()

    def resync(self, pod: dict, pod_ip: str) -> None:
        """Rewrite file-backed volumes when :data:`RESYNC_SECONDS` have passed; failures are logged."""
        if time.monotonic() - self._synced < RESYNC_SECONDS:
            return
        self._synced = time.monotonic()
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            try:
                files = self._files(pod, vol, pod_ip)
                if files is not None:
                    write_files(self.pod_dir / "volumes" / vol["name"], files)
            except (VolumeError, ApiException) as e:
                log.warning("pod %s/%s: volume %s not refreshed: %s", pod["metadata"]["namespace"],
                            pod["metadata"]["name"], vol["name"], e)

    def teardown(self) -> None:
        """Unmount the tmpfs volumes (the pod directory is the worker's to remove)."""
        for point in self.tmpfs:
            unmount(point)
        self.tmpfs = []
