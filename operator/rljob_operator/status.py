"""Pure: the saved status + the gang lifecycle + observed children + progress → the new status, the merge patch
that writes it (None when nothing changed) and the Kubernetes Events of its transitions.

Conditions (metav1.Condition shaped, keyed by type):

======================  ==========================================================================================
Valid                   False: the spec has a problem only code can find (the message names the field); no
                        children are created until it is fixed. NotSupported: a valid request for something
                        not implemented yet (tensor/pipeline parallelism, the fast-llm backend).
RedisReady              managed: the Redis Deployment has a ready replica; external: the operator reached it
                        (over TLS: the certificate verified against spec.redis.caSecretRef or the system CAs); a
                        missing password or CA Secret names its field. Until this process has probed Redis itself
                        (after a restart), the saved condition stays.
RolloutReady            every rollout pod is ready; Unschedulable names pods the scheduler cannot place;
                        AllRewardsFailed: every sample of a worker's last batch failed its reward function (the
                        rollout hash's ``all_rewards_failed``), so nothing reaches the trainer; cleared when a
                        batch scores again.
TrainerReady            every trainer pod of the current attempt is running; Unschedulable names pods the
                        scheduler cannot place (scheduled ranks wait in rendezvous; not a failure).
Running                 the whole gang runs (phase Running).
Restarting              a gang restart is in progress (reason: what ended the attempt); appears on the first one.
Suspended               runPolicy.suspend is true and the pods are gone; appears on the first suspend.
Succeeded / Failed      terminal; appear once.
======================  ==========================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Mapping, Optional, Sequence

from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.status import Condition, RLTrainingJobStatus
from rljob_api.validation import SpecProblem

from rljob_operator.gang import Lifecycle
from rljob_operator.observe import PodView
from rljob_operator.progress import Progress

#: Conditions set from the first pass on; the others appear when they first become True.
ALWAYS = (ConditionType.VALID, ConditionType.REDIS_READY, ConditionType.ROLLOUT_READY, ConditionType.TRAINER_READY,
          ConditionType.RUNNING)
ORDER = (*ALWAYS, ConditionType.RESTARTING, ConditionType.SUSPENDED, ConditionType.SUCCEEDED, ConditionType.FAILED)
IDLE_PHASES = (Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED, Phase.INVALID)
_NOT_NEWS = (Reason.PODS_NOT_READY, Reason.WAITING_FOR_GANG, Reason.REDIS_UNAVAILABLE)
"""Reasons of a new job's first conditions that are not news: "not ready yet"."""
_HEALTHY_FROM_THE_START = (ConditionType.VALID, ConditionType.REDIS_READY)
"""Conditions whose first observation as True is not news either: a valid spec and a reachable Redis are what a
user expects of a new job; only a later change (or a False) is worth an Event."""


@dataclass(frozen=True)
class RedisHealth:
    """Whether Redis is usable: ``ready`` None = not known yet."""

    ready: Optional[bool]
    message: str


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the job: ``type`` Normal or Warning."""

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class _Cond:
    status: str
    reason: str
    """A :class:`Reason`, or a saved condition's reason kept as it was."""
    message: str


def valid_condition(problems: Sequence[SpecProblem]) -> _Cond:
    """Valid: True, or False naming every problem's field (NotSupported when all are not-yet-supported)."""
    if not problems:
        return _Cond("True", Reason.SPEC_VALID, "the spec is valid")
    reason = Reason.NOT_SUPPORTED if all(not p.supported for p in problems) else Reason.INVALID_SPEC
    return _Cond("False", reason, "; ".join(str(p) for p in problems) + "; fix the spec (kubectl edit rljob)")


