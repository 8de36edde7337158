"""One pod's life on a node, on its own thread (kubelet's pod worker, reduced): sandbox (network
namespace + volumes + hosts files), init containers in order, then the containers, restarts per
restartPolicy with kubelet's back-off, probes, status reports, and termination on deletion.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .dns import resolv_conf
from .hosts import HostsManager
from .kube import ApiException, Kube, pod_path
from .logs import claim_log, log_path
from .mountpoints import MountPointError, MountPoints
from .network import Bridge, IPAllocator, NetworkError, PodSandboxNet
from .node import NodeSpec
from .podenv import ContainerConfigError, container_argv, container_env, expand
from .podstatus import ContainerRecord, exit_reason, pod_status, rfc3339, status_patch
from .podvolumes import PodVolumes
from .probes import ProbeTracker, run_probe
from .process import ContainerProcess, LaunchSpec
from .volumes import (
    Mount,
    VolumeError,
    container_mounts,
    image_mounts,
)

__all__ = ["ApiSource", "NodeRuntime", "PodWorker", "RuntimeContext"]

log = logging.getLogger(__name__)

TICK_SECONDS = 0.5
CONFIG_RETRY_SECONDS = 2.0
"""Retry period for a container whose env cannot be resolved, or a sandbox whose volumes cannot be set up."""
BACKOFF_RESET_SECONDS = 600.0
"""A container that ran this long has its restart back-off reset (kubelet: 10 minutes)."""
TERMINATION_MESSAGE_LIMIT = 4096
FALLBACK_LOG_LINES = 80
READ_ONLY_KINDS = ("configMap", "secret", "downwardAPI", "projected")


class ApiSource:
    """:class:`~.podenv.ObjectSource` reading ConfigMaps and Secrets from the API server."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def config_map(self, namespace: str, name: str) -> dict | None:
        return self.kube.get_or_none(f"/api/v1/namespaces/{namespace}/configmaps/{name}")

    def secret(self, namespace: str, name: str) -> dict | None:
        return self.kube.get_or_none(f"/api/v1/namespaces/{namespace}/secrets/{name}")


@dataclass
class RuntimeContext:
    """What every pod worker shares (made once by the agent)."""

    kube: Kube
    state_dir: Path
    cluster_domain: str
    image_env: dict[str, str]
    image_paths: tuple[str, ...]
    cluster_env: dict[str, str]
    bridge: Bridge
    mountpoints: MountPoints
    hosts: HostsManager
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    detach: list[str] = field(default_factory=list)

    @property
    def pods_dir(self) -> Path:
        return self.state_dir / "pods"


@dataclass
class NodeRuntime:
    """One node the agent runs: its spec and pod-IP allocator; ``lost`` stops all its work."""

    spec: NodeSpec
    allocator: IPAllocator
    lost: bool = False
    node_object: dict = field(default_factory=dict)
    """The Node as last registered (its uid owns the Lease)."""


def _hostname(pod: dict) -> str:
    """spec.hostname, else the pod name cut to 63 characters (kubelet's GeneratePodHostNameAndDomain)."""
    name = (pod.get("spec") or {}).get("hostname") or pod["metadata"]["name"]
    return name[:63].rstrip("-.")


def emit_event(kube: Kube, pod: dict, node: str, reason: str, message: str, *, warning: bool = False,
               container: str | None = None) -> None:
    """Post a core/v1 Event about ``pod`` from component ``kubelet`` (best effort)."""
    meta = pod["metadata"]
    now = rfc3339()
    involved = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]}
    if container:
        involved["fieldPath"] = f"spec.containers{{{container}}}"
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": "kubelet", "host": node},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        kube.create(f"/api/v1/namespaces/{meta['namespace']}/events", body)
    except Exception as e:  # noqa: BLE001 - events are best effort
        log.debug("event %s for %s/%s not posted: %s", reason, meta["namespace"], meta["name"], e)


