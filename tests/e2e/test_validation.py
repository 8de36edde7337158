"""Invalid specs: the API server refuses what its CEL rules can see, with a readable message; what only code
can check makes the job Valid=False naming the field, with no child created; fixing the spec recovers the job
without deleting it."""

from __future__ import annotations

import time

import pytest
from rljob_api import constants as c

from .conftest import children, condition, get_job, job_manifest, phase, wait_for

pytestmark = pytest.mark.e2e


def test_api_server_refuses_a_topology_that_does_not_divide(cluster, operator, namespace):
    manifest = job_manifest("bad-topology", {"trainer": {"nodes": 3, "processesPerNode": 1, "tensorParallel": 2}})
    result = cluster.apply(manifest, namespace, check=False)
    assert result.returncode != 0
    message = result.stderr
    assert "spec.trainer.nodes" in message, message
    assert ("nodes 3 × processesPerNode 1 = 3 ranks is not divisible by tensorParallel 2 × pipelineParallel 1 = 2"
            in message), message
    assert get_job(cluster, namespace, "bad-topology") == {}
    odd = cluster.apply(job_manifest("odd-batch", {"trainer": {"batch": {"documentsPerStep": 63}}}), namespace,
                        check=False)  # DP = 2 does not divide 63
    assert odd.returncode != 0 and ('spec.trainer.batch.documentsPerStep: Invalid value: "object": documentsPerStep '
                                    "63 is not divisible by the data-parallel size 2") in odd.stderr, odd.stderr
    assert get_job(cluster, namespace, "odd-batch") == {}


def test_code_only_invalid_spec_reports_the_field_then_recovers(cluster, operator, namespace, diagnostics):
    name = "stalling-checkpoint"
    diagnostics.job = name
    # 512 documents × 10 steps between checkpoints > maxPending 4096: no CEL rule can see it, the operator's check does
    manifest = job_manifest(name, {"trainer": {"checkpoint": {"everySteps": 10}}})
    cluster.apply(manifest, namespace)
    job = wait_for(lambda: phase(j := get_job(cluster, namespace, name)) == "Invalid" and j, 120,
                   "the job to be Invalid", diagnostics)
    valid = condition(job, c.ConditionType.VALID)
    assert (valid["status"], valid["reason"]) == ("False", c.Reason.INVALID_SPEC.value), valid
    assert "spec.trainer.checkpoint.everySteps" in valid["message"], valid
    assert "512 × 10 = 5120 must not exceed spec.redis.maxPending = 4096" in valid["message"], valid
    assert valid["observedGeneration"] == job["metadata"]["generation"]
    time.sleep(5)  # a few reconcile passes: still nothing created
    assert not any(children(cluster, namespace, name).values()), children(cluster, namespace, name)
    events = [e for e in cluster.items("events", namespace) if e["involvedObject"].get("name") == name]
    assert any(e["reason"] == c.Reason.INVALID_SPEC.value and e["type"] == "Warning" for e in events), events

    # Fixed (and suspended, so that nothing trains): valid again, the static children appear.
    cluster.kubectl("patch", "rljob", name, "-n", namespace, "--type=merge", "-p",
                    '{"spec": {"trainer": {"checkpoint": {"everySteps": 5}}, "runPolicy": {"suspend": true}}}')
    job = wait_for(lambda: phase(j := get_job(cluster, namespace, name)) == "Suspended" and j, 120,
                   "the fixed job to be accepted (Suspended)", diagnostics)
    valid = condition(job, c.ConditionType.VALID)
    assert (valid["status"], valid["reason"]) == ("True", c.Reason.SPEC_VALID.value), valid
    assert valid["observedGeneration"] == job["metadata"]["generation"] == 2
    made = wait_for(lambda: (kids := children(cluster, namespace, name))["configmaps"] and kids["deployments"] and kids,
                    60, "the config and the managed Redis", diagnostics)
    assert [n for n, _ in made["configmaps"]] == [f"{name}-config"]
    assert {n for n, _ in made["services"]} == {f"{name}-trainer", f"{name}-redis"}
    assert [n for n, _ in made["secrets"]] == [f"{name}-redis-auth"]
    assert not [n for n, _ in made["pods"] if not n.startswith(f"{name}-redis-")], made["pods"]
