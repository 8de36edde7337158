"""A queued job's Workload calls (the rules: :mod:`.workload`): read, create, update or replace it before the gang's
plan, and give its quota back or mark it finished after the status write.

Only jobs with a ``kueue.x-k8s.io/queue-name`` label cost API calls here: one GET of the Workload per pass, one of the
WorkloadPriorityClass when the job names one, and one per assigned ResourceFlavor while admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence

from rljob_api import constants as c
from rljob_api import names
from rljob_api.config import JobConfig
from rljob_api.constants import Phase, Reason

from rljob_operator import render, workload
from rljob_operator.kube_api import ApiError, adopt
from rljob_operator.gang import FINISHED, Lifecycle
from rljob_operator.observe import PodView, controller_uid
from rljob_operator.runtime import Context, JobRuntime
from rljob_operator.workload import Decision, Hold

NO_API = (f"the job has label {c.LABEL_KUEUE_QUEUE_NAME} but the cluster serves no {c.KUEUE_API_VERSION} Workload "
          "API: install Kueue (v0.15 or later) with integrations.externalFrameworks [RLTrainingJob.v1alpha1.rljob.dev], "
          "or remove the label; nothing runs until then")


@dataclass(frozen=True)
class Queued:
    """A queued job's Workload as this pass left it (None: none exists) and what Kueue decided."""

    decision: Decision
    workload: Optional[Mapping[str, Any]] = None

    @property
    def hold(self) -> Optional[Hold]:
        return self.decision.hold

    def admit(self, pod: dict[str, Any], role: c.Role) -> dict[str, Any]:
        """``pod`` as the admission places it (:func:`.workload.admitted_pod`)."""
        return workload.admitted_pod(pod, role.value, self.decision)


def wanted(job: render.Job, config: JobConfig, priority: Optional[tuple[str, int]]) -> dict[str, Any]:
    """The Workload the job should have now (:func:`.workload.render` of its rendered pods)."""
    spec = job.spec
    sets = workload.pod_sets(render.trainer_pod(job, config, 0, 0), spec.trainer.nodes,
                             render.rollout_pod(job, config, 0) if spec.rollout.replicas else None,
                             spec.rollout.replicas)
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
    """The Workload step before the plan: None for a job with no queue label (its Workload, if this process made one,
    is deleted); else the job's Workload created, updated or replaced as needed, and Kueue's decision.

    Raises:
        ApiError: a refused call other than the missing Workload API (which holds the job, reason
            KueueNotAvailable).
    """
    name = names.workload(job.name)
    if workload.queue_name(job.labels) is None:
        if runtime.queued:
            await ctx.api.delete(c.KUEUE_API_VERSION, workload.KIND, job.namespace, name)
            runtime.queued = False
        return None
    runtime.queued = True
    finished = before.phase in FINISHED
    existing = await ctx.api.get(c.KUEUE_API_VERSION, workload.KIND, job.namespace, name)
    if existing is not None and controller_uid(existing) != body["metadata"].get("uid"):
        return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION,
                                    f"waiting for Workload {name} of an earlier job of the same name to be deleted")))
    if finished:
        return Queued(workload.decision(existing, {}) if existing else Decision(None), existing)
    priority, missing = await _priority(job, ctx)
    if missing is not None:
        return Queued(Decision(missing), existing)
    want = wanted(job, config, priority)
    if existing is not None and workload.outdated(existing, want):
        await ctx.api.delete(c.KUEUE_API_VERSION, workload.KIND, job.namespace, name,
                             uid=existing["metadata"].get("uid"))
        return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION, (
            f"the job's pod sets changed, so its Workload {name} (immutable once queued) is replaced and the job "
            "queues again"))))
    if existing is None:
        adopt([want], body)
        try:
            existing = await ctx.api.create(want) or await ctx.api.get(c.KUEUE_API_VERSION, workload.KIND,
                                                                       job.namespace, name)
        except ApiError as err:
            if err.status == 404:
                return Queued(Decision(Hold(Reason.KUEUE_NOT_AVAILABLE, NO_API)))
            raise
        if existing is None:  # deleted again at once
            return Queued(Decision(Hold(Reason.WAITING_FOR_ADMISSION, f"creating Workload {name}")))
    elif (patch := workload.spec_patch(existing, want)) is not None:
        existing = await ctx.api.patch(c.KUEUE_API_VERSION, workload.KIND, job.namespace, name, patch,
                                       resource_version=existing["metadata"].get("resourceVersion"))
    flavors = {}
    for flavor in workload.flavors_of(existing):
        flavors[flavor] = await ctx.api.get(c.KUEUE_API_VERSION, workload.FLAVOR_KIND, "", flavor) or {}
    return Queued(workload.decision(existing, flavors), existing)


async def follow_up(queued: Optional[Queued], phase: Phase, message: str, pods: Sequence[PodView],
                    ctx: Context, now: datetime) -> None:
    """After the status write: an evicted Workload's quota is given back once no trainer or rollout pod of the job is
    left (:func:`.workload.release_patch`); a finished job's Workload is marked Finished with ``message``.

    Raises:
        ApiError: a refused patch (a 409 — Kueue wrote meanwhile — is left for the next pass).
    """
    if queued is None or queued.workload is None:
        return
    wl = queued.workload
    meta = wl["metadata"]
    patch = None
    if phase in FINISHED and not queued.decision.finished:
        patch = workload.finish_patch(wl, phase == Phase.SUCCEEDED, message, now)
    elif queued.decision.release and not any(p.role in (c.Role.TRAINER, c.Role.ROLLOUT) for p in pods):
        patch = workload.release_patch(wl, now)
    if patch is None:
        return
    try:
        await ctx.api.patch(c.KUEUE_API_VERSION, workload.KIND, meta["namespace"], meta["name"], patch,
                            subresource="status", resource_version=meta.get("resourceVersion"))
    except ApiError as err:
        if err.status != 409:
            raise
