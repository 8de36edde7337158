"""Scaling a queued job on a Kueue whose ElasticJobsViaWorkloadSlices gate is off (its default): the real Kueue manager
with the gate off and the operator as a process, against the real API server (no nodes), as in
test_kueue_queueing.py. Up: the replacement slice is admitted only in full, then the operator finishes the old one,
the gang untouched; down: Kueue's webhook refuses the in-place decrease, so the Workload is made again and the job
queues anew, the message naming the gate."""

from __future__ import annotations

import pytest

from rljob_localcluster.kueue import LocalKueue

from test_cluster import (  # noqa: F401  (fixtures)
    Kube, installed, kube, namespace, operator, wait_for,
)
from test_kueue_queueing import finished, live, queued_job, queues, slices, uids

pytestmark = [pytest.mark.cluster, pytest.mark.kueue]


@pytest.fixture(scope="module", autouse=True)
def kueue(control_plane):
    """Kueue with its default gates (elastic workloads off), started before the operator."""
    with LocalKueue(control_plane, feature_gates="VisibilityOnDemand=false") as running:
        yield running


def test_without_the_gate_a_scale_up_waits_for_the_whole_job_and_a_scale_down_requeues_it(kube, operator, namespace):
    queues(kube, namespace, gpus=11)  # the job at 1 rollout pod (5 GPUs) and again at 2 (6) side by side
    kube.apply(queued_job("nogate"), namespace)
    pods = wait_for(lambda: len(p := live(kube, namespace, "nogate")) == 3 and p, "2 trainer + 1 rollout pods")
    trainers = uids(pods, "trainer")

    kube.run("scale", "rljob", "nogate", "-n", namespace, "--replicas=2")
    pods = wait_for(lambda: len(p := live(kube, namespace, "nogate")) == 4 and p, "2 trainer + 2 rollout pods")
    assert uids(pods, "trainer") == trainers
    old = wait_for(lambda: finished(w := slices(kube, namespace, "nogate")["nogate-workload"]) and w,
                   "the old slice finished by the operator", timeout=60)
    assert finished(old)["reason"] == "OutOfSync"
    assert "ElasticJobsViaWorkloadSlices is off" in finished(old)["message"]
    assert kube.job(namespace, "nogate")["status"]["attempt"] == 0

    kube.run("scale", "rljob", "nogate", "-n", namespace, "--replicas=1")
    (told,) = wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                                if "ElasticJobsViaWorkloadSlices is off" in e["message"]], "the Event naming the gate")
    assert (told["type"], told["reason"]) == ("Warning", "ElasticJobsOff") and "field is immutable" in told["message"]
    pods = wait_for(lambda: len(p := live(kube, namespace, "nogate")) == 3 and p, "the job admitted again")
    assert not uids(pods, "trainer") & trainers
    assert list(slices(kube, namespace, "nogate")) == ["nogate-workload"]
