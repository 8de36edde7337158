"""Kueue admits, holds and preempts RLTrainingJobs: the real Kueue manager (built from source by
localcluster/build-go-tools.sh, with its CRDs and webhooks, rljob_localcluster.kueue) and the operator as a process
under the chart's RBAC, against the real API server of the local control plane (no nodes: pods stay Pending, which is
all admission needs).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest

from rljob_api import constants as c
from rljob_api.constants import Phase, Reason
from rljob_api.spec import RLTrainingJobSpec
from rljob_localcluster import ControlPlane
from rljob_localcluster.kueue import LocalKueue
from rljob_operator import gang, queueing, render
from rljob_operator.kube_api import KubeApi
from rljob_operator.runtime import Context, JobRuntime

from test_cluster import (  # noqa: F401  (fixtures)
    Kube, bind, ghost_node, installed, job_manifest, kube, kubelet_status, namespace, operator, wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.kueue]

POOL_LABEL = "rljob.dev/test-pool"
GPU = "nvidia.com/gpu"
# trainer: 2 pods x 2 GPUs; rollout: 1 pod x 1 GPU -> 5 GPUs for the whole job
JOB = dict(trainer={"nodes": 2, "resources": {"limits": {GPU: 2}}},
           rollout={"replicas": 1, "resources": {"limits": {GPU: 1}}})  # (CPU backend: gpusPerReplica must be 0)


@pytest.fixture(scope="module", autouse=True)
def kueue(control_plane):
    """Kueue for the module, started before the operator (autouse: first), so that its first discovery sees
    Workloads; stopped at the end, also on failure."""
    with LocalKueue(control_plane) as running:
        yield running


def queues(kube: Kube, namespace: str, gpus: int, *, preempt: bool = False) -> str:
    """A ResourceFlavor placing pods on POOL_LABEL=<namespace>, a ClusterQueue of ``gpus`` GPUs of it and a LocalQueue
    ``lq`` in ``namespace``; returns the ClusterQueue's name."""
    cq = f"cq-{namespace}"
    kube.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": namespace},
                "spec": {"nodeLabels": {POOL_LABEL: namespace}}})
    cluster_queue = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
                     "spec": {"namespaceSelector": {}, "resourceGroups": [{
                         "coveredResources": [GPU],
                         "flavors": [{"name": namespace, "resources": [{"name": GPU, "nominalQuota": gpus}]}]}]}}
    if preempt:
        cluster_queue["spec"]["preemption"] = {"withinClusterQueue": "LowerPriority"}
    kube.apply(cluster_queue)
    kube.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq"},
                "spec": {"clusterQueue": cq}}, namespace)
    return cq


def queued_job(name: str, priority: str | None = None) -> dict:
    manifest = job_manifest(name, **JOB)
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "lq",
                                      **({"kueue.x-k8s.io/priority-class": priority} if priority else {})}
    return manifest


def live(kube: Kube, namespace: str, job: str) -> list[dict]:
    """The job's trainer and rollout pods that are not being deleted."""
    return [p for role in ("trainer", "rollout") for p in kube.pods(namespace, role)
            if p["metadata"]["labels"]["rljob.dev/job-name"] == job and not p["metadata"].get("deletionTimestamp")]


