"""Suspend and resume (Kueue-compatible ``runPolicy.suspend``): every trainer and rollout pod is deleted while
Redis, its stream and the checkpoints stay; resuming starts a new attempt (not a restart) from the checkpoint,
and training goes on past where it was suspended. The job never trains to the end: it is deleted once that
is shown."""

from __future__ import annotations

import pytest
from rljob_api import constants as c

from .conftest import checkpointed_job, condition, get_job, phase, redis_snapshot, wait_for

pytestmark = pytest.mark.e2e


def _status(cluster, namespace, name) -> dict:
    return get_job(cluster, namespace, name).get("status") or {}


def _patch_suspend(cluster, namespace: str, name: str, suspend: bool) -> None:
    cluster.kubectl("patch", "rljob", name, "-n", namespace, "--type=merge", "-p",
                    f'{{"spec": {{"runPolicy": {{"suspend": {"true" if suspend else "false"}}}}}}}')


def test_suspend_keeps_redis_and_resume_continues(cluster, operator, namespace, diagnostics):
    name = "pausable"
    diagnostics.job = name
    cluster.apply(checkpointed_job(cluster, namespace, name, 5, {"trainer": {"maxSteps": 100_000}}), namespace)
    wait_for(lambda: (_status(cluster, namespace, name).get("step") or 0) >= 6, 300,
             "a checkpoint's worth of steps in status", diagnostics)
    (redis_before,) = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=redis")

    _patch_suspend(cluster, namespace, name, True)
    job = wait_for(lambda: phase(j := get_job(cluster, namespace, name)) == "Suspended"
                   and not cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)") and j,
                   120, "the job to be suspended with its pods gone", diagnostics)
    suspended = condition(job, c.ConditionType.SUSPENDED)
    assert (suspended["status"], suspended["reason"]) == ("True", c.Reason.JOB_SUSPENDED.value), suspended
    assert job["status"]["restarts"] == 0 and job["status"].get("startTime") is None
    attempt_suspended = job["status"]["attempt"]
    step_suspended = job["status"]["step"]
    (redis_after,) = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=redis")
    assert redis_after["metadata"]["uid"] == redis_before["metadata"]["uid"]  # Redis kept, not restarted
    snapshot = redis_snapshot(cluster, namespace, job, diagnostics)
    assert snapshot["xlen"] is not None and snapshot["groups"], snapshot  # the stream and its group are kept
    assert int(snapshot["progress"]["step"]) >= step_suspended
    checkpoint_step = int(snapshot["checkpoint"]["step"])
    assert checkpoint_step >= 5

    _patch_suspend(cluster, namespace, name, False)
    wait_for(lambda: phase(get_job(cluster, namespace, name)) == "Running", 180, "the job to run again", diagnostics)
    trainers = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=trainer")
    assert {p["metadata"]["labels"][c.LABEL_ATTEMPT] for p in trainers} == {str(attempt_suspended)}, trainers
    # The new trainer's own log says where it started; the status step alone could still be the suspended
    # attempt's last progress write.
    loaded = f"checkpoint: loaded /var/lib/rljob/checkpoints/step-{checkpoint_step:08d}"
    wait_for(lambda: loaded in cluster.kubectl("logs", "-n", namespace, f"{name}-trainer-0", check=False).stdout, 180,
             f"the resumed trainer to log '{loaded}'", diagnostics)
    progress_step = int(snapshot["progress"]["step"])
    wait_for(lambda: (_status(cluster, namespace, name).get("step") or 0) > progress_step, 300,
             f"training to go past step {progress_step} after the resume", diagnostics)
    job = get_job(cluster, namespace, name)
    assert condition(job, c.ConditionType.SUSPENDED).get("status") == "False"
    assert job["status"]["restarts"] == 0 and job["status"]["failedAttempts"] == 0
    assert job["status"]["startTime"]
