"""Pure parts of the local node agent: env and downward API, volumes and mounts, DNS records and
hosts files, pod status, IP allocation, probes, mount points. No cluster, no root needed.

Run: ``python -m pytest tests/localcluster/test_agent_units.py -q``.
"""

from __future__ import annotations

import base64
import http.server
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
from rljob_localcluster.agent.dns import (
    DnsRecord,
    hosts_lines,
    pod_hosts_file,
    records_from_endpoint_slices,
    replace_managed_block,
)
from rljob_localcluster.agent.mountpoints import MountPointError, MountPoints
from rljob_localcluster.agent.logs import PREVIOUS_DIR, claim_log, log_path, logs
from rljob_localcluster.agent.network import (
    IPAllocator,
    NetworkError,
    bridge_address,
    node_pod_cidrs,
    pod_mac,
)
from rljob_localcluster.agent.podenv import (
    ContainerConfigError,
    DictSource,
    container_argv,
    container_env,
    expand,
    field_value,
    resource_value,
)
from rljob_localcluster.agent.podstatus import (
    ContainerRecord,
    pod_conditions,
    pod_phase,
    pod_status,
    status_patch,
)
from rljob_localcluster.agent.probes import ProbeTracker, resolve_port, run_probe
from rljob_localcluster.agent.volumes import (
    Mount,
    VolumeError,
    VolumeFile,
    container_mounts,
    downward_files,
    host_path_dir,
    image_mounts,
    key_files,
    projected_files,
    write_files,
)


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


POD = {
    "metadata": {"name": "p0", "namespace": "ns1", "uid": "uid-1", "labels": {"b": "2", "a": "1"},
                 "annotations": {"note": "x"}},
    "spec": {"nodeName": "rljob-node-1", "serviceAccountName": "sa1", "hostname": "h0", "subdomain": "peers",
             "containers": [{"name": "main", "resources": {"limits": {"memory": "2Gi"}, "requests": {"cpu": "250m"}}}]},
    "status": {"podIP": "10.244.1.9", "hostIP": "10.244.0.1"},
}
SOURCE = DictSource({
    ("ConfigMap", "ns1", "cfg"): {"data": {"mode": "fast", "bad-key!": "skipped", "K": "from-cm"},
                                  "binaryData": {"bin": b64("raw")}},
    ("Secret", "ns1", "sec"): {"data": {"password": b64("hunter2")}},
})


# ---------------------------------------------------------------------------- $(VAR) expansion
@pytest.mark.parametrize(
    ("text", "want"),
    [
        # cases from kubernetes third_party/forked/golang/expansion/expand_test.go
        ("$(VAR_A)", "A"),
        ("___$(VAR_B)___", "___B___"),
        ("$(VAR_A)-$(VAR_A)", "A-A"),
        ("$$(VAR_A)", "$(VAR_A)"),
        ("$$$$(VAR_A)", "$$(VAR_A)"),
        ("$$$(VAR_A)", "$A"),
        ("$(VAR_DOES_NOT_EXIST)", "$(VAR_DOES_NOT_EXIST)"),
        ("$(VAR_A", "$(VAR_A"),
        ("$VAR_A", "$VAR_A"),
        ("f000-$$VAR_A", "f000-$VAR_A"),
        ("$", "$"),
        ("$()", "$()"),
        ("$(VAR_A)$(VAR_B)", "AB"),
    ],
)
def test_expand_matches_kubernetes(text, want):
    assert expand(text, {"VAR_A": "A", "VAR_B": "B"}) == want


