"""The gang state machine of DESIGN §5, as a pure function: (spec, lifecycle, observed pods, now) → plan.

Rules (JobSet's BlockingRecreate, Kubernetes Job's backoffLimit, suspend and deadline semantics):

- The trainer gang of attempt k is created whole; every pod carries ``rljob.dev/attempt=k`` and the same
  config hash. torchrun runs with a fixed node count, so no rank trains with a partial world.
- Any trainer pod of attempt k that fails, is evicted or preempted, is lost with its node (phase Unknown),
  is deleted, or runs an outdated config (a spec field the trainer reads changed, see :class:`ConfigHashes`) ends
  attempt k: the lifecycle is saved first
  (attempt k+1, restarts + 1), then every pod of attempt k is deleted, and attempt k+1 is created only once
  no pod of an older attempt is left, so attempts never mix.
- ``failedAttempts`` counts only failures and deletions; evictions, preemptions, node loss and spec changes
  are not counted. A counted failure when ``failedAttempts == backoffLimit`` fails the job instead.
- The job succeeds when trainer pod 0 (global rank 0, which exits 0 only after the final checkpoint and
  export) has Succeeded.
- ``runPolicy.suspend``: every trainer and rollout pod is deleted (Redis, the config and the stream stay);
  ``startTime`` is cleared, so ``activeDeadlineSeconds`` counts again from the resume; the next gang is a
  new attempt (not a restart). A suspend that comes once the trainer reported all ``maxSteps`` done, while every pod
  of the gang still runs (exporting, exiting), lets the gang finish: the job Succeeds.
- A queued job that Kueue has not admitted (or evicted) is held (:class:`~rljob_operator.workload.Hold`): as by a
  suspend every trainer and rollout pod is deleted, the next gang is a new attempt (not a restart, not counted) and
  ``startTime`` is cleared, but the phase is Pending with the hold's reason, and ``runPolicy.suspend`` is untouched.
- ``activeDeadlineSeconds`` past ``startTime`` fails the job (DeadlineExceeded).
- A trainer pod of the current attempt, or a rollout pod running the current config, whose container said it cannot
  start for good (its termination message, :mod:`rljob_api.start_failure`: a model that cannot be loaded, a backend
  the image lacks ...) fails the job at once (StartFailed, quoting it): no restart could train, and a rollout pod that
  cannot start would starve the trainer until its data timeout. A transient start failure is a failure like any other.
- Running needs the trainer's word: a gang whose pods all run is Starting (TrainerStarting) until trainer rank 0
  reported the attempt's start in the progress hash (:func:`require_started`, applied by the reconcile pass).
- Rewards that fail on every sample of every rollout batch for ``spec.rollout.rewardFailureDeadlineSeconds`` (the
  rollout hash's streak, counted from ``startTime`` at the earliest, so a suspension is not failing time) fail the job
  (RewardsFailing) instead of starving the trainer until its ranks time out and burn ``backoffLimit``.
- Finished jobs: pods are cleaned per ``cleanPodPolicy``; the job is deleted ``ttlSecondsAfterFinished``
  after ``completionTime``.
- A gang attempt during which Redis forgot the stream (the operator saw its identity key change or vanish) ends
  with reason StreamLost when its ranks stop, not counted against ``backoffLimit``: the next attempt recreates the
  stream and its group and goes on from the newest checkpoint.
- A pod whose node stopped reporting (NotReady, unreachable or gone) stays Terminating once deleted: its kubelet
  cannot confirm, and its name cannot be reused. Once the node has not been Ready for the pod's unreachable/not-ready
  toleration (300 s by default) and the pod's grace period is over, the pod is force-deleted (grace 0) and a Warning
  Event names the node; until then the phase's message names the pod, the node and when it will be force-deleted.
  Its processes may still run on that node: fencing (DESIGN §6) refuses their writes once the next attempt starts.
- Rollout pods are reconciled apart: a missing one is created, a failed or outdated one deleted (and
  recreated on the next pass), one above ``spec.rollout.replicas`` deleted; nothing about them ever touches the
  gang, and a change of rollout-only fields (replicas, image, resources, sampling ...) or of the reward ConfigMap's
  content leaves the attempt running.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Iterable, Mapping, Optional, Sequence

from rljob_api import constants as c
from rljob_api import names
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.protocol import Progress, RewardFailures
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.status import RLTrainingJobStatus

from rljob_operator.observe import NodeView, PodView
from rljob_operator.workload import Hold

FINISHED = (Phase.SUCCEEDED, Phase.FAILED)

#: The condition whose reason and message describe each phase (see :meth:`Lifecycle.from_status`).
PHASE_CONDITION = {
    Phase.RESTARTING: ConditionType.RESTARTING,
    Phase.SUSPENDED: ConditionType.SUSPENDED,
    Phase.SUCCEEDED: ConditionType.SUCCEEDED,
    Phase.FAILED: ConditionType.FAILED,
    Phase.INVALID: ConditionType.VALID,
}


@dataclass(frozen=True)
class Lifecycle:
    """The part of the status the gang logic owns; ``reason`` and ``message`` describe the phase."""

    phase: Phase = Phase.PENDING
    attempt: int = 0
    restarts: int = 0
    failed_attempts: int = 0
    gang_created: bool = False
    start_time: Optional[datetime] = None
    completion_time: Optional[datetime] = None
    reason: Reason = Reason.WAITING_FOR_GANG
    message: str = "creating the trainer gang"

    @classmethod
    def from_status(cls, status: RLTrainingJobStatus) -> "Lifecycle":
        """Read the lifecycle back from a saved status (a new job gives the defaults)."""
        phase = status.phase or Phase.PENDING
        cond = status.condition(PHASE_CONDITION.get(phase, ConditionType.RUNNING))
        try:
            reason = Reason(cond.reason) if cond else cls.reason
        except ValueError:
            reason = cls.reason
        return cls(
            phase=phase,
            attempt=status.attempt,
            restarts=status.restarts,
            failed_attempts=status.failed_attempts,
            gang_created=status.gang_created,
            start_time=status.start_time,
            completion_time=status.completion_time,
            reason=reason,
            message=cond.message if cond else cls.message,
        )


MAX_CHANGED_NAMED = 5
"""The changed fields a ConfigChanged message names at most (then "and N more")."""


@dataclass(frozen=True)
class ConfigHashes:
    """The config hashes current pods carry (from :mod:`rljob_operator.render`).

    ``config``: of the whole resolved config (label ``rljob.dev/config-hash``); ``trainer`` and ``rollout``: of the
    part each role reads (label ``rljob.dev/role-config-hash``, :func:`rljob_operator.render.role_config_hash`).
    """

    config: str
    trainer: str
    rollout: str
    reward_source: Optional[str] = None
    """The content hash of the reward ConfigMap (:mod:`rljob_operator.reward_source`) rollout pods must carry; None:
    any (no ConfigMap source, or not found)."""
    changed: tuple[str, ...] = ()
    """The fields the trainer reads that the last edit changed (:func:`rljob_operator.render.changed_fields`), named in
    a ConfigChanged restart; empty when unknown (an operator restarted since the edit)."""

    def outdated(self, pod: PodView) -> bool:
        """Whether ``pod`` runs a config its role would now read differently, or a rollout pod reward code other than
        :attr:`reward_source`. Pods without the role label (made by an operator before it existed) are compared by
        the whole config's hash."""
        if pod.role == c.Role.ROLLOUT and self.reward_source is not None and pod.reward_source_hash != self.reward_source:
            return True
        if pod.role_config_hash is None:
            return pod.config_hash != self.config
        return pod.role_config_hash != (self.trainer if pod.role == c.Role.TRAINER else self.rollout)


