"""The local node agent against the real control plane (kube-apiserver, scheduler, controller
manager): pods run as processes in their own network namespaces, with env, volumes, DNS, status,
restarts, probes, deletion, persistent volumes, GPU capacity and node loss.

This module's agent uses its own node names, node label, bridge and a /17 of the cluster CIDR, and
every pod here selects that label, so it can share the session's control plane with other agents.

Run: ``python -m pytest tests/localcluster/test_agent_cluster.py -q`` (root; builds the Go tools
on first use; RLJOB_SKIP_CLUSTER=1 skips).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from procutil import pids_with_env_marker
from rljob_localcluster.agent import Agent, AgentConfig, logs
from rljob_localcluster.agent.network import PodSandboxNet
from waiting import wait_until

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("RLJOB_SKIP_CLUSTER") == "1", reason="RLJOB_SKIP_CLUSTER=1"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the node agent needs root (network namespaces, mounts)"),
]

NODE_LABEL = "rljob.dev/agent-test"
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def agent(control_plane, tmp_path_factory):
    tag = uuid.uuid4().hex[:8]
    cfg = AgentConfig(
        kubeconfig=control_plane.kubeconfig, state_dir=tmp_path_factory.mktemp("agent-state"), nodes=2,
        gpus_per_node=GPUS_PER_NODE, node_prefix=f"agent-test-{tag}-", node_labels={NODE_LABEL: tag},
        cluster_cidr="10.244.128.0/17", bridge=f"rljt{tag[:6]}", backoff_base=1.0, backoff_max=4.0,
        heartbeat_seconds=1.0, shutdown_grace=2.0,
    )
    with Agent(cfg) as a:
        a.tag = tag
        yield a
    assert subprocess.run(["ip", "link", "show", cfg.bridge], capture_output=True, check=False).returncode != 0  # bridge removed
    assert f"rljob-local-node-agent {Path(cfg.state_dir).resolve()}" not in Path("/etc/hosts").read_text()


class Cluster:
    """kubectl helpers bound to one namespace and the test agent."""

    def __init__(self, cp, agent: Agent, ns: str) -> None:
        self.cp, self.agent, self.ns = cp, agent, ns

    def apply(self, *objs: dict) -> None:
        self.cp.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))

    def get(self, kind: str, name: str) -> dict | None:
        p = self.cp.kubectl("get", kind, name, "-n", self.ns, "-o", "json", check=False)
        if p.returncode != 0:
            assert "NotFound" in p.stderr, p.stderr
            return None
        return json.loads(p.stdout)

    def pod(self, name: str, command: list[str] | None, *, policy: str = "Never", **spec) -> dict:
        container = {"name": "main", "image": "ghcr.io/example/rljob-trainer:latest"}
        if command is not None:
            container["command"] = command
        container.update(spec.pop("container", {}))
        meta = {"name": name, "labels": spec.pop("labels", {})}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"restartPolicy": policy, "nodeSelector": {NODE_LABEL: self.agent.tag},
                         "terminationGracePeriodSeconds": 5, "containers": [container], **spec}}

    def wait_phase(self, name: str, phases: tuple[str, ...], timeout: float = 60) -> dict:
        return wait_until(lambda: (p := self.get("pod", name)) and p.get("status", {}).get("phase") in phases and p,
                          timeout, f"pod {name} in {phases}")

    def logs(self, pod: str) -> str:
        return logs(self.ns, pod, "main", state_dir=self.agent.state_dir)


@pytest.fixture
def k(control_plane, agent, pod_namespace):
    return Cluster(control_plane, agent, pod_namespace)


def py(code: str) -> list[str]:
    return ["python", "-c", code]


def terminated(pod: dict) -> dict:
    return pod["status"]["containerStatuses"][0]["state"]["terminated"]


# ---------------------------------------------------------------------------------------------------
ENV_SCRIPT = r"""
import json, os, socket, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
req = urllib.request.Request(
    "https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews" % (os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]),
    data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(),
    headers={"Authorization": "Bearer " + open(sa + "/token").read(), "Content-Type": "application/json"})
