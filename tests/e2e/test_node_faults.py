"""A node that stops reporting, on real kubelets (issue 11 item 7; DESIGN §5's exception to "the next attempt only
once no old pod is left"): one job, two faults of the node that runs a trainer rank and neither Redis nor the rollout nor the operator.

1. Partitioned: its kubelet is killed, its containers go on running (the rollout is paused meanwhile, see
   MAX_LAG). The node goes NotReady, the taint manager
   deletes its pods, which stay Terminating (nobody on the node confirms). Once the node has not been Ready for the
   pods' toleration (the local control plane's default, 10 s) the operator force-deletes them (Warning Event
   PodForceDeleted naming the node) and starts the next attempt, whose rank on the lost node cannot be placed until
   the node returns. Back, the kubelet kills the containers of the pods the API no longer has: no process of the
   old pod is left on the host.
2. Shut down: kubelet and every container of the node killed, containerd stopped; the same path.

Invariants, read from the pods' watch, the host's processes and Redis: every pod of attempt k is gone from the API
before any pod of attempt k+1 exists; the job ends Succeeded with every document of every step trained once (the
consumer group has nothing pending, nothing lost or dead-lettered) and the last checkpoint at the last step.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
from rljob_api import constants as c

from .conftest import (
    Recorder,
    check_attempts_never_mixed,
    check_trained_once,
    checkpointed_job,
    get_job,
    phase,
    redis_snapshot,
    wait_for,
)
from .faults import command_line, pod_pids, signal_all

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

MAX_STEPS = 60
EVERY_STEPS = 5
PER_STEP = 64
MAX_LAG = 512
"""Documents the rollout may be ahead: 8 steps. A partitioned rank trains on until the node's pods are evicted (the node
NotReady after 16 s, then its 10 s toleration: hundreds of steps on an idle machine), so while the node is partitioned
the rollout's processes are stopped (SIGSTOP, from outside): the gang trains the backlog and waits for documents, and
the job cannot end before the eviction on a fast machine."""
GPU = "nvidia.com/gpu"
GPUS_PER_RANK = 3
"""Of the 4 fake GPUs per node: two ranks never fit on one node, so one rank runs on the node that has neither Redis
nor the rollout (they were placed while it was cordoned), and one rank of the next attempt waits for its return."""


def _pods(cluster, namespace, role: str) -> list[dict]:
    return cluster.items("pods", namespace, f"{c.LABEL_ROLE}={role}")


def _trainers(cluster, namespace, attempt: int) -> list[dict]:
    return [p for p in _pods(cluster, namespace, "trainer") if p["metadata"]["labels"].get(c.LABEL_ATTEMPT) == str(attempt)]


def _trainer_on(cluster, namespace, attempt: int, node: str) -> dict | None:
    return next((p for p in _trainers(cluster, namespace, attempt) if p["spec"].get("nodeName") == node), None)


def _committed_after_load(log: str) -> bool:
    """A checkpoint committed by this attempt (after its 'checkpoint: loaded' line)."""
    return "checkpoint: committed" in log.split("checkpoint: loaded")[-1] and "checkpoint: loaded" in log


def _force_deleted(cluster, namespace) -> list[dict]:
    return [e for e in cluster.items("events", namespace) if e["reason"] == "PodForceDeleted"]


@pytest.mark.timeout(1500)  # two node losses, three gangs: long on a busy 2-core machine
def test_a_partitioned_then_shut_down_node_restarts_the_gang_and_leaves_nothing_behind(cluster, operator, namespace,
                                                                                        diagnostics):
    if cluster.nodes is None:
        pytest.skip("NODE FAULTS NOT TESTED: --cluster=existing has no node this test can stop (the local nodes can)")
    nodes = cluster.nodes
    # The operator's node stays up (on a partitioned node it would run on beside its replacement: not this test).
    (operator_pod,) = operator.pods()
    safe = operator_pod["spec"]["nodeName"]
    (victim,) = set(nodes.names) - {safe}
    name = "node-fault"
    diagnostics.job = name
    manifest = checkpointed_job(cluster, namespace, name, EVERY_STEPS, {
        "trainer": {"nodes": 2, "processesPerNode": 1, "maxSteps": MAX_STEPS, "batch": {"documentsPerStep": PER_STEP},
                    "resources": {"requests": {"cpu": "100m"}, "limits": {GPU: GPUS_PER_RANK}}},
        "rollout": {"maxLag": MAX_LAG},
        "runPolicy": {"backoffLimit": 4, "cleanPodPolicy": "None"},
    })
    started = time.monotonic()
    timings: dict[str, float] = {}
    cluster.kubectl("cordon", victim)
    try:
        with Recorder(cluster, namespace, "pods") as pods, Recorder(cluster, namespace, "rljobs") as jobs:
            cluster.apply(manifest, namespace)
            wait_for(lambda: all(p["spec"].get("nodeName") == safe for role in ("redis", "rollout")
                                 for p in _pods(cluster, namespace, role)) and len(_pods(cluster, namespace, "redis"))
                     == 1 and len(_pods(cluster, namespace, "rollout")) == 1 and _trainer_on(cluster, namespace, 0, safe),
                     180, f"Redis, the rollout and a trainer pod on {safe}", diagnostics)
            cluster.kubectl("uncordon", victim)
            for attempt, containers in ((0, False), (1, True)):
                fault = "shut down" if containers else "partitioned"
                victim_pod = wait_for(lambda a=attempt: _trainer_on(cluster, namespace, a, victim), 180,
                                      f"a trainer pod of attempt {attempt} on {victim}", diagnostics)
                rank0 = f"{name}-trainer-0"
                wait_for(lambda a=attempt: "checkpoint: committed" in (log := cluster.kubectl(
                    "logs", "-n", namespace, rank0, check=False).stdout) and (a == 0 or _committed_after_load(log)),
                    300, f"a checkpoint of attempt {attempt}", diagnostics, interval=0.5)
                uid = victim_pod["metadata"]["uid"]
                assert pod_pids(uid), f"no process of {victim_pod['metadata']['name']} found on the host"
                forced_before = len(_force_deleted(cluster, namespace))
                t0 = time.monotonic()
                rollout_pids = [] if containers else [
                    pid for pid in pod_pids(_pods(cluster, namespace, "rollout")[0]["metadata"]["uid"])
                    if not command_line(pid).startswith("/pause")]
                signal_all(rollout_pids, signal.SIGSTOP)
                nodes.stop_node(victim, containers=containers)
                step_at_fault = get_job(cluster, namespace, name)["status"].get("step")
                if not containers:
                    assert pod_pids(uid), "a partitioned node's containers must keep running"
                # The stuck pod is force-deleted, and attempt + 1's rank 1 waits for a node that can hold it.
                wait_for(lambda: len(_force_deleted(cluster, namespace)) > forced_before, 180,
                         f"PodForceDeleted after the node was {fault}", diagnostics)
                timings[f"{fault}: force-deleted"] = time.monotonic() - t0
                # One pod of the next gang fits beside Redis and the rollout; the other waits for the lost node.
                gang = wait_for(lambda a=attempt: len(g := _trainers(cluster, namespace, a + 1)) == 2
                                and _trainer_on(cluster, namespace, a + 1, safe) and g, 120,
                                f"attempt {attempt + 1}'s trainer pods, one on {safe}", diagnostics)
                assert sorted(p["spec"].get("nodeName") or "" for p in gang) == ["", safe], gang
                signal_all(rollout_pids, signal.SIGCONT)
                job = get_job(cluster, namespace, name)
                assert job["status"]["attempt"] == attempt + 1, job["status"]
                print(f"{fault} at step {step_at_fault}; attempt {attempt + 1} waits for {victim}")
                t1 = time.monotonic()
                nodes.start_node(victim)
                wait_for(lambda: not pod_pids(uid), 120, f"the processes of {victim_pod['metadata']['name']} to end",
                         diagnostics)
                timings[f"{fault}: node back, old pod's processes gone"] = time.monotonic() - t1
            final = wait_for(lambda: phase(job := get_job(cluster, namespace, name)) in ("Succeeded", "Failed") and job,
                             600, "the job to finish", diagnostics)
            timings["finished"] = time.monotonic() - started
    finally:
        cluster.kubectl("uncordon", victim, check=False)
        if victim not in [n for n in nodes.names if f"kubelet-{n}" in nodes.pids]:
            nodes.start_node(victim)
    pods.check()
    jobs.check()
    print("seconds: " + ", ".join(f"{what} {s:.0f}" for what, s in timings.items()))
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert status["attempt"] == 2 and status["step"] == MAX_STEPS, status
    assert status["lastCheckpoint"]["step"] == MAX_STEPS, status

    # Each force-delete named the node; the gang rule held: attempt k gone before attempt k+1 existed.
    forced = _force_deleted(cluster, namespace)
    assert len(forced) >= 2 and all(victim in e["message"] for e in forced), [e["message"] for e in forced]
    check_attempts_never_mixed(pods, 3)

    # Nothing lost or trained twice; the resumed attempts went on from committed checkpoints.
    check_trained_once(redis_snapshot(cluster, namespace, final, diagnostics), status, MAX_STEPS * PER_STEP)
    log = cluster.kubectl("logs", "-n", namespace, f"{name}-trainer-0").stdout
    loaded = [int(s) for s in re.findall(r"checkpoint: loaded \S+ \(step (\d+)", log)]
    assert loaded and loaded[-1] % EVERY_STEPS == 0 and loaded[-1] >= 2 * EVERY_STEPS, loaded
