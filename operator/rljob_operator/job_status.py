"""Pure: the saved status + the gang lifecycle + observed children + progress → the new status, the merge patch
that writes it (None when nothing changed) and the Kubernetes Events of its transitions.

Conditions (metav1.Condition shaped, keyed by type):

======================  ==========================================================================================
Valid                   False: the spec has a problem only code can find (the message names the field); no
                        children are created until it is fixed. NotSupported: a valid request for something
                        not implemented yet (tensor/pipeline parallelism).
RedisReady              managed: the Redis Deployment has a ready replica; external: the operator reached it
                        (over TLS: the certificate verified against spec.redis.caSecretRef or the system CAs); a
                        missing password or CA Secret names its field; a managed Redis pod that cannot be scheduled
                        or started is named; ClaimPending: its data claim cannot bind (the message names the claim,
                        its storage class and the claim's Event that says why). Until this process has probed Redis
                        itself (after a restart), the saved condition stays.
RolloutReady            every rollout pod is ready; ExternalProducers (True): spec.rollout.replicas is 0, rljob runs no
                        rollout pod and producers outside rljob write the stream (the message names the stream, its
                        consumer group, the events key, the Redis address and the members hash; status.stream holds
                        them all); Unschedulable names pods the scheduler cannot place;
                        ContainerCannotStart names the kubelet's waiting reason and message (a missing Secret,
                        an image that cannot be pulled); ContainerFailing: a container keeps exiting with an error
                        (CrashLoopBackOff), with its restart count and last exit code and termination message, and
                        stays so between restarts (:func:`failing`; a reward module that does not load says its
                        file and line there, rljob_rollout.tasks); RewardSourceMissing: the ConfigMap of
                        spec.rollout.task.rewardSource, or its key, does not exist (the message names them);
                        AllRewardsFailed: every sample of a worker's last batch failed its reward function (the
                        rollout hash's ``all_rewards_failed``), so nothing
                        reaches the trainer; the message says since when and when the job fails for it
                        (rewardFailureDeadlineSeconds, then Failed/RewardsFailing); cleared when a batch scores again.
EnvironmentReady        only on a job with spec.rollout.environment.server or url. server: every replica of the
                        environment server's Deployment is available (EnvironmentAvailable); False while it runs no
                        pod (the phase's reason: suspended, held by Kueue, finished, invalid), or naming the field at
                        fault: ContainerCannotStart (an image that cannot be pulled names server.image), ContainerFailing
                        (a crash loop, with its last termination message), ReadinessFailing (nothing answers on
                        server.port), Unschedulable, PodsNotReady while they start. url: Unknown, ExternalEnvironment
                        (the operator does not probe it). Running does not wait for it (see Running).
TrainerReady            every trainer pod of the current attempt is running; Unschedulable names pods the
                        scheduler cannot place (scheduled ranks wait in rendezvous; not a failure);
                        ContainerCannotStart and ContainerFailing as for RolloutReady.
Running                 training steps can be made (phase Running): the whole gang runs, Redis is ready and trainer
                        rank 0 reported the attempt's start (the progress hash's ``started_attempt``; until then phase
                        Starting, reason TrainerStarting; a gang whose Redis is down stays in phase Starting, reason
                        RedisUnavailable). CheckpointLost (still
                        True): the attempt started below the last recorded checkpoint because the checkpoint volume
                        no longer holds it (the progress hash's ``checkpoint_lost``). The message adds when no new
                        document can reach the trainer because RolloutReady or EnvironmentReady is False with none of
                        their pods serving; Running waits for neither (the trainer steps on what the stream holds).
Restarting              a gang restart is in progress (reason: what ended the attempt; the message: where the next
                        attempt starts); appears on the first one.
Suspended               runPolicy.suspend is true and the pods are gone; appears on the first suspend.
Succeeded / Failed      terminal; appear once. Succeeded's message says where the final weights were exported.
                        Failed/StartFailed: a trainer pod of the attempt or a rollout pod said it cannot start for
                        good (rljob_api.start_failure); the message quotes it (the spec field and its value).
======================  ==========================================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Optional, Sequence

from rljob_api import names, protocol
from rljob_api.config import JobConfig
from rljob_api.constants import ConditionType, Phase, Reason, Role
from rljob_api.protocol import LostCheckpoint, Progress
from rljob_api.spec import EnvironmentServerSpec, RedisPersistenceSpec, RLTrainingJobSpec, SecretKeyRef
from rljob_api.status import CheckpointStatus, Condition, RLTrainingJobStatus, SecretKeyStatus, StreamStatus
from rljob_api.validation import SpecProblem

from rljob_operator import account, capacity, eta, overrides
from rljob_operator.gang import Lifecycle, held_message, plural
from rljob_operator.observe import RESTART_REASONS, DeploymentView, PodView

def lost_checkpoint_message(lost: LostCheckpoint, attempt: int, volume: Optional[str]) -> str:
    """What Running=True/CheckpointLost says about gang ``attempt`` (:func:`rljob_api.protocol.lost_checkpoint_message`);
    ``volume``: spec.trainer.checkpoint.volume (None: an emptyDir)."""
    return protocol.lost_checkpoint_message(replace(lost, attempt=attempt), volume)


def stream_lost_message(old: str, new: Optional[str], backlog: Optional[protocol.Backlog], checkpoint: Any,
                        attempt: int) -> str:
    """The one description of a stream Redis forgot (operator Event and Running message). ``backlog``: the group's
    last counts the operator read before (None: never read); ``checkpoint``: status.lastCheckpoint (its ``step`` and
    ``documents_seen``; None: none committed). Both are the operator's last read, a pass before the loss at most: a
    checkpoint committed after it (which the next attempt loads) covered part of those pending entries, so the message
    names the checkpoint as the newest one known, never as the one that will be loaded."""
    now = f"holds another one ({new})" if new else "holds none"
    lost = "what it held is gone"
    if backlog is not None:
        undelivered = "an unknown number of" if backlog.undelivered is None else str(backlog.undelivered)
        lost = (f"at the operator's last read it held {backlog.pending} entries trained since the last checkpoint "
                f"(pending) and {undelivered} written but not delivered yet: those not covered by a later checkpoint "
                "are gone")
    if checkpoint is not None:
        goes_on = (f"the gang goes on from the newest committed checkpoint, step {checkpoint.step} "
                   f"({checkpoint.documents_seen} documents) at that read or a later one, recreating the stream and its "
                   "consumer group")
    else:
        goes_on = ("the gang goes on from the newest committed checkpoint (none at the operator's last read: then it "
                   "starts over), recreating the stream and its consumer group")
    return (f"Redis forgot the job's stream during attempt {attempt} (its identity was {old}, Redis {now}; a managed "
            f"Redis without persistence restarted, or an external one was flushed or failed over): {lost}; "
            f"{goes_on}; the restart is not counted against backoffLimit")


def status_fields(progress: Progress) -> dict[str, Any]:
    """The status fields ``progress`` sets (snake_case names of :class:`RLTrainingJobStatus`)."""
    fields: dict[str, Any] = {
        name: getattr(progress, name)
        for name in ("step", "documents_seen", "model_version", "tokens_per_second", "rollout_reward",
                     "rollout_model_version")
        if getattr(progress, name) is not None
    }
    if progress.metrics:
        fields["last_metrics"] = dict(progress.metrics)
    if progress.checkpoint is not None:
        record = progress.checkpoint
        fields["last_checkpoint"] = CheckpointStatus(
            step=record.step, documents_seen=record.documents_seen, path=record.path,
            time=None if record.committed_at is None else datetime.fromtimestamp(record.committed_at, timezone.utc))
    return fields


#: Conditions set from the first pass on; the others appear when they first become True.
ALWAYS = (ConditionType.VALID, ConditionType.REDIS_READY, ConditionType.ROLLOUT_READY, ConditionType.TRAINER_READY,
          ConditionType.RUNNING)
ORDER = (ConditionType.VALID, ConditionType.REDIS_READY, ConditionType.ROLLOUT_READY, ConditionType.ENVIRONMENT_READY,
         ConditionType.TRAINER_READY, ConditionType.RUNNING, ConditionType.RESTARTING, ConditionType.SUSPENDED, ConditionType.SUCCEEDED, ConditionType.FAILED)
IDLE_PHASES = (Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED, Phase.INVALID)
_NOT_NEWS = (Reason.PODS_NOT_READY, Reason.WAITING_FOR_GANG, Reason.GANG_CREATED, Reason.REDIS_UNAVAILABLE)
"""Reasons of a new job's first conditions that are not news: "not ready yet" (a new job's first status is written
once its gang is created)."""
_HEALTHY_FROM_THE_START = (ConditionType.REDIS_READY,)
"""Conditions whose first observation as True is not news either: a reachable external Redis is what a user expects
of a new job; only a later change (or a False) is worth an Event. Valid=True keeps its Event (SpecValid): it is the
one transition that tells a user the operator has accepted the job."""
_RUNNING_NEWS = (Reason.CHECKPOINT_LOST, Reason.EVICTED_BY_KUEUE, Reason.KUEUE_NOT_AVAILABLE,
                 Reason.KUEUE_INADMISSIBLE)
"""Reasons of Running that are news even while Running stays False (its reason otherwise follows the phase): a lost
checkpoint, and a queued job that Kueue evicted or cannot queue (after WaitingForAdmission, say)."""
_PHASE_CONDITIONS = (ConditionType.RESTARTING, ConditionType.SUSPENDED, ConditionType.SUCCEEDED, ConditionType.FAILED)
"""Conditions that describe a phase: of conditions that say the same, they give the Event."""
_WARNINGS = (Reason.UNSCHEDULABLE, Reason.ALL_REWARDS_FAILED, Reason.CONTAINER_CANNOT_START, Reason.CONTAINER_FAILING,
             Reason.READINESS_FAILING,
             Reason.CHECKPOINT_LOST, Reason.REDIS_UNAVAILABLE, Reason.CLAIM_PENDING, Reason.REWARD_SOURCE_MISSING,
             Reason.KUEUE_NOT_AVAILABLE, Reason.KUEUE_INADMISSIBLE)
"""Reasons whose Events are Warnings (besides Failed, Restarting and Valid=False)."""
_STARVED = (Reason.UNSCHEDULABLE, Reason.CONTAINER_CANNOT_START, Reason.CONTAINER_FAILING,
            Reason.REWARD_SOURCE_MISSING, Reason.READINESS_FAILING)
"""RolloutReady and EnvironmentReady reasons that, with none of their pods serving, mean that no new document reaches
the trainer."""

FAILING_WINDOW_PER_RESTART_S = 60.0
FAILING_WINDOW_MAX_S = 600.0
"""A container that restarted after a failure counts as failing (not ready) until its current run has lasted
FAILING_WINDOW_PER_RESTART_S per restart, at most FAILING_WINDOW_MAX_S (seconds; the kubelet, too, forgets a crash
loop after 10 minutes of running). A crash loop whose runs are shorter than that keeps its condition False between
restarts rather than flipping it (and posting two Events) on every restart, and the window outgrows longer runs after
a few restarts; one crash costs a healthy container at most a minute of readiness."""


@dataclass(frozen=True)
class RedisHealth:
    """Whether Redis is usable: ``ready`` None = not known yet. ``reason``: RedisReady's reason when it is not the one
    ``ready`` implies (ClaimPending: the managed Redis's data claim cannot bind)."""

    ready: Optional[bool]
    message: str
    reason: Optional[Reason] = None


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


def redis_replaced(job: str, before: Optional[RedisPersistenceSpec],
                   after: Optional[RedisPersistenceSpec]) -> Optional[Event]:
    """The Warning Event RedisReplaced when the managed Redis of ``job`` moved between an emptyDir (``None``) and its
    data claim (``before`` and ``after``: :func:`~rljob_operator.render.redis_persistence` of the recorded and the new
    config, both managed); None when it stayed where it was (a size or class edit does not change an existing
    claim)."""
    if (before is None) == (after is None):
        return None
    claim = names.redis_claim(job)
    move = (f"from an emptyDir to the claim {claim} (spec.redis.persistence.enabled: true)" if after is not None else
            f"from the claim {claim} to an emptyDir (spec.redis.persistence.enabled: false; the claim is deleted)")
    return Event("Warning", Reason.REDIS_REPLACED.value,
                 f"the managed Redis {names.redis_name(job)} moved {move}: its new pod started empty, so the stream, "
                 "its consumer group and pending entries and the progress and checkpoint hashes of the old one are "
                 "gone; a running trainer gang restarts from its newest checkpoint")


def valid_condition(problems: Sequence[SpecProblem], kept: Optional[str] = None) -> _Cond:
    """Valid: True, or False naming every problem's field (NotSupported when all are not-yet-supported); the message
    ends with "fix the spec (kubectl edit rljob)" when a problem is in the spec (a bad name says what to do itself),
    then with ``kept`` (what the running job goes on with meanwhile, see :mod:`.reconcile`) when given."""
    if not problems:
        return _Cond("True", Reason.SPEC_VALID, "the spec is valid")
    reason = Reason.NOT_SUPPORTED if all(not p.supported for p in problems) else Reason.INVALID_SPEC
    hint = "; fix the spec (kubectl edit rljob)" if any(p.field.startswith("spec") for p in problems) else ""
    return _Cond("False", reason, "; ".join(str(p) for p in problems) + hint + (f"; {kept}" if kept else ""))


def failing(pod: PodView, now: datetime) -> bool:
    """Whether ``pod``'s container keeps failing: it waits to be restarted (CrashLoopBackOff), or its last run failed
    and its current run (if any) is younger than the window of :data:`FAILING_WINDOW_MAX_S`."""
    if pod.waiting_reason in RESTART_REASONS:
        return True
    if not pod.last_failure:
        return False
    if pod.running_since is None:
        return True
    window = min(FAILING_WINDOW_PER_RESTART_S * max(pod.restarts, 1), FAILING_WINDOW_MAX_S)
    return (now - pod.running_since).total_seconds() < window


def _failing_detail(pod: PodView) -> str:
    """e.g. "container rollout CrashLoopBackOff, 3 restarts; last run: exit code 2 (Error): <termination message's
    last line>"."""
    state = pod.waiting_reason or ("running again" if pod.running_since else "exited")
    restarts = f", {plural(pod.restarts, 'restart')}" if pod.restarts else ""
    return f"container {pod.container} {state}{restarts}" + (f"; last run: {pod.last_failure}" if pod.last_failure
                                                            else "")


def _grouped(details: Iterable[tuple[str, str]]) -> str:
    """(pod name, detail) pairs as "a, b: detail; c: other detail" (pods that say the same are named together)."""
    groups: dict[str, list[str]] = {}
    for name, detail in details:
        groups.setdefault(detail, []).append(name)
    return "; ".join(f"{', '.join(names)}: {detail}" for detail, names in groups.items())


_LABELS = {Reason.UNSCHEDULABLE: "cannot be scheduled", Reason.CONTAINER_CANNOT_START: "cannot start",
           Reason.CONTAINER_FAILING: "failing", Reason.READINESS_FAILING: "not ready"}


_POD_TROUBLES = (Reason.UNSCHEDULABLE, Reason.CONTAINER_CANNOT_START, Reason.CONTAINER_FAILING,
                 Reason.READINESS_FAILING)
"""What keeps a pod from being ready, by precedence (the reason of a pods condition that names several)."""


def secret_fields(spec: RLTrainingJobSpec) -> dict[str, str]:
    """Secret name → the spec field that names it (hfTokenSecretRef, redis.passwordSecretRef, redis.caSecretRef, a
    role's podTemplate)."""
    refs = (("spec.hfTokenSecretRef", spec.hf_token_secret_ref), ("spec.redis.passwordSecretRef",
            spec.redis.password_secret_ref), ("spec.redis.caSecretRef", spec.redis.ca_secret_ref))
    fields = {ref.name: field for field, ref in refs if ref is not None}
    for role, section in (("trainer", spec.trainer), ("rollout", spec.rollout)):
        for name in overrides.secret_names(section.pod_template):
            fields.setdefault(name, f"spec.{role}.podTemplate")
    return fields


def name_secret_fields(pods: Iterable[PodView], fields: Mapping[str, str]) -> list[PodView]:
    """``pods`` with the spec field added to a kubelet waiting message about a Secret of ``fields``
    (:func:`secret_fields`), e.g. 'secret "hf" not found' → 'secret "hf" not found (spec.hfTokenSecretRef)', or
    "couldn't find key token in Secret ns/hf" likewise."""
    named = []
    for pod in pods:
        message = pod.waiting_message
        field = next((f for name, f in fields.items() if f'secret "{name}" not found' in message
                      or re.search(rf"in Secret [^/\s]+/{re.escape(name)}(?![-.\w])", message)), None)
        named.append(replace(pod, waiting_message=f"{message} ({field})") if field and field not in message else pod)
    return named


_NO_RLJOB = re.compile(r"No module named '?rljob_")
"""Python's words when an image lacks rljob's packages (``python -m rljob_rollout`` in a plain image)."""


def name_images_without_rljob(pods: Iterable[PodView], spec: RLTrainingJobSpec) -> list[PodView]:
    """``pods`` with the image field added to a trainer or rollout container's last failure that says Python found no
    rljob module, e.g. "... No module named rljob_rollout (spec.rollout.image 'python:3.11' has no rljob: build it
    FROM rljob's trainer image, or install rljob's packages in it)"."""
    images = {Role.TRAINER.value: spec.trainer.image, Role.ROLLOUT.value: spec.rollout.image}
    named = []
    for pod in pods:
        image = images.get(pod.role)
        if image and _NO_RLJOB.search(pod.last_failure) and "has no rljob" not in pod.last_failure:
            pod = replace(pod, last_failure=f"{pod.last_failure} (spec.{pod.role}.image {image!r} has no rljob: build "
                                            "it FROM rljob's trainer image, or install rljob's packages in it)")
        named.append(pod)
    return named


def name_spec_fields(pods: Iterable[PodView], spec: RLTrainingJobSpec) -> list[PodView]:
    """``pods`` with the spec fields behind their kubelet messages named: :func:`name_secret_fields` and
    :func:`name_images_without_rljob`."""
    return name_images_without_rljob(name_secret_fields(pods, secret_fields(spec)), spec)


def pod_trouble(pod: PodView, now: datetime) -> Optional[tuple[Reason, str]]:
    """Why ``pod`` is not ready when it is not merely on its way: (Unschedulable, the scheduler's message),
    (ContainerFailing, e.g. "container rollout CrashLoopBackOff, 3 restarts; last run: exit code 2 (Error): ..."),
    (ContainerCannotStart, e.g. 'container trainer CreateContainerConfigError: secret "nosuch" not found'); None."""
    if pod.unschedulable:
        return Reason.UNSCHEDULABLE, pod.unschedulable
    if failing(pod, now):
        return Reason.CONTAINER_FAILING, _failing_detail(pod)
    if pod.waiting_reason:
        return Reason.CONTAINER_CANNOT_START, f"container {pod.container} {pod.waiting_reason}" + (
            f": {pod.waiting_message}" if pod.waiting_message else "")
    return None


def describe_troubles(pods: Iterable[PodView], now: datetime) -> str:
    """ "name: cannot start: detail; ..." for every pod of ``pods`` with a :func:`pod_trouble` ("" when none)."""
    found = [(p.name, pod_trouble(p, now)) for p in pods]
    return "; ".join(f"{name}: {_LABELS[trouble[0]]}: {trouble[1]}" for name, trouble in found if trouble)


def _pods_condition(role: Role, pods: Sequence[PodView], wanted: int, ready_when, now: datetime,
                    trouble=pod_trouble) -> _Cond:
    """The readiness of one role's pods. Reason by precedence: Unschedulable, ContainerCannotStart, ContainerFailing,
    ReadinessFailing, PodsNotReady; the message names every pod that is not ready and why (``trouble``, by default
    :func:`pod_trouble`). A pod that Succeeded did its part (its container exited 0: training finished) and counts as
    ready, noted as finished, so the last seconds of a job, when some pods have exited and others not yet, are not told
    as pods that stopped being ready."""
    troubles = {p.name: trouble(p, now) for p in pods}
    ready = [p for p in pods if (ready_when(p) or p.phase == "Succeeded") and troubles[p.name] is None]
    finished = sum(p.phase == "Succeeded" for p in ready)
    message = f"{len(ready)}/{wanted} {role.value} pods ready" + (f" ({finished} finished)" if finished else "")
    if wanted and len(ready) >= wanted:
        return _Cond("True", Reason.PODS_READY, message)
    by_reason: dict[Reason, list[tuple[str, str]]] = {}
    for name, trouble in troubles.items():
        if trouble is not None:
            by_reason.setdefault(trouble[0], []).append((name, trouble[1]))
    unschedulable = by_reason.get(Reason.UNSCHEDULABLE)
    if unschedulable:
        hint = " (the scheduled ranks wait in rendezvous; this is not counted as a failure)" if role == Role.TRAINER else ""
        message += "; cannot be scheduled: " + ", ".join(f"{name}: {detail}" for name, detail in unschedulable) + hint
    for reason in _POD_TROUBLES[1:]:
        if reason in by_reason:
            message += f"; {_LABELS[reason]}: {_grouped(by_reason[reason])}"
    ready_names = {p.name for p in ready}
    waiting = [f"{p.name} ({p.phase})" for p in pods if p.name not in ready_names and troubles[p.name] is None]
    if waiting:
        message += "; waiting for " + ", ".join(waiting)
    reason = next((r for r in _POD_TROUBLES if r in by_reason), Reason.PODS_NOT_READY)
    return _Cond("False", reason, message)


def stream_status(config: JobConfig, password: Optional[SecretKeyRef]) -> StreamStatus:
    """status.stream of a job from its resolved ``config``; ``password``: where its roles' REDIS_PASSWORD comes from
    (:func:`rljob_operator.render.redis_password_ref`)."""
    redis, keys = config.redis, config.keys
    return StreamStatus(
        redis_address=f"{redis.host}:{redis.port}/{redis.db}",
        tls=redis.tls,
        password_secret_ref=None if password is None else SecretKeyStatus(name=password.name, key=password.key),
        stream_key=keys.stream,
        group=keys.group,
        events_key=keys.events,
        members_key=keys.members,
        dead_letter_key=keys.dead_letter,
        first_transfer_rank=config.first_external_transfer_rank(),
        weights_address=f"{config.trainer_master_host}:{config.weights_port}",
    )


def external_producers(stream: Optional[StreamStatus]) -> _Cond:
    """RolloutReady of a trainer-only job (spec.rollout.replicas 0): True, ExternalProducers, naming where producers
    outside rljob write (``stream``; None: not known in this pass, the message points at status.stream)."""
    message = "spec.rollout.replicas is 0: rljob runs no rollout pod; producers outside rljob write documents"
    if stream is None:
        return _Cond("True", Reason.EXTERNAL_PRODUCERS, f"{message} to the stream that status.stream names")
    return _Cond("True", Reason.EXTERNAL_PRODUCERS, (
        f"{message} to stream {stream.stream_key} (consumer group {stream.group}) and read events from "
        f"{stream.events_key} at Redis {stream.redis_address}; they receive weights by heartbeating in "
        f"{stream.members_key} as transfer rank {stream.first_transfer_rank} or above (status.stream)"))


IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
"""The kubelet's waiting reasons of a container whose image it cannot pull (or whose name is not an image's)."""
READINESS_GRACE_S = 30.0
"""How long an environment server container may run without passing its readiness probe before EnvironmentReady says
so (ReadinessFailing, naming the port): a server takes a few seconds to start listening."""


@dataclass(frozen=True)
class EnvironmentReport:
    """What EnvironmentReady is made of, on a job whose rollouts step an environment server: ``url``, where the rollout
    workers reach it; ``server``, the one the operator runs (None: ``spec.rollout.environment.url``, outside the job);
    ``name``, its Deployment's; ``deployment``, that Deployment as observed (None: not made yet); ``replicas``, the
    pods it should run in this pass (0: stopped with the job: suspended, held by Kueue, finished or invalid)."""

    url: str
    server: Optional[EnvironmentServerSpec] = None
    name: str = ""
    deployment: Optional[DeploymentView] = None
    replicas: int = 0


def _environment_trouble(server: EnvironmentServerSpec, pod: PodView, now: datetime) -> Optional[tuple[Reason, str]]:
    """:func:`pod_trouble` of an environment server pod, naming the field at fault: an image that cannot be pulled
    names ``spec.rollout.environment.server.image``; a container that has run :data:`READINESS_GRACE_S` without being
    ready (ReadinessFailing) names ``spec.rollout.environment.server.port``."""
    found = pod_trouble(pod, now)
    if found is not None:
        reason, detail = found
        if reason == Reason.CONTAINER_CANNOT_START and pod.waiting_reason in IMAGE_PULL_REASONS:
            detail = f"spec.rollout.environment.server.image {server.image!r} cannot be pulled: {detail}"
        return reason, detail
    if pod.phase != "Running" or pod.ready or pod.running_since is None:
        return None
    ran = int((now - pod.running_since).total_seconds())
    if ran < READINESS_GRACE_S:
        return None
    return Reason.READINESS_FAILING, (
        f"spec.rollout.environment.server.port {server.port}: container {pod.container} has run for {ran} s but "
        f"nothing answers its readiness probe (a TCP connection to port {server.port}); the server must listen on "
        f"0.0.0.0:{server.port}")


def environment_condition(report: EnvironmentReport, lc: Lifecycle, pods: Sequence[PodView], now: datetime) -> _Cond:
    """EnvironmentReady: Unknown (ExternalEnvironment) for an external ``url``, which the operator does not probe;
    False with the phase's reason while the server runs no pod (the job is suspended, held by Kueue, finished or
    invalid); True (EnvironmentAvailable) once its Deployment has every replica available; else False naming why, as
    the rollout pods' condition does (Unschedulable, ContainerCannotStart, ContainerFailing with the last termination
    message), with the field at fault (:func:`_environment_trouble`), or ReadinessFailing, or PodsNotReady while they
    start. ``pods``: the job's environment server pods."""
    if report.server is None:
        return _Cond("Unknown", Reason.EXTERNAL_ENVIRONMENT, (
            f"spec.rollout.environment.url {report.url} is a server outside the job, which the operator does not probe "
            "(from the operator's network a probe would not tell whether the rollout pods reach it); the rollout "
            "workers count the episodes it fails, and RolloutReady is AllRewardsFailed while every episode of their "
            "batches fails"))
    if report.replicas == 0:
        return _Cond("False", lc.reason, lc.message)
    where = f"environment server {report.name} ({report.url})"
    if report.deployment is None:
        return _Cond("False", Reason.PODS_NOT_READY, f"{where}: its Deployment does not exist yet")
    if report.deployment.available:
        return _Cond("True", Reason.ENVIRONMENT_AVAILABLE, f"{where}: {report.deployment.message}")
    found = _pods_condition(Role.ENVIRONMENT, [p for p in pods if not p.deleting], report.replicas,
                            lambda p: p.phase == "Running" and p.ready, now,
                            trouble=lambda p, at: _environment_trouble(report.server, p, at))
    if found.status == "True":  # every pod ready, the Deployment not yet counting them available
        return _Cond("False", Reason.PODS_NOT_READY, f"{where}: {report.deployment.message}")
    return _Cond("False", found.reason, f"{where}: {found.message}")


def _conditions(lc: Lifecycle, valid: _Cond, redis: RedisHealth, trainers: Sequence[PodView],
                rollouts: Sequence[PodView], nodes: int, replicas: int, rewards_failure: Optional[str],
                saved_redis: Optional[Condition], lost: Optional[str], stream: Optional[StreamStatus],
                now: datetime, reward_source: Optional[str] = None, environment: Optional[EnvironmentReport] = None,
                environments: Sequence[PodView] = (), scale_wait: Optional[str] = None) -> dict[ConditionType, _Cond]:
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
            redis.reason or (Reason.REDIS_AVAILABLE if redis.ready else Reason.REDIS_UNAVAILABLE),
            redis.message,
        )
    current = [p for p in trainers if p.attempt == lc.attempt and not p.deleting]
    conds[ConditionType.TRAINER_READY] = idle_cond if idle else _pods_condition(
        Role.TRAINER, current, nodes, lambda p: p.phase == "Running", now
    )
    rollouts = [p for p in rollouts if not p.deleting]
    if idle:
        conds[ConditionType.ROLLOUT_READY] = idle_cond
    elif replicas == 0:  # a trainer-only job: a reward streak left by earlier rollout pods is no longer anyone's
        conds[ConditionType.ROLLOUT_READY] = external_producers(stream)
    elif reward_source:
        conds[ConditionType.ROLLOUT_READY] = _Cond("False", Reason.REWARD_SOURCE_MISSING, reward_source)
    elif rewards_failure:
        conds[ConditionType.ROLLOUT_READY] = _Cond("False", Reason.ALL_REWARDS_FAILED, rewards_failure)
    else:
        conds[ConditionType.ROLLOUT_READY] = _pods_condition(
            Role.ROLLOUT, rollouts, replicas, lambda p: p.phase == "Running" and p.ready, now
        )
        if scale_wait:
            pods_message = conds[ConditionType.ROLLOUT_READY].message
            conds[ConditionType.ROLLOUT_READY] = _Cond("False", Reason.SCALE_UP_WAITING_FOR_QUOTA,
                                                       f"{pods_message}; {scale_wait}")
    if environment is not None:
        conds[ConditionType.ENVIRONMENT_READY] = idle_cond if idle else environment_condition(
            environment, lc, environments, now)
    feeders = [(ConditionType.ROLLOUT_READY, _serving(rollouts, now))]
    if environment is not None:
        feeders.append((ConditionType.ENVIRONMENT_READY, _serving(environments, now)))
    conds[ConditionType.RUNNING] = _running(lc, [(ctype, conds[ctype], serving) for ctype, serving in feeders], lost)
    for phase, ctype in ((Phase.RESTARTING, ConditionType.RESTARTING), (Phase.SUSPENDED, ConditionType.SUSPENDED),
                         (Phase.SUCCEEDED, ConditionType.SUCCEEDED), (Phase.FAILED, ConditionType.FAILED)):
        if lc.phase == phase:
            conds[ctype] = _Cond("True", lc.reason, lc.message)
    return conds


