"""The /scale subresource (issue 28 item 3) and status.capacity (item 1, the operator half) against the real API server
of the local control plane, with the operator as a process under the chart's RBAC and a real Redis. No kubelet: pods
stay Pending, and a deleted one goes at once."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

from test_cluster import Kube, external_redis, job_manifest, quiet_for, wait_for
from test_cluster import installed, kube, namespace, operator  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cluster]

SELECTOR = "rljob.dev/job-name={job},rljob.dev/role=rollout"


def live(kube: Kube, namespace: str, role: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kube.pods(namespace, role) if not p["metadata"].get("deletionTimestamp")}


def scale_of(kube: Kube, namespace: str, name: str) -> dict:
    return kube.json("get", "rljob", name, "-n", namespace, "--subresource=scale")


def test_kubectl_scale_moves_the_rollout_replicas_and_never_the_gang(kube, operator, namespace, tmp_path):
    kube.apply(job_manifest("sc"), namespace)
    wait_for(lambda: len(live(kube, namespace, "trainer")) == 2 and len(live(kube, namespace, "rollout")) == 1
             and (kube.job(namespace, "sc").get("status") or {}).get("gangCreated"), "the gang and 1 rollout pod")
    trainers = {n: (p["metadata"]["uid"], p["metadata"]["labels"]["rljob.dev/attempt"])
                for n, p in live(kube, namespace, "trainer").items()}
    scale = wait_for(lambda: (s := scale_of(kube, namespace, "sc"))["status"].get("replicas") == 1 and s,
                     "the scale subresource's status")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 1}
    assert scale["status"] == {"replicas": 1, "selector": SELECTOR.format(job="sc")}

    # a user who may only read and scale (the Role docs/scaling.md and the chart's README show): kubectl scale reads
    # the job first, then writes its scale subresource; a write to the job itself stays forbidden
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "rljob-scaler"},
                "rules": [{"apiGroups": ["rljob.dev"], "resources": ["rltrainingjobs"], "verbs": ["get"]},
                          {"apiGroups": ["rljob.dev"], "resources": ["rltrainingjobs/scale"],
                           "verbs": ["get", "update", "patch"]}]}, namespace)
    kube.run("create", "rolebinding", "rljob-scaler", "-n", namespace, "--role=rljob-scaler", "--user=scaler")
    config = kube.cp.write_kubeconfig(tmp_path / "scaler", "scaler")

    def as_scaler(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(kube.cp.bin_dir / "kubectl"), f"--kubeconfig={config}", "-n", namespace, *args],
                              capture_output=True, text=True, timeout=60)

    refused = as_scaler("patch", "rljob", "sc", "--type=merge", "-p", '{"spec":{"rollout":{"replicas":5}}}')
    assert refused.returncode != 0 and "forbidden" in refused.stderr
    scaled = as_scaler("scale", "rljob", "sc", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    assert kube.job(namespace, "sc")["spec"]["rollout"]["replicas"] == 3
    wait_for(lambda: sorted(live(kube, namespace, "rollout")) == ["sc-rollout-0", "sc-rollout-1", "sc-rollout-2"],
             "3 rollout pods")
    assert wait_for(lambda: (s := scale_of(kube, namespace, "sc"))["status"]["replicas"] == 3 and s,
                    "status.replicas 3")["spec"] == {"replicas": 3}
    selected = kube.json("get", "pods", "-n", namespace, "-l", scale_of(kube, namespace, "sc")["status"]["selector"])
    assert sorted(p["metadata"]["name"] for p in selected["items"]) == sorted(live(kube, namespace, "rollout"))

    kube.run("scale", "rljob", "sc", "-n", namespace, "--replicas=1")
    wait_for(lambda: sorted(live(kube, namespace, "rollout")) == ["sc-rollout-0"], "1 rollout pod")
    wait_for(lambda: scale_of(kube, namespace, "sc")["status"]["replicas"] == 1, "status.replicas 1")
    assert kube.run("scale", "rljob", "sc", "-n", namespace, "--replicas=-1", check=False).returncode != 0
    time.sleep(3)  # three active intervals: a restart would have begun
    assert {n: (p["metadata"]["uid"], p["metadata"]["labels"]["rljob.dev/attempt"])
            for n, p in live(kube, namespace, "trainer").items()} == trainers
    status = kube.job(namespace, "sc")["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0)
    assert not [e for e in kube.json("get", "events", "-n", namespace)["items"] if e["reason"] == "ConfigChanged"]


def test_capacity_reports_reach_status_and_the_operators_metrics(kube, operator, namespace, redis_server):
    kube.apply(job_manifest("cap", rollout={"replicas": 2}, redis=external_redis(kube, namespace, redis_server)),
               namespace)
    prefix = f"rljob:{namespace}:cap:"
    client = redis_server.client()
    now = time.time()
    client.hset(prefix + "progress", mapping={"step": 3, "updated_at": repr(now), "metrics": json.dumps(
        {"data_wait_share": 0.4137, "step_time_ms": 800.0})})

    def worker(held: float, tokens: float, at: float) -> str:
        return json.dumps({"version": 0, "samples_per_second": 1.0, "updated_at": at, "held_share": held,
                           "tokens_per_second": tokens, "held_seconds": 1.0, "window_s": 30.0})

    client.hset(prefix + "rollout", mapping={
        "worker:0": worker(0.0, 512.0, now), "worker:1": json.dumps({"version": 0, "updated_at": now}),  # no fields
        "worker:5": worker(1.0, 99.0, now),  # a replica index the spec no longer has
    })
    stream = prefix + "fast_llm_streaming"  # the default stream and group, under an external Redis's prefix
    client.xgroup_create(stream, "fast_llm_group", id="0", mkstream=True)
    for _ in range(3):
        client.xadd(stream, {"data": "x"})
    client.xreadgroup("fast_llm_group", "fast_llm_consumer_0", {stream: ">"}, count=1)  # 1 pending, 2 undelivered
    capacity = wait_for(lambda: (kube.job(namespace, "cap").get("status") or {}).get("capacity", {}).get(
        "replicasReporting") == 1 and kube.job(namespace, "cap")["status"]["capacity"], "status.capacity")
    assert {k: v for k, v in capacity.items() if k != "observedAt"} == {
        "dataWaitShare": 0.41, "heldShare": 0.0, "tokensPerSecond": 510.0, "tokensPerSecondPerReplica": 510.0,
        "pending": 1, "undelivered": 2, "replicasReporting": 1}
    # settled (the gang created, its pods unschedulable: no node here), then reports that only jitter write nothing
    settled = wait_for(lambda: (job := kube.job(namespace, "cap"))["status"].get("gangCreated") and all(
        c["reason"] == "Unschedulable" for c in job["status"]["conditions"] if c["type"] in ("TrainerReady",
                                                                                             "RolloutReady")) and job,
        "the gang created and its pods unschedulable")
    client.hset(prefix + "rollout", "worker:0", worker(0.01, 530.0, time.time()))
    client.hset(prefix + "progress", mapping={"updated_at": repr(time.time()), "metrics": json.dumps(
        {"data_wait_share": 0.4234, "step_time_ms": 810.0})})
    quiet_for(kube, namespace, "cap", settled, seconds=3.0)  # three active intervals, each reading Redis
    assert kube.job(namespace, "cap")["status"]["capacity"] == capacity
    text = urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics}/metrics", timeout=10).read().decode()
    labels = f'job_name="cap",job_namespace="{namespace}"'
    assert f"rljob_operator_job_data_wait_share{{{labels}}} 0.41" in text
    assert f"rljob_operator_job_rollout_replicas_reporting{{{labels}}} 1.0" in text
    assert f"rljob_operator_job_rollout_tokens_per_second{{{labels}}} 510.0" in text


def test_the_autoscaler_adds_rollouts_for_a_waiting_trainer_keeps_the_count_in_status_and_never_the_gang(
        kube, operator, namespace, redis_server):
    kube.apply(job_manifest("auto", rollout={"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 4, "cooldownSeconds": 15}},
        redis=external_redis(kube, namespace, redis_server)), namespace)
    wait_for(lambda: len(live(kube, namespace, "trainer")) == 2 and len(live(kube, namespace, "rollout")) == 1,
             "the gang and the starting rollout")
    trainers = {name: p["metadata"]["uid"] for name, p in live(kube, namespace, "trainer").items()}
    wait_for(lambda: (kube.job(namespace, "auto").get("status") or {}).get("autoscaling") == {"replicas": 1},
             "status.autoscaling with the starting count")
    prefix = f"rljob:{namespace}:auto:"
    client = redis_server.client()
    stream = prefix + "fast_llm_streaming"
    client.xgroup_create(stream, "fast_llm_group", id="0", mkstream=True)
    client.xadd(stream, {"data": "x"})  # one undelivered entry
    now = time.time()
    client.hset(prefix + "progress", mapping={"step": 3, "updated_at": repr(now), "metrics": json.dumps(
        {"data_wait_share": 0.5, "step_time_ms": 800.0})})
    client.hset(prefix + "rollout", "worker:0", json.dumps(
        {"version": 0, "samples_per_second": 1.0, "updated_at": now, "held_share": 0.0, "tokens_per_second": 300.0,
         "held_seconds": 0.0, "window_s": 30.0}))
    # needed = 1 × (1 − 0) / (1 − 0.5) = 2, of which ceil(2 × 0.95) = 2 keep the wait at the 5% target; the first
    # decision comes a cooldown (15 s) after the job started, the next not before another one
    status = wait_for(lambda: (s := kube.job(namespace, "auto")["status"]).get("autoscaling", {}).get("replicas") == 2
                      and s, "the autoscaler's count", timeout=60)
    client.hset(prefix + "progress", mapping={"updated_at": repr(time.time()), "metrics": json.dumps(
        {"data_wait_share": 0.0, "step_time_ms": 800.0})})  # fed now: the law holds after the cooldown too
    assert status["autoscaling"]["lastDecision"].startswith("rollout replicas 1 → 2: the trainer waits for data and "
                                                            "the rollouts are not held; trainer data-wait 50.0%")
    wait_for(lambda: len(live(kube, namespace, "rollout")) == 2, "a second rollout pod")
    job = kube.job(namespace, "auto")
    assert job["spec"]["rollout"]["replicas"] == 1  # the spec is never written
    assert {name: p["metadata"]["uid"] for name, p in live(kube, namespace, "trainer").items()} == trainers
    assert job["status"]["attempt"] == 0 and job["status"].get("restarts", 0) == 0
    events = kube.json("get", "events", "-n", namespace, "--field-selector",
                       "involvedObject.name=auto,reason=RolloutsScaled")["items"]
    assert [e["message"] for e in events] == [status["autoscaling"]["lastDecision"]]
