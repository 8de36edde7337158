"""A queued job's Workload calls (the rules: :mod:`.workload`): read, create, update or replace it before the gang's
plan, and give its quota back or mark it finished after the status write.

Only jobs with a ``kueue.x-k8s.io/queue-name`` label cost API calls here: one LIST of the job's Workloads (its slices,
by its job-name label) per pass, one GET of the WorkloadPriorityClass when the job names one, and one per assigned
ResourceFlavor while admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence

from rljob_api import constants as c
from rljob_api import names
from rljob_api.config import JobConfig
from rljob_api.constants import Phase, Reason

from rljob_operator import environment, render, rollout_scaling, workload
from rljob_operator.kube_api import ApiError, adopt
from rljob_operator.gang import FINISHED, Lifecycle
from rljob_operator.job_status import Event
from rljob_operator.observe import PodView, controller_uid
from rljob_operator.runtime import Context, JobRuntime
from rljob_operator.workload import Decision, Hold

NO_API = (f"the job has label {c.LABEL_KUEUE_QUEUE_NAME} but the cluster serves no {c.KUEUE_API_VERSION} Workload "
          "API: install Kueue (v0.15 or later) with integrations.externalFrameworks [RLTrainingJob.v1alpha1.rljob.dev], "
          "or remove the label; nothing runs until then")


QUOTA_ROLES = (c.Role.TRAINER, c.Role.ROLLOUT, c.Role.ENVIRONMENT)
"""The roles whose pods the job's Workload counts (the managed Redis's are outside it)."""


@dataclass(frozen=True)
class Queued:
    """A queued job's Workload as this pass left it (None: none exists) and what Kueue decided."""

    decision: Decision
    workload: Optional[Mapping[str, Any]] = None
    pending: Optional[Mapping[str, Any]] = None
    """A scale-up slice waiting for Kueue to replace ``workload`` (:func:`.workload.new_slice`)."""
    replaced: Optional[Mapping[str, Any]] = None
    """The slice ``workload`` replaced, not finished yet (:func:`.workload.replaced_patch`)."""

    @property
    def hold(self) -> Optional[Hold]:
        return self.decision.hold

    @property
    def rollouts(self) -> Optional[int]:
        """The rollout pods the admission covers (None: not admitted, the pods do not run)."""
        return workload.rollout_count(self.workload) if self.hold is None and self.workload is not None else None

    @property
    def scale_wait(self) -> Optional[str]:
        """Why the job runs fewer rollout pods than its spec asks (:func:`.workload.scale_wait`), or None."""
        if self.pending is None or self.rollouts is None:
            return None
        return workload.scale_wait(self.workload, self.pending)

    def admit(self, pod: dict[str, Any], role: c.Role) -> dict[str, Any]:
        """``pod`` as the admission places it (:func:`.workload.admitted_pod`)."""
        return workload.admitted_pod(pod, role.value, self.decision)


def wanted(job: render.Job, config: JobConfig, priority: Optional[tuple[str, int]]) -> dict[str, Any]:
    """The Workload the job should have now (:func:`.workload.render` of its rendered pods and environment server)."""
    spec = job.spec
    server = environment.server_of(config)
    rollouts = rollout_scaling.quota_replicas(spec)  # with autoscaling, what the job may grow to
    sets = workload.pod_sets(render.trainer_pod(job, config, 0, 0), spec.trainer.nodes,
                             render.rollout_pod(job, config, 0) if rollouts else None, rollouts,
                             None if server is None else (environment.pod_template(job, server), server.replicas))
    return workload.render(job.name, job.namespace, job.labels, sets, active=not spec.run_policy.suspend,
                           priority=priority)


async def _priority(job: render.Job, ctx: Context) -> tuple[Optional[tuple[str, int]], Optional[Hold]]:
    name = workload.priority_class(job.labels)
    if name is None:
        return None, None
    found = await ctx.api.get(c.KUEUE_API_VERSION, workload.PRIORITY_CLASS_KIND, "", name)
    if found is None:
        return None, Hold(Reason.KUEUE_NOT_AVAILABLE, (
            f"WorkloadPriorityClass {name} (label {c.LABEL_KUEUE_PRIORITY_CLASS}) does not exist; create it or "
            "change the label; nothing runs until then"))
    return (name, int(found.get("value") or 0)), None


