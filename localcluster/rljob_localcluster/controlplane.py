"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler — started the way controller-runtime's envtest starts them, plus the two
controllers-side components envtest leaves out (the garbage collector, the service-account and
node lifecycle controllers live in kube-controller-manager; pods need the scheduler).

    with ControlPlane() as cp:
        subprocess.run(["kubectl", "--kubeconfig", cp.kubeconfig, "get", "ns"])

Security set-up (as a kubeadm cluster, scaled down):
- one generated CA signs the API server's serving cert and every client cert; admin is a client
  cert in group ``system:masters``; kube-controller-manager and kube-scheduler use their own
  identities (``system:kube-controller-manager`` / ``system:kube-scheduler``) so the bootstrap RBAC
  roles apply, and the controller manager runs each controller under its own service account;
- authorization ``Node,RBAC``; the default admission plugins (ServiceAccount, NamespaceLifecycle,
  PodSecurity, ...) stay on;
- service-account issuer + RSA signing key (TokenRequest works; the controller manager gets the
  private key and the CA for the legacy token controller and ``kube-root-ca.crt`` ConfigMaps).

stop() terminates exactly the processes start() launched (by pid), also when start() fails, and
removes the data dir.
"""

from __future__ import annotations

import atexit
import base64
import http.client
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

from .pids import free_port, set_pdeathsig
from .pki import CertificateAuthority, KeyPair, service_account_keypair
from .tools import tools_bin_dir

__all__ = ["NODE_TIMINGS", "ControlPlane", "ControlPlaneError"]

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "rljob-admin"

#: Short node timings for a cluster with real kubelets (``ControlPlane(**NODE_TIMINGS)``): a node
#: that stops renewing its lease is Ready=Unknown after 16 s, and its pods are evicted 10 s later. The
#: kubelets renew every 4 s (nodeLeaseDurationSeconds 16, see rljob_localcluster.nodes).
NODE_TIMINGS: dict = {
    "node_monitor_grace_period": "16s",
    "node_monitor_period": "2s",
    "default_not_ready_toleration_seconds": 10,
    "default_unreachable_toleration_seconds": 10,
}


class ControlPlaneError(RuntimeError):
    """start() failed; the message carries the tail of the failing component's log."""


class _PortClash(ControlPlaneError):
    pass


