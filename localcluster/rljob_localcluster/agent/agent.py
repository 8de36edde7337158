"""The node agent: registers nodes, keeps them alive, runs the pods bound to them, and serves
cluster DNS names and persistent volumes. See the package doc for the whole picture.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from ..pids import pid_running
from .apiproxy import TcpRelay
from .dns import DnsRecord, records_from_endpoint_slices
from .hosts import HostsManager
from .kube import ApiException, Informer, Kube
from .kubeletapi import LogServer
from .mountpoints import MountPoints, unmount
from .network import Bridge, IPAllocator, PodSandboxNet, bridge_address, node_pod_cidrs
from .node import NodeSpec, node_status, register_node, renew_lease
from .podstatus import rfc3339
from .podworker import NodeRuntime, PodWorker, RuntimeContext
from .storage import Provisioner, ensure_storage_class

__all__ = ["Agent", "AgentConfig", "AgentError", "default_image_env", "default_image_paths"]

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """The agent cannot start (another agent owns the state dir, the API server is unreachable...)."""


def default_image_env() -> dict[str, str]:
    """The environment every "image" provides: the project's Python environment first on PATH (then
    the base installation's scripts, for a virtual environment made with --system-site-packages),
    HOME=/root, PYTHONUNBUFFERED=1 (as most Python images set it, so logs are live), and
    PYTHONPATH/VIRTUAL_ENV/LANG/LC_ALL/TZ passed through from the agent when set."""
    bins = dict.fromkeys([os.path.dirname(sys.executable), os.path.join(sys.base_prefix, "bin")])
    env = {
        "PATH": ":".join([*bins, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]),
        "HOME": "/root",
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def default_image_paths() -> tuple[str, ...]:
    """The host directories that make up every "image": the Python installation (``sys.prefix``,
    ``sys.base_prefix``), every directory on ``sys.path`` and the project checkout the agent runs from
    (where editable installs point). A volume mounted over a parent of one of them (an emptyDir at /tmp
    while the checkout is under /tmp) must not hide them, as a real image keeps its files elsewhere."""
    checkout = Path(__file__).resolve().parents[3]
    paths = {sys.prefix, sys.base_prefix, str(checkout)}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return tuple(sorted(os.path.realpath(p) for p in paths))


@dataclass
class AgentConfig:
    """Settings of one agent process (the CLI flags of ``python -m rljob_localcluster.agent``)."""

    kubeconfig: str
    state_dir: Path
    nodes: int = 2
    """Number of nodes, named ``<node_prefix><i>`` for i in 0..nodes-1."""
    gpus_per_node: int = 4
    """Fake ``nvidia.com/gpu`` capacity per node (nothing backs it: it makes GPU requests schedulable)."""
    node_prefix: str = "rljob-node-"
    node_labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on every node (e.g. for tests to pin pods with a nodeSelector)."""
    cpu: str = "16"
    memory: str = "64Gi"
    max_pods: str = "110"
    cluster_cidr: str = "10.244.0.0/16"
    """Pod network; the bridge takes its first address, node i the (i+1)-th /24."""
    bridge: str = "rljob0"
    cluster_domain: str = "cluster.local"
    etc_hosts: Path | None = Path("/etc/hosts")
    """Host hosts file that gets a managed block of cluster names (None: leave it alone)."""
    heartbeat_seconds: float = 10.0
    """Lease renewal period (kubelet: 10 s; the lease lasts ``lease_seconds``)."""
    lease_seconds: int = 40
    node_status_seconds: float = 60.0
    backoff_base: float = 10.0
    """First crash back-off after the immediate restart, seconds (kubelet: 10 s), doubling..."""
    backoff_max: float = 300.0
    """...up to this many seconds (kubelet: 300 s)."""
    shutdown_grace: float = 5.0
    """Seconds pods get between SIGTERM and SIGKILL when the agent itself stops."""
    delete_nodes_on_exit: bool = True
    """Delete the Node objects when the agent stops, so nothing is scheduled onto nodes that no
    longer run pods (kubelet leaves them; a lost node is simulated with :meth:`Agent.lose_node`)."""
    storage: bool = True
    """Make StorageClass ``rljob-local`` and provision hostPath PVs for its claims."""
    image_env: dict[str, str] = field(default_factory=default_image_env)
    image_paths: tuple[str, ...] = field(default_factory=default_image_paths)
    """Host directories every container sees even under a volume mounted over a parent of them."""


