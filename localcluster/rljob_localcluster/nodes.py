"""Real nodes for the local cluster: upstream kubelet + containerd + runc + CNI plugins, on this host.

    from rljob_localcluster import ControlPlane
    from rljob_localcluster.nodes import LocalNodes, node_control_plane_options
    with ControlPlane(**node_control_plane_options()) as cp, LocalNodes(cp, "/tmp/nodes") as nodes:
        cp.kubectl("get", "nodes", "-o", "wide")      # rljob-node-0, rljob-node-1: Ready, 4 nvidia.com/gpu each

Everything runs in the host's network namespace, as root:

- per node ``rljob-node-<i>``: a containerd (own root, state, socket, config; CRI plugin with its own CNI
  conf dir) and a kubelet (own root dir, port, cgroup root ``/rljob-node-<i>``, pod logs dir, serving
  cert signed by the cluster CA; client cert ``system:node:<name>`` in ``system:nodes``). CNI: bridge
  ``rljob-cni<i>`` with gateway 10.244.<i>.1 and host-local IPAM on 10.244.<i>.0/24, plus portmap; the
  Node object is created beforehand with that ``spec.podCIDR`` (kube-controller-manager's node IPAM stays
  on and records it);
- once per host: kube-proxy (iptables), CoreDNS (at the kube-dns ClusterIP 10.96.0.10 through a
  selector-less Service whose EndpointSlice points at the host address) and the node controller
  (``node/controller.py``: the default StorageClass's hostPath provisioner and the fake
  ``nvidia.com/gpu`` capacity);
- images: the archives of ``${RLJOB_IMAGES_DIR:-~/.cache/rljob/images}/index.json`` are imported into each
  node's containerd (``rljob_localcluster.images.import_into``: skipped when the node already has that
  manifest digest). Each node keeps its containerd root in ``${RLJOB_CONTAINERD_DIR:-~/.cache/rljob/
  containerd}/<node>`` across start/stop, so unpacked images survive (two containerd daemons cannot share
  one content store: each one's garbage collector deletes blobs its own metadata does not know).

stop() (and :func:`clean_host` after a crash) stops the pods first (through the API, so kubelet kills them),
then the processes it started (by pid), and removes what they left on the host: see :func:`clean_host`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Self

from . import images as images_mod
from . import statefile
from .controlplane import NODE_TIMINGS, ControlPlane
from .images import Image
from .node import checks, configs, dns, host
from .node.cleanup import (
    EGRESS_CHAIN,
    HOST_PATHS,
    ROUTE_SINK,
    STATE_FILE,
    NodesError,
    _HostLock,
    clean_host,
    host_leftovers,
    node_names,
)
from .node.checks import CNI_PLUGINS, REQUIRED_HOST_BINARIES
from .node.configs import GPU
from .node.processes import PortClash, Processes, drain, kill_tasks
from .pids import free_port

__all__ = ["CNI_PLUGINS", "REQUIRED_HOST_BINARIES", "LocalNodes", "NodesError", "clean_host", "host_leftovers",
           "node_control_plane_options", "node_names"]


def node_control_plane_options() -> dict:
    """ControlPlane keyword arguments for a control plane with these nodes: the API server listens on every
    address and advertises the host's default-route address (kubelets, kube-proxy and pods reach it; the
    ``kubernetes`` Service gets real endpoints), plus the short node timings (NODE_TIMINGS). Raises
    RuntimeError when the host has no IPv4 default route (or its interface no IPv4 address)."""
    ip = host.default_route_ip()
    return {"bind_address": "0.0.0.0", "advertise_address": ip, **NODE_TIMINGS}


def default_containerd_cache() -> Path:
    """Parent of the nodes' containerd roots: ``$RLJOB_CONTAINERD_DIR``, default ~/.cache/rljob/containerd."""
    d = os.environ.get("RLJOB_CONTAINERD_DIR")
    return Path(d) if d else Path.home() / ".cache" / "rljob" / "containerd"


def _http_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback health endpoint
        return r.status == 200