# ---------------------------------------------------------------------------- env
def test_container_env_resolves_every_kind_of_reference():
    container = {
        "name": "main",
        "resources": {"limits": {"memory": "2Gi"}, "requests": {"cpu": "250m"}},
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CM_"}, {"secretRef": {"name": "missing", "optional": True}}],
        "env": [
            {"name": "LITERAL", "value": "one"},
            {"name": "EXPANDED", "value": "$(LITERAL)-$(CM_mode)-$(UNDEFINED)"},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
            {"name": "OPTIONAL", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "nope", "optional": True}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "LABEL_A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['a']"}}},
            {"name": "MEM_MI", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "CPU_REQ_M", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
            {"name": "KUBERNETES_SERVICE_PORT", "value": "8443"},
        ],
    }
    env = container_env(POD, container, SOURCE, pod_ip="10.244.2.7", node_allocatable={"cpu": "16"},
                        cluster_env={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert env == {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "8443",  # the pod's own env wins over the cluster's
        "CM_mode": "fast",
        "CM_K": "from-cm",
        "CM_bin": "raw",  # binaryData too; "CM_bad-key!" is not a valid name and is skipped
        "LITERAL": "one",
        "EXPANDED": "one-fast-$(UNDEFINED)",
        "MODE": "fast",
        "PASSWORD": "hunter2",
        "POD_NAME": "p0",
        "POD_NAMESPACE": "ns1",
        "POD_IP": "10.244.2.7",  # the agent's address overrides the (stale) status
        "NODE": "rljob-node-1",
        "LABEL_A": "1",
        "MEM_MI": "2048",
        "CPU_LIMIT": "16",  # no limit: node allocatable
        "CPU_REQ_M": "250",
    }


@pytest.mark.parametrize(
    ("value_from", "message"),
    [
        ({"configMapKeyRef": {"name": "nope", "key": "k"}}, 'configmap "nope" not found'),
        ({"configMapKeyRef": {"name": "cfg", "key": "nope"}}, "couldn't find key nope in ConfigMap ns1/cfg"),
        ({"secretKeyRef": {"name": "sec", "key": "nope"}}, "couldn't find key nope in Secret ns1/sec"),
        ({"fieldRef": {"fieldPath": "spec.containers"}}, "unsupported fieldPath: spec.containers"),
        ({"resourceFieldRef": {"resource": "bogus"}}, "unsupported container resource: bogus"),
    ],
)
def test_container_env_errors_name_the_missing_reference(value_from, message):
    with pytest.raises(ContainerConfigError, match=message.replace("(", r"\(")):
        container_env(POD, {"name": "c", "env": [{"name": "X", "valueFrom": value_from}]}, SOURCE)


def test_downward_api_values():
    assert field_value(POD, "metadata.labels") == 'a="1"\nb="2"'
    assert field_value(POD, "metadata.annotations['note']") == "x"
    assert field_value(POD, "spec.serviceAccountName") == "sa1"
    assert field_value(POD, "status.hostIP") == "10.244.0.1"
    assert resource_value({"resources": {"requests": {"memory": "1500Ki"}}}, "requests.memory", "1Mi", {}) == "2"  # ceil
    assert resource_value({}, "requests.memory", None, {"memory": "8Gi"}) == "0"  # unset request: 0


def test_container_argv_expands_and_requires_a_command():
    argv = container_argv({"command": ["python", "-m", "x"], "args": ["--ip=$(POD_IP)", "$$(POD_IP)"]}, {"POD_IP": "1.2.3.4"})
    assert argv == ["python", "-m", "x", "--ip=1.2.3.4", "$(POD_IP)"]
    with pytest.raises(ContainerConfigError, match="sets no command.*image 'redis:7'"):
        container_argv({"name": "c", "image": "redis:7", "args": ["--port", "1"]}, {})


# ---------------------------------------------------------------------------- volumes
def test_configmap_and_secret_files():
    cm = {"data": {"config.json": "{}", "other": "o"}, "binaryData": {"blob": b64("\x00\x01")}}
    assert key_files("ConfigMap", cm, {"name": "cfg"}, None, volume="v", namespace="ns") == [
        VolumeFile("blob", b"\x00\x01", 0o644), VolumeFile("config.json", b"{}", 0o644), VolumeFile("other", b"o", 0o644)]
    items = {"name": "cfg", "items": [{"key": "config.json", "path": "sub/c.json", "mode": 0o600}]}
    assert key_files("ConfigMap", cm, items, 0o640, volume="v", namespace="ns") == [VolumeFile("sub/c.json", b"{}", 0o600)]
    sec = {"data": {"password": b64("pw")}}
    assert key_files("Secret", sec, {"secretName": "s"}, 0o400, volume="v", namespace="ns") == [VolumeFile("password", b"pw", 0o400)]
    assert key_files("Secret", None, {"secretName": "s", "optional": True}, None, volume="v", namespace="ns") == []
    with pytest.raises(VolumeError, match='secret "s" not found'):
        key_files("Secret", None, {"secretName": "s"}, None, volume="v", namespace="ns")
    with pytest.raises(VolumeError, match="has no key 'nope'"):
        key_files("ConfigMap", cm, {"name": "cfg", "items": [{"key": "nope", "path": "n"}]}, None, volume="v", namespace="ns")
    with pytest.raises(VolumeError, match="invalid item path"):
        key_files("ConfigMap", cm, {"name": "cfg", "items": [{"key": "other", "path": "../escape"}]}, None,
                  volume="v", namespace="ns")


def test_projected_service_account_volume():
    """The shape the ServiceAccount admission plugin injects (kube-api-access-*)."""
    source = DictSource({("ConfigMap", "ns1", "kube-root-ca.crt"): {"data": {"ca.crt": "CERT"}}})
    calls = []

    def token(audience: str, expiration: int) -> bytes:
        calls.append((audience, expiration))
        return b"TOKEN"

    projected = {"defaultMode": 0o644, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ]}
    files = projected_files(POD, projected, source, token, volume="kube-api-access-x")
    assert files == [VolumeFile("token", b"TOKEN", 0o644), VolumeFile("ca.crt", b"CERT", 0o644),
                     VolumeFile("namespace", b"ns1", 0o644)]
    assert calls == [("", 3607)]
    no_mode = {"sources": [{"serviceAccountToken": {"path": "t", "audience": "vault"}}]}
    assert projected_files(POD, no_mode, source, token, volume="v") == [VolumeFile("t", b"TOKEN", 0o600)]
    assert calls[-1] == ("vault", 3600)


def test_downward_volume_resource_item_needs_known_container():
    items = [{"path": "mem", "resourceFieldRef": {"containerName": "main", "resource": "limits.memory", "divisor": "1Gi"}},
             {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
    assert downward_files(POD, items, None, volume="d") == [VolumeFile("mem", b"2"), VolumeFile("labels", b'a="1"\nb="2"')]
    with pytest.raises(VolumeError, match="container 'ghost' not found"):
        downward_files(POD, [{"path": "m", "resourceFieldRef": {"containerName": "ghost", "resource": "limits.cpu"}}],
                       None, volume="d")


def test_write_files_is_atomic_and_prunes(tmp_path):
    write_files(tmp_path, [VolumeFile("a", b"1", 0o600), VolumeFile("d/b", b"2")])
    assert (tmp_path / "a").read_bytes() == b"1"
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o600
    inode = (tmp_path / "a").stat().st_ino
    write_files(tmp_path, [VolumeFile("a", b"new")])
    assert (tmp_path / "a").read_bytes() == b"new"
    assert (tmp_path / "a").stat().st_ino != inode  # replaced by rename, never rewritten in place
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a"]  # d/b and d pruned, no temp files left


def test_container_mounts(tmp_path):
    vols = {"cfg": str(tmp_path / "cfg"), "data": str(tmp_path / "data"), "shm": str(tmp_path / "shm")}
    for d in vols.values():
        os.makedirs(d)
    container = {"name": "main", "volumeMounts": [
        {"name": "data", "mountPath": "/var/lib/rljob/checkpoints/run", "subPathExpr": "$(POD_NAME)"},
        {"name": "cfg", "mountPath": "/etc/rljob"},
        {"name": "shm", "mountPath": "/dev/shm", "readOnly": True},
    ]}
    mounts = container_mounts(container, vols, {"cfg"}, {"POD_NAME": "p0"})
    assert [(m.source, m.target, m.read_only) for m in mounts] == [
        (vols["cfg"], "/etc/rljob", True),  # configMap kinds are read-only even without readOnly
        (vols["shm"], "/dev/shm", True),
        (os.path.join(vols["data"], "p0"), "/var/lib/rljob/checkpoints/run", False),  # deepest last
    ]
    assert os.path.isdir(os.path.join(vols["data"], "p0"))  # subPath dir created, as kubelet does
    with pytest.raises(VolumeError, match="names no volume"):
        container_mounts({"name": "c", "volumeMounts": [{"name": "ghost", "mountPath": "/x"}]}, vols, set(), {})


def test_image_mounts_rebind_only_the_outermost_hidden_image_paths():
    mounts = [Mount("/vol/empty", "/tmp"), Mount("/vol/cfg", "/etc/rljob", True)]
    image = ["/tmp/ci/checkout", "/tmp/ci/checkout/api", "/tmp/ci/venv", "/usr/lib/python3.11", "/tmp"]
    assert image_mounts(image, mounts) == [Mount("/tmp/ci/checkout", "/tmp/ci/checkout", True),
                                           Mount("/tmp/ci/venv", "/tmp/ci/venv", True)]
    # A volume exactly at an image path replaces it (as in a real container); nothing hidden, nothing bound.
    assert image_mounts(["/usr/lib/python3.11", "/tmpx/a"], mounts) == []


def test_host_path_type_checks(tmp_path):
    made = tmp_path / "a" / "b"
    assert host_path_dir({"path": str(made), "type": "DirectoryOrCreate"}, "v") == str(made) and made.is_dir()
    f = tmp_path / "f" / "file"
    assert host_path_dir({"path": str(f), "type": "FileOrCreate"}, "v") == str(f) and f.is_file()
    assert host_path_dir({"path": str(made), "type": "Directory"}, "v") == str(made)
    with pytest.raises(VolumeError, match="is not a directory"):
        host_path_dir({"path": str(f), "type": "Directory"}, "v")
    with pytest.raises(VolumeError, match="is not a file"):
        host_path_dir({"path": str(made), "type": "File"}, "v")
    with pytest.raises(VolumeError, match="does not exist"):
        host_path_dir({"path": str(tmp_path / "missing")}, "v")


# ---------------------------------------------------------------------------- DNS
SLICES = [
    {"metadata": {"namespace": "ns1", "labels": {"kubernetes.io/service-name": "peers", "service.kubernetes.io/headless": ""}},
     "addressType": "IPv4",
     "endpoints": [
         {"addresses": ["10.244.1.2"], "hostname": "h0", "conditions": {"ready": True}},
         {"addresses": ["10.244.2.2"], "hostname": "h1"},  # ready unset means ready
         {"addresses": ["10.244.2.3"], "hostname": "h2", "conditions": {"ready": False}},
     ]},
    {"metadata": {"namespace": "ns2", "labels": {"kubernetes.io/service-name": "redis"}},
     "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": True}}]},
    {"metadata": {"namespace": "ns2", "labels": {"kubernetes.io/service-name": "v6"}}, "addressType": "IPv6",
     "endpoints": [{"addresses": ["fd00::1"]}]},
    {"metadata": {"namespace": "ns2", "labels": {}}, "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.9"]}]},
]


