"""RLTrainingJobs queued by the real Kueue (README "Kueue") on the node cluster: Kueue's manager built from source
(localcluster/build-go-tools.sh) runs next to the control plane with its webhooks (rljob_localcluster.kueue), the
operator runs as a pod under the chart's RBAC, and the trainer and rollout pods run on real kubelets that advertise
fake ``nvidia.com/gpu`` (4 per node), which the ClusterQueues below count.

- a job held while its ClusterQueue lacks GPUs for trainer and rollout together (no pod at all, the Redis running),
  admitted once the quota fits, on the flavor's node, to Succeeded (its Workload then Finished);
- a job preempted by a higher-priority one (its pods deleted, nothing counted) that resumes from its checkpoint and
  succeeds once the other one has finished;
- a gang restart under Kueue (a trainer pod deleted) completes while the Workload stays admitted.

On ``--cluster=existing`` the cluster must run Kueue already (with RLTrainingJob as an external framework).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from rljob_api import constants as c

from .conftest import Cluster, checkpointed_job, condition, get_job, job_manifest, phase, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.kueue]

GPU = "nvidia.com/gpu"
NODE = "rljob-node-1"
"""Where the flavor places admitted pods (kubernetes.io/hostname)."""
HOSTNAME = "kubernetes.io/hostname"
HELD_S = 20
"""How long a held job is watched for a pod that should not exist (seconds)."""


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[None]:
    """Kueue for the module: started next to the local control plane (stopped at the end, also on failure); on an
    existing cluster it must be installed."""
    if cluster.mode != "local":
        if cluster.get("crd", "workloads.kueue.x-k8s.io") is None:
            pytest.skip("the existing cluster runs no Kueue")
        yield None
        return
    from conftest_cluster import acquire_control_plane, release_control_plane
    from rljob_localcluster.kueue import LocalKueue

    cp = acquire_control_plane()  # the suite's own (already started, shared): counted, released below
    try:
        with LocalKueue(cp):
            yield None
    finally:
        release_control_plane()


def queues(cluster: Cluster, namespace: str, gpus: int, *, preempt: bool = False) -> str:
    """ResourceFlavor ``namespace`` (pods on :data:`NODE`), ClusterQueue ``cq-<namespace>`` with ``gpus`` of it,
    LocalQueue ``lq`` in ``namespace``; returns the ClusterQueue's name (the cluster-scoped ones outlive the test,
    named after its namespace)."""
    cq = f"cq-{namespace}"
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": namespace},
                   "spec": {"nodeLabels": {HOSTNAME: NODE}}}, namespace)
    # Kueue admits only resources the queue covers: the pods' CPU and memory get room to spare, GPUs are the limit
    resources = [{"name": "cpu", "nominalQuota": 64}, {"name": "memory", "nominalQuota": "256Gi"},
                 {"name": GPU, "nominalQuota": gpus}]
    spec = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}, "resourceGroups": [{
        "coveredResources": [r["name"] for r in resources], "flavors": [{"name": namespace, "resources": resources}]}]}
    if preempt:
        spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
                   "spec": spec}, namespace)
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq"},
                   "spec": {"clusterQueue": cq}}, namespace)
    return cq


def queued(manifest: dict, priority: str | None = None) -> dict:
    manifest["metadata"]["labels"] = {c.LABEL_KUEUE_QUEUE_NAME: "lq",
                                      **({c.LABEL_KUEUE_PRIORITY_CLASS: priority} if priority else {})}
    return manifest


def gpu_spec(max_steps: int, trainer_gpus: int) -> dict:
    """Trainer 1 pod x 2 processes with ``trainer_gpus`` fake GPUs (the CPU trainer ignores them), rollout 1 pod
    with 1."""
    return {"trainer": {"maxSteps": max_steps, "resources": {"limits": {GPU: trainer_gpus}}},
            "rollout": {"resources": {"limits": {GPU: 1}}}, "runPolicy": {"cleanPodPolicy": "None"}}


def workers(cluster: Cluster, namespace: str, job: str) -> list[dict]:
    return [p for p in cluster.items("pods", namespace, f"{c.LABEL_JOB_NAME}={job}")
            if p["metadata"]["labels"].get(c.LABEL_ROLE) in ("trainer", "rollout")
            and not p["metadata"].get("deletionTimestamp")]


def workload(cluster: Cluster, namespace: str, job: str) -> dict:
    return cluster.get("workloads.kueue.x-k8s.io", f"{job}-workload", "-n", namespace) or {}


def workload_condition(wl: dict, ctype: str) -> dict:
    return next((cd for cd in (wl.get("status") or {}).get("conditions", []) if cd["type"] == ctype), {})


def test_a_job_waits_for_gpu_quota_for_trainer_and_rollout_together_then_runs_on_the_flavors_node(
        cluster, operator, kueue, namespace, diagnostics):
    name = "held"
    diagnostics.job = name
    cq = queues(cluster, namespace, gpus=2)  # the trainer's 2 GPUs fit, the rollout pod's 1 more does not
    manifest = queued(checkpointed_job(cluster, namespace, name, 5, gpu_spec(20, 2)))
    cluster.apply(manifest, namespace)
    held = wait_for(lambda: condition(job := get_job(cluster, namespace, name), c.ConditionType.RUNNING).get(
        "reason") == c.Reason.WAITING_FOR_ADMISSION.value and "insufficient" in condition(
        job, c.ConditionType.RUNNING)["message"] and job, 120, "WaitingForAdmission", diagnostics)
    assert phase(held) == "Pending", diagnostics()
    wait_for(lambda: ((cluster.get("deployment", f"{name}-redis", "-n", namespace) or {}).get("status") or {}).get(
        "readyReplicas") == 1, 180, "the Redis (outside the quota) to be ready", diagnostics)
    time.sleep(HELD_S)
    assert cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)") == [], diagnostics()

    cluster.kubectl("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([{
        "op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/2/nominalQuota", "value": 3}]))
    final = wait_for(lambda: phase(job := get_job(cluster, namespace, name)) in ("Succeeded", "Failed") and job,
                     600, "the admitted job to finish", diagnostics)
    assert phase(final) == "Succeeded", diagnostics()
    pods = cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)")
    assert pods and all(p["spec"]["nodeName"] == NODE for p in pods), [p["spec"].get("nodeName") for p in pods]
    assert all(c.LABEL_KUEUE_QUEUE_NAME not in p["metadata"]["labels"] for p in pods)
    finished = wait_for(lambda: workload_condition(workload(cluster, namespace, name), "Finished").get(
        "status") == "True" and workload(cluster, namespace, name), 60, "the Workload Finished", diagnostics)
    assert workload_condition(finished, "Finished")["reason"] == "Succeeded"
    assert [w["metadata"]["name"] for w in cluster.items("workloads.kueue.x-k8s.io", namespace)] == [
        f"{name}-workload"]


def test_a_preempted_job_resumes_from_its_checkpoint_once_the_higher_priority_job_is_done(
        cluster, operator, kueue, namespace, diagnostics):
    diagnostics.job = "low"
    queues(cluster, namespace, gpus=3, preempt=True)
    for priority, value in (("rljob-e2e-low", 10), ("rljob-e2e-high", 1000)):
        cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                       "metadata": {"name": priority}, "value": value}, namespace)
    cluster.apply(queued(checkpointed_job(cluster, namespace, "low", 5, gpu_spec(60, 2)), "rljob-e2e-low"), namespace)
    wait_for(lambda: "checkpoint: committed" in cluster.kubectl("logs", "-n", namespace, "low-trainer-0",
                                                                 check=False).stdout, 300,
             "low's first checkpoint", diagnostics, interval=0.5)
    high = queued(job_manifest("high", gpu_spec(10, 2)), "rljob-e2e-high")
    high["spec"]["trainer"].update(nodes=1, processesPerNode=2)
    cluster.apply(high, namespace)
    evicted = wait_for(lambda: condition(job := get_job(cluster, namespace, "low"), c.ConditionType.RUNNING).get(
        "reason") == c.Reason.EVICTED_BY_KUEUE.value and job, 120, "low evicted", diagnostics)
    assert "(Preempted: " in condition(evicted, c.ConditionType.RUNNING)["message"]
    assert phase(evicted) == "Pending" and evicted["spec"]["runPolicy"].get("suspend") in (None, False)
    done = wait_for(lambda: phase(job := get_job(cluster, namespace, "high")) in ("Succeeded", "Failed") and job,
                    600, "high to finish", diagnostics)
    assert phase(done) == "Succeeded", diagnostics()
    final = wait_for(lambda: phase(job := get_job(cluster, namespace, "low")) in ("Succeeded", "Failed") and job,
                     900, "low to resume and finish", diagnostics)
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["attempt"], status["restarts"], status["failedAttempts"]) == (1, 0, 0), status
    resumed = cluster.kubectl("logs", "-n", namespace, "low-trainer-0").stdout
    assert "checkpoint: loaded" in resumed, resumed[-3000:]
    assert workload_condition(workload(cluster, namespace, "low"), "Requeued").get("status") == "True"


def test_a_gang_restart_under_kueue_completes_while_the_workload_stays_admitted(
        cluster, operator, kueue, namespace, diagnostics):
    name = "restart"
    diagnostics.job = name
    queues(cluster, namespace, gpus=3)
    cluster.apply(queued(checkpointed_job(cluster, namespace, name, 5, gpu_spec(40, 2))), namespace)
    wait_for(lambda: "checkpoint: committed" in cluster.kubectl("logs", "-n", namespace, f"{name}-trainer-0",
                                                                 check=False).stdout, 300,
             "the first checkpoint", diagnostics, interval=0.5)
    admitted = workload_condition(workload(cluster, namespace, name), "Admitted")
    assert admitted.get("status") == "True", workload(cluster, namespace, name)
    cluster.kubectl("delete", "pod", f"{name}-trainer-0", "-n", namespace, "--wait=false")
    final = wait_for(lambda: phase(job := get_job(cluster, namespace, name)) in ("Succeeded", "Failed") and job,
                     600, "the job to finish", diagnostics)
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["restarts"], status["attempt"], status["failedAttempts"]) == (1, 1, 1), status
    wl = wait_for(lambda: workload_condition(w := workload(cluster, namespace, name), "Finished").get(
        "status") == "True" and w, 60, "the Workload Finished", diagnostics)
    # the restart was the operator's alone: Kueue never evicted or requeued the Workload
    assert workload_condition(wl, "Evicted").get("status") != "True", wl["status"]
    assert not (wl["status"].get("schedulingStats") or {}).get("evictions"), wl["status"]
    assert "requeueState" not in wl["status"], wl["status"]