@dataclass(frozen=True)
class Plan:
    """What one reconcile pass does, in this order.

    1. create trainer pods ``create_trainers`` of ``lifecycle.attempt`` (always the saved attempt: a new attempt's
       gang is created by a later pass, once no pod of an older attempt is left) and rollout pods ``create_rollouts``;
    2. save the status once: with ``after_create`` when it is set and every pod was created (the gang is then marked
       created), else with ``lifecycle``;
    3. delete the pods in ``delete`` and, if ``delete_job``, the job itself — after the save, so that a restart's new
       attempt number is saved before the old attempt's pods go.

    ``requeue_after``: seconds until a deadline or TTL fires (None: nothing timed is pending). ``force_delete``: pods
    stuck Terminating on a lost node, to delete with grace 0 (:class:`StuckPod`, with what the Event says).
    """

    lifecycle: Lifecycle
    delete: tuple[str, ...] = ()
    force_delete: tuple["StuckPod", ...] = ()
    create_trainers: tuple[int, ...] = ()
    create_rollouts: tuple[int, ...] = ()
    after_create: Optional[Lifecycle] = None
    delete_job: bool = False
    requeue_after: Optional[float] = None


STUCK_MARK = "; waiting for a lost node: "
"""Separates a waiting phase's message from the account of pods stuck on lost nodes (rewritten by every pass)."""


