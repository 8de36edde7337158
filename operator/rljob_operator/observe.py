"""Pure: raw Pod, Deployment and PersistentVolumeClaim objects → the small frozen views the gang logic and status
read.

These views are what the operator's kopf indices hold (one per child pod, keyed by job), so they carry only
what decisions need: role, index, attempt, config hashes, phase, why a pod failed, whether it was disrupted
(eviction, preemption, node loss; not counted against backoffLimit) and why it cannot be scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Optional

from rljob_api import constants as c
from rljob_api import start_failure

DISRUPTION_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Terminated"})
"""Pod ``status.reason`` values of a pod the platform (not the workload) ended."""
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
"""Waiting reasons of a container that is on its way (kubelet): anything else needs a change or a retry."""
RESTART_REASONS = frozenset({"CrashLoopBackOff", "RunContainerError"})
"""Waiting reasons of a container the kubelet keeps restarting after failed runs or starts (it backs off between)."""
DEFAULT_LOST_NODE_TOLERATION_S = 300
"""The tolerationSeconds Kubernetes' DefaultTolerationSeconds admission gives every pod for the unreachable and
not-ready taints, used for a pod that carries neither."""
LOST_NODE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
LAST_LINE_MAX = 300
"""Characters of a termination message's last line kept in a view (condition messages stay readable)."""


@dataclass(frozen=True)
class PodView:
    """One child pod as the operator sees it.

    ``phase``: Pending, Running, Succeeded, Failed or Unknown. ``deleting``: metadata.deletionTimestamp is set.
    ``disrupted``: a DisruptionTarget condition or a platform reason (:data:`DISRUPTION_REASONS`) — the
    platform, not the workload, ended it. ``failure``: what ended a Failed pod, for messages.
    ``unschedulable``: the scheduler's message while PodScheduled is False with reason Unschedulable.
    ``config_hash`` / ``role_config_hash``: the pod's ``rljob.dev/config-hash`` and ``rljob.dev/role-config-hash``
    labels (None when absent; pods made by operators before the role label have only the first).
    """

    name: str
    role: str
    index: int
    attempt: Optional[int]
    config_hash: Optional[str]
    phase: str
    ready: bool = False
    deleting: bool = False
    disrupted: bool = False
    failure: str = ""
    unschedulable: str = ""
    uid: str = ""
    owner_uid: str = ""
    """uid of the controller owner (the RLTrainingJob); another uid means a deleted job of the same name."""
    role_config_hash: Optional[str] = None
    reward_source_hash: Optional[str] = None
    """A rollout pod's ``rljob.dev/reward-source-hash`` label: the content of the reward ConfigMap it was made with."""
    container: str = ""
    """Name of the container the next fields describe: the first that waits for a reason other than being created,
    else the first that exited with an error, else the first that restarted, else the first main container that runs
    (then only ``running_since`` is set)."""
    waiting_reason: str = ""
    """Its waiting reason unless it is being created (:data:`STARTING_REASONS`): CrashLoopBackOff,
    CreateContainerConfigError, ImagePullBackOff, ErrImagePull ..."""
    waiting_message: str = ""
    """The kubelet's message for ``waiting_reason``, e.g. 'secret "nosuch" not found'."""
    restarts: int = 0
    """Its ``restartCount``."""
    last_failure: str = ""
    """Its last run that ended with a non-zero exit code (``lastState``, or ``state`` while terminated): "exit code 2
    (Error): <last line of the termination message>"; "" when none."""
    running_since: Optional[datetime] = None
    """When its current run started (``state.running.startedAt``); None while it does not run."""
    node: str = ""
    """The node it is bound to (``spec.nodeName``; "" while unscheduled)."""
    deletion_at: Optional[datetime] = None
    """``metadata.deletionTimestamp``: when its grace period ends (set once it is being deleted)."""
    lost_node_toleration_s: int = DEFAULT_LOST_NODE_TOLERATION_S
    """Seconds it tolerates its node being unreachable or not ready (its NoExecute tolerations of
    ``node.kubernetes.io/unreachable`` and ``not-ready``, the shorter; Kubernetes adds 300 s of each by default; -1: a
    toleration without seconds, forever)."""
    start_failure: str = ""
    """What a container of it said when it could not start for good (:func:`rljob_api.start_failure.permanent` of its
    current or last termination message; "" when none did): the operator fails the job with it (StartFailed)."""

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def active(self) -> bool:
        """Pending, Running or Unknown and not being deleted."""
        return not self.terminal and not self.deleting


