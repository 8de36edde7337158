"""The managed Redis as the operator renders and reports it: a durable Redis on a claim owned by the job (append-only
file, appendfsync everysec, a data-directory lock against a second Redis on the same file), the emptyDir Redis of
jobs recorded before ``spec.redis.persistence`` existed rendered byte for byte as before, the claim's problems in
RedisReady, and the Event of a Redis moved between an emptyDir and a claim. The start script runs here with a real
redis-server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import redis

from rljob_api import constants as c
from rljob_api.canonical import canonical_json
from rljob_api.config import JobConfig
from rljob_api.constants import Reason
from rljob_operator import applied_hash, job_status, render
from rljob_operator.redis_io import reads as redis_reads
from rljob_operator.observe import ClaimView, DeploymentView, claim_view
from rljob_operator.runtime import JobRuntime

from operator_helpers import T0, make_job
from portutil import free_port

EARLIER_DEPLOYMENT_HASH = "b8ce6578d57ef39e"
"""``applied_hash.manifest_hash`` of ``render.redis_deployment(make_job())`` as the operator before persistence rendered it
(main at 3c5b6b8): what the applied-hash annotation of a running job's Redis Deployment holds. Rendering the same hash
for its recorded config is what keeps an upgrade from re-applying the Deployment and replacing the Redis pod."""


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def recorded_without_persistence(job: render.Job) -> JobConfig:
    """The config an operator before ``spec.redis.persistence`` recorded for ``job`` (its bytes lack the field)."""
    data = json.loads(render.job_config(job).to_json())
    del data["spec"]["redis"]["persistence"]
    return JobConfig.from_recorded(canonical_json(data), {"trainer": "earlier-t", "rollout": "earlier-r"})


# --- rendering ---------------------------------------------------------------------------------------------------
def test_a_new_job_keeps_redis_on_a_claim_with_an_append_only_file():
    job = make_job()
    config = render.job_config(job)
    claim = render.redis_claim(job, config)
    assert claim == {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "demo-redis-data", "namespace": "ns", "labels": render.labels(job, c.Role.REDIS)},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}},
    }  # no storageClassName: the cluster's default class
    deployment = render.redis_deployment(job, config)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"} and deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "demo-redis-data"}}]
    container = _container(deployment)
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert container["command"] == ["sh", "-c", render.durable_redis_script()]
    assert container["command"][2] == (
        "exec 9>>/data/redis.lock\n"
        'flock -n 9 || { echo "redis: waiting for the Redis that held /data before this one to exit"; flock 9; }\n'
        'exec redis-server --port 6379 --requirepass "$REDIS_PASSWORD" --appendonly yes --appendfsync everysec '
        '--save "" --dir /data\n')
    assert render.redis_persistence(config).size == "10Gi"


@pytest.mark.parametrize(("persistence", "wanted"), [
    ({"storageClassName": "fast", "size": "20Gi"}, {"storageClassName": "fast", "storage": "20Gi"}),
    ({"storageClassName": "", "size": "512Mi"}, {"storageClassName": "", "storage": "512Mi"}),  # a pre-made PV
])
def test_storage_class_and_size_reach_the_claim(persistence, wanted):
    job = make_job(redis={"persistence": persistence})
    spec = render.redis_claim(job, render.job_config(job))["spec"]
    assert (spec["storageClassName"], spec["resources"]["requests"]["storage"]) == (
        wanted["storageClassName"], wanted["storage"])


@pytest.mark.parametrize("size", ["0", "0Gi", "10 Gi", "-1Gi", "1e9", "ten"])
def test_a_size_that_is_no_positive_quantity_is_refused_by_the_model(size):
    with pytest.raises(ValueError, match="persistence.size"):
        make_job(redis={"persistence": {"size": size}})


def test_without_persistence_redis_is_rendered_exactly_as_before_it_existed():
    """persistence.enabled=false and a config recorded before the field existed render the Deployment of the earlier
    operator byte for byte (its applied hash), with no claim; external Redis has neither."""
    job = make_job()
    off = make_job(redis={"persistence": {"enabled": False}})
    earlier = recorded_without_persistence(job)
    assert earlier.spec.redis.persistence.enabled  # the model fills the missing field with today's default ...
    for the_job, config in ((off, render.job_config(off)), (job, earlier)):
        assert render.redis_persistence(config) is None  # ... but the bytes decide: an emptyDir
        assert render.redis_claim(the_job, config) is None
        deployment = render.redis_deployment(the_job, config)
        assert applied_hash.manifest_hash(deployment) == EARLIER_DEPLOYMENT_HASH
        assert _container(deployment)["command"] == [
            "redis-server", "--port", "6379", "--requirepass", "$(REDIS_PASSWORD)", "--appendonly", "yes", "--dir",
            "/data"]
        assert deployment["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]
    external = make_job(redis={"mode": "external", "url": "redis://cache:6379"})
    assert render.redis_persistence(render.job_config(external)) is None
    assert render.redis_claim(external, render.job_config(external)) is None


# --- the start script with a real redis-server ----------------------------------------------------------------------
needs_redis_and_flock = pytest.mark.skipif(not (shutil.which("redis-server") and shutil.which("flock")),
                                           reason="needs redis-server and flock(1)")


@pytest.fixture()
def started(tmp_path):
    """Starts ``sh -c durable_redis_script(tmp_path, port)`` processes; each is killed at the end (by pid)."""
    procs: list[subprocess.Popen] = []

    def start(port: int) -> subprocess.Popen:
        proc = subprocess.Popen(["sh", "-c", render.durable_redis_script(str(tmp_path), port)],
                                env={**os.environ, c.ENV_REDIS_PASSWORD: "pw"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, password="pw", decode_responses=True, socket_timeout=5)


def _wait_up(port: int, timeout: float = 20.0) -> redis.Redis:
    client, deadline = _client(port), time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@needs_redis_and_flock
def test_a_second_redis_on_the_same_directory_waits_for_the_first_then_loads_its_stream(started, tmp_path):
    """What a Redis pod deleted mid-run gives: its replacement starts while it still runs (the ReplicaSet does not
    wait), blocks on the lock instead of opening the same append-only file, and once the first has flushed and exited
    (SIGTERM) loads the stream, the group with its pending entry and the hashes."""
    first_port, second_port = free_port(), free_port()
    first = started(first_port)
    client = _wait_up(first_port)
    entry = client.xadd("fast_llm_streaming", {"tokens": "1"})
    client.xgroup_create("fast_llm_streaming", "fast_llm_group", id="0")
    client.xreadgroup("fast_llm_group", "fast_llm_consumer_0", {"fast_llm_streaming": ">"})
    client.hset("rljob:ns:demo:progress", mapping={"step": 7})
    client.hset("rljob:ns:demo:checkpoint", mapping={"step": 5})

    second = started(second_port)
    assert second.stdout.readline() == f"redis: waiting for the Redis that held {tmp_path} before this one to exit\n"
    time.sleep(1.0)
    with pytest.raises(redis.ConnectionError):
        _client(second_port).ping()  # not started: the lock is held
    assert second.poll() is None

    first.send_signal(signal.SIGTERM)  # sh exec'd redis-server: it gets the signal, flushes, exits, drops the lock
    assert first.wait(20) == 0
    client = _wait_up(second_port)
    (group,) = client.xinfo_groups("fast_llm_streaming")
    assert (group["name"], group["pending"], group["last-delivered-id"]) == ("fast_llm_group", 1, entry)
    assert client.xpending("fast_llm_streaming", "fast_llm_group")["min"] == entry
    assert client.hgetall("rljob:ns:demo:progress") == {"step": "7"}
    assert client.hgetall("rljob:ns:demo:checkpoint") == {"step": "5"}
    assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
    assert client.config_get("save") == {"save": ""}


@needs_redis_and_flock
def test_a_sigkilled_redis_keeps_every_write_it_acknowledged(started):
    """Redis writes its append-only file before it replies (everysec only defers the fsync), so an OOM kill or SIGKILL
    of the process (the node keeps running, so its page cache reaches the disk) loses nothing it acknowledged
    (DESIGN §6); only a crash of the node can lose the last second."""
    port = free_port()
    first = started(port)
    client = _wait_up(port)
    client.xgroup_create("s", "g", id="0", mkstream=True)
    ids = [client.xadd("s", {"n": str(i)}) for i in range(200)]
    client.xreadgroup("g", "c0", {"s": ">"}, count=150)
    client.xack("s", "g", *ids[:100])
    first.send_signal(signal.SIGKILL)
    first.wait(20)
    started(port)
    client = _wait_up(port)
    assert client.xlen("s") == 200
    (group,) = client.xinfo_groups("s")
    assert (group["pending"], group["last-delivered-id"]) == (50, ids[149])


# --- what the operator reports ---------------------------------------------------------------------------------------
NOT_AVAILABLE = DeploymentView("demo-redis", False, "0/1 replicas available")


def _event(reason: str, message: str, *, type_: str = "Warning", at: str = "2026-01-01T12:00:05Z",
           uid: str = "claim-uid") -> dict:
    return {"type": type_, "reason": reason, "message": message, "lastTimestamp": at,
            "involvedObject": {"kind": "PersistentVolumeClaim", "name": "demo-redis-data", "uid": uid}}


def _claim(phase: str = "Pending", storage_class: str | None = "fast") -> dict:
    spec = {"storageClassName": storage_class} if storage_class is not None else {}
    return {"metadata": {"name": "demo-redis-data", "uid": "claim-uid"}, "spec": spec, "status": {"phase": phase}}


def test_a_claims_problem_is_its_newest_event_when_that_says_why_it_cannot_bind():
    events = [
        _event("ProvisioningFailed", 'storageclass.storage.k8s.io "fast" not found', at="2026-01-01T12:00:09Z"),
        _event("ProvisioningFailed", "an older failure", at="2026-01-01T12:00:01Z"),
        _event("ProvisioningFailed", "of an earlier claim of the same name", at="2026-01-01T12:00:11Z", uid="old"),
    ]
    assert claim_view(_claim(), events) == ClaimView("demo-redis-data", "Pending", "fast",
                                                      'ProvisioningFailed: storageclass.storage.k8s.io "fast" not found')
    no_class = _event("FailedBinding", "no persistent volumes available for this claim and no storage class is set",
                      type_="Normal")
    assert claim_view(_claim(storage_class=None), [no_class]).problem == (
        "FailedBinding: no persistent volumes available for this claim and no storage class is set")
    # the class was created since: the provisioner's newer Event says the claim is on its way
    fixed = events + [_event("ExternalProvisioning", "waiting for a volume to be created", type_="Normal",
                             at="2026-01-01T12:00:10Z")]
    assert claim_view(_claim(), fixed).problem == ""
    same_second = events + [_event("ExternalProvisioning", "waiting", type_="Normal", at="2026-01-01T12:00:09Z")]
    assert claim_view(_claim(), same_second).problem.startswith("ProvisioningFailed")
    assert claim_view({"metadata": {"name": "x"}}, []) == ClaimView("x", "Pending", None, "")


def test_redis_ready_names_a_claim_that_cannot_bind_with_its_class_and_reason():
    spec = make_job().spec
    problem = ClaimView("demo-redis-data", "Pending", "fast", 'ProvisioningFailed: storageclass.storage.k8s.io "fast" '
                        "not found")
    health = redis_reads.health(spec, NOT_AVAILABLE, JobRuntime(), [], T0, problem)
    assert (health.ready, health.reason) == (False, Reason.CLAIM_PENDING)
    assert health.message == (
        "managed Redis demo-redis: 0/1 replicas available; its data claim demo-redis-data (storage class 'fast') is "
        'Pending: ProvisioningFailed: storageclass.storage.k8s.io "fast" not found; fix spec.redis.persistence '
        "(storageClassName, size) or the cluster's storage, or set spec.redis.persistence.enabled to false")
    no_default = ClaimView("demo-redis-data", "Pending", None, "FailedBinding: no persistent volumes available")
    assert "(no storage class (the cluster has no default StorageClass)) is Pending: FailedBinding" in redis_reads.health(
        spec, NOT_AVAILABLE, JobRuntime(), [], T0, no_default).message
    provisioning = redis_reads.health(spec, NOT_AVAILABLE, JobRuntime(), [], T0, ClaimView("demo-redis-data", "Pending",
                                                                                          "fast"))
    assert (provisioning.ready, provisioning.reason) == (False, None)  # RedisUnavailable: nothing wrong yet
    assert provisioning.message.endswith("its data claim demo-redis-data (storage class 'fast') is Pending: waiting "
                                         "for it to be bound")
    bound = ClaimView("demo-redis-data", "Bound", "fast")
    assert redis_reads.health(spec, NOT_AVAILABLE, JobRuntime(), [], T0, bound).reason is None
    ready = redis_reads.health(spec, DeploymentView("demo-redis", True, "1/1 replicas available"), JobRuntime(), [],
                               T0, problem)
    assert (ready.ready, ready.reason) == (True, None)


def test_claim_pending_is_the_redis_ready_reason_and_a_warning_event():
    from rljob_api.status import RLTrainingJobStatus
    from rljob_operator import gang

    health = job_status.RedisHealth(False, "managed Redis demo-redis: ... Pending: ProvisioningFailed: ...",
                                Reason.CLAIM_PENDING)
    unavailable = job_status.RedisHealth(False, "managed Redis demo-redis: 0/1 replicas available")

    def build(previous, redis_health):
        return job_status.build_status(previous, generation=1, lifecycle=gang.Lifecycle(), problems=[],
                                   data_parallel_size=2, redis=redis_health, pods=[], nodes=2, replicas=1,
                                   progress=None, now=T0)

    first = build(RLTrainingJobStatus(), unavailable)
    pending = build(first, health)
    cond = pending.condition(c.ConditionType.REDIS_READY)
    assert (cond.status, cond.reason, cond.message) == ("False", "ClaimPending", health.message)
    assert [(e.type, e.reason) for e in job_status.transition_events(first, pending)] == [("Warning", "ClaimPending")]


def test_moving_a_managed_redis_between_an_emptydir_and_its_claim_is_a_warning_event():
    job = make_job()
    claim = render.redis_persistence(render.job_config(job))
    on = job_status.redis_replaced("demo", None, claim)
    assert (on.type, on.reason) == ("Warning", "RedisReplaced")
    assert on.message == (
        "the managed Redis demo-redis moved from an emptyDir to the claim demo-redis-data "
        "(spec.redis.persistence.enabled: true): its new pod started empty, so the stream, its consumer group and "
        "pending entries and the progress and checkpoint hashes of the old one are gone; a running trainer gang "
        "restarts from its newest checkpoint")
    off = job_status.redis_replaced("demo", claim, None)
    assert "from the claim demo-redis-data to an emptyDir (spec.redis.persistence.enabled: false; the claim is " \
           "deleted)" in off.message
    bigger = render.redis_persistence(render.job_config(make_job(redis={"persistence": {"size": "20Gi"}})))
    assert job_status.redis_replaced("demo", claim, bigger) is None  # same claim: nothing replaced
    assert job_status.redis_replaced("demo", None, None) is None
