"""The environment server the operator runs (issue 27 items 1 and 4) against the real API server of the local control
plane, with its controllers (the Deployment's ReplicaSet makes the pods) and the operator as a process under the
chart's RBAC. No kubelet: pods are bound to a Node with no kubelet behind it and their status is written the way a
kubelet would (test_cluster.kubelet_status). The NetworkPolicy is stored and validated by the API server, not enforced
(no policy CNI here)."""

from __future__ import annotations

import json
import uuid

import pytest

from test_cluster import Kube, bind, job_manifest, kubelet_status, wait_for
from test_cluster import installed, kube, namespace, operator  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cluster]

SERVER = {"image": "ghcr.io/example/guess:1", "args": ["serve"], "port": 9000, "replicas": 1,
          "resources": {"requests": {"cpu": "100m"}}}


def environment_job(name: str) -> dict:
    return job_manifest(name, rollout={"replicas": 1, "task": {"name": "environment"},
                                       "environment": {"server": SERVER}})


def live(kube: Kube, namespace: str, role: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kube.pods(namespace, role) if not p["metadata"].get("deletionTimestamp")}


def condition(kube: Kube, namespace: str, name: str, reason: str) -> dict:
    return wait_for(lambda: (r := kube.condition(namespace, name, "EnvironmentReady")).get("reason") == reason and r,
                    f"EnvironmentReady reason {reason}")