def _int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def controller_uid(obj: Mapping[str, Any]) -> str:
    """uid of the object's controller owner reference when that is an RLTrainingJob ("" otherwise: none, or
    e.g. the ReplicaSet of a Redis pod)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((ref.get("uid", "") for ref in refs if ref.get("controller") and ref.get("kind") == c.KIND), "")


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """The :class:`PodView` of a raw Pod object (as the API server or a kopf body gives it)."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    conditions = {cond.get("type"): cond for cond in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget", {})
    scheduled = conditions.get("PodScheduled", {})
    ready = conditions.get("Ready", {}).get("status") == "True"
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "Unschedulable"
    return PodView(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=labels.get(c.LABEL_ROLE, ""),
        index=_int(labels.get(c.LABEL_REPLICA_INDEX)) or 0,
        attempt=_int(labels.get(c.LABEL_ATTEMPT)),
        config_hash=labels.get(c.LABEL_CONFIG_HASH),
        role_config_hash=labels.get(c.LABEL_ROLE_CONFIG_HASH),
        reward_source_hash=labels.get(c.LABEL_REWARD_SOURCE_HASH),
        phase=status.get("phase") or "Pending",
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        disrupted=disruption.get("status") == "True" or status.get("reason") in DISRUPTION_REASONS,
        failure=_failure(status),
        unschedulable=unschedulable,
        owner_uid=controller_uid(pod),
        node=(pod.get("spec") or {}).get("nodeName") or "",
        deletion_at=_time(meta.get("deletionTimestamp")),
        lost_node_toleration_s=_lost_node_toleration(pod),
        start_failure=_start_failure(status),
        **_container_fields(status),
    )


def _lost_node_toleration(pod: Mapping[str, Any]) -> int:
    """See :attr:`PodView.lost_node_toleration_s` (a toleration without seconds tolerates forever: never force)."""
    seconds = []
    for toleration in (pod.get("spec") or {}).get("tolerations") or []:
        if toleration.get("key") in LOST_NODE_TAINTS and toleration.get("effect") in (None, "", "NoExecute"):
            value = toleration.get("tolerationSeconds")
            seconds.append(_int(value) if value is not None else None)
    finite = [s for s in seconds if s is not None]
    if finite:
        return max(0, min(finite))
    return -1 if seconds else DEFAULT_LOST_NODE_TOLERATION_S


