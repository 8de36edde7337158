"""What a pass reads about a job's Redis: its health (the managed Deployment and, while it is not available, its data
claim; or this process's last probe of an external one) and the progress hashes, through a client shared by the jobs
that use the same Redis (:mod:`.clients`). The password and TLS CA Secrets are read when connecting, not on
every pass.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Iterable, Optional

import redis.asyncio as aioredis

from rljob_api import constants as c, names, protocol
from rljob_api.config import JobConfig, RedisKeys
from rljob_api.constants import Phase, Reason
from rljob_api.protocol import Progress, parse_progress
from rljob_api.spec import RLTrainingJobSpec, SecretKeyRef
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import gang, job_status, render
from rljob_operator.kube_api import ApiError
from rljob_operator.redis_io.clients import tls_failure
from rljob_operator.observe import ClaimView, DeploymentView, PodView, claim_view
from rljob_operator.runtime import Context, JobRuntime


def health(spec: RLTrainingJobSpec, deployment: Optional[DeploymentView], runtime: JobRuntime,
           pods: Iterable[PodView], now: datetime, claim: Optional[ClaimView] = None) -> job_status.RedisHealth:
    """External: what this process's last probe found. Managed: whether the Deployment is available; if not, why: its
    data ``claim`` (:func:`read_claim`) that is not bound (reason ClaimPending when the claim's Events say why it
    cannot bind, e.g. 'ProvisioningFailed: storageclass.storage.k8s.io "fast" not found'), else why its pods are not
    ready, when they say (e.g. 'cannot start: container redis ImagePullBackOff: ...')."""
    if spec.redis.mode == "external":
        return runtime.redis_health
    if deployment is None:
        return job_status.RedisHealth(False, "the managed Redis Deployment does not exist yet")
    message = f"managed Redis {deployment.name}: {deployment.message}"
    if not deployment.available and claim is not None and not claim.bound:
        storage_class = (f"storage class {claim.storage_class!r}" if claim.storage_class is not None
                         else "no storage class (the cluster has no default StorageClass)")
        where = f"its data claim {claim.name} ({storage_class}) is {claim.phase}"
        if claim.problem:
            return job_status.RedisHealth(False, f"{message}; {where}: {claim.problem}; fix spec.redis.persistence "
                                      "(storageClassName, size) or the cluster's storage, or set "
                                      "spec.redis.persistence.enabled to false", Reason.CLAIM_PENDING)
        return job_status.RedisHealth(False, f"{message}; {where}: waiting for it to be bound")
    troubles = "" if deployment.available else job_status.describe_troubles(
        (p for p in pods if p.role == c.Role.REDIS and not p.deleting), now)
    return job_status.RedisHealth(deployment.available, f"{message}; {troubles}" if troubles else message)


async def read_claim(job_name: str, namespace: str, config: JobConfig, deployment: Optional[DeploymentView],
                     ctx: Context) -> Optional[ClaimView]:
    """The managed Redis's data claim with the Events that explain it, read only while it matters: the Redis of
    ``config`` keeps its data on a claim (:func:`~rljob_operator.render.redis_persistence`) and its Deployment exists
    but is not available. None otherwise, or when the claim does not exist (yet). One GET, and a LIST of the claim's
    Events while it is not bound.

    Raises:
        ApiError: a refused read.
    """
    if deployment is None or deployment.available or render.redis_persistence(config) is None:
        return None
    name = names.redis_claim(job_name)
    claim = await ctx.api.get("v1", "PersistentVolumeClaim", namespace, name)
    if claim is None:
        return None
    events = []
    if (claim.get("status") or {}).get("phase") != "Bound":
        events = await ctx.api.list("v1", "Event", namespace,
                                    field_selector=f"involvedObject.kind=PersistentVolumeClaim,involvedObject.name={name}")
    return claim_view(claim, events)


def invalid_health(spec: Optional[RLTrainingJobSpec], deployment: Optional[DeploymentView],
                   runtime: JobRuntime, pods: Iterable[PodView], now: datetime) -> job_status.RedisHealth:
    """RedisReady of an invalid job: a managed Redis that exists (the spec became invalid after it was made, or a
    child was refused) is reported as it is; otherwise what this process knows, or Unknown."""
    if spec is not None and spec.redis.mode == "managed" and deployment is not None:
        return health(spec, deployment, runtime, pods, now)
    if runtime.redis_health.ready is None:
        return job_status.RedisHealth(None, "not checked while the spec is invalid")
    return runtime.redis_health


def known(found: job_status.RedisHealth, previous: RLTrainingJobStatus) -> tuple[Optional[bool], str]:
    """(whether Redis is ready, why): this pass's ``found``, or while it is unknown (not probed by this process yet)
    the saved RedisReady condition's."""
    if found.ready is not None:
        return found.ready, found.message
    saved = previous.condition(c.ConditionType.REDIS_READY)
    if saved is None or saved.status == "Unknown":
        return None, found.message
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
    if before in job_status.IDLE_PHASES and after == before:
        return False
    if after in gang.FINISHED and before not in gang.FINISHED:
        return True
    return bool(redis_ready) or not managed


