"""One reconcile pass of one RLTrainingJob, as a straight line: admit → apply the children → decide → write the
status once → act.

Everything decided here comes from :mod:`.admission` and the pure modules (:mod:`.render`, :mod:`.gang`,
:mod:`.job_status`); this module sequences their results with the calls of :mod:`.children`, :mod:`.redis_io.reads` and
:mod:`.kube_api`:

1. admit (:func:`.admission.decide`, after the pass's one read of the job's record): the spec to run (the spec, or while
   an invalid edit is fixed the last valid one) with the config it runs, resolved once and used by every later step,
   its problems, or children of an earlier job of the same name to wait for;
2. apply the static children of a valid spec (Redis Secret and data claim create-only, ConfigMap, Services, Redis
   Deployment, the environment server's NetworkPolicy), only when their rendering changed since this process last applied them (:mod:`.applied_hash`); a child the
   API server refuses as the spec's fault (400/422; 403 for a pod naming a PriorityClass, ServiceAccount or
   RuntimeClass that does not exist) makes the job Invalid in this pass (admission is asked again); a managed Redis
   moved between an emptyDir and its claim is told in a RedisReplaced Event;
3. decide the pass's outcome: waiting for an earlier job's children; Invalid (nothing runs, no retry until the spec
   changes, but for a missing PriorityClass, ServiceAccount or RuntimeClass: tried again every 30 s); or the gang's plan (:func:`.gang.plan`) over the observed pods (the kopf index, plus pods this process
   created or deleted that the watch has not reported yet), Redis's health and the progress hashes (planned again
   with the rollout hash's reward-failure streak when it holds one: past its deadline the job fails; a running gang
   whose trainer has not reported the attempt's start there stays Starting) and the reward
   ConfigMap's content (:mod:`.reward_source`: rollout pods made from other content are outdated) — with the
   environment server's Deployment applied at the replicas the plan's phase and Kueue's hold give it
   (:func:`.environment.replicas`), then the plan's pods created: trainer pods only of the saved attempt, so the status
   that records the gang as created is written once they exist; a refused Deployment or pod makes the job Invalid in
   the same pass;
4. write the status once (merge patch with a resourceVersion precondition: a stale view is refused, not written),
   then post Events for its transitions;
5. act on what needs the status saved first: delete pods (a gang restart's new attempt number is saved before its
   pods go), scale the environment server of a job with no valid spec to 0, release the Redis client of an idle job,
   delete a finished job past its TTL.

Per-job state that lives only in this process is a :class:`~rljob_operator.runtime.JobRuntime` held in kopf's
``memo``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Iterable, Mapping, Optional, Sequence

from rljob_api import constants as c
from rljob_api.constants import Phase, Reason
from rljob_api.config import JobConfig
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.protocol import Backlog, Progress
from rljob_api.status import RLTrainingJobStatus, StreamStatus
from rljob_api.validation import data_parallel_size

from rljob_operator import (account, admission, capacity, children, environment, gang, job_status, queueing, render,
                            resolution, rollout_scaling)
from rljob_operator.redis_io import reads as redis_reads
from rljob_operator.admission import Decision
from rljob_operator.kube_api import ApiError
from rljob_operator.observe import DeploymentView, NodeView, PodView, node_view
from rljob_operator.reward_source import read_reward_source
from rljob_operator.runtime import RETRY_REFUSED_S, Context, JobRuntime

#: How long a pod this process created counts as present before the watch reports it (seconds).
CREATED_GRACE_S = 30.0

__all__ = ["CREATED_GRACE_S", "Context", "JobRuntime", "StaleStatus", "observed_pods", "reconcile"]


class StaleStatus(Exception):
    """The job changed between reading it and writing its status (HTTP 409); retry with the fresh object."""


def observed_pods(indexed: Iterable[PodView], runtime: JobRuntime, now: float) -> list[PodView]:
    """The index's pods, plus pods this process created that the watch has not shown yet (as Pending, for
    :data:`CREATED_GRACE_S`), with pods it deleted marked as deleting until the watch catches up."""
    seen = {p.name: p for p in indexed}
    for name, (created_at, view) in list(runtime.created.items()):
        if (name in seen and seen[name].uid == view.uid) or now - created_at > CREATED_GRACE_S:
            del runtime.created[name]
        elif name not in seen:
            seen[name] = view
    for name, uid in list(runtime.deleted.items()):
        pod = seen.get(name)
        if pod is None or pod.uid != uid:
            del runtime.deleted[name]
        elif not pod.deleting:
            seen[name] = replace(pod, deleting=True)
    return sorted(seen.values(), key=lambda p: (p.role, p.index, p.name))



def _forgotten_stream(this: _Pass, fetched: Progress) -> Optional[str]:
    """What Redis forgot when the stream identity it holds (``fetched.stream_id``) is not the one the status saved
    (another one, or none); None when it did not forget (or no identity was ever saved). Keeps the group's counts of
    each read in the job's runtime: the last ones before a loss are what was lost, as far as known."""
    saved, now_held = this.previous.stream_identity, fetched.stream_id
    last_backlog, this.runtime.backlog = this.runtime.backlog, fetched.backlog
    this.lost_backlog = last_backlog
    if not saved or now_held == saved:
        return None
    return job_status.stream_lost_message(saved, now_held, last_backlog, this.previous.last_checkpoint,
                                        this.before.attempt)