# ==================================================================================================== LocalNodes
class LocalNodes:
    """Start/stop the local nodes (see the module doc) against a started ``control_plane``.

    Args:
        control_plane: a started ControlPlane whose advertise address is not loopback
            (``ControlPlane(**node_control_plane_options())``).
        state_dir: configs, kubelet/containerd state, pod logs, PV data, logs (``logs/``), ``state.json``
            (pids, recorded sysctls and iptables chains; what :func:`clean_host` needs after a crash). stop()
            empties it but for ``logs/``.
        nodes / gpus_per_node: number of nodes (``rljob-node-0..``) and fake ``nvidia.com/gpu`` each.
        containerd_cache: parent of the per-node containerd roots kept across runs (RLJOB_CONTAINERD_DIR).
        images: images (``rljob_localcluster.images.Image``) to import into every node; None: those of
            index.json (RLJOB_IMAGES_DIR, localcluster/build-images.sh).
        extra_images: more images (e.g. archives a test made).
        start_timeout: seconds for everything to be ready, image imports included.
        log: where progress lines go (default: stderr).

    Raises:
        ValueError: ``nodes`` is not 1..200.
    """

    def __init__(
        self,
        control_plane: ControlPlane,
        state_dir: str | os.PathLike,
        *,
        nodes: int = 2,
        gpus_per_node: int = 4,
        containerd_cache: str | os.PathLike | None = None,
        images: Sequence[Image] | None = None,
        extra_images: Sequence[Image] = (),
        start_timeout: float = 900.0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes must be 1..200, got {nodes}")
        if gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0 (fake nvidia.com/gpu per node), got {gpus_per_node}")
        self.cp = control_plane
        self.state_dir = Path(state_dir).resolve()
        self.count = nodes
        self.gpus_per_node = gpus_per_node
        self.containerd_cache = Path(containerd_cache or default_containerd_cache()).resolve()
        self._images = images
        self.extra_images = list(extra_images)
        self.start_timeout = start_timeout
        self._log = log or (lambda m: print(f"[local-nodes] {m}", file=sys.stderr, flush=True))
        self.names = node_names(nodes)
        self.host_ip = ""
        self.snapshotter = "overlayfs"
        self.layouts: list[configs.NodeLayout] = []
        self.dns_port = 0
        self._st: dict = {}
        self._processes = Processes(self.log_dir, self.state_dir, self._record_pid)
        self._lock = _HostLock()
        self._started = False

    # ------------------------------------------------------------------ properties
    @property
    def log_dir(self) -> Path:
        """``<state_dir>/logs``: one log per process (kept by stop())."""
        return self.state_dir / "logs"

    @property
    def pv_root(self) -> Path:
        """``<state_dir>/pv``: the provisioned volumes' directories."""
        return self.state_dir / "pv"

    @property
    def dns_ip(self) -> str:
        """The cluster DNS address pods use (the kube-dns ClusterIP, 10.96.0.10)."""
        return configs.DNS_SERVICE_IP

    @property
    def pids(self) -> dict[str, int]:
        """{process name: pid} of what start() launched: ``containerd-<node>``, ``kubelet-<node>``,
        ``kube-proxy``, ``coredns``, ``node-controller``."""
        return self._processes.pids

    def socket(self, node: str) -> Path:
        """The containerd socket of ``node`` (for ``ctr -a``)."""
        return self.layouts[self.names.index(node)].containerd_socket

    def state(self) -> dict:
        """JSON-able summary (for the CLI's status)."""
        return {
            "nodes": {n.name: {"pod_cidr": n.pod_cidr, "bridge": n.bridge, "kubelet_port": n.kubelet_port,
                               "containerd_socket": str(n.containerd_socket), "containerd_root": str(n.containerd_root),
                               "cgroup_root": n.cgroup_root} for n in self.layouts},
            "host_ip": self.host_ip,
            "dns": f"{self.dns_ip}:53 -> {self.host_ip}:{self.dns_port}",
            "snapshotter": self.snapshotter,
            "state_dir": str(self.state_dir),
            "pids": self.pids,
        }

    def dead(self) -> dict[str, int]:
        """{name: exit code} of the processes that have exited."""
        return self._processes.dead()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalNodes:
        """Start the nodes and wait until each is Ready with its GPUs, DNS answers and the provisioner runs
        (``start_timeout`` seconds in all). First cleans what an earlier run of this state dir left (from its
        state.json). A process that loses its port to another program between choice and bind makes it start
        again once. On failure everything started is stopped and cleaned (the files are kept with
        RLJOB_CLUSTER_KEEP_ON_FAILURE=1).

        Raises:
            NodesError: a requirement is missing (root, binaries, CNI plugins, the Go tools, a non-loopback
                advertise address); local nodes already run on this host; the host is in use by another
                kube-proxy/kubelet (KUBE-* chains) or routes the Service or pod range elsewhere; an earlier
                run's leftovers could not all be removed; a process exited or a step timed out.
        """
        if self._started:
            return self
        self._preflight()
        self._lock.acquire(self.state_dir)
        try:
            self._clean_earlier_run()
            self._check_host_is_free()
        except BaseException:
            self._lock.release()
            raise
        for attempt in (1, 2):
            try:
                self._start()
                self._started = True
                return self
            except BaseException as e:
                retry = isinstance(e, PortClash) and attempt == 1
                keep = not retry and os.environ.get("RLJOB_CLUSTER_KEEP_ON_FAILURE") == "1"
                cleaned = False
                try:
                    self._stop_processes(graceful=False)
                    clean_host(self.state_dir, control_plane=self.cp, log=self._log, locked=True, keep_files=keep)
                    cleaned = True
                finally:
                    if not (retry and cleaned):
                        self._lock.release()
                if not retry:
                    raise
                self._log(f"{e.args[0].splitlines()[0]}: starting again with other ports")
        return self

    def stop(self) -> list[str]:
        """Stop the pods (through the API), then every process, then clean the host; returns what was
        removed (one line each). Raises nothing of its own; an error of clean_host propagates after the host
        lock was released."""
        if not self._started and not self._processes.procs:
            return []
        report: list[str] = []
        t0 = time.monotonic()
        try:
            if self._started:
                report += drain(self.cp, self.names)
            self._stop_processes(graceful=True)
            t1 = time.monotonic()
            report += clean_host(self.state_dir, control_plane=self.cp, log=self._log, locked=True)
            report.append(f"stopped in {time.monotonic() - t0:.0f}s (processes {t1 - t0:.0f}s, "
                          f"host clean-up {time.monotonic() - t1:.0f}s)")
        finally:
            self._started = False
            self._lock.release()
        return report

    def import_images(self, archives: Iterable[Image]) -> None:
        """Import more images into every node (skipped where the same manifest digest is already there).
        Raises RuntimeError naming the image and node that failed."""
        archives = list(archives)
        for lay in self.layouts:
            images_mod.import_into(str(lay.containerd_socket), archives, snapshotter=self.snapshotter,
                                   log=lambda m, lay=lay: self._log(f"{lay.name}: {m}"))

    # ------------------------------------------------------------------ node faults (for tests)
    def stop_node(self, name: str, *, containers: bool) -> None:
        """Make node ``name`` stop reporting, as a fault from outside: its kubelet is SIGKILLed (it reports
        nothing more, its lease lapses and the node goes NotReady/Unknown). ``containers=True``, a node shut down:
        every container of the node is SIGKILLed too and its containerd stopped. ``containers=False``, a node
        partitioned from the control plane: its containers go on running under containerd (they still reach
        Services on this host). :meth:`start_node` brings the node back.

        Raises:
            KeyError: ``name`` is not a running node of this set.
        """
        lay = self.layouts[self.names.index(name)]
        self._processes.end(f"kubelet-{name}")
        if containers:
            kill_tasks(lay.containerd_socket)
            self._processes.end(f"containerd-{name}", signal.SIGTERM)
        self._log(f"{name}: kubelet stopped" + (", containers killed, containerd stopped" if containers else
                                                 "; its containers keep running"))

    def start_node(self, name: str, timeout: float = 180.0) -> None:
        """Start what :meth:`stop_node` stopped on node ``name`` (its containerd if stopped, then its kubelet, with
        the same configs and state) and wait until the node is Ready with its GPUs. The kubelet then kills the
        containers of pods the API no longer has (pods force-deleted meanwhile).

        Raises:
            KeyError: ``name`` is not a node of this set; NodesError: it was not Ready within ``timeout`` seconds.
        """
        lay = self.layouts[self.names.index(name)]
        deadline = time.monotonic() + timeout
        if f"containerd-{name}" not in self._processes.procs:
            self._processes.spawn(f"containerd-{name}", ["containerd", "--config", str(lay.containerd_config)],
                                  marks=[str(lay.containerd_config)])
            self._processes.wait(f"containerd-{name}", "its socket answers", lambda: subprocess.run(
                ["ctr", "-a", str(lay.containerd_socket), "version"], capture_output=True, timeout=10,
                check=False).returncode == 0, deadline)
        if f"kubelet-{name}" not in self._processes.procs:
            self._processes.spawn(f"kubelet-{name}", configs.kubelet_args(lay, str(Path(self.cp.bin_dir) / "kubelet")),
                                  marks=[str(lay.kubelet_config)])
        self._processes.wait(f"kubelet-{name}", f"node {name} Ready with {self.gpus_per_node} {GPU}",
                             lambda: self._node_ready(name), deadline)
        self._log(f"{name}: back, Ready")

    # ------------------------------------------------------------------ checks
    def _preflight(self) -> None:
        if problems := checks.missing_requirements(self.cp):
            raise NodesError("local nodes cannot start: " + "; ".join(problems)
                             + " (Debian packages: containerd runc containernetworking-plugins iptables conntrack;"
                             " scripts/setup.sh installs them)")

    def _clean_earlier_run(self) -> None:
        """clean_host for what an earlier run of this state dir left; refuses to go on while some of it is
        left (its state.json is then kept for another try)."""
        if not (self.state_dir / STATE_FILE).exists():
            return
        self._log(f"cleaning what an earlier run left ({self.state_dir})")
        lines = clean_host(self.state_dir, control_plane=self.cp, log=lambda m: self._log(f"  {m}"), locked=True)
        if warnings := [ln for ln in lines if ln.startswith("WARNING")]:
            raise NodesError(f"an earlier run of {self.state_dir} left what could not be removed: "
                             f"{'; '.join(warnings)}; fix that, then 'python -m rljob_localcluster down' "
                             "(or clean_host) again")

    def _check_host_is_free(self) -> None:
        if problems := checks.host_conflicts([self.cp.service_cluster_ip_range, configs.CLUSTER_CIDR]):
            raise NodesError("local nodes cannot start on this host: " + "; ".join(problems)
                             + " ('python -m rljob_localcluster down' removes what local nodes left)")

    # ------------------------------------------------------------------ start
    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        t0 = time.monotonic()
        self._record_host_state()
        self._prepare_host()
        self._start_containerds(deadline)
        self._log(f"containerd up on {len(self.layouts)} nodes ({self.snapshotter}) in {time.monotonic() - t0:.1f}s")
        self._import_images(deadline)
        for lay in self.layouts:
            if configs.PAUSE_IMAGE not in images_mod.present(str(lay.containerd_socket)):
                raise NodesError(f"{lay.name}'s containerd has no sandbox image {configs.PAUSE_IMAGE}, so no pod "
                                 "could start: build the images (localcluster/build-images.sh) or pass its archive")
        self._register_nodes()
        self._start_kubelets()
        ready_port = self._start_host_services()
        self._wait_ready(ready_port, deadline)
        self._log(f"{self.count} nodes Ready with {self.gpus_per_node} {GPU} each, DNS at {self.dns_ip}, "
                  f"provisioner up ({time.monotonic() - t0:.1f}s)")

    def _record_host_state(self) -> None:
        """state.json before anything changes: what clean_host must write back or leave alone."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        self.host_ip = self.cp.advertise_address
        self._st = {
            "version": 1,
            "names": self.names,
            "bin_dir": str(self.cp.bin_dir),
            "host_ip": self.host_ip,
            "sysctls": host.read_sysctls(),
            "host_paths_before": [p for p in HOST_PATHS if os.path.lexists(p)],
            "chains_before": host.iptables_chains(),  # CNI-* of other software (podman); kept by clean_host
            "containerd_roots": [],
            "bridges": [],
            "links": [ROUTE_SINK],
            "pids": {},
        }
        statefile.write(self.state_dir / STATE_FILE, self._st)

    def _record_pid(self, name: str, pid: int, marks: list[str]) -> None:
        self._st["pids"][name] = {"pid": pid, "marks": marks}
        statefile.write(self.state_dir / STATE_FILE, self._st)

    def _prepare_host(self) -> None:
        """The nodes' cgroups, the snapshotter choice, and (before any pod or Service rule exists) the route sink
        and the egress REJECT, so that nothing for the Service or pod ranges leaves the host."""
        self.containerd_cache.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            host.make_cgroup(name)
        self.snapshotter = "overlayfs" if host.overlay_mount_works(self.containerd_cache) else "native"
        if self.snapshotter == "native":
            self._log("overlay mounts do not work under the containerd cache; using the native snapshotter")
        host.add_route_sink(ROUTE_SINK, [self.cp.service_cluster_ip_range, configs.CLUSTER_CIDR])
        host.reject_forwarding_out(EGRESS_CHAIN, configs.CLUSTER_CIDR, host.default_route_interface())

    def _start_containerds(self, deadline: float) -> None:
        self.layouts = []
        for i, name in enumerate(self.names):
            lay = configs.NodeLayout(
                index=i, name=name, dir=self.state_dir / name, containerd_root=self.containerd_cache / name,
                host_ip=self.host_ip, kubelet_port=free_port(self.host_ip), kubelet_healthz_port=free_port(),
            )
            self.layouts.append(lay)
            self._st["containerd_roots"].append(str(lay.containerd_root))
            self._st["bridges"].append(lay.bridge)
            for d in (lay.dir, lay.cni_conf_dir, lay.cni_ipam_dir, lay.kubelet_root, lay.pki, lay.pod_logs,
                      lay.containerd_root, lay.containerd_state, lay.containerd_socket.parent):
                d.mkdir(parents=True, exist_ok=True)
            (lay.cni_conf_dir / "10-rljob.conflist").write_text(json.dumps(configs.cni_conflist(lay), indent=2))
            lay.containerd_config.write_text(configs.containerd_config(lay, snapshotter=self.snapshotter))
            self._processes.spawn(f"containerd-{name}", ["containerd", "--config", str(lay.containerd_config)],
                                  marks=[str(lay.containerd_config)])
        for lay in self.layouts:
            self._processes.wait(f"containerd-{lay.name}", "its socket answers", lambda lay=lay: subprocess.run(
                ["ctr", "-a", str(lay.containerd_socket), "version"], capture_output=True, timeout=10,
                check=False).returncode == 0, deadline)

    def _import_images(self, deadline: float) -> None:
        """The images into every node, in parallel per node (mostly I/O); every ctr ends by ``deadline``."""
        archives = list(self._images or [])
        if self._images is None:
            if images_mod.index_path().exists():
                try:
                    archives = images_mod.load_index()
                except FileNotFoundError as e:
                    raise NodesError(str(e)) from None
            else:
                self._log(f"no image index ({images_mod.index_path()}; localcluster/build-images.sh makes it): "
                          "no images imported")
        archives += self.extra_images
        if not archives:
            return
        errors: list[str] = []
        t0 = time.monotonic()

        def one(lay: configs.NodeLayout) -> None:
            try:
                done = images_mod.import_into(str(lay.containerd_socket), archives, snapshotter=self.snapshotter,
                                              timeout=deadline - time.monotonic(),
                                              log=lambda m: self._log(f"{lay.name}: {m}"))
                if done:
                    self._log(f"{lay.name}: imported {len(done)} image(s) in {time.monotonic() - t0:.0f}s")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{lay.name}: {e}")

        threads = [threading.Thread(target=one, args=(lay,), daemon=True) for lay in self.layouts]
        for t in threads:
            t.start()
        for t in threads:  # a ctr past the deadline is killed: allow for that and the thread's end
            t.join(max(0.0, deadline - time.monotonic()) + 15)
        if any(t.is_alive() for t in threads):
            errors.append("image import did not end after its timeout")
        if errors:
            raise NodesError("image import failed: " + "; ".join(errors))

    def _register_nodes(self) -> None:
        """DNS RBAC, Service and EndpointSlice; each Node object created anew with its pod CIDR."""
        self.dns_port = free_port(self.host_ip, udp_too=True)
        self._apply(dns.coredns_objects(self.host_ip, self.dns_port))
        for lay in self.layouts:
            self.cp.kubectl("delete", "node", lay.name, "--ignore-not-found", "--wait=true", timeout=120)
            self._apply({"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": lay.name, "labels": {"kubernetes.io/hostname": lay.name}},
                         "spec": {"podCIDR": lay.pod_cidr, "podCIDRs": [lay.pod_cidr]}}, verb="create")

    def _start_kubelets(self) -> None:
        kubelet = str(Path(self.cp.bin_dir) / "kubelet")
        for lay in self.layouts:
            self.cp.write_kubeconfig(lay.kubeconfig, f"system:node:{lay.name}", ["system:nodes"])
            self.cp.write_serving_cert(lay.pki / "kubelet.crt", lay.pki / "kubelet.key", lay.name,
                                       [lay.name, "localhost"], [self.host_ip, "127.0.0.1"])
            cfg = configs.kubelet_config(lay, ca_file=self.cp.ca_cert_path, tls_cert=str(lay.pki / "kubelet.crt"),
                                         tls_key=str(lay.pki / "kubelet.key"))
            lay.kubelet_config.write_text(json.dumps(cfg, indent=2))
            self._processes.spawn(f"kubelet-{lay.name}", configs.kubelet_args(lay, kubelet),
                                  marks=[str(lay.kubelet_config)])

    def _start_host_services(self) -> int:
        """kube-proxy, CoreDNS and the node controller (one each for the host); returns CoreDNS's ready port."""
        bin_dir, sd = Path(self.cp.bin_dir), self.state_dir
        kp_dir = sd / "kube-proxy"
        kp_dir.mkdir(exist_ok=True)
        kp_kc = self.cp.write_kubeconfig(kp_dir / "kubeconfig", "system:kube-proxy")
        (kp_dir / "config.yaml").write_text(json.dumps(configs.kube_proxy_config(
            kubeconfig=kp_kc, hostname=self.names[0], node_ip=self.host_ip, healthz_port=free_port(),
            metrics_port=free_port()), indent=2))
        self._processes.spawn("kube-proxy", [str(bin_dir / "kube-proxy"), f"--config={kp_dir / 'config.yaml'}",
                                             "--v=1"], marks=[str(kp_dir / "config.yaml")])
        dns_dir = sd / "coredns"
        dns_dir.mkdir(exist_ok=True)
        dns_kc = self.cp.write_kubeconfig(dns_dir / "kubeconfig", dns.COREDNS_USER)
        ready_port = free_port()
        (dns_dir / "Corefile").write_text(configs.corefile(
            bind_ip=self.host_ip, port=self.dns_port, health_port=free_port(), ready_port=ready_port,
            kubeconfig=dns_kc))
        self._processes.spawn("coredns", [str(bin_dir / "coredns"), "-conf", str(dns_dir / "Corefile")],
                              marks=[str(dns_dir / "Corefile")])
        ctl = [sys.executable, "-m", "rljob_localcluster.node.controller", "--kubeconfig", self.cp.kubeconfig,
               "--pv-root", str(self.pv_root), "--gpus-per-node", str(self.gpus_per_node)]
        for n in self.names:
            ctl += ["--node", n]
        env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._processes.spawn("node-controller", ctl, marks=["rljob_localcluster.node.controller", str(self.pv_root)],
                              env=env)
        return ready_port

    def _wait_ready(self, ready_port: int, deadline: float) -> None:
        wait = self._processes.wait
        wait("coredns", "/ready", lambda: _http_ok(f"http://127.0.0.1:{ready_port}/ready"), deadline)
        for lay in self.layouts:
            wait(f"kubelet-{lay.name}", f"node {lay.name} Ready with {self.gpus_per_node} {GPU}",
                 lambda lay=lay: self._node_ready(lay.name), deadline)
        wait("node-controller", "controller ready",
             lambda: b"controller ready" in self._processes.log_since_start("node-controller"), deadline)
        wait("kube-proxy", "kubernetes.default resolves through 10.96.0.10",
             lambda: bool(dns.query_a(f"kubernetes.default.svc.{configs.CLUSTER_DOMAIN}", self.dns_ip)), deadline)

    def _apply(self, obj: dict, verb: str = "apply") -> None:
        args = ["apply", "--server-side", "--force-conflicts", "--field-manager=rljob-local-nodes", "-f", "-"] \
            if verb == "apply" else [verb, "-f", "-"]
        r = self.cp.kubectl(*args, input=json.dumps(obj), timeout=120, check=False)
        if r.returncode != 0:
            raise NodesError(f"kubectl {' '.join(args)} failed: {r.stderr.strip()}")

    def _node_ready(self, name: str) -> bool:
        status, body = self.cp.api_get(f"/api/v1/nodes/{name}")
        if status != 200:
            return False
        node = json.loads(body)
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))
        return ready and str(node["status"].get("capacity", {}).get(GPU)) == str(self.gpus_per_node)

    # ------------------------------------------------------------------ stop
    def _stop_processes(self, graceful: bool) -> None:
        """End exactly the processes start() launched: the controller, CoreDNS, kube-proxy and the kubelets
        first (SIGTERM, SIGKILL after 20 s), then containers the kubelets left, then containerd."""
        first = ["node-controller", "coredns", "kube-proxy", *[f"kubelet-{n}" for n in self.names]]
        self._processes.stop(first, {f"containerd-{lay.name}": lay.containerd_socket for lay in self.layouts},
                             graceful)
