"""Faults of the control side (issue 11 item 8), injected from outside on real kubelets (marker ``chaos``):

- the operator killed between creating the pods of a gang: a ValidatingAdmissionPolicy refuses trainer pod 1
  (Forbidden), so the operator has created pod 0 and keeps retrying pod 1; its process is then SIGKILLed (its
  container restarts) and the policy lifted. The new operator process completes the same gang: both trainer pods
  belong to attempt 0 with one config hash, the gang trains, nothing counts as a restart;
- then the namespace of that running job deleted: the job, its pods, Redis, the claims and their volumes all go, the
  namespace is gone within three minutes (kopf's finalizer is released), and the operator goes on without a restart
  or an error.

One job for both faults: a job's start costs a minute of the CI budget.
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest
from rljob_api import constants as c

from .conftest import checkpointed_job, get_job, wait_for
from .faults import command_line, pod_pids, signal_all

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

PER_STEP = 64


def _policy(name: str, namespace: str, refused_pod: str) -> list[dict]:
    """A ValidatingAdmissionPolicy and its binding refusing (403 Forbidden) the creation of pod ``refused_pod`` in
    ``namespace``."""
    return [{
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE"], "resources": ["pods"]}]},
                 "validations": [{"expression": f"object.metadata.name != '{refused_pod}'",
                                  "message": f"chaos test: {refused_pod} refused", "reason": "Forbidden"}]},
    }, {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}},
    }]


def _operator_pod(operator) -> dict:
    (pod,) = [p for p in operator.pods() if not p["metadata"].get("deletionTimestamp")]
    return pod


def _kill_operator(operator) -> int:
    """SIGKILL every process of the operator's container (not the sandbox's pause); returns its restart count before."""
    pod = _operator_pod(operator)
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    pids = [pid for pid in pod_pids(pod["metadata"]["uid"]) if not command_line(pid).startswith("/pause")]
    assert pids, "no operator process found on the host"
    signal_all(pids, signal.SIGKILL)
    return restarts


def test_operator_killed_between_the_pods_of_a_gang_then_the_namespace_deleted(cluster, operator, namespace,
                                                                              diagnostics):
    if cluster.nodes is None:
        pytest.skip("OPERATOR KILL NOT TESTED: --cluster=existing (the test signals the operator's host process)")
    name = "op-kill"
    diagnostics.job = name
    refused = f"{name}-trainer-1"
    policy = f"rljob-chaos-{uuid.uuid4().hex[:6]}"
    manifest = checkpointed_job(cluster, namespace, name, 5, {
        "trainer": {"nodes": 2, "processesPerNode": 1, "maxSteps": 10_000, "batch": {"documentsPerStep": PER_STEP}},
        "runPolicy": {"cleanPodPolicy": "None"},
    })
    for obj in _policy(policy, namespace, refused):
        cluster.apply(obj, namespace)
    try:
        # The policy is enforced once the API server has loaded it: a probe pod of that name is refused.
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": refused},
                 "spec": {"containers": [{"name": "x", "image": "registry.k8s.io/pause:3.10"}]}}
        wait_for(lambda: "chaos test" in cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                                                          input=json.dumps(probe), check=False).stderr,
                 60, "the admission policy to be enforced", diagnostics)
        cluster.apply(manifest, namespace)
        wait_for(lambda: cluster.get("pod", f"{name}-trainer-0", "-n", namespace), 180, "trainer pod 0", diagnostics)
        wait_for(lambda: "chaos test" in operator.logs(200), 60, "the operator to be refused pod 1", diagnostics)
        assert cluster.get("pod", refused, "-n", namespace) is None
        restarts = _kill_operator(operator)
        wait_for(lambda: (cs := _operator_pod(operator)["status"]["containerStatuses"][0])["restartCount"] > restarts
                 and cs.get("ready"), 120, "the operator's container to restart", diagnostics)
    finally:
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            cluster.kubectl("delete", kind, policy, "--ignore-not-found", check=False)
    # The new operator process completed attempt 0's gang: both pods, one config hash, training goes on.
    job = wait_for(lambda: ((j := get_job(cluster, namespace, name)).get("status") or {}).get("step", 0) >= 2 and j,
                   300, "the completed gang to train", diagnostics)
    status = job["status"]
    assert (status["attempt"], status["restarts"], status["failedAttempts"]) == (0, 0, 0), status
    assert status["dataParallelSize"] == 2, status
    trainers = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=trainer")
    assert sorted(p["metadata"]["name"] for p in trainers) == [f"{name}-trainer-0", refused], trainers
    assert {p["metadata"]["labels"][c.LABEL_ATTEMPT] for p in trainers} == {"0"}
    assert len({p["metadata"]["labels"][c.LABEL_CONFIG_HASH] for p in trainers}) == 1
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in trainers), trainers

    # Then the namespace of the running job deleted: everything goes, the operator goes on.
    claims = {p["spec"]["volumeName"] for p in cluster.items("pvc", namespace) if p["spec"].get("volumeName")}
    assert len(claims) == 2, claims  # the checkpoints' and Redis's
    pod = _operator_pod(operator)
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    t0 = time.monotonic()
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    wait_for(lambda: cluster.get("namespace", namespace) is None, 180, f"namespace {namespace} to be gone",
             diagnostics)
    took = time.monotonic() - t0
    wait_for(lambda: not (claims & {pv["metadata"]["name"] for pv in cluster.items("pv", "default")}), 120,
             "the job's volumes to be deleted", diagnostics)
    print(f"namespace gone {took:.0f} s after its deletion")
    after = _operator_pod(operator)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == restarts
    since = f"--since={int(time.monotonic() - t0) + 5}s"
    logs = cluster.kubectl("logs", "-n", operator.namespace, after["metadata"]["name"], since).stdout
    assert "Traceback" not in logs and namespace in logs, logs[-4000:]  # it saw the deletion and raised nothing
