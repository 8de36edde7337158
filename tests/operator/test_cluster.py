"""Against the real API server of the local control plane (no nodes: pods stay Pending).

The chart's CRDs, ServiceAccount, RBAC and peering object are installed with the objects ``helm template``
renders; the operator runs as a process with a token of that ServiceAccount, so a missing RBAC rule fails
these tests. Pod failures and evictions are written into pod status the way a kubelet would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Callable

import pytest
import yaml

from helm_tools import CHART, helm_binary, render
from rljob_operator.kube_api import KubeApi
from rljob_operator import resolution
from rljob_operator.admission import kept_spec
from rljob_operator.runtime import JobRuntime

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(helm_binary() is None, reason="helm is not built: run localcluster/build-go-tools.sh"),
]

RELEASE, SYSTEM_NS, SERVICE_ACCOUNT = "rel", "rljob-system", "rel-rljob-operator"
PEERING = "rljob-operator"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], object], what: str, timeout: float = 40.0, every: float = 0.3):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def quiet_for(kube: "Kube", namespace: str, name: str, first: dict, seconds: float, timeout: float = 30.0) -> dict:
    """Wait until the job goes ``seconds`` without a write (same resourceVersion), starting from ``first``; fail after
    ``timeout`` seconds naming what the last write changed. A job rewritten every pass never goes quiet."""
    deadline = time.monotonic() + timeout
    last, since, changed = first, time.monotonic(), {}
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = kube.job(namespace, name)
        if now["metadata"]["resourceVersion"] != last["metadata"]["resourceVersion"]:
            changed = {k: (last["status"].get(k), v) for k, v in now["status"].items() if last["status"].get(k) != v}
            changed["metadata.annotations"] = now["metadata"].get("annotations")
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return now
    pytest.fail(f"{namespace}/{name} was still written after {timeout} s; the last write changed "
                f"{json.dumps(changed, indent=1)}")


class Kube:
    def __init__(self, control_plane):
        self.cp = control_plane

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return self.cp.kubectl(*args, input=input, check=check)

    def json(self, *args: str):
        result = self.run(*args, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def apply(self, obj: dict, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.run(*args, input=yaml.safe_dump(obj), check=check)

    def job(self, namespace: str, name: str):
        return self.json("get", "rljob", name, "-n", namespace)

    def pods(self, namespace: str, role: str) -> list[dict]:
        found = self.json("get", "pods", "-n", namespace, "-l", f"rljob.dev/role={role}") or {"items": []}
        return found["items"]

    def condition(self, namespace: str, name: str, ctype: str) -> dict:
        status = (self.job(namespace, name) or {}).get("status") or {}
        return next((c for c in status.get("conditions", []) if c["type"] == ctype), {})

    def fail_pod(self, namespace: str, name: str, *, evicted: bool = False) -> None:
        status = {"phase": "Failed", "containerStatuses": [{
            "name": "trainer", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137 if evicted else 3, "reason": "Error"}},
        }]}
        if evicted:
            status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
        self.run("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": status}))


def job_manifest(name: str, **spec_overrides) -> dict:
    spec = {"model": {"source": "tiny"}, "trainer": {"nodes": 2, "batch": {"documentsPerStep": 64}}, "rollout": {"replicas": 1}}
    for key, value in spec_overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    return {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": name}, "spec": spec}


def external_redis(kube: Kube, namespace: str, server) -> dict:
    """spec.redis of a job on the test's Redis ``server`` (its password in a Secret ``shared-redis``, created here)."""
    kube.run("create", "secret", "generic", "shared-redis", "-n", namespace, f"--from-literal=password={server.password}")
    return {"mode": "external", "url": server.url, "passwordSecretRef": {"name": "shared-redis", "key": "password"}}


@pytest.fixture(scope="module")
def kube(control_plane) -> Kube:
    return Kube(control_plane)