def test_records_from_endpoint_slices():
    assert records_from_endpoint_slices(SLICES) == [
        DnsRecord("ns1", "h0.peers", "10.244.1.2"),
        DnsRecord("ns1", "h1.peers", "10.244.2.2"),
        DnsRecord("ns1", "peers", "10.244.1.2"),
        DnsRecord("ns1", "peers", "10.244.2.2"),
        DnsRecord("ns2", "redis", "10.244.1.5"),
    ]


def test_hosts_lines_and_pod_hosts_file():
    records = records_from_endpoint_slices(SLICES)
    host = hosts_lines(records, "cluster.local")
    assert host[0] == "10.244.1.2\th0.peers.ns1.svc.cluster.local h0.peers.ns1.svc h0.peers.ns1 " \
                      "peers.ns1.svc.cluster.local peers.ns1.svc peers.ns1"
    assert host[-1] == "10.244.2.2\th1.peers.ns1.svc.cluster.local h1.peers.ns1.svc h1.peers.ns1 " \
                       "peers.ns1.svc.cluster.local peers.ns1.svc peers.ns1"
    pod = {"metadata": {"name": "p", "namespace": "ns1"},
           "spec": {"hostname": "h0", "subdomain": "peers", "hostAliases": [{"ip": "1.2.3.4", "hostnames": ["a", "b"]}]}}
    text = pod_hosts_file(pod, "10.244.1.2", records, "cluster.local")
    lines = text.splitlines()
    assert "127.0.0.1\tlocalhost" in lines
    assert "10.244.1.2\th0.peers.ns1.svc.cluster.local\th0" in lines  # its own name, as kubelet writes it
    assert "1.2.3.4\ta\tb" in lines
    # short names only for its own namespace: "peers" and "h1.peers" yes, "redis" (ns2) no
    assert "10.244.2.2\th1.peers.ns1.svc.cluster.local h1.peers.ns1.svc h1.peers.ns1 h1.peers " \
           "peers.ns1.svc.cluster.local peers.ns1.svc peers.ns1 peers" in lines
    assert any(line.startswith("10.244.1.5\t") and line.endswith("redis.ns2") for line in lines)


