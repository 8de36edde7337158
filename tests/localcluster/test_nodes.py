"""Real local nodes (rljob_localcluster.nodes): two kubelets with containerd, runc and CNI on this host, kube-proxy,
CoreDNS, the default StorageClass's provisioner and fake GPUs; and that stopping them (cleanly or after a crash)
leaves nothing on the host.

Needs root, containerd, runc, the CNI plugins and busybox-static (scripts/setup.sh installs them). Missing ones
FAIL these tests with the reason; RLJOB_SKIP_CLUSTER=1 skips them. The images are a busybox image made here from
/bin/busybox (and the pause image when localcluster/build-images.sh has not made one), so the tests do not wait
for the image builds. One set of nodes serves the module (~1 min to start cold, seconds with the containerd
roots cached); the last test stops it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from rljob_localcluster import images
from rljob_localcluster.images import PAUSE_IMAGE, Image
from rljob_localcluster.node import cleanup, host
from rljob_localcluster.node.configs import CNI_BIN_DIR
from rljob_localcluster.nodes import CNI_PLUGINS, REQUIRED_HOST_BINARIES, LocalNodes, clean_host, host_leftovers
from rljob_localcluster.pids import pid_running
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BUSYBOX = "docker.io/rljob-test/busybox:1"
GPUS = 4
NODES = ["rljob-node-0", "rljob-node-1"]


# ---------------------------------------------------------------------------------------------------- images
def _blob(tf: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    ti = tarfile.TarInfo(f"blobs/sha256/{digest}")
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))
    return f"sha256:{digest}", len(data)


def busybox_image(path: Path, name: str, entrypoint: list[str] | None = None, busybox: str = "/bin/busybox") -> Path:
    """An OCI image archive named ``name``: a static busybox with every applet linked in /bin."""
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as lt:
        for d in ("bin", "tmp", "etc", "data"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            lt.addfile(ti)
        data = Path(busybox).read_bytes()
        ti = tarfile.TarInfo("bin/busybox")
        ti.size, ti.mode = len(data), 0o755
        lt.addfile(ti, io.BytesIO(data))
        for a in applets:
            if a != "busybox":
                ti = tarfile.TarInfo(f"bin/{a}")
                ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
                lt.addfile(ti)
        for fn, text in (("etc/passwd", "root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"),
                         ("etc/group", "root:x:0:\nnobody:x:65534:\n")):
            b = text.encode()
            ti = tarfile.TarInfo(fn)
            ti.size, ti.mode = len(b), 0o644
            lt.addfile(ti, io.BytesIO(b))
    tag = name.rpartition(":")[2]
    with tarfile.open(path, "w") as tf:
        ldig, lsize = _blob(tf, layer.getvalue())
        cfg = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [ldig]},
               "config": {"Env": ["PATH=/bin"], "Entrypoint": entrypoint, "Cmd": None if entrypoint else ["sh"]}}
        cdig, csize = _blob(tf, json.dumps(cfg).encode())
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdig, "size": csize},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ldig, "size": lsize}]}
        mdig, msize = _blob(tf, json.dumps(manifest).encode())
        index = {"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdig, "size": msize,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}}]}
        for fn, obj in (("oci-layout", {"imageLayoutVersion": "1.0.0"}), ("index.json", index)):
            b = json.dumps(obj).encode()
            ti = tarfile.TarInfo(fn)
            ti.size = len(b)
            tf.addfile(ti, io.BytesIO(b))
    return path


def _image(name: str, archive: Path) -> Image:
    return Image(key=name, name=name, archive=archive, hash=hashlib.sha256(archive.read_bytes()).hexdigest(),
                 bytes=archive.stat().st_size, unpacked_bytes=0)


def index_pause() -> list[Image]:
    """build-images.sh's pause image, when it has made one."""
    try:
        return [i for i in images.load_index() if i.name == PAUSE_IMAGE]
    except FileNotFoundError:
        return []


