"""The local cluster's container images: built by ``localcluster/build-images.sh``, imported into containerd.

``build-images.sh`` builds every image the cluster runs (operator, CPU trainer, the Redis stand-in, the pause
image) with buildah from the project's Dockerfiles, caches them by a hash of their inputs and writes one OCI
archive per image plus ``index.json``::

    {"images": [{"key": "operator", "name": "docker.io/rljob/operator:0.1.0", "archive": "/abs/operator-<h>.tar",
                 "hash": "<sha256 of the inputs>", "bytes": 123, "unpacked_bytes": 456}, ...]}

``name`` is the fully qualified name containerd and kubelet see (``rljob/operator:0.1.0`` in a pod spec is
``docker.io/rljob/operator:0.1.0``); ``ctr -n k8s.io images import <archive>`` registers it under that name.
This module finds, builds and imports them; the nodes call :func:`import_into` for each node's containerd.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .tools import run_build_script, script

#: The sandbox image the images are built for: containerd's ``sandbox_image`` must name exactly this one
#: (kubelet v1.34 takes the sandbox image from the CRI runtime; kubeadm v1.34 pins pause 3.10.1).
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
#: containerd namespace of the CRI plugin (what kubelet's images live in).
K8S_NAMESPACE = "k8s.io"


@dataclass(frozen=True)
class Image:
    """One entry of index.json."""

    key: str  # operator, trainer-cpu, redis, pause
    name: str  # fully qualified: docker.io/rljob/operator:0.1.0
    archive: Path  # OCI archive (`ctr images import` loads it under `name`)
    hash: str  # sha256 of the build inputs
    bytes: int  # archive size
    unpacked_bytes: int  # sum of the uncompressed layers (0 if unknown)

    def manifest_digest(self) -> str:
        """Digest of the image's manifest (what `ctr images ls` shows as DIGEST once imported).

        Raises ValueError when the archive is not an OCI archive or its index lists no manifest.
        """
        with tarfile.open(self.archive) as tar:
            member = tar.extractfile("index.json")
            if member is None:
                raise ValueError(f"{self.archive}: no index.json (not an OCI archive)")
            index = json.load(member)
        manifests = index.get("manifests") or []
        if not manifests:
            raise ValueError(f"{self.archive}: empty OCI index")
        return manifests[0]["digest"]


def images_dir() -> Path:
    """Where the archives and index.json live (``RLJOB_IMAGES_DIR``, default ~/.cache/rljob/images)."""
    override = os.environ.get("RLJOB_IMAGES_DIR")
    if override:
        return Path(override)
    return Path(os.environ.get("HOME", "/root")) / ".cache" / "rljob" / "images"


def index_path() -> Path:
    """``index.json`` in :func:`images_dir` (build-images.sh writes it; it may not exist yet)."""
    return images_dir() / "index.json"


def build(only: Sequence[str] = (), force: bool = False, quiet: bool = True) -> Path:
    """Run ``build-images.sh`` (cached: seconds when nothing changed) and return the index.json path.

    Its progress goes to this process's stderr. Raises RuntimeError when the build fails.
    """
    path = script("build-images.sh")
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; set RLJOB_REPO_ROOT")
    cmd = [str(path)]
    for key in only:
        cmd += ["--only", key]
    if force:
        cmd.append("--force")
    return run_build_script(cmd, {"RLJOB_IMAGES_QUIET": "1" if quiet else "0"}, "index path")


def load_index(path: Optional[os.PathLike[str] | str] = None) -> list[Image]:
    """The images of index.json (default :func:`index_path`); every archive must exist.

    Raises FileNotFoundError (with the command to run) when the index or an archive is missing.
    """
    p = Path(path) if path is not None else index_path()
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: build the images first (localcluster/build-images.sh)")
    images = [
        Image(key=e.get("key", ""), name=e["name"], archive=Path(e["archive"]), hash=e["hash"],
              bytes=int(e.get("bytes", 0)), unpacked_bytes=int(e.get("unpacked_bytes", 0)))
        for e in json.loads(p.read_text())["images"]
    ]
    missing = [str(i.archive) for i in images if not i.archive.exists()]
    if missing:
        raise FileNotFoundError(f"{p} lists archives that are gone ({', '.join(missing)}): "
                                "run localcluster/build-images.sh again")
    return images


SNAPSHOT_RACE = "does not exist: not found"
"""What ``ctr images import`` says when a parent layer snapshot it found was removed before it stacked on it
("failed to prepare extraction snapshot ...: parent snapshot sha256:... does not exist: not found"): seen when an
image replaces an earlier one of the same name in a node's kept containerd root. One retry imports it."""
IMPORT_RETRY_S = 5.0
"""Seconds before that retry."""