user = json.load(urllib.request.urlopen(req, context=ctx, timeout=20))["status"]["userInfo"]["username"]
shm = [l.split() for l in open("/proc/self/mountinfo") if l.split()[4] == "/dev/shm"][-1]
from multiprocessing import shared_memory
block = shared_memory.SharedMemory(create=True, size=1024); block.buf[0] = 7; block.close(); block.unlink()
print(json.dumps({
    "env": {k: os.environ[k] for k in ("POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE_NAME", "GREETING", "REDIS_PASSWORD", "HOSTNAME")},
    "config": json.load(open("/etc/rljob/config.json")),
    "namespace_file": open(sa + "/namespace").read(),
    "hostname": socket.gethostname(),
    "user": user,
    "shm_fstype": shm[shm.index("-") + 1],
    "cwd": os.getcwd(),
}))
"""


def test_pod_env_volumes_and_in_cluster_api(k):
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}
    pod = k.pod("env-pod", py(ENV_SCRIPT), container={
        "workingDir": "/etc/rljob",
        "env": [{"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                {"name": "POD_IP", **field("status.podIP")}, {"name": "NODE_NAME", **field("spec.nodeName")},
                {"name": "GREETING", "value": "hello $(POD_NAME)"},
                {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}}],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/rljob"}, {"name": "shm", "mountPath": "/dev/shm"}]},
        volumes=[{"name": "config", "configMap": {"name": "job-config"}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}])
    k.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job-config"}, "data": {"config.json": '{"steps": 3}'}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"password": "s3cret"}},
            pod)
    done = k.wait_phase("env-pod", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded", k.logs("env-pod")
    assert terminated(done)["exitCode"] == 0 and terminated(done)["reason"] == "Completed"
    out = json.loads(k.logs("env-pod").strip().splitlines()[-1])
    ip = done["status"]["podIP"]
    assert ip.startswith("10.244.") and done["status"]["podIPs"] == [{"ip": ip}]
    assert done["status"]["hostIP"] == "10.244.128.1"
    assert out == {
        "env": {"POD_NAME": "env-pod", "POD_NAMESPACE": k.ns, "POD_IP": ip, "NODE_NAME": done["spec"]["nodeName"],
                "GREETING": "hello env-pod", "REDIS_PASSWORD": "s3cret", "HOSTNAME": "env-pod"},
        "config": {"steps": 3},
        "namespace_file": k.ns,
        "hostname": "env-pod",
        "user": f"system:serviceaccount:{k.ns}:default",  # TokenRequest token, reaching the real API server
        "shm_fstype": "tmpfs",
        "cwd": "/etc/rljob",
    }
    # kubectl logs goes API server -> the agent's kubelet log endpoint; -f ends as the container has ended
    assert k.cp.kubectl("logs", "env-pod", "-n", k.ns).stdout == k.logs("env-pod")
    assert k.cp.kubectl("logs", "-f", "env-pod", "-n", k.ns, timeout=20).stdout == k.logs("env-pod")
    assert k.cp.kubectl("logs", "--tail=1", "env-pod", "-n", k.ns).stdout == k.logs("env-pod").splitlines(True)[-1]
    conditions = {c["type"]: c for c in done["status"]["conditions"]}
    assert conditions["PodScheduled"]["status"] == "True"
    assert conditions["Initialized"]["status"] == "True"
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["reason"] == "PodCompleted"


def test_kubectl_logs_follow_streams_until_the_container_ends(k):
    k.apply(k.pod("talker", py("import time\nfor i in range(5):\n    print('line', i, flush=True)\n    time.sleep(0.4)")))
    k.wait_phase("talker", ("Running",))
    started = time.monotonic()
    out = k.cp.kubectl("logs", "-f", "talker", "-n", k.ns, timeout=30).stdout
    assert out == "".join(f"line {i}\n" for i in range(5))
    assert time.monotonic() - started > 0.5  # it streamed while the container ran


def test_pods_of_a_headless_service_talk_tcp_by_dns_name(k):
    app = {"app": "peer"}
    server = k.pod("a", py(
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 8080)); s.listen()\n"
        "c, peer = s.accept(); data = c.recv(100)\n"
        "print('received', data.decode(), 'from', peer[0], flush=True)\n"
        "c.sendall(b'pong:' + data); c.close()\n"), labels=app, hostname="a", subdomain="peers")
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers"},
               "spec": {"clusterIP": "None", "selector": app, "ports": [{"name": "tcp", "port": 8080}]}}
    k.apply(service, server)
    running = k.wait_phase("a", ("Running",))
    a_ip = running["status"]["podIP"]
    fqdn = f"a.peers.{k.ns}.svc.cluster.local"

    def host_resolves():
        try:
            return socket.gethostbyname(fqdn) == a_ip
        except OSError:
            return False

    wait_until(host_resolves, 30, f"{fqdn} in the host's /etc/hosts")
    client = k.pod("b", py(
        "import socket, time\n"
        f"print('peers ->', socket.gethostbyname('peers'), 'a.peers ->', socket.gethostbyname('a.peers'))\n"
        f"c = socket.create_connection(('{fqdn}', 8080), timeout=10)\n"
        "c.sendall(b'ping'); print('reply', c.recv(100).decode(), 'mine', socket.gethostbyname(socket.gethostname()))\n"))
    k.apply(client)
    b = k.wait_phase("b", ("Succeeded", "Failed"))
    assert b["status"]["phase"] == "Succeeded", k.logs("b")
    b_ip = b["status"]["podIP"]
    assert b_ip != a_ip
    assert k.logs("b").splitlines() == [f"peers -> {a_ip} a.peers -> {a_ip}", f"reply pong:ping mine {b_ip}"]
    assert k.wait_phase("a", ("Succeeded",))
    assert k.logs("a") == f"received ping from {b_ip}\n"


def test_failures_report_exit_codes_and_reasons(k):
    k.apply(k.pod("exit3", py("import sys; print('bad input', file=sys.stderr); sys.exit(3)")),
            k.pod("nocmd", None),
            k.pod("notfound", ["no-such-binary-rljob"]))
    failed = {name: k.wait_phase(name, ("Failed", "Succeeded")) for name in ("exit3", "nocmd", "notfound")}
    assert {n: p["status"]["phase"] for n, p in failed.items()} == {"exit3": "Failed", "nocmd": "Failed", "notfound": "Failed"}
    t = terminated(failed["exit3"])
    assert (t["exitCode"], t["reason"]) == (3, "Error")
    assert k.logs("exit3") == "bad input\n"
    t = terminated(failed["nocmd"])
    assert (t["exitCode"], t["reason"]) == (128, "StartError")
    assert "sets no command" in t["message"] and "images" in t["message"]
    t = terminated(failed["notfound"])
    assert (t["exitCode"], t["reason"]) == (128, "StartError")
    assert t["message"] == 'exec: "no-such-binary-rljob": executable file not found in $PATH'




def test_deletion_kills_the_process_tree(k, control_plane):
    marker = uuid.uuid4().hex
    tree = ("import signal, subprocess, sys, time\n"
            "kids = [subprocess.Popen(['sleep', '1000']) for _ in range(2)]\n"
            "{handler}\nprint('ready', flush=True)\ntime.sleep(1000)\n")
    polite = tree.format(handler="signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(0)))")
    stubborn = tree.format(handler="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    env = {"env": [{"name": "TEST_MARKER", "value": marker}]}
    k.apply(k.pod("polite", py(polite), container=env), k.pod("stubborn", py(stubborn), container=env, terminationGracePeriodSeconds=2))
    uids = {}
    for name in ("polite", "stubborn"):
        uids[name] = k.wait_phase(name, ("Running",))["metadata"]["uid"]
        wait_until(lambda name=name: "ready" in k.logs(name), 30, f"{name} to start")
    assert len(pids_with_env_marker(marker)) == 6  # 2 × (main + 2 children)
    started = time.monotonic()
    control_plane.kubectl("delete", "pod", "polite", "stubborn", "-n", k.ns, "--wait=false")
    wait_until(lambda: k.get("pod", "polite") is None and k.get("pod", "stubborn") is None, 30, "both pods gone")
    took = time.monotonic() - started
    assert not pids_with_env_marker(marker)
    assert "got SIGTERM" in k.logs("polite")
    assert 2.0 <= took < 15, took  # the stubborn one was SIGKILLed after its 2 s grace period
    netns = {PodSandboxNet.for_pod(uid, "").netns for uid in uids.values()}
    assert not netns & set(os.listdir("/run/netns"))


def test_gpu_capacity_is_scheduled_by_the_real_scheduler(k):
    gpus = lambda n: {"resources": {"limits": {"nvidia.com/gpu": str(n)}}}
    k.apply(k.pod("fits", py("print('ok')"), container=gpus(GPUS_PER_NODE)),
            k.pod("too-many", py("print('never')"), container=gpus(GPUS_PER_NODE + 1)))
    assert k.wait_phase("fits", ("Succeeded",))

    def unschedulable():
        p = k.get("pod", "too-many")
        cond = {c["type"]: c for c in p["status"].get("conditions") or []}.get("PodScheduled")
        return cond and cond["status"] == "False" and cond.get("reason") == "Unschedulable" and cond

    cond = wait_until(unschedulable, 30, "PodScheduled=False/Unschedulable")
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    pending = k.get("pod", "too-many")
    assert pending["status"]["phase"] == "Pending" and "nodeName" not in pending["spec"]


def test_restart_policies(k):
    flaky = ("import os, sys\n"
             "first = not os.path.exists('/data/ran')\n"
             "open('/data/ran', 'a').close()\n"
             "print('run', 'first' if first else 'again', flush=True); sys.exit(1 if first else 0)\n")
    data = {"container": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
            "volumes": [{"name": "data", "emptyDir": {}}]}
    k.apply(k.pod("flaky", py(flaky), policy="OnFailure", **data),
            k.pod("looping", py("print('tick')"), policy="Always"))
    done = k.wait_phase("flaky", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded"
    status = done["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 1 and status["lastState"]["terminated"]["reason"] == "Error"
    assert k.logs("flaky") == "run first\nrun again\n"  # the emptyDir survived the restart

    def backing_off():
        p = k.get("pod", "looping")
        st = (p["status"].get("containerStatuses") or [{}])[0]
        waiting = st.get("state", {}).get("waiting", {})
        return st.get("restartCount", 0) >= 2 and waiting.get("reason") == "CrashLoopBackOff" and p

    looping = wait_until(backing_off, 30, "restarts with CrashLoopBackOff")
    assert looping["status"]["phase"] == "Running"  # restartPolicy Always never completes
    assert k.logs("looping").count("tick\n") >= 2


def test_readiness_probe_gates_ready(k):
    script = "import time, pathlib\ntime.sleep(3)\npathlib.Path('/srv/probe/ready').touch()\nprint('ready now', flush=True)\ntime.sleep(1000)\n"
    k.apply(k.pod("probed", py(script), policy="Always", container={
        "readinessProbe": {"exec": {"command": ["test", "-f", "/srv/probe/ready"]}, "periodSeconds": 1},
        "volumeMounts": [{"name": "work", "mountPath": "/srv/probe"}]}, volumes=[{"name": "work", "emptyDir": {}}]))

    def ready(pod):
        return {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}.get("Ready")

    running = k.wait_phase("probed", ("Running",))
    assert ready(running) == "False"
    assert running["status"]["containerStatuses"][0]["ready"] is False
    became = wait_until(lambda: (p := k.get("pod", "probed")) and ready(p) == "True" and p, 30, "Ready=True")
    assert "ready now" in k.logs("probed")
    assert became["status"]["containerStatuses"][0]["ready"] is True
    conditions = {c["type"]: c for c in became["status"]["conditions"]}
    for ctype in ("Ready", "ContainersReady"):  # no "containers with unready status" left from before
        assert "reason" not in conditions[ctype] and "message" not in conditions[ctype], conditions[ctype]


def test_a_new_pod_of_the_same_name_starts_its_log_afresh(k):
    def run(word: str) -> dict:
        k.apply(k.pod("reused", py(f"print({word!r}, flush=True)")))
        return k.wait_phase("reused", ("Succeeded",))

    first = run("first pod")
    k.cp.kubectl("delete", "pod", "reused", "-n", k.ns, "--wait=true", timeout=60)
    second = run("second pod")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    assert k.cp.kubectl("logs", "reused", "-n", k.ns).stdout == "second pod\n"
    assert k.logs("reused") == "second pod\n"
    previous = k.agent.state_dir / "logs" / "previous" / f"{k.ns}_reused_main.{first['metadata']['uid'][:8]}.log"
    assert previous.read_text() == "first pod\n"


def test_liveness_probe_restarts_the_container(k):
    k.apply(k.pod("unhealthy", py("import time\nprint('up', flush=True)\ntime.sleep(1000)"), policy="Always", container={
        "livenessProbe": {"exec": {"command": ["test", "-f", "/never"]}, "periodSeconds": 1, "failureThreshold": 2}},
        terminationGracePeriodSeconds=1))

    def restarted():
        st = (k.get("pod", "unhealthy")["status"].get("containerStatuses") or [{}])[0]
        return st.get("restartCount", 0) >= 1 and st.get("lastState", {}).get("terminated") and st

    st = wait_until(restarted, 30, "a restart after failed liveness probes")
    assert st["lastState"]["terminated"]["exitCode"] == 128 + 15  # SIGTERM ended it (Python's default action)
    events = json.loads(k.cp.kubectl("get", "events", "-n", k.ns, "-o", "json").stdout)["items"]
    assert any(e["reason"] == "Killing" and "failed liveness probe" in e["message"] for e in events)


def test_init_containers_and_host_network(k):
    shared = {"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}
    volumes = [{"name": "shared", "emptyDir": {}}]
    init = {"name": "prepare", "image": "any", "command": ["sh", "-c", "echo prepared > /shared/state"], **shared}
    bad_init = {"name": "prepare", "image": "any", "command": ["sh", "-c", "exit 4"]}
    k.apply(k.pod("with-init", ["cat", "/shared/state"], container=shared, volumes=volumes, initContainers=[init]),
            k.pod("bad-init", ["true"], initContainers=[bad_init]),
            k.pod("host-net", py("import socket; print(socket.gethostname())"), hostNetwork=True))
    ok = k.wait_phase("with-init", ("Succeeded", "Failed"))
    assert ok["status"]["phase"] == "Succeeded" and k.logs("with-init") == "prepared\n"
    assert ok["status"]["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    bad = k.wait_phase("bad-init", ("Succeeded", "Failed"))
    assert bad["status"]["phase"] == "Failed"
    assert bad["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 4
    assert "running" not in bad["status"]["containerStatuses"][0]["state"]  # main never started
    host = k.wait_phase("host-net", ("Succeeded", "Failed"))
    assert host["status"]["phase"] == "Succeeded"
    assert host["status"]["podIP"] == host["status"]["hostIP"] == "10.244.128.1"
    assert k.logs("host-net") == socket.gethostname() + "\n"  # the host's network and UTS namespaces


def test_persistent_volume_claim_survives_pods(k, control_plane):
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
    vol = {"container": {"volumeMounts": [{"name": "ckpt", "mountPath": "/var/lib/rljob/checkpoints"}]},
           "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}]}
    k.apply(claim, k.pod("writer", py("open('/var/lib/rljob/checkpoints/step', 'w').write('42')"), **vol))
    assert k.wait_phase("writer", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded", k.logs("writer")
    bound = k.get("pvc", "ckpt")
    assert bound["status"]["phase"] == "Bound" and bound["spec"]["storageClassName"] == "rljob-local"
    pv_name = bound["spec"]["volumeName"]
    k.apply(k.pod("reader", py("print(open('/var/lib/rljob/checkpoints/step').read())"), **vol))
    assert k.wait_phase("reader", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
    assert k.logs("reader") == "42\n"
    pv_dir = Path(k.agent.state_dir) / "pv" / pv_name
    assert (pv_dir / "step").read_text() == "42"
    control_plane.kubectl("delete", "pod", "writer", "reader", "-n", k.ns)
    control_plane.kubectl("delete", "pvc", "ckpt", "-n", k.ns)
    wait_until(lambda: control_plane.kubectl("get", "pv", pv_name, check=False).returncode != 0, 60,
               "the PV to be deleted")
    assert not pv_dir.exists()


def test_node_loss_and_return(k, control_plane):
    node = sorted(k.agent.nodes)[1]
    marker = uuid.uuid4().hex
    k.apply(k.pod("survivor", py("import time\nprint('up', flush=True)\ntime.sleep(1000)"), policy="Always",
                  container={"env": [{"name": "TEST_MARKER", "value": marker}]},
                  nodeSelector={NODE_LABEL: k.agent.tag, "kubernetes.io/hostname": node}))
    old_ip = k.wait_phase("survivor", ("Running",))["status"]["podIP"]
    wait_until(lambda: pids_with_env_marker(marker), 30, "the container process")
    lease = lambda: json.loads(control_plane.kubectl(
        "get", "lease", node, "-n", "kube-node-lease", "-o", "json").stdout)["spec"]["renewTime"]

    control = Path(k.agent.state_dir) / "control" / f"lose-{node}"
    control.touch()  # what `python -m rljob_localcluster.agent lose-node` does
    wait_until(lambda: k.agent.nodes[node].lost, 10, "the agent to lose the node")
    wait_until(lambda: not pids_with_env_marker(marker), 10, "the node's processes to die")
    frozen = lease()
    time.sleep(2.5)  # 2.5 heartbeat periods
    assert lease() == frozen
    assert k.get("pod", "survivor")["status"]["phase"] == "Running"  # nobody reports on a lost node

    allocator = k.agent.nodes[node].allocator
    assert allocator.allocate("another-pod", prefer=old_ip) == old_ip  # its address is taken meanwhile
    control.unlink()
    wait_until(lambda: not k.agent.nodes[node].lost, 10, "the node to come back")
    wait_until(lambda: lease() != frozen, 10, "lease renewals to resume")

    def restarted():
        st = (k.get("pod", "survivor")["status"].get("containerStatuses") or [{}])[0]
        return st.get("restartCount") == 1 and "running" in st.get("state", {}) and st

    st = wait_until(restarted, 30, "the container to restart after the node returned")
    assert st["lastState"]["terminated"]["reason"] == "ContainerStatusUnknown"
    assert st["lastState"]["terminated"]["exitCode"] == 137
    wait_until(lambda: pids_with_env_marker(marker), 30, "the restarted process")
    status = k.get("pod", "survivor")["status"]
    assert status["podIP"] != old_ip and status["podIPs"] == [{"ip": status["podIP"]}]
    allocator.release("another-pod")
