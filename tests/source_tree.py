"""The checkout's source folders, for the ``PYTHONPATH`` of the processes a test starts: they run this checkout's
code whatever clone an editable install points at."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("api", "wire", "trainer", "rollout", "operator", "localcluster")


def pythonpath(env: Mapping[str, str]) -> str:
    """The source folders ahead of ``env``'s own ``PYTHONPATH`` (os.pathsep-joined)."""
    return os.pathsep.join([*(str(REPO / folder) for folder in SOURCE_FOLDERS), env.get("PYTHONPATH", "")])
