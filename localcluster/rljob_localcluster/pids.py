"""Processes known by pid only (recorded in a pid file or a state file): is it still the one we started, and
stopping it. A pid can be recycled, so "ours" means alive and its command line naming what we started. Also the
two helpers every launcher of the local cluster needs: a free port and "die with the parent"."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["cmdline", "free_port", "pid_running", "set_pdeathsig", "terminate", "terminate_all"]

_PR_SET_PDEATHSIG = 1


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
    terminate_all([(pid, cmdline_parts)], timeout)


def terminate_all(procs: Iterable[tuple[int, Iterable[str]]], timeout: float = 15.0) -> list[int]:
    """SIGTERM each (pid, command-line marks) that still is that process (:func:`pid_running`), wait up to
    ``timeout`` seconds for all of them, SIGKILL those left and wait up to 10 s more for them to go. Returns
    the pids that were running. A recycled pid (its command line lacks the marks) is never touched."""
    live = [(pid, tuple(marks)) for pid, marks in procs if pid and pid_running(pid, *marks)]
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        for pid, marks in live:
            if pid_running(pid, *marks):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(pid_running(p, *m) for p, m in live):
            time.sleep(0.1)
    return [p for p, _ in live]


def free_port(addr: str = "127.0.0.1", udp_too: bool = False) -> int:
    """A TCP port (``udp_too``: free for UDP as well) that nothing listens on at ``addr`` (IPv4 or IPv6) now.

    The port is chosen and released before its user binds it, so another program may take it in between:
    a user that fails with "address already in use" retries its start (ControlPlane and LocalNodes do, once
    or twice). Raises OSError when 50 tries found no port free for both protocols.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    for _ in range(50):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        if not udp_too:
            return port
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as u:
                u.bind((addr, port))
            return port
        except OSError:
            continue
    raise OSError(f"no port free for TCP and UDP on {addr}")


def set_pdeathsig() -> None:
    """``preexec_fn`` for Popen: the child gets SIGTERM when the thread that started it ends (best effort;
    only from the main thread, whose end is the process's)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
