"""Faults injected from outside into running jobs on real nodes (marker ``chaos``), each checked against invariants
read from Redis, the pods and the job's status, not only its final phase.

The managed Redis pod deleted mid-training, with ``spec.redis.persistence`` (the default; the local cluster's
default StorageClass ``rljob-local``, kind's ``standard``): the replacement pod mounts the same claim and loads the
append-only file, so the stream, the consumer group and its pending entries and the progress and checkpoint hashes
are all there; the trainer rides the outage out (``runPolicy.backoffLimit: 0``: a counted failure would fail the
job), nothing restarts but Redis, and the job reaches Succeeded with every entry acked and every step full.
"""

from __future__ import annotations

import json
import time

import pytest
from rljob_api import constants as c
from rljob_api.protocol import entry_order

from .conftest import Recorder, checkpointed_job, condition, get_job, phase, redis_snapshot, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

MAX_STEPS = 60
EVERY_STEPS = 5
PER_STEP = 64

_READ = """
import json, sys
from rljob_api.config import JobConfig
from rljob_trainer.stream.connection import connect
config = JobConfig.load()
keys, r = config.keys, connect(config)
if sys.argv[1:] == ["pause"]:
    r.client_pause(60_000, all=False)  # WRITE: every write (XADD, XREADGROUP, XACK, HSET) waits; reads go on
def text(value):
    return value.decode() if isinstance(value, bytes) else value
def group_view(g):
    return {text(k): text(v) for k, v in g.items()}
stream = r.xinfo_stream(keys.stream) if r.exists(keys.stream) else {}
print(json.dumps({
    "run_id": r.info("server")["run_id"],
    "entries_added": stream.get("entries-added"),
    "last_generated_id": text(stream.get("last-generated-id")),
    "groups": [group_view(g) for g in r.xinfo_groups(keys.stream)] if stream else [],
    "pending": [text(row["message_id"]) for row in r.xpending_range(keys.stream, keys.group, "-", "+", 100000)]
    if stream else [],
    "progress": {text(k): text(v) for k, v in r.hgetall(keys.progress).items()},
    "checkpoint": {text(k): text(v) for k, v in r.hgetall(keys.checkpoint).items()},
    "rollout_written": text(r.hget(keys.rollout, "documents_written")),
}))
"""


def _read_redis(cluster, namespace: str, pod: str, *args: str) -> dict:
    """The job's Redis as one trainer process sees it, read from inside trainer pod ``pod`` (its config, password and
    client): run id, stream counters, groups, every pending entry id, the hashes. ``pause``: first CLIENT PAUSE WRITE
    for 60 s, so that what is read is exactly what Redis holds until it stops."""
    out = cluster.kubectl("exec", "-n", namespace, pod, "--", "python", "-c", _READ, *args).stdout
    return json.loads(out.strip().splitlines()[-1])


def _redis_pod(cluster, namespace: str) -> dict | None:
    live = [p for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}=redis")
            if not p["metadata"].get("deletionTimestamp")]
    return live[0] if len(live) == 1 else None


def _ready(pod: dict | None) -> bool:
    return bool(pod) and any(cd["type"] == "Ready" and cd["status"] == "True"
                             for cd in (pod.get("status") or {}).get("conditions") or [])