def _stream_identity(this: _Pass, new: RLTrainingJobStatus, fetched: Progress,
                     forgot: Optional[str]) -> RLTrainingJobStatus:
    """``new`` with the stream identity Redis holds now (kept while Redis holds none, unless that is the loss) and
    the attempt of a loss seen in this pass."""
    update: dict[str, Any] = {}
    if fetched.stream_id is not None or forgot is not None:
        update["stream_identity"] = fetched.stream_id
    if forgot is not None:
        update["stream_lost_attempt"] = this.before.attempt
        new = account.stream_lost(new, this.lost_backlog)
    return new.model_copy(update=update) if update else new


async def _lost_nodes(ctx: Context, pods: Sequence[PodView], now: datetime) -> dict[str, NodeView]:
    """The nodes of the pods whose deletion grace period is over but which are still there (a kubelet that stopped
    reporting cannot confirm their end): one GET per such node, none in the usual case.

    Raises:
        ApiError: the API server refused (e.g. RBAC without get nodes).
    """
    names = sorted({p.node for p in pods if p.deleting and p.node and p.deletion_at is not None and p.deletion_at <= now})
    found = await children.gather(ctx.api.get("v1", "Node", "", name) for name in names)
    return {name: node_view(name, raw) for name, raw in zip(names, found)}


@dataclass
class _Pass:
    """The inputs of one pass: a snapshot of the job ``body`` with its saved status, and what this process knows."""

    body: dict[str, Any]
    indexed: list[PodView]
    redis: Optional[DeploymentView]
    runtime: JobRuntime
    ctx: Context
    now: datetime
    environment: Optional[DeploymentView] = None
    """The environment server's Deployment as observed (None: the job has none, or not yet)."""
    previous: RLTrainingJobStatus = field(init=False)
    before: gang.Lifecycle = field(init=False)
    lost_backlog: Optional[Backlog] = field(default=None, init=False)
    """The group's counts at the last read before Redis forgot the stream (:func:`_forgotten_stream`)."""

    def __post_init__(self) -> None:
        self.previous = RLTrainingJobStatus.model_validate(self.body.get("status") or {})
        self.before = gang.Lifecycle.from_status(self.previous)

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.body["metadata"]

    def pods(self) -> list[PodView]:
        """The job's pods as this process sees them now (:func:`observed_pods`)."""
        return observed_pods(self.indexed, self.runtime, time.monotonic())

    def job(self, spec: RLTrainingJobSpec) -> render.Job:
        return render.Job(self.meta["name"], self.meta["namespace"], spec, dict(self.meta.get("labels") or {}),
                          self.meta.get("uid") or "")

    async def admit(self) -> Decision:
        """:func:`.admission.decide` with the record of the job's config: read from its ConfigMap once per process
        (:func:`.resolution.known_record`: the pass's one API read for admission), then kept in the runtime."""
        recorded = await resolution.known_record(self.body, self.runtime, self.ctx.api)
        return admission.decide(self.body, self.before, self.pods(), self.redis, self.runtime, recorded,
                                environment=self.environment)

    def stream(self, spec: RLTrainingJobSpec, config: JobConfig) -> StreamStatus:
        """status.stream for ``spec`` (:func:`.job_status.stream_status`) from the pass's ``config``."""
        return job_status.stream_status(config, render.redis_password_ref(self.job(spec)))

    def status(self, lifecycle: gang.Lifecycle, **report: Any) -> RLTrainingJobStatus:
        """The new status (:func:`.status.build_status`) for ``lifecycle`` and the rest of the ``report``, with the
        rollout pods' selector."""
        return job_status.build_status(self.previous, generation=self.meta.get("generation"), lifecycle=lifecycle,
                                   now=self.now, rollout_selector=render.selector_text(self.meta["name"], c.Role.ROLLOUT),
                                   **report)


