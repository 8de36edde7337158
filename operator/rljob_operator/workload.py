"""Pure: a queued RLTrainingJob's Kueue Workload — what it is, what Kueue decided about it, and what that does to the
job's pods (DESIGN §7 "Kueue").

A job with the label ``kueue.x-k8s.io/queue-name: Q`` is one Kueue workload, as Kueue's external-framework contract
has it (Kueue's Configuration ``integrations.externalFrameworks: [RLTrainingJob.v1alpha1.rljob.dev]``): the operator
creates and owns the Workload ``<job>-workload`` (kueue.x-k8s.io/v1beta2) in LocalQueue Q with

- pod set ``trainer`` (count ``spec.trainer.nodes``), pod set ``rollout`` (count ``spec.rollout.replicas``, with
  autoscaling its ``maxReplicas``; left out of a trainer-only job) and, for a job whose environment server the operator runs, pod set ``environment``
  (count ``spec.rollout.environment.server.replicas``), their templates stripped to what Kueue reads for quota and
  flavor fit (containers' names and resources, node selector, tolerations, affinity, priority class, runtime class,
  overhead, scheduler). The managed Redis is not in it: small, CPU-only, and kept through evictions so that the stream
  survives;
- the priority of the WorkloadPriorityClass named by the job's ``kueue.x-k8s.io/priority-class`` label;
- ``spec.active`` false while ``runPolicy.suspend`` is true (Kueue then evicts it and releases the quota).

Kueue decides; the operator follows (:func:`decision`):

- not admitted: no trainer, rollout or environment server pod exists (those of an earlier admission are deleted, the
  environment server's Deployment scaled to 0); phase Pending with reason WaitingForAdmission quoting Kueue's
  QuotaReserved condition;
- admitted: the pods start, each with the node labels and tolerations of the ResourceFlavors its pod set was
  assigned (and the admission checks' pod set updates) merged into it (:func:`admitted_pod`; for the environment
  server, into its Deployment's pod template);
- evicted (preempted, its ClusterQueue stopped, deactivated, ...): every trainer and rollout pod is deleted as by a
  suspend — not counted against ``backoffLimit``, ``runPolicy.suspend`` untouched — and the environment server scaled
  to 0; once none of those pods is left the operator gives the quota back (:func:`release_patch`, what Kueue's own job
  reconciler writes); Kueue requeues it;
- finished (Succeeded or Failed): the Workload is marked Finished (:func:`finish_patch`), which frees its quota.

Every Workload is elastic (annotation ``kueue.x-k8s.io/elastic-job: "true"``, Kueue's workload slices, behind its
alpha feature gate ElasticJobsViaWorkloadSlices), so that a change of the rollout pod set's count alone (``kubectl
scale``, an HPA or KEDA through ``/scale``) restarts nothing (:func:`resize`):

- a decrease lowers the count of the admitted Workload in place (Kueue's webhook allows it with the gate on); the
  surplus rollout pods go;
- an increase creates a new slice ``<job>-workload-<hash>`` annotated as the replacement for the admitted one
  (:func:`new_slice`): Kueue counts only the difference against the quota, and when it admits the new slice it
  finishes the old one (reason WorkloadSliceReplaced). Until then the job runs on the old slice's count
  (:func:`scale_wait` says why); the extra rollout pods start once the new slice is admitted;
- a Workload not admitted yet, and every other change of the pod sets (a template, the trainer's nodes, the environment
  server), is deleted and made again: its pods go, and the job queues anew.

The job's Workloads are found by its job-name label and controller reference (:func:`slices`); finished slices stay
until the job is deleted (owner references).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Mapping, Optional

from rljob_api import constants as c
from rljob_api import names
from rljob_api.canonical import canonical_hash
from rljob_api.constants import Reason
from rljob_api.validation import SpecProblem

KIND = "Workload"
FLAVOR_KIND = "ResourceFlavor"
PRIORITY_CLASS_KIND = "WorkloadPriorityClass"
TRAINER_POD_SET = c.Role.TRAINER.value
ROLLOUT_POD_SET = c.Role.ROLLOUT.value
ENVIRONMENT_POD_SET = c.Role.ENVIRONMENT.value

QUOTA_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName", "overhead",
                "schedulerName")
"""Pod spec fields a pod set's template keeps (besides the containers' names and resources, and a native sidecar's
restartPolicy): what Kueue reads to count quota and fit flavors. Nothing else, so that an edit Kueue would not see
(an image, the sampling) does not replace the Workload and requeue the job."""
CONTAINER_FIELDS = ("name", "resources", "restartPolicy")

# Workload condition types and eviction reasons (kueue.x-k8s.io/v1beta2).
ADMITTED = "Admitted"
QUOTA_RESERVED = "QuotaReserved"
EVICTED = "Evicted"
FINISHED = "Finished"
REQUEUED = "Requeued"
INADMISSIBLE = "Inadmissible"
"""Kueue's QuotaReserved=False reason for a Workload it cannot queue: its LocalQueue or ClusterQueue does not exist or
is stopped (the message says which), or its resource claims cannot be counted."""
REQUEUED_REASONS = ("Preempted", "NodeFailures")
"""Eviction reasons after which Kueue's own job reconciler marks a Workload Requeued=True."""
ELASTIC_JOB = "kueue.x-k8s.io/elastic-job"
"""Kueue's annotation (value ``"true"``) of an elastic Workload: with Kueue's feature gate ElasticJobsViaWorkloadSlices
on, its pod set counts may be lowered while admitted, and a replacement slice raises them."""
SLICE_REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"
"""On a new Workload slice: ``<namespace>/<name>`` of the admitted slice it replaces once Kueue admits it."""
SLICE_REPLACED = "WorkloadSliceReplaced"
"""Kueue's Finished reason of a slice its replacement took over."""
ELASTIC_GATE = "ElasticJobsViaWorkloadSlices"
GATE_OFF_AFTER_S = 10.0
"""Seconds a replacement slice may hold quota while the slice it replaces is not finished before the operator finishes
that one itself: with the gate on Kueue finishes it at admission; with the gate off Kueue admitted the new slice in
full and never will."""