def make_test_images(tmp: Path) -> list[Image]:
    """The busybox test image, and a busybox "pause" unless build-images.sh made the real one."""
    out = [_image(BUSYBOX, busybox_image(tmp / "busybox.tar", BUSYBOX))]
    if not index_pause():
        pause = busybox_image(tmp / "pause.tar", PAUSE_IMAGE,
                              ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"])
        out.append(_image(PAUSE_IMAGE, pause))
    return out


# ---------------------------------------------------------------------------------------------------- fixtures
def _requirements() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    missing += [b for b in REQUIRED_HOST_BINARIES if not shutil.which(b)]
    missing += [f"{CNI_BIN_DIR}/{p}" for p in CNI_PLUGINS if not os.access(f"{CNI_BIN_DIR}/{p}", os.X_OK)]
    if not os.access("/bin/busybox", os.X_OK):
        missing.append("/bin/busybox (busybox-static)")
    return missing


@pytest.fixture(scope="module")
def nodes(control_plane, tmp_path_factory):
    if os.environ.get("RLJOB_SKIP_CLUSTER") == "1":
        pytest.skip("RLJOB_SKIP_CLUSTER=1: the local nodes are not tested")
    if missing := _requirements():
        pytest.fail(f"the local nodes need {', '.join(missing)} (scripts/setup.sh installs them; "
                    "RLJOB_SKIP_CLUSTER=1 skips these tests)")
    tmp = tmp_path_factory.mktemp("nodes")
    ln = LocalNodes(control_plane, tmp / "state", nodes=2, gpus_per_node=GPUS, extra_images=make_test_images(tmp),
                    images=index_pause())
    ln.start()
    try:
        yield ln
    finally:
        ln.stop()


@pytest.fixture
def ns(control_plane, nodes):
    name = f"n-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    wait_until(lambda: control_plane.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
               30, "the default ServiceAccount")
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


# ---------------------------------------------------------------------------------------------------- helpers
def kget(cp, *args) -> dict:
    return json.loads(cp.kubectl("get", *args, "-o", "json").stdout)


def pod(name: str, node: str | None, command: str, **extra) -> dict:
    container = {"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never", "command": ["sh", "-c", command]}
    container.update(extra.pop("container", {}))
    labels = extra.pop("labels", {})
    spec = {"containers": [container], "terminationGracePeriodSeconds": 1, **extra}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def create(cp, ns: str, *objs: dict) -> None:
    r = cp.kubectl("apply", "-n", ns, "-f", "-", check=False,
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))
    assert r.returncode == 0, r.stderr


def describe(cp, ns: str) -> str:
    return cp.kubectl("get", "pods,events", "-n", ns, "-o", "wide", check=False).stdout


def wait_phase(cp, ns: str, name: str, phases=("Running",), timeout: float = 60) -> dict:
    def check():
        p = kget(cp, "pod", name, "-n", ns)
        return p if p["status"].get("phase") in phases else None
    return wait_until(check, timeout, f"pod {name} in {phases}", lambda: describe(cp, ns), interval=0.5)


def exec_(cp, ns: str, name: str, *cmd: str) -> str:
    return cp.kubectl("exec", "-n", ns, name, "--", *cmd, timeout=60).stdout


# ---------------------------------------------------------------------------------------------------- pure parts
def test_configs_give_each_node_its_own_everything(tmp_path):
    from rljob_localcluster.node import configs

    lays = [configs.NodeLayout(i, f"rljob-node-{i}", tmp_path / f"n{i}", tmp_path / f"c{i}", "192.0.2.2", 10250 + i, 20 + i)
            for i in range(2)]
    kc = [configs.kubelet_config(lay, ca_file="ca", tls_cert="c", tls_key="k") for lay in lays]
    for field in ("port", "healthzPort", "cgroupRoot", "containerRuntimeEndpoint", "podLogsDir"):
        assert kc[0][field] != kc[1][field], field
    assert kc[0]["cgroupRoot"] == "/rljob-node-0" and kc[0]["failCgroupV1"] is False
    assert kc[0]["authentication"]["anonymous"]["enabled"] is False and kc[0]["authorization"]["mode"] == "Webhook"
    assert kc[0]["imageGCHighThresholdPercent"] == 100
    cni = [configs.cni_conflist(lay) for lay in lays]
    assert [c["plugins"][0]["bridge"] for c in cni] == ["rljob-cni0", "rljob-cni1"]
    assert [c["plugins"][0]["ipam"]["ranges"][0][0]["subnet"] for c in cni] == ["10.244.0.0/24", "10.244.1.0/24"]
    ctd = configs.containerd_config(lays[1])
    assert "restrict_oom_score_adj = true" in ctd and f'root = "{tmp_path / "c1"}"' in ctd
    assert 'sandbox_image = "registry.k8s.io/pause:3.10.1"' in ctd and 'stream_server_port = "0"' in ctd


