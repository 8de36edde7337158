"""One reconcile pass, called directly against the real API server of the local control plane (no operator process
runs beside it in this module): what a single pass writes and reports."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from datetime import datetime, timedelta, timezone
from typing import Optional

import pytest

from helm_tools import helm_binary
from rljob_operator.kube_api import KubeApi
from rljob_operator.reconcile import reconcile
from rljob_operator.runtime import Context, JobRuntime
from test_cluster import SERVICE_ACCOUNT, Kube, job_manifest

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(helm_binary() is None, reason="helm is not built: run localcluster/build-go-tools.sh"),
]

from test_cluster import installed, kube, namespace  # noqa: E402,F401  (fixtures)


def one_pass(kubeconfig, body: dict) -> tuple[float, list, Counter]:
    """Run one pass over ``body`` with a fresh runtime; returns (delay, the Events posted, requests by verb and
    resource)."""
    events, requests = [], Counter()

    async def run():
        api = await KubeApi.connect(str(kubeconfig), on_request=lambda verb, resource: requests.update([(verb, resource)]))
        try:
            ctx = Context(api=api, post_event=lambda job, event: events.append(event), read_progress=False,
                          active_interval_s=1.0, idle_interval_s=30.0)
            return await reconcile(body, [], None, JobRuntime(), ctx)
        finally:
            await api.close()

    return asyncio.run(run()), events, requests


def live(kube: Kube, namespace: str, role: str) -> list[str]:
    return [p["metadata"]["name"] for p in kube.pods(namespace, role) if not p["metadata"].get("deletionTimestamp")]


def test_a_pod_the_api_server_refuses_makes_the_job_invalid_in_the_same_pass(kube: Kube, installed, namespace):
    """limits.cpu "-2" passes the CRD but not Pod validation: the pass that creates the pods reports it (before, only
    the next pass did), and the rollout pod it created beside the refused trainer pods is gone again."""
    kube.apply(job_manifest("refused", trainer={"resources": {"limits": {"cpu": "-2"}}}), namespace)
    delay, events, requests = one_pass(installed, kube.job(namespace, "refused"))

    job = kube.job(namespace, "refused")
    assert job["status"]["phase"] == "Invalid"
    valid = next(c for c in job["status"]["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert valid["message"].startswith(
        'spec.trainer.resources: the API server refused a child object: Pod "refused-trainer-0" is invalid')
    assert requests[("patch", "rltrainingjobs/status")] == 1
    assert requests[("create", "pods")] == 3 and requests[("delete", "pods")] == 1
    assert live(kube, namespace, "rollout") == [] and live(kube, namespace, "trainer") == []
    assert [(e.type, e.reason) for e in events if e.reason == "InvalidSpec"] == [("Warning", "InvalidSpec")]
    assert delay == 30.0


def test_the_pass_that_creates_a_gang_writes_the_status_once(kube: Kube, installed, namespace):
    kube.apply(job_manifest("once"), namespace)
    delay, events, requests = one_pass(installed, kube.job(namespace, "once"))

    status = kube.job(namespace, "once")["status"]
    assert (status["phase"], status["gangCreated"], status["attempt"], status["dataParallelSize"]) == (
        "Starting", True, 0, 2)
    running = next(c for c in status["conditions"] if c["type"] == "Running")
    assert (running["status"], running["reason"], running["message"]) == (
        "False", "GangCreated", "created attempt 0: 2 trainer pods")
    assert requests[("patch", "rltrainingjobs/status")] == 1
    assert sorted(live(kube, namespace, "trainer")) == ["once-trainer-0", "once-trainer-1"]
    assert live(kube, namespace, "rollout") == ["once-rollout-0"]
    assert [e.reason for e in events] == ["SpecValid"]  # a new gang's "created, not ready yet" is no news
    assert delay == 1.0


def pass_with_pods(kubeconfig, kube: Kube, namespace: str, name: str, *, now: Optional[datetime] = None,
                   events: Optional[list] = None, terminating: bool = False,
                   runtime: Optional[JobRuntime] = None) -> Counter:
    """One pass over job ``name`` by a fresh operator process (new runtime), seeing the job's pods as its watch
    would (``terminating``: pods being deleted too); returns the requests by verb and resource. With ``now`` (the
    pass's clock) the pass also reads the job's Redis, as the operator does; the Events it posts are added to
    ``events``. ``runtime``: the job's state in one operator process across passes (default: a new process)."""
    from rljob_operator.observe import pod_view

    pods = [pod_view(p) for role in ("trainer", "rollout") for p in kube.pods(namespace, role)
            if p["metadata"]["name"].startswith(f"{name}-") and (terminating or not p["metadata"].get("deletionTimestamp"))]
    requests = Counter()
    posted = events if events is not None else []

    async def run():
        api = await KubeApi.connect(str(kubeconfig), on_request=lambda verb, resource: requests.update([(verb, resource)]))
        ctx = Context(api=api, post_event=lambda job, event: posted.append(event), read_progress=now is not None,
                      active_interval_s=1.0, idle_interval_s=30.0)
        if now is not None:
            ctx.clock = lambda: now
        try:
            await reconcile(kube.job(namespace, name), pods, None, runtime or JobRuntime(), ctx)
        finally:
            await ctx.redis_clients.close()
            await api.close()

    asyncio.run(run())
    return requests


def uids(kube: Kube, namespace: str, role: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.pods(namespace, role)
            if not p["metadata"].get("deletionTimestamp")}


def test_an_upgraded_operator_restarts_no_gang_until_the_user_edits_a_field_the_role_reads(kube: Kube, installed,
                                                                                           namespace):
    """An earlier operator version recorded the job's config without a field this version adds (with a default), and
    its pods carry that version's hashes. This version keeps them: the same pod UIDs, the ConfigMap's bytes unchanged.
    An edit of a rollout-only field replaces the rollout pod only; an edit of a trainer field restarts the gang."""
    import json

    kube.apply(job_manifest("upgrade"), namespace)
    pass_with_pods(installed, kube, namespace, "upgrade")
    trainers, rollouts = uids(kube, namespace, "trainer"), uids(kube, namespace, "rollout")
    assert sorted(trainers) == ["upgrade-trainer-0", "upgrade-trainer-1"] and list(rollouts) == ["upgrade-rollout-0"]

    # What the earlier version left: the config without trainer.backend, its hashes on the ConfigMap and the pods.
    cm = kube.json("get", "configmap", "upgrade-config", "-n", namespace)
    data = json.loads(cm["data"]["config.json"])
    del data["spec"]["trainer"]["backend"]
    earlier_text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    cm["data"]["config.json"] = earlier_text
    cm["metadata"]["annotations"]["rljob.dev/role-config-hashes"] = json.dumps({"trainer": "earlier-t", "rollout": "earlier-r"})
    kube.run("replace", "-f", "-", input=json.dumps(cm))
    for pod, role in [*[(n, "t") for n in trainers], *[(n, "r") for n in rollouts]]:
        kube.run("label", "pod", pod, "-n", namespace, "--overwrite", f"rljob.dev/role-config-hash=earlier-{role}")

    requests = pass_with_pods(installed, kube, namespace, "upgrade")
    assert requests[("create", "pods")] == 0 and requests[("delete", "pods")] == 0
    assert (uids(kube, namespace, "trainer"), uids(kube, namespace, "rollout")) == (trainers, rollouts)
    assert kube.json("get", "configmap", "upgrade-config", "-n", namespace)["data"]["config.json"] == earlier_text

    kube.apply(job_manifest("upgrade", rollout={"maxLag": 77}), namespace)  # a rollout-only edit
    requests = pass_with_pods(installed, kube, namespace, "upgrade")
    assert requests[("delete", "pods")] == 1 and uids(kube, namespace, "trainer") == trainers
    text = kube.json("get", "configmap", "upgrade-config", "-n", namespace)["data"]["config.json"]
    assert json.loads(text)["spec"]["rollout"]["maxLag"] == 77 and "backend" not in json.loads(text)["spec"]["trainer"]

    kube.apply(job_manifest("upgrade", rollout={"maxLag": 77}, trainer={"maxSteps": 999}), namespace)  # a trainer edit
    pass_with_pods(installed, kube, namespace, "upgrade")
    assert not set(uids(kube, namespace, "trainer").values()) & set(trainers.values())
    text = kube.json("get", "configmap", "upgrade-config", "-n", namespace)["data"]["config.json"]
    assert json.loads(text)["spec"]["trainer"]["backend"] == "builtin"  # this version's resolution, new default in


def test_an_upgraded_operator_keeps_a_running_redis_on_its_emptydir_until_the_user_edits_its_persistence(
        kube: Kube, installed, namespace):
    """The job as the API server returns it after a CRD upgrade holds spec.redis.persistence with its defaults
    (enabled), but the children an earlier operator made — ConfigMap record without the field, emptyDir Redis
    Deployment stamped with that rendering's hash — stay as they are: no Deployment applied, no claim created, the
    Redis Deployment's template untouched, also through an edit elsewhere. An edit of spec.redis.persistence moves
    Redis onto the claim (created, owned by the job) and says so in a RedisReplaced Event; switching it off moves
    it back and deletes the claim."""
    import json

    from rljob_api.canonical import canonical_json
    from rljob_api.config import JobConfig
    from rljob_api.spec import RLTrainingJobSpec
    from rljob_operator import applied_hash, render
    from rljob_operator.kube_api import adopt

    kube.apply(job_manifest("keep"), namespace)
    job = kube.job(namespace, "keep")
    assert job["spec"]["redis"]["persistence"] == {"enabled": True, "size": "10Gi"}  # the CRD's defaults
    rendered = render.Job("keep", namespace, RLTrainingJobSpec.model_validate(job["spec"]))
    data = json.loads(render.job_config(rendered).to_json())
    del data["spec"]["redis"]["persistence"]
    earlier = JobConfig.from_recorded(canonical_json(data), render.role_hashes(JobConfig.from_json(canonical_json(data))))
    made = render.static_children(rendered, earlier, job["metadata"]["generation"])  # as the earlier operator did:
    secret = render.redis_secret(rendered, "pw")                                       # server-side apply, its manager
    adopt(made + [secret], job)
    for child in made + [secret]:
        kube.run("apply", "--server-side", "--field-manager=rljob-operator", "-f", "-",
                 input=json.dumps(applied_hash.stamp(child) if child is not secret else child))
    kube.run("patch", "rljob", "keep", "-n", namespace, "--subresource=status", "--type=merge",
             "-p", json.dumps({"status": {"phase": "Pending", "attempt": 0}}))
    deployment = kube.json("get", "deployment", "keep-redis", "-n", namespace)
    template = deployment["spec"]["template"]
    assert template["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]

    def claim():
        return kube.json("get", "pvc", "keep-redis-data", "-n", namespace)

    requests = pass_with_pods(installed, kube, namespace, "keep")
    assert (requests[("apply", "deployments")], requests[("create", "persistentvolumeclaims")]) == (0, 0)
    assert requests[("apply", "configmaps")] == 0 and claim() is None
    after = kube.json("get", "deployment", "keep-redis", "-n", namespace)
    assert (after["metadata"]["resourceVersion"], after["spec"]["template"]) == (
        deployment["metadata"]["resourceVersion"], template)
    assert "persistence" not in json.loads(kube.json("get", "configmap", "keep-config", "-n", namespace)[
        "data"]["config.json"])["spec"]["redis"]

    kube.apply(job_manifest("keep", trainer={"maxSteps": 999}), namespace)  # an edit elsewhere: a new resolution
    events = []
    requests = pass_with_pods(installed, kube, namespace, "keep", events=events)
    text = kube.json("get", "configmap", "keep-config", "-n", namespace)["data"]["config.json"]
    assert json.loads(text)["spec"]["trainer"]["maxSteps"] == 999 and "persistence" not in json.loads(text)["spec"]["redis"]
    assert requests[("apply", "deployments")] == 0 and claim() is None
    assert "RedisReplaced" not in [e.reason for e in events]
    assert kube.json("get", "deployment", "keep-redis", "-n", namespace)["spec"]["template"] == template

    kube.apply(job_manifest("keep", trainer={"maxSteps": 999}, redis={"persistence": {"size": "2Gi"}}), namespace)
    events = []
    requests = pass_with_pods(installed, kube, namespace, "keep", events=events)
    assert (requests[("apply", "deployments")], requests[("create", "persistentvolumeclaims")]) == (1, 1)
    made = claim()
    (ref,) = made["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("RLTrainingJob", "keep", job["metadata"]["uid"],
                                                                          True)
    assert made["spec"]["resources"]["requests"]["storage"] == "2Gi" and made["spec"]["accessModes"] == ["ReadWriteOnce"]
    volumes = kube.json("get", "deployment", "keep-redis", "-n", namespace)["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "data", "persistentVolumeClaim": {"claimName": "keep-redis-data"}}]
    (replaced,) = [e for e in events if e.reason == "RedisReplaced"]
    assert replaced.type == "Warning" and "moved from an emptyDir to the claim keep-redis-data" in replaced.message

    requests = pass_with_pods(installed, kube, namespace, "keep")  # the next operator: nothing more to do
    assert requests[("apply", "deployments")] == 0 and requests[("create", "persistentvolumeclaims")] == 0
    assert claim()["metadata"]["uid"] == made["metadata"]["uid"]

    kube.apply(job_manifest("keep", trainer={"maxSteps": 999}, redis={"persistence": {"size": "2Gi", "enabled": False}}),
               namespace)
    events = []
    requests = pass_with_pods(installed, kube, namespace, "keep", events=events)
    assert (requests[("apply", "deployments")], requests[("delete", "persistentvolumeclaims")]) == (1, 1)
    volumes = kube.json("get", "deployment", "keep-redis", "-n", namespace)["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "data", "emptyDir": {}}]
    gone = claim()
    assert gone is None or gone["metadata"].get("deletionTimestamp")  # kept while the old Redis pod holds it
    assert [e.reason for e in events].count("RedisReplaced") == 1


def test_an_upgrade_that_adds_the_reward_failure_deadline_replaces_no_pod_nor_does_editing_it(kube: Kube, installed,
                                                                                                namespace):
    """A job made before spec.rollout.rewardFailureDeadlineSeconds existed: this version's CRD fills in its default
    (600) without a new generation, so the recorded config (without the field) and the pods' hashes stay. An edit of
    the deadline alone replaces no pod either (only the operator reads it): the ConfigMap records the new value, the
    pods keep their hashes."""
    kube.apply(job_manifest("deadline"), namespace)
    pass_with_pods(installed, kube, namespace, "deadline")
    trainers, rollouts = uids(kube, namespace, "trainer"), uids(kube, namespace, "rollout")
    assert len(trainers) == 2 and len(rollouts) == 1

    cm = kube.json("get", "configmap", "deadline-config", "-n", namespace)
    data = json.loads(cm["data"]["config.json"])
    del data["spec"]["rollout"]["rewardFailureDeadlineSeconds"]  # what the earlier operator resolved and recorded
    earlier_text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    cm["data"]["config.json"] = earlier_text
    earlier_hashes = json.dumps({"trainer": "earlier-t", "rollout": "earlier-r"})
    cm["metadata"]["annotations"]["rljob.dev/role-config-hashes"] = earlier_hashes
    kube.run("replace", "-f", "-", input=json.dumps(cm))
    for pod, role in [*[(n, "t") for n in trainers], *[(n, "r") for n in rollouts]]:
        kube.run("label", "pod", pod, "-n", namespace, "--overwrite", f"rljob.dev/role-config-hash=earlier-{role}")
    job = kube.job(namespace, "deadline")
    assert job["spec"]["rollout"]["rewardFailureDeadlineSeconds"] == 600 and job["metadata"]["generation"] == 1

    requests = pass_with_pods(installed, kube, namespace, "deadline")
    assert requests[("create", "pods")] == 0 and requests[("delete", "pods")] == 0
    assert (uids(kube, namespace, "trainer"), uids(kube, namespace, "rollout")) == (trainers, rollouts)
    assert kube.json("get", "configmap", "deadline-config", "-n", namespace)["data"]["config.json"] == earlier_text

    kube.apply(job_manifest("deadline", rollout={"rewardFailureDeadlineSeconds": 120}), namespace)
    requests = pass_with_pods(installed, kube, namespace, "deadline")
    assert requests[("create", "pods")] == 0 and requests[("delete", "pods")] == 0
    assert (uids(kube, namespace, "trainer"), uids(kube, namespace, "rollout")) == (trainers, rollouts)
    cm = kube.json("get", "configmap", "deadline-config", "-n", namespace)
    assert json.loads(cm["data"]["config.json"])["spec"]["rollout"]["rewardFailureDeadlineSeconds"] == 120
    assert json.loads(cm["metadata"]["annotations"]["rljob.dev/role-config-hashes"]) == json.loads(earlier_hashes)


def test_rewards_failing_longer_than_the_deadline_fail_the_job_and_a_younger_streak_does_not(
        kube: Kube, installed, namespace, redis_server):
    """Passes over a job on an external Redis whose rollout hash holds a reward-failure streak (as workers write it):
    599 s of failing batches since the job started keep it running with RolloutReady=False/AllRewardsFailed saying
    when it fails; 600 s end it Failed/RewardsFailing with the exception counts, a Warning Event, and its pods
    deleted (cleanPodPolicy All)."""
    from rljob_api import protocol

    kube.run("create", "secret", "generic", "shared-redis", "-n", namespace,
             f"--from-literal=password={redis_server.password}")
    kube.apply(job_manifest("rewards", rollout={"rewardFailureDeadlineSeconds": 600},
                            redis={"mode": "external", "url": redis_server.url,
                                   "passwordSecretRef": {"name": "shared-redis", "key": "password"}}), namespace)
    start = datetime.now(timezone.utc).replace(microsecond=0)
    pass_with_pods(installed, kube, namespace, "rewards", now=start)  # creates the gang; startTime = start
    assert kube.job(namespace, "rewards")["status"]["startTime"] == f"{start:%Y-%m-%dT%H:%M:%SZ}"
    assert len(live(kube, namespace, "trainer")) == 2 and len(live(kube, namespace, "rollout")) == 1

    key, field = f"rljob:{namespace}:rewards:rollout", protocol.ROLLOUT_ALL_REWARDS_FAILED
    since = start.timestamp() + 30
    zero = "ZeroDivisionError: division by zero"

    def streak(lasted: float) -> protocol.RewardFailures:
        return protocol.RewardFailures(since=since, updated_at=since + lasted, batches=14, samples=512,
                                       errors={zero: 512}, version=64, last_samples=16,
                                       last_errors={"ZeroDivisionError": 16})

    client = redis_server.client()
    client.hset(key, field, streak(599).to_field())
    later = start + timedelta(seconds=700)
    events: list = []
    pass_with_pods(installed, kube, namespace, "rewards", now=later, events=events)
    status = kube.job(namespace, "rewards")["status"]
    assert status["phase"] == "Starting" and "completionTime" not in status  # no node here: the gang stays Pending
    ready = next(c for c in status["conditions"] if c["type"] == "RolloutReady")
    assert (ready["status"], ready["reason"]) == ("False", "AllRewardsFailed")
    failing_since = start + timedelta(seconds=30)
    assert ready["message"].endswith(
        f"failing since {failing_since:%Y-%m-%dT%H:%M:%SZ}: the job fails (RewardsFailing) if no sample scores by "
        f"{failing_since + timedelta(seconds=600):%Y-%m-%dT%H:%M:%SZ} (spec.rollout.rewardFailureDeadlineSeconds = 600)")
    assert ("Warning", "AllRewardsFailed") in [(e.type, e.reason) for e in events]
    assert "RewardsFailing" not in [e.reason for e in events]

    client.hset(key, field, streak(600).to_field())
    events.clear()
    requests = pass_with_pods(installed, kube, namespace, "rewards", now=later, events=events)
    status = kube.job(namespace, "rewards")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    message = (f"ZeroDivisionError: division by zero ×512 in spec.rollout.task's reward function since "
               f"{failing_since:%Y-%m-%dT%H:%M:%SZ}: every sample of 14 rollout batches failed for 600 s, reaching "
               "spec.rollout.rewardFailureDeadlineSeconds = 600; fix the reward code or spec.rollout.task "
               "(rewardFunction, datasetPath); the rollout pods' logs hold the tracebacks (kept when "
               "runPolicy.cleanPodPolicy is None)")
    assert (status["phase"], failed["status"], failed["reason"], failed["message"]) == (
        "Failed", "True", "RewardsFailing", message)
    assert status["completionTime"] == f"{later:%Y-%m-%dT%H:%M:%SZ}" and status["failedAttempts"] == 0
    assert ("Warning", "RewardsFailing", f"Failed=True: {message}") in [(e.type, e.reason, e.message) for e in events]
    assert requests[("delete", "pods")] == 3 and requests[("create", "pods")] == 0
    assert live(kube, namespace, "trainer") == [] and live(kube, namespace, "rollout") == []


def test_trainer_pods_stuck_on_a_lost_node_are_force_deleted_and_the_next_attempt_starts(kube: Kube, installed,
                                                                                         namespace):
    """No kubelet runs here, so a pod bound to a node stays Terminating once deleted, as on a node that stopped
    reporting. A Node whose Ready condition has been Unknown for 400 s (what the node lifecycle controller leaves of
    a node whose kubelet stopped) holds both trainer pods of attempt 0; one is deleted. The passes, under the
    operator's ServiceAccount (RBAC: get nodes): restart the gang (both pods now Terminating), force-delete both once
    their grace is over (the node lost for longer than their 300 s toleration) with a Warning Event naming the node,
    then create attempt 1."""
    kube.apply(job_manifest("lost"), namespace)
    pass_with_pods(installed, kube, namespace, "lost")
    node = f"lost-{namespace}"
    since = (datetime.now(timezone.utc) - timedelta(seconds=400)).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    try:
        kube.run("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps({"status": {
            "conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                            "message": "Kubelet stopped posting node status.", "lastTransitionTime": since,
                            "lastHeartbeatTime": since}]}}))
        for pod in ("lost-trainer-0", "lost-trainer-1"):  # as the scheduler binds a pod (a Binding is only created)
            kube.run("create", "-n", namespace, "-f", "-", input=json.dumps({
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}))
        kube.run("delete", "pod", "lost-trainer-1", "-n", namespace, "--grace-period=3", "--wait=false")

        events: list = []
        pass_with_pods(installed, kube, namespace, "lost", events=events, terminating=True)
        job = kube.job(namespace, "lost")
        assert (job["status"]["phase"], job["status"]["attempt"]) == ("Restarting", 1)
        stuck = {p["metadata"]["name"] for p in kube.pods(namespace, "trainer") if p["metadata"].get("deletionTimestamp")}
        assert stuck == {"lost-trainer-0", "lost-trainer-1"}, kube.run("get", "pods,events", "-n", namespace, "-o", "wide").stdout

        time.sleep(4)  # lost-trainer-1's grace is over; lost-trainer-0's (30 s) is not: it waits, named
        requests = pass_with_pods(installed, kube, namespace, "lost", events=events, terminating=True)
        assert requests[("get", "nodes")] == 1
        assert [p["metadata"]["name"] for p in kube.pods(namespace, "trainer")] == ["lost-trainer-0"]
        forced = [e for e in events if e.reason == "PodForceDeleted"]
        assert [(e.type, e.message.split(";")[0]) for e in forced] == [("Warning", (
            f"trainer pod lost-trainer-1 is stuck terminating: node {node} is not Ready since "
            f"{since[11:19]}: Unknown (NodeStatusUnknown)"))]
        assert "processes it left on the node are fenced" in forced[0].message

        deadline = time.monotonic() + 60  # lost-trainer-0 was deleted by the first pass, with a 30 s grace
        while kube.pods(namespace, "trainer"):
            assert time.monotonic() < deadline, "lost-trainer-0 was not force-deleted once its grace was over"
            time.sleep(2)
            pass_with_pods(installed, kube, namespace, "lost", events=events, terminating=True)
        pass_with_pods(installed, kube, namespace, "lost")
        assert sorted(p["metadata"]["labels"]["rljob.dev/attempt"] for p in kube.pods(namespace, "trainer")) == ["1", "1"]
        assert len([e for e in events if e.reason == "PodForceDeleted"]) == 2
    finally:
        kube.run("delete", "node", node, "--wait=false", check=False)


def test_a_stream_redis_forgot_is_reported_with_what_it_held_and_its_restart_is_not_counted(kube: Kube, installed,
                                                                                          namespace, redis_server):
    """Issue 11 item 2: an external Redis flushed under a running job. The operator saw the stream identity the
    trainer made and the group's counts; after FLUSHALL the identity is gone: a Warning Event StreamLost says what was
    lost (the last counts read) and the checkpoint the gang goes on from, and the trainer pod that then fails (as its
    ranks do: fenced, or NOGROUP) restarts the gang without counting against backoffLimit 0."""
    from rljob_api import protocol

    kube.run("create", "secret", "generic", "shared-redis", "-n", namespace,
             f"--from-literal=password={redis_server.password}")
    kube.apply(job_manifest("forgot", runPolicy={"backoffLimit": 0},
                            redis={"mode": "external", "url": redis_server.url,
                                   "passwordSecretRef": {"name": "shared-redis", "key": "password"}}), namespace)
    prefix = f"rljob:{namespace}:forgot:"
    start = datetime.now(timezone.utc).replace(microsecond=0)
    events: list = []
    memory = JobRuntime()  # what one operator process remembers between passes (a new runtime per event loop)

    def next_pass(seconds: float) -> None:
        runtime = JobRuntime(backlog=memory.backlog)
        pass_with_pods(installed, kube, namespace, "forgot", now=start + timedelta(seconds=seconds), runtime=runtime,
                       events=events)
        memory.backlog = runtime.backlog

    next_pass(0)  # creates attempt 0

    client = redis_server.client()  # as the trainer and the rollout leave it: identity, stream, group, a checkpoint
    client.set(prefix + protocol.KEY_STREAM_ID, "id-a")
    stream, group = prefix + "fast_llm_streaming", "fast_llm_group"
    for i in range(5):
        client.xadd(stream, {"tokens": b"x" * 8, "i": i})
    client.xgroup_create(stream, group, id="0")
    client.xreadgroup(group, "fast_llm_consumer_0", {stream: ">"}, count=3)  # 3 pending, 2 undelivered
    client.hset(prefix + "checkpoint", mapping=protocol.CheckpointRecord(30, 1920, "/ckpt/step-00000030").to_fields())
    next_pass(5)
    status = kube.job(namespace, "forgot")["status"]
    assert status["streamIdentity"] == "id-a" and "streamLostAttempt" not in status
    assert status["lastCheckpoint"]["step"] == 30 and "StreamLost" not in [e.reason for e in events]

    client.flushall()
    kube.fail_pod(namespace, "forgot-trainer-0")
    next_pass(10)
    status = kube.job(namespace, "forgot")["status"]
    assert (status["phase"], status["attempt"], status["failedAttempts"], status["streamLostAttempt"]) == (
        "Restarting", 1, 0, 0)
    assert "streamIdentity" not in status
    restarting = next(c for c in status["conditions"] if c["type"] == "Restarting")
    assert restarting["reason"] == "StreamLost" and "after Redis forgot the stream" in restarting["message"]
    lost = [e for e in events if e.reason == "StreamLost" and not e.message.startswith("Restarting=True")]
    assert [(e.type, e.message) for e in lost] == [("Warning", (
        "Redis forgot the job's stream during attempt 0 (its identity was id-a, Redis holds none; a managed Redis "
        "without persistence restarted, or an external one was flushed or failed over): at the operator's last read it "
        "held 3 entries trained since the last checkpoint (pending) and 2 written but not delivered yet: those not "
        "covered by a later checkpoint are gone; the gang goes on from the newest committed checkpoint, step 30 (1920 "
        "documents) at that read or a later one, recreating the stream and its consumer group; the restart is not "
        "counted against backoffLimit"))]

    client.set(prefix + protocol.KEY_STREAM_ID, "id-b")  # attempt 1's rank 0 made a new stream
    next_pass(15)
    assert kube.job(namespace, "forgot")["status"]["streamIdentity"] == "id-b"
    assert len([e for e in events if e.message.startswith("Redis forgot")]) == 1


def no_pod_deletes(kube: Kube, kubeconfig, namespace: str) -> Path:
    """A kubeconfig of a ServiceAccount with the operator's cluster rights except deleting pods: a pass under it writes
    its status and then fails at its first delete, as an operator stopped right after its status write would."""
    import yaml

    role = kube.json("get", "clusterrole", f"{SERVICE_ACCOUNT}-cluster")
    for rule in role["rules"]:
        if "pods" in rule.get("resources", ()) and "delete" in rule.get("verbs", ()):
            rule["verbs"] = [verb for verb in rule["verbs"] if verb not in ("delete", "deletecollection", "*")]
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "rljob-no-pod-deletes"}, "rules": role["rules"]})
    kube.run("create", "serviceaccount", "no-pod-deletes", "-n", namespace)
    kube.run("create", "clusterrolebinding", f"no-pod-deletes-{namespace}", "--clusterrole=rljob-no-pod-deletes",
             f"--serviceaccount={namespace}:no-pod-deletes")
    token = kube.run("create", "token", "no-pod-deletes", "-n", namespace, "--duration=1h").stdout.strip()
    config = yaml.safe_load(Path(kubeconfig).read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    path = Path(kubeconfig).with_name(f"no-pod-deletes-{namespace}")
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_restart_is_explained_in_status_before_any_pod_goes_and_after_the_next_attempt_runs(kube: Kube, installed,
                                                                                              namespace):
    """A trainer pod deleted, and the operator gone right after the status write that restarts the gang (its pod
    deletes refused): status.attempts already says why attempt 0 ended, and keeps saying it once a restarted operator
    has torn attempt 0 down and started attempt 1 (the Restarting condition no longer tells it then)."""
    from rljob_operator.kube_api import ApiError

    kube.apply(job_manifest("acct"), namespace)
    pass_with_pods(installed, kube, namespace, "acct")
    kube.run("delete", "pod", "acct-trainer-1", "-n", namespace, "--wait=false")
    crippled = no_pod_deletes(kube, installed, namespace)
    with pytest.raises(ApiError) as refused:
        pass_with_pods(crippled, kube, namespace, "acct")
    assert refused.value.status == 403
    status = kube.job(namespace, "acct")["status"]
    ended = ("PodDeleted", "trainer pod acct-trainer-1 of attempt 0 is gone (deleted); tearing down the gang, ")
    assert (status["attempt"], status["restarts"], status["phase"]) == (1, 1, "Restarting")
    assert [(a["attempt"], a["reason"], a["message"][:len(ended[1])], a["dataParallelSize"]) for a in
            status["attempts"]] == [(0, *ended, 2)]
    assert live(kube, namespace, "trainer") == ["acct-trainer-0"]  # nothing was deleted yet

    for _ in range(3):  # a restarted operator: tears attempt 0 down, then creates attempt 1
        pass_with_pods(installed, kube, namespace, "acct")
    status = kube.job(namespace, "acct")["status"]
    assert (status["attempt"], status["phase"], status["gangCreated"]) == (1, "Starting", True)
    assert [(a["attempt"], a.get("reason"), (a.get("message") or "")[:len(ended[1])], "endTime" in a)
            for a in status["attempts"]] == [(0, *ended, True), (1, None, "", False)]
    assert status["attempts"][0]["endTime"] <= status["attempts"][1]["startTime"]