_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""A lowercase RFC 1123 subdomain, the name of a LocalQueue or WorkloadPriorityClass: what Kueue's webhooks require of
the value of a queue-name label."""
_LABELS = {c.LABEL_KUEUE_QUEUE_NAME: ("LocalQueue", " in namespace {namespace}", "to run the job without Kueue"),
           c.LABEL_KUEUE_PRIORITY_CLASS: ("WorkloadPriorityClass", "", "for the default priority")}
"""Kueue's labels on a job: (kind of the object the value names, where it lives, what removing the label does)."""


def label_problems(labels: Mapping[str, str], namespace: str) -> list[SpecProblem]:
    """Kueue labels of a job in ``namespace`` whose value names no object: empty (the job would silently run unqueued,
    or without its priority) or not a lowercase RFC 1123 subdomain."""
    problems = []
    for label, (kind, where, unset) in _LABELS.items():
        value = labels.get(label)
        if value is None:
            continue
        fix = f"set it to the name of a {kind}{where.format(namespace=namespace)}, or remove the label {unset}"
        if not value:
            problems.append(SpecProblem(f"metadata.labels[{label}]", f"is empty, which names no {kind}: {fix}"))
        elif len(value) > 253 or not _OBJECT_NAME.match(value):
            problems.append(SpecProblem(f"metadata.labels[{label}]", (
                f"{value!r} is not a {kind} name (lowercase letters, digits, '-' and '.', starting and ending with a "
                f"letter or digit): {fix}")))
    return problems


def queue_name(labels: Mapping[str, str]) -> Optional[str]:
    """The LocalQueue a job asks for (its ``kueue.x-k8s.io/queue-name`` label), or None: not queued."""
    return labels.get(c.LABEL_KUEUE_QUEUE_NAME) or None


def priority_class(labels: Mapping[str, str]) -> Optional[str]:
    """The WorkloadPriorityClass a queued job names (label ``kueue.x-k8s.io/priority-class``), or None."""
    return labels.get(c.LABEL_KUEUE_PRIORITY_CLASS) or None


