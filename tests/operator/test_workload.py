"""A queued job's Kueue Workload (rljob_operator.workload) and what Kueue's decision does to the gang's plan."""

from __future__ import annotations

from datetime import timedelta

from rljob_api import constants as c
from rljob_api.constants import Phase, Reason

from rljob_operator import gang, queueing, render, workload
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