def workload_condition(kube: Kube, namespace: str, job: str, ctype: str) -> dict:
    found = kube.json("get", "workloads.kueue.x-k8s.io", f"{job}-workload", "-n", namespace) or {}
    return next((c for c in (found.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def test_a_job_is_admitted_when_quota_allows_its_pods_go_to_the_flavors_nodes_and_its_end_frees_the_quota(
        kube, operator, namespace, ghost_node):
    queues(kube, namespace, gpus=8)
    kube.apply(queued_job("fits"), namespace)
    pods = wait_for(lambda: len(p := live(kube, namespace, "fits")) == 3 and p, "2 trainer + 1 rollout pods")
    for pod in pods:
        assert pod["spec"]["nodeSelector"] == {POOL_LABEL: namespace}, pod["metadata"]["name"]
        assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]
    workloads = kube.json("get", "workloads.kueue.x-k8s.io", "-n", namespace)["items"]
    assert [w["metadata"]["name"] for w in workloads] == ["fits-workload"]  # no second Workload of Kueue's own
    (wl,) = workloads
    owner = wl["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLTrainingJob", "fits", True)
    assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [("trainer", 2), ("rollout", 1)]
    assignment = {a["name"]: a["flavors"] for a in wl["status"]["admission"]["podSetAssignments"]}
    assert assignment == {"trainer": {GPU: namespace}, "rollout": {GPU: namespace}}
    assert kube.json("get", "deployment", "fits-redis", "-n", namespace) is not None

    # trainer pod 0 (global rank 0) exits 0, as its kubelet would report it: the job succeeds, its Workload is Finished
    bind(kube, namespace, "fits-trainer-0", ghost_node)
    kubelet_status(kube, namespace, "fits-trainer-0", "Succeeded", {
        "name": "trainer", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}})
    wait_for(lambda: (kube.job(namespace, "fits").get("status") or {}).get("phase") == "Succeeded", "Succeeded")
    finished = wait_for(lambda: (c := workload_condition(kube, namespace, "fits", "Finished")).get("status") == "True"
                        and c, "the Workload Finished")
    assert finished["reason"] == "Succeeded"
    assert finished["message"] == kube.condition(namespace, "fits", "Succeeded")["message"]


def test_every_pod_is_held_while_the_cluster_queue_lacks_gpus_for_trainer_and_rollout_together(
        kube, operator, namespace):
    cq = queues(kube, namespace, gpus=4)  # the trainer gang alone would fit, the whole job does not
    kube.apply(queued_job("held"), namespace)
    running = wait_for(lambda: (c := kube.condition(namespace, "held", "Running")).get("reason") ==
                       "WaitingForAdmission" and "insufficient" in c["message"] and c, "WaitingForAdmission")
    assert running["status"] == "False"
    assert running["message"].startswith(
        f"waiting for Kueue to admit Workload held-workload in LocalQueue lq: QuotaReserved=False (Pending): ")
    assert kube.job(namespace, "held")["status"]["phase"] == "Pending"
    assert live(kube, namespace, "held") == []
    assert kube.json("get", "deployment", "held-redis", "-n", namespace) is not None  # Redis is outside the quota
    kube.run("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([{
        "op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota", "value": 5}]))
    wait_for(lambda: len(live(kube, namespace, "held")) == 3, "the pods once the quota fits the whole job")


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_afterwards_without_a_counted_restart(
        kube, operator, namespace):
    queues(kube, namespace, gpus=5, preempt=True)
    for name, value in (("rljob-test-low", 10), ("rljob-test-high", 1000)):
        kube.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                    "metadata": {"name": name}, "value": value})
    kube.apply(queued_job("low", "rljob-test-low"), namespace)
    wait_for(lambda: len(live(kube, namespace, "low")) == 3, "low's pods")
    wait_for(lambda: (kube.job(namespace, "low").get("status") or {}).get("gangCreated"), "low's gang created")
    wl = kube.json("get", "workloads.kueue.x-k8s.io", "low-workload", "-n", namespace)
    assert (wl["spec"]["priority"], wl["spec"]["priorityClassRef"]["name"]) == (10, "rljob-test-low")

    kube.apply(queued_job("high", "rljob-test-high"), namespace)
    evicted = wait_for(lambda: (c := kube.condition(namespace, "low", "Running")).get("reason") == "EvictedByKueue"
                       and c, "low evicted")
    assert "(Preempted: " in evicted["message"]
    wait_for(lambda: live(kube, namespace, "low") == [] and len(live(kube, namespace, "high")) == 3,
             "low's pods gone, high's created")
    status = kube.job(namespace, "low")
    assert (status["status"]["restarts"], status["status"]["failedAttempts"]) == (0, 0)
    assert status["spec"]["runPolicy"].get("suspend") in (None, False)  # the user's field is untouched
    assert workload_condition(kube, namespace, "low", "QuotaReserved")["status"] == "False"
    assert workload_condition(kube, namespace, "low", "Requeued")["status"] == "True"

    kube.run("delete", "rljob", "high", "-n", namespace, "--timeout=60s")
    wait_for(lambda: len(live(kube, namespace, "low")) == 3, "low's pods again once high is gone")
    resumed = wait_for(lambda: (s := kube.job(namespace, "low")["status"]).get("gangCreated") and s, "low resumed")
    assert (resumed["attempt"], resumed["restarts"], resumed["failedAttempts"]) == (1, 0, 0)
    attempts = {p["metadata"]["labels"]["rljob.dev/attempt"] for p in kube.pods(namespace, "trainer")
                if p["metadata"]["labels"]["rljob.dev/job-name"] == "low"}
    assert attempts == {"1"}