class PodWorker:
    """Runs one pod bound to ``node`` until it is deleted; fed new pod versions by :meth:`update`.

    The thread ends when the pod is gone from the API (after terminating its processes and
    deleting it with grace 0 as kubelet does), on :meth:`shutdown` (agent exit: processes get
    SIGTERM, then SIGKILL after ``grace`` seconds) or on :meth:`abandon` (node loss: SIGKILL at
    once, no further API writes).
    """

    def __init__(self, ctx: RuntimeContext, node: NodeRuntime, pod: dict, on_exit: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.node = node
        self.pod = pod
        meta = pod["metadata"]
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.on_exit = on_exit
        self.source = ApiSource(ctx.kube)
        self.pod_dir = ctx.pods_dir / self.uid
        self._wake = threading.Event()
        self._api_gone = False
        self._shutdown_grace: float | None = None
        self._abandon = False
        self._lock = threading.Lock()
        spec = pod.get("spec") or {}
        self.init_records = [ContainerRecord(c["name"], c.get("image", "")) for c in spec.get("initContainers") or []]
        first_reason = "PodInitializing" if self.init_records else "ContainerCreating"
        self.records = [ContainerRecord(c["name"], c.get("image", ""), reason=first_reason)
                        for c in spec.get("containers") or []]
        self.procs: dict[str, ContainerProcess] = {}
        self.envs: dict[str, dict[str, str]] = {}
        self.crashes: dict[str, int] = {}
        self.not_before: dict[str, float] = {}
        self.readiness: dict[str, ProbeTracker] = {}
        self.liveness: dict[str, ProbeTracker] = {}
        self.net: PodSandboxNet | None = None
        self.pod_ip = ""
        self.volumes = PodVolumes(ctx.kube, self.source, self.pod_dir, node.spec,
                                  on_tmpfs=lambda: self._save_sandbox_record(self.net))
        self.start_time: str | None = None
        self.last_status: dict | None = None
        self.finished = False
        self._adopted = False
        self._sandbox_retry_at = 0.0
        self.thread = threading.Thread(target=self._run, name=f"pod {self.namespace}/{self.name}", daemon=True)

    # ------------------------------------------------------------------ control (other threads)
    def start(self) -> PodWorker:
        self.thread.start()
        return self

    def update(self, pod: dict | None) -> None:
        """A newer version of the pod from the watch, or None when it was deleted from the API."""
        with self._lock:
            if pod is None:
                self._api_gone = True
            else:
                self.pod = pod
        self._wake.set()

    def shutdown(self, grace: float) -> None:
        self._shutdown_grace = grace
        self._wake.set()

    def abandon(self) -> None:
        self._abandon = True
        self._wake.set()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(TICK_SECONDS)
                self._wake.clear()
                if self._abandon:
                    self._kill_all()
                    self._teardown()
                    return
                if self._shutdown_grace is not None:
                    self._terminate(self._shutdown_grace)
                    self._teardown()
                    return
                try:
                    if self._sync():
                        return
                except Exception:
                    log.exception("pod %s/%s: sync failed", self.namespace, self.name)
                    time.sleep(1.0)
        finally:
            self.on_exit(self.uid)

    def _sync(self) -> bool:
        """One reconcile pass; True when the worker is done (pod deleted)."""
        with self._lock:
            pod, api_gone = self.pod, self._api_gone
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if api_gone or meta.get("deletionTimestamp"):
            grace = 0 if api_gone else meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
            if self.procs and any(p.poll() is None for p in self.procs.values()):
                emit_event(self.ctx.kube, pod, self.node.spec.name, "Killing", f"Stopping pod (grace period {grace}s)")
            self._terminate(float(grace or 0))
            self._teardown()
            if not api_gone:
                self._delete_from_api()
            return True
        if not self._adopted:
            self._adopt(pod)
        if self.finished:
            return False
        if self.start_time is None:
            self.start_time = rfc3339()
        if time.monotonic() < self._sandbox_retry_at:
            return False
        if not self._ensure_sandbox(pod):
            self._sandbox_retry_at = time.monotonic() + CONFIG_RETRY_SECONDS
            self._report(pod)
            return False
        self.volumes.resync(pod, self.pod_ip)
        self._reap(pod)
        self._start_due(pod)
        self._probe(pod)
        phase = self._report(pod)
        if phase in ("Succeeded", "Failed"):
            self.finished = True
            self._teardown()
        return False

    # ------------------------------------------------------------------ adoption
    def _adopt(self, pod: dict) -> None:
        """First sight of the pod: continue from the status a previous agent run reported.

        Processes do not survive the agent, so a container reported running or terminated is
        gone: under restartPolicy Never it is reported terminated (ContainerStatusUnknown, exit
        137, as kubelet does), otherwise it restarts with its restart count carried on.
        """
        self._adopted = True
        status = pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            self.finished = True
            return
        policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
        self.start_time = status.get("startTime")
        for records, key in ((self.init_records, "initContainerStatuses"), (self.records, "containerStatuses")):
            previous = {s["name"]: s for s in status.get(key) or []}
            for rec in records:
                prev = previous.get(rec.name)
                if not prev:
                    continue
                rec.restart_count = prev.get("restartCount", 0)
                state = prev.get("state") or {}
                if "terminated" in state:
                    t = state["terminated"]
                    rec.state, rec.exit_code, rec.reason = "terminated", t.get("exitCode", 0), t.get("reason", "")
                    rec.started_at, rec.finished_at = t.get("startedAt"), t.get("finishedAt")
                    rec.message = t.get("message", "")
                elif "running" in state:
                    rec.state, rec.exit_code, rec.reason = "terminated", 137, "ContainerStatusUnknown"
                    rec.started_at, rec.finished_at = state["running"].get("startedAt"), rfc3339()
                    rec.message = "The container could not be located when the pod was terminated"
                else:  # waiting: to start, or to restart after the run in lastState
                    rec.last_terminated = (prev.get("lastState") or {}).get("terminated")
                    continue
                is_init = records is self.init_records
                if self._should_restart(rec, is_init, policy):
                    self._schedule_restart(rec, delay=0.0)

    # ------------------------------------------------------------------ sandbox
    def _ensure_sandbox(self, pod: dict) -> bool:
        spec = pod.get("spec") or {}
        try:
            if self.net is None and not self.pod_ip:
                self.pod_dir.mkdir(parents=True, exist_ok=True)
                if spec.get("hostNetwork"):
                    self.pod_ip = self.node.spec.internal_ip
                else:
                    ip = self.node.allocator.allocate(self.uid, prefer=(pod.get("status") or {}).get("podIP"))
                    net = PodSandboxNet.for_pod(self.uid, ip)
                    self._save_sandbox_record(net)
                    net.create(self.ctx.bridge)
                    self.net, self.pod_ip = net, ip
                (self.pod_dir / "hostname").write_text(_hostname(pod) + "\n")
                if not spec.get("hostNetwork"):
                    (self.pod_dir / "resolv.conf").write_text(resolv_conf())
                    self.ctx.hosts.register(self.uid, self.pod_dir / "hosts", pod, self.pod_ip)
            if self.volumes.dirs is None:
                self.volumes.setup(pod, self.pod_ip)
            return True
        except (VolumeError, NetworkError, ApiException, OSError) as e:
            msg = str(e) if not isinstance(e, ApiException) else f"API error {e.status}: {e.reason}"
            for rec in self.init_records + self.records:
                if rec.state == "waiting" and rec.reason in ("ContainerCreating", "PodInitializing"):
                    if rec.message != msg:
                        emit_event(self.ctx.kube, pod, self.node.spec.name, "FailedMount", msg, warning=True)
                    rec.message = msg
                    break
            log.warning("pod %s/%s: sandbox not ready: %s", self.namespace, self.name, msg)
            return False

    def _save_sandbox_record(self, net: PodSandboxNet | None) -> None:
        record = {"namespace": self.namespace, "name": self.name, "tmpfs": self.volumes.tmpfs,
                  "netns": net.netns if net else None, "veth": net.veth if net else None}
        (self.pod_dir / "sandbox.json").write_text(json.dumps(record))

    # ------------------------------------------------------------------ containers
    @staticmethod
    def _should_restart(rec: ContainerRecord, is_init: bool, policy: str) -> bool:
        if is_init:
            return rec.exit_code != 0 and policy != "Never"
        return policy == "Always" or (policy == "OnFailure" and rec.exit_code != 0)

    def _schedule_restart(self, rec: ContainerRecord, delay: float) -> None:
        rec.last_terminated = rec.terminated_dict()
        rec.state, rec.exit_code = "waiting", None
        if delay:
            rec.reason = "CrashLoopBackOff"
            rec.message = (f"back-off {delay:g}s restarting failed container={rec.name} "
                           f"pod={self.name}_{self.namespace}({self.uid})")
        else:
            rec.reason, rec.message = "ContainerCreating", ""
        rec.started_at = rec.finished_at = None
        self.not_before[rec.name] = time.monotonic() + delay

    def _backoff_delay(self, rec: ContainerRecord, ran_seconds: float) -> float:
        """kubelet's crash back-off: restart at once the first time, then base, 2·base, ... ≤ max."""
        if ran_seconds >= BACKOFF_RESET_SECONDS:
            self.crashes[rec.name] = 0
        n = self.crashes.get(rec.name, 0)
        self.crashes[rec.name] = n + 1
        return 0.0 if n == 0 else min(self.ctx.backoff_base * 2 ** (n - 1), self.ctx.backoff_max)

    def _reap(self, pod: dict) -> None:
        policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
        defs = self._container_defs(pod)
        for is_init, records in ((True, self.init_records), (False, self.records)):
            for rec in records:
                proc = self.procs.get(rec.name)
                if proc is None or rec.state != "running":
                    continue
                code = proc.poll()
                if code is None:
                    continue
                del self.procs[rec.name]
                self.readiness.pop(rec.name, None)
                self.liveness.pop(rec.name, None)
                rec.state, rec.exit_code, rec.ready = "terminated", code, False
                rec.finished_at = rfc3339(proc.finished_wall)
                start_error = proc.start_error()
                if start_error:
                    rec.reason, rec.message = "StartError", start_error
                    emit_event(self.ctx.kube, pod, self.node.spec.name, "Failed", f"Error: {start_error}",
                               warning=True, container=rec.name)
                else:
                    rec.reason = exit_reason(code)
                    rec.message = self._termination_message(rec, defs[rec.name], code)
                if self._should_restart(rec, is_init, policy):
                    delay = self._backoff_delay(rec, time.monotonic() - proc.started_mono)
                    if delay:
                        emit_event(self.ctx.kube, pod, self.node.spec.name, "BackOff",
                                   "Back-off restarting failed container", warning=True, container=rec.name)
                    self._schedule_restart(rec, delay)

    def _termination_message(self, rec: ContainerRecord, cdef: dict, code: int) -> str:
        try:
            msg = (self.pod_dir / "containers" / rec.name / "termination-log").read_text(errors="replace")
        except OSError:
            msg = ""
        if not msg and code != 0 and cdef.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                lines = log_path(self.ctx.state_dir, self.namespace, self.name, rec.name).read_text(errors="replace").splitlines()
                msg = "\n".join(lines[-FALLBACK_LOG_LINES:])
            except OSError:
                msg = ""
        return msg[-TERMINATION_MESSAGE_LIMIT:]

    def _container_defs(self, pod: dict) -> dict[str, dict]:
        spec = pod.get("spec") or {}
        return {c["name"]: c for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])}

    def _due(self, rec: ContainerRecord) -> bool:
        return rec.state == "waiting" and time.monotonic() >= self.not_before.get(rec.name, 0.0)

    def _start_due(self, pod: dict) -> None:
        defs = self._container_defs(pod)
        for rec in self.init_records:
            if rec.state == "terminated" and rec.exit_code == 0:
                continue
            if self._due(rec):
                self._start(pod, rec, defs[rec.name])
            return  # one init container at a time; main containers wait for all
        for rec in self.records:
            if self._due(rec):
                self._start(pod, rec, defs[rec.name])

    def _start(self, pod: dict, rec: ContainerRecord, cdef: dict) -> None:
        spec = pod.get("spec") or {}
        try:
            env = container_env(pod, cdef, self.source, pod_ip=self.pod_ip, host_ip=self.node.spec.internal_ip,
                                node_allocatable=self.node.spec.capacity(), cluster_env=self.ctx.cluster_env)
        except ContainerConfigError as e:
            if rec.message != str(e):
                emit_event(self.ctx.kube, pod, self.node.spec.name, "Failed", f"Error: {e}", warning=True, container=rec.name)
            rec.reason, rec.message = e.reason, str(e)
            self.not_before[rec.name] = time.monotonic() + CONFIG_RETRY_SECONDS
            return
        hostname = _hostname(pod)
        full_env = {**self.ctx.image_env, "HOSTNAME": hostname, **env}
        run_dir = self.pod_dir / "containers" / rec.name
        try:
            argv = container_argv(cdef, env)
            mounts = self._mounts(pod, cdef, env, run_dir)
            for m in mounts:
                self.ctx.mountpoints.ensure(m.target, os.path.isdir(m.source))
            log_file = claim_log(self.ctx.state_dir, self.namespace, self.name, rec.name, self.uid)
        except (ContainerConfigError, VolumeError, MountPointError, OSError) as e:
            self._start_failed(pod, rec, str(e))
            return
        launch = LaunchSpec(
            argv=argv, env=full_env, cwd=expand(cdef.get("workingDir") or "/", env),
            hostname=None if spec.get("hostNetwork") else hostname,
            netns=self.net.netns_path if self.net else None, mounts=mounts, detach=self.ctx.detach,
        )
        if rec.last_terminated is not None:  # a previous run exists: this start is a restart
            rec.restart_count += 1
        proc = ContainerProcess(launch, run_dir, log_file)
        self.procs[rec.name] = proc
        self.envs[rec.name] = full_env
        rec.state, rec.reason, rec.message, rec.exit_code = "running", "", "", None
        rec.started_at = rfc3339(proc.started_wall)
        rec.container_id = f"rljob://{self.uid[:8]}-{rec.name}-{rec.restart_count}"
        rec.ready = cdef.get("readinessProbe") is None
        if cdef.get("readinessProbe"):
            self.readiness[rec.name] = ProbeTracker(cdef["readinessProbe"], proc.started_mono, initial=False)
        if cdef.get("livenessProbe"):
            self.liveness[rec.name] = ProbeTracker(cdef["livenessProbe"], proc.started_mono, initial=True)
        emit_event(self.ctx.kube, pod, self.node.spec.name, "Started", f"Started container {rec.name}", container=rec.name)

    def _start_failed(self, pod: dict, rec: ContainerRecord, message: str) -> None:
        """The command cannot be started at all: terminated, reason StartError, exit code 128 (as
        kubelet reports a runtime start failure); restartPolicy then applies as for any exit."""
        now = rfc3339()
        rec.state, rec.reason, rec.message, rec.exit_code = "terminated", "StartError", message, 128
        rec.started_at = rec.finished_at = now
        emit_event(self.ctx.kube, pod, self.node.spec.name, "Failed", f"Error: {message}", warning=True, container=rec.name)
        policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
        is_init = rec in self.init_records
        if self._should_restart(rec, is_init, policy):
            self._schedule_restart(rec, self._backoff_delay(rec, 0.0))

    def _mounts(self, pod: dict, cdef: dict, env: dict[str, str], run_dir: Path) -> list[Mount]:
        spec = pod.get("spec") or {}
        run_dir.mkdir(parents=True, exist_ok=True)
        term_log = run_dir / "termination-log"
        term_log.write_bytes(b"")
        mounts = [Mount(str(self.pod_dir / "hostname"), "/etc/hostname"),
                  Mount(str(term_log), cdef.get("terminationMessagePath") or "/dev/termination-log")]
        if not spec.get("hostNetwork"):
            mounts += [Mount(str(self.pod_dir / "hosts"), "/etc/hosts"),
                       Mount(str(self.pod_dir / "resolv.conf"), "/etc/resolv.conf")]
        mounts += container_mounts(cdef, self.volumes.dirs or {}, self.volumes.read_only, env)
        mounts += image_mounts(self.ctx.image_paths, mounts)
        return sorted(mounts, key=lambda m: len(Path(m.target).parts))

    # ------------------------------------------------------------------ probes
    def _probe(self, pod: dict) -> None:
        defs = self._container_defs(pod)
        for rec in self.records:
            proc = self.procs.get(rec.name)
            if rec.state != "running" or proc is None:
                continue
            cdef = defs[rec.name]
            for tracker in (self.readiness.get(rec.name), self.liveness.get(rec.name)):
                if tracker and tracker.due():
                    ok, msg = run_probe(tracker.probe, container=cdef, pod_ip=self.pod_ip, pid1=proc.pid1(),
                                        env=self.envs.get(rec.name, {}))
                    tracker.record(ok, msg)
            if rec.name in self.readiness:
                rec.ready = self.readiness[rec.name].ok
            live = self.liveness.get(rec.name)
            if live is not None and not live.ok:
                emit_event(self.ctx.kube, pod, self.node.spec.name, "Killing",
                           f"Container {rec.name} failed liveness probe, will be restarted: {live.message}",
                           container=rec.name)
                grace = live.probe.get("terminationGracePeriodSeconds",
                                       (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                self._stop_processes([proc], float(grace))
        self._reap(pod)

    # ------------------------------------------------------------------ status
    def _report(self, pod: dict) -> str:
        status = pod_status(
            {**pod, "status": self.last_status or pod.get("status") or {}},
            init=self.init_records, main=self.records, pod_ip=self.pod_ip,
            host_ip=self.node.spec.internal_ip, start_time=self.start_time or rfc3339(),
            sandbox_ready=bool(self.pod_ip) and self.volumes.dirs is not None,
        )
        if status != self.last_status and not self.node.lost and not self._abandon:
            try:
                self.ctx.kube.patch(pod_path(self.namespace, self.name, "status"), status_patch(status))
                self.last_status = status
            except ApiException as e:
                if e.status == 404:
                    self.update(None)
                else:
                    log.warning("pod %s/%s: status patch failed: %s %s %s", self.namespace, self.name, e.status,
                                e.reason, e.body)
        return status["phase"]

    # ------------------------------------------------------------------ termination
    @staticmethod
    def _stop_processes(procs: list[ContainerProcess], grace: float) -> None:
        """SIGTERM each, wait up to ``grace`` seconds for all, SIGKILL the rest."""
        for p in procs:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()

    def _terminate(self, grace: float) -> None:
        self._stop_processes(list(self.procs.values()), grace)

    def _kill_all(self) -> None:
        for p in self.procs.values():
            p.kill()

    def _teardown(self) -> None:
        """Remove what the sandbox holds: processes, hosts registration, network, tmpfs, pod dir."""
        self._kill_all()
        self.procs.clear()
        self.ctx.hosts.unregister(self.uid)
        if self.net is not None:
            self.net.delete()
            self.net = None
        self.node.allocator.release(self.uid)
        self.volumes.teardown()
        shutil.rmtree(self.pod_dir, ignore_errors=True)

    def _delete_from_api(self) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            self.ctx.kube.delete(pod_path(self.namespace, self.name), body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise
