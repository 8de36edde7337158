"""``python -m rljob_localcluster down`` removes the node agent's state dir (container logs, pod dirs, PV data)
with the control plane's data, says what it removed, and leaves the state dir alone while an agent still uses it
or something is mounted below it. No cluster is started: the dirs are laid out as a session leaves them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rljob_localcluster import __main__ as cli
from rljob_localcluster import agent_daemon


def _session_leftovers(d: Path) -> Path:
    """A cluster dir as a stopped session leaves it; returns the agent's state dir."""
    sd = agent_daemon.state_dir(d)
    (sd / "logs" / "previous").mkdir(parents=True)
    (sd / "logs" / "default_job-trainer-0_trainer.log").write_text("step 1\n")
    (sd / "logs" / "previous" / "default_job-trainer-0_trainer.0123abcd.log").write_text("step 0\n")
    (sd / "pv" / "pvc-1").mkdir(parents=True)
    (sd / "pv" / "pvc-1" / "checkpoint.bin").write_bytes(b"\0" * 16)
    (sd / "pods").mkdir()
    (d / "data" / "logs").mkdir(parents=True)
    (d / "agent.log").write_text("agent ready\n")
    (d / "daemon.log").write_text("control plane up\n")
    return sd


def test_down_removes_the_agent_state_and_says_so(tmp_path, capsys):
    d = tmp_path / "cluster"
    sd = _session_leftovers(d)
    assert cli._down(d) == 0
    err = capsys.readouterr().err
    assert not sd.exists() and not (d / "data").exists()
    assert (d / "agent.log").read_text() == "agent ready\n" and (d / "daemon.log").exists()
    assert f"removed {sd} (container logs, pod dirs, persistent volume data)" in err
    assert f"removed {d / 'data'} (etcd data, certificates, control-plane logs)" in err
    assert f"kept {d / 'daemon.log'} and {d / 'agent.log'}" in err
    assert cli._down(d) == 0  # nothing left to remove: says nothing about removing
    assert "removed" not in capsys.readouterr().err


def test_down_keeps_the_state_of_an_agent_that_still_runs(tmp_path, capsys):
    d = tmp_path / "cluster"
    sd = _session_leftovers(d)
    # a process that looks like this dir's agent to agent_pid() (module name and state dir on its command line)
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", agent_daemon.AGENT_MODULE, str(sd)])
    try:
        with pytest.raises(RuntimeError, match="still runs"):
            (d / "agent.pid").write_text(str(fake.pid))
            agent_daemon.remove_state(d)
        assert (sd / "logs" / "default_job-trainer-0_trainer.log").exists()
    finally:
        fake.kill()
        fake.wait()
    assert agent_daemon.remove_state(d) == sd and not sd.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_down_does_not_delete_through_a_mount(tmp_path, capsys):
    d = tmp_path / "cluster"
    sd = _session_leftovers(d)
    point = sd / "pods" / "uid-1" / "volumes" / "shm"
    point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], check=True)
    try:
        (point / "data").write_text("in memory")
        assert cli._down(d) == 1
        assert f"still mounted below {sd}: {point}" in capsys.readouterr().err
        assert (point / "data").read_text() == "in memory"
    finally:
        subprocess.run(["umount", str(point)], check=True)
    assert cli._down(d) == 0 and not sd.exists()
