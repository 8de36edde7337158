"""The local control plane is a real Kubernetes: versions, garbage collection, RBAC, node
controllers, scheduler, helm, clean start/stop, and the up/down CLI.

Run: ``python -m pytest tests/localcluster -v`` (the first run may build the Go tools: tens of
minutes; later runs start the control plane in ~10 s). RLJOB_SKIP_CLUSTER=1 skips these tests.
"""

from __future__ import annotations

import json
import os
import shlex
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rljob_localcluster import (
    ControlPlane,
    ControlPlaneError,
    pinned_versions,
    tools_bin_dir,
)
from rljob_localcluster.pids import pid_running
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("RLJOB_SKIP_CLUSTER") == "1", reason="RLJOB_SKIP_CLUSTER=1"),
]


def kget(cp, *args) -> dict | None:
    p = cp.kubectl("get", *args, "-o", "json", check=False)
    if p.returncode != 0:
        if "NotFound" in p.stderr:
            return None
        raise AssertionError(p.stderr)
    return json.loads(p.stdout)


def test_versions_match_pins(control_plane):
    want = pinned_versions()["kubernetes"]
    assert want.startswith("v1.34.")
    v = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert v["clientVersion"]["gitVersion"] == want
    assert v["serverVersion"]["gitVersion"] == want
    assert (v["serverVersion"]["major"], v["serverVersion"]["minor"]) == ("1", "34")
    etcd = subprocess.run(
        [str(control_plane.bin_dir / "etcd"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert f"etcd Version: {pinned_versions()['etcd'].lstrip('v')}" in etcd


def test_helm_version():
    helm = tools_bin_dir() / "helm"
    out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(pinned_versions()["helm"])
    assert out.stdout.startswith("v3.")


def test_helm_talks_to_the_cluster(control_plane, namespace):
    out = subprocess.run(
        [str(control_plane.bin_dir / "helm"), "list", "-n", namespace, "-o", "json"],
        capture_output=True, text=True, env=control_plane.env(), check=True,
    )
    assert json.loads(out.stdout) == []


def _configmap(name: str, ns: str, owner: dict | None = None, block: bool = False) -> str:
    meta: dict = {"name": name, "namespace": ns}
    if owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "blockOwnerDeletion": block,
            }
        ]
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}})


