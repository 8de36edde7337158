"""kopf handlers: tiny, each one parse → reconcile (:mod:`.reconcile`) → report.

- indices ``pods_by_job``, ``redis_by_job`` and ``environment_by_job``: child pods (the environment server's among
  them), the managed Redis Deployment and the environment server's Deployment, keyed by (namespace, job-name label),
  kept current by kopf's watch streams (no API calls per pass);
- a daemon per job, the only place passes run (so one writer per job): a pass every few seconds
  (``--active-interval``; ``--idle-interval`` for suspended, finished or invalid jobs, or sooner when a deadline
  or TTL fires), or at once when woken. On a new job it applies the static children (ConfigMap, Services, Redis)
  at once but writes nothing to the job until kopf has put its finalizer on it, so kopf's finalizer patch and the
  first status write never race (the loser would be refused with a 409);
- ``on.event`` of a job wakes its daemon when the spec (generation), the labels or kopf's finalizer changed — not
  on the daemon's own status writes. No ``on.create``/``on.update`` handler: kopf would patch its own
  bookkeeping annotations after each, racing the daemon's status write;
- ``on.event`` of a child pod, of the Redis or environment server Deployment or of a queued job's Kueue Workload wakes
  the job's daemon;
- deletion needs no handler: every child has an owner reference, so the garbage collector removes them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import kopf

from rljob_api import constants as c
from rljob_api import names

from rljob_operator import observe
from rljob_operator.redis_io import reads as redis_reads
from rljob_operator.kube_api import ApiError
from rljob_operator.reconcile import StaleStatus, reconcile
from rljob_operator.runtime import JobRuntime
from rljob_operator.settings import FINALIZER

JOBS = (c.GROUP, c.VERSION, c.PLURAL)
CHILDREN = {c.LABEL_JOB_NAME: kopf.PRESENT}
REDIS = {c.LABEL_JOB_NAME: kopf.PRESENT, c.LABEL_ROLE: c.Role.REDIS.value}
ENVIRONMENT = {c.LABEL_JOB_NAME: kopf.PRESENT, c.LABEL_ROLE: c.Role.ENVIRONMENT.value}
WORKLOADS = (c.KUEUE_GROUP, c.KUEUE_API_VERSION.split("/")[1], "workloads")
"""Kueue's Workloads: a queued job's own wakes it when Kueue admits or evicts it (not watched where Kueue's API is
absent: kopf serves a resource once it exists)."""
ERROR_BACKOFF_S = (1, 2, 5, 10, 30, 60)
FINALIZER_WAIT_S = 10.0
"""How long a new job's first pass waits for kopf's finalizer before it runs anyway (seconds)."""


def _key(namespace: str, job: str) -> tuple[str, str]:
    return namespace, names.job_label(job)


@kopf.index("v1", "pods", labels=CHILDREN)
def pods_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any):
    """(namespace, job-name label) → the job's pods as :class:`~rljob_operator.observe.PodView`."""
    return {(namespace, labels[c.LABEL_JOB_NAME]): observe.pod_view(body)}


@kopf.index("apps", "v1", "deployments", labels=REDIS)
def redis_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any):
    """(namespace, job-name label) → the managed Redis Deployment as a DeploymentView."""
    return {(namespace, labels[c.LABEL_JOB_NAME]): observe.deployment_view(body)}


@kopf.index("apps", "v1", "deployments", labels=ENVIRONMENT)
def environment_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any):
    """(namespace, job-name label) → the environment server's Deployment as a DeploymentView."""
    return {(namespace, labels[c.LABEL_JOB_NAME]): observe.deployment_view(body)}