@dataclass(frozen=True)
class _Outcome:
    """What a pass writes (``status``), then does: delete the (name, uid) pods in ``delete`` and the job itself when
    ``delete_job``, count ``restarts`` new gang restarts, release the Redis client when ``release``, and raise
    ``error`` (a refused pod creation that is not the spec's fault). ``delay``: seconds until the next pass."""

    status: RLTrainingJobStatus
    delay: float
    delete: tuple[tuple[str, str], ...] = ()
    delete_job: bool = False
    release: bool = False
    restarts: int = 0
    error: Optional[ApiError] = None
    force_delete: tuple[gang.StuckPod, ...] = ()
    events: tuple[job_status.Event, ...] = ()
    """Events of this pass that no condition transition tells (posted after the status write)."""
    queued: Optional[queueing.Queued] = None
    """A queued job's Workload and Kueue's decision (:mod:`.queueing`), followed up after the status write."""
    pods: tuple[PodView, ...] = ()
    """The job's pods the pass decided on (an evicted Workload's quota goes back once none is left)."""
    stop_environment: bool = False
    """Scale the environment server's Deployment to 0 (a job with no valid spec runs nothing)."""


async def reconcile(
    body: Mapping[str, Any],
    indexed_pods: Iterable[PodView],
    redis_deployment: Optional[DeploymentView],
    runtime: JobRuntime,
    ctx: Context,
    *,
    children_only: bool = False,
    environment_deployment: Optional[DeploymentView] = None,
) -> float:
    """Run one pass for the job ``body`` (see the module docstring). Returns seconds until the next pass.

    ``environment_deployment``: the job's environment server Deployment as observed (None: none).

    ``children_only``: stop once the static children are applied, before any write to the job itself (a new job's
    first pass while kopf is still adding its finalizer: a status write now would race kopf's patch).

    Raises:
        StaleStatus: the status write was refused because the job changed meanwhile.
        ApiError: any other refused API call (counted and retried by the handlers).
    """
    # A snapshot: a kopf daemon's body is a live view that follows the watch during the pass, and a status computed
    # from the old object must be written with the old resourceVersion (refused as stale), never with a newer one.
    this = _Pass(runtime.catch_up(dict(body)), list(indexed_pods), redis_deployment, runtime, ctx, ctx.clock(),
                 environment_deployment)
    if (runtime.rejected and admission.missing_reference(runtime.rejected[1])
            and time.monotonic() - runtime.rejected_at >= RETRY_REFUSED_S):
        runtime.rejected = None  # what the pod named may exist by now: try again (refused, it is recorded again)
    decision = await _apply_children(this, await this.admit())
    if children_only:
        return 0.0
    outcome = await _decide(this, decision)
    await _save(this, outcome.status)
    await _act(this, outcome)
    return outcome.delay


async def _apply_children(this: _Pass, decision: Decision) -> Decision:
    """Apply the static children of an admitted spec; a child the API server refuses as the spec's fault
    (:func:`.admission.refusal_of_spec`) is recorded for this generation and admission asked again (it becomes a
    problem of the spec)."""
    if not decision.applies:
        return decision
    job, generation, config = this.job(decision.run), this.meta.get("generation"), decision.config
    earlier = this.runtime.recorded
    try:
        await children.apply_static(job, config, generation, this.body, this.runtime, this.ctx)
    except ApiError as err:
        if not admission.refusal_of_spec(err.status, err.message):
            raise
        this.runtime.reject(generation, err.message)
        return await this.admit()
    this.runtime.last_valid = (generation, decision.run)
    if earlier is not None and earlier.config.to_json() != config.to_json():
        this.runtime.config_changes = render.changed_fields(earlier.config, config, c.Role.TRAINER)
    this.runtime.recorded = resolution.Recorded(resolution.as_recorded(config), generation)
    if earlier is not None and earlier.config.spec.redis.mode == config.spec.redis.mode == "managed":
        replaced = job_status.redis_replaced(job.name, render.redis_persistence(earlier.config),
                                         render.redis_persistence(config))
        if replaced is not None:
            this.runtime.notices.append(replaced)
    return decision