def _serving(pods: Sequence[PodView], now: datetime) -> bool:
    """Whether any of ``pods`` is ready with nothing wrong (:func:`pod_trouble`)."""
    return any(p.phase == "Running" and p.ready and not p.deleting and pod_trouble(p, now) is None for p in pods)


def _running(lc: Lifecycle, feeders: Sequence[tuple[ConditionType, _Cond, bool]], lost: Optional[str]) -> _Cond:
    """Running: True in phase Running (reason CheckpointLost, saying ``lost``, when the attempt lost its checkpoint),
    else False with the phase's reason. ``feeders``: (RolloutReady, its condition, whether a rollout pod serves) and on a
    job with an environment (EnvironmentReady, its condition, whether one of its pods serves): the message adds, for each that is False
    with no pod serving (or whose rewards all fail), that no new document reaches the trainer. Running waits for
    neither: the trainer steps on what the stream holds, and the rollout and environment pods recover on their own."""
    if lc.phase != Phase.RUNNING:
        return _Cond("False", lc.reason, lc.message)
    message = f"{lc.message}; {lost}" if lost else lc.message
    for ctype, cond, serving in feeders:
        if cond.reason == Reason.ALL_REWARDS_FAILED or (cond.reason in _STARVED and not serving):
            message += (f"; no new document reaches the trainer while {ctype.value} is False "
                        f"({Reason(cond.reason).value})")
    return _Cond("True", Reason.CHECKPOINT_LOST if lost else lc.reason, message)


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
    checkpoint_volume: Optional[str] = None,
    reward_deadline_s: Optional[int] = None,
    kept: Optional[str] = None,
    max_steps: Optional[int] = None,
    steps_per_second: Optional[float] = None,
    stream: Optional[StreamStatus] = None,
    reward_source: Optional[str] = None,
    environment: Optional[EnvironmentReport] = None,
    rollout_selector: Optional[str] = None,
    scale_wait: Optional[str] = None,
) -> RLTrainingJobStatus:
    """The new status. Conditions keep their lastTransitionTime while their status is unchanged; conditions
    that were True once stay listed (False with the current phase's reason) once they no longer hold.
    Progress fields, RolloutReady=False/AllRewardsFailed and Running=True/CheckpointLost keep their old values when
    ``progress`` is None (Redis not read this pass); RedisReady keeps its saved value while ``redis.ready`` is None
    (not probed yet). ``checkpoint_volume``: spec.trainer.checkpoint.volume (what a lost checkpoint's message
    advises). ``reward_deadline_s``: spec.rollout.rewardFailureDeadlineSeconds (AllRewardsFailed's message says when
    the job fails for it; None: not said). ``kept``: with ``problems``, what the running job goes on with meanwhile (ends Valid's message).
    ``max_steps``: spec.trainer.maxSteps, for progressPercentage (None: the progress fields are kept as they are);
    ``steps_per_second``: the trainer's recent rate (:class:`.eta.StepRate`) for the estimated time left, which is
    shown only while Running and kept on a pass that did not read Redis. ``stream``: status.stream
    (:func:`stream_status`; None keeps the saved one). ``reward_source``: why the rollout pods cannot load the reward
    module from its ConfigMap (:mod:`.reward_source`), RolloutReady=False/RewardSourceMissing; None: they can.
    ``environment``: what EnvironmentReady is made of (:func:`environment_condition`; its pods are the ``pods`` of role
    environment); None: the job has no environment server or URL, and no EnvironmentReady (an edit that removes the
    environment removes the condition). ``rollout_selector``: status.rolloutSelector (None keeps the saved one).
    ``scale_wait``: why a queued job runs fewer rollout pods than its spec asks (:func:`.workload.scale_wait`):
    RolloutReady=False, ScaleUpWaitingForQuota, the note after what the rollout pods' readiness says.
    status.capacity (:func:`.capacity.observe`) follows ``progress`` and ``replicas``, is kept on a pass that did not
    read Redis and removed while the job is idle (nothing runs to measure); status.rolloutReplicas counts the rollout
    ``pods`` not being deleted."""
    pods = list(pods)
    old = {cond.type: cond for cond in previous.conditions
           if environment is not None or cond.type != ConditionType.ENVIRONMENT_READY}
    fresh = _conditions(
        lifecycle,
        valid_condition(problems, kept),
        redis,
        [p for p in pods if p.role == Role.TRAINER],
        [p for p in pods if p.role == Role.ROLLOUT],
        nodes,
        replicas,
        _rewards_failure(progress, old.get(ConditionType.ROLLOUT_READY), reward_deadline_s, lifecycle.start_time),
        old.get(ConditionType.REDIS_READY),
        _lost_checkpoint(progress, lifecycle.attempt, checkpoint_volume),
        stream or previous.stream,
        now,
        reward_source,
        environment,
        [p for p in pods if p.role == Role.ENVIRONMENT],
        scale_wait,
    )
    old_running = old.get(ConditionType.RUNNING)
    if (progress is None and lifecycle.phase == Phase.RUNNING and lifecycle.attempt == previous.attempt
            and old_running is not None and old_running.reason == Reason.CHECKPOINT_LOST.value):
        fresh[ConditionType.RUNNING] = _Cond(old_running.status, old_running.reason, old_running.message)
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
        conditions=_condition_list(old, fresh, lifecycle, generation, now),
        rollout_replicas=sum(p.role == Role.ROLLOUT and not p.deleting for p in pods),
    )
    if lifecycle.phase in IDLE_PHASES:
        fields["capacity"] = None
    elif progress is not None:
        fields["capacity"] = capacity.observe(progress, replicas, now, previous.capacity)
    if rollout_selector is not None:
        fields["rollout_selector"] = rollout_selector
    if stream is not None:
        fields["stream"] = stream
    if progress is not None:
        fields.update(status_fields(progress))
        fields["reward"] = shown_reward(fields.get("rollout_reward"), fields.get("last_metrics") or {}, replicas)
    if max_steps is not None:
        fields.update(_progress_estimate(lifecycle.phase, fields.get("step", previous.step), max_steps,
                                         steps_per_second, read=progress is not None))
    return account.update(previous, previous.model_copy(update=fields), lifecycle, progress, now)


