"""RLTrainingJobs queued by the real Kueue (docs/kueue.md) on the node cluster: Kueue's manager built from source
(localcluster/build-go-tools.sh) runs next to the control plane with its webhooks (rljob_localcluster.kueue), the
operator runs as a pod under the chart's RBAC, and the trainer and rollout pods run on real kubelets that advertise
fake ``nvidia.com/gpu`` (4 per node), which the ClusterQueues below count.

- issue 12's "Done when" job: ``examples/rljob-cpu-configmap-reward.yaml`` with a pod template of every kind on each
  role, held while its ClusterQueue lacks GPUs for trainer and rollout together (no pod at all, the Redis running),
  admitted once the quota fits, on the flavor's node; an edit of the reward ConfigMap replaces the rollout pod only; a
  trainer pod deleted restarts the whole gang (2 FSDP ranks, ``parallelism`` left to its default) from its sharded
  checkpoint while the Workload stays admitted: Restarting ``PodDeleted`` naming the pod, every pod of attempt 0 gone
  before any of attempt 1 exists, attempt 1 going on from the step after the checkpoint it loaded, no document lost;
  Succeeded, the trainer pod beside its native sidecar too, and the Workload Finished;
- a job preempted by a higher-priority one (its pods deleted, nothing counted) that resumes from its checkpoint and
  succeeds once the other one has finished;
- a job scaled 1 → 2 → 1 rollout replicas through Kueue's Workload slices (the scale-up waiting for quota first),
  its trainer gang never restarted.

The jobs share what they can (one job takes the queue, the overrides, the reward edit and the gang restart) because each
costs minutes on 2 cores. On ``--cluster=existing`` the cluster must run Kueue already (with RLTrainingJob as an
external framework).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from rljob_api import constants as c

from .conftest import (
    Cluster,
    Recorder,
    check_attempts_never_mixed,
    check_trained_once,
    checkpointed_job,
    condition,
    example_documents,
    get_job,
    job_manifest,
    merge,
    phase,
    pvc,
    redis_snapshot,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.kueue]

GPU = "nvidia.com/gpu"
NODE = "rljob-node-1"
"""Where the flavor places admitted pods (kubernetes.io/hostname)."""
HOSTNAME = "kubernetes.io/hostname"
HELD_S = 20
"""How long a held job is watched for a pod that should not exist (seconds)."""
REWARD_EXAMPLE = "rljob-cpu-configmap-reward.yaml"
MAX_STEPS = 40
EVERY_STEPS = 5
EDITED_OFFSET = 10.0
"""What the edited helper adds to every reward: the new code's rewards are at least this, the example's at most 1."""
EDITED_SCORING = f"""def share(text: str, letter: str) -> float:
    return {EDITED_OFFSET} + (text.count(letter) / len(text) if text else 0.0)