def test_replace_managed_block_keeps_everything_else():
    original = "127.0.0.1 localhost\n# BEGIN t\n1.1.1.1 old\n# END t\n::1 ip6\n"
    replaced = replace_managed_block(original, ["2.2.2.2 new"], "t")
    assert replaced == "127.0.0.1 localhost\n::1 ip6\n# BEGIN t\n2.2.2.2 new\n# END t\n"
    assert replace_managed_block(replaced, [], "t") == "127.0.0.1 localhost\n::1 ip6\n"
    assert replace_managed_block("no newline", ["x"], "t") == "no newline\n# BEGIN t\nx\n# END t\n"
    other = replace_managed_block("a\n", ["x"], "other")
    assert replace_managed_block(other, ["y"], "t") == "a\n# BEGIN other\nx\n# END other\n# BEGIN t\ny\n# END t\n"


# ---------------------------------------------------------------------------- pod status
def rec(name, state, code=None, last=None):
    return ContainerRecord(name, state=state, exit_code=code, last_terminated=last)


@pytest.mark.parametrize(
    ("policy", "init", "main", "phase"),
    [
        ("Never", [], [rec("a", "waiting")], "Pending"),
        ("Never", [], [rec("a", "running"), rec("b", "waiting")], "Pending"),
        ("Never", [], [rec("a", "running"), rec("b", "terminated", 0)], "Running"),
        ("Never", [], [rec("a", "terminated", 0), rec("b", "terminated", 0)], "Succeeded"),
        ("Never", [], [rec("a", "terminated", 0), rec("b", "terminated", 2)], "Failed"),
        ("OnFailure", [], [rec("a", "terminated", 0)], "Succeeded"),
        ("OnFailure", [], [rec("a", "waiting", last={"exitCode": 1})], "Running"),
        ("Always", [], [rec("a", "terminated", 0)], "Running"),
        ("Always", [], [rec("a", "waiting", last={"exitCode": 0})], "Running"),
        ("Never", [rec("i", "running")], [rec("a", "waiting")], "Pending"),
        ("Never", [rec("i", "terminated", 1)], [rec("a", "waiting")], "Failed"),
        ("OnFailure", [rec("i", "terminated", 1)], [rec("a", "waiting")], "Pending"),
        ("Never", [rec("i", "terminated", 0)], [rec("a", "running")], "Running"),
    ],
)
def test_pod_phase_follows_kubelet(policy, init, main, phase):
    assert pod_phase(policy, init, main) == phase


