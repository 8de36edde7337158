"""A job whose trainer and rollout pods carry pod templates (labels, annotations, env, a volume and its mount, a
ServiceAccount, an init container and a native sidecar) trains to Succeeded on real kubelets: every trainer pod reaches
Succeeded although a sidecar runs beside the trainer container (the kubelet stops it once the trainer has exited),
and the init container ran to completion before it."""

from __future__ import annotations

import pytest
from rljob_api import constants as c

from .conftest import condition, get_job, load_example, phase, wait_for

pytestmark = pytest.mark.e2e

MAX_STEPS = 20
SIDECAR = ("trap 'echo sidecar: stopped; exit 0' TERM; echo sidecar: started; "
           "while true; do sleep 1; done")


def _template(role: str, image: str) -> dict:
    return {
        "metadata": {"labels": {"team": "rl"}, "annotations": {"example.com/owner": "e2e"}},
        "spec": {
            "serviceAccountName": "rl-pods",
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "initContainers": [
                {"name": "prepare", "image": image, "command": ["sh", "-c", "echo prepared > /scratch/ready; "
                                                                            "cat /scratch/ready"],
                 "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
                {"name": "sidecar", "image": image, "restartPolicy": "Always", "command": ["sh", "-c", SIDECAR]},
            ],
            "containers": [{"name": role, "env": [{"name": "RLJOB_E2E_MARKER", "value": role}],
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch", "readOnly": True}]}],
        },
    }


def test_a_job_with_pod_templates_and_a_native_sidecar_trains_to_succeeded(cluster, operator, namespace, diagnostics):
    job = load_example("rljob-cpu.yaml")
    name = job["metadata"]["name"]
    diagnostics.job = name
    spec = job["spec"]
    spec["trainer"]["maxSteps"] = MAX_STEPS
    del spec["trainer"]["checkpoint"]["volume"]  # no claim: this test is about the pods
    spec["runPolicy"]["cleanPodPolicy"] = "None"  # keep the finished pods to read their states
    for role in ("trainer", "rollout"):
        spec[role]["podTemplate"] = _template(role, spec[role]["image"])
    cluster.kubectl("create", "serviceaccount", "rl-pods", "-n", namespace)
    cluster.apply(job, namespace)

    final = wait_for(lambda: phase(j := get_job(cluster, namespace, name)) in ("Succeeded", "Failed") and j,
                     600, "the job to finish", diagnostics)
    assert phase(final) == "Succeeded", diagnostics()
    assert final["status"]["step"] == MAX_STEPS and final["status"]["restarts"] == 0, final["status"]
    assert condition(final, c.ConditionType.VALID)["status"] == "True"

    trainers = wait_for(lambda: (ps := cluster.items("pods", namespace, f"{c.LABEL_ROLE}=trainer"))
                        and all(p["status"].get("phase") == "Succeeded" for p in ps) and ps,
                        120, "every trainer pod Succeeded", diagnostics)
    assert len(trainers) == 2
    for pod in trainers:
        meta, pod_spec, status = pod["metadata"], pod["spec"], pod["status"]
        assert meta["labels"]["team"] == "rl" and meta["annotations"]["example.com/owner"] == "e2e"
        assert pod_spec["serviceAccountName"] == "rl-pods"
        assert [ct["name"] for ct in pod_spec["containers"]] == ["trainer"]
        init = {s["name"]: s for s in status["initContainerStatuses"]}
        assert init["prepare"]["state"]["terminated"]["exitCode"] == 0, init
        assert init["sidecar"]["state"].get("terminated") is not None, init  # stopped after the trainer exited
        (trainer,) = status["containerStatuses"]
        assert trainer["state"]["terminated"]["exitCode"] == 0, trainer
        logs = cluster.kubectl("logs", "-n", namespace, meta["name"], "-c", "prepare").stdout
        assert "prepared" in logs, logs
        sidecar_log = cluster.kubectl("logs", "-n", namespace, meta["name"], "-c", "sidecar").stdout
        assert "sidecar: started" in sidecar_log, sidecar_log
    (rollout,) = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=rollout")
    assert rollout["metadata"]["labels"]["team"] == "rl"
    env = {e["name"]: e.get("value") for e in rollout["spec"]["containers"][0]["env"]}
    assert env["RLJOB_E2E_MARKER"] == "rollout"
