"""Pod and Deployment views (what the kopf indices hold) and the merge with this process's own actions."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from rljob_operator.observe import LAST_LINE_MAX, NodeView, deployment_view, last_line, node_view, pod_view
from rljob_operator.reconcile import CREATED_GRACE_S, JobRuntime, observed_pods

from operator_helpers import CRASHED, kubelet_rollout_pod, trainer


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
    refused = deployment_view({"metadata": {"name": "j-redis"}, "spec": {"replicas": 1}, "status": {"conditions": [
        {"type": "Available", "status": "False", "message": "Deployment does not have minimum availability."},
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
         "message": 'pods "j-redis-5d9c-x" is forbidden: no PriorityClass with name high was found'}]}})
    assert refused.message == ("0/1 replicas available: Deployment does not have minimum availability.; FailedCreate: "
                               'pods "j-redis-5d9c-x" is forbidden: no PriorityClass with name high was found')


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
    from rljob_operator.admission import foreign_children

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


# --- containers that do not start or keep failing, as the kubelet reports them ----------------------------------
def test_a_crash_looping_container_gives_its_reason_restarts_and_last_termination_message():
    view = pod_view(kubelet_rollout_pod(
        restartCount=3, lastState=CRASHED,
        state={"waiting": {"reason": "CrashLoopBackOff",
                           "message": "back-off 40s restarting failed container=rollout pod=math-rollout-0_default(r0)"}}))
    assert (view.phase, view.ready, view.container, view.waiting_reason, view.restarts) == (
        "Running", False, "rollout", "CrashLoopBackOff", 3)
    assert view.last_failure == ("exit code 2 (Error): 2026-01-01 12:00:03,512 ERROR rljob_rollout.__main__: "
                                 "rollout: cannot start: spec.rollout.task.datasetPath: no file at '/data/nope.jsonl'")
    assert view.running_since is None and view.failure == ""  # a restarting container does not fail the pod

    again = pod_view(kubelet_rollout_pod(restartCount=3, lastState=CRASHED,
                                        state={"running": {"startedAt": "2026-01-01T12:00:44Z"}}))
    assert (again.ready, again.waiting_reason, again.restarts) == (True, "", 3)
    assert again.running_since == datetime(2026, 1, 1, 12, 0, 44, tzinfo=timezone.utc)
    assert again.last_failure.startswith("exit code 2 (Error): ")


@pytest.mark.parametrize(("reason", "message"), [
    ("CreateContainerConfigError", 'secret "nosuch" not found'),
    ("ImagePullBackOff", 'Back-off pulling image "rljob/trainer-gpu:0.1.0"'),
    ("ErrImagePull", 'failed to pull and unpack image "docker.io/rljob/nope:1": not found'),
])
def test_a_container_that_cannot_start_names_the_kubelets_reason_and_message(reason, message):
    pod = _pod("Pending", containers=[{"name": "trainer", "image": "x", "ready": False, "restartCount": 0,
                                       "state": {"waiting": {"reason": reason, "message": message}}}])
    view = pod_view(pod)
    assert (view.container, view.waiting_reason, view.waiting_message, view.restarts, view.last_failure) == (
        "trainer", reason, message, 0, "")
    creating = pod_view(_pod("Pending", containers=[{"name": "trainer", "state": {"waiting": {
        "reason": "ContainerCreating"}}}]))
    assert (creating.waiting_reason, creating.container) == ("", "")  # on its way: nothing to report


TORCHRUN_FAILURE = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/app/rljob_trainer/train.py", line 394, in main
[rank0]: ValueError: spec.model.path: no config.json in /models/qwen
E1201 12:00:09 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
rljob_trainer.train FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 31)
  traceback : Traceback (most recent call last):
    ValueError: spec.model.path: no config.json in /models/qwen

============================================================
"""


def test_a_failed_trainer_pod_quotes_the_last_line_of_its_termination_message():
    failed = pod_view(_pod("Failed", containers=[{"name": "trainer", "restartCount": 0, "state": {"terminated": {
        "exitCode": 1, "reason": "Error", "message": TORCHRUN_FAILURE}}}]))
    assert failed.failure == ("container trainer exited with code 1 (Error): "
                              "ValueError: spec.model.path: no config.json in /models/qwen")
    assert failed.last_failure == "exit code 1 (Error): ValueError: spec.model.path: no config.json in /models/qwen"
    assert last_line("=====\n\n") == "" and len(last_line("x" * 1000)) == LAST_LINE_MAX


def test_a_pod_view_knows_its_node_its_deletion_deadline_and_how_long_it_tolerates_a_lost_node():
    pod = {"metadata": {"name": "demo-trainer-1", "deletionTimestamp": "2026-01-01T12:05:30Z",
                        "labels": {"rljob.dev/role": "trainer"}},
           "spec": {"nodeName": "n2", "tolerations": [
               {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
               {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
               {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
           "status": {"phase": "Running"}}
    view = pod_view(pod)
    assert (view.node, view.deleting, view.lost_node_toleration_s) == ("n2", True, 60)
    assert view.deletion_at == datetime(2026, 1, 1, 12, 5, 30, tzinfo=timezone.utc)
    assert pod_view({**pod, "spec": {"nodeName": "n2"}}).lost_node_toleration_s == 300  # Kubernetes' default
    forever = {**pod, "spec": {"tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]}}
    assert pod_view(forever).lost_node_toleration_s == -1 and pod_view(forever).node == ""

    assert node_view("n1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}).ready
    lost = node_view("n2", {"status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown", "lastTransitionTime": "2026-01-01T12:00:00Z"}]}})
    assert (lost.ready, lost.exists, lost.reason, lost.not_ready_since) == (
        False, True, "Unknown (NodeStatusUnknown)", datetime(2026, 1, 1, 12, tzinfo=timezone.utc))
    assert node_view("n3", None) == NodeView("n3", exists=False, ready=False, reason="the Node object is gone")
