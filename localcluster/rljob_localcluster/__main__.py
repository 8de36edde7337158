"""CLI for the local cluster: a control plane and real nodes (kubelet + containerd, see nodes.py).

    python -m rljob_localcluster up       # build tools if missing; control plane + 2 nodes in the background
    python -m rljob_localcluster up --no-nodes   # the control plane alone (on 127.0.0.1)
    python -m rljob_localcluster up --kueue      # ... and Kueue next to it (docs/kueue.md; rljob_localcluster.kueue)
    eval "$(python -m rljob_localcluster env)"
    kubectl get nodes -o wide
    python -m rljob_localcluster status   # state JSON and the nodes; exit 1 when down or starting,
                                          # 3 when a node process exited (the rest runs on)
    python -m rljob_localcluster down     # stop everything (pods first), clean the host, remove the data
    python -m rljob_localcluster demo     # the README's main job: cluster + nodes, helm install, CPU example

State lives in ``--dir`` (default ``${RLJOB_CLUSTER_DIR:-$HOME/.cache/rljob/cluster}``):
``kubeconfig``, ``state.json``, ``daemon.pid``, ``daemon.log``, ``data/`` (certs, etcd, control-plane logs) and
``nodes/`` (the nodes' configs and state, PV data, their logs in ``nodes/logs/``). ``down`` removes everything
but ``daemon.log`` and ``nodes/logs/``; the nodes' containerd roots (unpacked images) stay in
``${RLJOB_CONTAINERD_DIR:-$HOME/.cache/rljob/containerd}``.
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

from . import clusterdir, demo, statefile
from .controlplane import ControlPlane
from .tools import pinned_versions, tools_bin_dir


def _exports(d: Path, bin_dir: str | None) -> str:
    lines = [f"export KUBECONFIG={shlex.quote(str(d / 'kubeconfig'))}"]
    if bin_dir:
        lines.append(f"export PATH={shlex.quote(bin_dir)}:\"$PATH\"")
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    d: Path = args.dir.resolve()
    if not 0 <= args.nodes <= 200:
        print(f"--nodes must be 0..200 (0: the control plane alone), got {args.nodes}", file=sys.stderr)
        return 2
    if args.gpus_per_node < 0:
        print(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}", file=sys.stderr)
        return 2
    if args.timeout <= 0 or args.nodes_timeout <= 0:
        print(f"--timeout and --nodes-timeout must be > 0 seconds, got {args.timeout:g} and {args.nodes_timeout:g}",
              file=sys.stderr)
        return 2
    if clusterdir.daemon_pid(d) and not clusterdir.read_state(d):
        print(f"# the local cluster in {d} is still starting (daemon pid {clusterdir.daemon_pid(d)}; {d / 'daemon.log'})",
              file=sys.stderr)
        return 1
    if clusterdir.daemon_pid(d) and (st := clusterdir.read_state(d)):
        running = st.get("requested") or {}
        asked = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, **({"kueue": True} if args.kueue else {})}
        if running and running != asked:
            print(f"a local cluster already runs in {d} with {running}, not {asked}: "
                  "'python -m rljob_localcluster down' first", file=sys.stderr)
            return 1
        if st.get("phase") != "ready":
            print(f"# the local cluster in {d} is still starting (daemon pid {st['daemon_pid']}; "
                  f"{d / 'daemon.log'})", file=sys.stderr)
            return 1
        print(f"# control plane already running ({st['server']})", file=sys.stderr)
        print(_exports(d, st.get("bin_dir")))
        return 0
    if (d / "data").exists() or (d / "daemon.pid").exists():
        print(f"# cleaning stale state in {d}", file=sys.stderr)
        clusterdir.down(d, quiet=True)
    d.mkdir(parents=True, exist_ok=True)
    bin_dir = str(args.bin_dir or tools_bin_dir())  # may build for tens of minutes, in the foreground
    if args.foreground:
        return _serve(d, bin_dir, args.bind_address, args.timeout, args.nodes, args.gpus_per_node,
                      args.nodes_timeout, args.kueue)
    cmd = [
        sys.executable, "-m", "rljob_localcluster", "_serve", "--dir", str(d), "--bin-dir", bin_dir,
        "--bind-address", args.bind_address or "", "--timeout", str(args.timeout), "--nodes", str(args.nodes),
        "--gpus-per-node", str(args.gpus_per_node), "--nodes-timeout", str(args.nodes_timeout),
        *(["--kueue"] if args.kueue else []),
    ]
    env = dict(os.environ)
    # Make the package importable for the daemon even when it is not installed.
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_start = (d / "daemon.log").stat().st_size if (d / "daemon.log").exists() else 0
    with open(d / "daemon.log", "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=str(d),
        )
    deadline = time.monotonic() + args.timeout + 30 + (args.nodes_timeout if args.nodes else 0)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(d / "daemon.log", "rb") as f:
                f.seek(log_start)
                this_run = f.read().decode(errors="replace")
            why = "stopped by 'down'" if "stopped while starting" in this_run else f"exit {proc.returncode}"
            print(f"the local cluster failed to start ({why}); this run's lines of {d / 'daemon.log'}:",
                  file=sys.stderr)
            print(this_run[-6000:], file=sys.stderr)
            return 1
        st = clusterdir.read_state(d)
        if st and st.get("daemon_pid") == proc.pid and st.get("phase") == "ready":
            print(f"# control plane up: {st['server']} (daemon pid {proc.pid}; "
                  f"'python -m rljob_localcluster down' stops it)", file=sys.stderr)
            if st.get("nodes"):
                print(f"# nodes Ready: {', '.join(st['nodes']['nodes'])} ({args.gpus_per_node} nvidia.com/gpu each; "
                      f"DNS {st['nodes']['dns']}; logs {d / 'nodes' / 'logs'})", file=sys.stderr)
            if st.get("kueue"):
                print(f"# Kueue {st['kueue']['version']} (pid {st['kueue']['pid']}; log {st['kueue']['log']})",
                      file=sys.stderr)
            print(_exports(d, bin_dir))
            return 0
        time.sleep(0.5)
    print("timed out waiting for the local cluster; stopping it", file=sys.stderr)
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
    clusterdir.down(d, quiet=True)
    return 1


class _Stopped(BaseException):
    """SIGTERM/SIGINT/SIGHUP while the daemon starts: unwinds start() (which stops what it started)."""


def _serve(d: Path, bin_dir: str, bind_address: str | None, timeout: float, nodes: int = 0,
           gpus_per_node: int = 4, nodes_timeout: float = 900.0, kueue: bool = False) -> int:
    """The daemon: the control plane, (``nodes`` > 0) the local nodes and (``kueue``) Kueue, until SIGTERM; then
    Kueue stops (its webhooks deleted), then the nodes (pods first, host cleaned), then the control plane.

    ``state.json`` is written as soon as the control plane runs (``phase: starting``, its pids) and again when
    the nodes are Ready (``phase: ready``), so ``down`` can end the processes of a daemon killed at any
    point. A signal while starting interrupts the start (what was started is stopped). A control-plane
    component that exits stops the daemon; a node process that exits (a kubelet, a containerd, kube-proxy,
    CoreDNS, the node controller) is logged and recorded under ``exited`` in state.json, and the rest keeps
    running (nodes fail on real clusters too; ``status`` shows it)."""
    from .kueue import LocalKueue
    from .nodes import LocalNodes, node_control_plane_options

    stop = threading.Event()
    starting = [True]

    def on_signal(*_: object) -> None:
        stop.set()
        if starting[0]:
            starting[0] = False  # raise once; a second signal must not cut the clean-up short
            raise _Stopped

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    (d / "daemon.pid").write_text(str(os.getpid()))
    rc = 0
    cp = local_nodes = local_kueue = None
    try:
        if nodes:
            opts = node_control_plane_options()
            if bind_address:
                opts["bind_address"] = bind_address
        else:
            opts = {"bind_address": bind_address or "127.0.0.1"}
        cp = ControlPlane(d / "data", bin_dir=bin_dir, start_timeout=timeout, **opts)
        cp.start()
        shutil.copyfile(cp.kubeconfig, d / "kubeconfig")
        (d / "kubeconfig").chmod(0o600)
        st = cp.state() | {"daemon_pid": os.getpid(), "kubeconfig": str(d / "kubeconfig"), "phase": "starting",
                           "requested": {"nodes": nodes, "gpus_per_node": gpus_per_node,
                                         **({"kueue": True} if kueue else {})}}
        statefile.write(d / "state.json", st)
        if nodes:
            print(f"control plane up ({cp.server}); starting {nodes} nodes", flush=True)
            local_nodes = LocalNodes(cp, d / "nodes", nodes=nodes, gpus_per_node=gpus_per_node,
                                     start_timeout=nodes_timeout, log=lambda m: print(m, flush=True))
            local_nodes.start()
            st["nodes"] = local_nodes.state()
        if kueue:
            local_kueue = LocalKueue(cp, data_dir=d / "data" / "kueue")
            local_kueue.start()
            st["pids"] = {**st["pids"], "kueue": local_kueue.proc.pid}  # 'down' ends it after a hard death
            st["kueue"] = {"pid": local_kueue.proc.pid, "log": str(local_kueue.log_path),
                           "version": pinned_versions()["kueue"]}
            print(f"kueue up (pid {local_kueue.proc.pid})", flush=True)
        starting[0] = False
        if stop.is_set():  # a signal between the end of start() and here
            raise _Stopped
        st["phase"] = "ready"
        statefile.write(d / "state.json", st)
        print(f"local cluster up: {json.dumps(st)}", flush=True)
        rc = _watch(d, st, cp, local_nodes, stop, local_kueue)
    except _Stopped:
        print("stopped while starting", flush=True)
        rc = 1
    except Exception as e:  # noqa: BLE001
        print(f"local cluster failed: {e}", flush=True)
        rc = 1
    finally:
        starting[0] = False
        if local_kueue is not None:
            local_kueue.stop()
        if local_nodes is not None:
            try:
                for line in local_nodes.stop():
                    print(f"nodes: {line}", flush=True)
            except Exception as e:  # noqa: BLE001 - 'down' cleans the host from nodes/state.json
                print(f"stopping the nodes failed: {e}", flush=True)
        if cp is not None:
            cp.stop()
        for name in ("state.json", "kubeconfig", "daemon.pid"):
            (d / name).unlink(missing_ok=True)
        print("control plane stopped", flush=True)
    return rc


def _watch(d: Path, st: dict, cp: ControlPlane, local_nodes, stop: threading.Event, local_kueue=None) -> int:
    """Until ``stop``: every 2 s, a control-plane component that exited ends the watch (return 1); a node
    process (or Kueue) that exited is logged once and added to ``st["exited"]`` (state.json rewritten); returns 0."""
    reported: set[str] = set()
    while not stop.wait(2.0):
        if local_kueue is not None and "kueue" not in reported and local_kueue.proc.poll() is not None:
            reported.add("kueue")
            print(f"kueue exited ({local_kueue.proc.returncode}); the rest keeps running:\n{local_kueue.log_tail()}",
                  flush=True)
            st["exited"] = {**st.get("exited", {}), "kueue": local_kueue.proc.returncode}
            statefile.write(d / "state.json", st)
        if dead := cp.dead_components():
            print(f"control-plane component(s) exited: {dead}; stopping", flush=True)
            for name in dead:
                print(f"--- tail of {name} log", flush=True)
                print((cp.log_dir / f"{name}.log").read_text(errors="replace")[-3000:], flush=True)
            return 1
        new = {n: c for n, c in (local_nodes.dead() if local_nodes else {}).items() if n not in reported}
        if new:
            reported |= set(new)
            print(f"node process(es) exited: {new}; the rest keeps running ('down' stops it)", flush=True)
            for name in new:
                print(f"--- tail of {name} log", flush=True)
                print((local_nodes.log_dir / f"{name}.log").read_text(errors="replace")[-3000:], flush=True)
            st["exited"] = {**st.get("exited", {}), **new}
            statefile.write(d / "state.json", st)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    return clusterdir.down(args.dir.resolve())


def cmd_status(args: argparse.Namespace) -> int:
    d = args.dir.resolve()
    pid, st = clusterdir.daemon_pid(d), clusterdir.read_state(d)
    if pid and st and st.get("phase") != "ready":
        print(json.dumps(st, indent=2))
        print(f"starting (daemon pid {pid}; {d / 'daemon.log'})", file=sys.stderr)
        return 1
    if pid and st:
        print(json.dumps(st, indent=2))
        if exited := st.get("exited"):
            print(f"DEGRADED: node process(es) exited {exited}; the logs are in {d / 'nodes' / 'logs'}",
                  file=sys.stderr)
        if st.get("nodes"):
            cols = ("NAME:.metadata.name,READY:.status.conditions[?(@.type=='Ready')].status,"
                    "GPUS:.status.capacity.nvidia\\.com/gpu,POD-CIDR:.spec.podCIDR,"
                    "INTERNAL-IP:.status.addresses[0].address,RUNTIME:.status.nodeInfo.containerRuntimeVersion,"
                    "KUBELET:.status.nodeInfo.kubeletVersion")
            out = subprocess.run([str(Path(st["bin_dir"]) / "kubectl"), "--kubeconfig", str(d / "kubeconfig"),
                                  "get", "nodes", "-o", f"custom-columns={cols}"],
                                 capture_output=True, text=True, check=False, timeout=30)
            print(out.stdout or out.stderr, end="", file=sys.stderr)
        return 3 if st.get("exited") else 0
    print("not running", file=sys.stderr)
    return 1


def cmd_env(args: argparse.Namespace) -> int:
    d = args.dir.resolve()
    st = clusterdir.read_state(d)
    if not (st and clusterdir.daemon_pid(d) and st.get("phase") == "ready"):
        print("not running (or still starting); start it with 'python -m rljob_localcluster up'", file=sys.stderr)
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
        sp.add_argument("--dir", type=Path, default=clusterdir.default_dir(), help="state dir (RLJOB_CLUSTER_DIR)")
        sp.set_defaults(fn=fn)
        return sp

    up = add("up", cmd_up, "start the control plane and the nodes in the background; prints export lines")
    up.add_argument("--foreground", action="store_true", help="run in this process until Ctrl-C")
    up.add_argument("--bind-address", default=None,
                    help="API server bind address (default: 0.0.0.0 with nodes, else 127.0.0.1)")
    up.add_argument("--nodes", type=int, default=2, help="number of real nodes (kubelet + containerd; root)")
    up.add_argument("--no-nodes", dest="nodes", action="store_const", const=0, help="the control plane alone")
    up.add_argument("--gpus-per-node", type=int, default=4, help="fake nvidia.com/gpu per node")
    up.add_argument("--nodes-timeout", type=float, default=900.0,
                    help="seconds for the nodes to be Ready (the first image import takes minutes)")
    up.add_argument("--kueue", action="store_true",
                    help="also run Kueue (its CRDs, webhooks and manager; RLTrainingJob as an external framework)")
    up.add_argument("--bin-dir", default=None, help="tools dir (default: build-go-tools.sh)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    add("down", cmd_down, "stop the nodes (pods first) and the control plane; clean the host; "
                          "remove their data")
    add("status", cmd_status, "print the state JSON; exit 1 when not running or starting, 3 when a node "
                              "process exited")
    add("env", cmd_env, "print export lines for KUBECONFIG and PATH")
    add("tools", cmd_tools, "build the Go tools if missing and print their bin dir")
    demo.add_parser(sub, clusterdir.default_dir())
    serve = add("_serve", None, "internal: run the control plane and the nodes in this process (used by up)")
    serve.add_argument("--bin-dir", required=True)
    serve.add_argument("--bind-address", default="")
    serve.add_argument("--timeout", type=float, default=180.0)
    serve.add_argument("--nodes", type=int, default=0)
    serve.add_argument("--gpus-per-node", type=int, default=4)
    serve.add_argument("--nodes-timeout", type=float, default=900.0)
    serve.add_argument("--kueue", action="store_true")

    args = p.parse_args(argv)
    if args.cmd == "_serve":
        return _serve(args.dir.resolve(), args.bin_dir, args.bind_address or None, args.timeout, args.nodes,
                      args.gpus_per_node, args.nodes_timeout, args.kueue)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
