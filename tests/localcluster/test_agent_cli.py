"""The agent as users and the e2e suite run it: ``python -m rljob_localcluster.agent`` as its own
process. SIGTERM removes everything it made on the host; after a SIGKILL its containers die with it
and the next agent on the same state dir removes the leftovers and restarts the pods.

Run: ``python -m pytest tests/localcluster/test_agent_cli.py -q`` (root; RLJOB_SKIP_CLUSTER=1 skips).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from procutil import pids_with_env_marker
from rljob_localcluster.agent.network import PodSandboxNet
from waiting import wait_until

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("RLJOB_SKIP_CLUSTER") == "1", reason="RLJOB_SKIP_CLUSTER=1"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the node agent needs root (network namespaces, mounts)"),
]

REPO = Path(__file__).resolve().parents[2]
LABEL = "rljob.dev/agent-cli-test"


class AgentProcess:
    """``python -m rljob_localcluster.agent`` with one node, stopped by pid (also on failure)."""

    def __init__(self, cp, state_dir: Path, tag: str) -> None:
        self.bridge = f"rljc{tag[:6]}"
        self.node = f"cli-{tag}-0"
        env = dict(os.environ, PYTHONPATH=f"{REPO / 'localcluster'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "rljob_localcluster.agent", "--kubeconfig", cp.kubeconfig,
               "--state-dir", str(state_dir), "--nodes", "1", "--node-prefix", f"cli-{tag}-",
               "--node-label", f"{LABEL}={tag}", "--cluster-cidr", "10.244.64.0/18", "--bridge", self.bridge,
               "--shutdown-grace", "2", "--backoff-base", "1", "--gpus-per-node", "0"]
        self.log = state_dir.parent / f"agent-{uuid.uuid4().hex[:6]}.log"
        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        wait_until(lambda: "agent ready" in self.log.read_text() or self.proc.poll() is not None, 60, "the agent")
        assert self.proc.poll() is None, self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.log_file.close()


def _pod(name: str, tag: str, marker: str) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Always", "nodeSelector": {LABEL: tag}, "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "any", "env": [{"name": "MARKER", "value": marker}],
                        "command": ["sh", "-c", "sleep 1000 & echo started; wait"],
                        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}]}})


def _host_state(bridge: str) -> dict:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    return {"bridge": f" {bridge}:" in links,
            "netns": set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set(),
            "tmpfs": [line for line in Path("/proc/mounts").read_text().splitlines() if "agent-state" in line]}


def _pod_json(cp, ns: str, name: str) -> dict:
    return json.loads(cp.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)


def _agent_with_pod(cp, ns: str, state: Path, tag: str, marker: str) -> tuple[AgentProcess, str]:
    """Start an agent on ``state`` and run pod ``p`` on its node until both its processes (sh + sleep, with
    ``marker`` in their environment) run; returns the agent and the pod's uid. On a failure the agent is stopped
    (SIGTERM: it removes what it made on the host)."""
    agent = AgentProcess(cp, state, tag)
    try:
        cp.kubectl("apply", "-n", ns, "-f", "-", input=_pod("p", tag, marker))
        wait_until(lambda: len(pids_with_env_marker(marker)) == 2, 60, "sh and sleep running")
        return agent, _pod_json(cp, ns, "p")["metadata"]["uid"]
    except BaseException:
        agent.stop()
        raise


def test_sigterm_cleans_up_everything(control_plane, pod_namespace, tmp_path):
    tag, marker = uuid.uuid4().hex[:8], uuid.uuid4().hex
    state = tmp_path / "agent-state"
    agent, uid = _agent_with_pod(control_plane, pod_namespace, state, tag, marker)
    try:
        netns = PodSandboxNet.for_pod(uid, "").netns
        during = _host_state(agent.bridge)
        assert during["bridge"] and netns in during["netns"] and len(during["tmpfs"]) == 1
        assert f"rljob-local-node-agent {state.resolve()}" in Path("/etc/hosts").read_text()
        out = subprocess.run([sys.executable, "-m", "rljob_localcluster.agent", "logs", "--state-dir", str(state),
                              pod_namespace, "p"], capture_output=True, text=True, check=False,
                             env=dict(os.environ, PYTHONPATH=str(REPO / "localcluster")))
        assert out.stdout == "started\n", out.stderr
    finally:
        rc = agent.stop(signal.SIGTERM)
    assert rc == 0, agent.log.read_text()
    assert not pids_with_env_marker(marker)
    after = _host_state(agent.bridge)
    assert not after["bridge"] and netns not in after["netns"] and after["tmpfs"] == []
    assert f"rljob-local-node-agent {state.resolve()}" not in Path("/etc/hosts").read_text()
    assert not (state / "agent.json").exists() and list((state / "pods").iterdir()) == []
    assert control_plane.kubectl("get", "node", agent.node, check=False).returncode != 0  # deregistered


def test_after_sigkill_containers_die_and_the_next_agent_cleans_up(control_plane, pod_namespace, tmp_path):
    tag, marker = uuid.uuid4().hex[:8], uuid.uuid4().hex
    state = tmp_path / "agent-state"
    first, uid = _agent_with_pod(control_plane, pod_namespace, state, tag, marker)
    first.stop(signal.SIGKILL)
    # parent-death signals
    wait_until(lambda: not pids_with_env_marker(marker), 10, "the containers to die with the agent")
    netns = PodSandboxNet.for_pod(uid, "").netns
    stale = _host_state(first.bridge)
    assert stale["bridge"] and netns in stale["netns"]  # a hard kill leaves the host state behind...

    second = AgentProcess(control_plane, state, tag)  # ...which the next agent removes, then runs the pod again
    try:
        def restarted():
            st = (_pod_json(control_plane, pod_namespace, "p")["status"].get("containerStatuses") or [{}])[0]
            return st.get("restartCount") == 1 and "running" in st.get("state", {}) and st

        st = wait_until(restarted, 60, "the pod to run again")
        assert st["lastState"]["terminated"]["reason"] == "ContainerStatusUnknown"
        wait_until(lambda: len(pids_with_env_marker(marker)) == 2, 30, "sh and sleep running again")
        assert len(_host_state(second.bridge)["tmpfs"]) == 1  # the old tmpfs was unmounted, one new
    finally:
        rc = second.stop(signal.SIGTERM)
    assert rc == 0, second.log.read_text()
    after = _host_state(second.bridge)
    assert not after["bridge"] and netns not in after["netns"] and after["tmpfs"] == []
    assert not pids_with_env_marker(marker)
