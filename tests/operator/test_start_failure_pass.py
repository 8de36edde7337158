"""Issue 24's job, ``model: {source: huggingface, name: Qwen/Qwen2.5-0.5B-Instruct}`` on a cluster that has neither the
model nor the network, against the real API server of the local control plane (no kubelet: pod status is written as a
kubelet writes it), a real Redis and the real rollout process: while the trainer has not reported the attempt's start
the job is Starting (TrainerStarting), not Running; once it has, Running; the rollout pod's permanent start failure
(its termination message, written by the process) fails the job at once with StartFailed naming spec.model.name and
its value, no restart counted."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from helm_tools import helm_binary
from rljob_api import protocol
from start_cases import run_entry, unloadable
from test_cluster import Kube, job_manifest, kubelet_status
from test_pass import pass_with_pods

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(helm_binary() is None, reason="helm is not built: run localcluster/build-go-tools.sh"),
]

from test_cluster import installed, kube, namespace  # noqa: E402,F401  (fixtures)

RUNS = {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T12:00:02Z"}}}


def conditions(kube: Kube, namespace: str, name: str) -> dict[str, tuple[str, str, str]]:
    return {cond["type"]: (cond["status"], cond["reason"], cond["message"])
            for cond in kube.job(namespace, name)["status"]["conditions"]}


@pytest.mark.timeout(300)
def test_a_model_no_pod_can_load_is_starting_then_fails_at_once_in_the_rollouts_words(
        kube: Kube, installed, namespace, redis_server, tmp_path):
    kube.run("create", "secret", "generic", "shared-redis", "-n", namespace,
             f"--from-literal=password={redis_server.password}")
    model, extra, said = unloadable("hub-offline", tmp_path)
    kube.apply(job_manifest("qwen", model=model, trainer={"nodes": 1},
                            redis={"mode": "external", "url": redis_server.url,
                                   "passwordSecretRef": {"name": "shared-redis", "key": "password"}}), namespace)
    events: list = []
    now = datetime.now(timezone.utc)
    pass_with_pods(installed, kube, namespace, "qwen", now=now, events=events)

    # The pods run; the trainer has not reported the attempt's start (no progress hash): Starting, not Running.
    kubelet_status(kube, namespace, "qwen-trainer-0", "Running", RUNS)
    kubelet_status(kube, namespace, "qwen-rollout-0", "Running", {**RUNS, "name": "rollout"})
    pass_with_pods(installed, kube, namespace, "qwen", now=now, events=events)
    job = kube.job(namespace, "qwen")
    assert job["status"]["phase"] == "Starting"
    assert conditions(kube, namespace, "qwen")["Running"] == (
        "False", "TrainerStarting", "attempt 0: the trainer pod is running; the trainer is loading the model and the "
        "newest checkpoint: no step before its rank 0 reports the attempt's start")
    assert conditions(kube, namespace, "qwen")["TrainerReady"][0] == "True"

    # Rank 0's start, as publish_start writes it: Running.
    client = redis_server.client()
    progress = protocol.key_prefix(namespace, "qwen") + protocol.KEY_PROGRESS
    client.hset(progress, mapping=protocol.start_fields(0, 0, attempt=0))
    pass_with_pods(installed, kube, namespace, "qwen", now=now, events=events)
    assert kube.job(namespace, "qwen")["status"]["phase"] == "Running"
    assert conditions(kube, namespace, "qwen")["Running"][:2] == ("True", "Training")

    # The rollout process as the pod runs it, on the job's recorded config: it cannot load the tokenizer, for good.
    config = tmp_path / "config.json"
    config.write_text(kube.json("get", "configmap", "qwen-config", "-n", namespace)["data"]["config.json"])
    ended = run_entry(["-m", "rljob_rollout"], config, tmp_path / "termination-log", extra,
                      password=redis_server.password)
    assert ended.returncode == 78, ended.stderr[-3000:]
    kubelet_status(kube, namespace, "qwen-rollout-0", "Running", {
        "name": "rollout", "restartCount": 1,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 78, "reason": "Error", "message": ended.termination}}})
    pass_with_pods(installed, kube, namespace, "qwen", now=now, events=events)

    status = kube.job(namespace, "qwen")["status"]
    assert (status["phase"], status["restarts"], status.get("failedAttempts", 0)) == ("Failed", 0, 0)
    failed = conditions(kube, namespace, "qwen")["Failed"]
    assert failed[:2] == ("True", "StartFailed")
    assert failed[2].startswith("rollout pod qwen-rollout-0 cannot start: " + said), failed[2]
    assert failed[2].endswith("; retrying cannot help, so the job failed without a restart: fix the spec and create "
                              "the job again")
    assert [(e.type, e.reason) for e in events if e.reason == "StartFailed"] == [("Warning", "StartFailed")]
    assert "Restarting" not in conditions(kube, namespace, "qwen")