@pytest.fixture(scope="module")
def installed(kube, tmp_path_factory) -> Path:
    """Chart CRDs + ServiceAccount + RBAC + peering object applied; returns a kubeconfig of the ServiceAccount."""
    kube.run("apply", "--server-side", "-f", str(CHART / "crds"))
    for crd in ("rltrainingjobs.rljob.dev", "clusterkopfpeerings.kopf.dev"):
        # polled: `kubectl wait --for=condition=Established` fails at once on a CRD with no conditions yet (a large
        # CRD is still being processed when the wait starts)
        wait_for(lambda: any(cond["type"] == "Established" and cond["status"] == "True"
                             for cond in ((kube.json("get", "crd", crd) or {}).get("status") or {}).get("conditions")
                             or ()), f"CRD {crd} Established", timeout=60)
    kube.run("create", "namespace", SYSTEM_NS, check=False)
    for obj in render(release=RELEASE, namespace=SYSTEM_NS):
        if obj["kind"] not in ("Deployment", "Service"):  # no nodes here: the operator runs as a process
            kube.apply(obj)
    token = kube.run("create", "token", SERVICE_ACCOUNT, "-n", SYSTEM_NS, "--duration=2h").stdout.strip()
    config = yaml.safe_load(Path(kube.cp.kubeconfig).read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "operator"
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


class OperatorProcess:
    """``rljob operator`` as its own process (stopped with SIGTERM, then SIGKILL, also on failure)."""

    def __init__(self, kubeconfig: Path, log: Path, priority: int):
        self.liveness, self.metrics, self.log = _free_port(), _free_port(), log
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_ID": f"test-{uuid.uuid4().hex[:6]}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rljob_operator.cli", "operator", "--all-namespaces", f"--peering={PEERING}",
             f"--priority={priority}", f"--liveness-port={self.liveness}", f"--metrics-port={self.metrics}",
             "--active-interval=1",
             "--idle-interval=5"],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        wait_for(self.alive, "the operator's liveness endpoint", timeout=60)

    def get(self, port: int, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.read().decode()

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the operator exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            return bool(self.get(self.liveness, "/healthz") is not None)
        except OSError:
            return False

    def logs(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def operator(installed, tmp_path_factory):
    proc = OperatorProcess(installed, tmp_path_factory.mktemp("logs") / "operator.log", priority=100)
    try:
        yield proc
    finally:
        proc.stop()
    assert "Traceback" not in proc.logs(), proc.logs()[-5000:]


@pytest.fixture()
def namespace(kube) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.run("create", "namespace", name)
    return name


# --- the API server enforces the CRD (schema + CEL) -----------------------------------------------------------
def test_schema_and_cel_rules_are_enforced_with_messages_that_name_the_field(kube, installed, namespace):
    def refused(manifest: dict) -> str:
        result = kube.apply(manifest, namespace, check=False)
        assert result.returncode != 0, f"accepted: {manifest}"
        return result.stderr

    # the refusals name the numbers (rljob_api.rules.NumberedMessage: digits a messageExpression can afford)
    assert ('spec.trainer.nodes: Invalid value: "object": nodes 3 × processesPerNode 1 = 3 ranks is not divisible by '
            "tensorParallel 2 × pipelineParallel 1 = 2: each data-parallel rank needs tensorParallel × "
            "pipelineParallel processes") in refused(job_manifest("div", trainer={"nodes": 3, "tensorParallel": 2}))
    assert ("nodes 4000 × processesPerNode 10 = 40000 ranks is not divisible by tensorParallel 64 × pipelineParallel "
            "64 = 4096") in refused(job_manifest("div2", trainer={"nodes": 4000, "processesPerNode": 10,
                                                                 "tensorParallel": 64, "pipelineParallel": 64}))
    assert ('spec.algorithm.metrics: Invalid value: "object": metrics basic or full requires '
            'trainer.pipelineParallel == 1') in refused(
        job_manifest("pp", algorithm={"metrics": "basic"}, trainer={"pipelineParallel": 2}))
    assert ('spec.trainer.batch.documentsPerStep: Invalid value: "object": documentsPerStep 64 is not divisible by the '
            "data-parallel size 6 = nodes 2 × processesPerNode 3 / (tensorParallel 1 × pipelineParallel 1): every "
            "data-parallel rank trains the same number of documents per step; set documentsPerStep to a multiple of "
            "the data-parallel size, or change the topology") in refused(
        job_manifest("docs", trainer={"nodes": 2, "processesPerNode": 3, "batch": {"documentsPerStep": 64}}))
    assert ("documentsPerStep 1000000007 is not divisible by the data-parallel size 100 = nodes 10 × processesPerNode "
            "10 / (tensorParallel 1 × pipelineParallel 1)") in refused(job_manifest("docs2", trainer={
                "nodes": 10, "processesPerNode": 10, "batch": {"documentsPerStep": 1000000007}}))
    assert ("documentsPerStep 9223372036854775807 is not divisible by the data-parallel size 40960 = nodes 640 × "
            "processesPerNode 64 / (tensorParallel 1 × pipelineParallel 1)") in refused(job_manifest("docs3", trainer={
                "nodes": 640, "processesPerNode": 64, "batch": {"documentsPerStep": 2**63 - 1}}))
    zero = refused(job_manifest("zero", trainer={"processesPerNode": 0}))  # the bound, and no CEL error beside it
    assert "spec.trainer.processesPerNode in body should be greater than or equal to 1" in zero
    assert "divisible" not in zero and "modulus by zero" not in zero
    kube.apply(job_manifest("docsok", trainer={"nodes": 2, "processesPerNode": 2, "pipelineParallel": 2,
                                               "batch": {"documentsPerStep": 2}}), namespace)  # DP = 2 divides 2
    assert ("spec.trainer.parallelism.replicate: Invalid value: \"object\": replicate 3 does not divide the "
            "data-parallel size 4 = nodes 2 × processesPerNode 2 / (tensorParallel 1 × pipelineParallel 1): each of "
            "the replicate groups (HSDP) shards the model over the same number of ranks") in refused(job_manifest(
                "hsdp3", trainer={"nodes": 2, "processesPerNode": 2, "parallelism": {"replicate": 3}}))
    assert ("spec.trainer.parallelism.replicate: Invalid value: \"object\": replicate > 1 (HSDP) requires strategy "
            "fsdp") in refused(job_manifest("ddphsdp", trainer={"nodes": 2, "processesPerNode": 2,
                                                               "parallelism": {"strategy": "ddp", "replicate": 2}}))
    # a setting the job would ignore is refused, naming both fields; their defaults (filled in before CEL runs) are not
    assert ('spec.trainer.precision.reduce: Invalid value: "object": precision.reduce bf16 is ignored with '
            "parallelism.strategy ddp, which all-reduces the gradients in float32 (only fsdp reduces in bf16): remove "
            "precision.reduce (fp32, the default) or set parallelism.strategy to fsdp") in refused(job_manifest(
                "ddpbf16", trainer={"parallelism": {"strategy": "ddp"}, "precision": {"reduce": "bf16"}}))
    kube.apply(job_manifest("ddp", trainer={"parallelism": {"strategy": "ddp"}, "precision": {"param": "bf16"}}),
               namespace)
    assert kube.job(namespace, "ddp")["spec"]["trainer"]["precision"] == {"param": "bf16", "reduce": "fp32"}
    assert ('spec.algorithm.klEstimator: Invalid value: "object": klEstimator k1 is ignored while klCoef is 0 (no KL '
            "penalty is computed): set klCoef > 0 to enable the KL penalty, or remove klEstimator") in refused(
        job_manifest("k1", algorithm={"klEstimator": "k1"}))
    kube.apply(job_manifest("klk1", algorithm={"klCoef": 0.05, "klEstimator": "k1"}), namespace)
    assert 'spec.trainer.parallelism.strategy: Unsupported value: "zero3"' in refused(
        job_manifest("zero3", trainer={"parallelism": {"strategy": "zero3"}}))
    kube.apply(job_manifest("hsdp", trainer={"nodes": 2, "processesPerNode": 2, "parallelism": {"replicate": 2},
                                             "batch": {"documentsPerStep": 4}}), namespace)  # 2 groups x 2 shards
    assert 'unknown field "spec.trainer.nodez"' in refused(job_manifest("unknown", trainer={"nodez": 1}))
    assert "spec.trainer.nodes: Invalid value: 0: spec.trainer.nodes in body should be greater than or equal to 1" \
        in refused(job_manifest("bound", trainer={"nodes": 0}))
    assert 'spec.algorithm.loss: Unsupported value: "ppo"' in refused(job_manifest("enum", algorithm={"loss": "ppo"}))
    assert ("spec.rollout.samplesPerPrompt: Invalid value: 1: spec.rollout.samplesPerPrompt in body should be greater "
            "than or equal to 2") in refused(job_manifest("group", rollout={"samplesPerPrompt": 1}))
    assert ("spec.rollout.replicas: Invalid value: -1: spec.rollout.replicas in body should be greater than or equal "
            "to 0") in refused(job_manifest("minus", rollout={"replicas": -1}))

    no_model = job_manifest("nomodel")
    del no_model["spec"]["model"]
    assert "spec.model: Required value" in refused(no_model)
    hub_id_only = job_manifest("hubid")
    hub_id_only["spec"]["model"] = {"name": "Qwen/Qwen2.5-1.5B-Instruct"}  # no silent tiny model named like Qwen
    assert "spec.model.source: Required value" in refused(hub_id_only)
    assert "spec: Required value" in refused({k: v for k, v in job_manifest("nospec").items() if k != "spec"})

    kube.apply(job_manifest("topo"), namespace)
    stored = kube.job(namespace, "topo")
    assert stored["spec"]["trainer"]["processesPerNode"] == 1  # defaults applied by the API server
    assert stored["spec"]["runPolicy"] == {"backoffLimit": 3, "cleanPodPolicy": "All", "suspend": False}
    patch = ["patch", "rljob", "topo", "-n", namespace, "--type=merge", "-p"]
    # the topology of a job that is not suspended may change (a gang restart, test_a_topology_edit_...), into one
    # that divides: the refusal of an edit names the numbers of the spec it would make
    result = kube.run(*patch, json.dumps({"spec": {"trainer": {"processesPerNode": 3}}}), check=False)
    assert result.returncode != 0 and (
        'spec.trainer.batch.documentsPerStep: Invalid value: "object": documentsPerStep 64 is not divisible by the '
        "data-parallel size 6 = nodes 2 × processesPerNode 3 / (tensorParallel 1 × pipelineParallel 1)"
    ) in result.stderr
    kube.run(*patch, json.dumps({"spec": {"trainer": {"nodes": 4}}}))
    kube.run(*patch, json.dumps({"spec": {"trainer": {"processesPerNode": 2}}}))
    assert (kube.job(namespace, "topo")["spec"]["trainer"]["nodes"],
            kube.job(namespace, "topo")["spec"]["trainer"]["processesPerNode"]) == (4, 2)
    explained = kube.run("explain", "rljob.spec.trainer.nodes").stdout
    assert "Trainer pods in the gang (torchrun nnodes)." in explained
    assert stored["spec"]["trainer"]["parallelism"] == {"strategy": "fsdp", "replicate": 1}
    assert stored["spec"]["trainer"]["precision"] == {"param": "bf16", "reduce": "fp32"}
    explained = kube.run("explain", "rljob.spec.trainer.parallelism.strategy").stdout
    assert "fsdp (the default): parameters, gradients and optimizer state are sharded" in " ".join(explained.split())

    # issue 13: the corrections' bounds and the learning-rate floor; their defaults fill the stored job, off
    below = ('spec.trainer.optimizer.minLearningRate: Invalid value: "object": optimizer.minLearningRate must be below '
             "optimizer.learningRate: schedule cosine decays from learningRate to minLearningRate (equal, the rate "
             "would stay constant)")
    assert below in refused(job_manifest("floor", trainer={"optimizer": {
        "learningRate": 1e-5, "minLearningRate": 3e-5, "schedule": "cosine"}}))
    assert below in refused(job_manifest("flat", trainer={"optimizer": {
        "learningRate": 1e-5, "minLearningRate": 1e-5, "schedule": "cosine"}}))
    minus = refused(job_manifest("minus", trainer={"optimizer": {"learningRate": -1, "schedule": "cosine"}}))
    assert "learningRate in body should be greater than 0" in minus and "minLearningRate" not in minus
    # settings the job would ignore are refused, naming the field; their defaults are not
    assert ('spec.trainer.optimizer.minLearningRate: Invalid value: "object": optimizer.minLearningRate is ignored with '
            "schedule constant (the rate stays at learningRate after the warm-up): set schedule linear or cosine to "
            "decay to it, or remove minLearningRate") in refused(job_manifest("floor0", trainer={"optimizer": {
                "minLearningRate": 1e-7}}))
    assert ('spec.trainer.optimizer.schedule: Invalid value: "object": optimizer.schedule linear or cosine decays over '
            "the steps after the warm-up, the first of them at learningRate: it needs maxSteps >= "
            "optimizer.warmupSteps + 2, or nothing is left to decay") in refused(job_manifest("warm", trainer={
                "maxSteps": 100, "optimizer": {"warmupSteps": 99, "schedule": "linear"}}))
    kube.apply(job_manifest("decay", trainer={"maxSteps": 100, "optimizer": {
        "warmupSteps": 98, "schedule": "linear", "minLearningRate": 1e-7}}), namespace)
    kube.apply(job_manifest("longwarm", trainer={"maxSteps": 100, "optimizer": {"warmupSteps": 200}}), namespace)
    assert ('spec.algorithm.importanceSampling.cap: Invalid value: "object": cap is ignored while enabled is false (no '
            "behaviour weight is applied): set enabled: true, or remove cap") in refused(job_manifest("capoff", algorithm={
                "importanceSampling": {"cap": 5}}))
    proximal = ("with importanceSampling enabled the PPO ratio is taken against the trainer's own weights at the start "
                "of the step and is 1 (DESIGN section 4), so it is")
    assert (f'spec.algorithm.dualClip: Invalid value: "object": dualClip never binds: {proximal} never above dualClip; '
            "the cap bounds the behaviour weight: remove dualClip, or disable importanceSampling") in refused(
        job_manifest("dualis", algorithm={"dualClip": 3, "importanceSampling": {"enabled": True}}))
    assert (f'spec.algorithm: Invalid value: "object": epsilonHigh never binds: {proximal} never clipped; the cap '
            "bounds the behaviour weight: remove epsilonLow and epsilonHigh, or disable importanceSampling") in refused(
        job_manifest("epsis", algorithm={"epsilonHigh": 0.28, "importanceSampling": {"enabled": True}}))
    assert 'spec.algorithm: Invalid value: "object": epsilonLow and epsilonHigh never bind: ' in refused(job_manifest(
        "epsis2", algorithm={"epsilonLow": 0.1, "epsilonHigh": 0.28, "importanceSampling": {"enabled": True}}))
    kube.apply(job_manifest("isok", algorithm={"importanceSampling": {"enabled": True, "cap": 1}, "maxStaleness": 0}),
               namespace)
    kube.apply(job_manifest("clips", algorithm={"dualClip": 3, "epsilonHigh": 0.28, "importanceSampling": {"cap": 2}}),
               namespace)
    assert ("spec.algorithm.dualClip: Invalid value: 1: spec.algorithm.dualClip in body should be greater than 1"
            in refused(job_manifest("dual", algorithm={"dualClip": 1})))
    assert ("spec.algorithm.importanceSampling.cap: Invalid value: 0.5: spec.algorithm.importanceSampling.cap in body "
            "should be greater than or equal to 1") in refused(job_manifest("cap", algorithm={
                "importanceSampling": {"enabled": True, "cap": 0.5}}))
    assert stored["spec"]["algorithm"]["importanceSampling"] == {"enabled": False, "cap": 2}
    assert (stored["spec"]["algorithm"]["klCoef"], stored["spec"]["trainer"]["optimizer"]["schedule"]) == (0, "constant")
    assert "dualClip" not in stored["spec"]["algorithm"] and "maxStaleness" not in stored["spec"]["algorithm"]


# --- the operator under its own ServiceAccount ------------------------------------------------------------
def test_children_owner_references_and_gpu_pending_status(kube, operator, namespace):
    kube.apply(job_manifest("demo"), namespace)
    job = kube.job(namespace, "demo")
    pods = wait_for(lambda: len(kube.pods(namespace, "trainer")) == 2 and len(kube.pods(namespace, "rollout")) == 1
                    and kube.pods(namespace, "trainer") + kube.pods(namespace, "rollout"), "3 pods")
    config = wait_for(lambda: kube.json("get", "configmap", "demo-config", "-n", namespace), "the ConfigMap")
    digest = hashlib.sha256(config["data"]["config.json"].encode()).hexdigest()[:16]
    for obj in pods + [config, kube.json("get", "service", "demo-trainer", "-n", namespace),
                       kube.json("get", "service", "demo-redis", "-n", namespace),
                       kube.json("get", "secret", "demo-redis-auth", "-n", namespace),
                       kube.json("get", "deployment", "demo-redis", "-n", namespace),
                       wait_for(lambda: kube.json("get", "pvc", "demo-redis-data", "-n", namespace), "the Redis claim")]:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("RLTrainingJob", "demo",
                                                                              job["metadata"]["uid"], True)
    assert {p["metadata"]["labels"]["rljob.dev/config-hash"] for p in pods} == {digest}
    # the last log lines of a failed container become its termination message (quoted in the job's conditions)
    assert {c["terminationMessagePolicy"] for p in pods for c in p["spec"]["containers"]} == {"FallbackToLogsOnError"}
    assert {p["metadata"]["labels"].get("rljob.dev/attempt") for p in kube.pods(namespace, "trainer")} == {"0"}

    ready = wait_for(lambda: kube.condition(namespace, "demo", "TrainerReady").get("reason") == "Unschedulable"
                     and kube.condition(namespace, "demo", "TrainerReady"), "TrainerReady=Unschedulable")
    assert ready["status"] == "False"
    assert "demo-trainer-0: no nodes available to schedule pods" in ready["message"]
    assert "not counted as a failure" in ready["message"]
    status = kube.job(namespace, "demo")["status"]
    assert (status["phase"], status["dataParallelSize"], status["restarts"], status["attempt"]) == ("Starting", 2, 0, 0)
    table = kube.run("get", "rljob", "demo", "-n", namespace).stdout.split("\n")
    assert table[0].split() == ["NAME", "PHASE", "DP", "STEP", "PROGRESS", "ETA", "MODELVERSION", "REWARD", "AGE"]
    assert table[1].split()[:3] == ["demo", "Starting", "2"]
    events = wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                               if e["involvedObject"]["kind"] == "RLTrainingJob" and e["reason"] == "Unschedulable"],
                      "an Unschedulable Event")
    assert events[0]["type"] == "Warning"


