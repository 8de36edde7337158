"""``python -m rljob_localcluster down`` on a cluster dir as a daemon that died hard leaves it: it removes the
control plane's data and the nodes' state dir (configs, kubelet and containerd state, pod logs, volume data) but
``nodes/logs/``, says what it removed and what it kept, leaves everything in place while local nodes still run on
this host, and detaches a mount below the nodes' state dir instead of deleting through it.

No cluster and no node is started. The nodes' ``state.json`` names no node and records every host path as there
before, and the host-wide parts of clean_host are pointed away from the host (the lock at a file of the test's
own, the iptables cleanup recorded instead of run), so that nodes running on this host (an e2e run) keep their
cgroups, bridges, chains and ``/var/lib/kubelet``.

Run: ``python -m pytest tests/localcluster/test_down.py -q`` (root for the mount test).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from rljob_localcluster import clusterdir
from rljob_localcluster.node import cleanup, host

NODES_REMOVED = "(configs, kubelet and containerd state, pod logs, volume data; kept logs/)"


@pytest.fixture
def iptables_cleanups(tmp_path: Path, monkeypatch) -> list[str]:
    """clean_host kept off the host: its lock and run dir under ``tmp_path``; returns the list its iptables
    cleanup appends to (instead of removing the host's CNI-*/KUBE-* chains)."""
    calls: list[str] = []
    monkeypatch.setattr(cleanup, "HOST_LOCK", tmp_path / "host.lock")
    monkeypatch.setattr(cleanup.configs, "RUN_DIR", tmp_path / "run")
    monkeypatch.setattr(cleanup.host, "remove_iptables_chains", lambda *a, **k: calls.append("iptables") or [])
    return calls


def _session_leftovers(d: Path) -> Path:
    """A cluster dir as a daemon that died hard leaves it; returns the nodes' state dir."""
    sd = d / "nodes"
    (sd / "logs").mkdir(parents=True)
    (sd / "logs" / "kubelet-rljob-node-0.log").write_text("kubelet started\n")
    (sd / "pv" / "pvc-1").mkdir(parents=True)
    (sd / "pv" / "pvc-1" / "checkpoint.bin").write_bytes(b"\0" * 16)
    (sd / "rljob-node-0" / "kubelet" / "pods").mkdir(parents=True)
    (sd / "rljob-node-0" / "kubelet.yaml").write_text("kind: KubeletConfiguration\n")
    (sd / "state.json").write_text(json.dumps({
        "version": 1, "names": [], "bin_dir": str(d / "no-bin"), "host_ip": "127.0.0.1", "sysctls": {},
        "host_paths_before": list(cleanup.HOST_PATHS), "containerd_roots": [], "bridges": [], "links": [],
        "pids": {},
    }))
    (d / "data" / "logs").mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"pids": {}}))
    (d / "kubeconfig").write_text("apiVersion: v1\n")
    (d / "daemon.log").write_text("local cluster up\n")
    return sd


def test_down_removes_the_node_state_and_says_what_it_removed_and_kept(tmp_path, capsys, iptables_cleanups):
    d = tmp_path / "cluster"
    sd = _session_leftovers(d)
    assert clusterdir.down(d) == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in d.iterdir()) == ["daemon.log", "nodes"]
    assert [p.name for p in sd.iterdir()] == ["logs"]
    assert (sd / "logs" / "kubelet-rljob-node-0.log").read_text() == "kubelet started\n"
    assert iptables_cleanups == ["iptables"]
    assert "control plane was not running" in err
    assert f"nodes: removed {sd} {NODES_REMOVED}" in err
    assert f"removed {d / 'data'} (etcd data, certificates, control-plane logs)" in err
    assert f"kept {d / 'daemon.log'} and {sd / 'logs'}" in err
    assert clusterdir.down(d) == 0  # nothing left to remove: says nothing about removing
    assert "removed" not in capsys.readouterr().err and iptables_cleanups == ["iptables"]


def test_down_leaves_everything_in_place_while_local_node_processes_run(tmp_path, capsys, iptables_cleanups):
    d = tmp_path / "cluster"
    sd = _session_leftovers(d)
    running = cleanup._HostLock()  # what LocalNodes holds while its nodes run
    running.acquire(tmp_path / "other-nodes")
    try:
        assert clusterdir.down(d) == 1
        assert "nodes not cleaned: local nodes still run on this host" in capsys.readouterr().err
        assert (sd / "state.json").exists() and (sd / "pv" / "pvc-1" / "checkpoint.bin").exists()
        assert (d / "data").exists() and (d / "kubeconfig").exists()
        assert iptables_cleanups == []
    finally:
        running.release()
    assert clusterdir.down(d) == 0
    assert f"nodes: removed {sd} {NODES_REMOVED}" in capsys.readouterr().err
    assert [p.name for p in sd.iterdir()] == ["logs"] and not (d / "data").exists()


def test_down_detaches_a_mount_below_the_node_state_instead_of_deleting_through_it(tmp_path, capsys,
                                                                                   iptables_cleanups):
    d = tmp_path / "cluster"
    sd = _session_leftovers(d)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the nodes' data")
    point = sd / "rljob-node-0" / "kubelet" / "pods" / "uid-1" / "volumes" / "data"
    point.mkdir(parents=True)
    if subprocess.run(["mount", "--bind", str(outside), str(point)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root and CAP_SYS_ADMIN)")
    try:
        assert host.mount_points_under([sd]) == [str(point.resolve())]
        assert clusterdir.down(d) == 0
        assert "nodes: unmounted 1 mounts" in capsys.readouterr().err
        assert host.mount_points_under([sd]) == []
        assert (outside / "keep.txt").read_text() == "not the nodes' data"
        assert [p.name for p in sd.iterdir()] == ["logs"]
    finally:
        if host.mount_points_under([sd]):
            subprocess.run(["umount", "-l", str(point)], check=False)
