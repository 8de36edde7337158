"""The processes of the local nodes while they run: started with their log files and recorded for clean_host,
waited for, and stopped in order (pods first through the API, then the kubelets and the host-wide services,
then containers, then containerd)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..images import ctr
from ..pids import set_pdeathsig
from .cleanup import NodesError

if TYPE_CHECKING:
    from ..controlplane import ControlPlane

__all__ = ["PortClash", "Processes", "drain", "kill_tasks", "tail"]


class PortClash(NodesError):
    """A process exited because another program took its port between the choice and the bind."""


def tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log ("(no log)" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Processes:
    """Processes started by name, each with ``<log_dir>/<name>.log`` (appended to) and ``cwd`` as working dir.

    ``record(name, pid, marks)`` is called after each start (LocalNodes writes it into state.json, so that
    clean_host finds the pid after a crash; ``marks`` are strings of its command line that tell it from a
    recycled pid).
    """

    def __init__(self, log_dir: Path, cwd: Path, record: Callable[[str, int, list[str]], None]) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self._record = record
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._log_start: dict[str, int] = {}

    def log_path(self, name: str) -> Path:
        """``<log_dir>/<name>.log``."""
        return self.log_dir / f"{name}.log"

    def log_since_start(self, name: str) -> bytes:
        """What ``name`` wrote to its log since this start (the log is appended to across runs)."""
        return self.log_path(name).read_bytes()[self._log_start[name]:]

    @property
    def pids(self) -> dict[str, int]:
        """{name: pid} of the processes started (and not stopped yet)."""
        return {n: p.pid for n, p in self.procs.items()}

    def dead(self) -> dict[str, int]:
        """{name: exit code} of the processes that have exited."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def spawn(self, name: str, cmd: list[str], marks: list[str], env: dict[str, str] | None = None) -> None:
        """Start ``cmd`` in its own session, stdout and stderr to its log; it gets SIGTERM when this process
        dies (when started from the main thread)."""
        f = open(self.log_path(name), "ab")  # noqa: SIM115 - open while the process runs
        self._log_start[name] = f.tell()
        f.write(("+ " + " ".join(cmd) + "\n").encode())
        f.flush()
        on_main = threading.current_thread() is threading.main_thread()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, cwd=self.cwd,
                                start_new_session=True, env=env or dict(os.environ),
                                preexec_fn=set_pdeathsig if on_main else None)  # noqa: PLW1509 - one prctl call
        self.procs[name] = proc
        self._logs[name] = f
        self._record(name, proc.pid, marks)

    def wait(self, name: str, what: str, probe: Callable[[], bool], deadline: float) -> None:
        """Poll ``probe`` every 0.5 s until it returns true (its exceptions count as false) or ``deadline``
        (time.monotonic()) passes.

        Raises:
            PortClash: a process exited with "address already in use" in its log.
            NodesError: a process exited, or the deadline passed (with the log's tail).
        """
        last: Exception | None = None
        while time.monotonic() < deadline:
            for n, code in self.dead().items():
                clash = b"address already in use" in self.log_since_start(n)  # this run's lines only
                raise (PortClash if clash else NodesError)(
                    f"{n} exited with code {code} while waiting for {name} ({what}); "
                    f"log {self.log_path(n)}:\n{tail(self.log_path(n))}")
            try:
                if probe():
                    return
            except Exception as e:  # noqa: BLE001 - keep polling; report the last error
                last = e
            time.sleep(0.5)
        raise NodesError(f"timed out waiting for {name} ({what}); last error {last!r}; log "
                         f"{self.log_path(name)}:\n{tail(self.log_path(name))}")

    def end(self, name: str, sig: int = signal.SIGKILL, timeout: float = 20.0) -> None:
        """End the one process ``name`` with ``sig`` (SIGKILL after ``timeout`` seconds if it is still running) and
        forget it, so that :meth:`spawn` can start it again under the same name. Raises KeyError for an unknown name."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._logs.pop(name).close()

    def stop(self, first: Iterable[str], sockets: dict[str, Path], graceful: bool) -> None:
        """End the processes named in ``first`` (SIGTERM, SIGKILL after 20 s, 5 s when not ``graceful``), then
        the containers left in each running containerd (``sockets``: {its process name: its socket}), then every
        other process (the containerds: 20 s)."""
        first = [n for n in first if n in self.procs]
        _term([self.procs[n] for n in first], 20 if graceful else 5)
        for name, sock in sockets.items():
            if name in self.procs and self.procs[name].poll() is None:
                kill_tasks(sock)
        _term([p for n, p in self.procs.items() if n not in first], 20)
        for f in self._logs.values():
            f.close()
        self.procs.clear()
        self._logs.clear()


def _term(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM each, then SIGKILL those still running after ``timeout`` seconds in all; reaps them."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def kill_tasks(sock: Path) -> None:
    """SIGKILL and delete every task of a node's containerd (containers kubelet did not stop); errors ignored."""
    try:
        ids = [ln.split()[0] for ln in ctr(str(sock), "tasks", "ls", timeout=30).stdout.splitlines()[1:] if ln.strip()]
        for i in ids:
            ctr(str(sock), "tasks", "kill", "-s", "SIGKILL", i, timeout=30)
        for i in ids:
            ctr(str(sock), "tasks", "delete", "-f", i, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def drain(cp: ControlPlane, names: list[str]) -> list[str]:
    """Cordon the nodes ``names`` and delete their pods through the API (kubelet kills the containers with the
    pods' grace period, at most 5 s); force-delete what is left after 40 s. Returns what it did (one line);
    API errors are reported in that line, never raised."""
    report = []
    try:
        for n in names:
            cp.kubectl("patch", "node", n, "-p", '{"spec":{"unschedulable":true}}', check=False)

        def pods() -> list[str]:
            out = []
            for n in names:
                r = cp.kubectl("get", "pods", "-A", "--field-selector", f"spec.nodeName={n}", "-o",
                               "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}{\"\\n\"}{end}",
                               check=False)
                out += [ln for ln in r.stdout.splitlines() if ln.strip()]
            return out

        left = pods()
        t0 = time.monotonic()
        if left:
            n_pods = len(left)
            for n in names:
                cp.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={n}",
                           "--grace-period=5", "--wait=false", check=False, timeout=120)
            end = time.monotonic() + 40
            while left and time.monotonic() < end:
                time.sleep(1)
                left = pods()
            report.append(f"deleted {n_pods} pods through the API in {time.monotonic() - t0:.0f}s; "
                          f"{len(left)} left for the kill")
            for n in names:
                if left:
                    cp.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={n}",
                               "--force", "--grace-period=0", "--wait=false", check=False, timeout=120)
    except Exception as e:  # noqa: BLE001 - the API may be gone; clean_host kills what is left
        report.append(f"pods not deleted through the API ({e}); killed instead")
    return report
