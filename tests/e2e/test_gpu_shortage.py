"""A gang that asks for more ``nvidia.com/gpu`` than the nodes have: the ranks that fit are scheduled and wait in
rendezvous, no training step runs, TrainerReady names the pods the scheduler cannot place, and nothing counts
as a failure (DESIGN §5 rule 2).

The request is sized from the nodes: every node with the most GPUs gets one trainer pod asking for all of them,
plus one pod more that fits nowhere (on nodes without GPUs, e.g. kind, one GPU per pod and nothing fits).
"""

from __future__ import annotations

import time

import pytest
from rljob_api import constants as c

from .conftest import condition, get_job, job_manifest, phase, wait_for

pytestmark = pytest.mark.e2e

GPU = "nvidia.com/gpu"
WAIT_S = 20
"""How long the job is watched after the scheduler has placed what it can (seconds)."""


def _gang_shape(cluster) -> tuple[int, int, int]:
    """(trainer pods, GPUs per pod, pods that fit)."""
    gpus = [int((n["status"].get("allocatable") or {}).get(GPU, 0)) for n in cluster.items("nodes", "default")]
    most = max(gpus, default=0)
    if most == 0:
        return 2, 1, 0
    fit = sum(1 for g in gpus if g == most)
    return fit + 1, most, fit


def test_unschedulable_ranks_are_reported_and_nothing_fails(cluster, operator, namespace, diagnostics):
    name = "gpu-hungry"
    diagnostics.job = name
    nodes, per_pod, fit = _gang_shape(cluster)
    cluster.apply(job_manifest(name, {"trainer": {
        "nodes": nodes, "batch": {"documentsPerStep": 8 * nodes},
        "resources": {"requests": {"cpu": "100m"}, "limits": {GPU: per_pod}},
    }}), namespace)

    def reported():
        job = get_job(cluster, namespace, name)
        cond = condition(job, c.ConditionType.TRAINER_READY)
        return cond.get("reason") == c.Reason.UNSCHEDULABLE.value and job

    job = wait_for(reported, 180, "TrainerReady=False/Unschedulable", diagnostics)
    wait_for(lambda: len([p for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}=trainer")
                          if p["status"].get("phase") == "Running"]) == fit, 120,
             f"the {fit} schedulable trainer pods to run", diagnostics)
    time.sleep(WAIT_S)
    job = get_job(cluster, namespace, name)
    status = job["status"]
    ready = condition(job, c.ConditionType.TRAINER_READY)
    assert (ready["status"], ready["reason"]) == ("False", c.Reason.UNSCHEDULABLE.value), ready
    trainers = {p["metadata"]["name"]: p for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}=trainer")}
    assert sorted(trainers) == sorted(f"{name}-trainer-{i}" for i in range(nodes))
    # The pods are created together, so which ranks the scheduler places first is not fixed: the condition must
    # name exactly the ones left unscheduled.
    pending = sorted(pod for pod, body in trainers.items() if not body["spec"].get("nodeName"))
    assert len(pending) == nodes - fit, pending
    for pod in pending:
        assert pod in ready["message"], ready
    for pod in set(trainers) - set(pending):
        assert pod not in ready["message"].split("cannot be scheduled:", 1)[-1], ready
    assert f"Insufficient {GPU}" in ready["message"], ready
    assert phase(job) == "Starting", status
    assert status.get("step") is None and status.get("documentsSeen") is None, status
    assert status["restarts"] == 0 and status["failedAttempts"] == 0 and status["attempt"] == 0, status
    assert condition(job, c.ConditionType.FAILED).get("status") in (None, "False")
    for pod_name in pending:
        scheduled = next(cd for cd in trainers[pod_name]["status"]["conditions"] if cd["type"] == "PodScheduled")
        assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable"), scheduled
    for pod in trainers.values():  # the placed ranks wait in rendezvous: running, never restarted
        if pod["metadata"]["name"] not in pending:
            (container,) = pod["status"]["containerStatuses"]
            assert pod["status"]["phase"] == "Running" and container["restartCount"] == 0, pod["status"]
    unschedulable = [e for e in cluster.items("events", namespace)
                     if e["involvedObject"].get("name") == name and e["reason"] == c.Reason.UNSCHEDULABLE.value]
    assert unschedulable and unschedulable[0]["type"] == "Warning", unschedulable
