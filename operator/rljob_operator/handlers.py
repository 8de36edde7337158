"""kopf handlers: tiny, each one parse → reconcile (:mod:`.reconcile`) → report.

- indices ``pods_by_job`` and ``redis_by_job``: child pods and the managed Redis Deployment, keyed by
  (namespace, job-name label), kept current by kopf's watch streams (no API calls per pass);
- ``on.create`` / ``on.update`` / ``on.resume`` of a job: one pass at once;
- a daemon per job: a pass every few seconds (``--active-interval``; ``--idle-interval`` for suspended,
  finished or invalid jobs, or sooner when a deadline or TTL fires), or at once when one of its child pods
  or its Redis Deployment changes (``on.event`` of the children wakes it);
- deletion needs no handler: every child has an owner reference, so the garbage collector removes them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import kopf

from rljob_api import constants as c
from rljob_api import names

from rljob_operator import observe
from rljob_operator.apply import ApiError, kopf_error
from rljob_operator.reconcile import JobRuntime, StaleStatus, reconcile

JOBS = (c.GROUP, c.VERSION, c.PLURAL)
CHILDREN = {c.LABEL_JOB_NAME: kopf.PRESENT}
REDIS = {c.LABEL_JOB_NAME: kopf.PRESENT, c.LABEL_ROLE: c.Role.REDIS.value}
ERROR_BACKOFF_S = (1, 2, 5, 10, 30, 60)


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


@kopf.on.event("v1", "pods", labels=CHILDREN)
@kopf.on.event("apps", "v1", "deployments", labels=REDIS)
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


async def _pass(body: kopf.Body, memo: kopf.Memo, pods_by_job: kopf.Index, redis_by_job: kopf.Index) -> float:
    key = _key(body["metadata"]["namespace"], body["metadata"]["name"])
    runtime: JobRuntime = memo["jobs"].setdefault(key, JobRuntime())
    redis: Optional[observe.DeploymentView] = next(iter(redis_by_job.get(key, [])), None)
    async with runtime.lock:
        with memo["metrics"].reconcile_duration.time():
            return await reconcile(body, list(pods_by_job.get(key, [])), redis, runtime, memo["context"])


@kopf.on.create(*JOBS)
@kopf.on.update(*JOBS)
@kopf.on.resume(*JOBS)
async def job_changed(body: kopf.Body, memo: kopf.Memo, pods_by_job: kopf.Index, redis_by_job: kopf.Index,
                      **_: Any) -> None:
    """The spec or labels changed (or the operator started): one pass now. An invalid spec is reported in
    the Valid condition by the pass itself and is not retried until the spec changes again."""
    try:
        await _pass(body, memo, pods_by_job, redis_by_job)
    except StaleStatus:  # the daemon already moved the job on: let it take the next pass on the fresh object
        runtime = memo["jobs"].get(_key(body["metadata"]["namespace"], body["metadata"]["name"]))
        if runtime is not None:
            runtime.wake.set()
    except ApiError as err:
        memo["metrics"].reconcile_errors.labels(kind=f"http{err.status}").inc()
        raise kopf_error(err) from err


@kopf.daemon(*JOBS, cancellation_backoff=10.0, cancellation_timeout=5.0)
async def gang_loop(body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, logger: kopf.Logger,
                    pods_by_job: kopf.Index, redis_by_job: kopf.Index, **_: Any) -> None:
    """The job's heartbeat: reconcile, sleep until woken or the interval passes, repeat until deleted."""
    key = _key(body["metadata"]["namespace"], body["metadata"]["name"])
    runtime: JobRuntime = memo["jobs"].setdefault(key, JobRuntime())
    failures = 0
    runtime.looping = True
    try:
        while not stopped and not memo["closing"].is_set():
            try:
                delay = await _pass(body, memo, pods_by_job, redis_by_job)
                failures = 0
            except StaleStatus:
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
        await asyncio.shield(runtime.close())
