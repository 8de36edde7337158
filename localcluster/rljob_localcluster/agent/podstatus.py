"""Pod status as kubelet reports it, computed from what the agent knows about each container.

Pure functions; the rules are kubelet's (pkg/kubelet/kubelet_pods.go ``getPhase``,
pkg/kubelet/status/generate.go for the conditions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["ContainerRecord", "exit_reason", "pod_conditions", "pod_phase", "pod_status", "rfc3339", "status_patch"]


def rfc3339(t: float | None = None) -> str:
    """``t`` (seconds since the epoch; now if None) as the API's RFC 3339 UTC timestamp."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def exit_reason(exit_code: int) -> str:
    """kubelet's terminated reason for an exit code: ``Completed`` for 0, else ``Error``."""
    return "Completed" if exit_code == 0 else "Error"


@dataclass
class ContainerRecord:
    """What the agent knows about one container of a pod (its current and previous run).

    ``state`` is "waiting", "running" or "terminated"; times are RFC 3339 strings; ``exit_code``
    is the process's exit status (128 + N when killed by signal N, as container runtimes report).
    """

    name: str
    image: str = ""
    state: str = "waiting"
    reason: str = "ContainerCreating"
    message: str = ""
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    restart_count: int = 0
    ready: bool = False
    container_id: str = ""
    last_terminated: dict | None = None
    """The previous run's ``terminated`` state dict (the status's ``lastState``)."""

    def terminated_dict(self) -> dict:
        d = {
            "exitCode": self.exit_code if self.exit_code is not None else 0,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }
        if self.message:
            d["message"] = self.message
        if self.container_id:
            d["containerID"] = self.container_id
        return d

    def state_dict(self) -> dict:
        if self.state == "running":
            return {"running": {"startedAt": self.started_at}}
        if self.state == "terminated":
            return {"terminated": self.terminated_dict()}
        d = {"reason": self.reason}
        if self.message:
            d["message"] = self.message
        return {"waiting": d}

    def status(self) -> dict:
        """The ``containerStatuses[]`` entry."""
        st = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": bool(self.ready and self.state == "running"),
            "started": self.state == "running",
            "restartCount": self.restart_count,
            "state": self.state_dict(),
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.container_id:
            st["containerID"] = self.container_id
        return st


def pod_phase(restart_policy: str, init: list[ContainerRecord], main: list[ContainerRecord]) -> str:
    """Pod phase from container states (kubelet ``getPhase``).

    Pending until every init container exited 0 (Failed if one failed under restartPolicy Never);
    then Pending while a container has never started; Running while one runs or will restart;
    Succeeded when all exited 0 (policy Never/OnFailure); Failed when all exited and one failed
    under Never.
    """
    for c in init:
        if c.state == "terminated" and c.exit_code == 0:
            continue
        if c.state == "terminated" and restart_policy == "Never":
            return "Failed"
        return "Pending"
    running = waiting = stopped = succeeded = 0
    for c in main:
        if c.state == "running":
            running += 1
        elif c.state == "terminated":
            stopped += 1
            succeeded += c.exit_code == 0
        elif c.last_terminated is not None:
            stopped += 1  # waiting to restart
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    return "Pending"


def _condition(ctype: str, ok: bool, previous: dict[str, dict], now: str, reason: str = "", message: str = "") -> dict:
    status = "True" if ok else "False"
    prev = previous.get(ctype)
    c = {
        "type": ctype,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": prev["lastTransitionTime"] if prev and prev.get("status") == status else now,
    }
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    return c


def pod_conditions(
    phase: str,
    sandbox_ready: bool,
    init: list[ContainerRecord],
    main: list[ContainerRecord],
    previous: list[dict],
    now: str,
) -> list[dict]:
    """PodReadyToStartContainers, Initialized, ContainersReady and Ready (PodScheduled is the
    scheduler's). ``previous`` conditions keep their lastTransitionTime while unchanged."""
    prev = {c["type"]: c for c in previous or []}
    initialized = all(c.state == "terminated" and c.exit_code == 0 for c in init)
    unready = [c.name for c in main if not (c.state == "running" and c.ready)]
    terminal = phase in ("Succeeded", "Failed")
    if terminal:
        ready_reason, ready_msg = "PodCompleted", ""
    elif unready:
        ready_reason, ready_msg = "ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]"
    else:
        ready_reason, ready_msg = "", ""
    init_pending = [c.name for c in init if not (c.state == "terminated" and c.exit_code == 0)]
    return [
        _condition("PodReadyToStartContainers", sandbox_ready, prev, now),
        _condition(
            "Initialized", initialized, prev, now,
            "" if initialized else "ContainersNotInitialized",
            "" if initialized else f"containers with incomplete status: [{' '.join(init_pending)}]",
        ),
        _condition("ContainersReady", not unready and not terminal, prev, now, ready_reason, ready_msg),
        _condition("Ready", not unready and not terminal, prev, now, ready_reason, ready_msg),
    ]


def pod_status(
    pod: dict,
    *,
    init: list[ContainerRecord],
    main: list[ContainerRecord],
    pod_ip: str,
    host_ip: str,
    start_time: str,
    sandbox_ready: bool,
    now: str | None = None,
) -> dict:
    """The ``status`` the agent patches onto the pod (strategic merge keeps PodScheduled)."""
    now = now or rfc3339()
    restart_policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
    phase = pod_phase(restart_policy, init, main)
    previous = (pod.get("status") or {}).get("conditions") or []
    status = {
        "phase": phase,
        "conditions": pod_conditions(phase, sandbox_ready, init, main, previous, now),
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": start_time,
        "containerStatuses": [c.status() for c in main],
    }
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if init:
        status["initContainerStatuses"] = [c.status() for c in init]
    return status


def status_patch(status: dict) -> dict:
    """The strategic merge patch that makes the pod's status ``status`` (as :func:`pod_status` builds it).

    A strategic merge patch keeps what it does not mention: lists merged by key keep entries' old fields, so
    a condition that turned True would keep its ``reason`` and ``message`` ("containers with unready status")
    unless they are deleted with null, as kubelet's patch (a diff of old and new status) does; podIPs/hostIPs
    merge by ``ip``, so a new address must replace the list.
    """
    out = dict(status)
    out["conditions"] = [{"reason": None, "message": None, **c} for c in status.get("conditions") or []]
    for key in ("podIPs", "hostIPs"):
        if key in out:
            out[key] = [{"$patch": "replace"}, *out[key]]
    return {"status": out}