def test_gang_restarts_counted_evictions_not_counted_suspend_resume_and_cascade(kube, operator, namespace):
    kube.apply(job_manifest("gang"), namespace)

    def trainer_attempts():
        return sorted({p["metadata"]["labels"]["rljob.dev/attempt"] for p in kube.pods(namespace, "trainer")
                       if not p["metadata"].get("deletionTimestamp")})

    wait_for(lambda: trainer_attempts() == ["0"] and len(kube.pods(namespace, "trainer")) == 2, "attempt 0")
    wait_for(lambda: (kube.job(namespace, "gang").get("status") or {}).get("gangCreated"), "gangCreated")
    kube.fail_pod(namespace, "gang-trainer-1")
    wait_for(lambda: trainer_attempts() == ["1"] and len(kube.pods(namespace, "trainer")) == 2, "attempt 1")
    status = wait_for(lambda: (s := kube.job(namespace, "gang")["status"])["gangCreated"] and s, "gang 1 created")
    assert (status["restarts"], status["failedAttempts"], status["attempt"]) == (1, 1, 1)
    restarting = kube.condition(namespace, "gang", "Restarting")
    assert (restarting["status"], restarting["reason"]) == ("False", "GangCreated")
    warnings = [e for e in kube.json("get", "events", "-n", namespace)["items"] if e["reason"] == "PodFailed"]
    assert warnings and "gang-trainer-1 of attempt 0 container trainer exited with code 3 (Error)" in warnings[0]["message"]
    assert len(kube.pods(namespace, "rollout")) == 1  # the rollout pod was not restarted with the gang

    kube.fail_pod(namespace, "gang-trainer-0", evicted=True)
    wait_for(lambda: trainer_attempts() == ["2"], "attempt 2")
    status = wait_for(lambda: (s := kube.job(namespace, "gang")["status"])["attempt"] == 2 and s, "status attempt 2")
    assert (status["restarts"], status["failedAttempts"]) == (2, 1)

    patch = ["patch", "rljob", "gang", "-n", namespace, "--type=merge", "-p"]
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    wait_for(lambda: not kube.pods(namespace, "trainer") and not kube.pods(namespace, "rollout"), "pods deleted")
    suspended = wait_for(lambda: kube.condition(namespace, "gang", "Suspended").get("status") == "True"
                         and kube.job(namespace, "gang")["status"], "Suspended=True")
    assert suspended["phase"] == "Suspended" and "startTime" not in suspended
    assert kube.json("get", "deployment", "gang-redis", "-n", namespace) is not None  # Redis and data kept
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    wait_for(lambda: trainer_attempts() == ["3"] and len(kube.pods(namespace, "trainer")) == 2, "attempt 3")
    resumed = wait_for(lambda: kube.condition(namespace, "gang", "Suspended").get("reason") == "JobResumed"
                       and kube.job(namespace, "gang")["status"], "JobResumed")
    assert resumed["restarts"] == 2 and resumed["startTime"]

    kube.run("delete", "rljob", "gang", "-n", namespace, "--timeout=60s")

    def leftovers():
        found = kube.json("get", "pods,services,configmaps,secrets,deployments,persistentvolumeclaims", "-n", namespace,
                          "-l", "rljob.dev/job-name=gang")
        return [f"{o['kind']}/{o['metadata']['name']}" for o in found["items"]]

    wait_for(lambda: leftovers() == [], "garbage collection of every child", timeout=60)


