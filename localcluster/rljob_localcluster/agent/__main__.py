"""CLI of the local node agent.

    python -m rljob_localcluster.agent --kubeconfig K --nodes 2 --gpus-per-node 4 --state-dir D
    python -m rljob_localcluster.agent lose-node --state-dir D rljob-node-1     # simulate node loss
    python -m rljob_localcluster.agent restore-node --state-dir D rljob-node-1
    python -m rljob_localcluster.agent logs --state-dir D NAMESPACE POD [CONTAINER]

The agent runs until SIGTERM/SIGINT, then stops its pods and removes everything it made on the
host. It needs root (network namespaces, bind mounts) and ``ip``, ``mount``, ``nsenter``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .agent import Agent, AgentConfig, AgentError
from .logs import default_state_dir, logs


def _run(args: argparse.Namespace) -> int:
    cfg = AgentConfig(
        kubeconfig=args.kubeconfig, state_dir=args.state_dir, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        node_prefix=args.node_prefix, cpu=args.cpu, memory=args.memory, cluster_cidr=args.cluster_cidr,
        bridge=args.bridge, etc_hosts=None if args.no_etc_hosts else Path("/etc/hosts"),
        backoff_base=args.backoff_base, backoff_max=args.backoff_max, shutdown_grace=args.shutdown_grace,
        heartbeat_seconds=args.heartbeat_seconds, delete_nodes_on_exit=not args.keep_nodes,
    )
    for flag, values, target in (("--image-env", args.image_env, cfg.image_env),
                                 ("--node-label", args.node_label, cfg.node_labels)):
        for extra in values or []:
            key, sep, value = extra.partition("=")
            if not sep or not key:
                print(f"{flag} {extra!r}: expected NAME=VALUE", file=sys.stderr)
                return 2
            target[key] = value
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    agent = Agent(cfg)
    try:
        agent.start()
    except AgentError as e:
        print(f"agent failed to start: {e}", file=sys.stderr)
        return 1
    print(f"agent ready: nodes {', '.join(agent.nodes)}", flush=True)
    agent.run_until(stop)
    return 0


def _control(args: argparse.Namespace) -> int:
    flag = args.state_dir / "control" / f"lose-{args.node}"
    if args.cmd == "lose-node":
        flag.parent.mkdir(parents=True, exist_ok=True)
        flag.touch()
    else:
        flag.unlink(missing_ok=True)
    print(f"{args.cmd} {args.node}: the agent applies it within a second")
    return 0


def _logs(args: argparse.Namespace) -> int:
    try:
        sys.stdout.write(logs(args.namespace, args.pod, args.container, args.state_dir))
    except (FileNotFoundError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"lose-node", "restore-node", "logs"}
    if argv and argv[0] in commands:
        p = argparse.ArgumentParser(prog="python -m rljob_localcluster.agent " + argv[0])
        p.add_argument("--state-dir", type=Path, default=default_state_dir())
        if argv[0] == "logs":
            p.add_argument("namespace")
            p.add_argument("pod")
            p.add_argument("container", nargs="?")
        else:
            p.add_argument("node")
        args = p.parse_args(argv[1:])
        args.cmd = argv[0]
        return _logs(args) if args.cmd == "logs" else _control(args)

    p = argparse.ArgumentParser(prog="python -m rljob_localcluster.agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", required=True, help="admin kubeconfig of the cluster")
    p.add_argument("--state-dir", type=Path, default=default_state_dir(),
                   help="pods' files, container logs (logs/), PV data (pv/) (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=4, help="fake nvidia.com/gpu capacity")
    p.add_argument("--node-prefix", default="rljob-node-")
    p.add_argument("--node-label", action="append", metavar="KEY=VALUE", help="extra label on every node")
    p.add_argument("--cpu", default="16", help="cpu capacity per node")
    p.add_argument("--memory", default="64Gi", help="memory capacity per node")
    p.add_argument("--cluster-cidr", default="10.244.0.0/16")
    p.add_argument("--bridge", default="rljob0")
    p.add_argument("--no-etc-hosts", action="store_true", help="do not keep a block of cluster names in /etc/hosts")
    p.add_argument("--backoff-base", type=float, default=10.0, help="crash back-off start, seconds")
    p.add_argument("--backoff-max", type=float, default=300.0, help="crash back-off cap, seconds")
    p.add_argument("--shutdown-grace", type=float, default=5.0, help="SIGTERM→SIGKILL seconds when the agent stops")
    p.add_argument("--heartbeat-seconds", type=float, default=10.0, help="node lease renewal period")
    p.add_argument("--keep-nodes", action="store_true", help="leave the Node objects registered on exit")
    p.add_argument("--image-env", action="append", metavar="NAME=VALUE", help="extra env of every image")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
