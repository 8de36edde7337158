"""Processes known by pid (``rljob_localcluster.pids``, the CLI's ``agent.pid``) with real child processes: a
zombie and a process whose command line lacks the expected parts are not "ours"; terminate() escalates to
SIGKILL and leaves a foreign process alone.

Run: ``python -m pytest tests/localcluster/test_pids.py -q`` (no root, no cluster).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rljob_localcluster import agent_daemon
from rljob_localcluster.pids import cmdline, pid_running, terminate
from waiting import wait_until

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
    proc = _child("import time; print('ready', flush=True); time.sleep(60)", tag)
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
    polite = _child("import time; print('ready', flush=True); time.sleep(60)", tag)
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


def test_stop_agent_stops_only_the_agent_its_pid_file_names(tmp_path):
    """``agent_daemon.stop_agent`` reads ``agent.pid``: a process whose command line does not name the agent
    module and this dir's state dir (a recycled pid) is left alone; the real one is stopped and the file removed."""
    sleeper = "import time; print('ready', flush=True); time.sleep(60)"
    stranger = _child(sleeper, "not-the-agent")
    agent = _child(sleeper, f"{agent_daemon.AGENT_MODULE} --state-dir {agent_daemon.state_dir(tmp_path)}")
    try:
        (tmp_path / "agent.pid").write_text(str(stranger.pid))
        assert agent_daemon.agent_pid(tmp_path) is None
        assert agent_daemon.stop_agent(tmp_path) is False and stranger.poll() is None
        (tmp_path / "agent.pid").write_text(str(agent.pid))
        assert agent_daemon.agent_pid(tmp_path) == agent.pid
        assert agent_daemon.stop_agent(tmp_path, timeout=10) is True
        assert agent.wait(5) == -signal.SIGTERM and not (tmp_path / "agent.pid").exists()
    finally:
        for proc in (stranger, agent):
            proc.kill()
            proc.wait()