def _stripped(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A pod manifest as a pod set template: the fields of :data:`QUOTA_FIELDS` and the containers' of
    :data:`CONTAINER_FIELDS`."""
    spec = pod["spec"]
    kept: dict[str, Any] = {key: spec[key] for key in QUOTA_FIELDS if key in spec}
    for key in ("initContainers", "containers"):
        if spec.get(key):
            kept[key] = [{f: ct[f] for f in CONTAINER_FIELDS if f in ct} for ct in spec[key]]
    return {"spec": kept}


def pod_sets(trainer: Mapping[str, Any], nodes: int, rollout: Optional[Mapping[str, Any]], replicas: int,
             environment: Optional[tuple[Mapping[str, Any], int]] = None) -> list[dict[str, Any]]:
    """The Workload's pod sets: ``nodes`` pods like the trainer manifest ``trainer``, ``replicas`` like ``rollout``
    (none when 0), and with an environment server (``environment``: its pod template and replicas) that many like
    it."""
    sets = [{"name": TRAINER_POD_SET, "count": nodes, "template": _stripped(trainer)}]
    if replicas > 0 and rollout is not None:
        sets.append({"name": ROLLOUT_POD_SET, "count": replicas, "template": _stripped(rollout)})
    if environment is not None and environment[1] > 0:
        sets.append({"name": ENVIRONMENT_POD_SET, "count": environment[1], "template": _stripped(environment[0])})
    return sets


def render(job: str, namespace: str, labels: Mapping[str, str], sets: list[dict[str, Any]], *, active: bool,
           priority: Optional[tuple[str, int]] = None) -> dict[str, Any]:
    """The Workload of job ``job`` (owner reference added by the caller) in the queue of ``labels``; ``priority``:
    (WorkloadPriorityClass name, its value) or None.

    Raises:
        ValueError: ``labels`` name no queue.
    """
    queue = queue_name(labels)
    if queue is None:
        raise ValueError(f"job {job} has no {c.LABEL_KUEUE_QUEUE_NAME} label")
    spec: dict[str, Any] = {"queueName": queue, "podSets": sets, "active": active}
    if priority is not None:
        spec["priorityClassRef"] = {"group": c.KUEUE_GROUP, "kind": PRIORITY_CLASS_KIND, "name": priority[0]}
        spec["priority"] = priority[1]
    return {
        "apiVersion": c.KUEUE_API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": names.workload(job),
            "namespace": namespace,
            "labels": {c.LABEL_JOB_NAME: names.job_label(job), "app.kubernetes.io/managed-by": c.FIELD_MANAGER},
            "annotations": {c.ANNOTATION_WORKLOAD_PODSETS_HASH: canonical_hash(sets, digits=16),
                            c.ANNOTATION_WORKLOAD_SHAPE_HASH: _shape_hash(sets), ELASTIC_JOB: "true"},
        },
        "spec": spec,
    }


def _shape_hash(sets: list[Mapping[str, Any]]) -> str:
    """The hash of pod sets with the rollout pod set's count left out: equal for Workloads that differ in it alone."""
    return canonical_hash([{key: value for key, value in s.items() if (s["name"], key) != (ROLLOUT_POD_SET, "count")}
                           for s in sets], digits=16)


def _annotation(workload: Mapping[str, Any], key: str) -> Optional[str]:
    return ((workload.get("metadata") or {}).get("annotations") or {}).get(key)


def _key(workload: Mapping[str, Any]) -> str:
    """``<namespace>/<name>``: how Kueue names a Workload in :data:`SLICE_REPLACEMENT_FOR`."""
    return f"{workload['metadata'].get('namespace')}/{workload['metadata']['name']}"


def rollout_count(workload: Mapping[str, Any]) -> int:
    """The count of a Workload's rollout pod set (0: it has none)."""
    return next((s["count"] for s in workload["spec"]["podSets"] if s["name"] == ROLLOUT_POD_SET), 0)


def _condition(workload: Mapping[str, Any], ctype: str) -> Optional[Mapping[str, Any]]:
    for cond in (workload.get("status") or {}).get("conditions") or ():
        if cond.get("type") == ctype:
            return cond
    return None


def _true(workload: Mapping[str, Any], ctype: str) -> bool:
    cond = _condition(workload, ctype)
    return cond is not None and cond.get("status") == "True"


@dataclass(frozen=True)
class Hold:
    """Why a queued job's pods may not run now (phase Pending with ``reason``; ``message`` quotes Kueue)."""

    reason: Reason
    message: str


@dataclass(frozen=True)
class Decision:
    """What Kueue decided about a job's Workload, for one pass.

    ``hold``: the pods may not run (None: admitted); ``assignments``: {pod set: (node labels, tolerations)} of an
    admitted Workload; ``release``: evicted with its quota still reserved — give it back once no pod is left;
    ``finished``: Kueue already counts it finished.
    """

    hold: Optional[Hold]
    assignments: Mapping[str, tuple[Mapping[str, str], tuple[Mapping[str, Any], ...]]] = None
    release: bool = False
    finished: bool = False


def flavors_of(workload: Mapping[str, Any]) -> list[str]:
    """The ResourceFlavors an admitted Workload was assigned (sorted, each once)."""
    admission = (workload.get("status") or {}).get("admission") or {}
    found = {flavor for assignment in admission.get("podSetAssignments") or ()
             for flavor in (assignment.get("flavors") or {}).values()}
    return sorted(found)


def decision(workload: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]]) -> Decision:
    """What ``workload`` (as read) lets the job run; ``flavors``: {name: ResourceFlavor} of :func:`flavors_of`."""
    name = workload["metadata"]["name"]
    queue = workload["spec"].get("queueName")
    finished = _true(workload, FINISHED)
    reserved = _true(workload, QUOTA_RESERVED) and (workload.get("status") or {}).get("admission") is not None
    if _true(workload, EVICTED):
        cond = _condition(workload, EVICTED)
        return Decision(Hold(Reason.EVICTED_BY_KUEUE, (
            f"Kueue evicted Workload {name} ({cond.get('reason')}: {cond.get('message')}); its trainer and rollout "
            "pods are deleted as by a suspend (not counted against backoffLimit) and the job waits to be admitted "
            "again")), release=reserved, finished=finished)
    if _true(workload, ADMITTED) and reserved:
        return Decision(None, assignments=_assignments(workload, flavors), finished=finished)
    cond, said = _waiting(workload)
    if workload["spec"].get("active") is False:
        said = "inactive while runPolicy.suspend is true"
    elif cond is not None and cond.get("type") == QUOTA_RESERVED and cond.get("reason") == INADMISSIBLE:
        namespace = workload["metadata"].get("namespace")
        return Decision(Hold(Reason.KUEUE_INADMISSIBLE, (
            f"Kueue cannot admit Workload {name} in LocalQueue {queue} of namespace {namespace}: {said}; create or "
            f"start the queue (kubectl get localqueue -n {namespace}), or change the job's label "
            f"{c.LABEL_KUEUE_QUEUE_NAME}; nothing runs until then")), finished=finished)
    return Decision(Hold(Reason.WAITING_FOR_ADMISSION,
                         f"waiting for Kueue to admit Workload {name} in LocalQueue {queue}: {said}"), finished=finished)