async def decide(job: render.Job, config: JobConfig, body: Mapping[str, Any], before: Lifecycle,
                 runtime: JobRuntime, ctx: Context) -> Optional[Queued]:
    """The Workload step before the plan: None for a job with no queue label (its Workloads, if this process made them,
    are deleted); else the job's Workload slices created, resized or replaced as needed (:func:`.workload.resize`),
    and Kueue's decision about the slice the job runs on.

    Raises:
        ApiError: a refused call other than the missing Workload API (which holds the job, reason
            KueueNotAvailable) and Kueue's refusal to shrink a Workload in place (its gate off: the Workload is
            replaced, a Warning Event ElasticJobsOff says so).
    """
    name = names.workload(job.name)
    if workload.queue_name(job.labels) is None:
        if runtime.queued:
            for wl in (await _slices(job, body, ctx))[1].present:
                await _delete(wl, ctx)
            runtime.queued = False
        return None
    runtime.queued = True
    try:
        foreign, found = await _slices(job, body, ctx)
    except ApiError as err:
        if err.status == 404:
            return Queued(Decision(Hold(Reason.KUEUE_NOT_AVAILABLE, NO_API)))
        raise
    if foreign:
        return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION,
                                    f"waiting for Workload {name} of an earlier job of the same name to be deleted")))
    current, pending = found.current, found.pending
    if before.phase in FINISHED:
        if pending is not None:
            await _delete(pending, ctx)
        return Queued(workload.decision(current, {}) if current else Decision(None), current)
    priority, missing = await _priority(job, ctx)
    if missing is not None:
        return Queued(Decision(missing), current)
    want = wanted(job, config, priority)
    for stray in found.others:
        await _delete(stray, ctx)
    if current is None:
        if found.deleting:
            return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION, (
                f"waiting for the job's earlier Workloads ({', '.join(found.deleting)}) to be deleted"))))
        adopt([want], body)
        try:
            current = await ctx.api.create(want) or await ctx.api.get(c.KUEUE_API_VERSION, workload.KIND,
                                                                      job.namespace, name)
        except ApiError as err:
            if err.status == 404:
                return Queued(Decision(Hold(Reason.KUEUE_NOT_AVAILABLE, NO_API)))
            raise
        if current is None:  # deleted again at once
            return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION, f"creating Workload {name}")))
    else:
        step = workload.resize(current, pending, want)
        if step.drop_pending:
            await _delete(pending, ctx)
            pending = None
        if step.shrink is not None:
            try:
                current = await _patch(current, step.shrink, ctx)
            except ApiError as err:
                if "field is immutable" not in err.message:  # Kueue's webhook (403), or its CRD's own rules (422)
                    raise
                step = replace(step, remake=workload.gate_off(current["metadata"]["name"], err.message))
                ctx.post_event(body, Event("Warning", Reason.ELASTIC_JOBS_OFF.value, step.remake))
        if step.remake is not None:
            for wl in found.present:
                await _delete(wl, ctx)
            return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION, step.remake)))
        if step.regrow is not None:
            pending = await _patch(pending, step.regrow, ctx)
        if step.grow is not None:
            adopt([step.grow], body)
            pending = await ctx.api.create(step.grow) or await ctx.api.get(
                c.KUEUE_API_VERSION, workload.KIND, job.namespace, step.grow["metadata"]["name"])
        current = await _follow_spec(current, want, ctx)
        if pending is not None:
            pending = await _follow_spec(pending, want, ctx)
    flavors = {}
    for flavor in workload.flavors_of(current):
        flavors[flavor] = await ctx.api.get(c.KUEUE_API_VERSION, workload.FLAVOR_KIND, "", flavor) or {}
    return Queued(workload.decision(current, flavors), current, pending, found.replaced)


async def _slices(job: render.Job, body: Mapping[str, Any],
                  ctx: Context) -> tuple[bool, workload.Slices]:
    """Whether a Workload of the job's name belongs to an earlier job of that name, and the job's own slices.

    Raises:
        ApiError: the list is refused (404: no Workload API).
    """
    listed = await ctx.api.list(c.KUEUE_API_VERSION, workload.KIND, job.namespace,
                                label_selector=f"{c.LABEL_JOB_NAME}={names.job_label(job.name)}")
    uid = body["metadata"].get("uid")
    foreign = any(w["metadata"]["name"] == names.workload(job.name) and controller_uid(w) != uid for w in listed)
    return foreign, workload.slices(w for w in listed if controller_uid(w) == uid)


async def _delete(wl: Mapping[str, Any], ctx: Context) -> None:
    meta = wl["metadata"]
    await ctx.api.delete(c.KUEUE_API_VERSION, workload.KIND, meta["namespace"], meta["name"], uid=meta.get("uid"))


async def _patch(wl: Mapping[str, Any], patch: Mapping[str, Any], ctx: Context,
                 subresource: Optional[str] = None) -> dict[str, Any]:
    """``wl`` merge-patched, refused with 409 when it changed since it was read."""
    meta = wl["metadata"]
    return await ctx.api.patch(c.KUEUE_API_VERSION, workload.KIND, meta["namespace"], meta["name"], patch,
                               subresource=subresource, resource_version=meta.get("resourceVersion"))


async def _follow_spec(wl: Mapping[str, Any], want: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    """``wl`` with the queue, activity and priority of ``want`` (:func:`.workload.spec_patch`)."""
    patch = workload.spec_patch(wl, want)
    return wl if patch is None else await _patch(wl, patch, ctx)


async def follow_up(queued: Optional[Queued], phase: Phase, message: str, pods: Sequence[PodView],
                    ctx: Context, now: datetime) -> None:
    """After the status write: an evicted Workload's quota is given back once no trainer, rollout or environment server
    pod of the job is left (:func:`.workload.release_patch`); a finished job's Workload is marked Finished with
    ``message``; a slice Kueue left unfinished after admitting its replacement is finished
    (:func:`.workload.replaced_patch`).

    Raises:
        ApiError: a refused patch (a 409 — Kueue wrote meanwhile — is left for the next pass).
    """
    if queued is None or queued.workload is None:
        return
    wl = queued.workload
    patches = []
    if phase in FINISHED and not queued.decision.finished:
        patches.append((wl, workload.finish_patch(wl, phase == Phase.SUCCEEDED, message, now)))
    elif queued.decision.release and not any(p.role in QUOTA_ROLES for p in pods):
        patches.append((wl, workload.release_patch(wl, now)))
    if queued.replaced is not None:
        patches.append((queued.replaced, workload.replaced_patch(queued.replaced, wl, now)))
    for target, patch in patches:
        if patch is None:
            continue
        try:
            await _patch(target, patch, ctx, subresource="status")
        except ApiError as err:
            if err.status != 409:
                raise
