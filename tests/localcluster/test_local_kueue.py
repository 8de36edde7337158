"""Kueue next to the local control plane (rljob_localcluster.kueue.LocalKueue): the pinned manager runs, the API server
reaches its validating webhook and its conversion webhook on loopback, and stopping it leaves no webhook behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rljob_localcluster import pinned_versions
from rljob_localcluster.kueue import WEBHOOK_PREFIX, LocalKueue
from rljob_localcluster.pids import pid_running

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.kueue,
    pytest.mark.skipif(os.environ.get("RLJOB_SKIP_CLUSTER") == "1", reason="RLJOB_SKIP_CLUSTER=1"),
]


def _cluster_queue(name: str, gpus: str) -> str:
    return json.dumps({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
                       "spec": {"resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                           {"name": "f", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}})


def _webhooks(cp) -> list[str]:
    found = cp.kubectl("get", "validatingwebhookconfigurations,mutatingwebhookconfigurations", "-o", "json")
    return [o["metadata"]["name"] for o in json.loads(found.stdout)["items"]
            if o["metadata"]["name"].startswith(WEBHOOK_PREFIX)]


def test_kueue_answers_its_webhooks_and_conversions_and_stop_removes_its_webhooks(control_plane):
    kueue = LocalKueue(control_plane)
    with kueue:
        pid = kueue.proc.pid
        assert f'"gitVersion":"{pinned_versions()["kueue"]}"' in kueue.log_path.read_text().replace(" ", "")
        assert sorted(_webhooks(control_plane)) == [WEBHOOK_PREFIX + "mutating-webhook-configuration",
                                                    WEBHOOK_PREFIX + "validating-webhook-configuration"]
        refused = control_plane.kubectl("apply", "-f", "-", input=_cluster_queue("rljob-test-negative", "-1"),
                                        check=False)
        assert refused.returncode != 0
        assert 'admission webhook "vclusterqueue.kb.io" denied the request' in refused.stderr, refused.stderr
        control_plane.kubectl("apply", "-f", "-", input=_cluster_queue("rljob-test-conversion", "4"))
        # served as v1beta1 too: the API server converts through Kueue's /convert
        old = json.loads(control_plane.kubectl("get", "clusterqueues.v1beta1.kueue.x-k8s.io",
                                               "rljob-test-conversion", "-o", "json").stdout)
        assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
        assert old["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] == "4"
        control_plane.kubectl("delete", "clusterqueue", "rljob-test-conversion")
    assert _webhooks(control_plane) == []
    assert kueue.proc is None and not pid_running(pid)
    assert not kueue.data_dir.exists()


def test_cli_up_kueue_runs_it_next_to_the_control_plane_and_down_ends_it(tmp_path):
    d = tmp_path / "cluster"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "localcluster"), os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "rljob_localcluster"]
    up = subprocess.run([*cli, "up", "--dir", str(d), "--no-nodes", "--kueue"], capture_output=True, text=True,
                        env=env, timeout=400, check=False)
    st: dict = {}
    try:
        assert up.returncode == 0, up.stderr
        assert f"# Kueue {pinned_versions()['kueue']} (pid " in up.stderr
        st = json.loads(subprocess.run([*cli, "status", "--dir", str(d)], capture_output=True, text=True, env=env,
                                       check=True).stdout)
        assert st["requested"] == {"nodes": 0, "gpus_per_node": 4, "kueue": True}
        assert st["pids"]["kueue"] == st["kueue"]["pid"] and pid_running(st["kueue"]["pid"])
        kubectl = subprocess.run(["bash", "-c", up.stdout + "\nkubectl get validatingwebhookconfigurations -o name"],
                                 capture_output=True, text=True, check=True)
        assert f"validatingwebhookconfiguration.admissionregistration.k8s.io/{WEBHOOK_PREFIX}" in kubectl.stdout
        other = subprocess.run([*cli, "up", "--dir", str(d), "--no-nodes"], capture_output=True, text=True,
                               env=env, timeout=60, check=False)
        assert other.returncode == 1 and "'kueue': True" in other.stderr
    finally:
        down = subprocess.run([*cli, "down", "--dir", str(d)], capture_output=True, text=True, env=env, timeout=180,
                              check=False)
    assert down.returncode == 0, down.stderr
    assert st and not pid_running(st["kueue"]["pid"])