def _waiting(workload: Mapping[str, Any]) -> tuple[Optional[Mapping[str, Any]], str]:
    """The condition that keeps a Workload from being admitted (QuotaReserved, else Admitted) and Kueue's words."""
    cond = _condition(workload, QUOTA_RESERVED) if not _true(workload, QUOTA_RESERVED) else _condition(workload, ADMITTED)
    said = f"{cond.get('type')}={cond.get('status')} ({cond.get('reason')}): {cond.get('message')}" if cond else \
        "Kueue has not looked at it yet"
    return cond, said


def _assignments(workload: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]]):
    """{pod set: (node selector, tolerations)} from the admission's flavors and the admission checks' updates."""
    status = workload.get("status") or {}
    out: dict[str, tuple[dict[str, str], tuple[Mapping[str, Any], ...]]] = {}
    for assignment in (status.get("admission") or {}).get("podSetAssignments") or ():
        selector: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        for flavor_name in sorted(set((assignment.get("flavors") or {}).values())):
            flavor_spec = (flavors.get(flavor_name) or {}).get("spec") or {}
            selector.update(flavor_spec.get("nodeLabels") or {})
            tolerations += [t for t in flavor_spec.get("tolerations") or () if t not in tolerations]
        for check in status.get("admissionChecks") or ():
            for update in check.get("podSetUpdates") or ():
                if update.get("name") == assignment.get("name"):
                    selector.update(update.get("nodeSelector") or {})
                    tolerations += [t for t in update.get("tolerations") or () if t not in tolerations]
        out[assignment["name"]] = (selector, tuple(tolerations))
    return out