def test_invalid_spec_creates_nothing_does_not_hot_loop_and_recovers(kube, operator, namespace):
    kube.apply(job_manifest("bad", model={"tiny": {"heads": 3}}), namespace)
    valid = wait_for(lambda: kube.condition(namespace, "bad", "Valid").get("status") == "False"
                     and kube.condition(namespace, "bad", "Valid"), "Valid=False")
    assert valid["reason"] == "InvalidSpec"
    assert valid["message"] == "spec.model.tiny.heads: heads = 3 does not divide hiddenSize = 64; " \
                               "fix the spec (kubectl edit rljob)"
    version = kube.job(namespace, "bad")["metadata"]["resourceVersion"]
    time.sleep(4)  # four active intervals: an idle invalid job is not rewritten
    assert kube.job(namespace, "bad")["metadata"]["resourceVersion"] == version
    assert kube.job(namespace, "bad")["status"]["phase"] == "Invalid"
    found = kube.json("get", "pods,services,configmaps,secrets,deployments", "-n", namespace,
                      "-l", "rljob.dev/job-name=bad")
    assert found["items"] == []
    kube.run("patch", "rljob", "bad", "-n", namespace, "--type=merge", "-p",
             json.dumps({"spec": {"model": {"tiny": {"heads": 4}}}}))
    wait_for(lambda: len(kube.pods(namespace, "trainer")) == 2, "children after the fix")
    assert wait_for(lambda: kube.condition(namespace, "bad", "Valid").get("status") == "True", "Valid=True")


def test_an_invalid_edit_keeps_the_running_pods_on_the_last_valid_spec_until_fixed(kube, operator, installed, namespace):
    kube.apply(job_manifest("edit"), namespace)

    def uids():
        return {p["metadata"]["name"]: p["metadata"]["uid"] for role in ("trainer", "rollout")
                for p in kube.pods(namespace, role) if not p["metadata"].get("deletionTimestamp")}

    wait_for(lambda: len(uids()) == 3 and (kube.job(namespace, "edit").get("status") or {}).get("gangCreated"),
             "the gang and 1 rollout pod")
    running, config = uids(), kube.json("get", "configmap", "edit-config", "-n", namespace)["data"]
    patch = ["patch", "rljob", "edit", "-n", namespace, "--type=merge", "-p"]
    kube.run(*patch, json.dumps({"spec": {"model": {"tiny": {"heads": 3}}, "rollout": {"replicas": 2}}}))
    valid = wait_for(lambda: (v := kube.condition(namespace, "edit", "Valid")).get("status") == "False" and v,
                     "Valid=False")
    assert (valid["reason"], valid["message"]) == ("InvalidSpec", (
        "spec.model.tiny.heads: heads = 3 does not divide hiddenSize = 64; fix the spec (kubectl edit rljob); "
        "the job goes on with its last valid spec (generation 1) until then"))
    time.sleep(3)  # three active intervals: the gang is still managed, nothing of generation 2 was applied
    job = kube.job(namespace, "edit")
    assert job["status"]["phase"] == "Starting" and job["status"]["observedGeneration"] == 2
    assert uids() == running  # no second rollout pod either: that is generation 2's
    assert kube.json("get", "configmap", "edit-config", "-n", namespace)["data"] == config

    # After an operator restart the last valid spec comes from the config ConfigMap, runPolicy from the edit.
    async def kept_after_restart():
        api = await KubeApi.connect(str(installed))
        try:
            recorded = await resolution.read_recorded("edit", namespace, api)
            return kept_spec({"runPolicy": {"backoffLimit": 7}}, JobRuntime(), recorded)
        finally:
            await api.close()

    generation, spec = asyncio.run(kept_after_restart())
    assert generation is None and spec.model.tiny.heads == 4 and spec.rollout.replicas == 1
    assert spec.run_policy.backoff_limit == 7

    # runPolicy edits still act on the kept spec: suspend deletes the pods and the job stays Suspended; a resume
    # while still invalid comes back on the last valid spec (1 rollout pod); the fixed spec then applies.
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    wait_for(lambda: not uids(), "pods deleted on suspend")
    time.sleep(2)
    assert kube.job(namespace, "edit")["status"]["phase"] == "Suspended"
    assert kube.condition(namespace, "edit", "Suspended")["status"] == "True"
    kube.run(*patch, json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    wait_for(lambda: len(uids()) == 3, "the gang and 1 rollout pod of the last valid spec after the resume")
    assert kube.condition(namespace, "edit", "Valid")["status"] == "False"
    kube.run(*patch, json.dumps({"spec": {"model": {"tiny": {"heads": 4}}}}))
    wait_for(lambda: len(uids()) == 4, "the gang and 2 rollout pods of the fixed spec")
    assert wait_for(lambda: kube.condition(namespace, "edit", "Valid").get("status") == "True", "Valid=True")


def test_progress_hashes_reach_status_and_printer_columns(kube, operator, namespace, redis_server):
    kube.apply(job_manifest("prog", redis=external_redis(kube, namespace, redis_server)), namespace)
    prefix = f"rljob:{namespace}:prog:"
    client = redis_server.client()
    client.hset(prefix + "progress", mapping={"step": 5, "documents_seen": 320, "model_version": 320,
                                               "tokens_per_second": "950.0",
                                               "metrics": json.dumps({"train_samples_reward": 0.5})})
    client.hincrbyfloat(prefix + "rollout", "reward_sum:256", 6.0)
    client.hincrby(prefix + "rollout", "reward_count:256", 8)
    # the first pass writes the progress with phase Pending, then Starting once it has created the gang
    status = wait_for(lambda: (s := kube.job(namespace, "prog").get("status") or {}).get("step") == 5
                      and s.get("gangCreated") and s, "progress in status")
    assert (status["documentsSeen"], status["modelVersion"], status["rolloutReward"]) == (320, 320, 0.75)
    assert status["lastMetrics"] == {"train_samples_reward": 0.5}
    redis_ready = kube.condition(namespace, "prog", "RedisReady")
    assert (redis_ready["status"], redis_ready["reason"]) == ("True", "RedisAvailable")
    row = kube.run("get", "rljob", "prog", "-n", namespace).stdout.split("\n")[1].split()
    assert row[:7] == ["prog", "Starting", "2", "5", "5", "320", "0.75"]  # 5 of maxSteps 100: 5 %; ETA empty
    assert kube.job(namespace, "prog")["status"]["progressPercentage"] == 5  # before Running
    client.hset(prefix + "progress", mapping={"step": 6})
    wait_for(lambda: kube.job(namespace, "prog")["status"].get("step") == 6, "the next step")

    # a rollout worker's batch whose every reward failed: RolloutReady=False/AllRewardsFailed + a Warning Event
    client.hset(prefix + "rollout", "all_rewards_failed", json.dumps(
        {"version": 320, "samples": 8, "errors": {"ZeroDivisionError": 8}, "message": "..."}))
    failed = wait_for(lambda: (r := kube.condition(namespace, "prog", "RolloutReady")).get("reason")
                      == "AllRewardsFailed" and r, "RolloutReady=AllRewardsFailed")
    assert failed["status"] == "False" and failed["message"].startswith(
        "every one of the 8 samples of a rollout worker's last batch (weights version 320) failed its reward "
        "function: ZeroDivisionError ×8;")
    events = wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                               if e["reason"] == "AllRewardsFailed"], "an AllRewardsFailed Event")
    assert events[0]["type"] == "Warning" and "ZeroDivisionError ×8" in events[0]["message"]
    client.hdel(prefix + "rollout", "all_rewards_failed")  # the next batch scored
    wait_for(lambda: kube.condition(namespace, "prog", "RolloutReady").get("reason") in ("Unschedulable", "PodsNotReady"),
             "RolloutReady back to the pods' readiness (no node here: the rollout pod is unschedulable)")