def test_an_empty_queue_label_is_invalid_and_a_local_queue_that_does_not_exist_is_a_warning(kube, operator, namespace):
    """A new user's two queue-label mistakes: an empty label (the job ran unqueued without a word) is Valid=False; a
    LocalQueue that does not exist holds the job Pending with Kueue's words, the LocalQueue and its namespace, and a
    Warning Event (it was a Normal WaitingForAdmission); creating the queue lets the job run."""
    manifest = queued_job("lost")
    manifest["metadata"]["labels"][c.LABEL_KUEUE_QUEUE_NAME] = ""
    kube.apply(manifest, namespace)
    valid = wait_for(lambda: (v := kube.condition(namespace, "lost", "Valid")).get("status") == "False" and v,
                     "Valid=False for the empty label")
    assert valid["message"] == (
        f"metadata.labels[kueue.x-k8s.io/queue-name]: is empty, which names no LocalQueue: set it to the name of a "
        f"LocalQueue in namespace {namespace}, or remove the label to run the job without Kueue")  # says what to do
    assert live(kube, namespace, "lost") == []

    kube.run("label", "rljob", "lost", "-n", namespace, f"{c.LABEL_KUEUE_QUEUE_NAME}=lq", "--overwrite")
    running = wait_for(lambda: (r := kube.condition(namespace, "lost", "Running")).get("reason") == "KueueInadmissible"
                       and r, "KueueInadmissible while LocalQueue lq does not exist")
    assert (running["status"], running["message"]) == ("False", (
        f"Kueue cannot admit Workload lost-workload in LocalQueue lq of namespace {namespace}: QuotaReserved=False "
        f"(Inadmissible): LocalQueue lq doesn't exist; create or start the queue (kubectl get localqueue -n "
        f"{namespace}), or change the job's label kueue.x-k8s.io/queue-name; nothing runs until then"))
    assert kube.job(namespace, "lost")["status"]["phase"] == "Pending"
    assert kube.condition(namespace, "lost", "Valid")["status"] == "True"
    events = wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                               if e["reason"] == "KueueInadmissible"], "the KueueInadmissible Event")
    assert [e["type"] for e in events] == ["Warning"]
    assert live(kube, namespace, "lost") == []

    queues(kube, namespace, gpus=5)
    wait_for(lambda: len(live(kube, namespace, "lost")) == 3, "the pods once the LocalQueue exists")


