"""Host paths that container mounts need.

A bind mount needs its target to exist. Inside a container's private mount namespace the target
path is still the host's file system, so a mountPath such as ``/etc/rljob`` needs an (empty)
``/etc/rljob`` directory on the host. :class:`MountPoints` creates such paths, remembers exactly
what it created (also in a JSON file, so an agent killed hard can be cleaned up by the next one),
and removes them again, deepest first, when they are still empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

__all__ = ["MountPointError", "MountPoints", "mount_tmpfs", "unmount"]

_FORBIDDEN = ("/proc", "/sys")


class MountPointError(Exception):
    """A mount target cannot be created (wrong type already there, or a forbidden path)."""


class MountPoints:
    """Creates mount targets on the host and removes the ones it created.

    Args:
        record: JSON file listing the created paths (read back by :meth:`cleanup` of a later agent).
    """

    def __init__(self, record: Path) -> None:
        self.record = record
        self._lock = threading.Lock()
        self._created: list[str] = self._load()

    def _load(self) -> list[str]:
        try:
            return list(json.loads(self.record.read_text()))
        except (OSError, ValueError):
            return []

    def _save(self) -> None:
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._created))
        tmp.replace(self.record)

    def ensure(self, target: str, is_dir: bool) -> None:
        """Make ``target`` exist as a directory (``is_dir``) or an empty file, creating parents.

        Raises:
            MountPointError: ``target`` is relative, under /proc or /sys, or exists with the other type.
        """
        if not target.startswith("/") or any(target == p or target.startswith(p + "/") for p in _FORBIDDEN):
            raise MountPointError(f"mount path {target!r} is not allowed (must be absolute, not under /proc or /sys)")
        with self._lock:
            path = Path(target)
            if path.exists():
                if path.is_dir() != is_dir:
                    kind = "directory" if is_dir else "file"
                    raise MountPointError(f"mount path {target!r} exists on the host but is not a {kind}")
                return
            missing = []
            p = path
            while not p.exists():
                missing.append(p)
                p = p.parent
            for p in reversed(missing):
                if p == path and not is_dir:
                    p.touch()
                else:
                    p.mkdir()
                self._created.append(str(p))
            self._save()

    def cleanup(self) -> list[str]:
        """Remove every created path that is still an empty directory or empty file, deepest
        first; returns the ones left in place (not empty, or busy)."""
        with self._lock:
            left = []
            for s in sorted(set(self._created), key=lambda s: s.count("/"), reverse=True):
                p = Path(s)
                try:
                    if p.is_dir() and not p.is_symlink():
                        p.rmdir()
                    elif p.is_file() and p.stat().st_size == 0:
                        p.unlink()
                    elif p.exists():
                        left.append(s)
                except OSError:
                    left.append(s)
            self._created = []
            try:
                os.unlink(self.record)
            except FileNotFoundError:
                pass
            return left


def mount_tmpfs(path: str, size: str) -> None:
    """Mount a tmpfs of ``size`` (bytes, or a percentage of RAM such as "50%") at ``path``.

    Raises:
        OSError: mount(8) failed (the message carries its stderr).
    """
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise OSError(f"mounting a tmpfs at {path} failed: {proc.stderr.strip()}")


def unmount(path: str) -> None:
    """Lazily unmount ``path`` (detached now, freed when no process uses it); errors are ignored."""
    subprocess.run(["umount", "-l", path], capture_output=True, check=False)