def test_a_private_redis_ca_is_mounted_and_verifies_the_operators_reads(kube, operator, namespace, redis_tls_server):
    """rediss:// with spec.redis.caSecretRef: a missing Secret is named in RedisReady (and not rewritten every pass);
    a CA that did not sign the server's certificate is named too; once the Secret holds the right CA the operator's
    own read verifies the server with it, and the pods mount it."""
    server = redis_tls_server
    kube.run("create", "secret", "generic", "tls-redis", "-n", namespace, f"--from-literal=password={server.password}")
    kube.apply(job_manifest("tls", redis={"mode": "external", "url": server.url,
                                          "passwordSecretRef": {"name": "tls-redis", "key": "password"},
                                          "caSecretRef": {"name": "redis-ca", "key": "ca.crt"}}), namespace)
    missing = wait_for(lambda: (r := kube.condition(namespace, "tls", "RedisReady")).get("status") == "False" and r,
                       "RedisReady=False for the missing CA Secret")
    assert missing["message"] == (f"spec.redis.caSecretRef: Secret {namespace}/redis-ca or its key 'ca.crt' does not "
                                  "exist; create it or fix the reference")
    # settled: the gang is created and the scheduler has said why its pods wait (both are status writes of their own)
    before = wait_for(lambda: (job := kube.job(namespace, "tls"))["status"].get("gangCreated") and all(
        c["reason"] == "Unschedulable" for c in job["status"]["conditions"] if c["type"] in ("TrainerReady",
                                                                                             "RolloutReady")) and job,
        "the gang created and its pods unschedulable")
    quiet_for(kube, namespace, "tls", before, seconds=3.0)  # three active intervals: the same problem is not rewritten

    kube.run("create", "secret", "generic", "redis-ca", "-n", namespace,
             f"--from-file=ca.crt={server.tls.foreign_ca_file}")
    wrong = wait_for(lambda: "did not verify" in (r := kube.condition(namespace, "tls", "RedisReady")).get("message", "")
                     and r, "RedisReady=False for a CA that did not sign the server's certificate")
    assert wrong["status"] == "False" and wrong["message"].startswith(
        f"the TLS certificate of Redis at {server.host}:{server.port} did not verify against the CAs of "
        f"spec.redis.caSecretRef (Secret {namespace}/redis-ca, key 'ca.crt'): self-signed certificate in certificate "
        "chain; set spec.redis.caSecretRef to a Secret key holding the CA that signed it")

    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "redis-ca"},
                "stringData": {"ca.crt": server.tls.ca_file.read_text()}}, namespace)  # the right CA
    ready = wait_for(lambda: (r := kube.condition(namespace, "tls", "RedisReady")).get("status") == "True" and r,
                     "RedisReady=True over TLS")
    assert ready["message"] == f"reached Redis at {server.host}:{server.port}"
    for role in ("trainer", "rollout"):
        for pod in kube.pods(namespace, role):
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            (container,) = pod["spec"]["containers"]
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/rljob-redis-ca"]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["secret"]["secretName"] == "redis-ca"
            assert {"name": "REDIS_TLS_CA_FILE", "value": "/etc/rljob-redis-ca/ca.crt"} in container["env"]


