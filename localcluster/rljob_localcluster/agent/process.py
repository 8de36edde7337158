"""One run of one container: the shim process (see ``shim.py``) and the files it leaves.

The container's stdout and stderr go, unmodified, to its log file (appended; see ``logs.claim_log``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .volumes import Mount

__all__ = ["SHIM", "ContainerProcess", "LaunchSpec"]

SHIM = Path(__file__).with_name("shim.py")


@dataclass
class LaunchSpec:
    """What the shim needs: command line, full environment, working dir, hostname (None keeps
    the host's), network namespace path (None: host network), bind mounts (parents first) and
    host mount points to detach inside the container's mount namespace."""

    argv: list[str]
    env: dict[str, str]
    cwd: str = "/"
    hostname: str | None = None
    netns: str | None = None
    mounts: list[Mount] = field(default_factory=list)
    detach: list[str] = field(default_factory=list)


class ContainerProcess:
    """Starts the shim for ``spec`` with its files in ``run_dir``; output appended to ``log_path``.

    Must be created on the thread that will outlive it: the shim holds a parent-death signal on
    that thread (so an agent that dies takes every container with it).
    """

    def __init__(self, spec: LaunchSpec, run_dir: Path, log_path: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid1_file = run_dir / "pid1"
        self.start_error_file = run_dir / "start-error"
        for f in (self.pid1_file, self.start_error_file):
            f.unlink(missing_ok=True)
        spec_path = run_dir / "launch.json"
        doc = asdict(spec) | {
            "parent_pid": os.getpid(),
            "pid1_file": str(self.pid1_file),
            "start_error_file": str(self.start_error_file),
        }
        spec_path.write_text(json.dumps(doc))
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-I", str(SHIM), str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        self.started_wall = time.time()
        self.started_mono = time.monotonic()
        self.finished_wall: float | None = None

    def poll(self) -> int | None:
        """The container's exit status once it has exited (128 + N after signal N), else None."""
        rc = self.popen.poll()
        if rc is not None and self.finished_wall is None:
            self.finished_wall = time.time()
        if rc is not None and rc < 0:
            return 128 - rc  # the shim itself was killed by a signal
        return rc

    def start_error(self) -> str | None:
        """Why the command could not start (sandbox or exec failure), or None."""
        try:
            return self.start_error_file.read_text()
        except FileNotFoundError:
            return None

    def pid1(self) -> int | None:
        """Host pid of PID 1 of the container's PID namespace (for ``nsenter``), once known."""
        try:
            return int(self.pid1_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the container's main process (the shim and its init forward it)."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the shim's process group and PID 1 (which ends the whole PID namespace)."""
        if self.popen.poll() is None:  # shim not reaped: its group id is still ours, PID 1 its child
            pid1 = self.pid1()
            for pid, kill in ((pid1, os.kill), (self.popen.pid, os.killpg)):
                if pid:
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        self.popen.wait()
        self.poll()
