"""Writes that survive a crash: each function returns once its data and directory entries are on stable storage
(fsync of the file, then of its directory), which is what "durable" means in DESIGN §6."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temp file beside it, fsync, rename, fsync of the directory.

    Raises:
        OSError: the write, the rename or an fsync failed.
    """
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, then fsync of the file and of its directory.

    Raises:
        OSError: the write or an fsync failed.
    """
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


def fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory``, then every directory (their entries).

    Raises:
        OSError: an fsync failed.
    """
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def fsync_dir(directory: Path) -> None:
    """fsync ``directory`` (makes the creation, rename or removal of its entries durable).

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