def stale_status_writes(proc: "OperatorProcess") -> float:
    """Status writes the operator had refused with 409 so far (rljob_operator_reconcile_errors_total{kind=StaleStatus})."""
    prefix = 'rljob_operator_reconcile_errors_total{kind="StaleStatus"}'
    lines = [line for line in proc.get(proc.metrics, "/metrics").splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_rollout_changes_never_restart_the_trainer_gang_and_no_status_write_is_refused(kube, operator, namespace):
    refused_before = stale_status_writes(operator)
    kube.apply(job_manifest("scale"), namespace)

    def live(role):
        return {p["metadata"]["name"]: p for p in kube.pods(namespace, role) if not p["metadata"].get("deletionTimestamp")}

    def trainer_identity():
        return {n: (p["metadata"]["uid"], p["metadata"]["labels"]["rljob.dev/attempt"]) for n, p in live("trainer").items()}

    wait_for(lambda: len(live("trainer")) == 2 and len(live("rollout")) == 1
             and (kube.job(namespace, "scale").get("status") or {}).get("gangCreated"), "the gang and 1 rollout pod")
    trainers = trainer_identity()
    assert sorted(trainers) == ["scale-trainer-0", "scale-trainer-1"] and {a for _, a in trainers.values()} == {"0"}
    rollout0 = live("rollout")["scale-rollout-0"]["metadata"]["uid"]
    patch = ["patch", "rljob", "scale", "-n", namespace, "--type=merge", "-p"]

    kube.run(*patch, json.dumps({"spec": {"rollout": {"replicas": 3}}}))
    wait_for(lambda: sorted(live("rollout")) == ["scale-rollout-0", "scale-rollout-1", "scale-rollout-2"],
             "3 rollout pods")
    assert live("rollout")["scale-rollout-0"]["metadata"]["uid"] == rollout0  # scaling keeps the running replica
    kube.run(*patch, json.dumps({"spec": {"rollout": {"replicas": 1, "image": "rollout:2", "samplesPerPrompt": 4}}}))
    def replaced() -> bool:  # one listing: the pod may go between two (its replacement is under way)
        pods = live("rollout")
        return list(pods) == ["scale-rollout-0"] and pods["scale-rollout-0"]["spec"]["containers"][0]["image"] == "rollout:2"

    wait_for(replaced, "1 rollout pod with the new image")
    time.sleep(3)  # three active intervals: a restart would have begun
    assert trainer_identity() == trainers
    status = kube.job(namespace, "scale")["status"]
    assert (status["attempt"], status["restarts"], status["phase"]) == (0, 0, "Starting")
    assert not [e for e in kube.json("get", "events", "-n", namespace)["items"] if e["reason"] == "ConfigChanged"]
    assert stale_status_writes(operator) == refused_before


def test_a_topology_edit_of_a_running_job_restarts_the_gang_with_the_new_world_size(kube, operator, namespace):
    """Issue 24 item 4: nodes/processesPerNode of a job that is not suspended change as a gang restart (ConfigChanged,
    uncounted, naming the fields) whose new pods run the new world size and reshard the last checkpoint (DCP,
    tests/trainer/test_checkpoint_strategies.py); the rollout pods stay. A topology no trainer runs (tensorParallel >
    1: nothing to reshard into) is refused by the operator's check, naming the value, and the gang keeps its own."""
    kube.apply(job_manifest("resize"), namespace)

    def live(role):
        return {p["metadata"]["name"]: p for p in kube.pods(namespace, role)
                if not p["metadata"].get("deletionTimestamp")}

    def torchrun(pod) -> tuple[str, str, str]:
        args = " ".join(pod["spec"]["containers"][0]["command"] + pod["spec"]["containers"][0].get("args", []))
        return (pod["metadata"]["labels"]["rljob.dev/attempt"], re.search(r"--nnodes=(\d+)", args).group(1),
                re.search(r"--nproc-per-node=(\d+)", args).group(1))

    wait_for(lambda: len(live("trainer")) == 2 and len(live("rollout")) == 1
             and (kube.job(namespace, "resize").get("status") or {}).get("gangCreated"), "the gang and 1 rollout pod")
    assert {torchrun(p) for p in live("trainer").values()} == {("0", "2", "1")}
    assert kube.job(namespace, "resize")["status"]["dataParallelSize"] == 2
    rollout_uid = live("rollout")["resize-rollout-0"]["metadata"]["uid"]
    patch = ["patch", "rljob", "resize", "-n", namespace, "--type=merge", "-p"]

    kube.run(*patch, json.dumps({"spec": {"trainer": {"nodes": 1, "processesPerNode": 4}}}))  # 2 ranks -> 4
    wait_for(lambda: list(live("trainer")) == ["resize-trainer-0"]
             and torchrun(live("trainer")["resize-trainer-0"]) == ("1", "1", "4"), "attempt 1: 1 pod of 4 ranks")
    status = wait_for(lambda: (s := kube.job(namespace, "resize")["status"])["gangCreated"] and s, "gang 1 created")
    assert (status["attempt"], status["restarts"], status["failedAttempts"], status["dataParallelSize"]) == (1, 1, 0, 4)
    config = json.loads(kube.json("get", "configmap", "resize-config", "-n", namespace)["data"]["config.json"])
    assert config["dataParallelSize"] == 4
    changed = [e["message"] for e in kube.json("get", "events", "-n", namespace)["items"]
               if e["reason"] == "ConfigChanged"]
    assert any("(dataParallelSize, spec.trainer.nodes, spec.trainer.processesPerNode changed)" in m for m in changed), \
        changed
    assert live("rollout")["resize-rollout-0"]["metadata"]["uid"] == rollout_uid  # no rollout pod reads the topology

    # growing past the pods the old gang had: a restart like any edit, not a pod counted as deleted
    kube.run(*patch, json.dumps({"spec": {"trainer": {"nodes": 3, "processesPerNode": 1, "batch": {
        "documentsPerStep": 63}}}}))
    wait_for(lambda: sorted(live("trainer")) == ["resize-trainer-0", "resize-trainer-1", "resize-trainer-2"]
             and {torchrun(p) for p in live("trainer").values()} == {("2", "3", "1")}, "attempt 2: 3 pods of 1 rank")
    status = wait_for(lambda: (s := kube.job(namespace, "resize")["status"])["gangCreated"] and s, "gang 2 created")
    assert (status["attempt"], status["restarts"], status["failedAttempts"], status["dataParallelSize"]) == (2, 2, 0, 3)

    # the API server refuses a topology documentsPerStep does not divide by, naming the numbers
    result = kube.run(*patch, json.dumps({"spec": {"trainer": {"nodes": 2}}}), check=False)
    assert result.returncode != 0 and (
        "documentsPerStep 63 is not divisible by the data-parallel size 2 = nodes 2 × processesPerNode 1 / "
        "(tensorParallel 1 × pipelineParallel 1)") in result.stderr, result.stderr

    # tensorParallel 3 (3 ranks divide by it): no trainer runs it, so no checkpoint reshards into it
    kube.run(*patch, json.dumps({"spec": {"trainer": {"tensorParallel": 3}}}))
    valid = wait_for(lambda: (v := kube.condition(namespace, "resize", "Valid")).get("status") == "False" and v,
                     "Valid=False")
    assert (valid["reason"], valid["message"]) == ("NotSupported", (
        "spec.trainer.tensorParallel: 3: tensor parallelism > 1 is not supported yet (the trainer parallelises over "
        "data-parallel ranks only): set it to 1; fix the spec (kubectl edit rljob); the job goes on with its last "
        "valid spec (generation 3) until then; its gang keeps tensorParallel 1"))
    time.sleep(3)  # three active intervals: a restart would have begun
    assert {torchrun(p) for p in live("trainer").values()} == {("2", "3", "1")}
    assert kube.job(namespace, "resize")["status"]["restarts"] == 2


def test_a_trainer_only_job_runs_no_rollout_pod_says_where_producers_write_and_scales_without_a_restart(
        kube, operator, namespace):
    kube.apply(job_manifest("tonly", rollout={"replicas": 0}), namespace)

    def live(role):
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.pods(namespace, role)
                if not p["metadata"].get("deletionTimestamp")}

    ready = wait_for(lambda: kube.condition(namespace, "tonly", "RolloutReady").get("reason") == "ExternalProducers"
                     and len(live("trainer")) == 2 and kube.condition(namespace, "tonly", "RolloutReady"),
                     "RolloutReady=ExternalProducers and the gang")
    assert (ready["status"], ready["message"]) == ("True", (
        "spec.rollout.replicas is 0: rljob runs no rollout pod; producers outside rljob write documents to stream "
        "fast_llm_streaming (consumer group fast_llm_group) and read events from fast_llm_events at Redis "
        f"tonly-redis.{namespace}.svc.cluster.local:6379/0; they receive weights by heartbeating in "
        f"rljob:{namespace}:tonly:members as transfer rank 1 or above (status.stream)"))
    assert live("rollout") == {}
    stream = kube.job(namespace, "tonly")["status"]["stream"]
    assert stream == {
        "redisAddress": f"tonly-redis.{namespace}.svc.cluster.local:6379/0", "tls": False,
        "passwordSecretRef": {"name": "tonly-redis-auth", "key": "password"}, "streamKey": "fast_llm_streaming",
        "group": "fast_llm_group", "eventsKey": "fast_llm_events", "membersKey": f"rljob:{namespace}:tonly:members",
        "deadLetterKey": f"rljob:{namespace}:tonly:dead_letter", "firstTransferRank": 1,
        "weightsAddress": f"tonly-trainer-0.tonly-trainer.{namespace}.svc.cluster.local:29600"}
    assert kube.json("get", "secret", stream["passwordSecretRef"]["name"], "-n", namespace)["data"]["password"]
    trainers = live("trainer")

    patch = ["patch", "rljob", "tonly", "-n", namespace, "--type=merge", "-p"]
    kube.run(*patch, json.dumps({"spec": {"rollout": {"replicas": 1}}}))
    wait_for(lambda: list(live("rollout")) == ["tonly-rollout-0"]
             and (kube.job(namespace, "tonly")["status"].get("stream") or {}).get("firstTransferRank") == 2,
             "a rollout pod, and the first transfer rank above it")
    kube.run(*patch, json.dumps({"spec": {"rollout": {"replicas": 0}}}))
    wait_for(lambda: live("rollout") == {} and kube.condition(namespace, "tonly", "RolloutReady").get("reason")
             == "ExternalProducers", "no rollout pod again")
    assert live("trainer") == trainers  # neither edit restarted the gang
    status = kube.job(namespace, "tonly")["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0)


def test_metrics_and_liveness_endpoints(kube, operator, namespace):
    kube.apply(job_manifest("seen", runPolicy={"suspend": True}), namespace)
    wait_for(lambda: (kube.job(namespace, "seen").get("status") or {}).get("phase") == "Suspended", "Suspended")
    text = operator.get(operator.metrics, "/metrics")
    suspended = next(line for line in text.splitlines() if line.startswith('rljob_operator_jobs{phase="Suspended"}'))
    assert float(suspended.split()[-1]) >= 1
    assert "rljob_operator_reconcile_duration_seconds_count" in text
    assert operator.get(operator.liveness, "/healthz") is not None


def kubelet_status(kube: Kube, namespace: str, pod: str, phase: str, container: dict, scheduled: bool = True) -> None:
    """Write pod status the way a kubelet would (there are no nodes here): phase, conditions, one container."""
    ready = "running" in container["state"]
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": "True"})
    status = {"phase": phase, "conditions": conditions, "containerStatuses": [
        {"image": "x", "imageID": "", "ready": ready, "started": ready, "restartCount": 0, **container}]}
    kube.run("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge",
             "-p", json.dumps({"status": status}))


@pytest.fixture()
def ghost_node(kube):
    """A Node with no kubelet behind it, for binding pods whose status the tests then write (deleted afterwards)."""
    name = f"ghost-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    try:
        yield name
    finally:
        kube.run("delete", "node", name, "--wait=false", check=False)


def bind(kube: Kube, namespace: str, pod: str, node: str) -> None:
    kube.run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}}))