"""
SIDECAR = ("trap 'echo sidecar: stopped; exit 0' TERM; echo sidecar: started; "
           "while true; do sleep 1; done")


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[None]:
    """Kueue for the module: started next to the local control plane (stopped at the end, also on failure); on an
    existing cluster it must be installed."""
    if cluster.mode != "local":
        if cluster.get("crd", "workloads.kueue.x-k8s.io") is None:
            pytest.skip("the existing cluster runs no Kueue")
        yield None
        return
    from conftest_cluster import acquire_control_plane, release_control_plane
    from rljob_localcluster.kueue import LocalKueue

    cp = acquire_control_plane()  # the suite's own (already started, shared): counted, released below
    try:
        with LocalKueue(cp):
            yield None
    finally:
        release_control_plane()


def queues(cluster: Cluster, namespace: str, gpus: int, *, preempt: bool = False) -> str:
    """ResourceFlavor ``namespace`` (pods on :data:`NODE`), ClusterQueue ``cq-<namespace>`` with ``gpus`` of it,
    LocalQueue ``lq`` in ``namespace``; returns the ClusterQueue's name (the cluster-scoped ones outlive the test,
    named after its namespace)."""
    cq = f"cq-{namespace}"
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": namespace},
                   "spec": {"nodeLabels": {HOSTNAME: NODE}}}, namespace)
    # Kueue admits only resources the queue covers: the pods' CPU and memory get room to spare, GPUs are the limit
    resources = [{"name": "cpu", "nominalQuota": 64}, {"name": "memory", "nominalQuota": "256Gi"},
                 {"name": GPU, "nominalQuota": gpus}]
    spec = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}, "resourceGroups": [{
        "coveredResources": [r["name"] for r in resources], "flavors": [{"name": namespace, "resources": resources}]}]}
    if preempt:
        spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
                   "spec": spec}, namespace)
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq"},
                   "spec": {"clusterQueue": cq}}, namespace)
    return cq


def queued(manifest: dict, priority: str | None = None) -> dict:
    manifest["metadata"]["labels"] = {c.LABEL_KUEUE_QUEUE_NAME: "lq",
                                      **({c.LABEL_KUEUE_PRIORITY_CLASS: priority} if priority else {})}
    return manifest


def gpu_spec(max_steps: int, trainer_gpus: int) -> dict:
    """Trainer 1 pod x 2 processes with ``trainer_gpus`` fake GPUs (the CPU trainer ignores them), rollout 1 pod
    with 1."""
    return {"trainer": {"maxSteps": max_steps, "resources": {"limits": {GPU: trainer_gpus}}},
            "rollout": {"resources": {"limits": {GPU: 1}}}, "runPolicy": {"cleanPodPolicy": "None"}}


def workload(cluster: Cluster, namespace: str, job: str) -> dict:
    return cluster.get("workloads.kueue.x-k8s.io", f"{job}-workload", "-n", namespace) or {}


def workload_condition(wl: dict, ctype: str) -> dict:
    return next((cd for cd in (wl.get("status") or {}).get("conditions", []) if cd["type"] == ctype), {})


def prerequisites(cluster: Cluster, namespace: str) -> None:
    """What the pod templates of :func:`overrides` name: a ServiceAccount, a pull Secret, a ConfigMap for envFrom,
    and the cluster-scoped PriorityClass and RuntimeClass (runc, the nodes' containerd handler), named after the
    namespace."""
    cluster.kubectl("create", "serviceaccount", "rl-pods", "-n", namespace)
    cluster.kubectl("create", "secret", "docker-registry", "registry", "-n", namespace, "--docker-server=registry.invalid",
                    "--docker-username=rl", "--docker-password=unused")
    cluster.kubectl("create", "configmap", "rl-settings", "-n", namespace, "--from-literal=E2E_FROM=envFrom")
    cluster.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": f"rl-{namespace}"},
                   "value": 100}, namespace)
    cluster.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": f"runc-{namespace}"},
                   "handler": "runc"}, namespace)


def overrides(role: str, image: str, namespace: str) -> dict:
    """A pod template with an override of every kind that docs/pod-templates.md lists: labels, annotations, the
    pod-level fields rljob lets the template set, pod and container securityContext, a volume and its mount, a
    topology spread, a pull Secret, env and envFrom, an init container that runs to completion and a native sidecar."""
    return {
        "metadata": {"labels": {"team": "rl"}, "annotations": {"example.com/owner": "e2e"}},
        "spec": {
            "serviceAccountName": "rl-pods",
            "automountServiceAccountToken": False,
            "priorityClassName": f"rl-{namespace}",
            "runtimeClassName": f"runc-{namespace}",
            "schedulerName": "default-scheduler",
            "imagePullSecrets": [{"name": "registry"}],
            "securityContext": {"fsGroup": 2000},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": HOSTNAME, "operator": "In", "values": ["rljob-node-0", NODE]}]}]}}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "ScheduleAnyway",
                                           "labelSelector": {"matchLabels": {c.LABEL_ROLE: role}}}],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "initContainers": [
                {"name": "prepare", "image": image, "command": ["sh", "-c", "echo prepared > /scratch/ready; "
                                                                            "cat /scratch/ready"],
                 "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
                {"name": "sidecar", "image": image, "restartPolicy": "Always", "command": ["sh", "-c", SIDECAR]},
            ],
            "containers": [{"name": role, "env": [{"name": "E2E_MARKER", "value": role}],
                            "envFrom": [{"configMapRef": {"name": "rl-settings"}}],
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch", "readOnly": True}],
                            "securityContext": {"allowPrivilegeEscalation": False}}],
        },
    }


def check_overrides(pod: dict, role: str, namespace: str) -> None:
    """Every override of :func:`overrides` landed on ``pod`` next to what rljob sets."""
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "rl" and meta["labels"][c.LABEL_ROLE] == role, meta["labels"]
    assert meta["annotations"]["example.com/owner"] == "e2e"
    assert (spec["serviceAccountName"], spec["automountServiceAccountToken"], spec["priorityClassName"],
            spec["runtimeClassName"], spec["schedulerName"]) == (
        "rl-pods", False, f"rl-{namespace}", f"runc-{namespace}", "default-scheduler"), spec
    assert spec["imagePullSecrets"] == [{"name": "registry"}] and spec["securityContext"]["fsGroup"] == 2000, spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["rljob-node-0", NODE], terms
    assert spec["topologySpreadConstraints"][-1]["topologyKey"] == HOSTNAME
    assert "scratch" in {v["name"] for v in spec["volumes"]}
    assert [i["name"] for i in spec["initContainers"]][-2:] == ["prepare", "sidecar"], spec["initContainers"]
    (container,) = spec["containers"]
    assert container["name"] == role
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["E2E_MARKER"] == role and c.ENV_CONFIG in env, env
    assert container["envFrom"] == [{"configMapRef": {"name": "rl-settings"}}]
    assert {"name": "scratch", "mountPath": "/scratch", "readOnly": True} in container["volumeMounts"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_a_job_with_every_override_and_a_configmap_reward_waits_for_quota_then_trains_through_an_edit_and_a_restart(
        cluster, operator, kueue, namespace, diagnostics):
    """Issue 12's "Done when" as a test: the ConfigMap reward example with a pod template of every kind on each role
    (and labels on the Redis pod), queued by Kueue. Held while the ClusterQueue lacks GPUs for trainer and rollout
    together (no pod, the Redis running); admitted once the quota fits, on the flavor's node; an edit of the ConfigMap
    replaces the rollout pod only; a trainer pod deleted restarts the gang from its checkpoint while the Workload
    stays admitted; Succeeded with every document trained once, the Workload Finished, never evicted."""
    documents = example_documents(REWARD_EXAMPLE)
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    (manifest,) = [d for d in documents if d["kind"] == c.KIND]
    name = manifest["metadata"]["name"]
    diagnostics.job = name
    cq = queues(cluster, namespace, gpus=2)  # the trainer's 2 GPUs fit, the rollout pod's 1 more does not
    prerequisites(cluster, namespace)
    claim = f"{name}-checkpoints"
    cluster.apply(pvc(claim), namespace)
    spec = manifest["spec"]
    image = spec["trainer"]["image"]
    manifest["spec"] = merge(spec, {
        "trainer": {"nodes": 1, "processesPerNode": 2, "maxSteps": MAX_STEPS, "resources": {"limits": {GPU: 2}},
                    "checkpoint": {"everySteps": EVERY_STEPS, "volume": claim},
                    "podTemplate": overrides("trainer", image, namespace)},
        "rollout": {"resources": {"limits": {GPU: 1}}, "podTemplate": overrides("rollout", image, namespace)},
        "redis": {"podTemplate": {"metadata": {"labels": {"team": "rl"}}}},
        "runPolicy": {"cleanPodPolicy": "None"},  # keep the finished pods to read their containers' states
    })
    cluster.apply(config_map, namespace)

    def job() -> dict:
        return get_job(cluster, namespace, name)

    def running(role: str) -> list[dict]:
        return [p for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}={role}")
                if not p["metadata"].get("deletionTimestamp")]

    with Recorder(cluster, namespace, "pods") as pods, Recorder(cluster, namespace, "rljobs") as jobs:
        cluster.apply(queued(manifest), namespace)
        held = wait_for(lambda: condition(j := job(), c.ConditionType.RUNNING).get(
            "reason") == c.Reason.WAITING_FOR_ADMISSION.value and "insufficient" in condition(
            j, c.ConditionType.RUNNING)["message"] and j, 120, "WaitingForAdmission", diagnostics)
        assert phase(held) == "Pending", diagnostics()
        wait_for(lambda: ((cluster.get("deployment", f"{name}-redis", "-n", namespace) or {}).get("status") or {}).get(
            "readyReplicas") == 1, 180, "the Redis (outside the quota) to be ready", diagnostics)
        time.sleep(HELD_S)
        assert cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)") == [], diagnostics()
        (redis,) = cluster.items("pods", namespace, f"{c.LABEL_ROLE}=redis")
        assert redis["metadata"]["labels"]["team"] == "rl", redis["metadata"]["labels"]

        cluster.kubectl("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([{
            "op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/2/nominalQuota", "value": 3}]))
        first = wait_for(lambda: ((s := job().get("status") or {}).get("lastCheckpoint") or {}).get("step", 0) >= 1
                         and s.get("rolloutReward") is not None and s, 600,
                         "a checkpoint and a reward of the ConfigMap's code", diagnostics)
        assert first["phase"] == "Running" and 0.0 <= first["rolloutReward"] <= 1.0, first
        (rollout,) = running("rollout")
        trainers = running("trainer")
        assert len(trainers) == 1, trainers
        for pod, role in ((rollout, "rollout"), (trainers[0], "trainer")):
            check_overrides(pod, role, namespace)
            assert pod["spec"]["nodeName"] == NODE, pod["spec"].get("nodeName")
            assert c.LABEL_KUEUE_QUEUE_NAME not in pod["metadata"]["labels"]
        volumes = {v["name"]: v for v in rollout["spec"]["volumes"]}
        assert volumes["reward-source"]["configMap"]["name"] == config_map["metadata"]["name"]

        config_map["data"]["scoring.py"] = EDITED_SCORING
        cluster.apply(config_map, namespace)
        # The trainer pod goes next, while the new rollout pod waits for weights: the job is then certainly before its
        # last step (waiting for the edited reward to show in status gave a fast trainer time to finish first). The
        # final status shows the edited reward.
        (replaced,) = wait_for(lambda: (pods := running("rollout")) and len(pods) == 1
                               and pods[0]["metadata"]["uid"] != rollout["metadata"]["uid"]
                               and pods[0]["status"].get("phase") == "Running" and pods, 600,
                               "the rollout pod replaced for the edited ConfigMap", diagnostics)
        edited = job()["status"]
        assert edited["phase"] == "Running" and edited["restarts"] == 0 and edited["step"] < MAX_STEPS, edited
        assert [p["metadata"]["uid"] for p in running("trainer")] == [trainers[0]["metadata"]["uid"]]
        assert (replaced["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH]
                != rollout["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH])

        admitted = workload_condition(workload(cluster, namespace, name), "Admitted")
        assert admitted.get("status") == "True", workload(cluster, namespace, name)
        cluster.kubectl("delete", "pod", f"{name}-trainer-0", "-n", namespace, "--wait=false")
        final = wait_for(lambda: phase(j := job()) in ("Succeeded", "Failed") and j, 600, "the job to finish",
                         diagnostics)
    pods.check()
    jobs.check()
    status = final["status"]
    per_step = spec["trainer"]["batch"]["documentsPerStep"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["step"], status["restarts"], status["attempt"], status["failedAttempts"]) == (
        MAX_STEPS, 1, 1, 1), status
    assert status["dataParallelSize"] == 2 and status["rolloutReward"] >= EDITED_OFFSET, status
    assert status["lastCheckpoint"]["step"] == MAX_STEPS, status
    assert final["spec"]["trainer"]["parallelism"] == {"strategy": "fsdp", "replicate": 1}, final["spec"]["trainer"]
    check_attempts_never_mixed(pods, 2)
    restarting = [e.object for e in jobs.events if e.status.get("phase") == "Restarting"]
    assert restarting, [e.status.get("phase") for e in jobs.events]
    cause = condition(restarting[0], c.ConditionType.RESTARTING)
    assert (cause["status"], cause["reason"]) == ("True", c.Reason.POD_DELETED.value), cause
    assert f"{name}-trainer-0" in cause["message"], cause
    assert condition(final, c.ConditionType.RESTARTING).get("status") == "False"

    # attempt 1 loaded a checkpoint of attempt 0 and went on from the step after it
    resumed = cluster.kubectl("logs", "-n", namespace, f"{name}-trainer-0", "-c", "trainer").stdout
    loaded = re.findall(r"checkpoint: loaded \S+ \(step (\d+), documents_seen (\d+)", resumed)
    assert loaded, resumed[-3000:]
    step, documents = int(loaded[-1][0]), int(loaded[-1][1])
    assert step >= EVERY_STEPS and step % EVERY_STEPS == 0 and documents == step * per_step, loaded
    steps = [json.loads(line)["step"] for line in resumed.split("checkpoint: loaded")[-1].splitlines()
             if line.startswith('{"event": "step"')]
    assert steps and steps[0] == step + 1 and steps[-1] == MAX_STEPS, steps
    snapshot = redis_snapshot(cluster, namespace, final, diagnostics)
    check_trained_once(snapshot, status, MAX_STEPS * per_step)
    assert snapshot["dead_letter"] == 0 and int(snapshot["checkpoint"]["step"]) == MAX_STEPS, snapshot

    # attempt 1's trainer pod reached Succeeded beside its sidecar (stopped by the kubelet after the trainer exited)
    (trainer,) = wait_for(lambda: (ps := running("trainer")) and all(
        p["status"].get("phase") == "Succeeded" for p in ps) and ps, 120, "the trainer pod Succeeded", diagnostics)
    check_overrides(trainer, "trainer", namespace)
    init = {s["name"]: s for s in trainer["status"]["initContainerStatuses"]}
    assert init["prepare"]["state"]["terminated"]["exitCode"] == 0, init
    assert init["sidecar"]["state"].get("terminated") is not None, init
    (main,) = trainer["status"]["containerStatuses"]
    assert main["state"]["terminated"]["exitCode"] == 0, main
    logs = {ct: cluster.kubectl("logs", "-n", namespace, f"{name}-trainer-0", "-c", ct).stdout
            for ct in ("prepare", "sidecar")}
    assert "prepared" in logs["prepare"] and "sidecar: started" in logs["sidecar"], logs
    placed = cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)")
    assert placed and all(p["spec"]["nodeName"] == NODE for p in placed), [p["spec"].get("nodeName") for p in placed]

    # the restart was the operator's alone: Kueue never evicted or requeued the Workload, and Finished frees its quota
    wl = wait_for(lambda: workload_condition(w := workload(cluster, namespace, name), "Finished").get(
        "status") == "True" and w, 60, "the Workload Finished", diagnostics)
    assert workload_condition(wl, "Finished")["reason"] == "Succeeded"
    assert workload_condition(wl, "Evicted").get("status") != "True", wl["status"]
    assert not (wl["status"].get("schedulingStats") or {}).get("evictions"), wl["status"]
    assert "requeueState" not in wl["status"], wl["status"]
    assert [w["metadata"]["name"] for w in cluster.items("workloads.kueue.x-k8s.io", namespace)] == [f"{name}-workload"]


def test_a_preempted_job_resumes_from_its_checkpoint_once_the_higher_priority_job_is_done(
        cluster, operator, kueue, namespace, diagnostics):
    diagnostics.job = "low"
    queues(cluster, namespace, gpus=3, preempt=True)
    for priority, value in (("rljob-e2e-low", 10), ("rljob-e2e-high", 1000)):
        cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                       "metadata": {"name": priority}, "value": value}, namespace)
    cluster.apply(queued(checkpointed_job(cluster, namespace, "low", 5, gpu_spec(60, 2)), "rljob-e2e-low"), namespace)
    wait_for(lambda: "checkpoint: committed" in cluster.kubectl("logs", "-n", namespace, "low-trainer-0",
                                                                 check=False).stdout, 300,
             "low's first checkpoint", diagnostics, interval=0.5)
    high = queued(job_manifest("high", gpu_spec(10, 2)), "rljob-e2e-high")
    high["spec"]["trainer"].update(nodes=1, processesPerNode=2)
    cluster.apply(high, namespace)
    evicted = wait_for(lambda: condition(job := get_job(cluster, namespace, "low"), c.ConditionType.RUNNING).get(
        "reason") == c.Reason.EVICTED_BY_KUEUE.value and job, 120, "low evicted", diagnostics)
    assert "(Preempted: " in condition(evicted, c.ConditionType.RUNNING)["message"]
    assert phase(evicted) == "Pending" and evicted["spec"]["runPolicy"].get("suspend") in (None, False)
    done = wait_for(lambda: phase(job := get_job(cluster, namespace, "high")) in ("Succeeded", "Failed") and job,
                    600, "high to finish", diagnostics)
    assert phase(done) == "Succeeded", diagnostics()
    final = wait_for(lambda: phase(job := get_job(cluster, namespace, "low")) in ("Succeeded", "Failed") and job,
                     900, "low to resume and finish", diagnostics)
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["attempt"], status["restarts"], status["failedAttempts"]) == (1, 0, 0), status
    resumed = cluster.kubectl("logs", "-n", namespace, "low-trainer-0").stdout
    assert "checkpoint: loaded" in resumed, resumed[-3000:]
    assert workload_condition(workload(cluster, namespace, "low"), "Requeued").get("status") == "True"


def test_a_queued_job_scales_its_rollouts_through_workload_slices_restarting_nothing(
        cluster, operator, kueue, namespace, diagnostics):
    """Issue 28 item 4 on real kubelets: a queued, admitted job scaled 1 → 2 rollout replicas while its ClusterQueue
    has no GPU to spare waits for quota (RolloutReady ScaleUpWaitingForQuota, the gang untouched, no second rollout
    pod); once the quota grows Kueue admits the new Workload slice and finishes the old one (WorkloadSliceReplaced),
    the second rollout pod loads the trainer's weights; scaled back to 1 the slice shrinks in place. The trainer pods,
    the first rollout pod and the attempt never change, and training goes on throughout."""
    name = "elastic"
    diagnostics.job = name
    cq = queues(cluster, namespace, gpus=3)  # the trainer's 2 GPUs and one rollout pod's 1
    cluster.apply(queued(checkpointed_job(cluster, namespace, name, 5, gpu_spec(100_000, 2))), namespace)

    def job() -> dict:
        return get_job(cluster, namespace, name)

    def running(role: str) -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.items(
            "pods", namespace, f"{c.LABEL_ROLE}={role}") if not p["metadata"].get("deletionTimestamp")}

    def slices() -> list[dict]:
        return cluster.items("workloads.kueue.x-k8s.io", namespace)

    wait_for(lambda: (job().get("status") or {}).get("step", 0) >= 2 or None, 300, "step 2", diagnostics)
    trainers, rollouts = running("trainer"), running("rollout")
    assert len(trainers) == 1 and list(rollouts) == [f"{name}-rollout-0"], (trainers, rollouts)
    (first,) = slices()

    cluster.kubectl("scale", "rljob", name, "-n", namespace, "--replicas=2")
    # First "Kueue has not looked at it yet", then Kueue's own reason once it has (the quota it lacks).
    waiting = wait_for(lambda: (cond := condition(j := job(), c.ConditionType.ROLLOUT_READY)).get("reason")
                       == c.Reason.SCALE_UP_WAITING_FOR_QUOTA.value and "insufficient" in cond.get("message", "") and j,
                       120, "the scale-up waiting for quota, Kueue saying which", diagnostics)
    assert phase(waiting) == "Running" and running("rollout") == rollouts and running("trainer") == trainers

    cluster.kubectl("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([{
        "op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/2/nominalQuota", "value": 4}]))
    second = f"{name}-rollout-1"
    wait_for(lambda: "rollout: loaded weights of step" in cluster.kubectl("logs", "-n", namespace, second,
                                                                          check=False).stdout or None,
             300, f"{second} to load the trainer's weights", diagnostics)
    by_name = {w["metadata"]["name"]: w for w in slices()}
    assert workload_condition(by_name[first["metadata"]["name"]], "Finished").get("reason") == "WorkloadSliceReplaced"
    (grown,) = [w for n, w in by_name.items() if n != first["metadata"]["name"]]
    assert workload_condition(grown, "Admitted").get("status") == "True", grown.get("status")
    assert {p["name"]: p["count"] for p in grown["spec"]["podSets"]}["rollout"] == 2, grown["spec"]["podSets"]
    step_grown = job()["status"]["step"]

    cluster.kubectl("scale", "rljob", name, "-n", namespace, "--replicas=1")
    wait_for(lambda: running("rollout") == rollouts or None, 120, f"{second} gone", diagnostics)
    shrunk = cluster.get("workloads.kueue.x-k8s.io", grown["metadata"]["name"], "-n", namespace)
    assert shrunk["metadata"]["uid"] == grown["metadata"]["uid"]  # in place
    assert {p["name"]: p["count"] for p in shrunk["spec"]["podSets"]}["rollout"] == 1, shrunk["spec"]["podSets"]
    wait_for(lambda: (job().get("status") or {}).get("step", 0) > step_grown or None, 120,
             "training to go on after the scale-down", diagnostics)
    status = job()["status"]
    assert (status["attempt"], status["restarts"]) == (0, 0), status
    assert running("trainer") == trainers and running("rollout") == rollouts