def shown_reward(rollout_reward: Optional[float], metrics: Mapping[str, float], replicas: int) -> Optional[float]:
    """status.reward: ``rollout_reward``; with no rollout pods (``replicas`` 0) the trained samples' mean reward of the
    last step (``train_samples_reward`` of its metrics, rounded as rolloutReward is), since nothing rljob runs measures a
    rollout reward then."""
    if replicas > 0:
        return rollout_reward
    trained = metrics.get("train_samples_reward")
    return None if trained is None else round(trained, protocol.REWARD_DECIMALS)


def _progress_estimate(phase: Phase, step: Optional[int], max_steps: int, steps_per_second: Optional[float],
                       read: bool) -> dict[str, Any]:
    """progressPercentage and the estimated time left (:mod:`.eta`) for a job in ``phase`` at ``step``; ``read``:
    whether this pass read the progress hash (if not, a Running job keeps its estimate)."""
    fields: dict[str, Any] = {}
    if step is not None:
        fields["progress_percentage"] = 100 if phase == Phase.SUCCEEDED else eta.progress_percentage(step, max_steps)
    if phase != Phase.RUNNING or (read and (step is None or not steps_per_second)):
        fields.update(estimated_remaining_seconds=None, estimated_remaining_time_summary=None)
    elif read:
        seconds = eta.remaining_seconds(step, max_steps, steps_per_second)
        fields.update(estimated_remaining_seconds=seconds, estimated_remaining_time_summary=eta.duration_summary(seconds))
    return fields