@dataclass(frozen=True)
class StuckPod:
    """A pod being deleted on a node that is not Ready: it goes at ``force_at`` (None: it tolerates the node's loss
    forever, so it is never forced); ``why`` describes the node."""

    pod: PodView
    node: NodeView
    force_at: Optional[datetime]

    @property
    def why(self) -> str:
        since = f" since {self.node.not_ready_since:%H:%M:%S}" if self.node.not_ready_since else ""
        state = "is gone" if not self.node.exists else f"is not Ready{since}: {self.node.reason}"
        return f"{self.pod.role} pod {self.pod.name} is stuck terminating: node {self.node.name} {state}"

    def waiting(self) -> str:
        """For the phase's message: what it waits for and until when."""
        if self.force_at is None:
            return f"{self.why}; it tolerates the node's loss forever, so only the node's return or a person ends it"
        return f"{self.why}; force-deleting it at {self.force_at:%H:%M:%S} unless the node comes back"


def stuck_pods(pods: Iterable[PodView], nodes: Mapping[str, NodeView]) -> list[StuckPod]:
    """The pods being deleted whose node (looked up in ``nodes``) is not Ready or gone, with when each may be forced:
    its grace period over and its node not Ready for its lost-node toleration (at once when the Node is gone)."""
    stuck = []
    for pod in pods:
        node = nodes.get(pod.node) if pod.deleting and pod.node else None
        if node is None or node.ready:
            continue
        force_at: Optional[datetime] = pod.deletion_at
        if pod.lost_node_toleration_s < 0:
            force_at = None
        elif node.exists and node.not_ready_since is not None:
            lost = node.not_ready_since + timedelta(seconds=pod.lost_node_toleration_s)
            force_at = lost if force_at is None else max(force_at, lost)
        stuck.append(StuckPod(pod, node, force_at))
    return stuck


@dataclass(frozen=True)
class _Failure:
    pod: str
    reason: Reason
    detail: str
    counted: bool


@dataclass(frozen=True)
class _Observed:
    trainers: Sequence[PodView]
    rollouts: Sequence[PodView]
    current: dict[int, PodView] = field(default_factory=dict)
    old: Sequence[PodView] = ()


def plan(
    job: str, spec: RLTrainingJobSpec, previous: Lifecycle, pods: Iterable[PodView], hashes: ConfigHashes,
    now: datetime, rewards: Optional[RewardFailures] = None, nodes: Mapping[str, NodeView] = {},
    stream_lost: bool = False, hold: Optional[Hold] = None, trained_step: Optional[int] = None,
) -> Plan:
    """Decide one reconcile pass of a valid job (see the module docstring for the rules).

    Args:
        job: the job's name (names missing pods in messages).
        spec: the validated spec.
        previous: the saved lifecycle (:meth:`Lifecycle.from_status`).
        pods: every trainer and rollout pod of the job (other roles are ignored).
        hashes: the config hashes of pods made now; a pod that differs in its role's hash is outdated.
        now: the current time (timezone-aware).
        rewards: the rollout hash's reward-failure streak when this pass read one (None: none, or not read).
        nodes: the nodes of the pods being deleted that are not Ready (others may be left out): stuck pods.
        stream_lost: Redis forgot the stream during the saved attempt: its end is StreamLost, not counted.
        hold: why Kueue does not let the job's pods run now (None: not queued, or admitted).
        trained_step: the steps the trainer reported done (status.step; None: none yet). A suspend that comes once
            ``maxSteps`` are done lets the running gang finish (the job Succeeds) instead of deleting it.
    """
    pods = list(pods)
    decided = _plan(job, spec, previous, pods, hashes, now, rewards, stream_lost, hold, trained_step)
    return _with_stuck(decided, stuck_pods(pods, nodes), now)