class Agent:
    """Runs :class:`AgentConfig` ``nodes`` nodes until :meth:`stop`.

    ``start()`` returns once the nodes are registered and the watches have listed; ``stop()``
    removes everything the agent made on the host (processes, namespaces, veths, bridge, mount
    points, the /etc/hosts block). Use as a context manager in tests.
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir).resolve()
        self.nodes: dict[str, NodeRuntime] = {}
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._stopped = False
        self._informers: list[Informer] = []
        self._pod_informers: dict[str, Informer] = {}
        self._relay: TcpRelay | None = None
        self._bridge: Bridge | None = None
        self._log_server: LogServer | None = None
        self._heartbeat: threading.Thread | None = None
        self.kube: Kube | None = None
        self.ctx: RuntimeContext | None = None
        self.service_ip = ""

    # ------------------------------------------------------------------ paths
    @property
    def record_path(self) -> Path:
        return self.state_dir / "agent.json"

    @property
    def control_dir(self) -> Path:
        return self.state_dir / "control"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Agent:
        """Set up host networking, register the nodes and start every watch.

        Raises:
            AgentError: another live agent uses the state dir, or the API server cannot be used.
        """
        cfg = self.config
        for sub in ("logs", "pods", "pv", "control"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.clean_leftovers()
        try:
            self._start(cfg)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, cfg: AgentConfig) -> None:
        self.kube = kube = Kube(cfg.kubeconfig)
        try:
            version = kube.get("/version")["gitVersion"]
            svc = kube.get("/api/v1/namespaces/default/services/kubernetes")
        except Exception as e:
            raise AgentError(f"API server {kube.server} not usable with {cfg.kubeconfig}: {e}") from e
        self.service_ip = svc["spec"]["clusterIP"]
        self._bridge = bridge = Bridge(cfg.bridge, bridge_address(cfg.cluster_cidr))
        bridge.ensure()
        self._write_record(bridge_created=bridge.created)
        bridge.add_address(f"{self.service_ip}/32")
        upstream = urlparse(kube.server)
        self._relay = TcpRelay((self.service_ip, 443), (upstream.hostname, upstream.port or 443)).start()
        hosts = HostsManager(cfg.cluster_domain, cfg.etc_hosts, f"rljob-local-node-agent {self.state_dir}",
                             static=[DnsRecord("default", "kubernetes", self.service_ip)])
        hosts.set_records([])
        self.ctx = RuntimeContext(
            kube=kube, state_dir=self.state_dir, cluster_domain=cfg.cluster_domain, image_env=dict(cfg.image_env),
            image_paths=cfg.image_paths,
            cluster_env=self._cluster_env(), bridge=bridge, mountpoints=MountPoints(self.state_dir / "mountpoints.json"),
            hosts=hosts, backoff_base=cfg.backoff_base, backoff_max=cfg.backoff_max,
            detach=["/run/netns", str(self.state_dir / "pods")],
        )
        if cfg.storage:
            ensure_storage_class(kube)
            provisioner = Provisioner(kube, self.state_dir / "pv")
            self._informers += [
                Informer(kube, "/api/v1/persistentvolumeclaims", provisioner.on_claim, name="pvc").start(),
                Informer(kube, "/api/v1/persistentvolumes", provisioner.on_volume, name="pv").start(),
            ]
        slices = Informer(kube, "/apis/discovery.k8s.io/v1/endpointslices",
                          lambda *_: hosts.set_records(records_from_endpoint_slices(slices.objects())), name="endpointslices")
        self._informers.append(slices.start())
        self._log_server = LogServer(str(bridge.address.ip), 0, self.state_dir, self._container_running).start()
        cidrs = node_pod_cidrs(cfg.cluster_cidr, cfg.nodes)
        for i in range(cfg.nodes):
            spec = NodeSpec(
                name=f"{cfg.node_prefix}{i}", pod_cidr=cidrs[i], internal_ip=str(bridge.address.ip), cpu=cfg.cpu,
                memory=cfg.memory, pods=cfg.max_pods, gpus=cfg.gpus_per_node, kubelet_version=version,
                kubelet_port=self._log_server.port, labels=dict(cfg.node_labels),
            )
            node = register_node(kube, spec)
            renew_lease(kube, node, cfg.lease_seconds)
            self.nodes[spec.name] = NodeRuntime(spec, IPAllocator(spec.pod_cidr), node_object=node)
            self._watch_pods(spec.name)
        for inf in self._informers + list(self._pod_informers.values()):
            if not inf.synced.wait(60):
                raise AgentError(f"watch of {inf.path} did not list within 60 s")
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="node-heartbeat", daemon=True)
        self._heartbeat.start()
        log.info("agent up: nodes %s, bridge %s %s, API relay %s:443 -> %s", list(self.nodes), cfg.bridge,
                 bridge.address, self.service_ip, kube.server)

    def _cluster_env(self) -> dict[str, str]:
        """The env kubelet gives every container for the ``kubernetes`` Service."""
        ip, port = self.service_ip, "443"
        url = f"tcp://{ip}:{port}"
        return {
            "KUBERNETES_SERVICE_HOST": ip,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": url,
            f"KUBERNETES_PORT_{port}_TCP": url,
            f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": port,
            f"KUBERNETES_PORT_{port}_TCP_ADDR": ip,
        }

    def _watch_pods(self, node_name: str) -> None:
        inf = Informer(self.kube, "/api/v1/pods", lambda t, pod: self._on_pod(node_name, t, pod),
                       query={"fieldSelector": f"spec.nodeName={node_name}"}, name=f"pods@{node_name}")
        self._pod_informers[node_name] = inf.start()

    def _on_pod(self, node_name: str, event_type: str, pod: dict) -> None:
        node = self.nodes[node_name]
        if node.lost or self._stopping.is_set():
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if event_type == "DELETED":
                if worker:
                    worker.update(None)
                return
            if worker is None:
                worker = PodWorker(self.ctx, node, pod, on_exit=self._worker_done)
                self.workers[uid] = worker
                worker.start()
            else:
                worker.update(pod)

    def _container_running(self, namespace: str, pod: str, container: str) -> bool:
        with self._lock:
            workers = [w for w in self.workers.values() if (w.namespace, w.name) == (namespace, pod)]
        return any(r.name == container and r.state != "terminated" for w in workers for r in w.init_records + w.records)

    def _worker_done(self, uid: str) -> None:
        with self._lock:
            self.workers.pop(uid, None)

    def run_until(self, stop: threading.Event) -> None:
        """Block until ``stop`` is set (e.g. by a signal handler), then :meth:`stop`."""
        try:
            while not stop.wait(1.0):
                pass
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop every pod (SIGTERM, SIGKILL after ``shutdown_grace``) and remove what the agent made
        on the host. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopping.set()
            workers = list(self.workers.values())
        for inf in self._informers + list(self._pod_informers.values()):
            inf.stop()
        for w in workers:
            w.shutdown(self.config.shutdown_grace)
        for w in workers:
            w.thread.join(self.config.shutdown_grace + 30)
        if self._relay is not None:
            self._relay.stop()
        if self._log_server is not None:
            self._log_server.stop()
        if self.config.delete_nodes_on_exit and self.kube is not None:
            for name in self.nodes:
                try:
                    self.kube.delete(f"/api/v1/nodes/{name}")
                except Exception as e:  # noqa: BLE001 - the API server may be gone already
                    log.warning("node %s not deleted: %s", name, e)
        if self.ctx is not None:
            self.ctx.hosts.restore()
            left = self.ctx.mountpoints.cleanup()
            if left:
                log.warning("mount points left in place (not empty): %s", left)
        if self._bridge is not None and self._bridge.created:
            self._bridge.delete()
        self.record_path.unlink(missing_ok=True)
        log.info("agent stopped")

    # ------------------------------------------------------------------ node loss
    def lose_node(self, name: str) -> None:
        """Simulate losing node ``name``: its processes are SIGKILLed at once, its sandboxes torn
        down, its lease and status no longer renewed and its pods no longer reported on (the API
        objects stay as they were, as with a machine that lost power).

        Raises:
            KeyError: no such node.
        """
        node = self.nodes[name]
        with self._lock:
            node.lost = True
            inf = self._pod_informers.pop(name, None)
            victims = [w for w in self.workers.values() if w.node is node]
        if inf:
            inf.stop()
        for w in victims:
            w.abandon()
        for w in victims:
            w.thread.join(30)
        log.info("node %s lost (%d pods killed)", name, len(victims))

    def restore_node(self, name: str) -> None:
        """Bring a lost node back: re-register, heartbeat again, run its pods (as after a reboot:
        containers that were running restart, or end ContainerStatusUnknown under restartPolicy Never).

        Raises:
            KeyError: no such node.
        """
        node = self.nodes[name]
        if not node.lost:
            return
        node.spec.ready_since = rfc3339()
        node.node_object = register_node(self.kube, node.spec)
        renew_lease(self.kube, node.node_object, self.config.lease_seconds)
        node.lost = False
        self._watch_pods(name)
        log.info("node %s restored", name)

    def _apply_control_files(self) -> None:
        """``<state-dir>/control/lose-<node>`` present → node lost; removed → node restored."""
        wanted = {p.name[len("lose-"):] for p in self.control_dir.glob("lose-*")}
        for name, node in self.nodes.items():
            if name in wanted and not node.lost:
                self.lose_node(name)
            elif name not in wanted and node.lost:
                self.restore_node(name)

    # ------------------------------------------------------------------ heartbeats
    def _heartbeat_loop(self) -> None:
        next_lease = next_status = time.monotonic()
        while not self._stopping.wait(1.0):
            try:
                self._apply_control_files()
                now = time.monotonic()
                if now >= next_lease:
                    next_lease = now + self.config.heartbeat_seconds
                    for node in list(self.nodes.values()):
                        if not node.lost:
                            self._renew(node)
                if now >= next_status:
                    next_status = now + self.config.node_status_seconds
                    for node in list(self.nodes.values()):
                        if not node.lost:
                            self.kube.patch(f"/api/v1/nodes/{node.spec.name}/status", {"status": node_status(node.spec)})
            except Exception:
                log.exception("heartbeat failed")

    def _renew(self, node: NodeRuntime) -> None:
        try:
            renew_lease(self.kube, node.node_object, self.config.lease_seconds)
        except ApiException as e:
            if e.status not in (404, 409, 422):
                raise
            node.node_object = register_node(self.kube, node.spec)  # the Node was deleted: register again
            renew_lease(self.kube, node.node_object, self.config.lease_seconds)

    # ------------------------------------------------------------------ host state records
    def _write_record(self, **extra) -> None:
        record = {"pid": os.getpid(), "bridge": self.config.bridge, "nodes": self.config.nodes,
                  "kubeconfig": self.config.kubeconfig, **extra}
        self.record_path.write_text(json.dumps(record))

    def clean_leftovers(self) -> None:
        """Remove what a previous agent with this state dir left after dying hard (SIGKILL): pod network
        namespaces and veths, tmpfs mounts, pod dirs, mount points, its bridge and /etc/hosts block. Also
        used before the state dir is deleted (``python -m rljob_localcluster down``).

        Raises:
            AgentError: a live agent uses the state dir.
        """
        try:
            previous = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            previous = None
        if previous and previous.get("pid") != os.getpid() and pid_running(previous["pid"]):
            raise AgentError(f"another agent (pid {previous['pid']}) uses state dir {self.state_dir}")
        pods = self.state_dir / "pods"
        for record_file in pods.glob("*/sandbox.json"):
            try:
                sandbox = json.loads(record_file.read_text())
            except (OSError, ValueError):
                sandbox = {}
            for point in sandbox.get("tmpfs") or []:
                unmount(point)
            if sandbox.get("netns"):
                PodSandboxNet(sandbox["netns"], sandbox["veth"], "").delete()
        for pod_dir in pods.iterdir() if pods.is_dir() else ():
            shutil.rmtree(pod_dir, ignore_errors=True)
        MountPoints(self.state_dir / "mountpoints.json").cleanup()
        if previous:
            if previous.get("bridge_created"):
                Bridge(previous["bridge"], bridge_address(self.config.cluster_cidr)).delete()
            if self.config.etc_hosts is not None:
                HostsManager(self.config.cluster_domain, self.config.etc_hosts,
                             f"rljob-local-node-agent {self.state_dir}").restore()
        self.record_path.unlink(missing_ok=True)