async def _decide(this: _Pass, decision: Decision) -> _Outcome:
    if decision.leftovers:
        return _waiting_for_leftovers(this, decision)
    if decision.run is None:
        return _invalid(this, decision, this.pods())
    return await _run(this, decision)


def _waiting_for_leftovers(this: _Pass, decision: Decision) -> _Outcome:
    """A deleted job of the same name: its children go first (the garbage collector removes them)."""
    spec = decision.run
    waiting = replace(this.before, phase=Phase.PENDING, reason=Reason.TEARING_DOWN, message=(
        f"waiting for {len(decision.leftovers)} children of an earlier RLTrainingJob named {this.meta['name']} to be "
        "deleted: " + ", ".join(decision.leftovers)))
    new = this.status(waiting, problems=[], data_parallel_size=data_parallel_size(spec),
                      redis=this.runtime.redis_health, pods=[], nodes=spec.trainer.nodes,
                      replicas=spec.rollout.replicas, progress=None, stream=this.stream(spec, decision.config))
    return _Outcome(new, delay=min(this.ctx.active_interval_s, 1.0))


def _invalid(this: _Pass, decision: Decision, pods: list[PodView], base: Optional[gang.Lifecycle] = None) -> _Outcome:
    """Nothing of an invalid job runs (e.g. the rollout pods made before a refused trainer pod are deleted); a
    finished job stays finished, its Valid condition still reporting the problem. ``base``: the lifecycle the job
    had reached in this pass (the plan's, when a pod was refused), else the saved one."""
    base = base or this.before
    finished = base.phase in gang.FINISHED
    valid = job_status.valid_condition(decision.problems, decision.note)
    lifecycle = base if finished else replace(base, phase=Phase.INVALID, reason=valid.reason, message=valid.message)
    health = redis_reads.invalid_health(decision.spec, this.redis, this.runtime, pods, this.now)
    spec_environment = decision.spec.rollout.environment if decision.spec is not None else None
    new = this.status(lifecycle, problems=decision.problems, data_parallel_size=None, redis=health, pods=pods,
                      nodes=0, replicas=0, progress=None, kept=decision.note,
                      environment=environment.report(this.job(decision.spec), spec_environment, this.environment, 0)
                      if decision.spec is not None else None)
    stray = () if finished else tuple((p.name, p.uid) for p in admission.live_workers(pods))
    return _Outcome(new, delay=this.ctx.idle_interval_s, delete=stray, release=True,
                    restarts=base.restarts - this.before.restarts,
                    stop_environment=this.environment is not None and this.environment.replicas > 0)