def _with_stuck(decided: Plan, stuck: Sequence[StuckPod], now: datetime) -> Plan:
    """``decided`` plus the force deletions due now, the others named in a waiting phase's message (the account of an
    earlier pass replaced), and a requeue at the next one due."""
    due = tuple(s for s in stuck if s.force_at is not None and s.force_at <= now)
    later = [s for s in stuck if s not in due]
    lifecycle = decided.lifecycle
    base = lifecycle.message.split(STUCK_MARK)[0]  # the saved message may carry an earlier pass's account
    told = STUCK_MARK + "; ".join(s.waiting() for s in later) if later and lifecycle.phase in (
        Phase.PENDING, Phase.RESTARTING, Phase.SUSPENDED) else ""
    if base + told != lifecycle.message:
        lifecycle = replace(lifecycle, message=base + told)
    requeue = decided.requeue_after
    for s in later:
        if s.force_at is not None:
            left = (s.force_at - now).total_seconds()
            requeue = left if requeue is None else min(requeue, left)
    if not due and lifecycle is decided.lifecycle and requeue == decided.requeue_after:
        return decided
    return replace(decided, lifecycle=lifecycle, force_delete=due, requeue_after=requeue)


def _plan(job: str, spec: RLTrainingJobSpec, previous: Lifecycle, pods: list[PodView], hashes: ConfigHashes,
          now: datetime, rewards: Optional[RewardFailures], stream_lost: bool, hold: Optional[Hold],
          trained_step: Optional[int]) -> Plan:
    trainers = [p for p in pods if p.role == c.Role.TRAINER]
    obs = _Observed(
        trainers=trainers,
        rollouts=[p for p in pods if p.role == c.Role.ROLLOUT],
        current={p.index: p for p in trainers if p.attempt == previous.attempt},
        old=[p for p in trainers if p.attempt != previous.attempt],
    )
    if previous.phase in FINISHED:
        return _finished(spec, previous, obs, now)
    if spec.run_policy.suspend and _finishing(spec, previous, obs, trained_step):
        finishing = _active(job, spec, previous, obs, hashes, now, rewards, stream_lost)
        if finishing.lifecycle.phase == Phase.RUNNING:
            finishing = replace(finishing, lifecycle=replace(finishing.lifecycle, message=(
                f"{finishing.lifecycle.message}; the suspend waits: all {spec.trainer.max_steps} steps are done and "
                "the gang is finishing (the job Succeeds)")))
        return finishing
    if spec.run_policy.suspend:
        return _suspend(spec, previous, obs)
    if hold is not None:
        return _held(previous, obs, hold)
    return _active(job, spec, previous, obs, hashes, now, rewards, stream_lost)


def require_redis(lc: Lifecycle, redis_ready: Optional[bool], why: str) -> Lifecycle:
    """A gang that runs while Redis is down makes no step: phase Running becomes Starting, reason RedisUnavailable
    (the message says why, ``why``: the RedisReady message). ``redis_ready`` None (not known yet) changes nothing."""
    if lc.phase != Phase.RUNNING or redis_ready is not False:
        return lc
    return replace(lc, phase=Phase.STARTING, reason=Reason.REDIS_UNAVAILABLE,
                   message=f"{lc.message}, but no step can be made while Redis is not ready: {why}")


