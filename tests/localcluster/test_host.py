"""What clean_host removes on the host, without nodes: iptables chains and routes in a network namespace of the test's
own (``unshare --net``: the host's rules are never touched), and the host-path clean-up on directories under
``tmp_path`` standing in for /var/lib/kubelet, /run/containerd, /etc/cni and /var/log/containers.

Run: ``python -m pytest tests/localcluster/test_host.py -q`` (root for the network namespace).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rljob_localcluster.node import cleanup, configs

NETNS_SCRIPT = textwrap.dedent('''
    import json, subprocess
    from rljob_localcluster.node import host

    def sh(*a):
        subprocess.run(a, check=True, capture_output=True)

    # another program's chains (podman's CNI firewall), jumped to with a quoted comment
    sh("iptables", "-N", "CNI-FORWARD")
    sh("iptables", "-A", "FORWARD", "-m", "comment", "--comment", "CNI firewall plugin rules", "-j", "CNI-FORWARD")
    sh("iptables", "-t", "nat", "-N", "CNI-HOSTPORT-DNAT")
    sh("iptables", "-t", "nat", "-A", "PREROUTING", "-j", "CNI-HOSTPORT-DNAT")
    before = host.iptables_chains()
    # the nodes': kube-proxy's (a spaced comment), portmap's (jumped to from a chain that was there), ours
    sh("iptables", "-N", "KUBE-FORWARD")
    sh("iptables", "-I", "FORWARD", "1", "-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD")
    sh("iptables", "-t", "nat", "-N", "CNI-DN-abc")
    sh("iptables", "-t", "nat", "-A", "CNI-HOSTPORT-DNAT", "-p", "tcp", "--dport", "80", "-j", "CNI-DN-abc")
    sh("iptables", "-N", "CNI-RLJOB-HOST-ONLY")
    sh("iptables", "-I", "FORWARD", "1", "-j", "CNI-RLJOB-HOST-ONLY")
    removed = host.remove_iptables_chains(keep=before)
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "route", "add", "10.96.5.0/24", "dev", "lo")
    print(json.dumps({"before": before, "removed": removed, "after": host.iptables_chains(),
                      "save": subprocess.run(["iptables-save"], capture_output=True, text=True).stdout,
                      "routes_96": host.routes_over("10.96.0.0/16"), "routes_244": host.routes_over("10.244.0.0/16")}))
''')


def test_only_chains_made_after_start_are_removed_and_routes_into_the_ranges_are_found():
    if os.geteuid() != 0 or subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and unshare --net (a network namespace of the test's own)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cleanup.__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["unshare", "--net", sys.executable, "-c", NETNS_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["before"] == ["iptables filter CNI-FORWARD", "iptables nat CNI-HOSTPORT-DNAT"]
    assert sorted(out["removed"]) == ["iptables filter CNI-RLJOB-HOST-ONLY", "iptables filter KUBE-FORWARD",
                                      "iptables nat CNI-DN-abc"]
    assert out["after"] == out["before"]
    assert "-j CNI-FORWARD" in out["save"] and "-j CNI-HOSTPORT-DNAT" in out["save"], out["save"]
    assert "KUBE-FORWARD" not in out["save"] and "CNI-DN-abc" not in out["save"], out["save"]
    assert out["routes_96"] == ["10.96.5.0/24 dev lo scope link"] and out["routes_244"] == []


def test_host_paths_lose_what_the_nodes_put_there_and_keep_what_others_did(tmp_path, monkeypatch):
    sd, root = tmp_path / "state", tmp_path / "host"
    kubelet, run_ctd, etc_cni, logs = root / "var/lib/kubelet", root / "run/containerd", root / "etc/cni", root / "log"
    monkeypatch.setattr(cleanup, "HOST_PATHS", tuple(str(p) for p in (kubelet, run_ctd, etc_cni, logs)))
    monkeypatch.setattr(cleanup, "KUBELET_DIR", kubelet)
    monkeypatch.setattr(cleanup, "SHIM_SOCKET_DIR", run_ctd / "s")
    monkeypatch.setattr(cleanup, "LOG_LINK_DIRS", (logs,))
    monkeypatch.setattr(cleanup, "CNI_RESULTS_DIR", root / "cni-results")
    monkeypatch.setattr(configs, "RUN_DIR", root / "rljob-nodes")
    (kubelet / "device-plugins").mkdir(parents=True)
    (kubelet / "device-plugins" / "kubelet.sock").touch()
    task = sd / "rljob-node-0" / "containerd-state" / "io.containerd.runtime.v2.task" / "k8s.io" / "abc123"
    task.mkdir(parents=True)
    digest = hashlib.sha256(f"{configs.containerd_socket('rljob-node-0')}/k8s.io/abc123".encode()).hexdigest()
    (run_ctd / "s").mkdir(parents=True)
    (run_ctd / "s" / digest).touch()  # our shim's socket, left by a killed shim
    (run_ctd / "s" / "f00d").touch()  # someone else's
    (etc_cni / "net.d").mkdir(parents=True)  # empty dirs only
    (root / "cni-results").mkdir()
    for f in ("rljob-node-0-abc123-eth0", "cni-loopback-abc123-lo", "cni-loopback-f00d-lo"):  # ours, ours, not ours
        (root / "cni-results" / f).touch()
    logs.mkdir()
    (logs / "pod_ns_c-1.log").symlink_to(sd / "rljob-node-0" / "pod-logs" / "c.log")
    (logs / "other.log").symlink_to(tmp_path / "elsewhere.log")
    st = {"names": ["rljob-node-0"], "host_paths_before": [str(logs)]}

    report = cleanup._remove_paths(sd, st)

    assert not kubelet.exists() and not etc_cni.exists()
    assert sorted(p.name for p in (run_ctd / "s").iterdir()) == ["f00d"]
    assert [p.name for p in logs.iterdir()] == ["other.log"]
    assert [p.name for p in (root / "cni-results").iterdir()] == ["cni-loopback-f00d-lo"]
    assert f"kept {run_ctd}: appeared while the nodes ran but holds files they do not make ({run_ctd / 's' / 'f00d'})" \
        in report, report
    assert f"removed {kubelet}" in report and f"removed {etc_cni}" in report, report
    assert not any(line.startswith("WARNING") for line in report), report