def _pods_condition(role: str, pods: Sequence[PodView], wanted: int, ready_when) -> _Cond:
    ready = [p for p in pods if ready_when(p)]
    if wanted and len(ready) >= wanted:
        return _Cond("True", Reason.PODS_READY, f"{len(ready)}/{wanted} {role} pods ready")
    message = f"{len(ready)}/{wanted} {role} pods ready"
    unschedulable = [p for p in pods if p.unschedulable]
    if unschedulable:
        names = ", ".join(f"{p.name}: {p.unschedulable}" for p in unschedulable)
        hint = " (the scheduled ranks wait in rendezvous; this is not counted as a failure)" if role == "trainer" else ""
        return _Cond("False", Reason.UNSCHEDULABLE, f"{message}; cannot be scheduled: {names}{hint}")
    waiting = [f"{p.name} ({p.phase})" for p in pods if not ready_when(p)]
    if waiting:
        message += "; waiting for " + ", ".join(waiting)
    return _Cond("False", Reason.PODS_NOT_READY, message)


def _conditions(lc: Lifecycle, valid: _Cond, redis: RedisHealth, trainers: Sequence[PodView],
                rollouts: Sequence[PodView], nodes: int, replicas: int, rewards_failure: Optional[str],
                saved_redis: Optional[Condition]) -> dict[ConditionType, _Cond]:
    idle = lc.phase in IDLE_PHASES
    idle_cond = _Cond("False", lc.reason, lc.message)
    conds = {ConditionType.VALID: valid}
    if redis.ready is None and saved_redis is not None:  # not probed by this process yet: keep what was known
        conds[ConditionType.REDIS_READY] = _Cond(saved_redis.status, saved_redis.reason, saved_redis.message)
    elif redis.ready is None:
        conds[ConditionType.REDIS_READY] = _Cond("Unknown", Reason.REDIS_UNAVAILABLE, redis.message)
    else:
        conds[ConditionType.REDIS_READY] = _Cond(
            "True" if redis.ready else "False",
            Reason.REDIS_AVAILABLE if redis.ready else Reason.REDIS_UNAVAILABLE,
            redis.message,
        )
    current = [p for p in trainers if p.attempt == lc.attempt and not p.deleting]
    conds[ConditionType.TRAINER_READY] = idle_cond if idle else _pods_condition(
        "trainer", current, nodes, lambda p: p.phase == "Running"
    )
    if idle:
        conds[ConditionType.ROLLOUT_READY] = idle_cond
    elif rewards_failure:
        conds[ConditionType.ROLLOUT_READY] = _Cond("False", Reason.ALL_REWARDS_FAILED, rewards_failure)
    else:
        conds[ConditionType.ROLLOUT_READY] = _pods_condition(
            "rollout", [p for p in rollouts if not p.deleting], replicas, lambda p: p.phase == "Running" and p.ready
        )
    running = lc.phase == Phase.RUNNING
    conds[ConditionType.RUNNING] = _Cond("True" if running else "False", lc.reason, lc.message)
    for phase, ctype in ((Phase.RESTARTING, ConditionType.RESTARTING), (Phase.SUSPENDED, ConditionType.SUSPENDED),
                         (Phase.SUCCEEDED, ConditionType.SUCCEEDED), (Phase.FAILED, ConditionType.FAILED)):
        if lc.phase == phase:
            conds[ctype] = _Cond("True", lc.reason, lc.message)
    return conds