def test_a_queued_job_on_a_cluster_without_kueue_is_held_with_a_message_that_says_so(tmp_path):
    """A control plane of its own, where no Kueue API was ever served: the Workload cannot be created, and the pass
    holds the job (Pending, KueueNotAvailable) instead of failing or running unqueued pods."""
    job = render.Job("lone", "default", RLTrainingJobSpec.model_validate(job_manifest("lone", **JOB)["spec"]),
                     {c.LABEL_KUEUE_QUEUE_NAME: "lq"}, "uid-1")
    body = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "lone", "namespace": "default",
                                                                       "uid": "uid-1"}}

    async def decide(kubeconfig: str):
        api = await KubeApi.connect(kubeconfig)
        try:
            return await queueing.decide(job, render.job_config(job), body, gang.Lifecycle(), JobRuntime(),
                                         Context(api=api, post_event=lambda *_: None))
        finally:
            await api.close()

    with ControlPlane(tmp_path / "cp") as bare:
        queued = asyncio.run(decide(bare.kubeconfig))
    assert queued.hold.reason == Reason.KUEUE_NOT_AVAILABLE and queued.workload is None
    assert queued.hold.message == (
        "the job has label kueue.x-k8s.io/queue-name but the cluster serves no kueue.x-k8s.io/v1beta2 Workload API: "
        "install Kueue (v0.15 or later) with integrations.externalFrameworks [RLTrainingJob.v1alpha1.rljob.dev], or "
        "remove the label; nothing runs until then")
    plan = gang.plan("lone", job.spec, gang.Lifecycle(), [], render.config_hashes(render.job_config(job)),
                     datetime.now(timezone.utc), hold=queued.hold)
    assert plan.lifecycle.phase == Phase.PENDING and plan.create_trainers == () and plan.create_rollouts == ()


def test_suspending_a_queued_job_deactivates_its_workload_and_resuming_queues_it_again(kube, operator, namespace):
    queues(kube, namespace, gpus=5)
    kube.apply(queued_job("pause"), namespace)
    wait_for(lambda: len(live(kube, namespace, "pause")) == 3, "the admitted job's pods")
    patch = ["patch", "rljob", "pause", "-n", namespace, "--type=merge", "-p"]
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    wait_for(lambda: kube.condition(namespace, "pause", "Suspended").get("status") == "True", "Suspended=True")
    wait_for(lambda: workload_condition(kube, namespace, "pause", "QuotaReserved").get("status") == "False",
             "the quota given back")
    wl = kube.json("get", "workloads.kueue.x-k8s.io", "pause-workload", "-n", namespace)
    assert wl["spec"]["active"] is False and "admission" not in wl["status"]
    assert live(kube, namespace, "pause") == []
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    wait_for(lambda: len(live(kube, namespace, "pause")) == 3, "the pods once Kueue admits it again")
    assert kube.json("get", "workloads.kueue.x-k8s.io", "pause-workload", "-n", namespace)["spec"]["active"] is True
    status = kube.job(namespace, "pause")["status"]
    assert (status["restarts"], status["failedAttempts"]) == (0, 0)


def slices(kube: Kube, namespace: str, job: str) -> dict[str, dict]:
    """The job's Workloads by name."""
    return {w["metadata"]["name"]: w for w in kube.json("get", "workloads.kueue.x-k8s.io", "-n", namespace)["items"]
            if w["metadata"]["labels"].get("rljob.dev/job-name") == job}


def finished(wl: dict) -> dict:
    return next((c for c in (wl.get("status") or {}).get("conditions", [])
                 if c["type"] == "Finished" and c["status"] == "True"), {})


def uids(pods: list[dict], role: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods if p["metadata"]["labels"]["rljob.dev/role"] == role}