def admitted_pod(pod: dict[str, Any], pod_set: str, decided: Decision) -> dict[str, Any]:
    """``pod`` with the node selector and tolerations Kueue's admission gave ``pod_set`` merged in (the flavor's node
    labels win over the spec's for the same key: Kueue only assigns flavors that fit the spec's selector)."""
    selector, tolerations = (decided.assignments or {}).get(pod_set, ({}, ()))
    if not selector and not tolerations:
        return pod
    spec = dict(pod["spec"])
    if selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **selector}
    if tolerations:
        own = list(spec.get("tolerations") or [])
        spec["tolerations"] = own + [dict(t) for t in tolerations if t not in own]
    return {**pod, "spec": spec}


def outdated(workload: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether the Workload's pod sets differ from the ``wanted`` rendering's (compared by their hash annotation)."""
    return _hash(workload) != _hash(wanted)


def spec_patch(workload: Mapping[str, Any], wanted: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """A merge patch of the mutable fields the operator owns (queue, active, priority) when they differ, else None.
    The queue is changed only while no quota is reserved (Kueue refuses it otherwise)."""
    have, want = workload["spec"], wanted["spec"]
    patch: dict[str, Any] = {}
    for key in ("active", "priority", "priorityClassRef"):
        if have.get(key) != want.get(key):
            patch[key] = want.get(key)
    if have.get("queueName") != want["queueName"] and not _true(workload, QUOTA_RESERVED):
        patch["queueName"] = want["queueName"]
    return {"spec": patch} if patch else None


def _set(conditions: Iterable[Mapping[str, Any]], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``conditions`` with ``new`` in place of the one of its type; lastTransitionTime kept while the status is."""
    out, found = [], False
    for cond in conditions:
        if cond.get("type") == new["type"]:
            found = True
            same = cond.get("status") == new["status"]
            out.append({**new, "lastTransitionTime": cond["lastTransitionTime"] if same else new["lastTransitionTime"]})
        else:
            out.append(dict(cond))
    if not found:
        out.append(dict(new))
    return out


def _cond(workload: Mapping[str, Any], ctype: str, status: bool, reason: str, message: str, now: datetime):
    return {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message[:32768],
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": workload["metadata"].get("generation", 0)}


def release_patch(workload: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The status (merge patch of the ``status`` subresource) giving an evicted Workload's quota back once the job's
    pods are gone, as Kueue's job reconciler writes it: Requeued (True after a preemption or node failures),
    QuotaReserved=False (reason Pending, the eviction's message), Admitted=False (NoReservation), no admission."""
    evicted = _condition(workload, EVICTED) or {}
    reason, message = evicted.get("reason", "Evicted"), evicted.get("message", "evicted")
    conditions = (workload.get("status") or {}).get("conditions") or []
    conditions = _set(conditions, _cond(workload, REQUEUED, reason in REQUEUED_REASONS, reason, message, now))
    conditions = _set(conditions, _cond(workload, QUOTA_RESERVED, False, "Pending", message, now))
    if _true(workload, ADMITTED):
        conditions = _set(conditions, _cond(workload, ADMITTED, False, "NoReservation",
                                            "The workload has no reservation", now))
    return {"status": {"conditions": conditions, "admission": None}}


def finish_patch(workload: Mapping[str, Any], succeeded: bool, message: str, now: datetime) -> dict[str, Any]:
    """The status (merge patch) marking the Workload Finished (reason Succeeded or Failed): Kueue frees its quota."""
    return _finished(workload, "Succeeded" if succeeded else "Failed", message, now)


def _finished(workload: Mapping[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    conditions = (workload.get("status") or {}).get("conditions") or []
    return {"status": {"conditions": _set(conditions, _cond(workload, FINISHED, True, reason, message, now))}}


@dataclass(frozen=True)
class Slices:
    """A job's Workloads as slices (:func:`slices`).

    ``current``: the slice the job runs on or waits for (None: none, or only ones being deleted); ``pending``: a
    scale-up slice that replaces ``current`` once Kueue admits it; ``replaced``: a slice whose replacement (now
    ``current``) Kueue admitted but that is not finished yet; ``others``: further unfinished slices (left by an
    interrupted replacement: to delete); ``deleting``: the names of those being deleted; ``present``: every slice not
    being deleted, finished ones too.
    """

    current: Optional[Mapping[str, Any]]
    pending: Optional[Mapping[str, Any]] = None
    replaced: Optional[Mapping[str, Any]] = None
    others: tuple[Mapping[str, Any], ...] = ()
    deleting: tuple[str, ...] = ()
    present: tuple[Mapping[str, Any], ...] = ()


def _created(workload: Mapping[str, Any]) -> tuple[str, str]:
    return workload["metadata"].get("creationTimestamp") or "", workload["metadata"]["name"]


def _replaced(workload: Mapping[str, Any]) -> bool:
    """Whether Kueue finished the slice for its replacement (:data:`SLICE_REPLACED`)."""
    return (_condition(workload, FINISHED) or {}).get("reason") == SLICE_REPLACED


def slices(workloads: Iterable[Mapping[str, Any]]) -> Slices:
    """The slices among ``workloads`` (a job's own): the oldest unfinished slice that replaces no other unfinished one
    is current, the unfinished one that replaces it pending (current once admitted; Kueue finishes the replaced slice
    just before it writes the admission, and in between the replaced one stays current); with none unfinished, the
    newest that no replacement finished (the one a finished job marked), so that finished slices never count."""
    present = tuple(w for w in workloads if not w["metadata"].get("deletionTimestamp"))
    deleting = tuple(sorted(w["metadata"]["name"] for w in workloads if w["metadata"].get("deletionTimestamp")))
    live = sorted((w for w in present if not _true(w, FINISHED)), key=_created)
    if not live:
        ended = sorted(present, key=lambda w: (not _replaced(w), _created(w)))
        return Slices(ended[-1] if ended else None, deleting=deleting, present=present)
    keys = {_key(w) for w in live}
    current = next((w for w in live if _annotation(w, SLICE_REPLACEMENT_FOR) not in keys), live[0])
    pending = next((w for w in live if _annotation(w, SLICE_REPLACEMENT_FOR) == _key(current)), None)
    others = tuple(w for w in live if w is not current and w is not pending)
    if pending is not None and _true(pending, QUOTA_RESERVED) and _true(pending, ADMITTED):
        return Slices(pending, replaced=current, others=others, deleting=deleting, present=present)
    replaced = next((w for w in present if _key(w) == _annotation(current, SLICE_REPLACEMENT_FOR)), None)
    if replaced is not None and _replaced(replaced) and not _true(current, ADMITTED):
        return Slices(replaced, current, others=others, deleting=deleting, present=present)  # Kueue is admitting it
    return Slices(current, pending, others=others, deleting=deleting, present=present)


@dataclass(frozen=True)
class Resize:
    """What the wanted Workload does to a job's current and pending slices (:func:`resize`).

    ``remake``: delete every slice and queue anew, saying this; ``shrink``: a merge patch lowering the current slice's
    rollout count in place; ``grow``: a new slice to create; ``regrow``: a merge patch of the pending slice's rollout
    count; ``drop_pending``: delete the pending slice.
    """

    remake: Optional[str] = None
    shrink: Optional[dict[str, Any]] = None
    grow: Optional[dict[str, Any]] = None
    regrow: Optional[dict[str, Any]] = None
    drop_pending: bool = False


def _hash(workload: Mapping[str, Any]) -> Optional[str]:
    return _annotation(workload, c.ANNOTATION_WORKLOAD_PODSETS_HASH)


def resize(current: Mapping[str, Any], pending: Optional[Mapping[str, Any]], wanted: Mapping[str, Any]) -> Resize:
    """How the job's slices follow ``wanted`` (:func:`.render`'s Workload): unchanged pod sets keep the current slice
    (a pending one is dropped: scaled back); a change of the rollout count alone on an admitted slice lowers it in place
    or makes (or re-aims) a replacement slice; anything else, or any change before admission, remakes the Workload."""
    if not outdated(current, wanted):
        return Resize(drop_pending=pending is not None)
    shape = _annotation(wanted, c.ANNOTATION_WORKLOAD_SHAPE_HASH)
    if _annotation(current, c.ANNOTATION_WORKLOAD_SHAPE_HASH) != shape or not _true(current, QUOTA_RESERVED):
        return Resize(remake=(
            f"the job's pod sets changed, so its Workload {current['metadata']['name']} (immutable once queued) is "
            "replaced and the job queues again"))
    if rollout_count(wanted) < rollout_count(current):
        return Resize(shrink=_counts_patch(current, wanted), drop_pending=pending is not None)
    if pending is None:
        return Resize(grow=new_slice(current, wanted))
    if not outdated(pending, wanted):
        return Resize()
    if _annotation(pending, c.ANNOTATION_WORKLOAD_SHAPE_HASH) == shape and not _true(pending, QUOTA_RESERVED):
        return Resize(regrow=_counts_patch(pending, wanted))
    return Resize(drop_pending=True)


def _counts_patch(workload: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch giving ``workload``'s rollout pod set the count of ``wanted``'s (the other pod sets as they
    are)."""
    count = rollout_count(wanted)
    sets = [{**s, "count": count} if s["name"] == ROLLOUT_POD_SET else s for s in workload["spec"]["podSets"]]
    return {"metadata": {"annotations": {c.ANNOTATION_WORKLOAD_PODSETS_HASH: _hash(wanted)}},
            "spec": {"podSets": sets}}


def new_slice(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The slice replacing ``current`` with ``wanted``'s pod sets, in ``current``'s LocalQueue: named
    ``<wanted's name>-<hash of current's uid and wanted's pod sets>``, annotated as ``current``'s replacement."""
    meta = wanted["metadata"]
    suffix = canonical_hash([current["metadata"].get("uid"), _hash(wanted)], digits=5)
    return {**wanted, "metadata": {**meta, "name": f"{meta['name']}-{suffix}",
                                   "annotations": {**meta["annotations"], SLICE_REPLACEMENT_FOR: _key(current)}},
            "spec": {**wanted["spec"], "queueName": current["spec"].get("queueName", wanted["spec"]["queueName"])}}


def scale_wait(current: Mapping[str, Any], pending: Mapping[str, Any]) -> str:
    """What a job says while its scale-up slice ``pending`` waits and it runs on ``current`` (Kueue's words)."""
    _, said = _waiting(pending)
    return (f"spec.rollout.replicas {rollout_count(pending)} waits for Kueue to admit Workload slice "
            f"{pending['metadata']['name']} in LocalQueue {pending['spec'].get('queueName')}: {said}; the job runs "
            f"{rollout_count(current)} rollout pods on Workload {current['metadata']['name']} meanwhile")


def gate_off(name: str, refusal: str) -> str:
    """The hold of a job whose admitted Workload ``name`` Kueue refused to shrink in place (``refusal``: its words)."""
    return (f"Kueue refused to lower the rollout pod set's count of its admitted Workload {name} in place ({refusal}): "
            f"its feature gate {ELASTIC_GATE} is off, so the Workload is replaced and the job queues again, its gang "
            "resuming from the newest checkpoint once admitted (turn the gate on to scale without a restart)")


def replaced_patch(replaced: Mapping[str, Any], current: Mapping[str, Any], now: datetime) -> Optional[dict[str, Any]]:
    """The status (merge patch) finishing ``replaced`` once its replacement ``current`` has held quota for
    :data:`GATE_OFF_AFTER_S` and Kueue has not finished it (its gate is off: it admitted ``current`` in full); None
    before."""
    since = (_condition(current, QUOTA_RESERVED) or {}).get("lastTransitionTime")
    if since is None or (now - datetime.fromisoformat(since.replace("Z", "+00:00"))).total_seconds() < GATE_OFF_AFTER_S:
        return None
    return _finished(replaced, "OutOfSync", (
        f"replaced by Workload slice {current['metadata']['name']}, which Kueue admitted in full without finishing "
        f"this one (its feature gate {ELASTIC_GATE} is off)"), now)
