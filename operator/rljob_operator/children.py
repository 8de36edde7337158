"""What a pass writes besides the job's status: the static children (applied only when their rendering changed,
:mod:`.applied`), the create-only children of the managed Redis (its password Secret, and with persistence its data
claim, which is deleted when persistence is switched off), the environment server's Deployment (:mod:`.environment`,
after the pass's plan: its replicas follow the job's phase) and pods (create-only; an existing pod must be of the same
attempt and job). Calls of one kind run concurrently (:func:`gather`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional

from rljob_api import constants as c, names
from rljob_api.canonical import canonical_hash
from rljob_api.config import JobConfig

from rljob_operator import applied_hash, environment, render
from rljob_operator.kube_api import ApiError, adopt
from rljob_operator.observe import controller_uid, pod_view
from rljob_operator.runtime import Context, JobRuntime


async def apply_static(job: render.Job, config: JobConfig, generation: Optional[int], body: Mapping[str, Any],
                       runtime: JobRuntime, ctx: Context) -> None:
    """Apply the static children (and create the managed Redis Secret and data claim) that are not as rendered,
    concurrently; with a managed Redis whose ``config`` has no persistence, delete a data claim of this job that
    an earlier persistent config made (re-enabling persistence later must start from an empty claim, not from a
    stale stream).

    A job this process has not applied yet but that has a status (reconciled before, by this process or an earlier
    one) may have every child in place already: they are read first (GET) and only the missing, changed or edited
    ones applied (:func:`~rljob_operator.applied.outdated`), so an operator restart writes nothing for an idle job.
    A new job's children are applied at once (no read before its first write). ``generation``: the job's, recorded
    on the config ConfigMap with ``config`` (:mod:`.resolution`).

    Raises:
        ApiError: a refused call; 409 when the Secret or claim exists but belongs to an earlier job of the same name.
    """
    children = render.static_children(job, config, generation) + environment.static_children(job, config)
    adopt(children, body)
    children = [applied_hash.stamp(child) for child in children]
    claim = render.redis_claim(job, config)
    digest = canonical_hash([children, claim])
    if runtime.applied == digest:
        return
    known = bool(body.get("status"))
    managed = config.spec.redis.mode == "managed"
    secret = render.redis_secret(job, secrets.token_urlsafe(32)) if managed else None
    existing: dict[str, Optional[Mapping[str, Any]]] = {}
    if known:
        reads = [_read(child, ctx) for child in children]
        if managed:
            reads.append(ctx.api.get("v1", "Secret", job.namespace, names.redis_secret(job.name)))
            reads.append(ctx.api.get("v1", "PersistentVolumeClaim", job.namespace, names.redis_claim(job.name)))
        found = await gather(reads)
        stale = [child for child, live in zip(children, found) if applied_hash.outdated(live, child)]
        if managed:
            existing = {"Secret": found[-2], "PersistentVolumeClaim": found[-1]}
    else:
        stale = children
    writes = [ctx.api.apply(child) for child in stale]
    if secret is not None:
        writes.append(_ensure_created(secret, existing.get("Secret"), body, ctx))
    if claim is not None:
        writes.append(_ensure_created(claim, existing.get("PersistentVolumeClaim"), body, ctx))
    elif (old := existing.get("PersistentVolumeClaim")) is not None and controller_uid(old) == body["metadata"].get("uid"):
        writes.append(ctx.api.delete("v1", "PersistentVolumeClaim", job.namespace, names.redis_claim(job.name),
                                     uid=old["metadata"].get("uid")))
    await gather(writes)
    runtime.applied = digest


def _read(child: Mapping[str, Any], ctx: Context) -> Awaitable[Optional[dict[str, Any]]]:
    """The GET of ``child`` as the API server holds it (None when missing)."""
    meta = child["metadata"]
    return ctx.api.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])


async def apply_environment(job: render.Job, config: JobConfig, replicas: int,
                            place: Optional[Callable[[dict[str, Any]], dict[str, Any]]], present: bool,
                            body: Mapping[str, Any], runtime: JobRuntime, ctx: Context) -> Optional[ApiError]:
    """Apply the environment server's Deployment of ``config`` with ``replicas`` pods (:func:`.environment.replicas`),
    its pod template passed through ``place`` (a queued job's Kueue admission: node labels and tolerations of the
    assigned flavor; None: as rendered), when it is not as rendered (:attr:`JobRuntime.environment_applied`; a job
    reconciled before is read first, as :func:`apply_static` does). Without a server in ``config``, delete the
    environment's children when the job had them (``present``: its Deployment is observed). Returns the refused
    call's error (the pass reports it after the status write, as a refused pod), None otherwise."""
    server = environment.server_of(config)
    try:
        if server is None:
            if present:
                await gather(ctx.api.delete(api_version, kind, job.namespace, names.environment(job.name))
                             for api_version, kind in environment.KINDS)
            runtime.environment_applied = None
            return None
        template = environment.pod_template(job, server)
        manifest = environment.deployment(job, server, replicas, template if place is None else place(template))
        adopt([manifest], body)
        digest = applied_hash.stamp(manifest)["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH]
        if runtime.environment_applied == digest:
            return None
        if runtime.environment_applied is not None or not body.get("status") or applied_hash.outdated(
                await _read(manifest, ctx), manifest):
            await ctx.api.apply(manifest)
    except ApiError as err:
        return err
    runtime.environment_applied = digest
    return None


async def stop_environment(job_name: str, namespace: str, runtime: JobRuntime, ctx: Context) -> None:
    """Scale the environment server's Deployment to 0 (a job with no valid spec to render it from: nothing of it
    runs); the next pass that renders it applies it again."""
    await ctx.api.patch("apps/v1", "Deployment", namespace, names.environment(job_name), {"spec": {"replicas": 0}})
    runtime.environment_applied = None


async def _ensure_created(obj: dict[str, Any], existing: Optional[Mapping[str, Any]], owner: Mapping[str, Any],
                          ctx: Context) -> None:
    """Create ``obj`` (the managed Redis Secret or data claim) unless it exists (``existing``: as read already, or
    None); an existing one must be this job's (409 otherwise: an earlier job of the same name still owns it)."""
    meta = obj["metadata"]
    if existing is None:
        adopt([obj], owner)
        if await ctx.api.create(obj) is not None:
            return
        existing = await ctx.api.get(obj["apiVersion"], obj["kind"], owner["metadata"]["namespace"], meta["name"])
    if existing is not None and controller_uid(existing) != owner["metadata"].get("uid"):
        raise ApiError(409, "Conflict", f"{obj['kind']} {meta['name']} of an earlier job of the same "
                       "name still exists", f"create {obj['kind']}")


async def gather(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await ``calls`` concurrently; once every one has ended, raise the first error in call order (if any)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def create_pod(manifest: dict[str, Any], owner: Mapping[str, Any], runtime: JobRuntime, ctx: Context) -> None:
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


async def create_pods(manifests: Iterable[dict[str, Any]], owner: Mapping[str, Any], runtime: JobRuntime,
                      ctx: Context) -> Optional[ApiError]:
    """Create ``manifests`` concurrently (:func:`create_pod`); the first refused call's error, or None when every
    pod exists now. The error is returned, not raised, so that the pass still writes the job's status before it is
    reported."""
    try:
        await gather(create_pod(manifest, owner, runtime, ctx) for manifest in manifests)
    except ApiError as err:
        return err
    return None


async def delete_pods(namespace: str, pods: Iterable[tuple[str, str]], runtime: JobRuntime, ctx: Context) -> None:
    """Delete the (name, uid) ``pods`` concurrently, each only if it is still that object (uid precondition; an
    empty uid deletes by name); those deleted count as deleting until the watch shows it (:attr:`JobRuntime.deleted`).
    """
    pods = list(pods)
    gone = await gather(ctx.api.delete("v1", "Pod", namespace, name, uid=uid or None) for name, uid in pods)
    runtime.deleted.update({name: uid for (name, uid), deleted in zip(pods, gone) if deleted})
