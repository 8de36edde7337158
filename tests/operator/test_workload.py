"""A queued job's Kueue Workload (rljob_operator.workload) and what Kueue's decision does to the gang's plan."""

from __future__ import annotations

from datetime import timedelta

from rljob_api import constants as c
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import gang, job_status, queueing, render, workload
from rljob_operator.workload import Hold

from operator_helpers import T0, make_job, make_spec, rollout, trainer

QUEUE = {c.LABEL_KUEUE_QUEUE_NAME: "team-a"}
GPU_JOB = dict(trainer={"nodes": 2, "resources": {"limits": {"nvidia.com/gpu": 4, "cpu": "8"}},
                        "nodeSelector": {"pool": "gpu"}},
               rollout={"replicas": 3, "gpusPerReplica": 1, "resources": {"requests": {"cpu": "2"}}})


def _workload(job, priority=None):
    return queueing.wanted(job, render.job_config(job), priority)


def test_the_workload_has_the_trainer_gang_and_the_rollout_pods_as_pod_sets_and_no_redis():
    job = make_job(labels={**QUEUE, c.LABEL_KUEUE_PRIORITY_CLASS: "high"}, **GPU_JOB)
    wl = _workload(job, ("high", 1000))
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == "demo-workload" and wl["metadata"]["labels"][c.LABEL_JOB_NAME] == "demo"
    spec = wl["spec"]
    assert spec["queueName"] == "team-a" and spec["active"] is True
    assert spec["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}
    assert spec["priority"] == 1000
    trainer_set, rollout_set = spec["podSets"]
    assert (trainer_set["name"], trainer_set["count"], rollout_set["name"], rollout_set["count"]) == (
        "trainer", 2, "rollout", 3)
    # only what Kueue counts and fits flavors with: no image, env, volumes, command or labels
    assert trainer_set["template"] == {"spec": {"nodeSelector": {"pool": "gpu"}, "containers": [{
        "name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 4, "cpu": "8"}}}]}}
    assert rollout_set["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2"}, "limits": {"nvidia.com/gpu": 1}}
    assert all(s["name"] != "redis" for s in spec["podSets"])


def test_a_trainer_only_job_has_one_pod_set_suspend_makes_it_inactive_and_a_changed_pod_set_is_outdated():
    job = make_job(labels=QUEUE, rollout={"replicas": 0}, runPolicy={"suspend": True})
    wl = _workload(job)
    assert [s["name"] for s in wl["spec"]["podSets"]] == ["trainer"]
    assert wl["spec"]["active"] is False and "priority" not in wl["spec"]
    assert not workload.outdated(wl, _workload(make_job(labels=QUEUE, rollout={"replicas": 0})))
    assert workload.outdated(wl, _workload(make_job(labels=QUEUE, rollout={"replicas": 2})))
    # fields Kueue does not read leave the Workload as it is
    sampled = make_job(labels=QUEUE, rollout={"replicas": 0, "sampling": {"temperature": 0.7}},
                       trainer={"image": "other/trainer:2"})
    assert not workload.outdated(wl, _workload(sampled))


def _kueue(wl, *conditions, admission=None, checks=()):
    status = {"conditions": [{"type": t, "status": s, "reason": r, "message": m,
                              "lastTransitionTime": "2026-01-01T11:00:00Z"} for t, s, r, m in conditions]}
    if admission is not None:
        status["admission"] = admission
    if checks:
        status["admissionChecks"] = list(checks)
    return {**wl, "metadata": {**wl["metadata"], "generation": 1}, "status": status}


ADMISSION = {"clusterQueue": "cq", "podSetAssignments": [
    {"name": "trainer", "flavors": {"nvidia.com/gpu": "h100", "cpu": "default"}, "count": 2},
    {"name": "rollout", "flavors": {"nvidia.com/gpu": "l4"}, "count": 3}]}
FLAVORS = {
    "h100": {"spec": {"nodeLabels": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists",
                                                                      "effect": "NoSchedule"}]}},
    "default": {"spec": {}},
    "l4": {"spec": {"nodeLabels": {"gpu": "l4", "pool": "inference"}}},
}


def test_a_queued_workload_holds_the_job_with_kueues_own_words():
    wl = _kueue(_workload(make_job(labels=QUEUE, **GPU_JOB)), (
        "QuotaReserved", "False", "Pending",
        "couldn't assign flavors to pod set trainer: insufficient quota for nvidia.com/gpu in flavor h100, "
        "previously considered podsets requests (0) + current podset request (8) > maximum capacity (4)"))
    decided = workload.decision(wl, {})
    assert decided.hold == Hold(Reason.WAITING_FOR_ADMISSION, (
        "waiting for Kueue to admit Workload demo-workload in LocalQueue team-a: QuotaReserved=False (Pending): "
        "couldn't assign flavors to pod set trainer: insufficient quota for nvidia.com/gpu in flavor h100, "
        "previously considered podsets requests (0) + current podset request (8) > maximum capacity (4)"))
    assert not decided.release and not decided.finished
    fresh = workload.decision(_workload(make_job(labels=QUEUE)), {})
    assert fresh.hold.message.endswith("Kueue has not looked at it yet")


def test_a_workload_kueue_cannot_queue_holds_the_job_naming_the_local_queue_and_its_namespace():
    """A LocalQueue that does not exist: Kueue says so in QuotaReserved=False (Inadmissible) and nothing more, so the
    hold has a reason of its own (a Warning Event, status.py) instead of WaitingForAdmission's Normal one."""
    job = make_job(labels=QUEUE)
    wl = _kueue(_workload(job), ("QuotaReserved", "False", "Inadmissible", "LocalQueue team-a doesn't exist"))
    decided = workload.decision(wl, {})
    assert decided.hold == Hold(Reason.KUEUE_INADMISSIBLE, (
        f"Kueue cannot admit Workload demo-workload in LocalQueue team-a of namespace {job.namespace}: "
        "QuotaReserved=False (Inadmissible): LocalQueue team-a doesn't exist; create or start the queue (kubectl get "
        f"localqueue -n {job.namespace}), or change the job's label kueue.x-k8s.io/queue-name; nothing runs until "
        "then"))
    suspended = _kueue({**wl, "spec": {**wl["spec"], "active": False}}, (
        "QuotaReserved", "False", "Inadmissible", "LocalQueue team-a doesn't exist"))
    assert workload.decision(suspended, {}).hold.reason == Reason.WAITING_FOR_ADMISSION  # says: inactive, suspended


def test_an_admitted_workload_places_each_pod_set_on_its_flavors():
    wl = _kueue(_workload(make_job(labels=QUEUE, **GPU_JOB)), ("QuotaReserved", "True", "QuotaReserved", "cq"),
                ("Admitted", "True", "Admitted", "The workload is admitted"), admission=ADMISSION,
                checks=[{"name": "prov", "state": "Ready",
                         "podSetUpdates": [{"name": "trainer", "nodeSelector": {"zone": "a"}}]}])
    assert workload.flavors_of(wl) == ["default", "h100", "l4"]
    decided = workload.decision(wl, FLAVORS)
    assert decided.hold is None
    job = make_job(labels=QUEUE, **GPU_JOB)
    config = render.job_config(job)
    pod = workload.admitted_pod(render.trainer_pod(job, config, 1, 0), "trainer", decided)
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu", "gpu": "h100", "zone": "a"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert c.LABEL_KUEUE_QUEUE_NAME not in pod["metadata"]["labels"]
    rollout_pod = workload.admitted_pod(render.rollout_pod(job, config, 0), "rollout", decided)
    assert rollout_pod["spec"]["nodeSelector"] == {"gpu": "l4", "pool": "inference"}
    assert "tolerations" not in rollout_pod["spec"]


def test_an_evicted_workload_holds_the_job_and_its_quota_goes_back_as_kueues_job_reconciler_writes_it():
    wl = _kueue(_workload(make_job(labels=QUEUE)), ("QuotaReserved", "True", "QuotaReserved", "cq"),
                ("Admitted", "True", "Admitted", "The workload is admitted"),
                ("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: u1) due to prioritization"),
                admission=ADMISSION)
    decided = workload.decision(wl, FLAVORS)
    assert decided.hold.reason == Reason.EVICTED_BY_KUEUE and decided.release
    assert decided.hold.message.startswith("Kueue evicted Workload demo-workload (Preempted: Preempted to "
                                           "accommodate a workload (UID: u1) due to prioritization)")
    now = T0
    patch = workload.release_patch(wl, now)["status"]
    assert patch["admission"] is None
    by_type = {cond["type"]: cond for cond in patch["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert by_type["QuotaReserved"]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert (by_type["Admitted"]["status"], by_type["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["lastTransitionTime"] == "2026-01-01T11:00:00Z"  # left as Kueue wrote it
    finished = workload.finish_patch(wl, True, "done", now)["status"]["conditions"][-1]
    assert (finished["type"], finished["status"], finished["reason"], finished["message"]) == (
        "Finished", "True", "Succeeded", "done")


def test_spec_patch_changes_queue_only_while_no_quota_is_reserved():
    wanted = _workload(make_job(labels={c.LABEL_KUEUE_QUEUE_NAME: "team-b"}, runPolicy={"suspend": True}))
    queued = _kueue(_workload(make_job(labels=QUEUE)), ("QuotaReserved", "False", "Pending", "no quota"))
    assert workload.spec_patch(queued, wanted) == {"spec": {"active": False, "queueName": "team-b"}}
    reserved = _kueue(_workload(make_job(labels=QUEUE)), ("QuotaReserved", "True", "QuotaReserved", "cq"))
    assert workload.spec_patch(reserved, wanted) == {"spec": {"active": False}}
    assert workload.spec_patch(queued, queued) is None


def test_a_hold_deletes_the_pods_like_a_suspend_but_leaves_the_job_pending_and_counts_no_restart():
    spec = make_spec(trainer={"nodes": 2})
    hashes = render.config_hashes(render.job_config(render.Job("demo", "ns", spec)))
    running = gang.Lifecycle(phase=Phase.RUNNING, attempt=2, restarts=1, failed_attempts=1, gang_created=True,
                             start_time=T0, reason=Reason.TRAINING, message="x")
    pods = [trainer(0, 2), trainer(1, 2), rollout(0)]
    hold = Hold(Reason.EVICTED_BY_KUEUE, "Kueue evicted Workload demo-workload (Preempted: ...)")
    plan = gang.plan("demo", spec, running, pods, hashes, T0 + timedelta(seconds=60), hold=hold)
    assert set(plan.delete) == {"demo-trainer-0", "demo-trainer-1", "demo-rollout-0"}
    assert plan.create_trainers == () and plan.create_rollouts == ()
    lc = plan.lifecycle
    assert (lc.phase, lc.reason, lc.attempt, lc.restarts, lc.failed_attempts, lc.gang_created, lc.start_time) == (
        Phase.PENDING, Reason.EVICTED_BY_KUEUE, 3, 1, 1, False, None)
    assert lc.message == "Kueue evicted Workload demo-workload (Preempted: ...) (3 pods still terminating)"
    # never admitted: nothing is created, the attempt stays
    fresh = gang.plan("demo", spec, gang.Lifecycle(), [], hashes, T0, hold=Hold(Reason.WAITING_FOR_ADMISSION, "w"))
    assert (fresh.lifecycle.phase, fresh.lifecycle.attempt, fresh.create_trainers) == (Phase.PENDING, 0, ())
    # admitted (no hold): the gang of the saved attempt is created
    admitted = gang.plan("demo", spec, plan.lifecycle, [], hashes, T0)
    assert admitted.create_trainers == (0, 1) and admitted.lifecycle.attempt == 3


def _admitted(wl, name=None, uid="u-0", created="2026-01-01T11:00:00Z", *extra):
    admitted = _kueue(wl, ("QuotaReserved", "True", "QuotaReserved", "cq"),
                      ("Admitted", "True", "Admitted", "The workload is admitted"), *extra, admission=ADMISSION)
    meta = {**admitted["metadata"], "namespace": "ns", "uid": uid, "creationTimestamp": created}
    return {**admitted, "metadata": {**meta, "name": name or meta["name"]}}


def _scaled(replicas, **fields):
    return _workload(make_job(labels=QUEUE, **{**GPU_JOB, "rollout": {**GPU_JOB["rollout"], "replicas": replicas}},
                              **fields))


def test_a_scale_down_of_an_admitted_workload_lowers_its_rollout_count_in_place():
    current = _admitted(_scaled(3))
    step = workload.resize(current, None, _scaled(1))
    assert step.remake is None and step.grow is None and not step.drop_pending
    assert [(s["name"], s["count"]) for s in step.shrink["spec"]["podSets"]] == [("trainer", 2), ("rollout", 1)]
    assert step.shrink["spec"]["podSets"][0] == current["spec"]["podSets"][0]  # the trainer's pod set as Kueue has it
    assert step.shrink["metadata"]["annotations"] == {
        c.ANNOTATION_WORKLOAD_PODSETS_HASH: _scaled(1)["metadata"]["annotations"][c.ANNOTATION_WORKLOAD_PODSETS_HASH]}
    assert workload.resize(current, None, _scaled(3)) == workload.Resize()


def test_a_scale_up_of_an_admitted_workload_makes_a_replacement_slice_that_waits_with_kueues_words():
    current = _admitted(_scaled(3))
    wanted = _scaled(5)
    step = workload.resize(current, None, wanted)
    new = step.grow
    assert step.remake is None and step.shrink is None
    assert new["metadata"]["name"].startswith("demo-workload-") and len(new["metadata"]["name"]) == 19
    assert new["metadata"]["annotations"][workload.SLICE_REPLACEMENT_FOR] == "ns/demo-workload"
    assert new["metadata"]["annotations"][workload.ELASTIC_JOB] == "true"
    assert new["metadata"]["labels"] == current["metadata"]["labels"] and new["spec"]["podSets"] == wanted["spec"]["podSets"]
    assert workload.resize(current, new, wanted) == workload.Resize()  # waits for Kueue
    assert workload.resize(current, new, _scaled(3)) == workload.Resize(drop_pending=True)  # scaled back
    assert workload.resize(current, new, _scaled(2)).shrink is not None  # below the running count: in place
    assert workload.resize(current, new, _scaled(2)).drop_pending
    regrow = workload.resize(current, new, _scaled(6)).regrow  # the waiting slice is re-aimed
    assert [s["count"] for s in regrow["spec"]["podSets"]] == [2, 6]

    pending = _kueue({**new, "metadata": {**new["metadata"], "namespace": "ns"}}, (
        "QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set rollout: insufficient unused quota "
        "for nvidia.com/gpu in flavor l4, 2 more needed"))
    assert workload.scale_wait(current, pending) == (
        f"spec.rollout.replicas 5 waits for Kueue to admit Workload slice {new['metadata']['name']} in LocalQueue "
        "team-a: QuotaReserved=False (Pending): couldn't assign flavors to pod set rollout: insufficient unused quota "
        "for nvidia.com/gpu in flavor l4, 2 more needed; the job runs 3 rollout pods on Workload demo-workload "
        "meanwhile")


def test_other_pod_set_changes_and_changes_before_admission_remake_the_workload():
    current = _admitted(_scaled(3))
    nodes = _workload(make_job(labels=QUEUE, **{**GPU_JOB, "trainer": {**GPU_JOB["trainer"], "nodes": 4}}))
    gpus = _workload(make_job(labels=QUEUE, **{**GPU_JOB, "rollout": {**GPU_JOB["rollout"], "gpusPerReplica": 2}}))
    for wanted in (nodes, gpus):
        assert workload.resize(current, None, wanted).remake == (
            "the job's pod sets changed, so its Workload demo-workload (immutable once queued) is replaced and the job "
            "queues again")
    queued = _kueue(_scaled(3), ("QuotaReserved", "False", "Pending", "no quota"))
    assert workload.resize(queued, None, _scaled(5)).remake is not None
    old = {**current, "metadata": {**current["metadata"], "annotations": {  # made before slices: no shape hash
        c.ANNOTATION_WORKLOAD_PODSETS_HASH: current["metadata"]["annotations"][c.ANNOTATION_WORKLOAD_PODSETS_HASH]}}}
    assert workload.resize(old, None, _scaled(5)).remake is not None
    assert "feature gate ElasticJobsViaWorkloadSlices is off" in workload.gate_off("demo-workload", "field is immutable")


def test_the_job_follows_its_admitted_slice_and_never_a_finished_one():
    first = _admitted(_scaled(3))
    grown = workload.resize(first, None, _scaled(5)).grow
    waiting = _kueue({**grown, "metadata": {**grown["metadata"], "namespace": "ns", "uid": "u-1",
                                            "creationTimestamp": "2026-01-01T11:05:00Z"}},
                     ("QuotaReserved", "False", "Pending", "no quota"))
    found = workload.slices([waiting, first])
    assert (found.current, found.pending, found.replaced) == (first, waiting, None)

    finished = ("Finished", "True", workload.SLICE_REPLACED, "Replaced to accommodate a workload")
    replaced = _admitted(_scaled(3), None, "u-0", "2026-01-01T11:00:00Z", finished)
    # Kueue finished the old slice just before it writes the new one's admission: the job stays on the old one
    found = workload.slices([waiting, replaced])
    assert (found.current, found.pending) == (replaced, waiting)
    assert workload.decision(replaced, FLAVORS).hold is None
    admitted = _admitted(waiting, None, "u-1", "2026-01-01T11:05:00Z")
    found = workload.slices([admitted, replaced])
    assert (found.current, found.pending, found.replaced, found.present) == (admitted, None, None, (admitted, replaced))
    # Kueue admitted the new slice without finishing the old one (its gate off): the operator finishes it
    found = workload.slices([first, admitted])
    assert (found.current, found.replaced) == (admitted, first)
    admitted_at = workload._condition(admitted, "QuotaReserved")["lastTransitionTime"]
    assert admitted_at == "2026-01-01T11:00:00Z"
    assert workload.replaced_patch(first, admitted, T0.replace(hour=11, second=5)) is None
    out = workload.replaced_patch(first, admitted, T0)["status"]["conditions"][-1]
    assert (out["type"], out["reason"]) == ("Finished", "OutOfSync")
    # a finished job: the slice it marked, not the one its replacement finished
    done = _admitted(waiting, None, "u-1", "2026-01-01T11:05:00Z", ("Finished", "True", "Succeeded", "done"))
    assert workload.slices([replaced, done]).current == done
    deleting = {**first, "metadata": {**first["metadata"], "deletionTimestamp": "2026-01-01T11:06:00Z"}}
    assert workload.slices([deleting]) == workload.Slices(None, deleting=("demo-workload",))


def test_transfer_ranks_stay_as_the_rollout_scales():
    ranks = {replicas: [render.job_config(make_job(rollout={"replicas": replicas, "gpusPerReplica": 2}))
                        .transfer_rank(i, t) for i in range(replicas) for t in range(2)] for replicas in (1, 2, 3)}
    assert ranks[3][:4] == ranks[2] and ranks[2][:2] == ranks[1] == [1, 2]


def test_a_waiting_scale_up_makes_rollout_ready_false_with_a_normal_event_and_leaves_running_alone():
    running = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING,
                             message="attempt 0: all 2 trainer pods running")
    wait = ("spec.rollout.replicas 2 waits for Kueue to admit Workload slice demo-workload-1a2b3 in LocalQueue lq: "
            "QuotaReserved=False (Pending): ...; the job runs 1 rollout pods on Workload demo-workload meanwhile")

    def build(previous, scale_wait):
        return job_status.build_status(
            previous, generation=1, lifecycle=running, problems=[], data_parallel_size=2,
            redis=job_status.RedisHealth(True, "ok"), pods=[trainer(0, 0), trainer(1, 0), rollout(0)], nodes=2,
            replicas=1, progress=None, now=T0, scale_wait=scale_wait)

    before = build(RLTrainingJobStatus(), None)
    assert before.condition(ConditionType.ROLLOUT_READY).status == "True"
    after = build(before, wait)
    ready = after.condition(ConditionType.ROLLOUT_READY)
    assert (ready.status, ready.reason, ready.message) == (
        "False", "ScaleUpWaitingForQuota", f"1/1 rollout pods ready; {wait}")
    assert after.condition(ConditionType.RUNNING) == before.condition(ConditionType.RUNNING)
    assert ("Normal", "ScaleUpWaitingForQuota") in [(e.type, e.reason) for e in job_status.transition_events(
        before, after)]