@dataclass
class _Component:
    name: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes] = field(repr=False)

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on free ports.

    Args:
        data_dir: where certs, kubeconfigs, etcd data and logs go; a fresh temp dir if None.
            Removed by stop() unless ``keep_data``.
        bin_dir: directory with the binaries; ``tools_bin_dir()`` (build-go-tools.sh) if None.
        bind_address: address the API server listens on (127.0.0.1; use e.g. a bridge address
            or 0.0.0.0 when pods in network namespaces must reach it).
        advertise_address: address published in the ``kubernetes`` Service endpoints and used in
            kubeconfigs; defaults to ``bind_address`` (127.0.0.1 when binding 0.0.0.0).
        extra_sans: more DNS names / IPs for the API server's serving certificate.
        service_cluster_ip_range: Service ClusterIP range.
        cluster_cidr: pod CIDR from which the node IPAM controller gives each Node a
            ``spec.podCIDR`` (``node_cidr_mask_size`` bits); None turns node CIDR allocation off.
        controllers: kube-controller-manager ``--controllers`` value.
        node_monitor_grace_period: kube-controller-manager ``--node-monitor-grace-period`` (how long
            a node may miss its lease before it turns NotReady/Unknown, e.g. "16s"); None keeps
            the default (50s). ``NODE_TIMINGS`` holds the values the local nodes use.
        node_monitor_period: kube-controller-manager ``--node-monitor-period`` (e.g. "2s").
        default_not_ready_toleration_seconds / default_unreachable_toleration_seconds:
            kube-apiserver's default tolerations of the not-ready / unreachable NoExecute taints
            (seconds until pods are evicted from a failed node; default 300).
        extra_args: per-component extra flags, e.g. ``{"kube-apiserver": ["--v=2"]}``.
        die_with_parent: children get SIGTERM if the thread that started them dies (Linux
            PDEATHSIG; applied only when start() runs on the main thread).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        bin_dir: str | os.PathLike | None = None,
        bind_address: str = "127.0.0.1",
        advertise_address: str | None = None,
        extra_sans: Iterable[str] = (),
        service_cluster_ip_range: str = "10.96.0.0/16",
        cluster_cidr: str | None = "10.244.0.0/16",
        node_cidr_mask_size: int = 24,
        controllers: str = "*",
        node_monitor_grace_period: str | None = None,
        node_monitor_period: str | None = None,
        default_not_ready_toleration_seconds: int | None = None,
        default_unreachable_toleration_seconds: int | None = None,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        keep_data: bool = False,
        die_with_parent: bool = True,
        start_timeout: float = 180.0,
    ) -> None:
        self._data_dir_arg = Path(data_dir) if data_dir is not None else None
        self._bin_dir_arg = Path(bin_dir) if bin_dir is not None else None
        self.bind_address = bind_address
        if advertise_address is None:
            advertise_address = "127.0.0.1" if bind_address in ("0.0.0.0", "::") else bind_address
        self.advertise_address = advertise_address
        self.extra_sans = list(extra_sans)
        self.service_cluster_ip_range = service_cluster_ip_range
        self.cluster_cidr = cluster_cidr
        self.node_cidr_mask_size = node_cidr_mask_size
        self.controllers = controllers
        self.node_monitor_grace_period = node_monitor_grace_period
        self.node_monitor_period = node_monitor_period
        self.default_not_ready_toleration_seconds = default_not_ready_toleration_seconds
        self.default_unreachable_toleration_seconds = default_unreachable_toleration_seconds
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        self.keep_data = keep_data
        self.die_with_parent = die_with_parent
        self.start_timeout = start_timeout

        self.data_dir: Path | None = None
        self.bin_dir: Path | None = None
        self.etcd_port = self.etcd_peer_port = self.api_port = 0
        self.kcm_port = self.scheduler_port = 0
        self._ca: CertificateAuthority | None = None
        self._components: list[_Component] = []
        self._created_dir = False
        self._started = False
        self._lock = threading.RLock()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ properties
    @property
    def kubeconfig(self) -> str:
        """Path of the admin kubeconfig (client cert in group system:masters)."""
        self._require_started()
        return str(self.data_dir / "admin.kubeconfig")

    @property
    def server(self) -> str:
        """The API server URL (https://<advertise address>:<port>)."""
        return f"https://{_url_host(self.advertise_address)}:{self.api_port}"

    @property
    def ca_cert_path(self) -> str:
        return str(self._pki / "ca.crt")

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self._components}

    @property
    def _pki(self) -> Path:
        return self.data_dir / "pki"

    def _require_started(self) -> None:
        if not self._started:
            raise ControlPlaneError("control plane is not started")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        with self._lock:
            if self._started:
                return self
            self.bin_dir = self._bin_dir_arg or tools_bin_dir()
            if self._data_dir_arg is not None:
                self.data_dir = self._data_dir_arg
                self.data_dir.mkdir(parents=True, exist_ok=True)
                self._created_dir = True
            else:
                self.data_dir = Path(tempfile.mkdtemp(prefix="rljob-cp-"))
                self._created_dir = True
            try:
                self._write_pki()
                for attempt in range(3):
                    try:
                        self._start_once()
                        break
                    except _PortClash:
                        self._terminate_all()
                        shutil.rmtree(self.data_dir / "etcd", ignore_errors=True)
                        if attempt == 2:
                            raise
                self._started = True
            except BaseException as e:
                keep = os.environ.get("RLJOB_CLUSTER_KEEP_ON_FAILURE") == "1"
                self._terminate_all()
                if not keep:
                    self._remove_data()
                elif isinstance(e, ControlPlaneError):
                    e.args = (f"{e.args[0]}\n(data kept in {self.data_dir})",)
                raise
            return self

    def stop(self) -> None:
        """Terminate the processes start() launched (by pid) and remove the data dir."""
        with self._lock:
            self._terminate_all()
            self._started = False
            if not self.keep_data:
                self._remove_data()

    def dead_components(self) -> dict[str, int]:
        """{name: exit code} of components that have exited."""
        return {c.name: c.proc.returncode for c in self._components if c.proc.poll() is not None}

    def _atexit(self) -> None:
        if self._components:
            try:
                self.stop()
            except Exception:  # noqa: BLE001,S110 - nothing left to report to at exit
                pass

    def _terminate_all(self) -> None:
        comps, self._components = self._components, []
        for c in reversed(comps):
            if c.proc.poll() is None:
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for c in reversed(comps):
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            c.log_file.close()

    def _remove_data(self) -> None:
        if self.data_dir is not None and self._created_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._created_dir = False

    # ------------------------------------------------------------------ PKI + kubeconfigs
    def _write_pki(self) -> None:
        pki = self._pki
        pki.mkdir(parents=True, exist_ok=True)
        self._ca = ca = CertificateAuthority()
        KeyPair(ca.cert_pem, ca.key_pem).write(pki / "ca.crt", pki / "ca.key")
        service_ip = str(next(ipaddress.ip_network(self.service_cluster_ip_range).hosts()))
        ips = ["127.0.0.1", "::1", service_ip, self.advertise_address]
        if self.bind_address not in ("0.0.0.0", "::"):
            ips.append(self.bind_address)
        dns = [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        for san in self.extra_sans:
            try:
                ipaddress.ip_address(san)
                ips.append(san)
            except ValueError:
                dns.append(san)
        ca.serving_cert("kube-apiserver", dns, ips).write(pki / "apiserver.crt", pki / "apiserver.key")
        ca.client_cert("kube-apiserver-kubelet-client", ["system:masters"]).write(
            pki / "apiserver-kubelet-client.crt", pki / "apiserver-kubelet-client.key"
        )
        service_account_keypair().write(pki / "sa.pub", pki / "sa.key")
        # Front proxy (aggregation layer), as kubeadm sets it up: its own CA and client cert, so
        # request-header authentication is configured for aggregated APIs and for the delegated
        # authentication of kube-controller-manager / kube-scheduler.
        fp = CertificateAuthority("rljob-localcluster-front-proxy-ca")
        KeyPair(fp.cert_pem, fp.key_pem).write(pki / "front-proxy-ca.crt", pki / "front-proxy-ca.key")
        fp.client_cert("front-proxy-client").write(
            pki / "front-proxy-client.crt", pki / "front-proxy-client.key"
        )

    def _kubeconfig_dict(self, user: str, kp: KeyPair, server: str | None = None) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rljob-local",
                    "cluster": {
                        "server": server or self.server,
                        "certificate-authority-data": _b64(self._ca.cert_pem),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate-data": _b64(kp.cert_pem),
                        "client-key-data": _b64(kp.key_pem),
                    },
                }
            ],
            "contexts": [{"name": "rljob-local", "context": {"cluster": "rljob-local", "user": user}}],
            "current-context": "rljob-local",
            "preferences": {},
        }

    def write_serving_cert(
        self, cert_path: str | os.PathLike, key_path: str | os.PathLike, common_name: str,
        dns_names: Iterable[str] = (), ips: Iterable[str] = (),
    ) -> None:
        """Write a TLS serving certificate signed by the cluster CA (e.g. a kubelet's)."""
        if self._ca is None:
            raise ControlPlaneError("control plane has no CA yet; call start() first")
        Path(cert_path).parent.mkdir(parents=True, exist_ok=True)
        self._ca.serving_cert(common_name, dns_names, ips).write(Path(cert_path), Path(key_path))

    def write_kubeconfig(
        self, path: str | os.PathLike, user: str, groups: Sequence[str] = (), server: str | None = None
    ) -> str:
        """Write a kubeconfig for a client-cert identity ``user`` in ``groups`` (e.g. a kubelet:
        user ``system:node:<name>``, groups ``["system:nodes"]``). Returns the path."""
        if self._ca is None:
            raise ControlPlaneError("control plane has no CA yet; call start() first")
        kp = self._ca.client_cert(user, groups)
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # JSON is valid YAML; kubectl, client-go and the Python client all read it.
        p.write_text(json.dumps(self._kubeconfig_dict(user, kp, server), indent=2))
        p.chmod(0o600)
        return str(p)

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, args: list[str]) -> _Component:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - stays open while the process runs
        use_pdeathsig = self.die_with_parent and threading.current_thread() is threading.main_thread()
        cmd = [str(self.bin_dir / name), *args, *self.extra_args.get(name, [])]
        log_file.write(("+ " + " ".join(cmd) + "\n").encode())
        log_file.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            start_new_session=True,  # a terminal's Ctrl-C goes to us; stop() ends them in order
            preexec_fn=set_pdeathsig if use_pdeathsig else None,  # noqa: PLW1509 - one prctl call
        )
        comp = _Component(name, proc, log_path, log_file)
        self._components.append(comp)
        return comp

    def _check_alive(self, comp: _Component) -> None:
        if comp.proc.poll() is not None:
            tail = comp.tail()
            exc = _PortClash if "address already in use" in tail else ControlPlaneError
            raise exc(f"{comp.name} exited with code {comp.proc.returncode}; log {comp.log_path}:\n{tail}")

    def _wait(self, comp: _Component, what: str, probe, deadline: float) -> None:
        last = None
        while time.monotonic() < deadline:
            self._check_alive(comp)
            try:
                if probe():
                    return
            except Exception as e:  # noqa: BLE001 - keep polling, report the last failure
                last = e
            time.sleep(0.25)
        raise ControlPlaneError(
            f"timed out waiting for {comp.name} ({what}); last error: {last!r}; log {comp.log_path}:\n"
            f"{comp.tail()}"
        )

    def _admin_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self._pki / "ca.crt"))
        ctx.load_cert_chain(str(self._pki / "admin.crt"), str(self._pki / "admin.key"))
        return ctx

    def _https_get(self, host: str, port: int, path: str, ctx: ssl.SSLContext) -> tuple[int, bytes]:
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def api_get(self, path: str) -> tuple[int, bytes]:
        """GET ``path`` on the API server as admin; returns (status, body)."""
        return self._https_get(self.advertise_address, self.api_port, path, self._admin_ssl())

    def _start_once(self) -> None:
        """Start the components in order, each waited for: etcd, the API server (and the admin kubeconfig), the
        controller manager and the scheduler (their kubeconfigs first), then the controllers' readiness."""
        deadline = time.monotonic() + self.start_timeout
        host = "127.0.0.1"
        self.etcd_port, self.etcd_peer_port = free_port(host), free_port(host)
        self.api_port = free_port(self.bind_address if self.bind_address not in ("::",) else "::")
        self.kcm_port, self.scheduler_port = free_port(host), free_port(host)
        etcd = self._start_etcd(host, deadline)
        apiserver = self._start_apiserver(f"http://{host}:{self.etcd_port}", deadline)
        kcm_kubeconfig, scheduler_kubeconfig = self._component_kubeconfigs()
        kcm = self._start_controller_manager(kcm_kubeconfig, host)
        scheduler = self._start_scheduler(scheduler_kubeconfig, host)
        self._wait_controllers(kcm, scheduler, host, deadline)
        for comp in (etcd, apiserver):
            self._check_alive(comp)

    def _start_etcd(self, host: str, deadline: float) -> _Component:
        client_url = f"http://{host}:{self.etcd_port}"
        peer_url = f"http://{host}:{self.etcd_peer_port}"
        etcd = self._spawn(
            "etcd",
            [
                "--name=rljob-local",
                f"--data-dir={self.data_dir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=rljob-local={peer_url}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync=true",  # test cluster: speed over durability (envtest does this)
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
        )

        def etcd_healthy() -> bool:
            conn = http.client.HTTPConnection(host, self.etcd_port, timeout=2)
            try:
                conn.request("GET", "/health")
                body = conn.getresponse().read()
                return json.loads(body).get("health") == "true"
            finally:
                conn.close()

        self._wait(etcd, "/health", etcd_healthy, deadline)
        return etcd

    def _start_apiserver(self, client_url: str, deadline: float) -> _Component:
        """kube-apiserver on etcd at ``client_url``, waited for on /readyz; then ``admin.kubeconfig``."""
        pki = self._pki
        self._ca.client_cert(ADMIN_USER, ["system:masters"]).write(pki / "admin.crt", pki / "admin.key")
        apiserver = self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={client_url}",
                f"--bind-address={self.bind_address}",
                f"--advertise-address={self.advertise_address}",
                f"--secure-port={self.api_port}",
                f"--cert-dir={pki / 'apiserver-generated'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--authorization-mode=Node,RBAC",
                f"--service-cluster-ip-range={self.service_cluster_ip_range}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--allow-privileged=true",
                "--enable-admission-plugins=NodeRestriction",
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--profiling=false",
                *(
                    [f"--default-not-ready-toleration-seconds={self.default_not_ready_toleration_seconds}"]
                    if self.default_not_ready_toleration_seconds is not None else []
                ),
                *(
                    [f"--default-unreachable-toleration-seconds={self.default_unreachable_toleration_seconds}"]
                    if self.default_unreachable_toleration_seconds is not None else []
                ),
                # Endpoints may not hold loopback addresses, so with a loopback advertise address (a
                # control plane without nodes, where no pod runs) the "kubernetes" Service gets no
                # endpoints; with nodes the advertise address is the host's (node_control_plane_options)
                # and kube-proxy routes the Service to it.
                "--endpoint-reconciler-type="
                + ("none" if ipaddress.ip_address(self.advertise_address).is_loopback else "lease"),
            ],
        )
        ctx = self._admin_ssl()
        self._wait(
            apiserver,
            "/readyz",
            lambda: self._https_get(self.advertise_address, self.api_port, "/readyz", ctx)[0] == 200,
            deadline,
        )
        (self.data_dir / "admin.kubeconfig").write_text(
            json.dumps(
                self._kubeconfig_dict(ADMIN_USER, KeyPair((pki / "admin.crt").read_bytes(),
                                                          (pki / "admin.key").read_bytes())),
                indent=2,
            )
        )
        (self.data_dir / "admin.kubeconfig").chmod(0o600)
        return apiserver

    def _component_kubeconfigs(self) -> tuple[str, str]:
        """The controller manager's and the scheduler's kubeconfigs: they talk to the API server over loopback when
        they can."""
        local_server = (
            f"https://127.0.0.1:{self.api_port}"
            if self.bind_address in ("127.0.0.1", "0.0.0.0")
            else self.server
        )
        kcm_kc = self.write_kubeconfig(
            self.data_dir / "kube-controller-manager.kubeconfig",
            "system:kube-controller-manager",
            server=local_server,
        )
        sched_kc = self.write_kubeconfig(
            self.data_dir / "kube-scheduler.kubeconfig", "system:kube-scheduler", server=local_server
        )
        return kcm_kc, sched_kc

    def _start_controller_manager(self, kcm_kc: str, host: str) -> _Component:
        pki = self._pki
        kcm_args = [
            f"--kubeconfig={kcm_kc}",
            f"--authentication-kubeconfig={kcm_kc}",
            f"--authorization-kubeconfig={kcm_kc}",
            f"--bind-address={host}",
            f"--secure-port={self.kcm_port}",
            f"--cert-dir={pki / 'kcm-generated'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--use-service-account-credentials=true",
            f"--controllers={self.controllers}",
            f"--service-cluster-ip-range={self.service_cluster_ip_range}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        if self.node_monitor_grace_period:
            kcm_args.append(f"--node-monitor-grace-period={self.node_monitor_grace_period}")
        if self.node_monitor_period:
            kcm_args.append(f"--node-monitor-period={self.node_monitor_period}")
        if self.cluster_cidr:
            kcm_args += [
                "--allocate-node-cidrs=true",
                f"--cluster-cidr={self.cluster_cidr}",
                f"--node-cidr-mask-size={self.node_cidr_mask_size}",
            ]
        else:
            kcm_args.append("--allocate-node-cidrs=false")
        return self._spawn("kube-controller-manager", kcm_args)

    def _start_scheduler(self, sched_kc: str, host: str) -> _Component:
        return self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                f"--bind-address={host}",
                f"--secure-port={self.scheduler_port}",
                f"--cert-dir={self._pki / 'scheduler-generated'}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )

    def _wait_controllers(self, kcm: _Component, sched: _Component, host: str, deadline: float) -> None:
        """Both answer /healthz, and the controller manager has made the default ServiceAccount."""
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # their serving certs are self-generated
        for comp, port in ((kcm, self.kcm_port), (sched, self.scheduler_port)):
            self._wait(
                comp,
                "/healthz",
                lambda port=port: self._https_get(host, port, "/healthz", insecure)[0] == 200,
                deadline,
            )
        # Pods cannot be created before the service-account controller has made the namespace's
        # "default" ServiceAccount (ServiceAccount admission), so that is the real readiness signal.
        self._wait(
            kcm,
            "default ServiceAccount in namespace default",
            lambda: self.api_get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
            deadline,
        )

    # ------------------------------------------------------------------ conveniences
    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment with KUBECONFIG set and the tools' bin dir first on PATH."""
        e = dict(os.environ if base is None else base)
        e["KUBECONFIG"] = self.kubeconfig
        e["PATH"] = f"{self.bin_dir}{os.pathsep}{e.get('PATH', '')}"
        return e

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run the pinned kubectl as admin; returns the CompletedProcess (text mode)."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, input=input, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def state(self) -> dict:
        """JSON-able description (used by the CLI's state file)."""
        return {
            "server": self.server,
            "kubeconfig": self.kubeconfig,
            "data_dir": str(self.data_dir),
            "bin_dir": str(self.bin_dir),
            "etcd_url": self.etcd_url,
            "ca_cert": self.ca_cert_path,
            "pids": self.pids,
            "advertise_address": self.advertise_address,
            "ports": {
                "etcd": self.etcd_port,
                "kube-apiserver": self.api_port,
                "kube-controller-manager": self.kcm_port,
                "kube-scheduler": self.scheduler_port,
            },
        }