def test_gpu_patch_and_provisioned_volume():
    from rljob_localcluster.node.controller import gpu_patch, pv_for_claim

    assert gpu_patch({"status": {"capacity": {"nvidia.com/gpu": "4"}, "allocatable": {"nvidia.com/gpu": "4"}}}, 4) == []
    ops = gpu_patch({"status": {"capacity": {"cpu": "2"}}}, 4)
    assert {"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "4"} in ops
    assert {"op": "add", "path": "/status/allocatable", "value": {}} in ops
    pv = pv_for_claim({"metadata": {"name": "data", "namespace": "ns", "uid": "u1"},
                       "spec": {"resources": {"requests": {"storage": "1Mi"}}}}, Path("/pv"))
    assert pv["spec"]["hostPath"]["path"] == "/pv/pvc-u1" and "nodeAffinity" not in pv["spec"]
    assert pv["spec"]["claimRef"]["uid"] == "u1" and pv["spec"]["storageClassName"] == "rljob-local"


# ---------------------------------------------------------------------------------------------------- tests
def test_two_nodes_ready_with_gpus_and_pod_cidrs(control_plane, nodes):
    for i, name in enumerate(NODES):
        n = kget(control_plane, "node", name)
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"]
        assert ready == "True", n["status"]["conditions"]
        assert n["status"]["capacity"]["nvidia.com/gpu"] == str(GPUS)
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS)
        assert n["spec"]["podCIDR"] == f"10.244.{i}.0/24"
        assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
        assert n["status"]["nodeInfo"]["kubeletVersion"] == "v1.34.4"
        assert {"type": "InternalIP", "address": nodes.host_ip} in n["status"]["addresses"]


def test_pods_services_and_dns_across_nodes(control_plane, nodes, ns):
    cp = control_plane
    serve = "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www"
    web = [pod(f"web-{i}", node, serve, labels={"app": "web"}, hostname=f"web-{i}", subdomain="peers")
           for i, node in enumerate(NODES)]
    client = pod("client", NODES[1], "exec sleep 3600")
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers"},
                "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}}
    create(cp, ns, *web, client, svc, headless)
    ips = {}
    for name in ("web-0", "web-1", "client"):
        p = wait_phase(cp, ns, name)
        ips[name] = p["status"]["podIP"]
    assert ips["web-0"].startswith("10.244.0.") and ips["web-1"].startswith("10.244.1.")
    assert kget(cp, "pod", "web-0", "-n", ns)["spec"]["nodeName"] == NODES[0]

    def http_get(ip: str, port: int) -> str:
        """The body's last line, or "" (busybox's wget crashes in Debian's static build: nc it is)."""
        r = cp.kubectl("exec", "-n", ns, "client", "--", "sh", "-c",
                       f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {ip} {port}", check=False)
        lines = r.stdout.strip().splitlines()
        return lines[-1].strip() if r.returncode == 0 and lines and lines[0].startswith("HTTP/1") else ""

    # pod -> pod across nodes (client on node 1, web-0 on node 0), no NAT in between
    assert wait_until(lambda: http_get(ips["web-0"], 8080), 30, "web-0 over the pod network") == "web-0"
    # ClusterIP through kube-proxy: both backends answer
    cluster_ip = kget(cp, "svc", "web", "-n", ns)["spec"]["clusterIP"]
    seen: set[str] = set()

    def both():
        if body := http_get(cluster_ip, 80):
            seen.add(body)
        return seen == {"web-0", "web-1"}
    wait_until(both, 60, f"both endpoints behind ClusterIP {cluster_ip}", lambda: str(seen), interval=0.2)

    # cluster DNS from a pod: a Service name, and the headless Service's per-pod names (torchrun's rendezvous
    # <job>-trainer-0.<job>-trainer.<ns>.svc: glibc's resolver completes it with the search list below; busybox's
    # nslookup does not use the search list, so the names are asked in full here)
    resolv = exec_(cp, ns, "client", "cat", "/etc/resolv.conf")
    assert "nameserver 10.96.0.10" in resolv and f"search {ns}.svc.cluster.local svc.cluster.local" in resolv, resolv
    for qname, want in ((f"web.{ns}.svc.cluster.local", cluster_ip), (f"web-0.peers.{ns}.svc.cluster.local", ips["web-0"]),
                        (f"web-1.peers.{ns}.svc.cluster.local", ips["web-1"]),
                        ("kubernetes.default.svc.cluster.local", "10.96.0.1")):
        out = wait_until(lambda q=qname: (lambda r: r.stdout if r.returncode == 0 else "")(
            cp.kubectl("exec", "-n", ns, "client", "--", "nslookup", q, check=False)), 30, f"{qname} resolving in a pod")
        if want:
            assert want in out, out
    # the API server through the kubernetes Service (its endpoint is the host address), from a pod
    api = exec_(cp, ns, "client", "sh", "-c",
                "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT")
    assert "Client sent an HTTP request to an HTTPS server" in api, api


def test_logs_exec_restarts_termination_message_probe(control_plane, nodes, ns):
    cp = control_plane
    crasher = pod("crasher", NODES[0],
                  "echo started $(cat /proc/sys/kernel/random/uuid); echo bye-message > /dev/termination-log; sleep 1; exit 3")
    live = pod("live", NODES[1], "touch /tmp/ok; echo alive; sleep 3; rm /tmp/ok; exec sleep 600",
               container={"livenessProbe": {"exec": {"command": ["cat", "/tmp/ok"]}, "periodSeconds": 1,
                                            "failureThreshold": 1}})
    sleeper = pod("sleeper", NODES[1], "echo ready; exec sleep 600")
    create(cp, ns, crasher, live, sleeper)
    wait_phase(cp, ns, "sleeper")
    # exec through the API server -> kubelet (its serving cert, webhook authn/authz) -> containerd
    assert exec_(cp, ns, "sleeper", "hostname").strip() == "sleeper"
    assert exec_(cp, ns, "sleeper", "sh", "-c", "echo $((6*7))").strip() == "42"
    assert cp.kubectl("logs", "-n", ns, "sleeper").stdout.strip() == "ready"

    def restarted(name):
        def check():
            st = (kget(cp, "pod", name, "-n", ns)["status"].get("containerStatuses") or [{}])[0]
            return st if st.get("restartCount", 0) >= 1 and st.get("lastState", {}).get("terminated") else None
        return wait_until(check, 90, f"{name} restarted", lambda: describe(cp, ns), interval=0.5)

    st = restarted("crasher")
    term = st["lastState"]["terminated"]
    assert term["exitCode"] == 3 and term["message"].strip() == "bye-message", term
    previous = cp.kubectl("logs", "-n", ns, "crasher", "--previous").stdout
    assert previous.startswith("started "), previous

    st = restarted("live")  # the liveness probe failed: kubelet killed and restarted it
    assert st["lastState"]["terminated"]["exitCode"] in (137, 143), st
    events = cp.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=live", "-o",
                        "jsonpath={.items[*].reason}").stdout
    assert "Unhealthy" in events and "Killing" in events, events
    assert cp.kubectl("logs", "-n", ns, "live", "--previous").stdout.strip() == "alive"