def build_status(
    previous: RLTrainingJobStatus,
    *,
    generation: Optional[int],
    lifecycle: Lifecycle,
    problems: Sequence[SpecProblem],
    data_parallel_size: Optional[int],
    redis: RedisHealth,
    pods: Iterable[PodView],
    nodes: int,
    replicas: int,
    progress: Optional[Progress],
    now: datetime,
) -> RLTrainingJobStatus:
    """The new status. Conditions keep their lastTransitionTime while their status is unchanged; conditions
    that were True once stay listed (False with the current phase's reason) once they no longer hold.
    Progress fields, and RolloutReady=False/AllRewardsFailed, keep their old values when ``progress`` is None
    (Redis not read this pass); RedisReady keeps its saved value while ``redis.ready`` is None (not probed yet)."""
    pods = list(pods)
    old = {cond.type: cond for cond in previous.conditions}
    rollout_ready = old.get(ConditionType.ROLLOUT_READY)
    if progress is not None:
        rewards_failure = progress.rewards_failure
    elif rollout_ready is not None and rollout_ready.reason == Reason.ALL_REWARDS_FAILED.value:
        rewards_failure = rollout_ready.message
    else:
        rewards_failure = None
    fresh = _conditions(
        lifecycle,
        valid_condition(problems),
        redis,
        [p for p in pods if p.role == "trainer"],
        [p for p in pods if p.role == "rollout"],
        nodes,
        replicas,
        rewards_failure,
        old.get(ConditionType.REDIS_READY),
    )
    conditions = []
    for ctype in ORDER:
        new = fresh.get(ctype)
        if new is None and ctype in old:
            if ctype == ConditionType.SUSPENDED:
                new = _Cond("False", Reason.JOB_RESUMED, "the job was resumed")
            else:
                new = _Cond("False", lifecycle.reason, lifecycle.message)
        if new is None:
            continue
        before = old.get(ctype)
        changed = before is None or before.status != new.status
        conditions.append(
            Condition(
                type=ctype,
                status=new.status,
                reason=getattr(new.reason, "value", new.reason),
                message=new.message,
                last_transition_time=now if changed else before.last_transition_time,
                observed_generation=generation,
            )
        )
    fields: dict[str, Any] = dict(
        phase=lifecycle.phase,
        observed_generation=generation,
        attempt=lifecycle.attempt,
        restarts=lifecycle.restarts,
        failed_attempts=lifecycle.failed_attempts,
        gang_created=lifecycle.gang_created,
        data_parallel_size=data_parallel_size,
        start_time=lifecycle.start_time,
        completion_time=lifecycle.completion_time,
        conditions=conditions,
    )
    if progress is not None:
        fields.update(progress.status_fields())
    return previous.model_copy(update=fields)


def to_json(status: RLTrainingJobStatus) -> dict[str, Any]:
    """The status as the API server stores it (camelCase, RFC 3339 times, no nulls)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 JSON merge patch turning ``old`` into ``new`` (removed keys become null; lists are replaced).

    Returns an empty dict when they are equal.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value) if isinstance(value, dict) else value
    return patch


def status_patch(stored: Mapping[str, Any], new: RLTrainingJobStatus) -> Optional[dict[str, Any]]:
    """The ``{"status": ...}`` merge patch from the ``stored`` status (as the API server holds it) to ``new``;
    None when nothing changed."""
    patch = merge_patch(dict(stored), to_json(new))
    return {"status": patch} if patch else None


def transition_events(previous: RLTrainingJobStatus, new: RLTrainingJobStatus) -> list[Event]:
    """One Event per condition whose status or reason changed (Warning for failures, restarts, invalid specs,
    unschedulable pods and rewards that all failed; Normal otherwise); conditions that echo the same reason and
    message (the pod conditions of a suspended or invalid job) give one Event. A new job's first conditions give
    none while they say what is expected (Valid=True, RedisReady=True, pods not ready yet): a job created
    suspended gets one Event (JobSuspended), a job created running none until something changes."""
    old = {cond.type: cond for cond in previous.conditions}
    events = []
    said: set[tuple[str, str]] = set()
    for cond in new.conditions:
        before = old.get(cond.type)
        if before is not None and before.status == cond.status and (
            before.reason == cond.reason or cond.type == ConditionType.RUNNING
        ):
            continue  # Running's reason follows the phase, whose own condition reports it
        if before is None and (
            (cond.status != "True" and cond.reason in _NOT_NEWS)
            or (cond.status == "True" and cond.type in _HEALTHY_FROM_THE_START)
        ):
            continue  # a new job's initial "not ready yet", valid spec and reachable Redis are not news
        if (cond.reason, cond.message) in said:
            continue
        said.add((cond.reason, cond.message))
        warning = (
            (cond.type in (ConditionType.FAILED, ConditionType.RESTARTING) and cond.status == "True")
            or (cond.type == ConditionType.VALID and cond.status == "False")
            or cond.reason in (Reason.UNSCHEDULABLE, Reason.ALL_REWARDS_FAILED)
        )
        events.append(Event("Warning" if warning else "Normal", cond.reason, f"{cond.type.value}={cond.status}: "
                            f"{cond.message}"))
    return events
