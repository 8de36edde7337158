"""Kueue next to a local control plane: its manager as a host process, its CRDs and its webhooks.

    with ControlPlane() as cp, LocalKueue(cp) as kueue:
        cp.kubectl("apply", "-f", "queues.yaml")

What :meth:`LocalKueue.start` does, in order (everything from the pinned Kueue that
``localcluster/build-go-tools.sh`` builds; its manifests lie next to the binary, copied from the same module
version):

1. applies Kueue's CRDs (server-side: the Workload CRD is larger than client-side apply's annotation allows), with
   the conversion webhook of the CRDs Kueue's kustomization patches (``/convert``) pointed at this process;
2. writes a serving certificate for 127.0.0.1 signed by the cluster CA and a Kueue ``Configuration``: webhooks,
   health probe and metrics on free loopback ports, no leader election, no internal cert management, no visibility
   API server, ``integrations.externalFrameworks`` (RLTrainingJob by default: rljob creates the jobs' Workloads);
3. starts ``kueue --config`` as admin (a client cert in ``system:masters``) with :data:`FEATURE_GATES` and
   waits for its readiness probe.
   Kueue reads its metrics serving certificate from the fixed path ``/etc/kueue/metrics/certs`` when it does not
   manage certificates itself, so the process runs in a private mount namespace (``unshare --mount``) where an
   overlay adds that directory, holding a certificate from the cluster CA, to ``/etc``: nothing is written to the
   host's ``/etc``. That needs root, as the local nodes do;
4. registers Kueue's own admission webhooks (those of its ``kueue.x-k8s.io`` types, and of pods when the ``pod``
   integration is on) as ``url:`` webhooks on 127.0.0.1 — the API server runs on the host, so loopback reaches Kueue
   the same way on the control-plane-only cluster and on the node cluster — and waits until the API server gets
   answers through them (a server-side dry-run of a ResourceFlavor).

:meth:`LocalKueue.stop` deletes the webhook configurations first (a webhook whose server is gone would refuse every
write it covers), then terminates the process (by pid) and removes its data dir; it runs also when ``start`` fails.
The CRDs stay: objects of them may outlive one Kueue process on a shared control plane, and a later start re-points
their conversion webhook.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Self

import yaml

from .controlplane import ControlPlane, ControlPlaneError
from .node.processes import tail
from .pids import free_port, set_pdeathsig

__all__ = ["KUEUE_NAMESPACE", "RLJOB_FRAMEWORK", "LocalKueue"]

RLJOB_FRAMEWORK = "RLTrainingJob.v1alpha1.rljob.dev"
"""RLTrainingJob as Kueue names an external framework (``Kind.version.group``): rljob makes its Workloads."""
KUEUE_NAMESPACE = "kueue-system"
WEBHOOK_PREFIX = "rljob-local-kueue-"
"""Name prefix of the webhook configurations a LocalKueue registers (deleted by stop)."""
FEATURE_GATES = "VisibilityOnDemand=false,ElasticJobsViaWorkloadSlices=true"
"""Kueue's feature gates here: no visibility API server, and elastic Workloads (alpha in v0.17), which rljob uses to
scale a queued job's rollout pods without a restart (docs/kueue.md)."""
CONVERTED_CRDS = ("clusterqueues", "cohorts", "localqueues", "workloads", "multikueueclusters")
"""The CRDs whose conversion Kueue's kustomization hands to its webhook (config/components/crd/kustomization.yaml)."""
KUEUE_WEBHOOK_PATHS = ("-kueue-x-k8s-io-",)
"""Webhook paths of Kueue's own types; a framework's webhooks are added when the framework is enabled."""
FRAMEWORK_WEBHOOK_PATHS = {"pod": "--v1-pod", "batch/job": "-batch-v1-job"}
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
"""Where Kueue's manager reads its metrics serving certificate when it does not manage certificates itself."""