def test_default_storage_class_volume_shared_between_nodes(control_plane, nodes, ns):
    cp = control_plane
    sc = kget(cp, "storageclass", "rljob-local")
    assert sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
           "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}}}
    vol = {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}], "restartPolicy": "Never"}
    mount = {"volumeMounts": [{"name": "d", "mountPath": "/data"}], "securityContext": {"runAsUser": 65534}}
    create(cp, ns, pvc, pod("writer", NODES[0], "echo written-on-$(hostname) > /data/f", container=mount, **vol))
    wait_phase(cp, ns, "writer", ("Succeeded", "Failed"))
    assert kget(cp, "pod", "writer", "-n", ns)["status"]["phase"] == "Succeeded", describe(cp, ns)
    claim = kget(cp, "pvc", "data", "-n", ns)
    assert claim["status"]["phase"] == "Bound" and claim["spec"]["storageClassName"] == "rljob-local"
    create(cp, ns, pod("reader", NODES[1], "cat /data/f", container=mount, **vol))
    wait_phase(cp, ns, "reader", ("Succeeded", "Failed"))
    assert cp.kubectl("logs", "-n", ns, "reader").stdout.strip() == "written-on-writer"
    # deleting the claim deletes the volume and its directory
    pv = claim["spec"]["volumeName"]
    cp.kubectl("delete", "pod", "writer", "reader", "-n", ns, "--wait=true")
    cp.kubectl("delete", "pvc", "data", "-n", ns, "--wait=true")
    wait_until(lambda: cp.kubectl("get", "pv", pv, check=False).returncode != 0, 30, f"{pv} deleted")
    assert not (nodes.pv_root / pv).exists()