def plural(n: int, noun: str) -> str:
    """"1 trainer pod", "2 trainer pods"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _resumes(spec: RLTrainingJobSpec, attempt: int) -> str:
    """Where gang ``attempt`` starts from: the last checkpoint on the claim, or (emptyDir) over from step 0 or initFrom."""
    checkpoint = spec.trainer.checkpoint
    start = "spec.trainer.checkpoint.initFrom" if checkpoint.init_from else "step 0"
    if checkpoint.volume:
        return (f"attempt {attempt} resumes from the newest checkpoint on PersistentVolumeClaim {checkpoint.volume} "
                f"(from {start} if none was written yet: one every {checkpoint.every_steps} steps)")
    return (f"attempt {attempt} starts over from {start}: the checkpoints were on an emptyDir that goes with the pods "
            "(set spec.trainer.checkpoint.volume to a PersistentVolumeClaim to keep them)")


def _export(spec: RLTrainingJobSpec) -> str:
    """Where trainer rank 0 exported the final weights (see :data:`rljob_api.constants.EXPORT_SUBDIR`)."""
    if not spec.trainer.export.safetensors:
        return "no export (spec.trainer.export.safetensors is false)"
    path = posixpath.join(c.CHECKPOINT_MOUNT_DIR, c.EXPORT_SUBDIR)
    claim = spec.trainer.checkpoint.volume
    exported = f"final weights exported to {path} (safetensors, Hugging Face layout)"
    if claim:
        return f"{exported} on PersistentVolumeClaim {claim}"
    return (f"{exported} on the pod's emptyDir, which goes with the pod: set spec.trainer.checkpoint.volume to a "
            "PersistentVolumeClaim to keep them")


def _finished(spec: RLTrainingJobSpec, lc: Lifecycle, obs: _Observed, now: datetime) -> Plan:
    delete = _cleanup(spec.run_policy.clean_pod_policy, [*obs.trainers, *obs.rollouts])
    ttl = spec.run_policy.ttl_seconds_after_finished
    if ttl is None or lc.completion_time is None:
        return Plan(lc, delete=delete)
    left = (lc.completion_time + timedelta(seconds=ttl) - now).total_seconds()
    return Plan(lc, delete=delete, delete_job=left <= 0, requeue_after=max(left, 0.0))


def _cleanup(policy: str, pods: Sequence[PodView]) -> tuple[str, ...]:
    """Pods ``cleanPodPolicy`` deletes: All (every pod), Running (those not yet terminated) or None."""
    if policy == "All":
        return _names(p for p in pods if not p.deleting)
    if policy == "Running":
        return _names(p for p in pods if p.active)
    return ()


def _finishing(spec: RLTrainingJobSpec, lc: Lifecycle, obs: _Observed, trained_step: Optional[int]) -> bool:
    """Whether the gang has trained all ``maxSteps`` and is finishing on its own (every pod of its attempt running or
    exited 0): a suspend then lets it end instead of deleting it."""
    return (trained_step is not None and trained_step >= spec.trainer.max_steps and lc.gang_created
            and len(obs.current) == spec.trainer.nodes
            and all(p.phase in ("Running", "Succeeded") and not p.deleting for p in obs.current.values()))


def _suspend(spec: RLTrainingJobSpec, lc: Lifecycle, obs: _Observed) -> Plan:
    left = [*obs.trainers, *obs.rollouts]
    message = "job suspended: pods deleted, Redis and the stream kept; set runPolicy.suspend to false to resume"
    if (lc.gang_created or lc.attempt > 0) and not spec.trainer.checkpoint.volume:  # a gang has run
        message += (" (from step 0: the checkpoints were on an emptyDir; set spec.trainer.checkpoint.volume to a "
                    "PersistentVolumeClaim to keep them)")
    if left:
        message += f" ({len(left)} pods still terminating)"
    suspended = replace(
        lc,
        phase=Phase.SUSPENDED,
        attempt=lc.attempt + 1 if lc.gang_created else lc.attempt,
        gang_created=False,
        start_time=None,
        reason=Reason.JOB_SUSPENDED,
        message=message,
    )
    return Plan(suspended, delete=_names(p for p in left if not p.deleting))


def held_message(message: str) -> str:
    """A held job's Running message without the count of pods still terminating that :func:`_held` adds (what Kueue
    said)."""
    return re.sub(r" \(\d+ pods? still terminating\)$", "", message)


def _held(lc: Lifecycle, obs: _Observed, hold: Hold) -> Plan:
    """Kueue holds the job: its pods go as by a suspend, the phase is Pending with the hold's reason and message."""
    left = [*obs.trainers, *obs.rollouts]
    message = hold.message + (f" ({plural(len(left), 'pod')} still terminating)" if left else "")
    held = replace(lc, phase=Phase.PENDING, attempt=lc.attempt + 1 if lc.gang_created else lc.attempt,
                   gang_created=False, start_time=None, reason=hold.reason, message=message)
    return Plan(held, delete=_names(p for p in left if not p.deleting))