def test_garbage_collector_deletes_dependents(control_plane, namespace):
    cp = control_plane
    cp.kubectl("apply", "-f", "-", input=_configmap("owner", namespace))
    owner = kget(cp, "configmap", "owner", "-n", namespace)
    cp.kubectl("apply", "-f", "-", input=_configmap("dependent", namespace, owner))
    dep = kget(cp, "configmap", "dependent", "-n", namespace)
    assert dep["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]

    cp.kubectl("delete", "configmap", "owner", "-n", namespace)  # background propagation
    wait_until(lambda: kget(cp, "configmap", "dependent", "-n", namespace) is None, 60,
               "garbage collector to delete the dependent ConfigMap")


def test_foreground_deletion_waits_for_dependents(control_plane, namespace):
    cp = control_plane
    cp.kubectl("apply", "-f", "-", input=_configmap("fg-owner", namespace))
    owner = kget(cp, "configmap", "fg-owner", "-n", namespace)
    cp.kubectl("apply", "-f", "-", input=_configmap("fg-dep", namespace, owner, block=True))
    cp.kubectl("delete", "configmap", "fg-owner", "-n", namespace, "--cascade=foreground",
               "--wait=false")
    wait_until(lambda: kget(cp, "configmap", "fg-owner", "-n", namespace) is None
               and kget(cp, "configmap", "fg-dep", "-n", namespace) is None, 60,
               "foreground deletion of owner and dependent")


def _api(cp, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    ctx = ssl.create_default_context(cafile=cp.ca_cert_path)
    req = urllib.request.Request(
        cp.server + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_rbac_is_enforced_for_service_account_tokens(control_plane, namespace):
    cp = control_plane
    cp.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    # TokenRequest API (what kubectl create token calls), bound to the API server's audience.
    tr = json.loads(cp.kubectl(
        "create", "--raw", f"/api/v1/namespaces/{namespace}/serviceaccounts/nobody/token", "-f", "-",
        input=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                          "spec": {"expirationSeconds": 600}}),
    ).stdout)
    token = tr["status"]["token"]

    # The token authenticates ...
    code, review = _api(cp, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", token,
                        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    assert code == 201, review
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:nobody"
    # ... but without a RoleBinding RBAC forbids it.
    code, status = _api(cp, "GET", f"/api/v1/namespaces/{namespace}/configmaps", token)
    assert code == 403, status
    assert status["reason"] == "Forbidden"
    code, _ = _api(cp, "GET", "/api/v1/namespaces/default/configmaps", token)
    assert code == 403

    # Bind a Role and the same token is allowed (RBAC decides, not something else).
    cp.kubectl("create", "role", "cm-reader", "-n", namespace, "--verb=get,list", "--resource=configmaps")
    cp.kubectl("create", "rolebinding", "nobody-reads", "-n", namespace, "--role=cm-reader",
               f"--serviceaccount={namespace}:nobody")
    wait_until(lambda: _api(cp, "GET", f"/api/v1/namespaces/{namespace}/configmaps", token)[0] == 200,
               30, "RoleBinding to take effect")
    code, _ = _api(cp, "GET", "/api/v1/namespaces/default/configmaps", token)
    assert code == 403, "a namespaced RoleBinding must not grant access to other namespaces"
    code, _ = _api(cp, "GET", "/api/v1/namespaces", "not-a-token")
    assert code == 401


def test_namespace_controllers_run(control_plane, namespace):
    cp = control_plane
    # service-account controller and root-CA publisher (kube-controller-manager)
    wait_until(lambda: kget(cp, "serviceaccount", "default", "-n", namespace), 30,
               "default ServiceAccount")
    ca = wait_until(lambda: kget(cp, "configmap", "kube-root-ca.crt", "-n", namespace), 30,
                    "kube-root-ca.crt ConfigMap")
    assert ca["data"]["ca.crt"] == Path(cp.ca_cert_path).read_text()


def _node(name: str, ready: str) -> str:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res = {"cpu": "4", "memory": "8Gi", "pods": "110", "nvidia.com/gpu": "1"}
    return json.dumps({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "capacity": res, "allocatable": res,
            "conditions": [{"type": "Ready", "status": ready, "reason": "Test",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        },
    })


def test_node_controllers_and_scheduler(control_plane, pod_namespace):
    cp, namespace = control_plane, pod_namespace
    good, bad = f"node-{namespace}-a", f"node-{namespace}-b"
    try:
        for name, ready in ((good, "True"), (bad, "False")):
            cp.kubectl("create", "-f", "-", input=_node(name, ready))
            # status is dropped on create; set it through the status subresource like a kubelet
            cp.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                       json.dumps({"status": json.loads(_node(name, ready))["status"]}))

        # node-ipam controller gives each node a pod CIDR
        wait_until(lambda: (kget(cp, "node", good) or {}).get("spec", {}).get("podCIDR"), 30,
                   "podCIDR on the node")
        # node-lifecycle controller taints the NotReady node
        def tainted():
            taints = (kget(cp, "node", bad) or {}).get("spec", {}).get("taints") or []
            return any(t["key"] == "node.kubernetes.io/not-ready" for t in taints)
        wait_until(tainted, 60, "node-lifecycle controller's not-ready taint")

        # the scheduler binds a GPU pod to the only Ready node with a GPU
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "gpu-pod", "namespace": namespace},
            "spec": {"containers": [{"name": "c", "image": "none", "command": ["true"],
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        }
        cp.kubectl("create", "-f", "-", input=json.dumps(pod))
        bound = wait_until(lambda: (kget(cp, "pod", "gpu-pod", "-n", namespace) or {})
                           .get("spec", {}).get("nodeName"), 60, "scheduler to bind the pod")
        assert bound == good
    finally:
        cp.kubectl("delete", "pod", "gpu-pod", "-n", namespace, "--force", "--grace-period=0",
                   "--ignore-not-found", check=False)
        cp.kubectl("delete", "node", good, bad, "--ignore-not-found", check=False)


def test_stop_terminates_its_processes_and_removes_data(tmp_path):
    cp = ControlPlane(tmp_path / "cp")
    with cp:
        pids = cp.pids
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
        assert all(pid_running(p) for p in pids.values())
        assert cp.kubectl("get", "ns", "default").returncode == 0
    assert not any(pid_running(p) for p in pids.values())
    assert not (tmp_path / "cp").exists()


def test_failed_start_cleans_up(tmp_path):
    real = tools_bin_dir()
    bad = tmp_path / "bin"
    bad.mkdir()
    for t in ("etcd", "kube-controller-manager", "kube-scheduler", "kubectl"):
        (bad / t).symlink_to(real / t)
    (bad / "kube-apiserver").write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    (bad / "kube-apiserver").chmod(0o755)
    cp = ControlPlane(tmp_path / "cp", bin_dir=bad, start_timeout=60)
    with pytest.raises(ControlPlaneError, match="boom: cannot start"):
        cp.start()
    assert cp.pids == {}
    assert not (tmp_path / "cp").exists()
    # etcd had been started by that attempt and must be gone
    out = subprocess.run(["pgrep", "-f", str(tmp_path / "cp")], capture_output=True, text=True,
                         check=False)
    assert out.stdout.strip() == ""


def test_cli_up_status_down(tmp_path):
    d = tmp_path / "cluster"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "localcluster"), os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "rljob_localcluster"]
    up = subprocess.run([*cli, "up", "--dir", str(d), "--no-nodes"], capture_output=True, text=True, env=env,
                        timeout=300, check=False)
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={shlex.quote(str(d / 'kubeconfig'))}" in up.stdout
        st = json.loads(subprocess.run([*cli, "status", "--dir", str(d)], capture_output=True,
                                       text=True, env=env, check=True).stdout)
        assert st["phase"] == "ready" and st["requested"] == {"nodes": 0, "gpus_per_node": 4}
        assert all(pid_running(p) for p in st["pids"].values())
        # the exported environment works for a plain shell
        out = subprocess.run(["bash", "-c", up.stdout + "\nkubectl get ns default -o name"],
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "namespace/default"
        # a second 'up' reuses the running cluster
        again = subprocess.run([*cli, "up", "--dir", str(d), "--no-nodes"], capture_output=True, text=True,
                               env=env, timeout=60, check=False)
        assert again.returncode == 0 and "already running" in again.stderr
        # ... but not one asked for nodes it does not have
        other = subprocess.run([*cli, "up", "--dir", str(d), "--nodes", "1"], capture_output=True, text=True,
                               env=env, timeout=60, check=False)
        assert other.returncode == 1
        assert "already runs in" in other.stderr and "{'nodes': 0, 'gpus_per_node': 4}, not {'nodes': 1" in other.stderr
    finally:
        down = subprocess.run([*cli, "down", "--dir", str(d)], capture_output=True, text=True,
                              env=env, timeout=120, check=False)
    assert down.returncode == 0, down.stderr
    assert not any(pid_running(p) for p in st["pids"].values())
    assert not pid_running(st["daemon_pid"])
    assert not (d / "data").exists() and not (d / "kubeconfig").exists()
    assert subprocess.run([*cli, "status", "--dir", str(d)], env=env, capture_output=True,
                          check=False).returncode == 1


def test_cli_down_while_the_control_plane_starts_stops_it_at_once(tmp_path):
    """SIGTERM (what ``down`` sends) interrupts the daemon's start: the processes it started end and ``down``
    returns in seconds, not after its 180 s SIGKILL timeout."""
    d = tmp_path / "cluster"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "localcluster"), os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "rljob_localcluster"]
    up = subprocess.Popen([*cli, "up", "--dir", str(d), "--no-nodes"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
    try:
        def etcd_runs() -> bool:
            return bool(subprocess.run(["pgrep", "-f", f"etcd.*{d / 'data'}"], capture_output=True,
                                       check=False).stdout.strip())
        wait_until(etcd_runs, timeout=60, what="the daemon's etcd started")
        daemon = int((d / "daemon.pid").read_text())
        second = subprocess.run([*cli, "up", "--dir", str(d), "--no-nodes"], capture_output=True, text=True, env=env,
                                timeout=60, check=False)  # a second up leaves the starting one alone
        assert second.returncode == 1 and "is still starting" in second.stderr, second.stderr
        assert pid_running(daemon)
        t0 = time.monotonic()
        down = subprocess.run([*cli, "down", "--dir", str(d)], capture_output=True, text=True, env=env,
                              timeout=120, check=False)
        took = time.monotonic() - t0
        assert down.returncode == 0, down.stderr
        assert took < 60, f"down took {took:.0f}s"
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 1 and "failed to start (stopped by 'down')" in err and "stopped while starting" in err
    assert not pid_running(daemon)
    assert subprocess.run(["pgrep", "-f", str(d / "data")], capture_output=True, check=False).stdout == b""
    assert not (d / "data").exists() and not (d / "daemon.pid").exists()


def test_cli_up_refuses_bad_counts_before_starting_anything(tmp_path):
    from rljob_localcluster import __main__ as cli

    assert cli.main(["up", "--dir", str(tmp_path / "c"), "--nodes", "-1"]) == 2
    assert cli.main(["up", "--dir", str(tmp_path / "c"), "--gpus-per-node", "-2"]) == 2
    assert cli.main(["up", "--dir", str(tmp_path / "c"), "--nodes-timeout", "-5"]) == 2
    assert cli.main(["up", "--dir", str(tmp_path / "c"), "--timeout", "0"]) == 2
    assert not (tmp_path / "c").exists()