async def read_progress(job: render.Job, config, runtime: JobRuntime, ctx: Context) -> Optional[Progress]:
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
            await release(runtime, ctx, *holder)
            runtime.redis_health = job_status.RedisHealth(False, str(err))
            return None
        runtime.redis = await ctx.redis_clients.acquire(holder, config.redis, password, ca_data)
        runtime.redis_identity = identity
    try:
        result = await fetch(runtime.redis, config.keys)
    except (aioredis.RedisError, OSError) as err:
        await release(runtime, ctx, *holder)  # reconnect (and re-read the Secrets) on the next pass
        reason = tls_failure(err)
        if reason is not None:
            bundle = (f"the CAs of spec.redis.caSecretRef (Secret {job.namespace}/{ca_ref.name}, key {ca_ref.key!r})"
                      if ca_ref else "the system CAs (spec.redis.caSecretRef unset)")
            message = (f"the TLS certificate of Redis at {where} did not verify against {bundle}: {reason}; set "
                       "spec.redis.caSecretRef to a Secret key holding the CA that signed it, and check that the "
                       "certificate names the host of spec.redis.url")
        else:
            message = f"cannot reach Redis at {where}: {err}"
        runtime.redis_health = job_status.RedisHealth(False, message)
        return None
    runtime.redis_health = job_status.RedisHealth(True, f"reached Redis at {where}")
    return result


async def release(runtime: JobRuntime, ctx: Context, namespace: str, name: str) -> None:
    """The job stops holding its shared Redis client (closed when no other job holds it)."""
    runtime.redis, runtime.redis_identity = None, None
    await ctx.redis_clients.release((namespace, name))


async def fetch(client: aioredis.Redis, keys: RedisKeys) -> Progress:
    """Read the progress, rollout and checkpoint hashes in one round trip and parse them.

    Raises:
        redis.RedisError: Redis unreachable or the password is wrong.
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.progress)
        pipe.hgetall(keys.rollout)
        pipe.hgetall(keys.checkpoint)
        pipe.get(keys.prefix + protocol.KEY_STREAM_ID)
        pipe.xinfo_groups(keys.stream)
        pipe.xlen(keys.stream)
        progress, rollout, checkpoint, stream_id, groups, length = await pipe.execute(raise_on_error=False)
    for reply in (progress, rollout, checkpoint, stream_id):
        if isinstance(reply, Exception):
            raise reply
    parsed = parse_progress(progress, rollout, checkpoint)
    backlog = None if isinstance(groups, Exception) else protocol.Backlog.from_groups(  # no stream
        groups, keys.group, None if isinstance(length, Exception) else int(length))
    return dataclasses.replace(parsed, stream_id=protocol.text(stream_id), backlog=backlog)