def test_conditions_keep_transition_time_until_status_changes():
    running = [ContainerRecord("a", state="running", ready=True, started_at="t0")]
    first = pod_conditions("Running", True, [], running, [], "T1")
    assert {c["type"]: c["status"] for c in first} == {
        "PodReadyToStartContainers": "True", "Initialized": "True", "ContainersReady": "True", "Ready": "True"}
    again = pod_conditions("Running", True, [], running, first, "T2")
    assert all(c["lastTransitionTime"] == "T1" for c in again)
    unready = [ContainerRecord("a", state="running", ready=False), ContainerRecord("b", state="waiting")]
    changed = {c["type"]: c for c in pod_conditions("Pending", True, [], unready, first, "T3")}
    assert changed["Ready"]["status"] == "False" and changed["Ready"]["lastTransitionTime"] == "T3"
    assert changed["Ready"]["message"] == "containers with unready status: [a b]"
    assert changed["Initialized"]["lastTransitionTime"] == "T1"
    done = {c["type"]: c for c in pod_conditions("Succeeded", False, [], [rec("a", "terminated", 0)], [], "T4")}
    assert done["Ready"]["reason"] == "PodCompleted"


def test_pod_status_document():
    a = ContainerRecord("main", image="img", state="terminated", reason="Error", exit_code=3, restart_count=2,
                        started_at="S", finished_at="F", message="boom", container_id="rljob://x",
                        last_terminated={"exitCode": 1, "reason": "Error"})
    st = pod_status({"spec": {"restartPolicy": "Never"}}, init=[], main=[a], pod_ip="10.244.1.4",
                    host_ip="10.244.0.1", start_time="S0", sandbox_ready=True, now="N")
    assert st["phase"] == "Failed"
    assert st["podIPs"] == [{"ip": "10.244.1.4"}] and st["hostIP"] == "10.244.0.1" and st["startTime"] == "S0"
    assert st["containerStatuses"] == [{
        "name": "main", "image": "img", "imageID": "", "ready": False, "started": False, "restartCount": 2,
        "containerID": "rljob://x",
        "state": {"terminated": {"exitCode": 3, "reason": "Error", "startedAt": "S", "finishedAt": "F",
                                 "message": "boom", "containerID": "rljob://x"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
    }]
    assert "initContainerStatuses" not in st


# ---------------------------------------------------------------------------- networking arithmetic
def test_ip_allocation():
    assert str(bridge_address("10.244.0.0/16")) == "10.244.0.1/16"
    assert node_pod_cidrs("10.244.0.0/16", 2) == ["10.244.1.0/24", "10.244.2.0/24"]
    with pytest.raises(ValueError, match="fewer than 4"):
        node_pod_cidrs("10.244.0.0/23", 3)
    alloc = IPAllocator("10.244.1.0/30")  # hosts .1 .2; .1 is reserved
    assert alloc.allocate("a") == "10.244.1.2"
    assert alloc.allocate("a") == "10.244.1.2"
    with pytest.raises(NetworkError, match="no free pod IP"):
        alloc.allocate("b")
    alloc.release("a")
    assert alloc.allocate("b") == "10.244.1.2"
    alloc.release("b")
    two = IPAllocator("10.244.3.0/29")
    assert two.allocate("x", prefer="10.244.3.5") == "10.244.3.5"  # e.g. the address in the pod's status
    assert two.allocate("y", prefer="10.244.3.5") == "10.244.3.2"  # taken: lowest free instead
    assert two.allocate("z", prefer="10.9.9.9") == "10.244.3.3"  # outside the range: ignored
    big = IPAllocator("10.244.2.0/24")
    got = [big.allocate(str(i)) for i in range(253)]
    assert got[0] == "10.244.2.2" and got[-1] == "10.244.2.254" and len(set(got)) == 253


# ---------------------------------------------------------------------------- probes
def test_probe_tracker_thresholds():
    t = ProbeTracker({"initialDelaySeconds": 5, "periodSeconds": 2, "failureThreshold": 2, "successThreshold": 2},
                     started=100.0, initial=False)
    assert not t.due(104.9) and t.due(105.0)
    t.record(True, now=105.0)
    assert not t.ok  # one success of two
    assert not t.due(106.9) and t.due(107.0)
    t.record(True, now=107.0)
    assert t.ok
    t.record(False, now=109.0)
    assert t.ok  # one failure of two
    t.record(False, now=111.0)
    assert not t.ok
    live = ProbeTracker({}, started=0.0, initial=True)
    assert live.ok and live.due(0.0)


def test_tcp_and_http_probes_against_real_servers():
    container = {"name": "c", "ports": [{"name": "web", "containerPort": 0}]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    container["ports"][0]["containerPort"] = port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert resolve_port("web", container) == port
        assert run_probe({"tcpSocket": {"port": "web"}}, container=container, pod_ip="127.0.0.1", pid1=None, env={})[0]
        assert run_probe({"httpGet": {"port": port, "path": "/ok"}}, container=container, pod_ip="127.0.0.1",
                         pid1=None, env={}) == (True, "HTTP probe failed with statuscode: 200")
        ok, msg = run_probe({"httpGet": {"port": port, "path": "/bad"}}, container=container, pod_ip="127.0.0.1",
                            pid1=None, env={})
        assert not ok and "503" in msg
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    ok, msg = run_probe({"tcpSocket": {"port": closed}}, container=container, pod_ip="127.0.0.1", pid1=None, env={})
    assert not ok and "refused" in msg.lower()
    ok, msg = run_probe({"grpc": {"port": 1}}, container=container, pod_ip="127.0.0.1", pid1=None, env={})
    assert not ok and "unsupported probe handler ['grpc']" in msg
    with pytest.raises(ValueError, match="not a named port"):
        resolve_port("nope", container)


# ---------------------------------------------------------------------------- mount points
def test_mount_points_created_and_removed(tmp_path):
    record = tmp_path / "mp.json"
    mp = MountPoints(record)
    target = tmp_path / "host" / "etc" / "rljob"
    mp.ensure(str(target), is_dir=True)
    mp.ensure(str(tmp_path / "host" / "dev" / "termination-log"), is_dir=False)
    assert target.is_dir() and (tmp_path / "host" / "dev" / "termination-log").is_file()
    with pytest.raises(MountPointError, match="not a file"):
        mp.ensure(str(target), is_dir=False)
    with pytest.raises(MountPointError, match="not allowed"):
        mp.ensure("/proc/foo", is_dir=True)
    (target / "keep").write_text("user data")
    # a later agent (after a crash) cleans up from the record alone
    left = MountPoints(record).cleanup()
    assert left == [str(target), str(tmp_path / "host" / "etc"), str(tmp_path / "host")]
    assert not (tmp_path / "host" / "dev").exists()
    assert (target / "keep").read_text() == "user data"  # never removes what is not empty
    assert not record.exists()


def test_logs_helper(tmp_path):
    p = log_path(tmp_path, "ns", "pod", "main")
    p.parent.mkdir(parents=True)
    p.write_text("hello\n")
    assert logs("ns", "pod", state_dir=tmp_path) == "hello\n"
    log_path(tmp_path, "ns", "pod", "side").write_text("x")
    log_path(tmp_path, "ns", "pod-b", "main").write_text("other pod")
    with pytest.raises(ValueError, match=r"several containers \['main', 'side'\]"):
        logs("ns", "pod", state_dir=tmp_path)
    assert logs("ns", "pod", "side", state_dir=tmp_path) == "x"
    with pytest.raises(FileNotFoundError, match="no logs for pod ns/ghost"):
        logs("ns", "ghost", state_dir=Path(tmp_path))


def test_a_new_pod_of_the_same_name_starts_its_log_afresh(tmp_path):
    first = claim_log(tmp_path, "ns", "job-trainer-0", "trainer", "aaaaaaaa-1111")
    assert first == log_path(tmp_path, "ns", "job-trainer-0", "trainer") and not first.exists()
    first.write_text("attempt 0 run 0\n")
    # a restart of the container in the same pod, or the pod taken over by a restarted agent: appended
    assert claim_log(tmp_path, "ns", "job-trainer-0", "trainer", "aaaaaaaa-1111") == first
    with first.open("a") as f:
        f.write("attempt 0 run 1\n")
    second = claim_log(tmp_path, "ns", "job-trainer-0", "trainer", "bbbbbbbb-2222")
    assert second == first and not second.exists()
    previous = tmp_path / "logs" / PREVIOUS_DIR / "ns_job-trainer-0_trainer.aaaaaaaa.log"
    assert previous.read_text() == "attempt 0 run 0\nattempt 0 run 1\n"
    second.write_text("attempt 1\n")
    assert logs("ns", "job-trainer-0", state_dir=tmp_path) == "attempt 1\n"
    assert logs("ns", "job-trainer-0", "trainer", state_dir=tmp_path) == "attempt 1\n"
    # a file without a recorded owner (left by an older agent) is kept as well, named by its mtime
    other = log_path(tmp_path, "ns", "old", "main")
    other.write_text("old agent\n")
    os.utime(other, (1_700_000_000, 1_700_000_000))
    claim_log(tmp_path, "ns", "old", "main", "cccccccc")
    assert (tmp_path / "logs" / PREVIOUS_DIR / "ns_old_main.unknown-1700000000.log").read_text() == "old agent\n"
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == ["ns_job-trainer-0_trainer.log"]


def test_pod_mac_is_a_function_of_the_pod_ip():
    assert pod_mac("10.244.1.2") == "0a:58:0a:f4:01:02"
    assert pod_mac("10.244.255.254") == "0a:58:0a:f4:ff:fe"
    assert int(pod_mac("10.0.0.1")[:2], 16) & 0b11 == 0b10  # locally administered, unicast
    with pytest.raises(ValueError):
        pod_mac("fd00::1")


def test_status_patch_deletes_the_fields_a_condition_no_longer_has():
    unready = [rec("redis", "running")]
    ready = [ContainerRecord("redis", state="running", ready=True)]
    before = pod_status({"spec": {}}, init=[], main=unready, pod_ip="10.244.1.2", host_ip="10.244.0.1",
                        start_time="t0", sandbox_ready=True, now="t1")
    assert {c["type"]: c.get("message") for c in before["conditions"]}["Ready"] == "containers with unready status: [redis]"
    after = pod_status({"spec": {}, "status": before}, init=[], main=ready, pod_ip="10.244.1.2",
                       host_ip="10.244.0.1", start_time="t0", sandbox_ready=True, now="t2")
    patch = status_patch(after)["status"]
    conds = {c["type"]: c for c in patch["conditions"]}
    assert conds["Ready"] == {"type": "Ready", "status": "True", "lastProbeTime": None, "lastTransitionTime": "t2",
                              "reason": None, "message": None}
    assert conds["Initialized"]["reason"] is None and conds["Initialized"]["message"] is None
    assert patch["podIPs"] == [{"$patch": "replace"}, {"ip": "10.244.1.2"}]
    assert patch["hostIPs"] == [{"$patch": "replace"}, {"ip": "10.244.0.1"}]
    unready_patch = {c["type"]: c for c in status_patch(before)["status"]["conditions"]}
    assert unready_patch["Ready"]["reason"] == "ContainersNotReady"
    assert unready_patch["Ready"]["message"] == "containers with unready status: [redis]"
