"""Pod volumes materialised on the host, and each container's mount list.

The agent keeps one directory per volume under ``<state-dir>/pods/<uid>/volumes/<name>`` (or the
volume's own host directory: hostPath, PersistentVolume) and bind-mounts it at the container's
``mountPath`` inside the container's private mount namespace (see ``shim.py``).

File-backed volumes (configMap, secret, downwardAPI, projected incl. the service-account token)
are planned as :class:`VolumeFile` lists by pure functions, then written with atomic renames so a
reader never sees half a file (kubelet's AtomicWriter does the same with a ``..data`` symlink swap).
Source: kubelet pkg/volume/{configmap,secret,downwardapi,projected}.
"""

from __future__ import annotations

import base64
import os
import posixpath
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .podenv import (
    ContainerConfigError,
    ObjectSource,
    expand,
    field_value,
    resource_value,
)

__all__ = [
    "DEFAULT_MODE",
    "Mount",
    "TokenSource",
    "VolumeError",
    "VolumeFile",
    "container_mounts",
    "downward_files",
    "host_path_dir",
    "image_mounts",
    "key_files",
    "projected_files",
    "write_files",
]

DEFAULT_MODE = 0o644
"""defaultMode of configMap/secret/downwardAPI/projected volumes (420 in the API)."""


class VolumeError(Exception):
    """A volume cannot be set up yet (kubelet: event FailedMount, pod stays ContainerCreating)."""


@dataclass(frozen=True)
class VolumeFile:
    """One file of a file-backed volume: ``path`` relative to the volume root, ``data``, ``mode``."""

    path: str
    data: bytes
    mode: int = DEFAULT_MODE


@dataclass(frozen=True)
class Mount:
    """A bind mount the shim makes: host ``source`` at ``target`` inside the container."""

    source: str
    target: str
    read_only: bool = False


TokenSource = Callable[[str, int], bytes]
"""``(audience, expiration_seconds) -> token`` for the pod's service account (TokenRequest API);
``audience`` is "" for the API server's default audiences."""


def _check_rel_path(path: str, volume: str) -> str:
    norm = posixpath.normpath(path)
    if not path or path.startswith("/") or norm.startswith("..") or norm == ".":
        raise VolumeError(f"volume {volume!r}: invalid item path {path!r} (must be relative, without '..')")
    return norm


def _raw_data(kind: str, obj: dict) -> dict[str, bytes]:
    if kind == "ConfigMap":
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


def key_files(
    kind: str, obj: dict | None, ref: dict, default_mode: int | None, *, volume: str, namespace: str
) -> list[VolumeFile]:
    """Files of a configMap/secret volume (or projected source) ``ref`` over object ``obj``.

    Without ``items`` every key becomes a file named after it; with ``items`` only the listed keys,
    at their ``path`` with their ``mode``. ``kind`` is "ConfigMap" or "Secret"; ``ref`` holds
    ``name`` (``secretName`` for secret volumes), ``items``, ``optional``.

    Raises:
        VolumeError: the object (or an item's key) is missing and the reference is not optional.
    """
    name = ref.get("name") or ref.get("secretName") or ""
    optional = bool(ref.get("optional"))
    mode = DEFAULT_MODE if default_mode is None else default_mode
    if obj is None:
        if optional:
            return []
        raise VolumeError(f'volume {volume!r}: {kind.lower()} "{name}" not found in namespace {namespace!r}')
    data = _raw_data(kind, obj)
    items = ref.get("items")
    if not items:
        return [VolumeFile(_check_rel_path(k, volume), v, mode) for k, v in sorted(data.items())]
    files = []
    for item in items:
        key = item["key"]
        if key not in data:
            if optional:
                continue
            raise VolumeError(f"volume {volume!r}: {kind.lower()} {namespace}/{name} has no key {key!r}")
        files.append(VolumeFile(_check_rel_path(item["path"], volume), data[key], item.get("mode", mode)))
    return files


def downward_files(
    pod: dict,
    items: list[dict],
    default_mode: int | None,
    *,
    volume: str,
    pod_ip: str = "",
    host_ip: str = "",
    node_allocatable: Mapping[str, str] | None = None,
) -> list[VolumeFile]:
    """Files of a downwardAPI volume (or projected source): one per item, from ``fieldRef`` or
    ``resourceFieldRef`` (``containerName`` required, as the API validates).

    Raises:
        VolumeError: an unsupported field or resource, or an unknown container.
    """
    mode = DEFAULT_MODE if default_mode is None else default_mode
    containers = {c["name"]: c for c in (pod.get("spec") or {}).get("containers") or []}
    files = []
    for item in items:
        try:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
            else:
                ref = item["resourceFieldRef"]
                if ref.get("containerName") not in containers:
                    raise ContainerConfigError(f"container {ref.get('containerName')!r} not found")
                value = resource_value(
                    containers[ref["containerName"]], ref["resource"], ref.get("divisor"), node_allocatable or {}
                )
        except ContainerConfigError as e:
            raise VolumeError(f"volume {volume!r}: item {item.get('path')!r}: {e}") from e
        files.append(VolumeFile(_check_rel_path(item["path"], volume), value.encode(), item.get("mode", mode)))
    return files


