"""The main job end to end: ``examples/rljob-cpu.yaml`` (with ``maxSteps`` cut to :data:`MAX_STEPS` to save CI
time; the learning-rate schedule then decays over those steps) trains to Succeeded.

2 data-parallel ranks (2 trainer pods × 1 process), a managed Redis (the pod runs Debian's redis-server on
the local cluster, its append-only file on the claim ``<job>-redis-data``) and a CPU rollout pod. The operator pod is
restarted while the job runs: no child is duplicated and the job still completes. Deleting the job leaves no pod,
Service, Secret, ConfigMap or Redis data claim behind (the real garbage collector follows the owner references).
"""

from __future__ import annotations

import re
import time

import pytest
import yaml
from rljob_api import constants as c
from rljob_api.protocol import REWARD_DECIMALS

from .conftest import (
    Recorder,
    children,
    condition,
    example_documents,
    redis_snapshot,
    rollout_rewards,
    wait_for,
)

pytestmark = pytest.mark.e2e

MAX_STEPS = 100
"""The example runs 300 steps (its cosine schedule's horizon); 100 show the rise below in a third of the time."""
REWARD_RISE = 0.4
"""The rollout reward of the newest weights minus that of the initial weights (the rollout issue's margin)."""
METRICS = ("train_samples_reward", "max_train_samples_reward", "min_train_samples_reward",
           "staleness", "max_staleness", "min_staleness")