def _fail(spec: RLTrainingJobSpec, lc: Lifecycle, obs: _Observed, reason: Reason, message: str,
          now: datetime) -> Plan:
    """The job ends Failed with ``reason`` and ``message``; its pods are deleted per ``cleanPodPolicy``."""
    failed = replace(lc, phase=Phase.FAILED, completion_time=now, reason=reason, message=message)
    return Plan(failed, delete=_cleanup(spec.run_policy.clean_pod_policy, [*obs.trainers, *obs.rollouts]))


def _rewards_failing(spec: RLTrainingJobSpec, lc: Lifecycle, rewards: Optional[RewardFailures]) -> Optional[str]:
    """Failed/RewardsFailing's message when ``rewards`` (the rollout hash's streak) has failed for at least
    ``spec.rollout.rewardFailureDeadlineSeconds``, measured between failing batches from the later of the streak's
    start and ``lc.start_time`` (:meth:`RewardFailures.failing_seconds`); else None (also for a record that keeps no
    streak, written by a worker that predates it)."""
    if rewards is None:
        return None
    deadline = spec.rollout.reward_failure_deadline_seconds
    started = lc.start_time.timestamp() if lc.start_time is not None else None
    seconds = rewards.failing_seconds(started)
    if seconds is None or seconds < deadline:
        return None
    return rewards.failed_message(deadline, started)


def _active(
    job: str, spec: RLTrainingJobSpec, lc: Lifecycle, obs: _Observed, hashes: ConfigHashes, now: datetime,
    rewards: Optional[RewardFailures] = None, stream_lost: bool = False,
) -> Plan:
    rp = spec.run_policy
    if lc.start_time is None:
        lc = replace(lc, start_time=now)
    requeue = None
    if rp.active_deadline_seconds is not None:
        left = (lc.start_time + timedelta(seconds=rp.active_deadline_seconds) - now).total_seconds()
        if left <= 0:
            return _fail(spec, lc, obs, Reason.DEADLINE_EXCEEDED,
                         f"the job was active for more than activeDeadlineSeconds = {rp.active_deadline_seconds} s", now)
        requeue = left

    delete_rollouts, create_rollouts = _rollouts(spec, obs.rollouts, hashes)
    pod0 = obs.current.get(0)
    if pod0 is not None and pod0.phase == "Succeeded":
        done = replace(
            lc,
            phase=Phase.SUCCEEDED,
            completion_time=now,
            reason=Reason.TRAINING_FINISHED,
            message=f"trainer pod {pod0.name} (global rank 0) of attempt {lc.attempt} exited 0; {_export(spec)}",
        )
        return Plan(done, delete=_cleanup(rp.clean_pod_policy, [*obs.trainers, *obs.rollouts]))
    failing = _rewards_failing(spec, lc, rewards)
    if failing is not None:
        return _fail(spec, lc, obs, Reason.REWARDS_FAILING, failing, now)
    cannot = _start_failed(lc, obs, hashes)
    if cannot is not None:
        return _fail(spec, lc, obs, Reason.START_FAILED, cannot, now)

    failures = _failures(job, spec, lc, obs.current, hashes)
    if failures and stream_lost:  # the ranks stopped because Redis forgot their stream, not for their own fault
        failures = [replace(f, reason=Reason.STREAM_LOST, counted=False,
                            detail=f"{f.detail} after Redis forgot the stream") for f in failures]
    if failures:
        return _restart_or_fail(spec, lc, obs, failures, delete_rollouts, create_rollouts, requeue, now)
    delete_old = _names(p for p in obs.old if not p.deleting)
    return _gang(spec, lc, obs, dict(delete=delete_old + delete_rollouts, create_rollouts=create_rollouts,
                                     requeue_after=requeue))