async def _run(this: _Pass, decision: Decision) -> _Outcome:
    """The gang's plan for the spec to run, with its pods created (see the module docstring)."""
    spec, config, runtime, ctx = decision.run, decision.config, this.runtime, this.ctx
    spec = rollout_scaling.with_replicas(spec, rollout_scaling.replicas_to_run(spec, this.previous.autoscaling))
    job = this.job(spec)
    pods = this.pods()
    source = await read_reward_source(spec, job.namespace, ctx)
    hashes = replace(render.config_hashes(config), reward_source=source.hash, changed=runtime.config_changes)
    nodes = await _lost_nodes(this.ctx, pods, this.now)
    stream_lost = this.previous.stream_lost_attempt == this.before.attempt
    queued = await queueing.decide(job, config, this.body, this.before, runtime, ctx)
    hold = queued.hold if queued is not None else None
    if queued is not None and queued.rollouts is not None and queued.rollouts < spec.rollout.replicas:
        spec = rollout_scaling.with_replicas(spec, queued.rollouts)  # a scale-up waits for its Workload slice
    plan = gang.plan(job.name, spec, this.before, pods, hashes, this.now, nodes=nodes, stream_lost=stream_lost,
                     hold=hold, trained_step=this.previous.step)
    claim = await redis_reads.read_claim(job.name, job.namespace, config, this.redis, ctx)
    health = redis_reads.health(spec, this.redis, runtime, pods, this.now, claim)
    fetched, forgot = None, None
    if ctx.read_progress and redis_reads.reads_progress(this.before.phase, plan.lifecycle.phase,
                                                        spec.redis.mode == "managed", health.ready):
        fetched = await redis_reads.read_progress(job, config, runtime, ctx)
        if fetched is not None:
            runtime.step_rate.add(fetched.updated_at, fetched.step)
            forgot = _forgotten_stream(this, fetched)
        health = redis_reads.health(spec, this.redis, runtime, pods, this.now, claim)
        done = fetched is not None and fetched.step is not None and fetched.step >= spec.trainer.max_steps
        if fetched is not None and (fetched.reward_failures is not None or forgot or (spec.run_policy.suspend and done)):
            # the plan may change (a suspend that comes after the last step lets the gang finish)
            plan = gang.plan(job.name, spec, this.before, pods, hashes, this.now, rewards=fetched.reward_failures,
                             nodes=nodes, stream_lost=stream_lost or forgot is not None, hold=hold,
                             trained_step=fetched.step)
    manifests = [render.trainer_pod(job, config, i, plan.lifecycle.attempt) for i in plan.create_trainers]
    manifests += [render.rollout_pod(job, config, i, source.hash) for i in plan.create_rollouts]
    if queued is not None:
        manifests = [queued.admit(m, c.Role(m["metadata"]["labels"][c.LABEL_ROLE])) for m in manifests]
    server = environment.server_of(config)
    serving = environment.replicas(server, plan.lifecycle.phase, hold is not None) if server is not None else 0
    place = (lambda template: queued.admit(template, c.Role.ENVIRONMENT)) if queued is not None and hold is None \
        else None
    error = await children.apply_environment(job, config, serving, place, this.environment is not None, this.body,
                                             runtime, ctx)
    if error is None:
        error = await children.create_pods(manifests, this.body, runtime, ctx)
    lifecycle, problems, note = plan.lifecycle, decision.problems, decision.note
    if error is not None and admission.refusal_of_spec(error.status, error.message):
        runtime.reject(this.meta.get("generation"), error.message)
        decision, error = await this.admit(), None
        if decision.run is None:
            return _invalid(this, decision, this.pods(), plan.lifecycle)
        problems, note = decision.problems, decision.note  # an invalid edit goes on with its last valid spec
    elif error is None and plan.after_create is not None:
        lifecycle, pods = plan.after_create, this.pods()
    lifecycle = gang.require_redis(lifecycle, *redis_reads.known(health, this.previous))
    lifecycle = gang.require_started(lifecycle, fetched, this.before)
    new = this.status(lifecycle, problems=problems, data_parallel_size=data_parallel_size(spec), redis=health,
                      pods=job_status.name_spec_fields(pods, spec), nodes=spec.trainer.nodes,
                      replicas=spec.rollout.replicas, progress=fetched, max_steps=spec.trainer.max_steps,
                      steps_per_second=runtime.step_rate.per_second(),
                      checkpoint_volume=spec.trainer.checkpoint.volume,
                      reward_deadline_s=spec.rollout.reward_failure_deadline_seconds, kept=note,
                      stream=this.stream(spec, config), reward_source=source.problem,
                      scale_wait=queued.scale_wait if queued is not None else None,
                      environment=environment.report(job, config.spec.rollout.environment, this.environment, serving))
    if fetched is not None:
        new = _stream_identity(this, new, fetched, forgot)
    new, scaled = _autoscale(this, spec, new, fetched)
    uids = {p.name: p.uid for p in pods}
    idle = plan.lifecycle.phase in job_status.IDLE_PHASES
    # A job Kueue holds with no pod left waits for its Workload, whose changes wake it (handlers.WORKLOADS).
    waiting = hold is not None and not admission.live_workers(pods)
    interval = ctx.idle_interval_s if idle or waiting else ctx.active_interval_s
    if plan.requeue_after is not None and not plan.delete_job:
        interval = min(interval, plan.requeue_after)
    return _Outcome(
        new, delay=interval,
        delete=tuple((name, uids.get(name, "")) for name in plan.delete), delete_job=plan.delete_job, release=idle,
        force_delete=plan.force_delete,
        events=_pass_events(this, plan.lifecycle, forgot) + scaled,
        restarts=plan.lifecycle.restarts - this.before.restarts, error=error, queued=queued, pods=tuple(pods),
    )


