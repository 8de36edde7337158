"""The agent's container sandbox on the real kernel, without a cluster: the shim (network, mount,
UTS and PID namespaces, bind mounts, init that forwards signals) and pod networking (bridge,
per-pod network namespace, veth). Needs root and iproute2; uses its own bridge and a 10.251/16
subnet, and removes both.

Run: ``python -m pytest tests/localcluster/test_agent_sandbox.py -q``.
"""

from __future__ import annotations

import ast
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from procutil import pids_with_env_marker
from rljob_localcluster.agent.network import Bridge, PodSandboxNet, pod_mac
from rljob_localcluster.agent.process import ContainerProcess, LaunchSpec
from rljob_localcluster.agent.agent import default_image_paths
from rljob_localcluster.agent.volumes import Mount, image_mounts
from waiting import wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (namespaces, bridges)"
)

IMAGE_ENV = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def bridge():
    br = Bridge(f"rljt{uuid.uuid4().hex[:6]}", ipaddress.ip_interface("10.251.0.1/16"))
    br.ensure()
    try:
        yield br
    finally:
        br.delete()


def launch(tmp_path: Path, code: str, **kw) -> tuple[ContainerProcess, Path]:
    """Run ``code`` with this Python in a sandbox; like the agent, the "image" (this Python installation, which
    may live under a volume's mount point such as /tmp) is bound back over the given mounts."""
    log = tmp_path / "c.log"
    mounts = list(kw.pop("mounts", []))
    mounts += image_mounts(default_image_paths(), mounts)
    spec = LaunchSpec(argv=[sys.executable, "-c", code], env=dict(IMAGE_ENV, **kw.pop("env", {})), mounts=mounts, **kw)
    return ContainerProcess(spec, tmp_path / "run", log), log


def test_pod_network_namespace_with_real_mount_path(tmp_path, bridge):
    """A server in a pod namespace on 0.0.0.0 is reached at the pod IP from the host; the pod sees
    its volume at a real absolute path, its own hostname and PID 1; the host sees none of it."""
    net = PodSandboxNet.for_pod(f"test-{uuid.uuid4()}", "10.251.1.2")
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "config.json").write_text('{"k": 1}')
    target = f"/tmp/rljob-agent-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(target)
    code = (
        "import os, socket\n"
        "cfg = open(os.environ['TARGET'] + '/config.json').read()\n"
        "s = socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen()\n"
        "c, peer = s.accept()\n"
        "c.sendall(f'{cfg}|{socket.gethostname()}|{os.getpid()}'.encode()); c.close()\n"
        "print('served', peer[0])\n"
    )
    try:
        net.create(bridge)
        proc, log = launch(tmp_path, code, env={"TARGET": target}, hostname="pod-a", netns=net.netns_path,
                           mounts=[Mount(str(vol), target, read_only=True)])

        def connect():
            try:
                with socket.create_connection(("10.251.1.2", 8080), timeout=1) as c:
                    return c.recv(1024).decode()
            except OSError:
                return None

        reply = wait_until(connect, 15, "the pod's server")
        assert reply == '{"k": 1}|pod-a|2'  # PID 2: the shim's init is PID 1
        assert wait_until(lambda: proc.poll() is not None, 10, "exit") and proc.poll() == 0
        assert log.read_text() == "served 10.251.0.1\n"  # the host came in through the bridge
        assert os.listdir(target) == []  # the bind mount never reached the host
        assert socket.gethostname() != "pod-a"
    finally:
        net.delete()
        os.rmdir(target)
    assert subprocess.run(["ip", "netns", "pids", net.netns], capture_output=True, check=False).returncode != 0


def test_exit_codes_and_start_errors(tmp_path):
    proc, _ = launch(tmp_path / "a", "import sys; sys.exit(3)")
    wait_until(lambda: proc.poll() is not None, 10, "exit")
    assert proc.poll() == 3 and proc.start_error() is None

    spec = LaunchSpec(argv=["no-such-binary-rljob"], env=IMAGE_ENV)
    proc = ContainerProcess(spec, tmp_path / "b" / "run", tmp_path / "b.log")
    wait_until(lambda: proc.poll() is not None, 10, "exit")
    assert proc.poll() == 128
    assert proc.start_error() == 'exec: "no-such-binary-rljob": executable file not found in $PATH'

    spec = LaunchSpec(argv=["true"], env=IMAGE_ENV, cwd="/no/such/dir")
    proc = ContainerProcess(spec, tmp_path / "c" / "run", tmp_path / "c.log")
    wait_until(lambda: proc.poll() is not None, 10, "exit")
    assert proc.poll() == 128
    assert proc.start_error() == 'chdir to working dir "/no/such/dir": no such file or directory'




