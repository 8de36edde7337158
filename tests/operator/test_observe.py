"""Pod and Deployment views (what the kopf indices hold) and the merge with this process's own actions."""

from __future__ import annotations

from rljob_operator.observe import deployment_view, pod_view
from rljob_operator.reconcile import CREATED_GRACE_S, JobRuntime, observed_pods

from operator_helpers import trainer


def _pod(phase="Pending", conditions=(), reason=None, containers=(), deleting=False, attempt="2"):
    return {
        "metadata": {"name": "j-trainer-1", "uid": "u1", "deletionTimestamp": "2026-01-01T00:00:00Z" if deleting else None,
                     "labels": {"rljob.dev/role": "trainer", "rljob.dev/replica-index": "1", "rljob.dev/attempt": attempt,
                                "rljob.dev/config-hash": "abc"}},
        "status": {"phase": phase, "conditions": list(conditions), "reason": reason, "containerStatuses": list(containers)},
    }


def test_pod_view_reads_labels_phase_and_scheduling():
    view = pod_view(_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]))
    assert (view.name, view.role, view.index, view.attempt, view.config_hash) == ("j-trainer-1", "trainer", 1, 2, "abc")
    assert view.unschedulable == "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    assert view.active and not view.disrupted and view.failure == ""


def test_pod_view_failure_and_disruption():
    crashed = pod_view(_pod("Failed", containers=[{"name": "trainer", "state": {"terminated": {"exitCode": 3, "reason": "Error"}}}]))
    assert crashed.failure == "container trainer exited with code 3 (Error)" and not crashed.disrupted
    evicted = pod_view(_pod("Failed", reason="Evicted"))
    assert evicted.disrupted and evicted.failure == "Evicted"
    preempted = pod_view(_pod("Running", deleting=True, conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]))
    assert preempted.disrupted and preempted.deleting and not preempted.active
    assert pod_view(_pod(attempt="x")).attempt is None


def test_deployment_view():
    ready = deployment_view({"metadata": {"name": "j-redis"}, "spec": {"replicas": 1},
                             "status": {"availableReplicas": 1, "conditions": [{"type": "Available", "status": "True"}]}})
    assert ready.available and ready.message == "1/1 replicas available"
    waiting = deployment_view({"metadata": {"name": "j-redis"}, "spec": {"replicas": 1}, "status": {
        "conditions": [{"type": "Available", "status": "False", "message": "Deployment does not have minimum availability."}]}})
    assert not waiting.available
    assert waiting.message == "0/1 replicas available: Deployment does not have minimum availability."


def test_observed_pods_bridge_the_watch_lag_of_this_process_own_actions():
    runtime = JobRuntime()
    created = trainer(1, 0, "Pending")
    runtime.created["demo-trainer-1"] = (100.0, created)
    runtime.deleted["demo-trainer-0"] = "t0-0"
    indexed = [trainer(0, 0, "Running")]
    pods = {p.name: p for p in observed_pods(indexed, runtime, now=101.0)}
    assert pods["demo-trainer-1"] == created  # created, not yet reported by the watch
    assert pods["demo-trainer-0"].deleting  # deleted, the watch still shows it running
    # once the watch reports both, the process forgets them
    pods = {p.name: p for p in observed_pods([trainer(1, 0, "Running")], runtime, now=102.0)}
    assert list(pods) == ["demo-trainer-1"] and not runtime.created and not runtime.deleted
    # a created pod the watch never reports stops counting after the grace period
    runtime.created["demo-trainer-1"] = (100.0, created)
    assert observed_pods([], runtime, now=100.0 + CREATED_GRACE_S + 1) == []


def test_children_of_a_deleted_job_of_the_same_name_are_foreign():
    from rljob_operator.reconcile import foreign_children

    owned = _pod()
    owned["metadata"]["ownerReferences"] = [{"uid": "old-job", "controller": True, "kind": "RLTrainingJob"}]
    view = pod_view(owned)
    assert view.owner_uid == "old-job"
    redis = deployment_view({"metadata": {"name": "j-redis", "ownerReferences": [
        {"uid": "old-job", "controller": True, "kind": "RLTrainingJob"}]},
                             "spec": {"replicas": 1}, "status": {}})
    assert foreign_children("new-job", [view], redis) == ["j-trainer-1", "j-redis"]
    assert foreign_children("old-job", [view], redis) == []
    assert foreign_children("new-job", [pod_view(_pod())], None) == []  # no owner reference: not foreign
    redis_pod = _pod()
    redis_pod["metadata"]["ownerReferences"] = [{"uid": "rs", "controller": True, "kind": "ReplicaSet"}]
    assert foreign_children("new-job", [pod_view(redis_pod)], None) == []  # owned by its ReplicaSet
