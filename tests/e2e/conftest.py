"""Fixtures of the end-to-end suite: a cluster, the operator installed with helm, and helpers to drive it.

``--cluster=local`` (default): the project's real control plane (``rljob_localcluster.ControlPlane``:
kube-apiserver, etcd, kube-controller-manager, kube-scheduler built from source) and two real nodes
(``rljob_localcluster.nodes.LocalNodes``: upstream kubelet + containerd + runc + CNI, kube-proxy, CoreDNS, four
fake ``nvidia.com/gpu`` each) running the images built from the project's Dockerfiles
(``localcluster/build-images.sh``). Both are stopped when the suite ends, also on failure. Needs root, the cached
Go tools and the images (``scripts/setup.sh`` builds both).

``--cluster=existing``: whatever cluster ``KUBECONFIG`` points at (kind: ``tests/e2e/kind/run.sh``), with the
operator image given by ``--operator-image``.

The operator always runs as a pod under its own ServiceAccount (``helm install`` of ``helm/rljob-operator``),
so a missing RBAC rule fails the suite. Every test gets its own namespace; on a failure the assertion message
carries the job's status, the namespace's pods and Events, and the operator's and pods' logs.

Run: ``python -m pytest -q tests/e2e`` (``-m e2e`` selects the suite from the whole tree).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes import watch as kube_watch
from rljob_api import constants as c
from rljob_api import protocol
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rljob-operator"
EXAMPLES = ROOT / "examples"
RELEASE = "rljob-operator"
OPERATOR_NAMESPACE = "rljob-system"
GPUS_PER_NODE = 4
LOG_TAIL = 60
"""Lines of each log a failure message carries."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rljob e2e")
    group.addoption("--cluster", choices=("local", "existing"), default="local",
                    help="e2e cluster: 'local' starts the local control plane + two kubelet nodes (default); "
                    "'existing' uses KUBECONFIG (e.g. kind)")
    group.addoption("--operator-image", default=None,
                    help="operator image REPOSITORY:TAG (default: the chart's, which the local nodes have imported)")
    group.addoption("--earlier-operator-image", default=None,
                    help="the operator image of the commit in tests/e2e/upgrade-from, REPOSITORY:TAG, which the upgrade "
                    "test installs first (--cluster=existing only: on the local cluster it is built and imported)")