def test_a_scale_of_an_admitted_job_replaces_its_workload_slice_and_restarts_nothing(kube, operator, namespace):
    """kubectl scale 1→2: a new Workload slice replacing the admitted one is admitted (Kueue finishes the old one,
    WorkloadSliceReplaced), then the second rollout pod starts; 2→1: the slice's count goes down in place and rollout
    pod 1 goes. The trainer gang is never touched (same pods, attempt 0)."""
    queues(kube, namespace, gpus=8)
    kube.apply(queued_job("grow"), namespace)
    pods = wait_for(lambda: len(p := live(kube, namespace, "grow")) == 3 and p, "2 trainer + 1 rollout pods")
    wait_for(lambda: (kube.job(namespace, "grow").get("status") or {}).get("gangCreated"), "the gang created")
    trainers = uids(pods, "trainer")
    assert slices(kube, namespace, "grow")["grow-workload"]["metadata"]["annotations"][
        "kueue.x-k8s.io/elastic-job"] == "true"

    kube.run("scale", "rljob", "grow", "-n", namespace, "--replicas=2")
    pods = wait_for(lambda: len(p := live(kube, namespace, "grow")) == 4 and p, "2 trainer + 2 rollout pods")
    assert uids(pods, "trainer") == trainers
    found = slices(kube, namespace, "grow")
    assert finished(found.pop("grow-workload"))["reason"] == "WorkloadSliceReplaced"
    ((name, new),) = found.items()
    assert name.startswith("grow-workload-") and not finished(new)
    assert new["metadata"]["annotations"]["kueue.x-k8s.io/workload-slice-replacement-for"] == \
        f"{namespace}/grow-workload"
    assert new["metadata"]["ownerReferences"][0]["name"] == "grow"
    assert [(s["name"], s["count"]) for s in new["spec"]["podSets"]] == [("trainer", 2), ("rollout", 2)]
    status = kube.job(namespace, "grow")["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0)

    kube.run("scale", "rljob", "grow", "-n", namespace, "--replicas=1")
    pods = wait_for(lambda: len(p := live(kube, namespace, "grow")) == 3 and p, "rollout pod 1 gone")
    assert {p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["rljob.dev/role"] == "rollout"} == {
        "grow-rollout-0"}
    assert uids(pods, "trainer") == trainers
    same = slices(kube, namespace, "grow")[name]
    assert same["metadata"]["uid"] == new["metadata"]["uid"] and not finished(same)
    assert [(s["name"], s["count"]) for s in same["spec"]["podSets"]] == [("trainer", 2), ("rollout", 1)]
    status = kube.job(namespace, "grow")["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0)


def test_a_scale_up_beyond_the_quota_waits_on_the_admitted_count_and_goes_on_when_quota_frees_or_scaled_back(
        kube, operator, namespace):
    """5 GPUs: the job (5) runs; scaled to 3 rollout pods (7) the new slice cannot be admitted, so the job keeps its one
    rollout pod and its gang, RolloutReady says why in Kueue's words; scaled back to 1 the waiting slice goes; scaled to
    2 again and the quota raised to 6, the second rollout pod starts."""
    cq = queues(kube, namespace, gpus=5)
    kube.apply(queued_job("wait"), namespace)
    pods = wait_for(lambda: len(p := live(kube, namespace, "wait")) == 3 and p, "2 trainer + 1 rollout pods")
    trainers = uids(pods, "trainer")
    kube.run("scale", "rljob", "wait", "-n", namespace, "--replicas=3")
    ready = wait_for(lambda: (r := kube.condition(namespace, "wait", "RolloutReady")).get("reason") ==
                     "ScaleUpWaitingForQuota" and "insufficient" in r["message"] and r, "the scale-up waiting")
    assert ready["status"] == "False"
    assert "spec.rollout.replicas 3 waits for Kueue to admit Workload slice wait-workload-" in ready["message"]
    assert "QuotaReserved=False (Pending): " in ready["message"]
    assert ready["message"].endswith("the job runs 1 rollout pods on Workload wait-workload meanwhile")
    assert kube.job(namespace, "wait")["status"]["phase"] not in ("Pending", "Restarting")
    pods = live(kube, namespace, "wait")
    assert len(pods) == 3 and uids(pods, "trainer") == trainers

    kube.run("scale", "rljob", "wait", "-n", namespace, "--replicas=1")
    wait_for(lambda: list(slices(kube, namespace, "wait")) == ["wait-workload"], "the waiting slice deleted")
    wait_for(lambda: kube.condition(namespace, "wait", "RolloutReady").get("reason") != "ScaleUpWaitingForQuota",
             "RolloutReady without the wait")

    kube.run("scale", "rljob", "wait", "-n", namespace, "--replicas=2")
    wait_for(lambda: kube.condition(namespace, "wait", "RolloutReady").get("reason") == "ScaleUpWaitingForQuota",
             "the scale-up to 2 waiting")
    kube.run("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([{
        "op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota", "value": 6}]))
    pods = wait_for(lambda: len(p := live(kube, namespace, "wait")) == 4 and p, "the second rollout pod")
    assert uids(pods, "trainer") == trainers
    status = kube.job(namespace, "wait")["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0)
