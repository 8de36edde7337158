"""One reconcile pass of one RLTrainingJob: parse → render → apply → plan the gang → report.

Everything decided here comes from the pure modules (:mod:`.render`, :mod:`.gang`, :mod:`.status`); this
module only sequences their results with the API calls of :mod:`.apply`:

1. parse and check the spec; a problem (or an earlier 422 from the API server for this generation) makes the
   job Invalid: status says which field, no pod runs, nothing retries until the spec changes. An edit that makes
   the spec of a job with pods (Pending, Starting, Running, Restarting) or of a suspended job invalid does not
   orphan or forget them: the job goes on with its last valid spec (:func:`kept_spec`; runPolicy edits still act,
   so suspend and resume work), Valid=False says so, and the fixed spec is applied like any edit;
2. apply the Redis Secret (create-only), the ConfigMap, Services and the Redis Deployment, concurrently — only when
   their rendering changed since this process last applied them; a job this process meets for the first time has
   its children read back first, and only those not as rendered are applied (:mod:`.applied`);
3. plan the gang from the observed pods (the kopf index, plus pods this process created or deleted that the
   watch has not reported yet) and read the progress hashes;
4. save the status (merge patch with a resourceVersion precondition: a stale view is refused, not written)
   and post Events for transitions; then delete and create pods (each batch concurrently), and save again if a gang
   was created.

Per-job state that lives only in this process (locks, what was applied and written, the Redis client held) is a
:class:`JobRuntime` held in kopf's ``memo``. A pass that starts before the watch has delivered this process's
own last status write reads the job as written (:meth:`JobRuntime.catch_up`), so it is not refused as stale.
Redis clients are shared by the jobs that use the same Redis (:mod:`.redis_clients`); a job holds one only while
it is active.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import json
import secrets
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional

import redis.asyncio as aioredis
from pydantic import ValidationError

from rljob_api import constants as c, names
from rljob_api.constants import Phase
from rljob_api.config import JobConfig
from rljob_api.spec import RLTrainingJobSpec, RunPolicySpec, SecretKeyRef
from rljob_api.status import RLTrainingJobStatus
from rljob_api.validation import SpecProblem, check_spec, data_parallel_size

from rljob_operator import applied, gang, progress, render, status
from rljob_operator.apply import ApiError, KubeApi, adopt
from rljob_operator.observe import DeploymentView, PodView, controller_uid, pod_view
from rljob_operator.redis_clients import RedisClients

#: How long a pod this process created counts as present before the watch reports it (seconds).
CREATED_GRACE_S = 30.0


class StaleStatus(Exception):
    """The job changed between reading it and writing its status (HTTP 409); retry with the fresh object."""


@dataclass
class JobRuntime:
    """State of one job in this operator process (lost on restart, rebuilt from the cluster)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    applied: Optional[str] = None
    """Digest of the static children this process last applied or found as rendered (re-applied only when it
    changes)."""
    rejected: Optional[tuple[int, str]] = None
    """(generation, message) of a child the API server refused (422); cleared by a new generation."""
    last_valid: Optional[tuple[Optional[int], RLTrainingJobSpec]] = None
    """(generation, spec) whose children this process last applied: what an invalid edit keeps running."""
    created: dict[str, tuple[float, PodView]] = field(default_factory=dict)
    deleted: dict[str, str] = field(default_factory=dict)
    redis: Optional[aioredis.Redis] = None
    """The shared client this job holds (:class:`~rljob_operator.redis_clients.RedisClients`), while active."""
    redis_identity: Optional[tuple] = None
    redis_health: status.RedisHealth = status.RedisHealth(None, "not checked yet")
    looping: bool = False
    """True while the job's daemon loop runs (the operator's cleanup waits for it)."""
    seen: Optional[tuple] = None
    """What the job's metadata said at the last pass (see ``handlers``): a watch event that changes it wakes the
    daemon, this process's own status writes do not."""
    written: Optional[tuple[frozenset[str], str, dict[str, Any]]] = None
    """(resourceVersions this process's status writes replaced, the resourceVersion and status they left), until
    the watch shows the job at or past that write."""

    def catch_up(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body``, or — when it predates this process's last status write — ``body`` with that write's status
        and resourceVersion. A status write carries a resourceVersion precondition, so nothing else changed the
        job between the replaced version and the written one: the result is the job as the API server holds it."""
        if self.written is None:
            return body
        replaced, version, stored = self.written
        meta = body.get("metadata") or {}
        if meta.get("resourceVersion") not in replaced:
            self.written = None  # the watch caught up, or the job moved on since
            return body
        return {**body, "metadata": {**meta, "resourceVersion": version}, "status": stored}

    def remember_write(self, before: Optional[str], updated: Mapping[str, Any]) -> None:
        """Record a status write that moved the job from resourceVersion ``before`` to ``updated``."""
        replaced = self.written[0] if self.written is not None else frozenset()
        self.written = (replaced | {before}, updated["metadata"]["resourceVersion"], dict(updated.get("status") or {}))


@dataclass
class Context:
    """What a pass needs from the operator: the API, intervals (seconds), and hooks for events and metrics."""

    api: KubeApi
    post_event: Callable[[Mapping[str, Any], status.Event], None]
    redis_clients: RedisClients = field(default_factory=RedisClients)
    on_restart: Callable[[int], None] = lambda n: None
    active_interval_s: float = 5.0
    idle_interval_s: float = 60.0
    read_progress: bool = True
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(timezone.utc).replace(microsecond=0))


NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def parse_spec(name: str, raw: Mapping[str, Any]) -> tuple[Optional[RLTrainingJobSpec], list[SpecProblem]]:
    """Validate the job's name and ``raw`` spec with the pydantic model, then :func:`check_spec`.

    Returns (spec or None, problems); every problem names its field (``metadata.name``, ``spec.a.b``).
    The name rule is checked here, not by CEL: the API server cannot bound the cost of a regex on
    metadata.name.
    """
    problems = []
    if not NAME_PATTERN.match(name):
        problems.append(SpecProblem(
            "metadata.name",
            f"{name!r} must start with a lowercase letter and hold only lowercase letters, digits and '-' "
            "(it names the job's Services and pod hostnames); a name cannot be changed: delete the job and create it "
            "again under another name",
        ))
    try:
        spec = RLTrainingJobSpec.model_validate(raw)
    except ValidationError as err:
        return None, problems + [
            SpecProblem("spec." + ".".join(str(part) for part in e["loc"]) if e["loc"] else "spec", e["msg"])
            for e in err.errors()
        ]
    return spec, problems + check_spec(spec)


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


#: Phases whose pods an invalid edit leaves running on the last valid spec (:func:`kept_spec`).
KEEP_PHASES = (Phase.PENDING, Phase.STARTING, Phase.RUNNING, Phase.RESTARTING, Phase.SUSPENDED)


async def kept_spec(
    name: str, namespace: str, raw: Mapping[str, Any], runtime: JobRuntime, api: KubeApi
) -> Optional[tuple[Optional[int], RLTrainingJobSpec]]:
    """The (generation or None, spec) an active job goes on with while its spec is invalid: the last valid spec this
    process applied, or — after an operator restart — the one in the job's config ConfigMap (the resolved config of
    the last valid spec). Its ``runPolicy`` is the invalid spec's when that part validates on its own (suspend,
    deadlines and backoffLimit still act; the ConfigMap's copy holds only defaults), else the last valid one's.
    None when there is none (a job that was never valid). The caller drops a kept spec equal to the current one
    (a spec whose children the API server refused).

    Raises:
        ApiError: reading the ConfigMap failed other than with 404.
    """
    if runtime.last_valid is not None:
        generation, spec = runtime.last_valid
    else:
        stored = await api.get("v1", "ConfigMap", namespace, names.config_map(name))
        try:
            spec = JobConfig.from_json(stored["data"][c.CONFIG_FILE_NAME]).spec if stored else None
        except (KeyError, TypeError, ValidationError):
            spec = None  # edited by hand: nothing to go on with
        if spec is None:
            return None
        generation = None
    try:
        run_policy = RunPolicySpec.model_validate(raw.get("runPolicy") or {})
    except ValidationError:
        return generation, spec
    return generation, spec.model_copy(update={"run_policy": run_policy})


def _live_workers(pods: Iterable[PodView]) -> list[PodView]:
    """The trainer and rollout pods of ``pods`` that are not being deleted (the managed Redis pod is not one)."""
    return [p for p in pods if p.role in (c.Role.TRAINER, c.Role.ROLLOUT) and not p.deleting]


def foreign_children(uid: Optional[str], pods: Iterable[PodView], redis: Optional[DeploymentView]) -> list[str]:
    """Names of pods and of the Redis Deployment that carry the job's labels but belong to another owner: a
    deleted job of the same name whose children the garbage collector has not removed yet."""
    found = [p.name for p in pods if p.owner_uid and p.owner_uid != uid]
    if redis is not None and redis.owner_uid and redis.owner_uid != uid:
        found.append(redis.name)
    return found


def _digest(objs: Any) -> str:
    return hashlib.sha256(json.dumps(objs, sort_keys=True).encode()).hexdigest()


async def reconcile(
    body: Mapping[str, Any],
    indexed_pods: Iterable[PodView],
    redis_deployment: Optional[DeploymentView],
    runtime: JobRuntime,
    ctx: Context,
    *,
    children_only: bool = False,
) -> float:
    """Run one pass for the job ``body`` (see the module docstring). Returns seconds until the next pass.

    ``children_only``: stop once the static children are applied, before any write to the job itself (a new job's
    first pass while kopf is still adding its finalizer: a status write now would race kopf's patch).

    Raises:
        StaleStatus: the status write was refused because the job changed meanwhile.
        ApiError: any other refused API call (mapped to kopf errors by the handlers).
    """
    # A snapshot: a kopf daemon's body is a live view that follows the watch during the pass, and a status computed
    # from the old object must be written with the old resourceVersion (refused as stale), never with a newer one.
    body = runtime.catch_up(dict(body))
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    previous = RLTrainingJobStatus.model_validate(body.get("status") or {})
    before = gang.Lifecycle.from_status(previous)
    now = ctx.clock()
    pods = observed_pods(indexed_pods, runtime, time.monotonic())

    spec, problems = parse_spec(name, body.get("spec") or {})
    if runtime.rejected and runtime.rejected[0] != generation:
        runtime.rejected = None
    if spec is not None and not problems and runtime.rejected is None:
        job = render.Job(name, namespace, spec, dict(meta.get("labels") or {}))
        config = render.job_config(job)
        leftovers = foreign_children(meta.get("uid"), pods, redis_deployment)
        if leftovers and children_only:
            return 0.0
        if leftovers:  # a deleted job of the same name: its children go first (the garbage collector removes them)
            waiting = replace(before, phase=Phase.PENDING, reason=c.Reason.TEARING_DOWN, message=(
                f"waiting for {len(leftovers)} children of an earlier RLTrainingJob named {name} to be deleted: "
                + ", ".join(leftovers)))
            new = status.build_status(
                previous, generation=generation, lifecycle=waiting, problems=[],
                data_parallel_size=data_parallel_size(spec), redis=runtime.redis_health, pods=[],
                nodes=spec.trainer.nodes, replicas=spec.rollout.replicas, progress=None, now=now,
            )
            await _save(body, previous, new, runtime, ctx)
            return min(ctx.active_interval_s, 1.0)
        try:
            await _apply_static(job, config, body, runtime, ctx)
            runtime.last_valid = (generation, spec)
        except ApiError as err:
            if err.status not in (400, 422):
                raise
            runtime.rejected = (generation, err.message)
    if children_only:
        return 0.0
    if runtime.rejected:
        problems = [*problems, SpecProblem("spec", f"the API server refused a child object: {runtime.rejected[1]}")]
    kept = None
    if (spec is None or problems) and before.phase in KEEP_PHASES and (
        before.phase == Phase.SUSPENDED or _live_workers(pods)
    ):
        kept = await kept_spec(name, namespace, body.get("spec") or {}, runtime, ctx.api)
    if kept is not None and spec is not None and kept[1].model_copy(update={"run_policy": spec.run_policy}) == spec:
        kept = None  # the last valid spec is this one, refused by the API server: nothing valid to go on with
    if kept is not None:
        kept_generation, spec = kept
        job = render.Job(name, namespace, spec, dict(meta.get("labels") or {}))
        config = render.job_config(job)
        kept_note = ("the job goes on with its last valid spec"
                     + (f" (generation {kept_generation})" if kept_generation is not None else "") + " until then")
    elif spec is None or problems:
        finished = before.phase in gang.FINISHED
        note = f"the job has {before.phase.value}: a spec edit changes nothing" if finished else None
        valid = status.valid_condition(problems, note)
        # a finished job stays finished (its Valid condition still reports the problem)
        invalid = before if finished else replace(before, phase=Phase.INVALID, reason=valid.reason,
                                                  message=valid.message)
        new = status.build_status(
            previous, generation=generation, lifecycle=invalid, problems=problems, data_parallel_size=None,
            redis=_invalid_redis_health(spec, redis_deployment, runtime, pods, now), pods=pods, nodes=0, replicas=0,
            progress=None, now=now, kept=note,
        )
        await _save(body, previous, new, runtime, ctx)
        await release_redis(runtime, ctx, namespace, name)
        if not finished:  # nothing of an invalid job runs (e.g. the rollout pods made before a refused trainer pod)
            stray = _live_workers(pods)
            gone = await _all(ctx.api.delete("v1", "Pod", namespace, p.name, uid=p.uid or None) for p in stray)
            runtime.deleted.update({p.name: p.uid for p, deleted in zip(stray, gone) if deleted})
        return ctx.idle_interval_s
    else:
        kept_note = None

    plan = gang.plan(name, spec, before, pods, render.config_hashes(config), now)
    redis_health = _redis_health(spec, redis_deployment, runtime, pods, now)
    fetched = None
    if ctx.read_progress and reads_progress(before.phase, plan.lifecycle.phase, spec.redis.mode == "managed",
                                            redis_health.ready):
        fetched = await _read_progress(job, config, runtime, ctx)
        redis_health = _redis_health(spec, redis_deployment, runtime, pods, now)
    lifecycle = gang.require_redis(plan.lifecycle, *_known_redis(redis_health, previous))
    secrets = status.secret_fields(spec)
    common = dict(
        generation=generation, problems=problems, data_parallel_size=data_parallel_size(spec), redis=redis_health,
        nodes=spec.trainer.nodes, replicas=spec.rollout.replicas, progress=fetched, now=now,
        checkpoint_volume=spec.trainer.checkpoint.volume, kept=kept_note,
    )
    new = status.build_status(previous, lifecycle=lifecycle, pods=status.name_secret_fields(pods, secrets), **common)
    resource_version = await _save(body, previous, new, runtime, ctx)
    if plan.lifecycle.restarts > before.restarts:
        ctx.on_restart(plan.lifecycle.restarts - before.restarts)

    uids = {p.name: p.uid for p in pods}
    gone = await _all(ctx.api.delete("v1", "Pod", namespace, pod, uid=uids.get(pod) or None) for pod in plan.delete)
    for pod, deleted in zip(plan.delete, gone):
        if deleted:
            runtime.deleted[pod] = uids.get(pod, "")
    if plan.lifecycle.phase in status.IDLE_PHASES:
        await release_redis(runtime, ctx, namespace, name)
    if plan.delete_job:
        await ctx.api.delete(c.API_VERSION, c.KIND, namespace, name, uid=meta.get("uid"))
        return ctx.idle_interval_s
    created = [render.trainer_pod(job, config, i, plan.lifecycle.attempt) for i in plan.create_trainers]
    created += [render.rollout_pod(job, config, i) for i in plan.create_rollouts]
    try:
        await _all(_create_pod(manifest, body, runtime, ctx) for manifest in created)
    except ApiError as err:
        if err.status not in (400, 422):
            raise
        runtime.rejected = (generation, err.message)
        return 0.0 if kept is None else ctx.active_interval_s  # the next pass reports it as Valid=False
    if plan.after_create is not None:
        pods = observed_pods(indexed_pods, runtime, time.monotonic())
        after = status.build_status(new, lifecycle=plan.after_create, pods=status.name_secret_fields(pods, secrets),
                                    **{**common, "progress": None})
        await _save(body, new, after, runtime, ctx, resource_version)
    if plan.lifecycle.phase in status.IDLE_PHASES:
        return min(ctx.idle_interval_s, plan.requeue_after if plan.requeue_after is not None else float("inf"))
    return min(ctx.active_interval_s, plan.requeue_after if plan.requeue_after is not None else float("inf"))


async def _apply_static(job: render.Job, config, body: Mapping[str, Any], runtime: JobRuntime, ctx: Context) -> None:
    """Apply the static children (and create the managed Redis Secret) that are not as rendered, concurrently.

    A job this process has not applied yet but that has a status (reconciled before, by this process or an earlier
    one) may have every child in place already: they are read first (GET) and only the missing, changed or edited
    ones applied (:func:`~rljob_operator.applied.outdated`), so an operator restart writes nothing for an idle job.
    A new job's children are applied at once (no read before its first write)."""
    children = render.static_children(job, config)
    adopt(children, body)
    children = [applied.stamp(child) for child in children]
    digest = _digest(children)
    if runtime.applied == digest:
        return
    known = bool(body.get("status"))
    managed = job.spec.redis.mode == "managed"
    secret = render.redis_secret(job, secrets.token_urlsafe(32)) if managed else None
    if known:
        reads = [ctx.api.get(ch["apiVersion"], ch["kind"], job.namespace, ch["metadata"]["name"]) for ch in children]
        if secret is not None:
            reads.append(ctx.api.get("v1", "Secret", job.namespace, secret["metadata"]["name"]))
        found = await _all(reads)
        stale = [child for child, live in zip(children, found) if applied.outdated(live, child)]
    else:
        found, stale = [], children
    writes = [ctx.api.apply(child) for child in stale]
    if secret is not None:
        writes.append(_ensure_secret(secret, found[-1] if known else None, body, ctx))
    await _all(writes)
    runtime.applied = digest


async def _ensure_secret(secret: dict[str, Any], existing: Optional[Mapping[str, Any]], owner: Mapping[str, Any],
                         ctx: Context) -> None:
    """Create the managed Redis password Secret unless it exists (``existing``: as read already, or None); an existing
    Secret must be this job's (409 otherwise: an earlier job of the same name still owns it)."""
    if existing is None:
        adopt([secret], owner)
        if await ctx.api.create(secret) is not None:
            return
        existing = await ctx.api.get("v1", "Secret", owner["metadata"]["namespace"], secret["metadata"]["name"])
    if existing is not None and controller_uid(existing) != owner["metadata"].get("uid"):
        raise ApiError(409, "Conflict", f"Secret {secret['metadata']['name']} of an earlier job of the same "
                       "name still exists", "create Secret")


async def _all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await ``calls`` concurrently; once every one has ended, raise the first error in call order (if any)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _create_pod(manifest: dict[str, Any], owner: Mapping[str, Any], runtime: JobRuntime, ctx: Context) -> None:
    """Create one pod; an existing pod of the same name must belong to the same attempt (409 otherwise)."""
    adopt([manifest], owner)
    meta = manifest["metadata"]
    created = await ctx.api.create(manifest)
    if created is not None:
        runtime.created[meta["name"]] = (time.monotonic(), pod_view(created))
        return
    existing = await ctx.api.get("v1", "Pod", meta["namespace"], meta["name"])
    wanted = meta["labels"].get(c.LABEL_ATTEMPT)
    if existing is not None and (existing["metadata"].get("labels") or {}).get(c.LABEL_ATTEMPT) != wanted:
        raise ApiError(409, "Conflict", f"pod {meta['name']} of another attempt still exists", "create pod")
    if existing is not None and controller_uid(existing) != owner["metadata"].get("uid"):
        raise ApiError(409, "Conflict", f"pod {meta['name']} of another job of the same name still exists", "create pod")


async def _save(body: Mapping[str, Any], previous: RLTrainingJobStatus, new: RLTrainingJobStatus,
                runtime: JobRuntime, ctx: Context, resource_version: Optional[str] = None) -> Optional[str]:
    """Write ``new`` if it differs from what is stored (the body's status, or ``previous`` once this pass
    wrote it: ``resource_version`` given); post an Event per transition. Returns the resourceVersion."""
    stored = status.to_json(previous) if resource_version else (body.get("status") or {})
    resource_version = resource_version or body["metadata"].get("resourceVersion")
    patch = status.status_patch(stored, new)
    if patch is None:
        return resource_version
    meta = body["metadata"]
    try:
        updated = await ctx.api.patch_status(meta["namespace"], meta["name"], patch, resource_version)
    except ApiError as err:
        if err.status == 409:
            raise StaleStatus(str(err)) from err
        raise
    runtime.remember_write(resource_version, updated)
    for event in status.transition_events(previous, new):
        ctx.post_event(body, event)
    return updated["metadata"]["resourceVersion"]


def _redis_health(spec: RLTrainingJobSpec, deployment: Optional[DeploymentView], runtime: JobRuntime,
                  pods: Iterable[PodView], now: datetime) -> status.RedisHealth:
    """External: what this process's last probe found. Managed: whether the Deployment is available; if not, why its
    pods are not ready, when they say (e.g. 'cannot start: container redis ImagePullBackOff: ...')."""
    if spec.redis.mode == "external":
        return runtime.redis_health
    if deployment is None:
        return status.RedisHealth(False, "the managed Redis Deployment does not exist yet")
    message = f"managed Redis {deployment.name}: {deployment.message}"
    troubles = "" if deployment.available else status.describe_troubles(
        (p for p in pods if p.role == c.Role.REDIS.value and not p.deleting), now)
    return status.RedisHealth(deployment.available, f"{message}; {troubles}" if troubles else message)


def _invalid_redis_health(spec: Optional[RLTrainingJobSpec], deployment: Optional[DeploymentView],
                          runtime: JobRuntime, pods: Iterable[PodView], now: datetime) -> status.RedisHealth:
    """RedisReady of an invalid job: a managed Redis that exists (the spec became invalid after it was made, or a
    child was refused) is reported as it is; otherwise what this process knows, or Unknown."""
    if spec is not None and spec.redis.mode == "managed" and deployment is not None:
        return _redis_health(spec, deployment, runtime, pods, now)
    if runtime.redis_health.ready is None:
        return status.RedisHealth(None, "not checked while the spec is invalid")
    return runtime.redis_health


def _known_redis(health: status.RedisHealth, previous: RLTrainingJobStatus) -> tuple[Optional[bool], str]:
    """(whether Redis is ready, why): this pass's health, or while it is unknown (not probed by this process yet)
    the saved RedisReady condition's."""
    if health.ready is not None:
        return health.ready, health.message
    saved = previous.condition(c.ConditionType.REDIS_READY)
    if saved is None or saved.status == "Unknown":
        return None, health.message
    return saved.status == "True", saved.message


class _SecretProblem(Exception):
    """A Secret the Redis client needs cannot be read; the message names the spec field and the Secret."""


async def _secret_text(ctx: Context, namespace: str, ref: Optional[SecretKeyRef], field_name: str) -> Optional[str]:
    """The value of ``ref`` in ``namespace`` (None when ``ref`` is None).

    Raises:
        _SecretProblem: the Secret or its key is missing, or the API server refused to read it.
    """
    if ref is None:
        return None
    try:
        value = await ctx.api.secret_value(namespace, ref.name, ref.key)
    except ApiError as err:
        raise _SecretProblem(f"{field_name}: cannot read Secret {namespace}/{ref.name}: {err.message}") from err
    if value is None:
        raise _SecretProblem(f"{field_name}: Secret {namespace}/{ref.name} or its key {ref.key!r} does not exist; "
                             "create it or fix the reference")
    return value


def reads_progress(before: Phase, after: Phase, managed: bool, redis_ready: Optional[bool]) -> bool:
    """Whether a pass that moves the job from phase ``before`` to ``after`` reads the progress hashes: while active
    or on a phase change, a managed Redis only once it is ready — except on the pass that finishes the job, whose
    read carries the final step, reward and metrics into status even when the Redis Deployment's readiness lags
    behind the trainer (a short job can finish before it shows)."""
    if before in status.IDLE_PHASES and after == before:
        return False
    if after in gang.FINISHED and before not in gang.FINISHED:
        return True
    return bool(redis_ready) or not managed


async def _read_progress(job: render.Job, config, runtime: JobRuntime, ctx: Context) -> Optional[progress.Progress]:
    """Best effort: the progress hashes, or None (and RedisReady=False with the error).

    The password and TLS CA Secrets are read when connecting, not on every pass: a missing one is reported (naming
    the spec field) and read again on the next pass."""
    password_ref, ca_ref = render.redis_password_ref(job), job.spec.redis.ca_secret_ref
    where = f"{config.redis.host}:{config.redis.port}"
    identity = (config.redis.host, config.redis.port, config.redis.db, config.redis.tls, password_ref, ca_ref)
    holder = (job.namespace, job.name)
    if runtime.redis is None or runtime.redis_identity != identity:
        external = job.spec.redis.mode == "external"
        password_field = "spec.redis.passwordSecretRef" if external else "the managed Redis password"
        try:
            password = await _secret_text(ctx, job.namespace, password_ref, password_field)
            ca_data = await _secret_text(ctx, job.namespace, ca_ref, "spec.redis.caSecretRef")
        except _SecretProblem as err:
            await release_redis(runtime, ctx, *holder)
            runtime.redis_health = status.RedisHealth(False, str(err))
            return None
        runtime.redis = await ctx.redis_clients.acquire(holder, config.redis, password, ca_data)
        runtime.redis_identity = identity
    try:
        result = await progress.fetch(runtime.redis, config.keys)
    except (aioredis.RedisError, OSError) as err:
        await release_redis(runtime, ctx, *holder)  # reconnect (and re-read the Secrets) on the next pass
        reason = progress.tls_failure(err)
        if reason is not None:
            bundle = (f"the CAs of spec.redis.caSecretRef (Secret {job.namespace}/{ca_ref.name}, key {ca_ref.key!r})"
                      if ca_ref else "the system CAs (spec.redis.caSecretRef unset)")
            message = (f"the TLS certificate of Redis at {where} did not verify against {bundle}: {reason}; set "
                       "spec.redis.caSecretRef to a Secret key holding the CA that signed it, and check that the "
                       "certificate names the host of spec.redis.url")
        else:
            message = f"cannot reach Redis at {where}: {err}"
        runtime.redis_health = status.RedisHealth(False, message)
        return None
    runtime.redis_health = status.RedisHealth(True, f"reached Redis at {where}")
    return result


async def release_redis(runtime: JobRuntime, ctx: Context, namespace: str, name: str) -> None:
    """The job stops holding its shared Redis client (closed when no other job holds it)."""
    runtime.redis, runtime.redis_identity = None, None
    await ctx.redis_clients.release((namespace, name))