def _start_failed(lc: Lifecycle, obs: _Observed, hashes: ConfigHashes) -> Optional[str]:
    """Failed/StartFailed's message when a trainer pod of the attempt, or a rollout pod of the current config, said it
    cannot start for good (:attr:`PodView.start_failure`); None when none did."""
    said = [(f"trainer pod {p.name} of attempt {lc.attempt}", p) for _, p in sorted(obs.current.items())]
    said += [(f"rollout pod {p.name}", p) for p in sorted(obs.rollouts, key=lambda p: p.index)
             if not p.deleting and not hashes.outdated(p)]
    for who, pod in said:
        if pod.start_failure:
            return (f"{who} cannot start: {pod.start_failure}; retrying cannot help, so the job failed without a "
                    "restart: fix the spec and create the job again")
    return None


def require_started(lc: Lifecycle, progress: Optional[Progress], saved: Lifecycle) -> Lifecycle:
    """A gang whose pods all run makes no step before its trainer loaded the model and the checkpoint: phase Running
    becomes Starting, reason TrainerStarting, until trainer rank 0 reported this attempt's start in the progress hash
    (:meth:`~rljob_api.protocol.Progress.started`). ``progress`` None (not read this pass): as the ``saved`` lifecycle
    said of the same attempt."""
    if lc.phase != Phase.RUNNING:
        return lc
    if progress is not None:
        waiting = not progress.started(lc.attempt)
    else:
        waiting = (saved.phase, saved.reason, saved.attempt) == (Phase.STARTING, Reason.TRAINER_STARTING, lc.attempt)
    if not waiting:
        return lc
    return replace(lc, phase=Phase.STARTING, reason=Reason.TRAINER_STARTING,
                   message=f"{lc.message}; the trainer is loading the model and the newest checkpoint: no step before "
                   "its rank 0 reports the attempt's start")


def _gang(spec: RLTrainingJobSpec, lc: Lifecycle, obs: _Observed, common: dict) -> Plan:
    """An active job with no failure: wait for earlier attempts' pods, create the gang, or follow it as it starts
    (``common``: the rollout pods' part of the plan and the requeue)."""
    if obs.old:
        waiting = f"waiting for {plural(len(obs.old), 'trainer pod')} of earlier attempts to terminate"
        if lc.phase == Phase.RESTARTING:
            return Plan(lc, **common)
        return Plan(replace(lc, phase=Phase.PENDING, reason=Reason.TEARING_DOWN, message=waiting), **common)
    if not lc.gang_created:
        missing = tuple(i for i in range(spec.trainer.nodes) if i not in obs.current)
        before = lc if lc.phase == Phase.RESTARTING else replace(
            lc, phase=Phase.PENDING, reason=Reason.WAITING_FOR_GANG, message="creating the trainer gang"
        )
        after = replace(
            lc,
            phase=Phase.STARTING,
            gang_created=True,
            reason=Reason.GANG_CREATED,
            message=f"created attempt {lc.attempt}: {plural(spec.trainer.nodes, 'trainer pod')}",
        )
        return Plan(before, create_trainers=missing, after_create=after, **common)
    # A rank that exited 0 finished its share (at maxSteps): the gang is not "starting" again while pod 0 exits.
    running = [p for p in obs.current.values() if p.phase in ("Running", "Succeeded")]
    if len(running) == spec.trainer.nodes:
        now_running = replace(
            lc,
            phase=Phase.RUNNING,
            reason=Reason.TRAINING,
            message=f"attempt {lc.attempt}: "
            + (f"all {spec.trainer.nodes} trainer pods running" if spec.trainer.nodes > 1 else "the trainer pod is running"),
        )
        return Plan(now_running, **common)
    if lc.phase == Phase.STARTING:
        return Plan(lc, **common)
    starting = replace(
        lc,
        phase=Phase.STARTING,
        reason=Reason.WAITING_FOR_GANG,
        message=f"attempt {lc.attempt}: {len(running)}/{spec.trainer.nodes} trainer pods running",
    )
    return Plan(starting, **common)


