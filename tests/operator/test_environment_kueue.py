"""An environment server under Kueue (issue 27 item 1): its pods are a pod set of the job's Workload, run only while
the Workload is admitted (on the flavor's nodes) and go with an eviction, whose quota comes back once they are gone.
The real Kueue manager and API server of the local control plane, the operator as a process under the chart's RBAC
(no nodes: admission needs none)."""

from __future__ import annotations

import json

import pytest

from test_cluster import Kube, job_manifest, wait_for
from test_cluster import installed, kube, namespace, operator  # noqa: F401  (fixtures)
from test_kueue_queueing import GPU, JOB, POOL_LABEL, kueue, queues, workload_condition  # noqa: F401  (kueue: fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.kueue]

# trainer 2 pods x 2 GPUs, rollout 1 x 1, environment server 1 x 1: 6 GPUs for the whole job
SERVER = {"image": "ghcr.io/example/guess:1", "replicas": 1, "resources": {"limits": {GPU: 1}}}


def queued_environment_job(name: str, priority: str) -> dict:
    manifest = job_manifest(name, trainer=JOB["trainer"],
                            rollout={**JOB["rollout"], "task": {"name": "environment"},
                                     "environment": {"server": SERVER}})
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "lq", "kueue.x-k8s.io/priority-class": priority}
    return manifest


def environment(kube: Kube, namespace: str, job: str) -> dict:
    return kube.json("get", "deployment", f"{job}-environment", "-n", namespace) or {}


def environment_pods(kube: Kube, namespace: str, job: str) -> list[dict]:
    return [p for p in kube.pods(namespace, "environment") if p["metadata"]["labels"]["rljob.dev/job-name"] == job
            and not p["metadata"].get("deletionTimestamp")]


def test_environment_pods_count_in_the_workload_run_only_while_admitted_and_go_with_an_eviction(kube, operator,
                                                                                                 namespace):
    cq = queues(kube, namespace, gpus=5, preempt=True)  # one GPU short of the job with its environment server
    for name, value in (("rljob-env-low", 10), ("rljob-env-high", 1000)):
        kube.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                    "metadata": {"name": name}, "value": value})
    kube.apply(queued_environment_job("envq", "rljob-env-low"), namespace)
    wait_for(lambda: (c := kube.condition(namespace, "envq", "Running")).get("reason") == "WaitingForAdmission"
             and "insufficient" in c["message"], "held for want of the sixth GPU")
    wl = kube.json("get", "workloads.kueue.x-k8s.io", "envq-workload", "-n", namespace)
    assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [("trainer", 2), ("rollout", 1),
                                                                        ("environment", 1)]
    assert wait_for(lambda: environment(kube, namespace, "envq"), "the Deployment")["spec"]["replicas"] == 0
    ready = wait_for(lambda: (r := kube.condition(namespace, "envq", "EnvironmentReady")).get("reason")
                     == "WaitingForAdmission" and r, "EnvironmentReady held")
    assert ready["status"] == "False" and environment_pods(kube, namespace, "envq") == []

    kube.run("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([{
        "op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota", "value": 6}]))
    pods = wait_for(lambda: environment_pods(kube, namespace, "envq"), "the environment pod once admitted")
    assert pods[0]["spec"]["nodeSelector"] == {POOL_LABEL: namespace}  # placed on the flavor's nodes
    assert environment(kube, namespace, "envq")["spec"]["replicas"] == 1
    assignment = {a["name"]: a["flavors"] for a in kube.json("get", "workloads.kueue.x-k8s.io", "envq-workload", "-n",
                                                               namespace)["status"]["admission"]["podSetAssignments"]}
    assert assignment["environment"] == {GPU: namespace}
    wait_for(lambda: (kube.job(namespace, "envq").get("status") or {}).get("gangCreated"), "the gang created")

    # a job of higher priority preempts it: its environment server goes too, then Kueue gets the quota back
    high = job_manifest("envhigh", trainer={"nodes": 2, "resources": {"limits": {GPU: 3}}}, rollout={"replicas": 0})
    high["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "lq", "kueue.x-k8s.io/priority-class": "rljob-env-high"}
    kube.apply(high, namespace)
    wait_for(lambda: kube.condition(namespace, "envq", "Running").get("reason") == "EvictedByKueue", "evicted")
    wait_for(lambda: environment(kube, namespace, "envq")["spec"]["replicas"] == 0, "the environment scaled to 0")
    wait_for(lambda: not environment_pods(kube, namespace, "envq"), "no environment pod")
    wait_for(lambda: workload_condition(kube, namespace, "envq", "Requeued").get("status") == "True",
             "the quota given back (Requeued)")

    kube.run("delete", "rljob", "envhigh", "-n", namespace, "--timeout=60s")
    wait_for(lambda: environment(kube, namespace, "envq")["spec"]["replicas"] == 1, "the environment back")
    status = wait_for(lambda: (s := kube.job(namespace, "envq")["status"]).get("gangCreated") and s, "resumed")
    assert (status["restarts"], status["failedAttempts"]) == (0, 0)
