"""Host-side helpers of the chaos tests: the local nodes run their containers as processes of this host, so a test
can find a pod's processes and signal them from outside, as an operator or a kernel would (no hook in product code).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def pod_pids(pod_uid: str) -> list[int]:
    """Host pids of every process (sandbox and containers) in the cgroups of the pod with ``pod_uid``: kubelet's
    cgroupfs driver names a pod's cgroup ``pod<uid>`` in every hierarchy. Empty when none runs."""
    mark = f"/pod{pod_uid}"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:  # gone meanwhile
            continue
        if mark in text:
            pids.append(int(entry.name))
    return sorted(pids)


def command_line(pid: int) -> str:
    """The command line of ``pid`` with spaces for NULs ('' when it is gone)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def environment(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with ({} when it is gone)."""
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def rank_pids(pod_uid: str) -> dict[int, int]:
    """{global rank: host pid} of the training processes torchrun started in the pod with ``pod_uid`` (their
    environment carries RANK and their command line is the trainer's module, not torchrun itself)."""
    ranks = {}
    for pid in pod_pids(pod_uid):
        env = environment(pid)
        if "RANK" in env and "LOCAL_RANK" in env and "torchrun" not in command_line(pid):
            ranks[int(env["RANK"])] = pid
    return ranks


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each pid (those already gone are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