def test_a_deleted_redis_pod_comes_back_with_its_stream_and_the_job_trains_on(cluster, operator, namespace,
                                                                               diagnostics):
    name = "durable"
    diagnostics.job = name
    cluster.apply(checkpointed_job(cluster, namespace, name, EVERY_STEPS, {
        "trainer": {"maxSteps": MAX_STEPS, "batch": {"documentsPerStep": PER_STEP}},
        "redis": {"persistence": {"size": "1Gi"}},
        "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
    }), namespace)
    trainer0 = f"{name}-trainer-0"
    wait_for(lambda: "checkpoint: committed" in cluster.kubectl("logs", "-n", namespace, trainer0, check=False).stdout,
             300, "the first checkpoint", diagnostics, interval=0.5)
    redis_pod = wait_for(lambda: _ready(p := _redis_pod(cluster, namespace)) and p, 60, "the Redis pod", diagnostics)
    volumes = {v["name"]: v for v in redis_pod["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": f"{name}-redis-data"}, volumes
    claim = cluster.get("pvc", f"{name}-redis-data", "-n", namespace)
    assert claim["status"]["phase"] == "Bound" and claim["metadata"]["ownerReferences"][0]["name"] == name

    with Recorder(cluster, namespace, "rljobs") as jobs:
        before = _read_redis(cluster, namespace, trainer0, "pause")  # nothing is written from here until Redis stops
        assert before["groups"] and before["pending"] and int(before["checkpoint"]["step"]) >= EVERY_STEPS, before
        assert int(before["progress"]["step"]) < MAX_STEPS, "the job finished before the fault"
        deleted_at = time.monotonic()
        cluster.kubectl("delete", "pod", "-n", namespace, redis_pod["metadata"]["name"], "--wait=false")
        replacement = wait_for(lambda: _ready(p := _redis_pod(cluster, namespace))
                               and p["metadata"]["uid"] != redis_pod["metadata"]["uid"] and p, 180,
                               "a ready replacement Redis pod", diagnostics, interval=0.25)
        print(f"Redis pod deleted -> replacement ready: {time.monotonic() - deleted_at:.1f} s")
        after = _read_redis(cluster, namespace, trainer0)
        final = wait_for(lambda: phase(job := get_job(cluster, namespace, name)) in ("Succeeded", "Failed") and job,
                         600, "the job to finish", diagnostics)
    jobs.check()
    redis_ready = [condition(e.object, c.ConditionType.REDIS_READY).get("status") for e in jobs.events]
    assert "False" in redis_ready and redis_ready[-1] == "True", redis_ready  # the operator saw the outage end

    # The same data, read back from the new Redis process (the writers go on meanwhile, so "after" is the cut or
    # later): the stream and the group, whose counters never go back; every entry pending at the cut, unless a
    # checkpoint committed since has acked it; the hashes; the same claim under a new pod.
    assert after["run_id"] != before["run_id"]
    assert after["entries_added"] >= before["entries_added"], (before["entries_added"], after["entries_added"])
    assert entry_order(after["last_generated_id"]) >= entry_order(before["last_generated_id"])
    (group_before,), (group_after,) = before["groups"], after["groups"]
    assert group_after["name"] == group_before["name"] == "fast_llm_group"
    assert entry_order(group_after["last-delivered-id"]) >= entry_order(group_before["last-delivered-id"]), (
        group_before, group_after)
    if int(after["checkpoint"]["step"]) == int(before["checkpoint"]["step"]):  # no checkpoint since: none acked
        assert set(before["pending"]) <= set(after["pending"]), (before["pending"], after["pending"])
    assert int(after["checkpoint"]["step"]) >= int(before["checkpoint"]["step"])
    assert int(after["progress"]["step"]) >= int(before["progress"]["step"])
    assert int(after["progress"]["documents_seen"]) >= int(before["progress"]["documents_seen"])
    assert int(after["rollout_written"]) >= int(before["rollout_written"])
    assert replacement["spec"]["volumes"] == redis_pod["spec"]["volumes"]
    assert cluster.get("pvc", f"{name}-redis-data", "-n", namespace)["metadata"]["uid"] == claim["metadata"]["uid"]

    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["restarts"], status["attempt"], status["failedAttempts"]) == (0, 0, 0), status
    for pod in cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)"):
        assert all(cs["restartCount"] == 0 for cs in pod["status"]["containerStatuses"]), pod["status"]
    log = cluster.kubectl("logs", "-n", namespace, trainer0).stdout
    steps = [json.loads(line)["step"] for line in log.splitlines() if line.startswith('{"event": "step"')]
    assert steps == list(range(1, MAX_STEPS + 1)), steps  # one process, every step once

    # Every entry delivered was acked once its checkpoint was durable, every step was full, nothing was lost.
    snapshot = redis_snapshot(cluster, namespace, final, diagnostics)
    assert int(snapshot["progress"]["documents_seen"]) == MAX_STEPS * PER_STEP == status["documentsSeen"]
    (group,) = snapshot["groups"]
    assert group["pending"] == 0, snapshot["groups"]
    counters = json.loads(snapshot["progress"]["stream"])
    assert counters["lost_pending"] == 0 and counters["dead_lettered"] == 0 and counters["redeliveries"] == 0, counters
    assert int(snapshot["checkpoint"]["step"]) == MAX_STEPS