def test_sigterm_reaches_main_process_and_the_tree_dies_with_it(tmp_path):
    marker = f"RLJOB_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    code = (
        "import signal, subprocess, sys, time\n"
        "kids = [subprocess.Popen(['sleep', '1000']) for _ in range(2)]\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(1000)\n"
    )
    proc, log = launch(tmp_path, code, env={key: value})
    wait_until(lambda: "ready" in log.read_text(), 15, "the container to start")
    assert len(pids_with_env_marker(marker)) == 3  # main + 2 children (the shim's env has no marker)
    proc.signal(signal.SIGTERM)
    wait_until(lambda: proc.poll() is not None, 10, "exit")
    assert proc.poll() == 7
    assert "got SIGTERM" in log.read_text()
    wait_until(lambda: not pids_with_env_marker(marker), 5, "the orphaned children to be killed")


def test_kill_ends_a_process_that_ignores_sigterm(tmp_path):
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(1000)\n"
    proc, log = launch(tmp_path, code)
    wait_until(lambda: "ready" in log.read_text(), 15, "the container to start")
    proc.signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None
    proc.kill()
    assert proc.poll() == 137  # 128 + SIGKILL


def test_volume_over_a_parent_of_the_state_dir_hides_no_later_source(tmp_path):
    """An emptyDir mounted at /tmp (the operator chart does this) while the agent's files live under /tmp:
    the later mounts' sources and the shim's own files (pid1, start errors) are still reached."""
    assert str(tmp_path).startswith("/tmp/")
    empty, vol = tmp_path / "empty", tmp_path / "vol"
    empty.mkdir()
    vol.mkdir()
    (vol / "config.json").write_text("cfg")
    target = f"/var/tmp/rljob-agent-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(target)
    try:
        (empty / "marker").write_text("")
        code = "import os; print('marker' in os.listdir('/tmp'), open(os.environ['TARGET'] + '/config.json').read())"
        proc, log = launch(tmp_path, code, env={"TARGET": target},
                           mounts=[Mount(str(empty), "/tmp"), Mount(str(vol), target, read_only=True)])
        wait_until(lambda: proc.poll() is not None, 15, "exit")
        assert proc.poll() == 0, log.read_text()
        assert log.read_text() == "True cfg\n"
        assert proc.start_error() is None

        spec = LaunchSpec(argv=["no-such-binary-rljob"], env=IMAGE_ENV, mounts=[Mount(str(empty), "/tmp")])
        failing = ContainerProcess(spec, tmp_path / "b" / "run", tmp_path / "b.log")
        wait_until(lambda: failing.poll() is not None, 10, "exit")
        assert failing.poll() == 128
        assert failing.start_error() == 'exec: "no-such-binary-rljob": executable file not found in $PATH'
    finally:
        os.rmdir(target)


def test_image_under_a_volume_mount_point_stays_visible(tmp_path):
    """A checkout under /tmp and an emptyDir at /tmp (the operator chart): the agent binds the image's
    paths back, read-only, so the container still imports the project's code from the checkout."""
    assert str(tmp_path).startswith("/tmp/")
    empty, image = tmp_path / "empty", tmp_path / "image"
    empty.mkdir()
    (image / "pkg").mkdir(parents=True)
    (image / "pkg" / "rljob_image_probe.py").write_text("VALUE = 42\n")
    mounts = [Mount(str(empty), "/tmp")]
    mounts += image_mounts([str(image)], mounts)
    code = ("import os, sys; sys.path.insert(0, os.environ['IMAGE'] + '/pkg'); import rljob_image_probe as m; "
            "print(m.VALUE, os.access(os.environ['IMAGE'], os.W_OK), sorted(os.listdir('/tmp')))")
    proc, log = launch(tmp_path, code, env={"IMAGE": str(image)}, mounts=mounts)
    wait_until(lambda: proc.poll() is not None, 15, "exit")
    assert proc.poll() == 0, log.read_text()
    value, writable, listing = log.read_text().split(" ", 2)
    top = str(tmp_path).split("/")[2]
    assert (value, writable) == ("42", "False")
    assert top in ast.literal_eval(listing)
    assert top in os.listdir(empty)  # the bind target was made inside the emptyDir, not on the host


