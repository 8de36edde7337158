"""State files of the local cluster (the daemon's ``state.json``, the nodes' ``nodes/state.json``): read as a
dict, written whole with a rename so that a reader never sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["read", "write"]


def read(path: str | os.PathLike) -> dict | None:
    """The JSON object in ``path``; None when the file is missing or not JSON (e.g. written by a crashed run)."""
    try:
        st = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def write(path: str | os.PathLike, st: dict) -> None:
    """Write ``st`` to ``path`` as indented JSON through ``<path>.tmp`` and a rename (atomic on one filesystem)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(st, indent=2))
    tmp.replace(p)