def test_cpu_example_trains_to_succeeded_through_an_operator_restart(cluster, operator, namespace, diagnostics):
    documents = example_documents("rljob-cpu.yaml")
    example = next(d for d in documents if d["kind"] == c.KIND)
    name, spec = example["metadata"]["name"], example["spec"]
    spec["trainer"]["maxSteps"] = MAX_STEPS
    diagnostics.job = name
    max_steps, per_step = spec["trainer"]["maxSteps"], spec["trainer"]["batch"]["documentsPerStep"]

    (op_pod,) = operator.pods()
    assert op_pod["spec"]["serviceAccountName"] == operator.service_account

    with Recorder(cluster, namespace, "rljobs") as jobs, Recorder(cluster, namespace, "pods") as pods:
        cluster.apply("---\n".join(yaml.safe_dump(d) for d in documents), namespace)  # the claim, then the job
        running = wait_for(lambda: (j := cluster.get("rljob", name, "-n", namespace))
                           and (j.get("status") or {}).get("phase") in ("Running", "Succeeded") and j,
                           300, "the job to run", diagnostics)
        # The pods as rendered: explicit commands, 2 pods x 1 process, Debian's redis-server, one config hash.
        trainers = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=trainer")
        assert len(trainers) == 2, diagnostics()
        for pod in trainers:
            command = pod["spec"]["containers"][0]["command"]
            assert command[0] == "torchrun" and "--nnodes=2" in command and "--nproc-per-node=1" in command
            assert command[-2:] == ["-m", "rljob_trainer.train"]
        assert len({p["metadata"]["labels"][c.LABEL_CONFIG_HASH] for p in trainers}) == 1
        (redis_pod,) = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=redis")
        # The example's durable Redis (spec.redis.persistence): redis-server under its start script, on its claim.
        command = redis_pod["spec"]["containers"][0]["command"]
        assert command[:2] == ["sh", "-c"] and "exec redis-server " in command[2], command
        volumes = {v["name"]: v for v in redis_pod["spec"]["volumes"]}
        assert volumes["data"]["persistentVolumeClaim"] == {"claimName": f"{name}-redis-data"}, volumes
        (rollout_pod,) = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=rollout")
        assert rollout_pod["spec"]["containers"][0]["command"] == ["python", "-m", "rljob_rollout"]
        before_restart = children(cluster, namespace, name)

        # (f) restart the operator while the job runs: the new operator pod finishes the job.
        assert running["status"]["phase"] == "Running", running["status"]
        operator.restart()
        restarted_at = time.monotonic()
        final = wait_for(lambda: (j := cluster.get("rljob", name, "-n", namespace))
                         and (j.get("status") or {}).get("phase") in ("Succeeded", "Failed") and j,
                         600, "the job to finish", diagnostics)
        after_restart = children(cluster, namespace, name)
    jobs.check()
    pods.check()
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()

    assert any(e.time > restarted_at and e.status.get("phase") == "Succeeded" for e in jobs.events), \
        "the job finished before the operator restart completed: the restart did not happen mid-run"

    # No duplicate children: one gang, one rollout pod, the same Redis, Secret, ConfigMap and Services.
    trainer_lives = pods.lifetimes("trainer")
    assert len(trainer_lives) == 2 and {a for a, _, _ in trainer_lives.values()} == {0}, trainer_lives
    assert len(pods.lifetimes("rollout")) == 1
    assert len(pods.lifetimes("redis")) == 1
    for kind in ("services", "secrets", "configmaps", "deployments"):
        assert after_restart[kind] == before_restart[kind], (kind, before_restart[kind], after_restart[kind])

    # Final status: conditions and their reasons, progress, metrics.
    expected = {
        c.ConditionType.VALID: ("True", c.Reason.SPEC_VALID),
        c.ConditionType.REDIS_READY: ("True", c.Reason.REDIS_AVAILABLE),
        c.ConditionType.SUCCEEDED: ("True", c.Reason.TRAINING_FINISHED),
        c.ConditionType.RUNNING: ("False", c.Reason.TRAINING_FINISHED),
    }
    for ctype, (state, reason) in expected.items():
        cond = condition(final, ctype)
        assert (cond.get("status"), cond.get("reason")) == (state, reason.value), (ctype, cond)
    assert condition(final, c.ConditionType.FAILED).get("status") in (None, "False")
    assert status["restarts"] == 0 and status["attempt"] == 0 and status["failedAttempts"] == 0
    assert status["dataParallelSize"] == 2
    assert status["step"] == max_steps
    assert status["documentsSeen"] == max_steps * per_step
    assert status["modelVersion"] == status["documentsSeen"]
    assert status["completionTime"] >= status["startTime"]
    metrics = status["lastMetrics"]
    assert set(METRICS) <= set(metrics), metrics
    assert metrics["min_train_samples_reward"] <= metrics["train_samples_reward"] <= metrics["max_train_samples_reward"]
    assert 0 <= metrics["min_staleness"] <= metrics["staleness"] <= metrics["max_staleness"]

    # The condition sequence, from every status the API server stored.
    phases = [e.status.get("phase") for e in jobs.events if e.status.get("phase")]
    phases = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    order = ["Pending", "Starting", "Running", "Succeeded"]
    assert "Running" in phases and phases[-1] == "Succeeded", phases
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases), phases
    steps = [e.status["step"] for e in jobs.events if e.status.get("step") is not None]
    assert steps == sorted(steps) and len(set(steps)) >= 2, steps
    documents = [e.status["documentsSeen"] for e in jobs.events if e.status.get("documentsSeen") is not None]
    assert documents == sorted(documents) and len(set(documents)) >= 2, documents
    versions = [e.status["modelVersion"] for e in jobs.events if e.status.get("modelVersion") is not None]
    assert versions == sorted(versions) and len(set(versions)) >= 2, versions
    times = {ctype: condition(final, ctype)["lastTransitionTime"]
             for ctype in (c.ConditionType.VALID, c.ConditionType.REDIS_READY, c.ConditionType.SUCCEEDED)}
    assert times[c.ConditionType.VALID] <= times[c.ConditionType.REDIS_READY] <= times[c.ConditionType.SUCCEEDED]

    # The rollout reward rises: per weights version from the rollout hash, and as status reported it.
    snapshot = redis_snapshot(cluster, namespace, final, diagnostics)
    rewards = rollout_rewards(snapshot["rollout"])
    first_version, last_version = min(rewards), max(rewards)
    assert first_version == 0, rewards
    assert status["rolloutModelVersion"] == last_version
    assert status["rolloutReward"] == pytest.approx(rewards[last_version][0], abs=0.5 * 10 ** -REWARD_DECIMALS)
    assert int(snapshot["progress"]["step"]) == max_steps
    assert not [g for g in snapshot["groups"] if g["pending"]], snapshot["groups"]

    # kubectl get rljob: the printer columns.
    table = cluster.kubectl("get", "rljob", name, "-n", namespace).stdout.splitlines()
    assert re.split(r"\s+", table[0].strip()) == [
        "NAME", "PHASE", "DP", "STEP", "PROGRESS", "ETA", "MODELVERSION", "REWARD", "AGE"]
    row = re.split(r"\s+", table[1].strip())  # a finished job has no ETA: kubectl leaves the cell empty
    assert row[:6] == [name, "Succeeded", "2", str(max_steps), "100", str(status["modelVersion"])], table
    assert float(row[6]) == pytest.approx(status["rolloutReward"]) and status["reward"] == status["rolloutReward"]
    assert status["progressPercentage"] == 100 and "estimatedRemainingSeconds" not in status, status

    # Events on the transitions, posted on the job by the operator.
    events = cluster.items("events", namespace)
    reasons = {e["reason"] for e in events if e["involvedObject"].get("name") == name
               and e["involvedObject"].get("kind") == c.KIND}
    for reason in (c.Reason.SPEC_VALID, c.Reason.REDIS_AVAILABLE, c.Reason.PODS_READY, c.Reason.TRAINING,
                   c.Reason.TRAINING_FINISHED):
        assert reason.value in reasons, (reason, reasons)

    # Deletion cascades through the garbage collector: nothing of the job is left.
    cluster.kubectl("delete", "rljob", name, "-n", namespace, "--wait=true", "--timeout=120s")
    left = wait_for(lambda: not any(children(cluster, namespace, name).values()) or None, 120,
                    "the garbage collector to delete every child", diagnostics)
    assert left is True
    leftovers = [o["metadata"]["name"] for kind in ("pods", "services", "secrets", "configmaps")
                 for o in cluster.items(kind, namespace) if o["metadata"]["name"] != "kube-root-ca.crt"]
    assert leftovers == [], leftovers
    claims = wait_for(lambda: (k := [o["metadata"]["name"] for o in cluster.items("pvc", namespace)])
                      == [f"{name}-checkpoints"] and k, 60, "the Redis data claim to go with the job", diagnostics)
    assert claims == [f"{name}-checkpoints"]  # the example's own claim is the user's: it stays

    # Last, as it is about learning rather than plumbing: the policy got better (DESIGN §10).
    assert rewards[last_version][0] - rewards[first_version][0] >= REWARD_RISE, rewards
