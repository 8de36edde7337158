"""Gang behaviour end to end (DESIGN §5, §6) with 2 data-parallel ranks in 1 pod × 2 processes, sharded by FSDP2
(``parallelism.strategy`` left to its default, ``fsdp``; the resume loads the sharded checkpoint into new shards).

A trainer pod deleted after a checkpoint ends the attempt: every pod of attempt k is gone before any pod of
attempt k+1 exists (read off one watch stream of the namespace's pods), attempt k+1 resumes from the
checkpoint on the job's PersistentVolumeClaim and completes, status.restarts == 1, and no document is lost
(every delivered stream entry acked, documents_seen exactly maxSteps × documentsPerStep).
"""

from __future__ import annotations

import json
import re

import pytest
from rljob_api import constants as c

from .conftest import (
    Recorder,
    check_attempts_never_mixed,
    check_trained_once,
    checkpointed_job,
    condition,
    get_job,
    phase,
    redis_snapshot,
    wait_for,
)

pytestmark = pytest.mark.e2e

MAX_STEPS = 60
EVERY_STEPS = 10
PER_STEP = 64


def _step_lines(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith('{"event": "step"')]


def test_deleted_trainer_pod_restarts_the_whole_gang_from_the_checkpoint(cluster, operator, namespace, diagnostics):
    name = "gang"
    diagnostics.job = name
    manifest = checkpointed_job(cluster, namespace, name, EVERY_STEPS, {
        "trainer": {"maxSteps": MAX_STEPS, "batch": {"documentsPerStep": PER_STEP}},
        "runPolicy": {"cleanPodPolicy": "None"},  # keep the finished pods for their logs
    })
    pod0 = f"{name}-trainer-0"
    with Recorder(cluster, namespace, "pods") as pods, Recorder(cluster, namespace, "rljobs") as jobs:
        cluster.apply(manifest, namespace)
        log = wait_for(lambda: "checkpoint: committed" in (text := cluster.kubectl(
            "logs", "-n", namespace, pod0, check=False).stdout) and text, 300,
            "the first checkpoint of attempt 0", diagnostics, interval=0.5)
        assert phase(get_job(cluster, namespace, name)) in ("Starting", "Running"), diagnostics()
        command = cluster.get("pod", pod0, "-n", namespace)["spec"]["containers"][0]["command"]
        assert "--nnodes=1" in command and "--nproc-per-node=2" in command, command
        cluster.kubectl("delete", "pod", pod0, "-n", namespace, "--wait=false")
        final = wait_for(lambda: phase(job := get_job(cluster, namespace, name)) in ("Succeeded", "Failed") and job,
                         600, "the job to finish", diagnostics)
    pods.check()
    jobs.check()
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["restarts"], status["attempt"], status["failedAttempts"]) == (1, 1, 1), status
    assert status["dataParallelSize"] == 2 and status["step"] == MAX_STEPS
    assert status["lastCheckpoint"]["step"] == MAX_STEPS and status["lastCheckpoint"]["documentsSeen"] == (
        MAX_STEPS * PER_STEP), status
    assert final["spec"]["trainer"]["parallelism"] == {"strategy": "fsdp", "replicate": 1}, final["spec"]["trainer"]

    # The gang was torn down whole before attempt 1 started (one watch stream, API server order).
    check_attempts_never_mixed(pods, 2)

    # Restarting, with the reason, was reported between the attempts.
    restarting = [e.status for e in jobs.events if e.status.get("phase") == "Restarting"]
    assert restarting, [e.status.get("phase") for e in jobs.events]
    cond = next(cd for cd in restarting[0]["conditions"] if cd["type"] == c.ConditionType.RESTARTING.value)
    assert (cond["status"], cond["reason"]) == ("True", c.Reason.POD_DELETED.value), cond
    assert pod0 in cond["message"]
    assert condition(final, c.ConditionType.RESTARTING).get("status") == "False"

    # Attempt 1 loaded the checkpoint attempt 0 wrote and went on from its step.
    committed = [int(s) for s in re.findall(r"checkpoint: committed \S+step-(\d+)", log)]
    assert committed and committed[0] == EVERY_STEPS, log
    resumed = cluster.kubectl("logs", "-n", namespace, pod0).stdout
    loaded = re.findall(r"checkpoint: loaded \S+ \(step (\d+), documents_seen (\d+)", resumed)
    assert loaded, resumed[-3000:]
    step, documents = int(loaded[-1][0]), int(loaded[-1][1])
    assert step >= EVERY_STEPS and step % EVERY_STEPS == 0 and documents == step * PER_STEP, loaded
    steps = [line["step"] for line in _step_lines(resumed.split("checkpoint: loaded")[-1])]
    assert steps and steps[0] == step + 1 and steps[-1] == MAX_STEPS, steps

    # No document lost: every delivered entry acked, every step full, no dead letters or lost pending entries.
    snapshot = redis_snapshot(cluster, namespace, final, diagnostics)
    check_trained_once(snapshot, status, MAX_STEPS * PER_STEP)
    assert snapshot["dead_letter"] == 0
    assert int(snapshot["checkpoint"]["step"]) == MAX_STEPS, snapshot["checkpoint"]