def test_crash_looping_and_unstartable_containers_are_named_on_the_job(kube, operator, namespace, ghost_node):
    """A rollout container in CrashLoopBackOff and trainer containers stuck in CreateContainerConfigError, as the kubelet
    reports them: the job's conditions quote the kubelet's reason, the restart count and the termination message, with
    one Warning Event each."""
    kube.apply(job_manifest("loop"), namespace)
    wait_for(lambda: len(kube.pods(namespace, "trainer")) == 2 and kube.pods(namespace, "rollout")
             and (kube.job(namespace, "loop").get("status") or {}).get("gangCreated"), "the gang and a rollout pod")
    for pod in ("loop-rollout-0", "loop-trainer-0", "loop-trainer-1"):
        bind(kube, namespace, pod, ghost_node)
    log_tail = ("2026-01-01 12:00:03,512 ERROR rljob_rollout.__main__: rollout: cannot start: "
                "spec.rollout.task.datasetPath: no file at '/data/nope.jsonl'\n")
    kubelet_status(kube, namespace, "loop-rollout-0", "Running", {
        "name": "rollout", "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": log_tail,
                                     "startedAt": "2026-01-01T12:00:02Z", "finishedAt": "2026-01-01T12:00:04Z"}}})
    for pod in ("loop-trainer-0", "loop-trainer-1"):
        kubelet_status(kube, namespace, pod, "Pending", {"name": "trainer", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "nosuch" not found'}}})

    rollout = wait_for(lambda: (r := kube.condition(namespace, "loop", "RolloutReady")).get("reason")
                       == "ContainerFailing" and r, "RolloutReady=False/ContainerFailing")
    assert rollout["message"] == (
        "0/1 rollout pods ready; failing: loop-rollout-0: container rollout CrashLoopBackOff, 4 restarts; last run: "
        f"exit code 2 (Error): {log_tail.strip()}")
    # The two trainer pods' statuses are two writes: a pass can see the first alone, so wait until both are named.
    trainer = wait_for(lambda: (r := kube.condition(namespace, "loop", "TrainerReady")).get("reason")
                       == "ContainerCannotStart" and "waiting for" not in r.get("message", "") and r,
                       "TrainerReady=False/ContainerCannotStart naming both trainer pods")
    assert trainer["message"] == ('0/2 trainer pods ready; cannot start: loop-trainer-0, loop-trainer-1: container '
                                  'trainer CreateContainerConfigError: secret "nosuch" not found')
    def warnings():
        found = {e["reason"]: e for e in kube.json("get", "events", "-n", namespace)["items"]
                 if e["reason"] in ("ContainerFailing", "ContainerCannotStart")}
        return found if len(found) == 2 else None

    events = wait_for(warnings, "a ContainerFailing and a ContainerCannotStart Event")
    assert {e["type"] for e in events.values()} == {"Warning"}
    assert "nope.jsonl" in events["ContainerFailing"]["message"]
    assert kube.job(namespace, "loop")["status"]["phase"] == "Starting"


def test_a_gang_whose_redis_is_unreachable_is_not_running(kube, operator, namespace, ghost_node):
    """Every trainer pod runs, but nothing listens at the external Redis URL: the job stays Starting with
    Running=False/RedisUnavailable (never Running=True while no step can be made)."""
    port = _free_port()  # nothing listens there
    kube.apply(job_manifest("noredis", redis={"mode": "external", "url": f"redis://127.0.0.1:{port}"}), namespace)
    wait_for(lambda: len(kube.pods(namespace, "trainer")) == 2
             and (kube.job(namespace, "noredis").get("status") or {}).get("gangCreated"), "the gang")
    for pod in ("noredis-trainer-0", "noredis-trainer-1"):
        bind(kube, namespace, pod, ghost_node)
        kubelet_status(kube, namespace, pod, "Running", {"name": "trainer",
                                                         "state": {"running": {"startedAt": "2026-01-01T12:00:00Z"}}})
    running = wait_for(lambda: (r := kube.condition(namespace, "noredis", "Running")).get("reason")
                       == "RedisUnavailable" and r, "Running=False/RedisUnavailable")
    assert running["status"] == "False" and running["message"].startswith(
        "attempt 0: all 2 trainer pods running, but no step can be made while Redis is not ready: cannot reach Redis "
        f"at 127.0.0.1:{port}")
    assert kube.condition(namespace, "noredis", "TrainerReady")["status"] == "True"
    time.sleep(2)  # two active intervals: it does not flip to Running
    status = kube.job(namespace, "noredis")["status"]
    assert status["phase"] == "Starting"
    assert [c["status"] for c in status["conditions"] if c["type"] in ("RedisReady", "Running")] == ["False", "False"]


def test_a_child_the_api_server_refuses_makes_the_job_invalid_and_redis_ready_says_what_it_sees(kube, operator,
                                                                                               namespace):
    """limits.cpu "-2" passes the CRD but not Pod validation: Valid=False quotes the API server; the managed Redis,
    already made, is reported as it is (here: its pod cannot be scheduled), not as "not checked yet"."""
    kube.apply(job_manifest("badres", trainer={"resources": {"limits": {"cpu": "-2"}}}), namespace)
    valid = wait_for(lambda: (v := kube.condition(namespace, "badres", "Valid")).get("status") == "False" and v,
                     "Valid=False")
    assert valid["reason"] == "InvalidSpec" and valid["message"].startswith(
        'spec.trainer.resources: the API server refused a child object: Pod "badres-trainer-0" is invalid')
    assert '"-2": must be greater than or equal to 0' in valid["message"]
    redis = wait_for(lambda: "cannot be scheduled" in (r := kube.condition(namespace, "badres", "RedisReady")).get(
        "message", "") and r, "RedisReady naming the Redis pod")
    assert redis["status"] == "False" and redis["message"].startswith(
        "managed Redis badres-redis: 0/1 replicas available")
    assert kube.job(namespace, "badres")["status"]["phase"] == "Invalid"
    # nothing of an invalid job runs: a rollout pod created beside the refused trainer pods is deleted
    wait_for(lambda: not [p for p in kube.pods(namespace, "rollout") if not p["metadata"].get("deletionTimestamp")],
             "no rollout pod of the invalid job")


def test_a_redis_claim_that_cannot_bind_is_named_in_redis_ready_until_fixed(kube, operator, namespace):
    """spec.redis.persistence names a StorageClass the cluster does not have: the operator's claim stays Pending and
    RedisReady says so (ClaimPending: the claim, its class and the PV controller's reason, read from the claim's
    Events under the operator's ServiceAccount), with one Warning Event. Switching persistence off moves Redis onto an
    emptyDir and deletes the claim; RedisReady then tells the Redis pod's own state (no nodes here)."""
    kube.apply(job_manifest("noclass", redis={"persistence": {"storageClassName": "fast", "size": "1Gi"}}), namespace)
    pending = wait_for(lambda: (r := kube.condition(namespace, "noclass", "RedisReady")).get("reason") == "ClaimPending"
                       and r, "RedisReady=False/ClaimPending")
    assert pending["status"] == "False" and pending["message"].startswith(
        "managed Redis noclass-redis: 0/1 replicas available")
    assert pending["message"].endswith(
        "; its data claim noclass-redis-data (storage class 'fast') is Pending: ProvisioningFailed: "
        'storageclass.storage.k8s.io "fast" not found; fix spec.redis.persistence (storageClassName, size) or the '
        "cluster's storage, or set spec.redis.persistence.enabled to false"), pending["message"]
    claim = kube.json("get", "pvc", "noclass-redis-data", "-n", namespace)
    assert claim["spec"]["storageClassName"] == "fast" and claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert claim["metadata"]["ownerReferences"][0]["name"] == "noclass"
    events = wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                               if e["involvedObject"]["kind"] == "RLTrainingJob" and e["reason"] == "ClaimPending"],
                      "a ClaimPending Event")
    assert [e["type"] for e in events] == ["Warning"] and 'storageclass.storage.k8s.io "fast" not found' in events[0][
        "message"]

    kube.run("patch", "rljob", "noclass", "-n", namespace, "--type=merge",
             "-p", json.dumps({"spec": {"redis": {"persistence": {"enabled": False}}}}))
    moved = wait_for(lambda: (r := kube.condition(namespace, "noclass", "RedisReady")).get("reason") == "RedisUnavailable"
                     and r, "RedisReady back to the Redis pod's state")
    assert "claim" not in moved["message"]
    wait_for(lambda: (c := kube.json("get", "pvc", "noclass-redis-data", "-n", namespace)) is None
             or c["metadata"].get("deletionTimestamp"), "the claim deleted")
    volumes = kube.json("get", "deployment", "noclass-redis", "-n", namespace)["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "data", "emptyDir": {}}]
    replaced = wait_for(lambda: [e for e in kube.json("get", "events", "-n", namespace)["items"]
                                 if e["reason"] == "RedisReplaced"], "a RedisReplaced Event")
    assert replaced[0]["type"] == "Warning" and "to an emptyDir" in replaced[0]["message"]


def test_watch_of_a_job_that_does_not_exist_says_so_in_one_line(kube, installed, namespace):
    kube.apply(job_manifest("here", runPolicy={"suspend": True}), namespace)

    def watch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rljob_operator.cli", "watch", *args], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "KUBECONFIG": str(kube.cp.kubeconfig)})

    missing = watch("nosuchjob", "-n", namespace)
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        3, "", f"rltrainingjob nosuchjob not found in namespace {namespace}\n")
    elsewhere = watch("here")  # the default namespace
    assert (elsewhere.returncode, elsewhere.stderr) == (3, "rltrainingjob here not found in namespace default\n")
    wait_for(lambda: (kube.job(namespace, "here").get("status") or {}).get("phase") == "Suspended", "Suspended")
    waited = watch("here", "-n", namespace, "--timeout=0.5")
    assert waited.returncode == 2 and waited.stderr == (
        f"RLTrainingJob {namespace}/here did not finish within 0 s\n"), waited.stderr
    # Not a terminal (a pipe): plain lines, the figures, then each condition.
    lines = waited.stdout.splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d here Suspended step 0/100 attempt 0 DP 2 documents - modelVersion - "
                        r"rollout reward - train reward - staleness -/-", lines[0]), waited.stdout
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d here Suspended=True JobSuspended: job suspended: .*", line)
               for line in lines[1:]), waited.stdout