def _lost_checkpoint(progress: Optional[Progress], attempt: int, checkpoint_volume: Optional[str]) -> Optional[str]:
    """The message of the progress hash's lost-checkpoint record when it belongs to ``attempt``, else None."""
    record = progress.checkpoint_lost if progress is not None else None
    if record is None or not record.belongs_to(attempt):
        return None
    return lost_checkpoint_message(record, attempt, checkpoint_volume)


def _rewards_failure(progress: Optional[Progress], rollout_ready: Optional[Condition], deadline_s: Optional[int],
                     start_time: Optional[datetime]) -> Optional[str]:
    """Why every reward of a worker's last batch failed (:meth:`rljob_api.protocol.RewardFailures.ready_message`,
    with the deadline ``deadline_s`` counted from the streak's start, at the earliest the job's ``start_time``): from
    ``progress`` when read, else the saved RolloutReady's AllRewardsFailed message; None when rewards score."""
    if progress is not None:
        if progress.reward_failures is None:
            return None
        started = start_time.timestamp() if start_time is not None else None
        return progress.reward_failures.ready_message(deadline_s, started)
    if rollout_ready is not None and rollout_ready.reason == Reason.ALL_REWARDS_FAILED.value:
        return rollout_ready.message
    return None


def _condition_list(old: Mapping[ConditionType, Condition], fresh: Mapping[ConditionType, _Cond],
                    lifecycle: Lifecycle, generation: Optional[int], now: datetime) -> list[Condition]:
    """The conditions in :data:`ORDER`: ``fresh`` ones, and ``old`` ones no longer set (False with the phase's
    reason; Suspended: JobResumed); lastTransitionTime kept while a condition's status is unchanged."""
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
    return conditions


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


