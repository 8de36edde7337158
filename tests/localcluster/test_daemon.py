"""The daemon's watch over a running local cluster (``rljob_localcluster.__main__._watch``): a node process that
exits (a kubelet, a containerd) is recorded in state.json and the rest keeps running; a control-plane component
that exits ends the watch. The processes are real (``sh`` exiting with a code); the ControlPlane and LocalNodes
are stand-ins that report them, so no cluster is started.

Run: ``python -m pytest tests/localcluster/test_daemon.py -q``.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from rljob_localcluster import __main__ as cli
from rljob_localcluster import statefile
from waiting import wait_until


class _Exited:
    """Reports the exit codes of real processes by name, as ControlPlane.dead_components / LocalNodes.dead do."""

    def __init__(self, log_dir: Path, procs: dict[str, subprocess.Popen]) -> None:
        self.log_dir = log_dir
        self.procs = procs
        for name in procs:
            (log_dir / f"{name}.log").write_text(f"{name} log line\n")

    def dead(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    dead_components = dead


def test_a_node_process_that_exits_is_recorded_and_the_cluster_keeps_running(tmp_path, capsys):
    alive = subprocess.Popen(["sleep", "60"])
    crashed = subprocess.Popen(["sh", "-c", "exit 3"])
    try:
        nodes = _Exited(tmp_path, {"containerd-rljob-node-0": alive, "kubelet-rljob-node-1": crashed})
        cp = _Exited(tmp_path, {"etcd": alive})
        st = {"phase": "ready", "pids": {"etcd": alive.pid}}
        statefile.write(tmp_path / "state.json", st)
        stop = threading.Event()
        rc: list[int] = []
        watch = threading.Thread(target=lambda: rc.append(cli._watch(tmp_path, st, cp, nodes, stop)))
        watch.start()
        wait_until(lambda: (statefile.read(tmp_path / "state.json") or {}).get("exited"), timeout=15,
                   what="state.json records the exited kubelet")
        assert statefile.read(tmp_path / "state.json")["exited"] == {"kubelet-rljob-node-1": 3}
        assert watch.is_alive()  # still watching: the cluster keeps running
        stop.set()
        watch.join(10)
        assert rc == [0]
        out = capsys.readouterr().out
        assert out.count("node process(es) exited: {'kubelet-rljob-node-1': 3}") == 1  # reported once
        assert "kubelet-rljob-node-1 log line" in out
    finally:
        alive.kill()
        alive.wait()


def test_a_control_plane_component_that_exits_ends_the_watch(tmp_path, capsys):
    etcd = subprocess.Popen(["sh", "-c", "exit 1"])
    etcd.wait()
    cp = _Exited(tmp_path, {"etcd": etcd})
    assert cli._watch(tmp_path, {"phase": "ready"}, cp, None, threading.Event()) == 1
    out = capsys.readouterr().out
    assert "control-plane component(s) exited: {'etcd': 1}; stopping" in out and "etcd log line" in out
