"""A local cluster's directory (``--dir``): where it is by default, its daemon's pid and state, and taking it down.

The layout (``kubeconfig``, ``state.json``, ``daemon.pid``, ``daemon.log``, ``data/``, ``nodes/``) is described in
:mod:`rljob_localcluster.__main__`, whose commands and :mod:`.demo` both use this module.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from . import statefile
from .pids import pid_running, terminate, terminate_all


def default_dir() -> Path:
    """``$RLJOB_CLUSTER_DIR``, else ``~/.cache/rljob/cluster``."""
    d = os.environ.get("RLJOB_CLUSTER_DIR")
    return Path(d) if d else Path.home() / ".cache" / "rljob" / "cluster"


def daemon_marks(d: Path) -> tuple[str, str]:
    """What the command line of this dir's daemon contains (so a recycled pid is not taken for it)."""
    return "rljob_localcluster", str(d)


def daemon_pid(d: Path) -> int | None:
    """The running daemon's pid for this dir, or None (checks the pid really is our daemon)."""
    try:
        pid = int((d / "daemon.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_running(pid, *daemon_marks(d)) else None


def read_state(d: Path) -> dict | None:
    """The daemon's state.json in ``d`` (None when missing or unreadable)."""
    return statefile.read(d / "state.json")


def down(d: Path, quiet: bool = False) -> int:
    """Stop the daemon (it stops the nodes, pods first while the API server still answers, then the control
    plane); after a daemon that died hard, end its recorded processes and clean what its nodes left on the host
    (:func:`clean_host`, from ``nodes/state.json``); then delete the data: ``data/`` and ``nodes/`` but
    ``nodes/logs/``. ``daemon.log`` and ``nodes/logs/`` are kept. Exit status 1 when the nodes could not be
    cleaned: local nodes still run on this host (then nothing is removed) or something of theirs is left
    (a ``WARNING`` line says what)."""
    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr)

    from .nodes import clean_host

    pid = daemon_pid(d)
    st = read_state(d) or {}
    had_data = (d / "data").exists()  # the daemon removes it itself when it stops
    log = d / "daemon.log"
    log_start = log.stat().st_size if log.exists() else 0
    if pid:
        # the daemon stops the nodes (pods first, through the API) before the control plane
        terminate(pid, 180, *daemon_marks(d))
    # Components of a daemon that died hard: end exactly those recorded pids whose command line
    # still names this cluster's data dir (so a recycled pid is never touched).
    left = terminate_all([(cpid, [str(d / "data")]) for cpid in (st.get("pids") or {}).values()], 10)
    say("control plane stopped" if pid else
        f"the daemon had died; ended {len(left)} control-plane process(es) it left" if left else
        "control plane was not running")
    if pid and log.exists():  # what the daemon's own stop removed (its lines written during this stop)
        with open(log, "rb") as f:
            f.seek(log_start)
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith("nodes: "):
                    say(line)
    # A daemon that died hard left its nodes' processes and host changes: clean from nodes/state.json.
    try:
        cleaned = clean_host(d / "nodes")
    except RuntimeError as err:
        print(f"nodes not cleaned: {err}", file=sys.stderr)
        return 1
    warnings = [line for line in cleaned if line.startswith("WARNING")]
    for line in cleaned:
        if line in warnings:
            print(f"nodes: {line}", file=sys.stderr)  # also when quiet
        else:
            say(f"nodes: {line}")
    for name in ("state.json", "state.json.tmp", "kubeconfig", "daemon.pid"):
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(d / "data", ignore_errors=True)
    if had_data:
        say(f"removed {d / 'data'} (etcd data, certificates, control-plane logs)")
    if kept := [str(p) for p in (d / "daemon.log", d / "nodes" / "logs") if p.exists()]:
        say(f"kept {' and '.join(kept)}")
    return 1 if warnings else 0
