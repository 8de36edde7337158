"""CLI for the local control plane.

    python -m rljob_localcluster up       # build tools if missing, start in the background
    python -m rljob_localcluster up --agent   # ... plus the node agent, so that pods run
    eval "$(python -m rljob_localcluster env)"
    kubectl get ns
    python -m rljob_localcluster status
    python -m rljob_localcluster down     # stop it (and the node agent) and remove their data
    python -m rljob_localcluster demo     # the README's main job: cluster + agent, helm install, CPU example

State lives in ``--dir`` (default ``${RLJOB_CLUSTER_DIR:-$HOME/.cache/rljob/cluster}``):
``kubeconfig``, ``state.json``, ``daemon.pid``, ``daemon.log`` and ``data/`` (certs, etcd, logs); with the node
agent also ``agent.pid``, ``agent.log`` and ``agent/`` (container logs, pod dirs, PV data). ``down`` removes
everything but the two ``.log`` files.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import agent_daemon, demo
from .controlplane import ControlPlane
from .pids import pid_running, terminate
from .tools import tools_bin_dir


def default_dir() -> Path:
    d = os.environ.get("RLJOB_CLUSTER_DIR")
    return Path(d) if d else Path.home() / ".cache" / "rljob" / "cluster"


def _daemon_marks(d: Path) -> tuple[str, str]:
    """What the command line of this dir's daemon contains (so a recycled pid is not taken for it)."""
    return "rljob_localcluster", str(d)


def _daemon_pid(d: Path) -> int | None:
    """The running daemon's pid for this dir, or None (checks the pid really is our daemon)."""
    try:
        pid = int((d / "daemon.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_running(pid, *_daemon_marks(d)) else None


def _exports(d: Path, bin_dir: str | None) -> str:
    lines = [f"export KUBECONFIG={shlex.quote(str(d / 'kubeconfig'))}"]
    if bin_dir:
        lines.append(f"export PATH={shlex.quote(bin_dir)}:\"$PATH\"")
    return "\n".join(lines)


def _read_state(d: Path) -> dict | None:
    try:
        return json.loads((d / "state.json").read_text())
    except (OSError, ValueError):
        return None


def cmd_up(args: argparse.Namespace) -> int:
    rc = _up(args)
    if rc == 0 and args.agent and not args.foreground:
        d = args.dir.resolve()
        try:
            pid = agent_daemon.start_agent(d, str(d / "kubeconfig"))
        except RuntimeError as err:
            print(f"node agent failed to start: {err}", file=sys.stderr)
            return 1
        print(f"# node agent up (pid {pid}; 2 nodes, 4 fake nvidia.com/gpu each; log {d / 'agent.log'})",
              file=sys.stderr)
    return rc


def _up(args: argparse.Namespace) -> int:
    d: Path = args.dir.resolve()
    if _daemon_pid(d) and _read_state(d):
        st = _read_state(d)
        print(f"# control plane already running ({st['server']})", file=sys.stderr)
        print(_exports(d, st.get("bin_dir")))
        return 0
    if (d / "data").exists() or (d / "daemon.pid").exists():
        print(f"# cleaning stale state in {d}", file=sys.stderr)
        _down(d, quiet=True)
    d.mkdir(parents=True, exist_ok=True)
    bin_dir = str(args.bin_dir or tools_bin_dir())  # may build for tens of minutes, in the foreground
    if args.foreground:
        return _serve(d, bin_dir, args.bind_address, args.timeout)
    cmd = [
        sys.executable, "-m", "rljob_localcluster", "_serve", "--dir", str(d), "--bin-dir", bin_dir,
        "--bind-address", args.bind_address, "--timeout", str(args.timeout),
    ]
    env = dict(os.environ)
    # Make the package importable for the daemon even when it is not installed.
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(d / "daemon.log", "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=str(d),
        )
    deadline = time.monotonic() + args.timeout + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"control plane failed to start (exit {proc.returncode}); {d / 'daemon.log'}:",
                  file=sys.stderr)
            print((d / "daemon.log").read_text(errors="replace")[-6000:], file=sys.stderr)
            return 1
        st = _read_state(d)
        if st and st.get("daemon_pid") == proc.pid:
            print(f"# control plane up: {st['server']} (daemon pid {proc.pid}; "
                  f"'python -m rljob_localcluster down' stops it)", file=sys.stderr)
            print(_exports(d, bin_dir))
            return 0
        time.sleep(0.5)
    print("timed out waiting for the control plane; stopping it", file=sys.stderr)
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    return 1


def _serve(d: Path, bin_dir: str, bind_address: str, timeout: float) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    (d / "daemon.pid").write_text(str(os.getpid()))
    cp = ControlPlane(d / "data", bin_dir=bin_dir, bind_address=bind_address, start_timeout=timeout)
    rc = 0
    try:
        cp.start()
        shutil.copyfile(cp.kubeconfig, d / "kubeconfig")
        (d / "kubeconfig").chmod(0o600)
        st = cp.state() | {"daemon_pid": os.getpid(), "kubeconfig": str(d / "kubeconfig")}
        tmp = d / "state.json.tmp"
        tmp.write_text(json.dumps(st, indent=2))
        tmp.replace(d / "state.json")
        print(f"control plane up: {json.dumps(st)}", flush=True)
        while not stop.wait(2.0):
            dead = cp.dead_components()
            if dead:
                print(f"component(s) exited: {dead}; stopping", flush=True)
                for name in dead:
                    print(f"--- tail of {name} log", flush=True)
                    print((cp.log_dir / f"{name}.log").read_text(errors="replace")[-3000:], flush=True)
                rc = 1
                break
    except Exception as e:  # noqa: BLE001
        print(f"control plane failed: {e}", flush=True)
        rc = 1
    finally:
        cp.stop()
        for name in ("state.json", "kubeconfig", "daemon.pid"):
            (d / name).unlink(missing_ok=True)
        print("control plane stopped", flush=True)
    return rc


def _down(d: Path, quiet: bool = False) -> int:
    """Stop the node agent (its pods first, while the API server still answers), then the control plane,
    and delete their data: ``data/`` and the agent's state dir ``agent/``. ``daemon.log`` and ``agent.log``
    are kept. Exit status 1 when the agent's state dir could not be removed."""
    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr)

    if agent_daemon.stop_agent(d):
        say("node agent stopped")
    pid = _daemon_pid(d)
    st = _read_state(d) or {}
    had_data = (d / "data").exists()  # the daemon removes it itself when it stops
    if pid:
        terminate(pid, 60, *_daemon_marks(d))
    # Components of a daemon that died hard: end exactly those recorded pids whose command line
    # still names this cluster's data dir (so a recycled pid is never touched).
    for cpid in (st.get("pids") or {}).values():
        terminate(cpid, 10, str(d / "data"))
    say("control plane stopped" if pid else "control plane was not running")
    for name in ("state.json", "state.json.tmp", "kubeconfig", "daemon.pid"):
        (d / name).unlink(missing_ok=True)
    rc = 0
    shutil.rmtree(d / "data", ignore_errors=True)
    if had_data:
        say(f"removed {d / 'data'} (etcd data, certificates, control-plane logs)")
    try:
        if removed := agent_daemon.remove_state(d):
            say(f"removed {removed} (container logs, pod dirs, persistent volume data)")
    except RuntimeError as err:
        print(f"node agent state not removed: {err}", file=sys.stderr)
        rc = 1
    kept = [str(d / name) for name in ("daemon.log", "agent.log") if (d / name).exists()]
    if kept:
        say(f"kept {' and '.join(kept)}")
    return rc