def _kueue_says_more(before: Condition, cond: Condition) -> bool:
    """Running stays WaitingForAdmission but Kueue's reason for the hold changed."""
    return (cond.type == ConditionType.RUNNING and cond.reason == before.reason == Reason.WAITING_FOR_ADMISSION
            and held_message(cond.message) != held_message(before.message))


def transition_events(previous: RLTrainingJobStatus, new: RLTrainingJobStatus) -> list[Event]:
    """One Event per condition whose status or reason changed (Warning for failures, restarts, invalid specs, Redis
    down, pods that cannot be scheduled, cannot start or keep failing, rewards that all failed and lost checkpoints;
    Normal otherwise). Conditions that echo the same reason and message (the pod conditions of a suspended, finished or
    invalid job) give one Event, the phase's own condition's (e.g. Succeeded=True), and Running gives none for a reason
    another condition's Event already told. Running's reason otherwise follows the phase, so a change of it alone is
    no Event, except to one of :data:`_RUNNING_NEWS` (CheckpointLost: once per attempt, Running is False between
    attempts; the Kueue holds a user or Kueue must act on, e.g. after WaitingForAdmission), and WaitingForAdmission
    again when what Kueue says changes (not the count of pods still terminating). A new job's first conditions give
    none while they say what is expected (RedisReady=True, pods not ready yet)."""
    old = {cond.type: cond for cond in previous.conditions}
    news = []
    for cond in new.conditions:
        before = old.get(cond.type)
        if before is not None and before.status == cond.status and not _kueue_says_more(before, cond) and (
            before.reason == cond.reason
            or (cond.type == ConditionType.RUNNING and cond.reason not in _RUNNING_NEWS)
        ):
            continue
        if before is None and (
            (cond.status != "True" and cond.reason in _NOT_NEWS)
            or (cond.status == "True" and cond.type in _HEALTHY_FROM_THE_START)
        ):
            continue  # a new job's initial "not ready yet" and reachable Redis are not news
        news.append(cond)
    told: dict[tuple[str, str], Condition] = {}  # (reason, message) → the condition that tells it, in first-seen order
    for cond in news:
        key = (cond.reason, cond.message)
        if key not in told or (cond.type in _PHASE_CONDITIONS and (
            told[key].type not in _PHASE_CONDITIONS or (cond.status == "True" and told[key].status != "True")
        )):
            told[key] = cond  # e.g. Succeeded=True tells a finish, not the Restarting=False that echoes it
    reasons = {cond.reason for cond in told.values() if cond.type != ConditionType.RUNNING}
    events = []
    for cond in told.values():
        if cond.type == ConditionType.RUNNING and cond.reason in reasons:
            continue
        warning = (
            (cond.type in (ConditionType.FAILED, ConditionType.RESTARTING) and cond.status == "True")
            or (cond.type == ConditionType.VALID and cond.status == "False")
            or (cond.reason in _WARNINGS and cond.status != "Unknown")
        )
        events.append(Event("Warning" if warning else "Normal", cond.reason, f"{cond.type.value}={cond.status}: "
                            f"{cond.message}"))
    return events + [Event(*told) for told in account.events(previous, new)]