# --- the cluster ------------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    """One cluster the suite drives with the pinned kubectl and helm."""

    kubeconfig: str
    bin_dir: Path | None
    mode: str
    helm_home: Path = field(default_factory=lambda: Path("/tmp/rljob-e2e-helm"))
    nodes: Any = None
    """The local nodes (``rljob_localcluster.nodes.LocalNodes``: ``import_images``) in ``local`` mode, else None."""

    def _tool(self, name: str) -> str:
        if self.bin_dir is not None and (self.bin_dir / name).exists():
            return str(self.bin_dir / name)
        found = shutil.which(name)
        if found is None:  # the pinned build, when this machine has it
            from rljob_localcluster.tools import tools_bin_dir

            found = str(tools_bin_dir() / name)
        return found

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl; with ``check`` a non-zero exit fails the test with kubectl's stderr."""
        cmd = [self._tool("kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, **{
            f"HELM_{kind}_HOME": str(self.helm_home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}}
        cmd = [self._tool("helm"), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    def get(self, *args: str) -> dict[str, Any] | None:
        """``kubectl get ARGS -o json``, or None when the object does not exist."""
        proc = self.kubectl("get", *args, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr or "not found" in proc.stderr:
                return None
            pytest.fail(f"kubectl get {' '.join(args)}: {proc.stderr}")
        return json.loads(proc.stdout)

    def items(self, kind: str, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = [kind, "-n", namespace] + (["-l", selector] if selector else [])
        return (self.get(*args) or {}).get("items", [])

    def apply(self, manifest: dict[str, Any] | str, namespace: str, check: bool = True) -> subprocess.CompletedProcess:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-n", namespace, "-f", "-", input=text, check=check)

    def api_client(self) -> kube_client.ApiClient:
        """A kubernetes.client.ApiClient for this cluster (watches)."""
        return kube_config.new_client_from_config(config_file=self.kubeconfig)

    def pod_log(self, namespace: str, pod: str, tail: int = LOG_TAIL) -> str:
        """The last ``tail`` lines of every container of a pod (``kubectl logs``), the previous container's first
        when it restarted (``kubectl logs --previous``)."""
        text = ""
        for previous in (True, False):
            args = ["logs", "-n", namespace, pod, "--all-containers", f"--tail={tail}"] + (["--previous"] if previous else [])
            proc = self.kubectl(*args, check=False)
            if previous and proc.returncode != 0:
                continue
            text += ("--- previous container\n" if previous else "") + proc.stdout + proc.stderr
        return text

    def control_plane_log_lines(self, namespace: str, keep: int = 30) -> list[str]:
        """The local control plane's kube-controller-manager and kube-scheduler log lines that name ``namespace``
        (the last ``keep`` of each), as "<component> log:\n..." entries; none on another cluster."""
        cp = getattr(self.nodes, "cp", None)
        out = []
        for component in ("kube-controller-manager", "kube-scheduler") if cp is not None else ():
            try:
                lines = (cp.log_dir / f"{component}.log").read_text(errors="replace").splitlines()
            except OSError as e:
                lines = [f"(unreadable: {e})"]
            out.append(f"{component} log:\n" + "\n".join([ln for ln in lines if namespace in ln][-keep:]))
        return out

    def logged_pods(self, namespace: str, prefix: str = "") -> list[str]:
        """Pods of ``namespace`` whose names start with ``prefix`` (their logs go with them when deleted)."""
        return sorted(p["metadata"]["name"] for p in self.items("pods", namespace)
                      if p["metadata"]["name"].startswith(prefix))


def _start_local(request: pytest.FixtureRequest, stack) -> Cluster:
    if os.environ.get("RLJOB_SKIP_CLUSTER") == "1":
        pytest.skip("RLJOB_SKIP_CLUSTER=1: the end-to-end suite does NOT run")
    if os.geteuid() != 0:
        pytest.fail("the local nodes need root (containerd, kubelet, CNI); run as root or set RLJOB_SKIP_CLUSTER=1")
    from conftest_cluster import acquire_control_plane, release_control_plane
    from rljob_localcluster.nodes import LocalNodes

    cp = acquire_control_plane()
    stack.append(release_control_plane)
    nodes = LocalNodes(cp, Path(os.environ.get("RLJOB_E2E_NODES_DIR", "/tmp/rljob-e2e-nodes")), nodes=2,
                       gpus_per_node=GPUS_PER_NODE)
    nodes.start()
    stack.append(nodes.stop)
    return Cluster(kubeconfig=cp.kubeconfig, bin_dir=Path(cp.bin_dir), mode="local", nodes=nodes)


@pytest.fixture(scope="package")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The e2e cluster (see the module docstring); everything it started is stopped at the end."""
    mode = request.config.getoption("--cluster", default="local")
    stack: list[Callable[[], None]] = []
    try:
        if mode == "local":
            yield _start_local(request, stack)
        else:
            kubeconfig = os.environ.get("KUBECONFIG")
            if not kubeconfig:
                pytest.fail("--cluster=existing needs KUBECONFIG")
            yield Cluster(kubeconfig=kubeconfig, bin_dir=None, mode="existing")
    finally:
        for stop in reversed(stack):
            stop()


# --- the operator -----------------------------------------------------------------------------------------------
@dataclass
class Operator:
    """The helm release of the operator."""

    cluster: Cluster
    namespace: str = OPERATOR_NAMESPACE
    release: str = RELEASE
    values: list[str] = field(default_factory=list)
    """The ``--set`` arguments of the suite's install (the image given by ``--operator-image``)."""

    @property
    def service_account(self) -> str:
        return self.release  # the chart's fullname when the release is named like the chart

    def pods(self) -> list[dict[str, Any]]:
        return self.cluster.items("pods", self.namespace, f"app.kubernetes.io/instance={self.release}")

    def logs(self, tail: int = LOG_TAIL) -> str:
        text = ""
        for name in self.cluster.logged_pods(self.namespace, self.release):
            text += self.cluster.pod_log(self.namespace, name, tail)
        return text

    def restart(self) -> str:
        """Delete the running operator pod; returns the new pod's name once it is ready."""
        old = {p["metadata"]["name"] for p in self.pods()}
        self.cluster.kubectl("delete", "pod", "-n", self.namespace, *old, "--wait=false")
        return wait_for(lambda: next((p["metadata"]["name"] for p in self.pods()
                                      if p["metadata"]["name"] not in old and _ready(p)), None),
                        120, "a new ready operator pod", self.logs)


def image_values(image: str) -> list[str]:
    """The chart's ``--set`` arguments for the operator image ``REPOSITORY:TAG`` (on a cluster that has it)."""
    repository, _, tag = image.rpartition(":")
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=IfNotPresent"]


def _ready(pod: dict[str, Any]) -> bool:
    return any(cond["type"] == "Ready" and cond["status"] == "True"
               for cond in (pod.get("status") or {}).get("conditions") or [])


@pytest.fixture(scope="package")
def operator(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Operator]:
    """``helm install rljob-operator helm/rljob-operator -n rljob-system --create-namespace --wait``; the
    release is uninstalled at the end (after every test namespace, whose jobs need the running operator to
    drop their finalizers)."""
    image = request.config.getoption("--operator-image", default=None)
    op = Operator(cluster, values=image_values(image) if image else [])
    values = op.values
    cluster.helm("uninstall", op.release, "-n", op.namespace, "--wait", check=False)  # a leftover of a killed run
    try:
        cluster.helm("install", op.release, str(CHART), "-n", op.namespace, "--create-namespace", "--wait",
                     "--timeout", "5m", *values)
    except RuntimeError as err:
        pods = cluster.kubectl("get", "pods", "-n", op.namespace, "-o", "wide", check=False).stdout
        cluster.helm("uninstall", op.release, "-n", op.namespace, "--wait", check=False)
        pytest.fail(f"{err}\npods:\n{pods}\noperator logs:\n{op.logs()}")
    try:
        yield op
    finally:
        cluster.helm("uninstall", op.release, "-n", op.namespace, "--wait", "--timeout", "2m", check=False)


# --- per test ---------------------------------------------------------------------------------------------------
@pytest.fixture()
def namespace(cluster: Cluster, operator: Operator, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace; deleted at the end with its jobs (waited for, while the operator runs: kopf's finalizer goes
    with them) and its pods. The namespace's own deletion is not waited for (tens of seconds of the namespace
    controller's retries per test): the next test's pods wait for the resources its pods still hold, and the cluster's
    teardown ends whatever is left."""
    name = f"e2e-{request.node.name.removeprefix('test_').replace('_', '-')[:40].rstrip('-')}-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(lambda: cluster.get("serviceaccount", "default", "-n", name), 60, "the default ServiceAccount")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "rljob", "--all", "-n", name, "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@dataclass
class Diagnostics:
    """What a failure message shows about one job: status, children, Events, operator and pod logs."""

    cluster: Cluster
    operator: Operator
    namespace: str
    job: str | None = None

    def __call__(self) -> str:
        ns, out = self.namespace, []
        if self.job:
            job = self.cluster.get("rljob", self.job, "-n", ns)
            out.append("job status:\n" + yaml.safe_dump((job or {}).get("status"), sort_keys=False))
        out.append("pods:\n" + self.cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", "-L",
                                                     f"{c.LABEL_ATTEMPT},{c.LABEL_ROLE}", check=False).stdout)
        out.append("events:\n" + self.cluster.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp",
                                                       check=False).stdout[-6000:])
        claims = self.cluster.kubectl("get", "pvc", "-n", ns, "-o", "wide", check=False).stdout
        if claims.strip():
            out.append("claims:\n" + claims + "volumes:\n"
                       + self.cluster.kubectl("get", "pv", "-o", "wide", check=False).stdout[-3000:])
            out += self.cluster.control_plane_log_lines(ns)
        out.append("operator logs:\n" + self.operator.logs())
        for pod in self.cluster.logged_pods(ns):
            out.append(self.cluster.pod_log(ns, pod, 40))
        return "\n".join(out)


@pytest.fixture()
def diagnostics(cluster: Cluster, operator: Operator, namespace: str) -> Diagnostics:
    return Diagnostics(cluster, operator, namespace)


# --- helpers ----------------------------------------------------------------------------------------------------
wait_for = functools.partial(wait_until, interval=1.0)
"""``wait_until(check, timeout, what, diagnose)`` polling once a second (each check runs kubectl)."""


def condition(job: dict[str, Any] | None, ctype: c.ConditionType) -> dict[str, Any]:
    """The condition of ``ctype`` in a job object ({} when absent)."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype.value:
            return cond
    return {}


def example_documents(name: str) -> list[dict[str, Any]]:
    """Every object of ``examples/<name>``, in the file's order (a fresh parse: changing them changes nothing else)."""
    return [doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text()) if doc]


def load_example(name: str) -> dict[str, Any]:
    """The RLTrainingJob of ``examples/<name>`` (the file also holds its checkpoint PersistentVolumeClaim)."""
    return next(doc for doc in example_documents(name) if doc.get("kind") == c.KIND)


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: ``seq`` orders the events as the API server sent them (one stream)."""

    seq: int
    type: str
    object: dict[str, Any]
    time: float

    @property
    def name(self) -> str:
        return self.object["metadata"]["name"]

    @property
    def uid(self) -> str:
        return self.object["metadata"].get("uid", "")

    @property
    def labels(self) -> dict[str, str]:
        return self.object["metadata"].get("labels") or {}

    @property
    def role(self) -> str:
        return self.labels.get(c.LABEL_ROLE, "")

    @property
    def attempt(self) -> int | None:
        attempt = self.labels.get(c.LABEL_ATTEMPT)
        return int(attempt) if attempt is not None else None

    @property
    def status(self) -> dict[str, Any]:
        return self.object.get("status") or {}


class Recorder:
    """Records every watch event of ``resource`` ("pods" or "rljobs") in one namespace (a kubernetes watch in a
    thread), starting with the objects that exist (type EXISTING).

    One watch stream, resumed at its last resourceVersion when the server closes it, keeps the API server's
    order, so "every pod of attempt k was DELETED before any pod of attempt k+1 was ADDED" and the sequence of
    a job's status changes can be read off :attr:`events`. When the server cannot resume it (410 Gone: an RLTrainingJob
    watch after the CRD was changed), the objects are listed again (type RELISTED: what changed in between is not
    seen) and the watch goes on from that list.
    """

    def __init__(self, cluster: Cluster, namespace: str, resource: str = "pods", selector: str = "") -> None:
        self.cluster, self.namespace, self.resource, self.selector = cluster, namespace, resource, selector
        self.events: list[WatchEvent] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{resource}-{namespace}", daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        if not self._ready.wait(30) or self.error is not None:
            raise RuntimeError(f"the {self.resource} watch of {self.namespace} did not start: {self.error!r}")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=30)

    def _list(self, api_client):
        if self.resource == "pods":
            api = kube_client.CoreV1Api(api_client)
            return lambda **kw: api.list_namespaced_pod(self.namespace, label_selector=self.selector, **kw)
        api = kube_client.CustomObjectsApi(api_client)
        return lambda **kw: api.list_namespaced_custom_object(c.GROUP, c.VERSION, self.namespace, c.PLURAL,
                                                              label_selector=self.selector, **kw)

    def _run(self) -> None:
        api_client = self.cluster.api_client()
        list_fn = self._list(api_client)
        try:
            version = self._relist(list_fn, api_client, "EXISTING")
            self._ready.set()
            while not self._stop.is_set():
                self._watch = kube_watch.Watch()
                try:
                    # Short server-side timeouts: the thread notices stop() within seconds and is gone before the
                    # session ends (CPython 3.11.7 can fail compiling in one thread while another compiles too).
                    for event in self._watch.stream(list_fn, resource_version=version, timeout_seconds=5,
                                                    allow_watch_bookmarks=True):
                        if event is None:  # the client yields None for a line it cannot decode (a cut stream)
                            continue
                        obj = api_client.sanitize_for_serialization(event.get("object")) or {}
                        if event["type"] == "ERROR" or not (obj.get("metadata") or {}).get("resourceVersion"):
                            # A Status in the stream (e.g. its resourceVersion expired): list again and go on.
                            version = self._relist(list_fn, api_client, "RELISTED")
                            break
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._record(event["type"], obj)
                        if self._stop.is_set():
                            break
                except urllib3.exceptions.ProtocolError:  # the server ended the stream: resume where it was
                    continue
                except kube_client.exceptions.ApiException as err:
                    if err.status != 410:
                        raise
                    version = self._relist(list_fn, api_client, "RELISTED")
        except BaseException as err:  # noqa: BLE001 - the tests read it from .error
            self.error = err
            self._ready.set()

    def _relist(self, list_fn, api_client, kind: str) -> str:
        """Record every object listed now as ``kind``; the list's resourceVersion."""
        listed = api_client.sanitize_for_serialization(list_fn())
        for obj in listed.get("items", []):
            self._record(kind, obj)
        return listed["metadata"]["resourceVersion"]

    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self.events.append(WatchEvent(len(self.events), kind, obj, time.monotonic()))

    def check(self) -> None:
        """Fail the test if the watch broke (its record would be incomplete)."""
        if self.error is not None:
            pytest.fail(f"the {self.resource} watch of {self.namespace} failed: {self.error!r}")

    def lifetimes(self, role: str) -> dict[str, tuple[int | None, int, int | None]]:
        """Per pod uid of ``role``: (attempt label, seq of its first event, seq of its DELETED event or None)."""
        out: dict[str, tuple[int | None, int, int | None]] = {}
        for event in self.events:
            if event.role != role:
                continue
            attempt, first, _ = out.get(event.uid, (event.attempt, event.seq, None))
            out[event.uid] = (attempt, first, event.seq if event.type == "DELETED" else None)
        return out


_REDIS_SNAPSHOT = """
import json, os, redis
r = redis.Redis(host=os.environ["HOST"], port=int(os.environ["PORT"]), password=os.environ.get("REDIS_PASSWORD"),
                decode_responses=True, socket_timeout=10)
k = json.loads(os.environ["KEYS"])
stream = r.exists(k["stream"])
print(json.dumps({
    "progress": r.hgetall(k["progress"]), "rollout": r.hgetall(k["rollout"]), "checkpoint": r.hgetall(k["checkpoint"]),
    "xlen": r.xlen(k["stream"]) if stream else None,
    "groups": r.xinfo_groups(k["stream"]) if stream else [],
    "dead_letter": r.xlen(k["dead_letter"]) if r.exists(k["dead_letter"]) else 0,
}, default=str))
"""


def redis_snapshot(cluster: Cluster, namespace: str, job: dict[str, Any], diagnose: Callable[[], str],
                   script: str = _REDIS_SNAPSHOT) -> Any:
    """Read a job's Redis (by default progress and rollout hashes, stream length, consumer groups, checkpoint hash)
    from inside the cluster: a one-off pod of the job's trainer image with the job's Redis password runs ``script``
    (Python; the environment has HOST, PORT, REDIS_PASSWORD and KEYS, the job's RedisKeys as JSON) and prints JSON
    as its last line, read with ``kubectl logs`` (works on any cluster; the pod is deleted afterwards)."""
    from rljob_api.config import RedisKeys
    from rljob_api.spec import RLTrainingJobSpec
    from rljob_operator import render

    name = job["metadata"]["name"]
    spec = RLTrainingJobSpec.model_validate(job["spec"])
    rendered = render.Job(name, namespace, spec)
    connection = render.redis_connection(rendered)
    keys = RedisKeys.build(namespace, name, spec)
    password = render.redis_password_ref(rendered)
    pod = f"{name[:40]}-redis-read-{uuid.uuid4().hex[:5]}"
    env = [{"name": "HOST", "value": connection.host}, {"name": "PORT", "value": str(connection.port)},
           {"name": "KEYS", "value": keys.model_dump_json()}]
    if password is not None:
        env.append({"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": password.name, "key": password.key}}})
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
            "name": "read", "image": spec.trainer.image, "command": ["python", "-c", script], "env": env}]},
    }, namespace)
    try:
        phase = wait_for(lambda: (cluster.get("pod", pod, "-n", namespace) or {}).get("status", {}).get("phase")
                         in ("Succeeded", "Failed") and cluster.get("pod", pod, "-n", namespace)["status"]["phase"],
                         90, f"the Redis reader pod {pod}", diagnose)
        out = cluster.kubectl("logs", "-n", namespace, pod).stdout
        assert phase == "Succeeded", f"the Redis reader pod failed:\n{out}"
        return json.loads(out.strip().splitlines()[-1])
    finally:
        cluster.kubectl("delete", "pod", pod, "-n", namespace, "--wait=true", check=False)