def _container_fields(status: Mapping[str, Any]) -> dict[str, Any]:
    """The PodView fields of the container that explains why a pod is not ready (see :class:`PodView`)."""
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    stuck = [cs for cs in containers if _waiting(cs).get("reason") not in (None, *STARTING_REASONS)]
    failed = [cs for cs in containers if ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")]
    restarted = [cs for cs in containers if cs.get("restartCount")]
    chosen = next(iter(stuck or failed or restarted), None)
    if chosen is None:  # all well so far: when the first main container runs, since when (is it ready by now?)
        running = next((cs for cs in status.get("containerStatuses") or [] if (cs.get("state") or {}).get("running")),
                       None)
        if running is None:
            return {}
        return {"container": running.get("name", ""), "running_since": _time(running["state"]["running"].get("startedAt"))}
    state = chosen.get("state") or {}
    wait = _waiting(chosen) if chosen in stuck else {}
    terminated = state.get("terminated") or (chosen.get("lastState") or {}).get("terminated") or {}
    return {
        "container": chosen.get("name", ""),
        "waiting_reason": wait.get("reason", ""),
        "waiting_message": wait.get("message") or "",
        "restarts": _int(chosen.get("restartCount")) or 0,
        "last_failure": _exit(terminated) if terminated.get("exitCode") else "",
        "running_since": _time((state.get("running") or {}).get("startedAt")),
    }


def _start_failure(status: Mapping[str, Any]) -> str:
    """The first permanent start failure a container's termination message says (its current state's, else its last
    one's: a rollout container restarted since); "" when none."""
    for container in status.get("containerStatuses") or []:
        for state in (container.get("state") or {}, container.get("lastState") or {}):
            said = start_failure.permanent(((state.get("terminated") or {}).get("message")) or "")
            if said:
                return said
    return ""


def _waiting(container_status: Mapping[str, Any]) -> Mapping[str, Any]:
    return (container_status.get("state") or {}).get("waiting") or {}


def _exit(terminated: Mapping[str, Any]) -> str:
    """A terminated run as "exit code N (Reason)", plus ": <last line>" of its termination message (with
    terminationMessagePolicy FallbackToLogsOnError: the tail of its log when the container wrote no message)."""
    text = f"exit code {terminated.get('exitCode')} ({terminated.get('reason') or 'Error'})"
    line = last_line(terminated.get("message") or "")
    return f"{text}: {line}" if line else text


def last_line(message: str) -> str:
    """The last line of ``message`` that says something (not blank, not a ``====`` rule), at most
    :data:`LAST_LINE_MAX` characters: a Python traceback's exception, a log's last error."""
    lines = [line.strip() for line in message.splitlines()]
    said = [line for line in lines if any(ch.isalnum() for ch in line)]
    if not said:
        return ""
    line = said[-1]
    return line if len(line) <= LAST_LINE_MAX else line[:LAST_LINE_MAX - 1] + "…"


def _time(value: Any) -> Optional[datetime]:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _failure(status: Mapping[str, Any]) -> str:
    """'reason: message' of the pod, else the first container that terminated with a non-zero code."""
    if status.get("phase") not in ("Failed", "Unknown"):
        return ""
    for container in status.get("containerStatuses") or []:
        term = (container.get("state") or {}).get("terminated") or {}
        if term.get("exitCode"):
            reason = term.get("reason") or "Error"
            line = last_line(term.get("message") or "")
            return f"container {container.get('name')} exited with code {term['exitCode']} ({reason})" + (
                f": {line}" if line else "")
    if status.get("reason") or status.get("message"):
        return ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
    return f"phase {status.get('phase')}"


@dataclass(frozen=True)
class NodeView:
    """A node as the gang logic needs it when a pod on it does not go away: whether its kubelet reports Ready, and
    since when its Ready condition has not been True. ``exists`` False: the Node object is gone."""

    name: str
    exists: bool = True
    ready: bool = True
    not_ready_since: Optional[datetime] = None
    reason: str = ""
    """The Ready condition's status and reason, e.g. "Unknown (NodeStatusUnknown)"."""


def node_view(name: str, node: Optional[Mapping[str, Any]]) -> NodeView:
    """The :class:`NodeView` of a raw Node object (None: it does not exist)."""
    if node is None:
        return NodeView(name, exists=False, ready=False, reason="the Node object is gone")
    conditions = {cond.get("type"): cond for cond in (node.get("status") or {}).get("conditions") or []}
    ready = conditions.get("Ready") or {}
    if ready.get("status") == "True":
        return NodeView(name)
    reason = f"{ready.get('status') or 'no Ready condition'}" + (f" ({ready['reason']})" if ready.get("reason") else "")
    return NodeView(name, ready=False, not_ready_since=_time(ready.get("lastTransitionTime")), reason=reason)


@dataclass(frozen=True)
class DeploymentView:
    """A child Deployment (the managed Redis, an environment server): available = every replica it wants (at least
    one) ready; ``replicas``: how many it wants (``spec.replicas``)."""

    name: str
    available: bool
    message: str
    owner_uid: str = ""
    replicas: int = 1


def deployment_view(deployment: Mapping[str, Any]) -> DeploymentView:
    """The :class:`DeploymentView` of a raw Deployment object."""
    meta = deployment.get("metadata", {})
    status = deployment.get("status") or {}
    wanted = (deployment.get("spec") or {}).get("replicas", 1)
    ready = status.get("availableReplicas") or 0
    available_cond = next(
        (cond for cond in status.get("conditions") or [] if cond.get("type") == "Available"), {}
    )
    available = ready >= max(1, wanted) and available_cond.get("status", "True") == "True"
    message = f"{ready}/{wanted} replicas available"
    if not available and available_cond.get("message"):
        message += f": {available_cond['message']}"
    failure = next((cond for cond in status.get("conditions") or [] if cond.get("type") == "ReplicaFailure"
                    and cond.get("status") == "True"), {})
    if not available and failure.get("message"):  # its pod cannot even be created, e.g. a PriorityClass not found
        message += f"; {failure.get('reason') or 'ReplicaFailure'}: {failure['message']}"
    return DeploymentView(name=meta.get("name", ""), available=available, message=message,
                          owner_uid=controller_uid(deployment), replicas=wanted)


CLAIM_PROBLEM_REASONS = frozenset({"FailedBinding"})
"""Normal-type Event reasons of a PersistentVolumeClaim that still mean it cannot bind as it is (the PV controller's
"no persistent volumes available for this claim and no storage class is set"); every Warning means so too."""


@dataclass(frozen=True)
class ClaimView:
    """The managed Redis's data claim as the operator reports it: ``phase`` (Pending, Bound, Lost), ``storage_class``
    (its spec.storageClassName: None when it names none, which after admission means the cluster had no default
    class) and ``problem``: "<reason>: <message>" of its newest Event when that one says why it cannot bind (a
    Warning, or :data:`CLAIM_PROBLEM_REASONS`); "" when the newest says it is on its way (Provisioning,
    ExternalProvisioning, WaitForFirstConsumer: a fixed class or provisioner shows so at once) or there is none."""

    name: str
    phase: str
    storage_class: Optional[str]
    problem: str = ""

    @property
    def bound(self) -> bool:
        return self.phase == "Bound"


def claim_view(claim: Mapping[str, Any], events: list[Mapping[str, Any]]) -> ClaimView:
    """The :class:`ClaimView` of a raw PersistentVolumeClaim and the Events whose involvedObject it is (as listed: any
    order; core/v1 Events, whose time is lastTimestamp, eventTime or the creation time; a repeated Event's
    lastTimestamp moves on). Events of an earlier claim of the same name (another uid) are left out."""
    def problem(event: Mapping[str, Any]) -> bool:
        return event.get("type") == "Warning" or event.get("reason") in CLAIM_PROBLEM_REASONS

    def when(event: Mapping[str, Any]) -> tuple[str, bool]:
        at = (event.get("lastTimestamp") or event.get("eventTime")
              or (event.get("metadata") or {}).get("creationTimestamp") or "")
        return at, problem(event)  # within one second, the problem is the newer news

    uid = (claim.get("metadata") or {}).get("uid")
    own = [e for e in events if (e.get("involvedObject") or {}).get("uid") in (None, uid)]
    newest = max(own, key=when, default=None)
    return ClaimView(
        name=(claim.get("metadata") or {}).get("name", ""),
        phase=(claim.get("status") or {}).get("phase") or "Pending",
        storage_class=(claim.get("spec") or {}).get("storageClassName"),
        problem=f"{newest.get('reason')}: {last_line(newest.get('message') or '')}" if newest and problem(newest)
        else "",
    )