def ctr(socket: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``ctr --address <socket> --namespace k8s.io <args>`` (output captured as text, exit status unchecked).

    Raises subprocess.TimeoutExpired after ``timeout`` seconds (the ctr process is killed first).
    """
    return subprocess.run(["ctr", "--address", socket, "--namespace", K8S_NAMESPACE, *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def present(socket: str, timeout: float = 60) -> dict[str, str]:
    """{image name: manifest digest} of the images in a containerd's k8s.io namespace.

    Raises RuntimeError when ``ctr images ls`` fails, subprocess.TimeoutExpired after ``timeout`` seconds.
    """
    proc = ctr(socket, "images", "ls", timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ctr images ls at {socket}: {proc.stderr.strip()}")
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3:
            out[fields[0]] = fields[2]  # REF TYPE DIGEST SIZE PLATFORMS LABELS
    return out


def import_into(ctr_socket: str, images: Optional[Sequence[Image]] = None, *, timeout: float = 1800,
                snapshotter: str = "", log: Callable[[str], None] | None = None) -> list[str]:
    """Import the images (default: every image of index.json) into the containerd at ``ctr_socket``
    (namespace k8s.io, unpacked for ``snapshotter``; "": containerd's default, overlayfs), skipping those
    already there with the same manifest digest. Returns the names imported.

    Args:
        timeout: seconds for the whole call; a ``ctr`` still running then is killed.
        snapshotter: must be the snapshotter of the node's CRI plugin, or its pods cannot use the images.
        log: called with one line before each import.

    Raises:
        RuntimeError: an import failed or did not register the image (the message names it), or
            ``timeout`` ran out.
        FileNotFoundError: ``images`` is None and index.json or one of its archives is missing.
    """
    deadline = time.monotonic() + timeout

    def left(what: str) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"image import into {ctr_socket} timed out after {timeout:.0f}s ({what})")
        return remaining

    if images is None:
        images = load_index()
    try:
        have = present(ctr_socket, timeout=min(60.0, left("listing images")))
        imported = []
        for image in images:
            digest = image.manifest_digest()
            if have.get(image.name) == digest:
                continue
            if log:
                log(f"importing {image.name} ({image.bytes / 2**20:.0f} MiB archive) into {ctr_socket}")
            extra = ["--snapshotter", snapshotter] if snapshotter else []
            proc = ctr(ctr_socket, "images", "import", *extra, str(image.archive), timeout=left(image.name))
            if proc.returncode != 0 and SNAPSHOT_RACE in (proc.stderr or proc.stdout):
                # containerd's garbage collector removed a layer snapshot of the image this name replaces while the
                # import was about to stack on it; once it is done, the import unpacks that layer anew
                if log:
                    log(f"importing {image.name} again: {(proc.stderr or proc.stdout).strip()[-300:]}")
                time.sleep(IMPORT_RETRY_S)
                proc = ctr(ctr_socket, "images", "import", *extra, str(image.archive), timeout=left(image.name))
            if proc.returncode != 0:
                raise RuntimeError(f"ctr images import {image.archive} at {ctr_socket}: "
                                   f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
            got = present(ctr_socket, timeout=min(60.0, left(image.name))).get(image.name)
            if got != digest:
                raise RuntimeError(f"after importing {image.archive} at {ctr_socket}, {image.name} is "
                                   f"{got or 'missing'} (expected {digest}); ctr said: {proc.stdout.strip()[-500:]}")
            imported.append(image.name)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"image import into {ctr_socket} timed out after {timeout:.0f}s "
                           f"({' '.join(map(str, e.cmd[-2:]))} killed)") from None
    return imported


def build_release(commit: str, source_only: bool = False) -> Path:
    """Run ``build-release.sh [--source-only] COMMIT`` (cached: seconds when done before) and return the release
    directory: ``src/`` (the commit's tree) and, unless ``source_only``, ``images/index.json`` (its operator image,
    ``docker.io/rljob/operator:<version>-<commit, 12 hex>``).

    Raises RuntimeError when the script fails (e.g. the commit is not in this clone's history).
    """
    path = script("build-release.sh")
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; set RLJOB_REPO_ROOT")
    cmd = [str(path), *(["--source-only"] if source_only else []), commit]
    return run_build_script(cmd, {"RLJOB_IMAGES_QUIET": "1"}, "release directory")