def check_trained_once(snapshot: dict[str, Any], status: dict[str, Any], documents: int) -> dict[str, Any]:
    """Assert, from a :func:`redis_snapshot` and the job's final status, that ``documents`` documents were trained (the
    progress hash and status agree), nothing is pending in the consumer group, and no pending entry was lost or
    dead-lettered. Returns the trainer's stream counters."""
    assert int(snapshot["progress"]["documents_seen"]) == documents == status["documentsSeen"], (snapshot, status)
    (group,) = snapshot["groups"]
    assert group["pending"] == 0, snapshot["groups"]
    counters = json.loads(snapshot["progress"]["stream"])
    assert counters["lost_pending"] == 0 and counters["dead_lettered"] == 0, counters
    return counters


def check_attempts_never_mixed(pods: Recorder, attempts: int) -> None:
    """Assert from the pods' watch that the trainer pods of exactly ``attempts`` attempts existed and every pod of
    attempt k was DELETED before any pod of attempt k+1 was ADDED (DESIGN §5)."""
    by_attempt: dict[int, list[tuple[int, int | None]]] = {}
    for attempt, first, deleted in pods.lifetimes(c.Role.TRAINER.value).values():
        by_attempt.setdefault(attempt, []).append((first, deleted))
    assert sorted(by_attempt) == list(range(attempts)), by_attempt
    for k in range(attempts - 1):
        assert all(deleted is not None for _, deleted in by_attempt[k]), f"a pod of attempt {k} was never deleted"
        assert max(d for _, d in by_attempt[k]) < min(f for f, _ in by_attempt[k + 1]), (k, by_attempt)


