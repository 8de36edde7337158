"""The node agent as a background process of the CLI's local cluster (``python -m rljob_localcluster demo``).

The agent runs as ``python -m rljob_localcluster.agent`` in its own session, its state in ``<dir>/agent``
(pods' files, container logs in ``logs/``, PV data), its output in ``<dir>/agent.log`` and its pid in
``<dir>/agent.pid``. ``python -m rljob_localcluster down`` stops it (SIGTERM: pods get their grace period and
everything it made on the host is removed) before the control plane, then deletes its state dir
(:func:`remove_state`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .agent.shim import mount_points_under
from .pids import pid_running, terminate

AGENT_MODULE = "rljob_localcluster.agent"


def state_dir(d: Path) -> Path:
    """The agent's ``--state-dir`` inside the cluster dir ``d``."""
    return d / "agent"


def agent_pid(d: Path) -> int | None:
    """The pid of the agent started for cluster dir ``d``, or None (the pid is checked to be that agent)."""
    try:
        pid = int((d / "agent.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_running(pid, AGENT_MODULE, str(state_dir(d))) else None


def start_agent(d: Path, kubeconfig: str, *, nodes: int = 2, gpus_per_node: int = 4, timeout: float = 90.0) -> int:
    """Start the agent in the background (or return the running one's pid) once its nodes are registered.

    Every "image" gets ``OMP_NUM_THREADS=1``, as the CPU trainer image sets it.

    Raises:
        RuntimeError: the agent exited or did not report ready within ``timeout`` seconds (its log is in
            the message).
    """
    running = agent_pid(d)
    if running:
        return running
    log_path = d / "agent.log"
    cmd = [sys.executable, "-m", AGENT_MODULE, "--kubeconfig", kubeconfig, "--state-dir", str(state_dir(d)),
           "--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node), "--image-env", "OMP_NUM_THREADS=1"]
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "ab") as log:
        start = log.tell()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=str(d))
    (d / "agent.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_bytes()[start:].decode(errors="replace")
        if "agent ready" in text:
            return proc.pid
        if proc.poll() is not None:
            raise RuntimeError(f"the node agent exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.3)
    stop_agent(d)
    raise RuntimeError(f"the node agent did not report ready within {timeout:.0f} s; see {log_path}")


def stop_agent(d: Path, timeout: float = 60.0) -> bool:
    """SIGTERM the agent of cluster dir ``d`` (SIGKILL after ``timeout`` s); False when none was running."""
    pid = agent_pid(d)
    if pid is None:
        (d / "agent.pid").unlink(missing_ok=True)
        return False
    terminate(pid, timeout, AGENT_MODULE, str(state_dir(d)))
    (d / "agent.pid").unlink(missing_ok=True)
    return True


def remove_state(d: Path) -> Path | None:
    """Delete the agent's state dir of cluster dir ``d`` (container logs, pod dirs, PV data) once no agent
    runs, after removing what an agent that died hard left on the host (:meth:`.agent.Agent.clean_leftovers`).
    Returns the removed dir, or None when there was none.

    Raises:
        RuntimeError: the agent still runs, or something is still mounted below the dir (nothing is deleted).
    """
    from .agent import Agent, AgentConfig, AgentError

    sd = state_dir(d)
    if not sd.exists():
        return None
    if agent_pid(d) is not None:
        raise RuntimeError(f"the node agent (pid {agent_pid(d)}) still runs; {sd} not removed")

    def foreign_mounts() -> list[str]:
        """Mounts below the dir but the pods' tmpfs volumes (clean_leftovers unmounts those)."""
        recorded = set()
        for record in (sd / "pods").glob("*/sandbox.json"):
            try:
                recorded.update(json.loads(record.read_text()).get("tmpfs") or [])
            except (OSError, ValueError):
                pass
        return [p for p in mount_points_under([str(sd.resolve())]) if p not in recorded]

    if mounts := foreign_mounts():
        raise RuntimeError(f"still mounted below {sd}: {', '.join(mounts)}; not removed")
    try:
        Agent(AgentConfig(kubeconfig="", state_dir=sd)).clean_leftovers()
    except AgentError as err:
        raise RuntimeError(f"{err}; {sd} not removed") from err
    if mounts := mount_points_under([str(sd.resolve())]):
        raise RuntimeError(f"still mounted below {sd}: {', '.join(mounts)}; not removed")
    shutil.rmtree(sd)
    return sd