class LocalKueue:
    """Kueue's manager for a started :class:`~rljob_localcluster.controlplane.ControlPlane` (see the module docstring).

    Args:
        cp: the started control plane (its bin dir holds ``kueue``, its CA signs the webhook certificate).
        frameworks: Kueue's built-in integrations to enable (``integrations.frameworks``; Kueue's default,
            ``batch/job``, which it also takes for an empty list), their webhooks registered with its own.
        external_frameworks: ``integrations.externalFrameworks`` (``Kind.version.group``).
        data_dir: certificates, config and log; a fresh temp dir if None (removed by stop).
        start_timeout: seconds for the whole start.
        feature_gates: Kueue's ``--feature-gates`` (:data:`FEATURE_GATES`).
    """

    def __init__(self, cp: ControlPlane, *, frameworks: Iterable[str] = ("batch/job",),
                 external_frameworks: Iterable[str] = (RLJOB_FRAMEWORK,), data_dir: str | os.PathLike | None = None,
                 start_timeout: float = 180.0, feature_gates: str = FEATURE_GATES) -> None:
        self.cp = cp
        self.feature_gates = feature_gates
        self.frameworks = list(frameworks)
        self.external_frameworks = list(external_frameworks)
        unknown = [f for f in self.frameworks if f not in FRAMEWORK_WEBHOOK_PATHS]
        if unknown:
            raise ValueError(f"frameworks {unknown}: only {sorted(FRAMEWORK_WEBHOOK_PATHS)} are wired up here")
        self._data_dir_arg = Path(data_dir) if data_dir is not None else None
        self.start_timeout = start_timeout
        self.data_dir: Path | None = None
        self.webhook_port = self.health_port = self.metrics_port = 0
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._webhooks: list[tuple[str, str]] = []
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ files of the pinned build
    @property
    def binary(self) -> Path:
        return Path(self.cp.bin_dir) / "kueue"

    @property
    def manifests_dir(self) -> Path:
        """Where build-go-tools.sh put the manifests of the binary's module version (``crds/``, ``webhooks.yaml``)."""
        return self.binary.resolve().parent

    @property
    def log_path(self) -> Path:
        return self.data_dir / "kueue.log"

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of Kueue's log ("(no log)" when it cannot be read)."""
        return tail(self.log_path, n)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Self:
        """Start Kueue (see the module docstring).

        Raises:
            ControlPlaneError: a step failed; the message carries Kueue's log tail. Everything started is stopped.
        """
        with self._lock:
            if self.proc is not None:
                return self
            if not self.binary.exists():
                raise ControlPlaneError(f"{self.binary} missing (run localcluster/build-go-tools.sh)")
            if os.geteuid() != 0:
                raise ControlPlaneError("Kueue runs in a mount namespace of its own (its metrics certificate path is "
                                        "fixed, see rljob_localcluster.kueue): run as root")
            self.data_dir = self._data_dir_arg or Path(tempfile.mkdtemp(prefix="rljob-kueue-"))
            self.data_dir.mkdir(parents=True, exist_ok=True)
            try:
                self._start(time.monotonic() + self.start_timeout)
            except BaseException:
                self.stop()
                raise
            return self

    def stop(self) -> None:
        """Delete the webhook configurations, terminate the process (by pid), remove the data dir."""
        with self._lock:
            for kind, name in reversed(self._webhooks):
                self.cp.kubectl("delete", kind, name, "--ignore-not-found", "--wait=false", check=False)
            self._webhooks = []
            proc, self.proc = self.proc, None
            if proc is not None:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.data_dir is not None and self._data_dir_arg is None and \
                    os.environ.get("RLJOB_CLUSTER_KEEP_ON_FAILURE") != "1":
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def _start(self, deadline: float) -> None:
        self.webhook_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        ca_bundle = base64.b64encode(Path(self.cp.ca_cert_path).read_bytes()).decode()
        self._apply_crds(ca_bundle)
        certs = self.data_dir / "certs"
        for where in (certs, self.data_dir / "etc" / METRICS_CERT_DIR.relative_to("/etc")):
            self.cp.write_serving_cert(where / "tls.crt", where / "tls.key", "rljob-local-kueue",
                                       dns_names=["localhost"], ips=["127.0.0.1"])
        kubeconfig = self.cp.write_kubeconfig(self.data_dir / "kueue.kubeconfig", "rljob-local-kueue",
                                              ["system:masters"])
        self.cp.kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)
        config = self.data_dir / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration(certs)))
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - stays open while the process runs
        use_pdeathsig = threading.current_thread() is threading.main_thread()
        overlay = f"mount -t overlay rljob-local-kueue -o lowerdir={self.data_dir / 'etc'}:/etc /etc"
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{overlay} && exec "$0" "$@"',
             str(self.binary), f"--config={config}", f"--feature-gates={self.feature_gates}",
             "--zap-log-level=info"],
            env={**os.environ, "KUBECONFIG": kubeconfig}, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.data_dir,
            start_new_session=True, preexec_fn=set_pdeathsig if use_pdeathsig else None,  # noqa: PLW1509
        )
        self._wait("its readiness probe", self._ready, deadline)
        self._register_webhooks(ca_bundle)
        self._wait("its webhooks through the API server", self._webhooks_answer, deadline)

    def configuration(self, cert_dir: Path) -> dict:
        """Kueue's ``Configuration`` (config.kueue.x-k8s.io/v1beta2) for this process."""
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": self.frameworks, "externalFrameworks": self.external_frameworks},
        }

    # ------------------------------------------------------------------ manifests
    def _apply_crds(self, ca_bundle: str) -> None:
        crds = []
        for path in sorted((self.manifests_dir / "crds").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
                crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                    "clientConfig": {"url": f"https://127.0.0.1:{self.webhook_port}/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"]}}
            crds.append(crd)
        self.cp.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=rljob-local-kueue", "-f", "-",
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": crds}), timeout=120)
        for crd in crds:
            self.cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")

    def webhook_configurations(self, ca_bundle: str) -> list[dict]:
        """Kueue's webhook configurations as registered here: only the webhooks of Kueue's own types and of the
        enabled frameworks, each a ``url:`` on this process's port; names prefixed with :data:`WEBHOOK_PREFIX`."""
        wanted = KUEUE_WEBHOOK_PATHS + tuple(FRAMEWORK_WEBHOOK_PATHS[f] for f in self.frameworks)
        configs = []
        for doc in yaml.safe_load_all((self.manifests_dir / "webhooks.yaml").read_text()):
            if not doc:
                continue
            hooks = []
            for hook in doc.get("webhooks") or []:
                path = hook["clientConfig"]["service"]["path"]
                if not any(part in path for part in wanted):
                    continue
                hooks.append({**hook, "clientConfig": {"url": f"https://127.0.0.1:{self.webhook_port}{path}",
                                                       "caBundle": ca_bundle}})
            if hooks:
                name = WEBHOOK_PREFIX + doc["metadata"]["name"]
                configs.append({**doc, "metadata": {"name": name}, "webhooks": hooks})
        return configs

    def _register_webhooks(self, ca_bundle: str) -> None:
        for config in self.webhook_configurations(ca_bundle):
            self._webhooks.append((config["kind"], config["metadata"]["name"]))
            self.cp.kubectl("apply", "-f", "-", input=json.dumps(config))

    # ------------------------------------------------------------------ waiting
    def _ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.health_port, timeout=2)
        try:
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    def _webhooks_answer(self) -> bool:
        probe = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                 "metadata": {"name": "rljob-local-kueue-probe"}}
        return self.cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe),
                               check=False).returncode == 0

    def _wait(self, what: str, probe, deadline: float) -> None:
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ControlPlaneError(f"kueue exited with code {self.proc.returncode}; log {self.log_path}:\n"
                                        f"{self.log_tail()}")
            try:
                if probe():
                    return
            except Exception as err:  # noqa: BLE001 - keep polling, report the last failure
                last = err
            time.sleep(0.5)
        raise ControlPlaneError(f"timed out waiting for kueue ({what}); last error: {last!r}; log {self.log_path}:\n"
                                f"{self.log_tail()}")

