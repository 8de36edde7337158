"""Processes known by pid (``rljob_localcluster.pids``; the CLI's ``daemon.pid`` and ``state.json``, the nodes'
``nodes/state.json``) with real child processes: a zombie and a process whose command line lacks the expected
parts are not "ours"; terminate() escalates to SIGKILL and leaves a foreign process alone; ``down`` and the nodes'
cleanup signal only the processes their files name whose command lines still name what was started.

Run: ``python -m pytest tests/localcluster/test_pids.py -q`` (no root, no cluster).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rljob_localcluster import clusterdir
from rljob_localcluster.pids import cmdline, pid_running, terminate, terminate_all
from waiting import wait_until

SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
                  "time.sleep(60)"


def _child(code: str, tag: str) -> subprocess.Popen:
    """A Python child whose command line carries ``tag``; it prints ``ready`` once its signal handlers are set."""
    proc = subprocess.Popen([sys.executable, "-c", code, tag], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def _state(pid: int) -> str:
    """The process state letter from /proc/<pid>/stat (R, S, Z, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_running_checks_liveness_zombies_and_the_command_line():
    tag = f"pids-test-{uuid.uuid4().hex}"
    proc = _child(SLEEPER, tag)
    try:
        assert tag in cmdline(proc.pid)
        assert pid_running(proc.pid) and pid_running(proc.pid, tag, "-c")
        assert not pid_running(proc.pid, tag, "some-other-dir")  # a recycled pid: another command line
        proc.kill()  # not reaped until wait(): a zombie, which kill(pid, 0) still finds
        wait_until(lambda: _state(proc.pid) == "Z", 10, "the killed child to be a zombie")
        assert not pid_running(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not pid_running(proc.pid) and cmdline(proc.pid) == ""


def test_terminate_escalates_to_sigkill_after_the_timeout():
    tag = f"pids-test-{uuid.uuid4().hex}"
    proc = _child(IGNORES_SIGTERM, tag)
    try:
        started = time.monotonic()
        terminate(proc.pid, 1.0, tag)
        took = time.monotonic() - started
        assert proc.wait(5) == -signal.SIGKILL
        assert 1.0 <= took < 5, took
    finally:
        proc.kill()
        proc.wait()


def test_terminate_stops_at_sigterm_and_leaves_a_foreign_process_alone():
    tag = f"pids-test-{uuid.uuid4().hex}"
    polite = _child(SLEEPER, tag)
    foreign = _child(IGNORES_SIGTERM, tag)
    try:
        terminate(foreign.pid, 1.0, tag, "not-in-its-command-line")
        assert foreign.poll() is None  # not signalled at all
        terminate(polite.pid, 10, tag)
        assert polite.wait(5) == -signal.SIGTERM
    finally:
        for proc in (polite, foreign):
            proc.kill()
            proc.wait()


def test_down_signals_only_the_processes_its_files_name(tmp_path, capsys):
    """``down`` reads ``daemon.pid`` and the control-plane pids of ``state.json``: a pid whose command line does
    not name this cluster's dir (a recycled pid) is left alone; the daemon and the components that are still
    ours are stopped, and the files removed."""
    d = tmp_path / "cluster"
    d.mkdir()
    stranger = _child(SLEEPER, "not-this-cluster")
    daemon = _child(SLEEPER, f"-m rljob_localcluster _serve --dir {d}")
    etcd = _child(SLEEPER, f"etcd --data-dir {d / 'data' / 'etcd'}")
    try:
        (d / "daemon.pid").write_text(str(stranger.pid))
        (d / "state.json").write_text(json.dumps({"pids": {"etcd": stranger.pid}}))
        assert clusterdir.daemon_pid(d) is None
        assert clusterdir.down(d) == 0 and stranger.poll() is None
        assert "control plane was not running" in capsys.readouterr().err
        assert not (d / "daemon.pid").exists() and not (d / "state.json").exists()
        (d / "daemon.pid").write_text(str(daemon.pid))
        (d / "state.json").write_text(json.dumps({"pids": {"etcd": etcd.pid, "kube-apiserver": stranger.pid}}))
        assert clusterdir.daemon_pid(d) == daemon.pid
        assert clusterdir.down(d) == 0
        assert daemon.wait(5) == -signal.SIGTERM and etcd.wait(5) == -signal.SIGTERM
        assert stranger.poll() is None and not (d / "daemon.pid").exists()
    finally:
        for proc in (stranger, daemon, etcd):
            proc.kill()
            proc.wait()


def test_the_node_cleanup_ends_only_recorded_pids_that_still_carry_their_marks():
    """``pids.terminate_all`` (clean_host with the pids of ``nodes/state.json``): only the processes whose
    command line still has their recorded marks are signalled, and only they are reported as ended."""
    tag = f"pids-test-{uuid.uuid4().hex}"
    recycled = _child(SLEEPER, "some-other-process")
    kubelet = _child(SLEEPER, f"kubelet --config /nodes/{tag}/kubelet.yaml")
    stubborn = _child(IGNORES_SIGTERM, f"containerd --config /nodes/{tag}/containerd.toml")
    try:
        ended = terminate_all([(recycled.pid, [f"/nodes/{tag}/kubelet.yaml"]),
                               (kubelet.pid, [f"/nodes/{tag}/kubelet.yaml"]),
                               (stubborn.pid, [f"/nodes/{tag}/containerd.toml"])], timeout=1.0)
        assert sorted(ended) == sorted([kubelet.pid, stubborn.pid])
        assert kubelet.wait(5) == -signal.SIGTERM and stubborn.wait(5) == -signal.SIGKILL
        assert recycled.poll() is None
    finally:
        for proc in (recycled, kubelet, stubborn):
            proc.kill()
            proc.wait()