@kopf.on.event("v1", "pods", labels=CHILDREN)
@kopf.on.event("apps", "v1", "deployments", labels=REDIS)
@kopf.on.event("apps", "v1", "deployments", labels=ENVIRONMENT)
@kopf.on.event(*WORKLOADS, labels=CHILDREN)
def wake_job(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A child changed: wake its job's daemon (the pass itself runs there)."""
    runtime = memo["jobs"].get((namespace, labels[c.LABEL_JOB_NAME]))
    if runtime is not None:
        runtime.wake.set()


async def _sleep(runtime: JobRuntime, stopped: kopf.DaemonStopped, closing: asyncio.Event, seconds: float) -> None:
    """Sleep up to ``seconds``, or until a child pod wakes the job, or until kopf stops the daemon or the
    operator closes."""
    waiters = [asyncio.ensure_future(runtime.wake.wait()), asyncio.ensure_future(stopped.wait()),
               asyncio.ensure_future(closing.wait())]
    try:
        await asyncio.wait(waiters, timeout=max(seconds, 0.05), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    runtime.wake.clear()


async def _pass(body: kopf.Body, memo: kopf.Memo, indices: tuple[kopf.Index, kopf.Index, kopf.Index],
                children_only: bool = False) -> float:
    """One pass over ``body`` with what ``indices`` (pods_by_job, redis_by_job, environment_by_job) hold for it."""
    pods_by_job, redis_by_job, environment_by_job = indices
    key = _key(body["metadata"]["namespace"], body["metadata"]["name"])
    runtime: JobRuntime = memo["jobs"].setdefault(key, JobRuntime())
    redis: Optional[observe.DeploymentView] = next(iter(redis_by_job.get(key, [])), None)
    environment: Optional[observe.DeploymentView] = next(iter(environment_by_job.get(key, [])), None)
    async with runtime.lock:
        with memo["metrics"].reconcile_duration.time():
            return await reconcile(body, list(pods_by_job.get(key, [])), redis, runtime, memo["context"],
                                   children_only=children_only, environment_deployment=environment)


def pass_inputs(body: kopf.Body) -> tuple:
    """What of the job's metadata a pass depends on: generation (the spec), labels (copied to pods), whether
    kopf's finalizer is on it (a new job's first pass waits for it) and the annotation that accepts the loss of an
    emptyDir Redis's data (:data:`~rljob_api.constants.ANNOTATION_ALLOW_REDIS_DATA_LOSS`). Its status is the
    operator's own."""
    meta = body.get("metadata") or {}
    labels = tuple(sorted((meta.get("labels") or {}).items()))
    allow = (meta.get("annotations") or {}).get(c.ANNOTATION_ALLOW_REDIS_DATA_LOSS)
    return meta.get("generation"), labels, FINALIZER in (meta.get("finalizers") or ()), allow


@kopf.on.event(*JOBS)
def job_changed(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The job changed: wake its daemon when the change is one a pass depends on (:func:`pass_inputs`). An
    invalid spec is reported in the Valid condition by the pass and is not retried until the spec changes."""
    runtime = memo["jobs"].get(_key(namespace, name))
    if runtime is not None and runtime.seen != pass_inputs(body):
        runtime.wake.set()


@kopf.daemon(*JOBS, cancellation_backoff=10.0, cancellation_timeout=5.0)
async def gang_loop(body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, logger: kopf.Logger,
                    pods_by_job: kopf.Index, redis_by_job: kopf.Index, environment_by_job: kopf.Index,
                    **_: Any) -> None:
    """The job's heartbeat: reconcile, sleep until woken or the interval passes, repeat until deleted."""
    key = _key(body["metadata"]["namespace"], body["metadata"]["name"])
    runtime: JobRuntime = memo["jobs"].setdefault(key, JobRuntime())
    indices = (pods_by_job, redis_by_job, environment_by_job)
    failures = 0
    runtime.looping = True
    waiting_since, prepared = asyncio.get_running_loop().time(), False
    try:
        while not stopped and not memo["closing"].is_set():
            runtime.seen = pass_inputs(body)
            waited = asyncio.get_running_loop().time() - waiting_since
            if not runtime.seen[2] and waited < FINALIZER_WAIT_S:  # a new job: kopf is adding its finalizer
                if not prepared:
                    prepared = True
                    try:
                        await _pass(body, memo, indices, children_only=True)
                    except Exception as err:  # the full pass applies them again and reports the error
                        logger.debug("applying the children early failed: %s", err)
                await _sleep(runtime, stopped, memo["closing"], FINALIZER_WAIT_S - waited)
                continue
            runtime.wake.clear()  # what woke it so far is seen by this pass
            try:
                delay = await _pass(body, memo, indices)
                failures = 0
            except StaleStatus:  # refused with 409: the job changed meanwhile; the next pass reads it fresh
                memo["metrics"].reconcile_errors.labels(kind="StaleStatus").inc()
                delay = 0.5
            except Exception as err:  # keep the loop alive; the error is counted and logged
                if stopped or memo["closing"].is_set():
                    break  # the operator is stopping: requests fail because their session is closing
                memo["metrics"].reconcile_errors.labels(
                    kind=f"http{err.status}" if isinstance(err, ApiError) else type(err).__name__
                ).inc()
                delay = ERROR_BACKOFF_S[min(failures, len(ERROR_BACKOFF_S) - 1)]
                failures += 1
                logger.warning("reconcile failed (retry in %s s): %s", delay, err, exc_info=not isinstance(err, ApiError))
            await _sleep(runtime, stopped, memo["closing"], delay)
    finally:
        runtime.looping = False
        # The runtime (its lock above all) outlives a pause or a restart of this loop; not the job's deletion.
        if stopped.reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in stopped.reason:
            memo["jobs"].pop(key, None)
        meta = body["metadata"]
        await asyncio.shield(redis_reads.release(runtime, memo["context"], meta["namespace"], meta["name"]))