def _autoscale(this: _Pass, spec: RLTrainingJobSpec, new: RLTrainingJobStatus,
               fetched: Optional[Progress]) -> tuple[RLTrainingJobStatus, tuple[job_status.Event, ...]]:
    """The autoscaler's turn (:mod:`.rollout_scaling`) for a running job with ``spec.rollout.autoscaling``: ``new``
    with ``status.autoscaling``, and the RolloutsScaled Event of a change. Without autoscaling the status has none."""
    if spec.rollout.autoscaling is None:
        return (new if new.autoscaling is None else new.model_copy(update={"autoscaling": None})), ()
    replicas = spec.rollout.replicas  # replicas_to_run, already in the pass's spec
    measured = capacity.signals(new.capacity) if fetched is not None else None  # none while idle (capacity removed)
    auto, decision = rollout_scaling.decide(spec, new.autoscaling, replicas, measured, this.now, new.start_time)
    events = ()
    if decision is not None and decision.changed:
        events = (job_status.Event("Normal", Reason.ROLLOUTS_SCALED.value, decision.reason),)
    return new.model_copy(update={"autoscaling": auto}), events


def _phase_message(new: RLTrainingJobStatus) -> str:
    """The message of the condition that describes ``new``'s phase."""
    cond = new.condition(gang.PHASE_CONDITION.get(new.phase, c.ConditionType.RUNNING))
    return cond.message if cond is not None else ""


def _pass_events(this: _Pass, lifecycle: gang.Lifecycle, forgot: Optional[str]) -> tuple[job_status.Event, ...]:
    """Warnings no condition transition tells: Redis forgot the stream; Kueue evicted the job (Running stays False
    between a wait for admission and an eviction, so its reason change alone is no Event)."""
    events = []
    if forgot is not None:
        events.append(job_status.Event("Warning", Reason.STREAM_LOST.value, forgot))
    if lifecycle.reason == Reason.EVICTED_BY_KUEUE and this.before.reason != Reason.EVICTED_BY_KUEUE:
        events.append(job_status.Event("Warning", Reason.EVICTED_BY_KUEUE.value, lifecycle.message))
    return tuple(events)


async def _save(this: _Pass, new: RLTrainingJobStatus) -> None:
    """Write ``new`` if it differs from the stored status; then post an Event per transition, and the Events of what
    passes did (:attr:`JobRuntime.notices`).

    Raises:
        StaleStatus: the job changed since the pass read it (409).
    """
    patch = job_status.status_patch(this.body.get("status") or {}, new)
    events = list(this.runtime.notices)
    if patch is not None:
        resource_version = this.meta.get("resourceVersion")
        try:
            updated = await this.ctx.api.patch_status(this.meta["namespace"], this.meta["name"], patch,
                                                      resource_version)
        except ApiError as err:
            if err.status == 409:
                raise StaleStatus(str(err)) from err
            raise
        this.runtime.remember_write(resource_version, updated)
        events = job_status.transition_events(this.previous, new) + events
    this.runtime.notices.clear()
    for event in events:
        this.ctx.post_event(this.body, event)


async def _act(this: _Pass, outcome: _Outcome) -> None:
    """What follows the status write (see :class:`_Outcome`).

    Raises:
        ApiError: a refused call, or the outcome's ``error``.
    """
    namespace, name = this.meta["namespace"], this.meta["name"]
    if outcome.restarts > 0:
        this.ctx.on_restart(outcome.restarts)
    await children.delete_pods(namespace, outcome.delete, this.runtime, this.ctx)
    if outcome.stop_environment:
        await children.stop_environment(name, namespace, this.runtime, this.ctx)
    for event in outcome.events:
        this.ctx.post_event(this.body, event)
    for stuck in outcome.force_delete:
        if await this.ctx.api.delete("v1", "Pod", namespace, stuck.pod.name, uid=stuck.pod.uid or None,
                                     grace_period_seconds=0):
            this.ctx.post_event(this.body, job_status.Event("Warning", "PodForceDeleted", (
                f"{stuck.why}; force-deleted (grace 0) after the node was not Ready for "
                f"{stuck.pod.lost_node_toleration_s} s, so that the gang can go on; processes it left on the node "
                "are fenced from the job's writes (DESIGN §6)")))
    await queueing.follow_up(outcome.queued, outcome.status.phase, _phase_message(outcome.status), outcome.pods,
                             this.ctx, this.now)
    if outcome.release:
        await redis_reads.release(this.runtime, this.ctx, namespace, name)
    if outcome.delete_job:
        await this.ctx.api.delete(c.API_VERSION, c.KIND, namespace, name, uid=this.meta.get("uid"))
    if outcome.error is not None:
        raise outcome.error