def _failures(
    job: str, spec: RLTrainingJobSpec, lc: Lifecycle, current: dict[int, PodView], hashes: ConfigHashes
) -> list[_Failure]:
    """Why attempt ``lc.attempt`` cannot go on (empty: it can)."""
    failures = []
    for index in sorted(current):
        p = current[index]
        if p.phase == "Failed":
            reason = Reason.POD_EVICTED if p.disrupted else Reason.POD_FAILED
            failures.append(_Failure(p.name, reason, p.failure or "failed", counted=not p.disrupted))
        elif p.phase == "Unknown":
            failures.append(_Failure(p.name, Reason.POD_LOST, "lost with its node (phase Unknown)", counted=False))
        elif p.deleting and p.phase != "Succeeded":
            reason = Reason.POD_EVICTED if p.disrupted else Reason.POD_DELETED
            failures.append(_Failure(p.name, reason, "was deleted", counted=not p.disrupted))
        elif hashes.outdated(p):
            changed = (f"{', '.join(hashes.changed[:MAX_CHANGED_NAMED])}"
                       + (f" and {len(hashes.changed) - MAX_CHANGED_NAMED} more" if len(hashes.changed) > MAX_CHANGED_NAMED
                          else "")) if hashes.changed else "a spec field the trainer reads"
            failures.append(_Failure(p.name, Reason.CONFIG_CHANGED, f"runs an outdated config ({changed} changed)",
                                     counted=False))
    # A pod missing from a gang made for an outdated config was deleted, or never made: an edit of spec.trainer.nodes
    # asks for pods the old gang never had, and the config change restarts the gang anyway, uncounted.
    if lc.gang_created and not any(f.reason == Reason.CONFIG_CHANGED for f in failures):
        for index in range(spec.trainer.nodes):
            if index not in current:
                failures.append(_Failure(names.trainer_pod(job, index), Reason.POD_DELETED, "is gone (deleted)",
                                         counted=True))
    return failures


def _restart_or_fail(spec, lc, obs, failures, delete_rollouts, create_rollouts, requeue, now) -> Plan:
    counted = [f for f in failures if f.counted]
    cause = counted[0] if counted else failures[0]
    what = f"trainer pod {cause.pod} of attempt {lc.attempt} {cause.detail}"
    teardown = _names(p for p in [*obs.current.values(), *obs.old] if not p.deleting)
    limit = spec.run_policy.backoff_limit
    if counted and lc.failed_attempts >= limit:
        failed = replace(
            lc,
            phase=Phase.FAILED,
            completion_time=now,
            reason=Reason.BACKOFF_LIMIT_EXCEEDED,
            message=f"{what}; backoffLimit = {limit} reached ({lc.failed_attempts} counted restarts)",
        )
        return Plan(failed, delete=teardown if spec.run_policy.clean_pod_policy != "None" else ())
    restarted = replace(
        lc,
        phase=Phase.RESTARTING,
        attempt=lc.attempt + 1,
        restarts=lc.restarts + 1,
        failed_attempts=lc.failed_attempts + (1 if counted else 0),
        gang_created=False,
        reason=cause.reason,
        message=f"{what}; tearing down the gang, {_resumes(spec, lc.attempt + 1)} "
        f"(restart {lc.restarts + 1}; counted {lc.failed_attempts + (1 if counted else 0)} of backoffLimit {limit})",
    )
    return Plan(restarted, delete=teardown + delete_rollouts, create_rollouts=create_rollouts, requeue_after=requeue)


def _rollouts(spec: RLTrainingJobSpec, rollouts: Sequence[PodView], hashes: ConfigHashes):
    """(pods to delete, indices to create): replicas 0..R-1 exist, run the current config and have not failed."""
    replicas = spec.rollout.replicas
    by_index = {p.index: p for p in rollouts}
    delete = _names(
        p for p in rollouts
        if not p.deleting and (p.index >= replicas or p.phase in ("Failed", "Unknown") or hashes.outdated(p))
    )
    create = tuple(i for i in range(replicas) if i not in by_index)
    return delete, create


def _names(pods: Iterable[PodView]) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in pods))
