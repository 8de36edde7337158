"""Readiness and liveness probes (exec, tcpSocket, httpGet), as kubelet's prober runs them
(pkg/kubelet/prober): results count against successThreshold/failureThreshold every periodSeconds
after initialDelaySeconds; a readiness probe starts failed, a liveness probe starts passed.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ProbeTracker", "resolve_port", "run_probe"]


def resolve_port(port, container: dict) -> int:
    """A probe port: a number, or the name of one of the container's ``ports``.

    Raises:
        ValueError: an unknown port name.
    """
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is not a named port of container {container.get('name')!r}")


def _exec_probe(argv: list[str], pid1: int, env: Mapping[str, str], timeout: float) -> tuple[bool, str]:
    cmd = ["nsenter", "-t", str(pid1), "-n", "-m", "-u", "-p", "--", *argv]
    proc = subprocess.Popen(cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False, f"command timed out after {timeout:g}s"
    return proc.returncode == 0, out.decode(errors="replace")[-1024:]


def run_probe(probe: dict, *, container: dict, pod_ip: str, pid1: int | None, env: Mapping[str, str]) -> tuple[bool, str]:
    """Run ``probe`` once against a running container; returns (success, message).

    exec runs the command inside the container's namespaces (``nsenter`` into PID 1 of its PID
    namespace) with the container's env; tcpSocket connects to the pod IP; httpGet expects a
    status in [200, 400). gRPC probes are not supported and fail with a message saying so.
    """
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "exec" in probe:
            if pid1 is None:
                return False, "container has no process yet"
            return _exec_probe(probe["exec"].get("command") or [], pid1, env, timeout)
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            with socket.create_connection((t.get("host") or pod_ip, resolve_port(t["port"], container)), timeout=timeout):
                return True, ""
        if "httpGet" in probe:
            h = probe["httpGet"]
            host, port = h.get("host") or pod_ip, resolve_port(h["port"], container)
            if (h.get("scheme") or "HTTP").upper() == "HTTPS":
                conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request("GET", h.get("path") or "/", headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []})
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
        return False, f"unsupported probe handler {sorted(k for k in probe if k not in _TIMING)}"
    except (OSError, ValueError, http.client.HTTPException) as e:
        return False, str(e)


_TIMING = {"initialDelaySeconds", "timeoutSeconds", "periodSeconds", "successThreshold", "failureThreshold",
           "terminationGracePeriodSeconds"}


@dataclass
class ProbeTracker:
    """One probe of one running container: when it is due and what it currently says.

    Args:
        probe: the probe dict from the container spec.
        started: monotonic time the container started (seconds).
        initial: result before the first run (False for readiness, True for liveness).
    """

    probe: dict
    started: float
    initial: bool

    def __post_init__(self) -> None:
        self.ok = self.initial
        self.message = ""
        self._next = self.started + float(self.probe.get("initialDelaySeconds") or 0)
        self._successes = self._failures = 0

    def due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._next

    def record(self, success: bool, message: str = "", now: float | None = None) -> None:
        """Count one result; flips ``ok`` after successThreshold successes / failureThreshold failures."""
        now = time.monotonic() if now is None else now
        self._next = now + float(self.probe.get("periodSeconds") or 10)
        self.message = message
        if success:
            self._successes, self._failures = self._successes + 1, 0
            if self._successes >= int(self.probe.get("successThreshold") or 1):
                self.ok = True
        else:
            self._failures, self._successes = self._failures + 1, 0
            if self._failures >= int(self.probe.get("failureThreshold") or 3):
                self.ok = False
