"""Processes known by pid only (recorded in a pid file or a state file): is it still the one we started, and
stopping it. A pid can be recycled, so "ours" means alive and its command line naming what we started."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces ("" when there is no such process)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_running(pid: int, *cmdline_parts: str) -> bool:
    """Whether ``pid`` is a live process (a zombie is not) whose command line contains each of ``cmdline_parts``.

    A process of another user that cannot be signalled counts as alive.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    if not cmdline_parts:
        return True
    line = cmdline(pid)
    return all(part in line for part in cmdline_parts)


def terminate(pid: int, timeout: float, *cmdline_parts: str) -> None:
    """SIGTERM ``pid`` and wait up to ``timeout`` seconds for it to exit, then SIGKILL it.

    Only while :func:`pid_running` (``pid``, ``cmdline_parts``) holds is the process signalled, so a pid that
    was recycled meanwhile is never touched.
    """
    if not pid_running(pid, *cmdline_parts):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_running(pid, *cmdline_parts) and time.monotonic() < deadline:
            time.sleep(0.2)
        if pid_running(pid, *cmdline_parts):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
