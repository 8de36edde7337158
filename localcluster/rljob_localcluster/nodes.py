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

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Self

from . import images as images_mod
from .controlplane import NODE_TIMINGS, ControlPlane
from .images import Image
from .node import configs, dns, host
from .node.cleanup import (
    EGRESS_CHAIN,
    HOST_PATHS,
    ROUTE_SINK,
    NodesError,
    _HostLock,
    _write_state,
    clean_host,
    host_leftovers,
    node_names,
)

__all__ = ["LocalNodes", "NodesError", "clean_host", "host_leftovers", "node_control_plane_options", "node_names"]

GPU = "nvidia.com/gpu"
REQUIRED_HOST_BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "iptables-save",
                          "iptables-restore", "ip", "conntrack")
CNI_BIN_DIR = "/usr/lib/cni"
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
_PR_SET_PDEATHSIG = 1


def node_control_plane_options() -> dict:
    """ControlPlane keyword arguments for a control plane with these nodes: the API server listens on every
    address and advertises the host's default-route address (kubelets, kube-proxy and pods reach it; the
    ``kubernetes`` Service gets real endpoints), plus the short node timings (NODE_TIMINGS)."""
    ip = host.default_route_ip()
    return {"bind_address": "0.0.0.0", "advertise_address": ip, **NODE_TIMINGS}


def default_containerd_cache() -> Path:
    d = os.environ.get("RLJOB_CONTAINERD_DIR")
    return Path(d) if d else Path.home() / ".cache" / "rljob" / "containerd"


def _free_port(addr: str = "127.0.0.1", udp_too: bool = False) -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        if not udp_too:
            return port
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind((addr, port))
            return port
        except OSError:
            continue
    raise NodesError("no free port")