def projected_files(
    pod: dict,
    projected: dict,
    source: ObjectSource,
    token_source: TokenSource,
    *,
    volume: str,
    pod_ip: str = "",
    host_ip: str = "",
    node_allocatable: Mapping[str, str] | None = None,
) -> list[VolumeFile]:
    """Files of a projected volume: configMap, secret, downwardAPI and serviceAccountToken sources
    (the ``kube-api-access-*`` volume the ServiceAccount admission plugin injects is one of these:
    token + ca.crt from ConfigMap kube-root-ca.crt + namespace).

    The token file is written mode 0600 unless the volume sets defaultMode (as kubelet does).

    Raises:
        VolumeError: a referenced object or key is missing, or the TokenRequest failed.
    """
    namespace = (pod.get("metadata") or {}).get("namespace", "default")
    default_mode = projected.get("defaultMode")
    files: list[VolumeFile] = []
    for src in projected.get("sources") or []:
        if "configMap" in src:
            ref = src["configMap"]
            files += key_files("ConfigMap", source.config_map(namespace, ref.get("name", "")), ref,
                               default_mode, volume=volume, namespace=namespace)
        elif "secret" in src:
            ref = src["secret"]
            files += key_files("Secret", source.secret(namespace, ref.get("name", "")), ref,
                               default_mode, volume=volume, namespace=namespace)
        elif "downwardAPI" in src:
            files += downward_files(pod, src["downwardAPI"].get("items") or [], default_mode, volume=volume,
                                    pod_ip=pod_ip, host_ip=host_ip, node_allocatable=node_allocatable)
        elif "serviceAccountToken" in src:
            sat = src["serviceAccountToken"]
            token = token_source(sat.get("audience") or "", int(sat.get("expirationSeconds") or 3600))
            mode = 0o600 if default_mode is None else default_mode
            files.append(VolumeFile(_check_rel_path(sat["path"], volume), token, mode))
        else:
            raise VolumeError(f"volume {volume!r}: unsupported projected source {sorted(src)}")
    return files


def host_path_dir(hp: dict, volume: str) -> str:
    """The directory of a ``hostPath`` volume after kubelet's type checks (``DirectoryOrCreate`` and
    ``FileOrCreate`` create it).

    Raises:
        VolumeError: the path fails its type check, or does not exist (type unset).
    """
    path, kind = Path(hp["path"]), hp.get("type") or ""
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif kind == "Directory" and not path.is_dir():
        raise VolumeError(f"volume {volume!r}: hostPath type check failed: {path} is not a directory")
    elif kind == "File" and not path.is_file():
        raise VolumeError(f"volume {volume!r}: hostPath type check failed: {path} is not a file")
    elif not kind and not path.exists():
        raise VolumeError(f"volume {volume!r}: hostPath {path} does not exist")
    return str(path)


def write_files(root: Path, files: list[VolumeFile]) -> None:
    """Write ``files`` under ``root``, each via a temp file + rename (readers never see a partial
    file), removing files a previous write left that are no longer listed."""
    root.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for f in files:
        dest = root / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        try:
            os.write(fd, f.data)
            os.fchmod(fd, f.mode)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        wanted.add(dest)
    for p in sorted(root.rglob("*"), reverse=True):
        if p.is_file() and p not in wanted:
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()


def container_mounts(container: dict, volume_dirs: Mapping[str, str], read_only_volumes: set[str],
                     env: Mapping[str, str]) -> list[Mount]:
    """The bind mounts for ``container.volumeMounts``: ``volume_dirs`` maps a volume name to its
    host directory; volumes in ``read_only_volumes`` (configMap, secret, downwardAPI, projected)
    are always mounted read-only, as kubelet does. ``subPath`` selects a file or directory inside
    the volume (created as a directory when missing, as kubelet does); ``subPathExpr`` expands
    ``$(VAR)`` from the container's ``env`` first.

    Mounts are ordered parents first (fewer path components first), as container runtimes do.

    Raises:
        VolumeError: unknown volume, or a subPath escaping its volume.
    """
    mounts = []
    for vm in container.get("volumeMounts") or []:
        name = vm["name"]
        if name not in volume_dirs:
            raise VolumeError(f"container {container.get('name')!r}: volumeMount {name!r} names no volume of the pod")
        source = volume_dirs[name]
        sub = vm.get("subPath") or (expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else "")
        if sub:
            rel = _check_rel_path(sub, name)
            source = os.path.join(source, rel)
            if not os.path.exists(source):
                os.makedirs(source, exist_ok=True)
        mounts.append(Mount(source, vm["mountPath"], bool(vm.get("readOnly")) or name in read_only_volumes))
    return sorted(mounts, key=lambda m: len(Path(m.target).parts))


def image_mounts(image_paths: Sequence[str], mounts: Sequence[Mount]) -> list[Mount]:
    """Read-only self-binds that keep the "image" visible: each of ``image_paths`` (host directories the
    project's Python environment lives in) that lies strictly below the target of one of ``mounts`` is
    bound back over itself, so a volume at a parent (an emptyDir at /tmp while the checkout is under
    /tmp) does not hide the code the container runs. Only the outermost such path is bound."""
    def below(path: str, parent: str) -> bool:
        return path.startswith(parent.rstrip("/") + "/")

    hidden = sorted({p for p in image_paths if any(below(p, m.target) for m in mounts)}, key=lambda p: (p.count("/"), p))
    outermost: list[str] = []
    for path in hidden:
        if not any(path == kept or below(path, kept) for kept in outermost):
            outermost.append(path)
    return [Mount(path, path, read_only=True) for path in outermost]
