"""``spec.<role>.podTemplate`` against the real API server of the local control plane (no nodes: pods stay Pending):
the vendored Kubernetes schemas and the CEL rule refuse a wrong template at admission, ``kubectl explain`` shows its
shape, the operator creates pods the API server accepts with every kind of override, refuses what rljob sets, waits
for a PriorityClass that does not exist yet, replaces only the pods of the role whose template changed, and keeps an
emptyDir Redis from being replaced until the loss is accepted."""

from __future__ import annotations

import copy
import json
import time
import uuid

import pytest

from rljob_api import constants as c
from test_cluster import Kube, job_manifest, wait_for
from test_cluster import installed, kube, namespace, operator  # noqa: F401  (fixtures)
from test_pod_template import full_template

pytestmark = [pytest.mark.cluster]


def _refused(kube: Kube, manifest: dict, namespace: str) -> str:
    result = kube.apply(manifest, namespace, check=False)
    assert result.returncode != 0, f"accepted: {manifest}"
    return " ".join(result.stderr.split())


def test_the_api_server_refuses_a_wrong_template_and_explains_its_shape(kube, installed, namespace):
    def job(**spec):
        return job_manifest(f"t-{uuid.uuid4().hex[:6]}", **spec)

    wrong_type = _refused(kube, job(trainer={"podTemplate": {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "gpu"}}}}}}), namespace)
    assert ("spec.trainer.podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
            "nodeSelectorTerms: Invalid value: \"string\": spec.trainer.podTemplate.spec.affinity.nodeAffinity."
            "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms in body must be of type array: "
            "\"string\"") in wrong_type
    assert ("spec.rollout.podTemplate.spec.topologySpreadConstraints[0].whenUnsatisfiable: Required value"
            in _refused(kube, job(rollout={"podTemplate": {"spec": {"topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone"}]}}}), namespace))
    assert 'unknown field "spec.rollout.podTemplate.spec.volumes[0].hostpath"' in _refused(
        kube, job(rollout={"podTemplate": {"spec": {"volumes": [{"name": "d", "hostpath": {"path": "/d"}}]}}}),
        namespace)
    # a sidecar listed in containers (with an image, as a new user writes it): why, and where it goes instead; not
    # the API server's 'unknown field "...image"'
    sidecar = _refused(kube, job(trainer={"podTemplate": {"spec": {"containers": [
        {"name": "trainer", "env": [{"name": "A", "value": "1"}]},
        {"name": "logger", "image": "fluent/fluent-bit:3.1", "args": ["-c", "/conf/fluent-bit.conf"],
         "resources": {"limits": {"memory": "64Mi"}}}]}}}), namespace)
    assert ("spec.trainer.podTemplate.spec.containers[1].name: Invalid value: \"object\": 'logger' is not rljob's "
            "trainer container: podTemplate.spec.containers only adds env, envFrom, volumeMounts, securityContext to "
            "rljob's own container, named trainer, and cannot add a container (a pod ends only when all its regular "
            "containers have exited, so a trainer pod would never reach Succeeded); run a sidecar as a native sidecar "
            "instead: move it to podTemplate.spec.initContainers with restartPolicy: Always") in sidecar
    assert "unknown field" not in sidecar and "containers[0]" not in sidecar
    assert ("spec.redis.podTemplate.spec.containers[0].name: Invalid value: \"object\": 'exporter' is not rljob's "
            "redis container") in _refused(kube, job(redis={"podTemplate": {"spec": {"containers": [
                {"name": "exporter", "image": "oliver006/redis_exporter:v1.62.0"}]}}}), namespace)
    # what rljob renders on its own container: named, with the fields that configure it
    own = _refused(kube, job(rollout={"podTemplate": {"spec": {"containers": [
        {"name": "rollout", "image": "mine/rollout:1", "ports": [{"containerPort": 8080}]}]}}}), namespace)
    assert ("spec.rollout.podTemplate.spec.containers[0]: Forbidden: image, ports: rljob renders the rollout "
            "container itself (spec.rollout.image and spec.rollout.resources set its image and resources); its "
            "podTemplate.spec.containers entry adds only env, envFrom, volumeMounts, securityContext: remove the "
            "others, or run another program as a native sidecar (podTemplate.spec.initContainers with restartPolicy: "
            "Always)") in own
    assert "unknown field" not in own
    # a refused object field's content is not checked (any value is refused): no "unknown field" inside it either
    probe = _refused(kube, job(trainer={"podTemplate": {"spec": {"containers": [
        {"name": "trainer", "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 5},
         "resources": {"limits": {"memory": "1Gi"}}}]}}}), namespace)
    assert ("spec.trainer.podTemplate.spec.containers[0]: Forbidden: livenessProbe, resources: rljob renders the "
            "trainer container itself") in probe
    assert "unknown field" not in probe
    # its type is still checked (Kubernetes' type: command is a list)
    assert ("spec.trainer.podTemplate.spec.containers[0].command: Invalid value: \"string\"") in _refused(
        kube, job(trainer={"podTemplate": {"spec": {"containers": [{"name": "trainer", "command": "python"}]}}}),
        namespace)
    assert "spec.trainer.podTemplate.spec.containers[0].env[1]: Duplicate value" in _refused(
        kube, job(trainer={"podTemplate": {"spec": {"containers": [{"name": "trainer", "env": [
            {"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}]}}}), namespace)
    assert "spec.trainer.podTemplate.spec.volumes[0].name: Required value" in _refused(
        kube, job(trainer={"podTemplate": {"spec": {"volumes": [{"emptyDir": {}}]}}}), namespace)

    template = full_template("trainer")
    kube.apply(job_manifest("accepted", trainer={"podTemplate": template}), namespace)
    stored = kube.job(namespace, "accepted")["spec"]["trainer"]["podTemplate"]
    expected = copy.deepcopy(template)
    expected["spec"]["initContainers"][1]["ports"][0]["protocol"] = "TCP"  # Kubernetes' default, as on a Pod
    assert stored == expected

    explained = " ".join(kube.run("explain", "rljob.spec.trainer.podTemplate.spec.affinity.nodeAffinity."
                                  "requiredDuringSchedulingIgnoredDuringExecution").stdout.split())
    assert "FIELD: requiredDuringSchedulingIgnoredDuringExecution <Object>" in explained
    assert "nodeSelectorTerms <[]Object> -required-" in explained
    sidecar = " ".join(kube.run("explain", "rljob.spec.rollout.podTemplate.spec.initContainers").stdout.split())
    assert "Run before rljob's container" in sidecar and "restartPolicy <string>" in sidecar
    assert "lifecycle <Object>" in sidecar and "startupProbe <Object>" in sidecar


def _invalid(kube: Kube, namespace: str, name: str, why: str) -> dict:
    """The job's Valid condition once it is False (``why``: what the wait is for)."""
    return wait_for(lambda: (v := kube.condition(namespace, name, "Valid")).get("status") == "False" and v,
                    f"Valid=False for {why}")


def _live(kube: Kube, namespace: str, role: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kube.pods(namespace, role) if not p["metadata"].get("deletionTimestamp")}


def test_the_operator_merges_every_override_and_replaces_only_the_edited_roles_pods(kube, operator, namespace):
    priority = f"rljob-{uuid.uuid4().hex[:6]}"
    runtime_class = f"rljob-{uuid.uuid4().hex[:6]}"
    kube.run("create", "serviceaccount", "trainer-sa", "-n", namespace)
    templates = {}
    for role in ("trainer", "rollout", "redis"):
        templates[role] = full_template(role)
        templates[role]["spec"].update(priorityClassName=priority, runtimeClassName=runtime_class)
    try:
        kube.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": runtime_class},
                    "handler": "runc"})
        kube.apply(job_manifest("tpl", **{role: {"podTemplate": t} for role, t in templates.items()}), namespace)

        # The PriorityClass does not exist yet: the API server refuses the pods, the job says which field names it.
        valid = _invalid(kube, namespace, "tpl", "the missing PriorityClass")
        assert valid["message"].startswith("spec.")
        assert f"podTemplate.spec.priorityClassName: the API server refused a child object: pods \"tpl-" \
               in valid["message"]
        assert f"is forbidden: no PriorityClass with name {priority} was found (tried again every 30 s)" \
            in valid["message"]
        kube.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority},
                    "value": 1000})
        wait_for(lambda: len(_live(kube, namespace, "trainer")) == 2 and len(_live(kube, namespace, "rollout")) == 1,
                 "the gang and a rollout pod once the PriorityClass exists", timeout=150)
        assert wait_for(lambda: kube.condition(namespace, "tpl", "Valid").get("status") == "True", "Valid=True")

        for role in ("trainer", "rollout"):
            for pod in _live(kube, namespace, role).values():
                _assert_merged(pod, templates[role], role)
        redis = kube.json("get", "deployment", "tpl-redis", "-n", namespace)["spec"]["template"]
        _assert_merged(redis, templates["redis"], "redis")

        # a rljob-owned field: refused naming it, the pods stay as they are (the last valid spec)
        trainers = {n: p["metadata"]["uid"] for n, p in _live(kube, namespace, "trainer").items()}
        patch = ["patch", "rljob", "tpl", "-n", namespace, "--type=json", "-p"]
        kube.run(*patch, json.dumps([{"op": "add", "path": "/spec/trainer/podTemplate/spec/containers/0/env/-",
                                      "value": {"name": "RLJOB_CONFIG", "value": "/tmp/mine.json"}}]))
        valid = _invalid(kube, namespace, "tpl", "RLJOB_CONFIG")
        assert valid["message"] == (
            "spec.trainer.podTemplate.spec.containers[0].env[2].name: 'RLJOB_CONFIG' is set by rljob in the trainer "
            "container (RLJOB_CONFIG, RLJOB_REPLICA_INDEX, RLJOB_ATTEMPT, RLJOB_JOB_UID, POD_IP, POD_NAME, "
            "POD_NAMESPACE, REDIS_PASSWORD, PYTHONUNBUFFERED): remove it; fix the spec (kubectl edit rljob); the job "
            "goes on with its last valid spec (generation 1) until then")
        time.sleep(2)
        assert {n: p["metadata"]["uid"] for n, p in _live(kube, namespace, "trainer").items()} == trainers
        kube.run(*patch, json.dumps([{"op": "remove", "path": "/spec/trainer/podTemplate/spec/containers/0/env/2"}]))
        wait_for(lambda: kube.condition(namespace, "tpl", "Valid").get("status") == "True", "Valid=True again")

        # the rollout's template: its pod is replaced, the gang keeps running
        rollout = {n: p["metadata"]["uid"] for n, p in _live(kube, namespace, "rollout").items()}
        kube.run("patch", "rljob", "tpl", "-n", namespace, "--type=merge", "-p",
                 json.dumps({"spec": {"rollout": {"podTemplate": {"metadata": {"labels": {"team": "rl-2"}}}}}}))
        wait_for(lambda: [p["metadata"]["labels"].get("team") for p in _live(kube, namespace, "rollout").values()]
                 == ["rl-2"], "the rollout pod replaced with the new label")
        assert {n: p["metadata"]["uid"] for n, p in _live(kube, namespace, "rollout").items()} != rollout
        # the managed Redis's template (persistent, the default): its Deployment's pod template changes, nothing else
        kube.run("patch", "rljob", "tpl", "-n", namespace, "--type=merge", "-p",
                 json.dumps({"spec": {"redis": {"podTemplate": {"metadata": {"labels": {"team": "rl-3"}}}}}}))
        wait_for(lambda: kube.json("get", "deployment", "tpl-redis", "-n", namespace)["spec"]["template"]["metadata"]
                 ["labels"].get("team") == "rl-3", "the Redis pod template with the new label")
        time.sleep(2)
        assert {n: p["metadata"]["uid"] for n, p in _live(kube, namespace, "trainer").items()} == trainers
        status = kube.job(namespace, "tpl")["status"]
        assert (status["attempt"], status["restarts"]) == (0, 0)
        # the trainer's template: the gang restarts (attempt 1), as for any field the trainer pods are made of
        kube.run("patch", "rljob", "tpl", "-n", namespace, "--type=merge", "-p",
                 json.dumps({"spec": {"trainer": {"podTemplate": {"metadata": {"labels": {"team": "rl-4"}}}}}}))
        wait_for(lambda: {(p["metadata"]["labels"][c.LABEL_ATTEMPT], p["metadata"]["labels"].get("team"))
                          for p in _live(kube, namespace, "trainer").values()} == {("1", "rl-4")}
                 and len(_live(kube, namespace, "trainer")) == 2, "the gang of attempt 1 with the new label", timeout=60)
        assert kube.job(namespace, "tpl")["status"]["attempt"] == 1
        assert [e for e in kube.json("get", "events", "-n", namespace)["items"] if e["reason"] == "ConfigChanged"]
    finally:
        kube.run("delete", "priorityclass", priority, "--ignore-not-found", check=False)
        kube.run("delete", "runtimeclass", runtime_class, "--ignore-not-found", check=False)


def _assert_merged(pod: dict, template: dict, container: str) -> None:
    """``pod`` (as the API server holds it) carries every part of ``template`` on top of rljob's own."""
    meta, spec, wanted = pod["metadata"], pod["spec"], template["spec"]
    assert meta["labels"]["team"] == template["metadata"]["labels"]["team"]
    assert meta["labels"][c.LABEL_ROLE] == container
    assert meta["annotations"]["example.com/owner"] == "alice"
    for field in ("serviceAccountName", "automountServiceAccountToken", "priorityClassName", "runtimeClassName",
                  "schedulerName", "affinity", "imagePullSecrets"):
        assert spec[field] == wanted[field], field
    assert [t["topologyKey"] for t in spec["topologySpreadConstraints"]] == ["topology.kubernetes.io/zone"]
    assert spec["securityContext"]["runAsUser"] == 1000 and spec["securityContext"]["fsGroup"] == 2000
    assert [(i["name"], i.get("restartPolicy")) for i in spec["initContainers"]] == [("fetch", None),
                                                                                    ("log-shipper", "Always")]
    assert {"datasets", "hf-cache"} <= {v["name"] for v in spec["volumes"]}
    (own,) = spec["containers"]  # no extra regular container
    assert own["name"] == container
    env = {e["name"] for e in own["env"]}
    assert {"WANDB_API_KEY", "HF_HOME", c.ENV_REDIS_PASSWORD} <= env
    assert own["envFrom"] == [{"configMapRef": {"name": "nccl-settings"}}]
    assert {"/datasets", "/cache/hf"} <= {m["mountPath"] for m in own["volumeMounts"]}
    assert own["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_an_emptydir_redis_is_not_replaced_for_its_template_until_the_loss_is_accepted(kube, operator, namespace):
    kube.apply(job_manifest("ephemeral", redis={"persistence": {"enabled": False}}), namespace)

    def redis_labels() -> dict:
        found = kube.json("get", "deployment", "ephemeral-redis", "-n", namespace)
        return found["spec"]["template"]["metadata"]["labels"] if found else {}

    wait_for(lambda: redis_labels() and (kube.job(namespace, "ephemeral").get("status") or {}).get("gangCreated"),
             "the Redis Deployment and the gang")
    before = kube.json("get", "deployment", "ephemeral-redis", "-n", namespace)["metadata"]["generation"]
    kube.run("patch", "rljob", "ephemeral", "-n", namespace, "--type=merge", "-p",
             json.dumps({"spec": {"redis": {"podTemplate": {"metadata": {"labels": {"team": "rl"}}}}}}))
    valid = _invalid(kube, namespace, "ephemeral", "the emptyDir Redis")
    assert valid["message"] == (
        "spec.redis.podTemplate: changing it replaces the managed Redis pod, and this Redis keeps its data in an "
        "emptyDir (spec.redis.persistence.enabled is false, or the Redis was made before persistence existed): the "
        "new pod would start without the stream, its consumer group and the progress and checkpoint hashes, and the "
        "gang would restart from its newest checkpoint. Enable spec.redis.persistence instead (that also replaces the "
        "Redis pod, once), or accept the loss: kubectl annotate rljob ephemeral rljob.dev/allow-redis-data-loss=true; "
        "fix the spec (kubectl edit rljob); the job goes on with its last valid spec (generation 1) until then")
    time.sleep(2)
    deployment = kube.json("get", "deployment", "ephemeral-redis", "-n", namespace)
    assert "team" not in redis_labels() and deployment["metadata"]["generation"] == before
    kube.run("annotate", "rljob", "ephemeral", "-n", namespace, f"{c.ANNOTATION_ALLOW_REDIS_DATA_LOSS}=true")
    wait_for(lambda: redis_labels().get("team") == "rl", "the Redis pod template with the label once accepted")
    assert wait_for(lambda: kube.condition(namespace, "ephemeral", "Valid").get("status") == "True", "Valid=True")