def rollout_rewards(rollout_hash: dict[str, str]) -> dict[int, tuple[float, int]]:
    """Per weights version: (mean raw reward, documents) from the rollout hash's reward_sum/reward_count fields."""
    return protocol.rewards_by_version(rollout_hash)


def children(cluster: Cluster, namespace: str, job: str) -> dict[str, list[tuple[str, str]]]:
    """(name, uid) of the job's children by kind, selected by the job-name label."""
    from rljob_api import names

    selector = f"{c.LABEL_JOB_NAME}={names.job_label(job)}"
    return {kind: sorted((o["metadata"]["name"], o["metadata"]["uid"]) for o in cluster.items(kind, namespace, selector))
            for kind in ("pods", "services", "secrets", "configmaps", "deployments")}


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def job_manifest(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An RLTrainingJob named ``name``: the CPU example's spec without its checkpoint claim (that claim belongs to
    the example's own job; :func:`checkpointed_job` makes one per job) and with ``parallelism`` left to its default
    (fsdp: the gang restarts, resizes and suspensions of these jobs reshard its sharded checkpoints; the example's
    ddp trains in tests/rollout/test_learn.py and scripts/demo.sh), with ``spec`` merged in."""
    base = load_example("rljob-cpu.yaml")["spec"]  # a fresh parse: changing it changes nothing else
    base["trainer"]["checkpoint"].pop("volume", None)
    base["trainer"].pop("parallelism", None)
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name}, "spec": merge(base, spec)}


def get_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get("rljob", name, "-n", namespace) or {}


def phase(job: dict[str, Any]) -> str | None:
    return (job.get("status") or {}).get("phase")


def pvc(name: str, size: str = "1Gi") -> dict[str, Any]:
    """A ReadWriteOnce claim of the cluster's default StorageClass: ``rljob-local`` on the local nodes (the
    provisioner of their node controller), ``standard`` on kind."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}


def checkpointed_job(cluster: Cluster, namespace: str, name: str, every_steps: int,
                     spec: dict[str, Any]) -> dict[str, Any]:
    """An RLTrainingJob (:func:`job_manifest` with ``spec`` merged in) whose trainer is 1 pod × 2 processes
    checkpointing every ``every_steps`` steps to the claim ``<name>-checkpoints``, which is created here. One pod,
    because the claim is ReadWriteOnce (any cluster's default class): it mounts on one node."""
    claim = f"{name}-checkpoints"
    cluster.apply(pvc(claim), namespace)
    trainer = {"nodes": 1, "processesPerNode": 2, "checkpoint": {"everySteps": every_steps, "volume": claim}}
    return job_manifest(name, merge({"trainer": trainer}, spec))