def test_host_hosts_file_rewrite_keeps_the_containers_hosts_mount(tmp_path):
    """The agent's managed block in the host's hosts file is rewritten in place: replacing that file by
    rename would detach every container's bind mount of its own hosts file at the same path."""
    from rljob_localcluster.agent.dns import DnsRecord
    from rljob_localcluster.agent.hosts import HostsManager

    host_hosts, pod_hosts = tmp_path / "host-hosts", tmp_path / "pod-hosts"
    host_hosts.write_text("127.0.0.1 localhost\n")
    pod_hosts.write_text("10.251.1.9 pod-a\n")
    code = (
        "import os, time\n"
        "path = os.environ['TARGET']\n"
        "print('ready', flush=True)\n"
        "while not os.path.exists(os.environ['GO']): time.sleep(0.05)\n"
        "print(open(path).read(), end='', flush=True)\n"
    )
    go = tmp_path / "go"
    proc, log = launch(tmp_path, code, env={"TARGET": str(host_hosts), "GO": str(go)},
                       mounts=[Mount(str(pod_hosts), str(host_hosts))])
    wait_until(lambda: "ready" in log.read_text(), 15, "the container to start")
    HostsManager("cluster.local", host_hosts, "test").set_records([DnsRecord("ns", "svc", "10.251.1.7")])
    assert "10.251.1.7" in host_hosts.read_text()
    go.touch()
    wait_until(lambda: proc.poll() is not None, 10, "exit")
    assert log.read_text() == "ready\n10.251.1.9 pod-a\n"  # still the pod's own file


def test_bridge_keeps_its_mac_when_pod_veths_come_and_go(bridge):
    """Pods cache the gateway's MAC: a bridge that took the lowest port MAC (Linux's default) would change it
    whenever a pod with a lower veth MAC starts or stops, leaving running pods sending into a black hole."""
    def mac() -> str:
        return Path(f"/sys/class/net/{bridge.name}/address").read_text().strip()

    assert mac() == bridge.mac
    net = PodSandboxNet.for_pod(f"test-{uuid.uuid4()}", "10.251.1.3")
    try:
        net.create(bridge)
        subprocess.run(["ip", "link", "set", "dev", net.veth, "address", "00:00:5e:00:00:01"], check=True)
        assert mac() == bridge.mac
    finally:
        net.delete()
    assert mac() == bridge.mac


def _serve_once_in(net: PodSandboxNet, port: int) -> subprocess.Popen:
    """A TCP server on ``port`` inside the pod's network namespace; returns once it listens."""
    code = ("import socket, sys\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('0.0.0.0', {port})); s.listen(); print('listening', flush=True)\n"
            "c, _ = s.accept(); c.sendall(b'hi'); c.close()\n")
    proc = subprocess.Popen(["ip", "netns", "exec", net.netns, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "listening\n"
    return proc


def test_a_new_pod_on_a_reused_ip_is_reachable_at_once(bridge):
    """The host caches the first pod's MAC for its IP (REACHABLE for 15-45 s); the next pod on that IP must
    answer at once, as a new Redis pod's readiness probe (1 s timeout) expects."""
    ip, port = "10.251.1.7", 7001
    for attempt in range(2):
        net = PodSandboxNet.for_pod(f"test-{uuid.uuid4()}", ip)
        net.create(bridge)
        try:
            mac = subprocess.run(["ip", "-n", net.netns, "-o", "link", "show", "eth0"], capture_output=True,
                                 text=True, check=True).stdout
            assert f"link/ether {pod_mac(ip)} " in mac
            server = _serve_once_in(net, port)
            try:
                with socket.create_connection((ip, port), timeout=1.0) as conn:
                    assert conn.recv(2) == b"hi"
            finally:
                server.kill()
                server.wait()
        finally:
            net.delete()
        neigh = subprocess.run(["ip", "neigh", "show", ip, "dev", bridge.name], capture_output=True, text=True).stdout
        assert pod_mac(ip) in neigh  # the host keeps the entry the next pod needs
