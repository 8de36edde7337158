"""Operator scale: many suspended RLTrainingJobs on a real control plane, then a few running ones.

Starts everything it measures and stops it again (also on an error or Ctrl-C): the local control plane
(:class:`rljob_localcluster.ControlPlane`, with a kube-apiserver audit log of every write), one shared
redis-server with a password (the external Redis of every job), and ``rljob operator --all-namespaces`` as a
local process under its own client-certificate identity, so the audit log tells its requests apart.

Phases and figures:

1. ``--jobs`` RLTrainingJobs with ``runPolicy.suspend: true`` and ``redis.mode: external`` are created one after
   the other as fast as the API server takes them. A watch on ConfigMaps, Services, Secrets, Deployments and
   Pods carrying the ``rljob.dev/job-name`` label timestamps each child; the latency of a job is from just
   before its create request to the moment its last expected child is seen (seconds; the expected children
   come from :func:`rljob_operator.render.static_children`, so the benchmark follows the renderer). p50/p95.
   Also the operator's writes the API server refused (409 Conflict: a status written from a stale view) per new
   job, from the audit log; target zero (phase 4 counts them for running jobs too).
2. Once every job is Suspended and the operator has been quiet for a few seconds: ``--idle-minutes`` of
   idleness. Every write (POST/PUT/PATCH/DELETE) the operator's identity makes in the jobs' namespace is
   counted from the audit log (kopf's finalizer and annotation patches and Events included), divided by jobs
   and minutes. A suspended job has no real status change, so the target is zero. The operator's own
   reconcile-pass counter shows the idle passes did run.
3. The operator is restarted once (SIGTERM, then a fresh process): writes per idle job caused by the restart,
   and which conditions changed; the new process's reads (GET, from its ``rljob_operator_api_requests_total``)
   and how long it took to make one pass per job.
4. ``--active-jobs`` unsuspended tiny jobs (managed Redis: 2 trainer pods, 1 rollout pod, 1 Redis pod made by
   the Deployment controller): create → every pod created (no nodes, so pods stay Pending), and create →
   the operator's own pods (trainer and rollout).

Operator memory: VmRSS of its process from /proc (MB = 10^6 bytes), with no jobs, the highest during the
idle window, and the kernel's peak (VmHWM) of each operator process. Operator CPU while idle: utime + stime
over the window (% of one core). Targets: p50 < 1 s, p95 < 3 s, zero writes per idle job, zero refused writes
per new job, RSS < 250 MB.

    python benchmarks/operator_scale.py --quick        # 20 jobs, 30 s idle, operator idle interval 10 s
    python benchmarks/operator_scale.py                # 200 jobs, 2 idle minutes
    python benchmarks/operator_scale.py --jobs 500 --idle-minutes 5 --keep-logs /tmp/scale

Exit status 0 when every figure meets its target, 1 otherwise, 2 on an error, 130 when interrupted (the
figures measured so far are printed in every case). Results and the
operator problems they showed: docs/operator-scale.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import redis
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch

from rljob_api import constants as c
from rljob_api import names
from rljob_api.spec import RLTrainingJobSpec
from rljob_operator import render
from rljob_operator.crd import crd_yaml
from rljob_operator.settings import OperatorOptions
from rljob_localcluster import ControlPlane

OPERATOR_USER = "rljob-operator-bench"
"""Client-certificate user of the operator process (group system:masters); audit records are filtered by it."""
IDLE_NS, ACTIVE_NS = "scale-idle", "scale-active"
REDIS_SECRET, REDIS_SECRET_KEY = "shared-redis", "password"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "verbs": sorted(WRITE_VERBS)}, {"level": "None"}],
}
QUIET_S = 5.0
"""The operator counts as settled after this many seconds without a write in the idle namespace."""
MB = 1e6

TARGET_P50_S, TARGET_P95_S, TARGET_RSS_MB, TARGET_IDLE_WRITES = 1.0, 3.0, 250.0, 0.0


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], Any], what: str, timeout_s: float, every_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy.

    Raises:
        TimeoutError: ``timeout_s`` seconds passed; the message names ``what`` and the last value.
    """
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc`` (one we started), SIGKILL after ``grace_s`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- processes we start ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[tuple[str, str]]:
    """Debian's redis-server with a password on a free loopback port; yields (url, password)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port, password = free_port(), secrets.token_urlsafe(16)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password, "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: proc.poll() is not None or _redis_answers(port, password), "redis-server", 20, 0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        yield f"redis://127.0.0.1:{port}/0", password
    finally:
        stop_process(proc, 10)


def _redis_answers(port: int, password: str) -> bool:
    try:
        return bool(redis.Redis(port=port, password=password, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def redis_clients(url: str, password: str) -> int:
    """Connected clients of the shared Redis (INFO clients), minus this one."""
    return int(redis.Redis.from_url(url, password=password).info("clients")["connected_clients"]) - 1


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB (10^6 bytes): resident memory now and its peak so far."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / MB  # /proc reports kB (KiB)
    return fields["VmRSS"], fields["VmHWM"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used so far (seconds; /proc/<pid>/stat utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class OperatorProcess:
    """``python -m rljob_operator.cli operator --all-namespaces`` with its own kubeconfig and log file."""

    def __init__(self, kubeconfig: str, log: Path, idle_interval_s: Optional[float]) -> None:
        self.liveness, self.metrics = free_port(), free_port()
        args = [sys.executable, "-m", "rljob_operator.cli", "operator", "--all-namespaces",
                f"--liveness-port={self.liveness}", f"--metrics-port={self.metrics}"]
        if idle_interval_s is not None:
            args.append(f"--idle-interval={idle_interval_s}")
        self.log = log
        with log.open("a") as out:
            self.proc = subprocess.Popen(
                args, env={**os.environ, "KUBECONFIG": kubeconfig}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the benchmark only; it stops the operator in order
            )
        self.peak_mb = 0.0
        wait_for(self._alive, "the operator's /healthz", 90, 0.3)

    def _get(self, port: int, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.read().decode()

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.proc.returncode}; log: {self.log}")
        try:
            self._get(self.liveness, "/healthz")
            return True
        except OSError:
            return False

    def rss_mb(self) -> float:
        """Resident memory now (MB); remembers the process's peak (VmHWM)."""
        rss, hwm = rss_mb(self.proc.pid)
        self.peak_mb = max(self.peak_mb, hwm)
        return rss

    def passes(self) -> float:
        """Reconcile passes so far (rljob_operator_reconcile_duration_seconds_count)."""
        for line in self._get(self.metrics, "/metrics").splitlines():
            if line.startswith("rljob_operator_reconcile_duration_seconds_count"):
                return float(line.split()[-1])
        return 0.0

    def api_requests(self) -> Counter:
        """The operator's own API requests so far by "verb resource" (rljob_operator_api_requests_total): reads
        included, which the audit log (writes only) does not show."""
        found: Counter = Counter()
        for line in self._get(self.metrics, "/metrics").splitlines():
            if line.startswith("rljob_operator_api_requests_total{"):
                labels = {key: value.strip('"') for key, value in
                          (kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))}
                found[f"{labels['verb']} {labels['resource']}"] += int(float(line.split()[-1]))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, KeyError):
                self.rss_mb()
        stop_process(self.proc, 30)


# --- what the API server saw ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Write:
    """One audited write: who, verb, object (resource/subresource, namespace, name), when (Unix seconds)."""

    user: str
    verb: str
    resource: str
    namespace: str
    name: str
    at: float
    code: int

    @property
    def what(self) -> str:
        return f"{self.verb} {self.resource}"


class AuditLog:
    """kube-apiserver's audit log of writes (Metadata level, one JSON object per line)."""

    def __init__(self, workdir: Path) -> None:
        self.policy = workdir / "audit-policy.json"
        self.path = workdir / "audit.log"
        self.policy.write_text(json.dumps(AUDIT_POLICY))

    def apiserver_args(self) -> list[str]:
        return [f"--audit-policy-file={self.policy}", f"--audit-log-path={self.path}", "--audit-log-maxbackup=0",
                "--audit-log-maxsize=0"]

    def writes(self, user: str = OPERATOR_USER) -> list[Write]:
        """Every completed write by ``user`` so far."""
        found = []
        if not self.path.exists():
            return found
        with self.path.open() as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line being written
                if record.get("stage") != "ResponseComplete" or record.get("verb") not in WRITE_VERBS:
                    continue
                if record.get("user", {}).get("username") != user:
                    continue
                ref = record.get("objectRef", {})
                resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
                found.append(Write(user, record["verb"], resource, ref.get("namespace", ""), ref.get("name", ""),
                                   datetime.fromisoformat(record["stageTimestamp"]).timestamp(),
                                   int(record.get("responseStatus", {}).get("code", 0))))
        return found


def window(writes: list[Write], start: float, end: float, namespace: Optional[str] = None) -> list[Write]:
    """Writes in [start, end) (Unix seconds), in ``namespace`` when given."""
    return [w for w in writes if start <= w.at < end and (namespace is None or w.namespace == namespace)]


def breakdown(writes: list[Write]) -> str:
    """"patch rltrainingjobs/status ×60 (20 refused), create events ×40": writes by verb and resource, with how
    many the API server refused (409 conflicts and other non-2xx answers; still requests it had to serve)."""
    total = Counter(w.what for w in writes)
    refused = Counter(w.what for w in writes if w.code >= 300)
    return ", ".join(f"{what} ×{n}" + (f" ({refused[what]} refused)" if refused[what] else "")
                     for what, n in total.most_common()) or "none"


class ChildWatch:
    """Watches of every kind of child (label ``rljob.dev/job-name`` present, all namespaces), one thread each.

    ``seen[(namespace, job label, kind, role)]`` lists the monotonic times (seconds) at which children of that
    job, kind and role were first seen.
    """

    def __init__(self, kubeconfig: str) -> None:
        self.seen: dict[tuple[str, str, str, str], list[float]] = {}
        self._first: set[str] = set()  # uids already seen
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watches: list[k8s_watch.Watch] = []
        self.errors: list[str] = []
        for kind, lister in (("ConfigMap", "CoreV1Api.list_config_map_for_all_namespaces"),
                             ("Service", "CoreV1Api.list_service_for_all_namespaces"),
                             ("Secret", "CoreV1Api.list_secret_for_all_namespaces"),
                             ("Pod", "CoreV1Api.list_pod_for_all_namespaces"),
                             ("Deployment", "AppsV1Api.list_deployment_for_all_namespaces")):
            api_name, method = lister.split(".")
            api = getattr(k8s, api_name)(k8s_config.new_client_from_config(config_file=kubeconfig))
            threading.Thread(target=self._run, args=(kind, getattr(api, method)), daemon=True,
                             name=f"watch-{kind}").start()

    def _run(self, kind: str, list_fn) -> None:
        while not self._stopping.is_set():
            watch = k8s_watch.Watch()
            self._watches.append(watch)
            try:
                for event in watch.stream(list_fn, label_selector=c.LABEL_JOB_NAME, timeout_seconds=240):
                    now = time.monotonic()
                    meta = event["object"].metadata
                    labels = meta.labels or {}
                    with self._lock:
                        if meta.uid in self._first:
                            continue
                        self._first.add(meta.uid)
                        self.seen.setdefault(
                            (meta.namespace, labels.get(c.LABEL_JOB_NAME, ""), kind, labels.get(c.LABEL_ROLE, "")), []
                        ).append(now)
            except Exception as err:  # noqa: BLE001 - the control plane stopping ends the stream this way
                if not self._stopping.is_set():
                    self.errors.append(f"{kind}: {type(err).__name__}: {err}")
                    time.sleep(0.5)

    def done_at(self, namespace: str, job: str, expected: Counter) -> Optional[float]:
        """When the last expected child of ``job`` was seen (monotonic seconds), or None if one is missing."""
        label = names.job_label(job)
        times = []
        with self._lock:
            for (kind, role), count in expected.items():
                seen = sorted(self.seen.get((namespace, label, kind, role), []))
                if len(seen) < count:
                    return None
                times.append(seen[count - 1])
        return max(times)

    def stop(self) -> None:
        self._stopping.set()
        for watch in self._watches:
            watch.stop()


# --- jobs -----------------------------------------------------------------------------------------------------
def suspended_job(name: str, redis_url: str) -> dict[str, Any]:
    """A suspended job on the shared external Redis (2 trainer pods, 1 rollout pod when resumed)."""
    return _job(name, {
        "trainer": {"nodes": 2, "batch": {"documentsPerStep": 64}},
        "rollout": {"replicas": 1},
        "redis": {"mode": "external", "url": redis_url,
                  "passwordSecretRef": {"name": REDIS_SECRET, "key": REDIS_SECRET_KEY}},
        "runPolicy": {"suspend": True},
    })


def tiny_job(name: str) -> dict[str, Any]:
    """A running tiny job with managed Redis: 2 trainer pods, 1 rollout pod, 1 Redis pod."""
    return _job(name, {"trainer": {"nodes": 2, "batch": {"documentsPerStep": 64}}, "rollout": {"replicas": 1}})


def _job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
            "spec": {"model": {"source": "tiny"}, **spec}}


def expected_children(namespace: str, manifest: dict[str, Any]) -> Counter:
    """Children the operator makes for ``manifest``, as counts of (kind, role label): what
    :mod:`rljob_operator.render` renders (ConfigMap, Services, the managed Redis Secret and Deployment), plus,
    unless suspended, the trainer and rollout pods and the pods of each Deployment's template."""
    job = render.Job(manifest["metadata"]["name"], namespace, RLTrainingJobSpec.model_validate(manifest["spec"]), {})
    config = render.job_config(job)
    objects = render.static_children(job, config)
    if job.spec.redis.mode == "managed":
        objects.append(render.redis_secret(job, "unused"))
    if not job.spec.run_policy.suspend:
        objects += [render.trainer_pod(job, config, i, 0) for i in range(job.spec.trainer.nodes)]
        objects += [render.rollout_pod(job, config, i) for i in range(job.spec.rollout.replicas)]
        for deployment in [o for o in objects if o["kind"] == "Deployment"]:
            template = deployment["spec"]["template"]
            objects += [{"kind": "Pod", **template}] * deployment["spec"]["replicas"]
    return Counter((o["kind"], o["metadata"]["labels"][c.LABEL_ROLE]) for o in objects)


def create_jobs(api: k8s.CustomObjectsApi, namespace: str, manifests: list[dict[str, Any]]) -> dict[str, float]:
    """Create the jobs one after the other; returns name → monotonic time just before its create request."""
    started = {}
    for manifest in manifests:
        started[manifest["metadata"]["name"]] = time.monotonic()
        api.create_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, manifest)
    return started


def latencies(watch: ChildWatch, namespace: str, manifests: list[dict[str, Any]], started: dict[str, float],
              kinds: Optional[set[str]], timeout_s: float, roles: Optional[set[str]] = None) -> list[float]:
    """Per job: seconds from its create request to its last expected child (of ``kinds`` and ``roles``, or all)
    seen."""
    expected = {}
    for m in manifests:
        counts = expected_children(namespace, m)
        expected[m["metadata"]["name"]] = Counter({
            (kind, role): n for (kind, role), n in counts.items()
            if (kinds is None or kind in kinds) and (roles is None or role in roles)
        })

    def all_done():
        done = {name: watch.done_at(namespace, name, want) for name, want in expected.items()}
        missing = sorted(name for name, at in done.items() if at is None)
        return done if not missing else None

    try:
        done = wait_for(all_done, f"the children of {len(manifests)} jobs in {namespace}", timeout_s, 0.5)
    except TimeoutError:
        missing = [n for n, want in expected.items() if watch.done_at(namespace, n, want) is None]
        raise TimeoutError(f"{len(missing)} jobs still miss children after {timeout_s:.0f} s, e.g. {missing[:5]}; "
                           f"watch errors: {watch.errors[:3]}") from None
    return [done[name] - started[name] for name in expected]


def phases(api: k8s.CustomObjectsApi, namespace: str) -> Counter:
    jobs = api.list_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL)["items"]
    return Counter((job.get("status") or {}).get("phase", "none") for job in jobs)


def conditions(api: k8s.CustomObjectsApi, namespace: str) -> dict[str, dict[str, str]]:
    """job name → {condition type: "status/reason"} (plus "phase")."""
    found = {}
    for job in api.list_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL)["items"]:
        status = job.get("status") or {}
        found[job["metadata"]["name"]] = {
            "phase": status.get("phase", ""),
            **{cond["type"]: f"{cond['status']}/{cond['reason']}" for cond in status.get("conditions", [])},
        }
    return found


def changes(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> str:
    """What changed between two :func:`conditions` snapshots, e.g. "RedisReady True/RedisAvailable →
    Unknown/RedisUnavailable in 20 jobs"."""
    seen = Counter(f"{key} {old.get(key, '-')} → {new.get(key, '-')}"
                   for name, new in after.items() for old in [before.get(name, {})]
                   for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key))
    return "; ".join(f"{change} in {n} jobs" for change, n in seen.most_common()) or "no status change"


def wait_quiet(audit: AuditLog, namespace: str, timeout_s: float, since: float = 0.0) -> float:
    """Wait until the operator made no write in ``namespace`` for :data:`QUIET_S` seconds counted from its last
    write or ``since`` (Unix seconds), whichever is later; returns that moment."""
    def quiet():
        last = max([w.at for w in audit.writes() if w.namespace == namespace] + [since])
        return last if time.time() - last >= QUIET_S else None

    return wait_for(quiet, f"the operator to stop writing in {namespace}", timeout_s, 1.0)


# --- report ---------------------------------------------------------------------------------------------------
@dataclass
class Figure:
    """One row of the table: ``target`` None = reported for information only."""

    name: str
    value: float
    unit: str
    target: Optional[float] = None
    note: str = ""

    @property
    def passed(self) -> Optional[bool]:
        if self.target is None:
            return None
        return self.value <= self.target if self.target == 0 else self.value < self.target

    def row(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        value = f"{self.value:.3g}" if abs(self.value) < 1000 else f"{self.value:.0f}"
        target = "—" if self.target is None else ("0" if self.target == 0 else f"< {self.target:g}{unit}")
        result = {None: "info", True: "PASS", False: "**FAIL**"}[self.passed]
        return f"| {self.name} | {value}{unit} | {target} | {result} | {self.note} |"


def table(figures: list[Figure]) -> str:
    """The figures as a markdown table (also readable as plain text)."""
    lines = ["| figure | value | target | result | notes |", "| --- | --- | --- | --- | --- |"]
    return "\n".join(lines + [f.row() for f in figures])


def refused_figure(kind: str, writes: list[Write], jobs: int) -> Figure:
    """Writes the API server refused (409 Conflict and other non-2xx answers) per new job of ``kind``; target 0."""
    refused = [w for w in writes if w.code >= 300]
    return Figure(f"refused operator writes per new {kind} job", len(refused) / jobs, "", TARGET_IDLE_WRITES,
                  f"{len(refused)} of {len(writes)} writes ({breakdown(refused)})")


def percentiles(name: str, values: list[float], what: str) -> list[Figure]:
    p50, p95 = np.percentile(values, [50, 95])
    return [Figure(f"{name} p50", float(p50), "s", TARGET_P50_S, what),
            Figure(f"{name} p95", float(p95), "s", TARGET_P95_S, f"max {max(values):.2f} s over {len(values)} jobs")]


# --- the run --------------------------------------------------------------------------------------------------
@dataclass
class Options:
    """The command line: job counts, the idle window (seconds) and the operator's idle interval (seconds;
    None = the operator's default)."""

    jobs: int
    idle_s: float
    active_jobs: int
    idle_interval_s: Optional[float]
    restart_check: bool
    keep_logs: Optional[Path]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def established(cp: ControlPlane, crd: str) -> None:
    """Wait until the CRD ``crd`` is Established, polled: ``kubectl wait --for=condition=Established`` fails at once on
    a CRD that has no conditions yet (as a large one right after its apply).

    Raises:
        TimeoutError: not Established within 60 s.
    """
    def conditions() -> list[dict]:
        found = cp.kubectl("get", "crd", crd, "-o", "json", check=False)
        return ((json.loads(found.stdout).get("status") or {}).get("conditions") or []) if found.returncode == 0 else []

    wait_for(lambda: any(cond["type"] == "Established" and cond["status"] == "True" for cond in conditions()),
             f"CRD {crd} Established", timeout_s=60.0, every_s=0.3)


def run(opts: Options, workdir: Path, figures: list[Figure]) -> None:
    """Every phase of the module docstring, appending to ``figures`` as they are measured (so a failed run
    still reports what it got). Everything started is stopped on exit."""
    audit = AuditLog(workdir)
    with contextlib.ExitStack() as stack:
        url, password = stack.enter_context(redis_server(workdir))
        log("starting the control plane")
        cp = stack.enter_context(ControlPlane(extra_args={"kube-apiserver": audit.apiserver_args()},
                                              start_timeout=300))
        cp.kubectl("apply", "--server-side", "-f", "-", input=crd_yaml())
        established(cp, c.CRD_NAME)
        for namespace in (IDLE_NS, ACTIVE_NS):
            cp.kubectl("create", "namespace", namespace)
        cp.kubectl("create", "secret", "generic", REDIS_SECRET, "-n", IDLE_NS,
                   f"--from-literal={REDIS_SECRET_KEY}={password}")
        operator_kubeconfig = cp.write_kubeconfig(workdir / "operator.kubeconfig", OPERATOR_USER, ["system:masters"])
        custom = k8s.CustomObjectsApi(k8s_config.new_client_from_config(config_file=cp.kubeconfig))

        log("starting the operator")
        operator = OperatorProcess(operator_kubeconfig, workdir / "operator.log", opts.idle_interval_s)
        stack.callback(lambda: operator.stop())  # late binding: the process running then, also after a restart
        time.sleep(2)
        empty_mb = operator.rss_mb()
        watch = ChildWatch(cp.kubeconfig)
        stack.callback(watch.stop)
        time.sleep(2)  # the watches connect before the first create

        # 1. create → children
        log(f"creating {opts.jobs} suspended jobs")
        manifests = [suspended_job(f"idle-{i:04d}", url) for i in range(opts.jobs)]
        t_create = time.time()
        started = create_jobs(custom, IDLE_NS, manifests)
        created_s = time.monotonic() - started[manifests[0]["metadata"]["name"]]
        lat = latencies(watch, IDLE_NS, manifests, started, None, timeout_s=120 + opts.jobs)
        kinds = "+".join(sorted({k for k, _ in expected_children(IDLE_NS, manifests[0])}))
        figures += percentiles("suspended job: create → children", lat,
                               f"{kinds} per job; {opts.jobs} creates took {created_s:.1f} s")

        # 2. idle
        wait_for(lambda: phases(custom, IDLE_NS) == Counter({"Suspended": opts.jobs}) or None,
                 f"{opts.jobs} jobs Suspended", 60 + opts.jobs * 0.5, 1.0)
        settled = wait_quiet(audit, IDLE_NS, 120 + opts.jobs)
        creation_writes = window(audit.writes(), t_create - 1, settled + 1, IDLE_NS)
        log(f"settled; idle for {opts.idle_s:.0f} s")
        passes_before, cpu_before, idle_start = operator.passes(), cpu_seconds(operator.proc.pid), time.time()
        idle_rss = []
        while time.time() - idle_start < opts.idle_s:
            idle_rss.append(operator.rss_mb())
            time.sleep(min(1.0, max(0.0, opts.idle_s - (time.time() - idle_start))))
        idle_end = time.time()
        idle_rss.append(operator.rss_mb())
        idle_passes = operator.passes() - passes_before
        idle_cpu = (cpu_seconds(operator.proc.pid) - cpu_before) / (idle_end - idle_start)
        idle_writes = window(audit.writes(), idle_start, idle_end, IDLE_NS)
        other_writes = [w for w in window(audit.writes(), idle_start, idle_end) if w.namespace != IDLE_NS]
        minutes = (idle_end - idle_start) / 60
        figures += [
            Figure("operator writes per suspended job while creating", len(creation_writes) / opts.jobs, "",
                   note=breakdown(creation_writes)),
            refused_figure("suspended", creation_writes, opts.jobs),
            Figure("operator writes per idle job per minute", len(idle_writes) / opts.jobs / minutes, "",
                   TARGET_IDLE_WRITES,
                   f"{len(idle_writes)} writes in {minutes:.1f} min ({breakdown(idle_writes)}); "
                   f"{idle_passes:.0f} reconcile passes ran"),
            Figure("operator CPU while idle", 100 * idle_cpu, "% of a core", note="user + system time / wall time"),
            Figure("operator writes elsewhere while idle, per minute", len(other_writes) / minutes, "",
                   note=breakdown(other_writes)),
            Figure("shared Redis connections held by the operator", redis_clients(url, password), "",
                   note=f"for {opts.jobs} suspended jobs"),
        ]

        # 3. restart
        if opts.restart_check:
            log("restarting the operator")
            before = conditions(custom, IDLE_NS)
            first = operator
            first.stop()
            peak_first = first.peak_mb
            restart_at = time.time()
            operator = OperatorProcess(operator_kubeconfig, workdir / "operator.log", opts.idle_interval_s)
            # each job's daemon runs one pass at start; then the writes it caused trail off
            wait_for(lambda: operator.passes() >= opts.jobs, f"{opts.jobs} passes after the restart", 60 + opts.jobs)
            one_pass_each_s = time.time() - restart_at
            quiet = wait_quiet(audit, IDLE_NS, 120 + opts.jobs, since=time.time())
            restart_writes = window(audit.writes(), restart_at, quiet + 1, IDLE_NS)
            requests = operator.api_requests()
            reads = Counter({what: n for what, n in requests.items() if what.startswith("get ")})
            figures += [
                Figure("operator writes per idle job after a restart", len(restart_writes) / opts.jobs,
                       "", TARGET_IDLE_WRITES,
                       f"{breakdown(restart_writes)}; {changes(before, conditions(custom, IDLE_NS))}"),
                Figure("operator reads per idle job after a restart", sum(reads.values()) / opts.jobs, "",
                       note=", ".join(f"{what} ×{n}" for what, n in reads.most_common()) or "none"),
                Figure("operator restart → one pass per job", one_pass_each_s, "s",
                       note=f"{opts.jobs} jobs; includes the new process's start"),
            ]
        else:
            peak_first = 0.0

        # 4. running tiny jobs
        if opts.active_jobs:
            log(f"creating {opts.active_jobs} running tiny jobs")
            active = [tiny_job(f"tiny-{i}") for i in range(opts.active_jobs)]
            t_active = time.time()
            started = create_jobs(custom, ACTIVE_NS, active)
            lat = latencies(watch, ACTIVE_NS, active, started, {"Pod"}, timeout_s=180)
            roles = expected_children(ACTIVE_NS, active[0])
            pods = ", ".join(f"{n} {role}" for (kind, role), n in sorted(roles.items()) if kind == "Pod")
            figures += percentiles("running tiny job: create → every pod", lat, f"pods per job: {pods}")
            own = np.percentile(latencies(watch, ACTIVE_NS, active, started, {"Pod"}, 30, {"trainer", "rollout"}),
                                [50, 95])
            figures.append(Figure("running tiny job: create → the operator's own pods p50", float(own[0]), "s",
                                  note=f"trainer and rollout pods (not the Redis pod of the ReplicaSet controller); "
                                       f"p95 {own[1]:.3f} s"))
            time.sleep(5)
            figures.append(refused_figure("running", window(audit.writes(), t_active - 1, time.time(), ACTIVE_NS),
                                          opts.active_jobs))

        operator.rss_mb()
        figures += [
            Figure("operator RSS with no jobs", empty_mb, "MB"),
            Figure("operator RSS while idle (highest sample)", max(idle_rss), "MB", TARGET_RSS_MB,
                   f"{opts.jobs} suspended jobs; +{(max(idle_rss) - empty_mb) * 1e3 / opts.jobs:.0f} kB per job; "
                   f"{idle_rss[0]:.0f} MB at the start of the window, {idle_rss[-1]:.0f} MB at its end"),
            Figure("operator RSS peak (VmHWM)", max(operator.peak_mb, peak_first), "MB", TARGET_RSS_MB,
                   f"first process {peak_first:.0f} MB, after the restart {operator.peak_mb:.0f} MB"
                   if opts.restart_check else "whole run"),
        ]
        if opts.keep_logs:
            opts.keep_logs.mkdir(parents=True, exist_ok=True)
            operator.stop()
            for path in (workdir / "operator.log", audit.path):
                shutil.copy(path, opts.keep_logs / path.name)
            for component in cp.log_dir.glob("*.log"):
                shutil.copy(component, opts.keep_logs / component.name)
        log("stopping")


def parse_args(argv: Optional[list[str]] = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="suspended jobs (default 200)")
    parser.add_argument("--idle-minutes", type=float, default=2.0, help="idle window in minutes (default 2)")
    parser.add_argument("--active-jobs", type=int, default=5, help="running tiny jobs (default 5)")
    parser.add_argument("--operator-idle-interval", type=float, default=None,
                        help="the operator's --idle-interval in seconds (default: the operator's own, 60)")
    parser.add_argument("--quick", action="store_true",
                        help="20 jobs, 30 s idle, operator idle interval 10 s (each job still gets idle passes)")
    parser.add_argument("--no-restart-check", action="store_true", help="skip the operator restart phase")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="copy the operator log, the audit log and the component logs here")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.idle_minutes = 20, 0.5
        args.operator_idle_interval = args.operator_idle_interval or 10.0
    if args.jobs < 1 or args.idle_minutes <= 0 or args.active_jobs < 0:
        parser.error("--jobs must be >= 1, --idle-minutes > 0 and --active-jobs >= 0")
    return Options(args.jobs, args.idle_minutes * 60, args.active_jobs, args.operator_idle_interval,
                   not args.no_restart_check, args.keep_logs)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse_args(argv)
    # SIGTERM ends the run like Ctrl-C does: the ExitStack in run() stops what it started.
    signal.signal(signal.SIGTERM, _interrupt)
    load = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="rljob-operator-scale-"))
    figures: list[Figure] = []
    status = None
    try:
        run(opts, workdir, figures)
    except KeyboardInterrupt:
        log("interrupted; everything this run started is stopped")
        status = 130
    except Exception as err:  # report the figures measured so far, then the error
        traceback.print_exc()
        log(f"failed: {type(err).__name__}: {err}; everything this run started is stopped")
        status = 2
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    interval = opts.idle_interval_s or OperatorOptions().idle_interval_s
    print(f"\noperator scale, {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {os.cpu_count()} CPUs, "
          f"{opts.jobs} suspended jobs, {opts.idle_s / 60:g} idle min, {opts.active_jobs} running jobs, "
          f"operator idle interval {interval:g} s, load average {load:.1f} at start"
          + ("" if status is None else " (INCOMPLETE: the run stopped early)") + "\n")
    print(table(figures))
    if status is not None:
        return status
    return 0 if all(f.passed is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
