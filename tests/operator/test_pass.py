"""One reconcile pass, called directly against the real API server of the local control plane (no operator process
runs beside it in this module): what a single pass writes and reports."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from helm_tools import helm_binary
from rljob_operator.apply import KubeApi
from rljob_operator.reconcile import reconcile
from rljob_operator.runtime import Context, JobRuntime
from test_cluster import Kube, job_manifest

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
    assert valid["message"].startswith('spec: the API server refused a child object: Pod "refused-trainer-0" is invalid')
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