def test_a_stopped_kubelet_shows_in_seconds_and_its_pods_are_evicted(control_plane, nodes, ns):
    """A node fault shows in seconds (controlplane.NODE_TIMINGS): with rljob-node-1's kubelet stopped (SIGSTOP by
    its pid), the Node's Ready condition leaves True within 20 s and a pod bound to the node is deleted (the
    unreachable taint's eviction, after the pod's default 10 s toleration) within 40 s of the stop. SIGCONT
    brings the node back Ready, and its kubelet then removes the pod."""
    cp = control_plane
    node = NODES[1]
    create(cp, ns, pod("bound", node, "exec sleep 600"))
    wait_phase(cp, ns, "bound")
    kubelet = nodes.pids[f"kubelet-{node}"]

    def not_ready() -> str | None:
        conds = kget(cp, "node", node)["status"]["conditions"]
        return next((f"{c['status']} ({c.get('reason')})" for c in conds if c["type"] == "Ready" and c["status"] != "True"),
                    None)

    def deleted() -> bool:
        r = cp.kubectl("get", "pod", "bound", "-n", ns, "-o", "jsonpath={.metadata.deletionTimestamp}", check=False)
        return r.returncode != 0 or bool(r.stdout.strip())

    def status() -> str:
        return cp.kubectl("get", "node", node, "-o", "yaml", check=False).stdout[-3000:] + describe(cp, ns)

    os.kill(kubelet, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        ready = wait_until(not_ready, 20, f"{node}'s Ready condition leaving True", status, interval=0.5)
        t_ready = time.monotonic() - t0
        wait_until(deleted, 40 - t_ready, "the pod on the stopped node deleted", status, interval=0.5)
        print(f"kubelet of {node} stopped: Ready {ready} after {t_ready:.1f}s, pod deleted after "
              f"{time.monotonic() - t0:.1f}s")
    finally:
        os.kill(kubelet, signal.SIGCONT)
    wait_until(lambda: nodes._node_ready(node), 60, f"{node} Ready again", status, interval=0.5)
    wait_until(lambda: cp.kubectl("get", "pod", "bound", "-n", ns, check=False).returncode != 0, 60,
               "the evicted pod removed by its kubelet", lambda: describe(cp, ns), interval=0.5)


def _host_state_is_clean(state_dir: Path, st: dict) -> None:
    """Nothing of the nodes on the host: what ``host_leftovers`` looks for (chains there before start, as
    ``st``, the nodes' state.json, recorded them, do not count), no host path that was not there before, and
    the sysctls as ``st`` recorded them."""
    left = host_leftovers(NODES, state_dir, chains_before=st["chains_before"])
    left += [f"path {p}" for p in cleanup.HOST_PATHS if os.path.lexists(p) and p not in st["host_paths_before"]]
    assert not left, left
    assert host.read_sysctls(st["sysctls"]) == st["sysctls"]


def test_crash_then_clean_host_and_stop_leave_nothing(control_plane, nodes, ns, tmp_path_factory):
    """Last: SIGKILL every process of the module's nodes while a pod runs, then clean_host (what 'down' runs after
    a crash); then a fresh single node, stopped cleanly. Neither leaves a bridge, chain, mount, cgroup, process,
    shim socket, host path that was not there before, or a changed sysctl."""
    cp = control_plane
    st = json.loads((nodes.state_dir / "state.json").read_text())
    create(cp, ns, pod("victim", NODES[0], "exec sleep 600"))
    wait_phase(cp, ns, "victim")
    pids = [v["pid"] for v in st["pids"].values()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for p in nodes._processes.procs.values():  # reap them (this process is their parent)
        p.wait(10)
    nodes._processes.procs.clear()
    nodes._started = False
    assert host.cgroup_dirs("rljob-node-0")[0].exists()  # the pod's processes outlive the kubelet
    shim_sockets = cleanup._shim_sockets(nodes.state_dir, NODES)  # those of the killed shims
    report = clean_host(nodes.state_dir, control_plane=cp, locked=True)
    nodes._lock.release()
    assert not [str(s) for s in shim_sockets if s.exists()], report
    assert not [line for line in report if line.startswith(("WARNING", "kept "))], report
    assert any("cgroup" in line for line in report), report
    _host_state_is_clean(nodes.state_dir, st)
    assert not any(pid_running(p) for p in pids)

    # a clean start/stop of one node: pods deleted through the API first, everything undone
    tmp_path = tmp_path_factory.mktemp("one")
    one = LocalNodes(cp, tmp_path / "one", nodes=1, gpus_per_node=1, images=[],
                     extra_images=make_test_images(tmp_path))
    one.start()
    try:
        create(cp, ns, pod("short", NODES[0], "exec sleep 600"))
        wait_phase(cp, ns, "short")
    finally:
        report = one.stop()
    assert any("pods through the API" in line for line in report), report
    assert not [line for line in report if line.startswith(("WARNING", "kept "))], report
    _host_state_is_clean(tmp_path / "one", st)
    assert (tmp_path / "one" / "logs" / "kubelet-rljob-node-0.log").exists()
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["logs"]
    assert cp.kubectl("get", "node", NODES[0], check=False).returncode != 0