def test_an_environment_server_is_owned_sandboxed_named_in_environment_ready_and_rolled_alone(kube, operator,
                                                                                              namespace):
    kube.apply(environment_job("env"), namespace)
    job = wait_for(lambda: (j := kube.job(namespace, "env")) and (j.get("status") or {}).get("gangCreated") and j,
                   "the gang")
    objects = {kind: wait_for(lambda: kube.json("get", kind, "env-environment", "-n", namespace), kind)
               for kind in ("deployment", "service", "networkpolicy")}
    for obj in objects.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "RLTrainingJob", "env", job["metadata"]["uid"], True)
    policy = objects["networkpolicy"]["spec"]  # as the API server validated and stored it
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "rljob.dev/job-name": "env", "rljob.dev/role": "rollout"}}}], "ports": [{"protocol": "TCP", "port": 9000}]}]
    assert policy["egress"] == [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    assert objects["service"]["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": 9000,
                                                    "protocol": "TCP"}]

    # the ReplicaSet made the pod from the sandboxed template
    (pod_name, pod), = wait_for(lambda: list(live(kube, namespace, "environment").items()), "an environment pod")
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsUser"] == 65532
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any(m["mountPath"].startswith("/var/run/secrets") for m in container.get("volumeMounts", []))
    assert condition(kube, namespace, "env", "Unschedulable")["status"] == "False"

    node = f"ghost-{uuid.uuid4().hex[:6]}"  # made only now: the node controller taints a silent node within seconds
    kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    try:
        bind(kube, namespace, pod_name, node)
        kubelet_status(kube, namespace, pod_name, "Pending", {"name": "environment", "state": {"waiting": {
            "reason": "ErrImagePull", "message": 'failed to pull image "ghcr.io/example/guess:1": not found'}}})
        pulling = condition(kube, namespace, "env", "ContainerCannotStart")
        assert pulling["status"] == "False" and pulling["message"] == (
            "environment server env-environment (http://env-environment." + namespace + ".svc.cluster.local:9000): "
            f"0/1 environment pods ready; cannot start: {pod_name}: spec.rollout.environment.server.image "
            "'ghcr.io/example/guess:1' cannot be pulled: container environment ErrImagePull: failed to pull image "
            '"ghcr.io/example/guess:1": not found')
        assert wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                                 if e["involvedObject"]["kind"] == "RLTrainingJob"
                                 and e["reason"] == "ContainerCannotStart"], "a ContainerCannotStart Event"
                        )[0]["type"] == "Warning"

        kubelet_status(kube, namespace, pod_name, "Running", {"name": "environment", "state": {"running": {
            "startedAt": "2026-01-01T12:00:00Z"}}})
        ready = condition(kube, namespace, "env", "EnvironmentAvailable")
        assert ready["status"] == "True" and ready["message"].endswith(":9000): 1/1 replicas available")
    finally:
        kube.run("delete", "node", node, "--wait=false", check=False)

    # an edit of the server's image rolls its pods alone: the gang and the rollout pod stay
    keep = {n: p["metadata"]["uid"] for role in ("trainer", "rollout") for n, p in live(kube, namespace, role).items()}
    patch = ["patch", "rljob", "env", "-n", namespace, "--type=merge", "-p"]
    kube.run(*patch, json.dumps({"spec": {"rollout": {"environment": {"server": {"image": "ghcr.io/example/guess:2"}}}}}))
    wait_for(lambda: kube.json("get", "deployment", "env-environment", "-n", namespace)["spec"]["template"]["spec"]
             ["containers"][0]["image"] == "ghcr.io/example/guess:2", "the Deployment's new image")
    # a rolling update: the new ReplicaSet's pod comes first (the old one goes once it is ready, which no kubelet
    # here makes it)
    wait_for(lambda: "ghcr.io/example/guess:2" in [p["spec"]["containers"][0]["image"]
                                                  for p in live(kube, namespace, "environment").values()],
             "a pod of the new image")
    assert {n: p["metadata"]["uid"] for role in ("trainer", "rollout")
            for n, p in live(kube, namespace, role).items()} == keep
    status = kube.job(namespace, "env")["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0)

    # suspended: no environment pod, the Deployment kept at 0 replicas; resumed: back
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    wait_for(lambda: kube.json("get", "deployment", "env-environment", "-n", namespace)["spec"]["replicas"] == 0,
             "the environment scaled to 0")
    assert condition(kube, namespace, "env", "JobSuspended")["status"] == "False"
    wait_for(lambda: not live(kube, namespace, "environment"), "no environment pod")
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    wait_for(lambda: kube.json("get", "deployment", "env-environment", "-n", namespace)["spec"]["replicas"] == 1,
             "the environment scaled back to 1")

    # another task: the environment's children go (the task name is read by the trainer: the gang restarts)
    kube.run(*patch, json.dumps({"spec": {"rollout": {"task": {"name": "digits-copy"}, "environment": None}}}))
    wait_for(lambda: not kube.json("get", "deployments,services,networkpolicies", "-n", namespace, "-l",
                                   "rljob.dev/job-name=env,rljob.dev/role=environment")["items"],
             "the environment's children deleted")
    wait_for(lambda: not kube.condition(namespace, "env", "EnvironmentReady") or None, "no EnvironmentReady")

    kube.run("delete", "rljob", "env", "-n", namespace, "--timeout=60s")
    wait_for(lambda: not kube.json("get", "deployments,services", "-n", namespace, "-l",
                                   "rljob.dev/job-name=env")["items"], "garbage collection", timeout=60)


def test_a_job_whose_pods_the_api_server_refuses_runs_no_environment_pod(kube, operator, namespace):
    """limits.cpu "-2" passes the CRD but not Pod validation: the job is Invalid with nothing to go on with, and its
    environment server, applied before the refused trainer pod, is scaled to 0."""
    manifest = environment_job("badenv")
    manifest["spec"]["trainer"]["resources"] = {"limits": {"cpu": "-2"}}
    kube.apply(manifest, namespace)
    wait_for(lambda: kube.condition(namespace, "badenv", "Valid").get("status") == "False", "Valid=False")
    wait_for(lambda: (d := kube.json("get", "deployment", "badenv-environment", "-n", namespace)) is not None
             and d["spec"]["replicas"] == 0, "the environment at 0 replicas")
    ready = condition(kube, namespace, "badenv", "InvalidSpec")
    assert ready["status"] == "False" and ready["message"].startswith("spec.trainer.resources: the API server refused")
    assert kube.job(namespace, "badenv")["status"]["phase"] == "Invalid"