def api_requests(proc: OperatorProcess) -> dict[tuple[str, str], float]:
    """(verb, resource) → the operator's own API requests so far (rljob_operator_api_requests_total)."""
    found = {}
    for line in proc.get(proc.metrics, "/metrics").splitlines():
        if line.startswith("rljob_operator_api_requests_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            found[(labels["verb"].strip('"'), labels["resource"].strip('"'))] = float(line.split()[-1])
    return found


def reconcile_count(proc: OperatorProcess) -> float:
    line = next(line for line in proc.get(proc.metrics, "/metrics").splitlines()
                if line.startswith("rljob_operator_reconcile_duration_seconds_count"))
    return float(line.split()[-1])


def settled_reconcile_count(proc: OperatorProcess) -> float:
    """The pass count once it has not moved for 4 s."""
    counts = [reconcile_count(proc)]
    while len(counts) < 5 or counts[-1] != counts[-5]:
        time.sleep(1)
        counts.append(reconcile_count(proc))
        assert len(counts) < 30, f"the paused replica keeps reconciling: {counts}"
    return counts[-1]


def test_two_replicas_one_active_and_failover(kube, operator, installed, namespace, tmp_path):
    """Runs last: it stops the module's operator. The replica with the higher peering priority works."""
    held = f"{namespace}-held"  # jobs the replica that takes over finds (besides earlier tests'), apart from `peer`
    kube.run("create", "namespace", held)
    kube.apply(job_manifest("held"), held)
    kube.apply(job_manifest("held-idle", runPolicy={"suspend": True}), held)
    wait_for(lambda: (kube.job(held, "held").get("status") or {}).get("gangCreated")
             and (kube.job(held, "held-idle").get("status") or {}).get("phase") == "Suspended", "2 jobs settled")
    paused_before = operator.logs().count("Pausing operations in favour of")
    second = OperatorProcess(installed, tmp_path / "second.log", priority=200)
    try:
        wait_for(lambda: operator.logs().count("Pausing operations in favour of") > paused_before,
                 "the lower-priority replica to pause")
        passes_while_paused = settled_reconcile_count(operator)  # passes in flight at the pause have ended
        # The replica that took over reads every job's children back once and applies none: they are as rendered.
        with_children = len(kube.json("get", "configmaps", "-A", "-l", "rljob.dev/role=config")["items"])
        assert with_children >= 2
        wait_for(lambda: api_requests(second).get(("get", "configmaps"), 0) >= with_children,
                 f"the new replica's first pass over {with_children} jobs")
        requests = api_requests(second)
        assert not [key for key in requests if key[0] == "apply" or key == ("create", "secrets")], requests
        assert requests[("get", "services")] >= with_children
        kube.apply(job_manifest("peer"), namespace)
        wait_for(lambda: len(kube.pods(namespace, "trainer")) == 2, "pods from the active replica")
        time.sleep(2)
        assert reconcile_count(operator) == passes_while_paused  # the paused replica did nothing
        assert reconcile_count(second) > 0
        resumed_before = operator.logs().count("Resuming operations")
        second.stop()
        wait_for(lambda: operator.logs().count("Resuming operations") > resumed_before,
                 "the waiting replica to resume", timeout=90)
        kube.apply(job_manifest("after"), namespace)
        wait_for(lambda: any(p["metadata"]["name"] == "after-trainer-0" for p in kube.pods(namespace, "trainer")),
                 "pods from the replica that took over", timeout=60)
    finally:
        second.stop()