def cmd_down(args: argparse.Namespace) -> int:
    return _down(args.dir.resolve())


def cmd_status(args: argparse.Namespace) -> int:
    d = args.dir.resolve()
    pid, st = _daemon_pid(d), _read_state(d)
    if pid and st:
        print(json.dumps(st, indent=2))
        return 0
    print("not running", file=sys.stderr)
    return 1


def cmd_env(args: argparse.Namespace) -> int:
    d = args.dir.resolve()
    st = _read_state(d)
    if not (st and _daemon_pid(d)):
        print("not running; start it with 'python -m rljob_localcluster up'", file=sys.stderr)
        return 1
    print(_exports(d, st.get("bin_dir")))
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    print(tools_bin_dir())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljob_localcluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--dir", type=Path, default=default_dir(), help="state dir (RLJOB_CLUSTER_DIR)")
        sp.set_defaults(fn=fn)
        return sp

    up = add("up", cmd_up, "start the control plane in the background; prints export lines")
    up.add_argument("--foreground", action="store_true", help="run in this process until Ctrl-C")
    up.add_argument("--bind-address", default="127.0.0.1", help="API server bind address")
    up.add_argument("--bin-dir", default=None, help="tools dir (default: build-go-tools.sh)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    up.add_argument("--agent", action="store_true",
                    help="also start the test node agent (pods run; needs root), as the demo does")
    add("down", cmd_down, "stop the node agent and the control plane; remove their data (data/, agent/)")
    add("status", cmd_status, "print the state JSON; exit 1 when not running")
    add("env", cmd_env, "print export lines for KUBECONFIG and PATH")
    add("tools", cmd_tools, "build the Go tools if missing and print their bin dir")
    demo.add_parser(sub, default_dir())
    serve = add("_serve", None, "internal: run the control plane in this process (used by up)")
    serve.add_argument("--bin-dir", required=True)
    serve.add_argument("--bind-address", default="127.0.0.1")
    serve.add_argument("--timeout", type=float, default=180.0)

    args = p.parse_args(argv)
    if args.cmd == "_serve":
        return _serve(args.dir.resolve(), args.bin_dir, args.bind_address, args.timeout)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