def _set_pdeathsig() -> None:  # in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# ==================================================================================================== LocalNodes
class LocalNodes:
    """Start/stop the local nodes (see the module doc) against a started ``control_plane``.

    Args:
        control_plane: a started ControlPlane whose advertise address is not loopback
            (``ControlPlane(**node_control_plane_options())``).
        state_dir: configs, kubelet/containerd state, pod logs, PV data, logs (``logs/``), ``state.json``
            (pids, recorded sysctls; what :func:`clean_host` needs after a crash). stop() empties it but
            for ``logs/``.
        nodes / gpus_per_node: number of nodes (``rljob-node-0..``) and fake ``nvidia.com/gpu`` each.
        containerd_cache: parent of the per-node containerd roots kept across runs (RLJOB_CONTAINERD_DIR).
        images: images (``rljob_localcluster.images.Image``) to import into every node; None: those of
            index.json (RLJOB_IMAGES_DIR, localcluster/build-images.sh).
        extra_images: more images (e.g. archives a test made).
        start_timeout: seconds for everything to be ready, image imports included.
        log: where progress lines go (default: stderr).
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
            raise ValueError("nodes must be 1..200")
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
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._log_start: dict[str, int] = {}
        self._lock = _HostLock()
        self._started = False

    # ------------------------------------------------------------------ properties
    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pv_root(self) -> Path:
        return self.state_dir / "pv"

    @property
    def dns_ip(self) -> str:
        return configs.DNS_SERVICE_IP

    @property
    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items()}

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

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalNodes:
        if self._started:
            return self
        self._preflight()
        self._lock.acquire(self.state_dir)
        try:
            if (self.state_dir / "state.json").exists():
                self._log(f"cleaning what an earlier run left ({self.state_dir})")
                for line in clean_host(self.state_dir, control_plane=self.cp, log=self._log, locked=True):
                    self._log(f"  {line}")
            self._start()
            self._started = True
        except BaseException:
            keep = os.environ.get("RLJOB_CLUSTER_KEEP_ON_FAILURE") == "1"
            self._stop_processes(graceful=False)
            clean_host(self.state_dir, control_plane=self.cp, log=self._log, locked=True, keep_files=keep)
            self._lock.release()
            raise
        return self

    def stop(self) -> list[str]:
        """Stop the pods (through the API), then every process, then clean the host; returns what was
        removed (one line each)."""
        if not self._started and not self._procs:
            return []
        report: list[str] = []
        t0 = time.monotonic()
        try:
            if self._started:
                report += self._drain()
            self._stop_processes(graceful=True)
            t1 = time.monotonic()
            report += clean_host(self.state_dir, control_plane=self.cp, log=self._log, locked=True)
            report.append(f"stopped in {time.monotonic() - t0:.0f}s (processes {t1 - t0:.0f}s, "
                          f"host clean-up {time.monotonic() - t1:.0f}s)")
        finally:
            self._started = False
            self._lock.release()
        return report

    # ------------------------------------------------------------------ start
    def _preflight(self) -> None:
        problems = []
        if os.geteuid() != 0:
            problems.append("must run as root (cgroups, network, mounts)")
        for b in REQUIRED_HOST_BINARIES:
            if not shutil.which(b):
                problems.append(f"'{b}' not found on PATH")
        for p in CNI_PLUGINS:
            if not os.access(f"{CNI_BIN_DIR}/{p}", os.X_OK):
                problems.append(f"CNI plugin {CNI_BIN_DIR}/{p} missing")
        if not self.cp.bin_dir:
            problems.append("the control plane is not started")
        else:
            for b in ("kubelet", "kube-proxy", "coredns"):
                if not (Path(self.cp.bin_dir) / b).exists():
                    problems.append(f"{b} missing in {self.cp.bin_dir} (run localcluster/build-go-tools.sh)")
        if self.cp.advertise_address in ("127.0.0.1", "::1", "localhost"):
            problems.append("the control plane advertises a loopback address; kubelets and pods cannot use it: "
                            "start it with ControlPlane(**node_control_plane_options())")
        if problems:
            raise NodesError("local nodes cannot start: " + "; ".join(problems)
                             + " (Debian packages: containerd runc containernetworking-plugins iptables conntrack;"
                             " scripts/setup.sh installs them)")

    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        t0 = time.monotonic()
        sd = self.state_dir
        sd.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        self.host_ip = self.cp.advertise_address
        self.containerd_cache.mkdir(parents=True, exist_ok=True)
        st = {
            "version": 1,
            "names": self.names,
            "bin_dir": str(self.cp.bin_dir),
            "host_ip": self.host_ip,
            # recorded before anything changes them; clean_host writes them back
            "sysctls": host.read_sysctls(),
            "host_paths_before": [p for p in HOST_PATHS if os.path.lexists(p)],
            "containerd_roots": [],
            "bridges": [],
            "links": [ROUTE_SINK],
            "pids": {},
        }
        _write_state(sd, st)
        self._st = st

        for name in self.names:
            host.make_cgroup(name)
        self.snapshotter = self._pick_snapshotter()
        # nothing for the Service or pod ranges leaves the host, before any pod or Service rule exists
        host.add_route_sink(ROUTE_SINK, [self.cp.service_cluster_ip_range, configs.CLUSTER_CIDR])
        host.reject_forwarding_out(EGRESS_CHAIN, configs.CLUSTER_CIDR, host.default_route_interface())

        # ---- containerd per node
        self.layouts = []
        for i, name in enumerate(self.names):
            lay = configs.NodeLayout(
                index=i, name=name, dir=sd / name, containerd_root=self.containerd_cache / name,
                host_ip=self.host_ip, kubelet_port=_free_port(self.host_ip), kubelet_healthz_port=_free_port(),
            )
            self.layouts.append(lay)
            st["containerd_roots"].append(str(lay.containerd_root))
            st["bridges"].append(lay.bridge)
            for d in (lay.dir, lay.cni_conf_dir, lay.cni_ipam_dir, lay.kubelet_root, lay.pki, lay.pod_logs,
                      lay.containerd_root, lay.containerd_state, lay.containerd_socket.parent):
                d.mkdir(parents=True, exist_ok=True)
            (lay.cni_conf_dir / "10-rljob.conflist").write_text(json.dumps(configs.cni_conflist(lay), indent=2))
            lay.containerd_config.write_text(configs.containerd_config(lay, snapshotter=self.snapshotter))
            self._spawn(f"containerd-{name}", ["containerd", "--config", str(lay.containerd_config)],
                        marks=[str(lay.containerd_config)])
        _write_state(sd, st)
        for lay in self.layouts:
            self._wait(f"containerd-{lay.name}", "its socket answers", lambda lay=lay: subprocess.run(
                ["ctr", "-a", str(lay.containerd_socket), "version"], capture_output=True, timeout=10,
                check=False).returncode == 0, deadline)
        self._log(f"containerd up on {len(self.layouts)} nodes ({self.snapshotter}) in {time.monotonic() - t0:.1f}s")

        # ---- images (in parallel per node: mostly I/O)
        self._import_images(deadline)
        for lay in self.layouts:
            if configs.PAUSE_IMAGE not in images_mod.present(str(lay.containerd_socket)):
                raise NodesError(f"{lay.name}'s containerd has no sandbox image {configs.PAUSE_IMAGE}, so no pod "
                                 "could start: build the images (localcluster/build-images.sh) or pass its archive")

        # ---- API objects: Nodes with their pod CIDR, DNS RBAC + Service + EndpointSlice
        self.dns_port = _free_port(self.host_ip, udp_too=True)
        self._apply(dns.coredns_objects(self.host_ip, self.dns_port))
        for lay in self.layouts:
            self.cp.kubectl("delete", "node", lay.name, "--ignore-not-found", "--wait=true", timeout=120)
            self._apply({"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": lay.name, "labels": {"kubernetes.io/hostname": lay.name}},
                         "spec": {"podCIDR": lay.pod_cidr, "podCIDRs": [lay.pod_cidr]}}, verb="create")

        # ---- kubelets
        bin_dir = Path(self.cp.bin_dir)
        for lay in self.layouts:
            self.cp.write_kubeconfig(lay.kubeconfig, f"system:node:{lay.name}", ["system:nodes"])
            self.cp.write_serving_cert(lay.pki / "kubelet.crt", lay.pki / "kubelet.key", lay.name,
                                       [lay.name, "localhost"], [self.host_ip, "127.0.0.1"])
            cfg = configs.kubelet_config(lay, ca_file=self.cp.ca_cert_path, tls_cert=str(lay.pki / "kubelet.crt"),
                                         tls_key=str(lay.pki / "kubelet.key"))
            lay.kubelet_config.write_text(json.dumps(cfg, indent=2))
            self._spawn(f"kubelet-{lay.name}", configs.kubelet_args(lay, str(bin_dir / "kubelet")),
                        marks=[str(lay.kubelet_config)])

        # ---- host-wide: kube-proxy, CoreDNS, node controller
        kp_dir = sd / "kube-proxy"
        kp_dir.mkdir(exist_ok=True)
        kp_kc = self.cp.write_kubeconfig(kp_dir / "kubeconfig", "system:kube-proxy")
        (kp_dir / "config.yaml").write_text(json.dumps(configs.kube_proxy_config(
            kubeconfig=kp_kc, hostname=self.names[0], node_ip=self.host_ip, healthz_port=_free_port(),
            metrics_port=_free_port()),
            indent=2))
        self._spawn("kube-proxy", [str(bin_dir / "kube-proxy"), f"--config={kp_dir / 'config.yaml'}", "--v=1"],
                    marks=[str(kp_dir / "config.yaml")])
        dns_dir = sd / "coredns"
        dns_dir.mkdir(exist_ok=True)
        dns_kc = self.cp.write_kubeconfig(dns_dir / "kubeconfig", dns.COREDNS_USER)
        ready_port = _free_port()
        (dns_dir / "Corefile").write_text(configs.corefile(
            bind_ip=self.host_ip, port=self.dns_port, health_port=_free_port(), ready_port=ready_port,
            kubeconfig=dns_kc))
        self._spawn("coredns", [str(bin_dir / "coredns"), "-conf", str(dns_dir / "Corefile")],
                    marks=[str(dns_dir / "Corefile")])
        ctl = [sys.executable, "-m", "rljob_localcluster.node.controller", "--kubeconfig", self.cp.kubeconfig,
               "--pv-root", str(self.pv_root), "--gpus-per-node", str(self.gpus_per_node)]
        for n in self.names:
            ctl += ["--node", n]
        self._spawn("node-controller", ctl, marks=["rljob_localcluster.node.controller", str(self.pv_root)])

        # ---- ready?
        self._wait("coredns", "/ready", lambda: _http_ok(f"http://127.0.0.1:{ready_port}/ready"), deadline)
        for lay in self.layouts:
            self._wait(f"kubelet-{lay.name}", f"node {lay.name} Ready with {self.gpus_per_node} {GPU}",
                       lambda lay=lay: self._node_ready(lay.name), deadline)
        ctl_log, ctl_from = self.log_dir / "node-controller.log", self._log_start["node-controller"]
        self._wait("node-controller", "controller ready",
                   lambda: b"controller ready" in ctl_log.read_bytes()[ctl_from:], deadline)
        self._wait("kube-proxy", "kubernetes.default resolves through 10.96.0.10",
                   lambda: bool(dns.query_a(f"kubernetes.default.svc.{configs.CLUSTER_DOMAIN}", self.dns_ip)),
                   deadline)
        self._log(f"{self.count} nodes Ready with {self.gpus_per_node} {GPU} each, DNS at {self.dns_ip}, "
                  f"provisioner up ({time.monotonic() - t0:.1f}s)")

    def _pick_snapshotter(self) -> str:
        """overlayfs when the containerd cache's filesystem takes an overlay mount, else native."""
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        with tempfile.TemporaryDirectory(dir=self.containerd_cache, prefix=".overlay-check-") as t:
            for d in ("lower", "upper", "work", "merged"):
                os.mkdir(os.path.join(t, d))
            opts = f"lowerdir={t}/lower,upperdir={t}/upper,workdir={t}/work".encode()
            if libc.mount(b"overlay", f"{t}/merged".encode(), b"overlay", 0, opts) == 0:
                libc.umount2(f"{t}/merged".encode(), 2)
                return "overlayfs"
        self._log("overlay mounts do not work under the containerd cache; using the native snapshotter")
        return "native"

    def _import_images(self, deadline: float) -> None:
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
        if self.snapshotter != "overlayfs":
            os.environ["CONTAINERD_SNAPSHOTTER"] = self.snapshotter  # what `ctr images import` unpacks for
        errors: list[str] = []
        t0 = time.monotonic()

        def one(lay: configs.NodeLayout) -> None:
            try:
                done = images_mod.import_into(str(lay.containerd_socket), archives,
                                              timeout=max(60.0, deadline - time.monotonic()),
                                              log=lambda m: self._log(f"{lay.name}: {m}"))
                if done:
                    self._log(f"{lay.name}: imported {len(done)} image(s) in {time.monotonic() - t0:.0f}s")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{lay.name}: {e}")

        threads = [threading.Thread(target=one, args=(lay,), daemon=True) for lay in self.layouts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            errors.append("image import timed out")
        if errors:
            raise NodesError("image import failed: " + "; ".join(errors))

    def import_images(self, archives: Iterable[Image]) -> None:
        """Import more images into every node (skipped where the same manifest digest is already there)."""
        archives = list(archives)
        for lay in self.layouts:
            images_mod.import_into(str(lay.containerd_socket), archives,
                                   log=lambda m, lay=lay: self._log(f"{lay.name}: {m}"))

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

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, cmd: list[str], marks: list[str]) -> None:
        log_path = self.log_dir / f"{name}.log"
        f = open(log_path, "ab")  # noqa: SIM115 - open while the process runs
        self._log_start[name] = f.tell()
        f.write(("+ " + " ".join(cmd) + "\n").encode())
        f.flush()
        env = dict(os.environ)
        if name == "node-controller":
            pkg_root = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        on_main = threading.current_thread() is threading.main_thread()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, cwd=self.state_dir,
                                start_new_session=True, env=env, preexec_fn=_set_pdeathsig if on_main else None)  # noqa: PLW1509
        self._procs[name] = proc
        self._logs[name] = f
        self._st["pids"][name] = {"pid": proc.pid, "marks": marks}
        _write_state(self.state_dir, self._st)

    def _wait(self, name: str, what: str, probe: Callable[[], bool], deadline: float) -> None:
        last: Exception | None = None
        while time.monotonic() < deadline:
            for n, p in self._procs.items():
                if p.poll() is not None:
                    raise NodesError(f"{n} exited with code {p.returncode} while waiting for {name} ({what}); "
                                     f"log {self.log_dir / (n + '.log')}:\n{_tail(self.log_dir / (n + '.log'))}")
            try:
                if probe():
                    return
            except Exception as e:  # noqa: BLE001 - keep polling; report the last error
                last = e
            time.sleep(0.5)
        raise NodesError(f"timed out waiting for {name} ({what}); last error {last!r}; log "
                         f"{self.log_dir / (name + '.log')}:\n{_tail(self.log_dir / (name + '.log'))}")

    def dead(self) -> dict[str, int]:
        """{name: exit code} of the processes that have exited."""
        return {n: p.returncode for n, p in self._procs.items() if p.poll() is not None}

    def _stop_processes(self, graceful: bool) -> None:
        """End exactly the processes start() launched: the controller, CoreDNS, kube-proxy and the kubelets
        first (SIGTERM, SIGKILL after 20 s), then containers the kubelets left, then containerd."""
        order = ["node-controller", "coredns", "kube-proxy", *[f"kubelet-{n}" for n in self.names]]
        first = [(self._procs[n]) for n in order if n in self._procs]
        self._term(first, 20 if graceful else 5)
        for lay in self.layouts:
            if f"containerd-{lay.name}" in self._procs and self._procs[f"containerd-{lay.name}"].poll() is None:
                _kill_tasks(lay.containerd_socket)
        self._term([p for n, p in self._procs.items() if n.startswith("containerd-")], 20)
        for f in self._logs.values():
            f.close()
        self._procs.clear()
        self._logs.clear()

    @staticmethod
    def _term(procs: list[subprocess.Popen], timeout: float) -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _drain(self) -> list[str]:
        """Cordon the nodes and delete their pods through the API (kubelet kills the containers with the pods'
        grace period, at most 5 s); force-delete what is left after 40 s."""
        report = []
        try:
            for n in self.names:
                self.cp.kubectl("patch", "node", n, "-p", '{"spec":{"unschedulable":true}}', check=False)

            def pods() -> list[str]:
                out = []
                for n in self.names:
                    r = self.cp.kubectl("get", "pods", "-A", "--field-selector", f"spec.nodeName={n}", "-o",
                                        "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}{\"\\n\"}{end}",
                                        check=False)
                    out += [ln for ln in r.stdout.splitlines() if ln.strip()]
                return out

            left = pods()
            t0 = time.monotonic()
            if left:
                n_pods = len(left)
                for n in self.names:
                    self.cp.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={n}",
                                    "--grace-period=5", "--wait=false", check=False, timeout=120)
                end = time.monotonic() + 40
                while left and time.monotonic() < end:
                    time.sleep(1)
                    left = pods()
                report.append(f"deleted {n_pods} pods through the API in {time.monotonic() - t0:.0f}s; "
                              f"{len(left)} left for the kill")
                for n in self.names:
                    if left:
                        self.cp.kubectl("delete", "pods", "-A", "--field-selector", f"spec.nodeName={n}",
                                        "--force", "--grace-period=0", "--wait=false", check=False, timeout=120)
        except Exception as e:  # noqa: BLE001 - the API may be gone; clean_host kills what is left
            report.append(f"pods not deleted through the API ({e}); killed instead")
        return report


def _http_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback health endpoint
        return r.status == 200


def _kill_tasks(sock: Path) -> None:
    """SIGKILL and delete every task of a node's containerd (containers kubelet did not stop)."""
    def ctr(*a: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "-a", str(sock), "-n", "k8s.io", *a], capture_output=True, text=True,
                              timeout=timeout, check=False)
    try:
        ids = [ln.split()[0] for ln in ctr("tasks", "ls").stdout.splitlines()[1:] if ln.strip()]
        for i in ids:
            ctr("tasks", "kill", "-s", "SIGKILL", i)
        for i in ids:
            ctr("tasks", "delete", "-f", i)
    except (OSError, subprocess.TimeoutExpired):
        pass
