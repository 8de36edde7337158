"""Rendering: names, labels, env, ports, volumes, owner references, config hash and torchrun args."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest
import yaml

from rljob_api import constants as c
from rljob_api import names
from rljob_api.config import JobConfig
from rljob_api.spec import ApiModel, RLTrainingJobSpec, RolloutSpec, TrainerSpec

from rljob_operator import render
from rljob_operator.kube_api import adopt

from operator_helpers import make_job


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _all_pods(job: render.Job, attempt: int = 0) -> list[dict]:
    config = render.job_config(job)
    return [render.trainer_pod(job, config, i, attempt) for i in range(job.spec.trainer.nodes)] + [
        render.rollout_pod(job, config, i) for i in range(job.spec.rollout.replicas)
    ]


@pytest.mark.parametrize(
    ("nodes", "ppn"), [(2, 1), (1, 2)], ids=["2 pods x 1 process", "1 pod x 2 processes"]
)
def test_torchrun_args_fix_the_node_count_and_rendezvous_at_pod_0(nodes, ppn):
    job = make_job(trainer={"nodes": nodes, "processesPerNode": ppn, "rendezvousTimeoutSeconds": 120})
    config = render.job_config(job)
    assert config.data_parallel_size == 2
    for index in range(nodes):
        command = render.trainer_pod(job, config, index, attempt=0)["spec"]["containers"][0]["command"]
        assert command == [
            "torchrun",
            f"--nnodes={nodes}",
            f"--nproc-per-node={ppn}",
            f"--node-rank={index}",
            "--rdzv-backend=static",
            "--master-addr=demo-trainer-0.demo-trainer.ns.svc.cluster.local",
            "--master-port=29500",
            "--rdzv-conf=timeout=120",
            "--max-restarts=0",
            "-m",
            "rljob_trainer.train",
        ]


def test_trainer_pod_labels_env_ports_and_volumes():
    job = make_job(labels={c.LABEL_KUEUE_QUEUE_NAME: "team-a", "unrelated": "x"},
                   trainer={"nodes": 2, "resources": {"limits": {"cpu": "2"}}, "nodeSelector": {"pool": "gpu"},
                            "tolerations": [{"key": "k", "operator": "Exists"}]},
                   hfTokenSecretRef={"name": "hf", "key": "token"})
    config = render.job_config(job)
    pod = render.trainer_pod(job, config, 1, attempt=3)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "demo-trainer-1"
    assert meta["labels"] == {
        c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "trainer", "app.kubernetes.io/managed-by": "rljob-operator",
        c.LABEL_CONFIG_HASH: config.config_hash(), c.LABEL_REPLICA_INDEX: "1", c.LABEL_ATTEMPT: "3",
        c.LABEL_ROLE_CONFIG_HASH: render.role_config_hash(config, c.Role.TRAINER),
    }  # no queue label: Kueue's pod integration would make a second Workload for the pod (the job's is rljob's)
    assert (spec["hostname"], spec["subdomain"], spec["restartPolicy"]) == ("demo-trainer-1", "demo-trainer", "Never")
    container = spec["containers"][0]
    env = _env(container)
    assert env[c.ENV_CONFIG] == "/etc/rljob/config.json"
    assert env[c.ENV_REPLICA_INDEX] == "1" and env[c.ENV_ATTEMPT] == "3"
    assert c.ENV_JOB_UID not in env  # a Job without a uid (rendering outside a reconcile pass)
    with_uid = render.trainer_pod(dataclasses.replace(job, uid="0f6c-uid"), config, 1, attempt=3)
    assert _env(with_uid["spec"]["containers"][0])[c.ENV_JOB_UID] == "0f6c-uid"  # the owner of its Redis writes
    assert env[c.ENV_POD_IP] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[c.ENV_POD_NAME] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env[c.ENV_POD_NAMESPACE] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env[c.ENV_REDIS_PASSWORD] == {"secretKeyRef": {"name": "demo-redis-auth", "key": "password"}}
    assert env[c.ENV_HF_TOKEN] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {
        ("rendezvous", 29400), ("master", 29500), ("weights", 29600), ("metrics", 9400)
    }
    assert container["resources"] == {"limits": {"cpu": "2"}}
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"] == [{"key": "k", "operator": "Exists"}]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[next(n for n, p in mounts.items() if p == "/dev/shm")]["emptyDir"] == {"medium": "Memory"}
    assert volumes[next(n for n, p in mounts.items() if p == "/etc/rljob")]["configMap"] == {"name": "demo-config"}
    assert volumes[next(n for n, p in mounts.items() if p == c.CHECKPOINT_MOUNT_DIR)]["emptyDir"] == {}


def test_a_private_redis_ca_is_mounted_read_only_into_trainer_and_rollout_pods_and_named_by_env():
    tls = {"mode": "external", "url": "rediss://cache.example:6380/0", "passwordSecretRef": {"name": "pw", "key": "p"}}
    job = make_job(trainer={"nodes": 2}, rollout={"replicas": 1},
                   redis={**tls, "caSecretRef": {"name": "corp-ca", "key": "bundle.pem"}})
    pods = _all_pods(job)
    assert [p["metadata"]["labels"][c.LABEL_ROLE] for p in pods] == ["trainer", "trainer", "rollout"]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
        assert volume["secret"] == {"secretName": "corp-ca", "items": [{"key": "bundle.pem", "path": "ca.crt"}]}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": "/etc/rljob-redis-ca", "readOnly": True}
        assert _env(container)[c.ENV_REDIS_TLS_CA_FILE] == "/etc/rljob-redis-ca/ca.crt" == c.REDIS_CA_PATH
        assert c.REDIS_CA_PATH.startswith(mount["mountPath"] + "/")

    plain = _all_pods(make_job(trainer={"nodes": 2}, rollout={"replicas": 1}, redis=tls))  # system CAs
    for pod in plain:
        assert not [v for v in pod["spec"]["volumes"] if "secret" in v]
        assert c.ENV_REDIS_TLS_CA_FILE not in _env(pod["spec"]["containers"][0])


def test_checkpoint_pvc_and_model_volume():
    job = make_job(trainer={"checkpoint": {"volume": "ckpt"}}, model={"source": "path", "path": "/models/m1",
                                                                     "volume": "models"})
    pod = render.trainer_pod(job, render.job_config(job), 0, attempt=0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_rollout_pod_command_env_gpus_and_restart_policy():
    job = make_job(rollout={"backend": "vllm", "gpusPerReplica": 2, "replicas": 3,
                            "resources": {"requests": {"cpu": "4"}}})
    pod = render.rollout_pod(job, render.job_config(job), 2)
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "demo-rollout-2"
    assert container["command"] == ["python", "-m", "rljob_rollout"]
    assert _env(container)[c.ENV_REPLICA_INDEX] == "2"
    assert c.ENV_ATTEMPT not in _env(container) and c.ENV_JOB_UID not in _env(container)
    assert container["resources"] == {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": 2}}
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    # ready once the worker serves its metrics: after its backend (a vLLM engine) started
    assert container["readinessProbe"] == {"httpGet": {"path": "/metrics", "port": 9400}, "periodSeconds": 5}
    assert c.LABEL_ATTEMPT not in pod["metadata"]["labels"]
    assert job.spec.rollout.resources == {"requests": {"cpu": "4"}}  # rendering did not mutate the spec


def test_config_hash_is_identical_on_every_pod_and_matches_the_configmap():
    job = make_job(trainer={"nodes": 3, "batch": {"documentsPerStep": 96}}, rollout={"replicas": 2})
    config = render.job_config(job)
    cm = render.config_map(job, config)
    text = cm["data"]["config.json"]
    assert JobConfig.from_json(text).config_hash() == config.config_hash()
    hashes = {p["metadata"]["labels"][c.LABEL_CONFIG_HASH] for p in _all_pods(job)}
    assert hashes == {config.config_hash()}
    assert json.loads(text)["dataParallelSize"] == 3


def test_run_policy_does_not_change_the_config_hash():
    a = render.job_config(make_job())
    b = render.job_config(make_job(runPolicy={"backoffLimit": 9, "suspend": True, "ttlSecondsAfterFinished": 5}))
    assert a.config_hash() == b.config_hash()
    assert render.job_config(make_job(trainer={"maxSteps": 7})).config_hash() != a.config_hash()


ROLLOUT_ONLY_CHANGES = [
    {"replicas": 5}, {"image": "other:2"}, {"backend": "vllm", "gpusPerReplica": 1},
    {"resources": {"requests": {"cpu": "3"}}}, {"nodeSelector": {"pool": "a"}},
    {"tolerations": [{"key": "k", "operator": "Exists"}]}, {"promptsPerBatch": 2}, {"samplesPerPrompt": 2},
    {"maxLag": 7}, {"sampling": {"topP": 0.5, "maxNewTokens": 9}}, {"task": {"digits": 6}},
    {"task": {"datasetPath": "/d.jsonl", "rewardFunction": "m:f"}}, {"advantage": {"epsilon": 0.1}},
    {"filterZeroVariance": True}, {"seed": 3}, {"rewardFailureDeadlineSeconds": 60},
]


@pytest.mark.parametrize("rollout", ROLLOUT_ONLY_CHANGES, ids=lambda r: ",".join(r))
def test_rollout_only_fields_leave_the_trainer_pods_hash_alone(rollout):
    base = render.job_config(make_job())
    changed = render.job_config(make_job(rollout=rollout))
    assert changed.config_hash() != base.config_hash()  # the ConfigMap does change
    assert render.role_config_hash(changed, c.Role.TRAINER) == render.role_config_hash(base, c.Role.TRAINER)
    no_pod_reads = set(rollout) <= {"replicas", "rewardFailureDeadlineSeconds"}  # render.ROLLOUT_POD_IGNORES
    assert (render.role_config_hash(changed, c.Role.ROLLOUT) == render.role_config_hash(base, c.Role.ROLLOUT)) \
        == no_pod_reads


@pytest.mark.parametrize("change", [
    {"rollout": {"sampling": {"temperature": 0.5}}}, {"rollout": {"task": {"name": "digits-reverse"}}},
    {"trainer": {"maxSteps": 7}}, {"algorithm": {"loss": "gspo"}}, {"model": {"source": "tiny", "tiny": {"layers": 3}}},
    {"redis": {"streamKey": "s2"}},
])
def test_fields_the_trainer_reads_change_both_role_hashes(change):
    base = render.job_config(make_job())
    changed = render.job_config(make_job(**change))
    for role in (c.Role.TRAINER, c.Role.ROLLOUT):
        assert render.role_config_hash(changed, role) != render.role_config_hash(base, role)


def _leaves(model_type, prefix=""):
    for name, field in model_type.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, ApiModel):
            yield from _leaves(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


TRAINER_ONLY_CHANGES = [
    {"optimizer": {"learningRate": 1e-4}}, {"checkpoint": {"everySteps": 7}}, {"parallelism": {"strategy": "ddp"}},
    {"resources": {"requests": {"cpu": "3"}}}, {"collectiveTimeoutSeconds": 120}, {"export": {"safetensors": False}},
    {"activationCheckpointing": "full"}, {"image": "other:2"},
]


@pytest.mark.parametrize("trainer", TRAINER_ONLY_CHANGES, ids=lambda t: ",".join(t))
def test_trainer_only_fields_leave_the_rollout_pods_hash_alone(trainer):
    base = render.job_config(make_job())
    changed = render.job_config(make_job(trainer=trainer))
    assert render.role_config_hash(changed, c.Role.TRAINER) != render.role_config_hash(base, c.Role.TRAINER)
    assert render.role_config_hash(changed, c.Role.ROLLOUT) == render.role_config_hash(base, c.Role.ROLLOUT)


@pytest.mark.parametrize("trainer", [{"maxSteps": 7}, {"seed": 5}, {"batch": {"documentsPerStep": 256}},
                                     {"precision": {"param": "fp32"}}], ids=lambda t: ",".join(t))
def test_trainer_fields_a_rollout_reads_change_both_hashes(trainer):
    base = render.job_config(make_job())
    changed = render.job_config(make_job(trainer=trainer))
    for role in (c.Role.TRAINER, c.Role.ROLLOUT):
        assert render.role_config_hash(changed, role) != render.role_config_hash(base, role)


def test_every_trainer_field_is_classified_once():
    """A new trainer field must be put in ROLLOUT_READS_FROM_TRAINER or TRAINER_ONLY_FIELDS."""
    classes = list(render.ROLLOUT_READS_FROM_TRAINER) + list(render.TRAINER_ONLY_FIELDS)
    assert sorted(classes) == sorted(TrainerSpec.model_fields), set(classes) ^ set(TrainerSpec.model_fields)


def test_every_rollout_field_is_classified_once():
    """A new rollout field must be put in TRAINER_READS_FROM_ROLLOUT or ROLLOUT_ONLY_FIELDS."""
    classes = list(render.TRAINER_READS_FROM_ROLLOUT) + list(render.ROLLOUT_ONLY_FIELDS)
    for leaf in _leaves(RolloutSpec):
        owners = [p for p in classes if leaf == p or leaf.startswith(p + ".")]
        assert len(owners) == 1, f"spec.rollout.{leaf} is classified {len(owners)} times: {owners}"
    assert len(set(classes)) == len(classes)


def test_every_pod_carries_its_roles_hash_and_the_whole_configs_hash():
    job = make_job(trainer={"nodes": 2}, rollout={"replicas": 2})
    config = render.job_config(job)
    hashes = render.config_hashes(config)
    for pod in _all_pods(job):
        labels = pod["metadata"]["labels"]
        role = labels[c.LABEL_ROLE]
        assert labels[c.LABEL_CONFIG_HASH] == hashes.config
        assert labels[c.LABEL_ROLE_CONFIG_HASH] == (hashes.trainer if role == "trainer" else hashes.rollout)
    with pytest.raises(ValueError, match="role 'redis' has no pods"):
        render.role_config_hash(config, c.Role.REDIS)


def test_services_declare_every_port_and_are_headless():
    job = make_job()
    svc = render.trainer_service(job)
    assert svc["metadata"]["name"] == "demo-trainer"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "trainer"}
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("rendezvous", 29400, 29400), ("master", 29500, 29500), ("weights", 29600, 29600), ("metrics", 9400, 9400)
    ]
    redis = render.redis_service(job)
    assert redis["spec"]["clusterIP"] == "None" and redis["spec"]["ports"][0]["port"] == 6379


def test_managed_redis_deployment_secret_and_connection():
    job = make_job()
    config = render.job_config(job)
    deployment = render.redis_deployment(job, config)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert _env(container)["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "demo-redis-auth", "key": "password"}}
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert template_labels[c.LABEL_ROLE] == "redis"
    assert render.redis_secret(job, "s3cret")["stringData"] == {"password": "s3cret"}
    assert (config.redis.host, config.redis.port) == ("demo-redis.ns.svc.cluster.local", 6379)
    kinds = [child["kind"] for child in render.static_children(job, config)]
    assert kinds == ["ConfigMap", "Service", "Service", "Deployment"]  # the Secret and claim are create-only


def test_external_redis_has_no_managed_children_and_prefixed_keys():
    job = make_job(redis={"mode": "external", "url": "rediss://cache.example:6380/2",
                          "passwordSecretRef": {"name": "shared-redis", "key": "pw"}})
    config = render.job_config(job)
    assert (config.redis.host, config.redis.port, config.redis.tls, config.redis.db) == ("cache.example", 6380, True, 2)
    assert config.keys.stream == "rljob:ns:demo:fast_llm_streaming"
    assert [child["kind"] for child in render.static_children(job, config)] == ["ConfigMap", "Service"]
    env = _env(render.rollout_pod(job, config, 0)["spec"]["containers"][0])
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "shared-redis", "key": "pw"}}
    no_password = make_job(redis={"mode": "external", "url": "redis://cache:6379"})
    assert "REDIS_PASSWORD" not in _env(render.rollout_pod(no_password, render.job_config(no_password), 0)
                                        ["spec"]["containers"][0])


def test_long_job_names_are_hashed_within_63_characters():
    long_name = "a-very-long-reinforcement-learning-job-name-for-the-qwen-math-experiment-v2"
    job = make_job(name=long_name, trainer={"nodes": 2}, rollout={"replicas": 2})
    config = render.job_config(job)
    objs = render.static_children(job, config) + _all_pods(job) + [render.redis_secret(job, "x")]
    for obj in objs:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
        for value in obj["metadata"]["labels"].values():
            assert len(value) <= 63
    label = names.job_label(long_name)
    assert len(label) == 63 and label != long_name[:63]
    assert {o["metadata"]["labels"][c.LABEL_JOB_NAME] for o in objs} == {label}
    pod0 = render.trainer_pod(job, config, 0, 0)
    assert pod0["spec"]["hostname"] == names.trainer_pod(long_name, 0)
    assert config.trainer_master_host.startswith(pod0["spec"]["hostname"] + "." + pod0["spec"]["subdomain"] + ".ns.")


def test_adopt_sets_owner_reference_and_namespace_but_copies_no_labels(owner):
    owner["metadata"]["labels"] = {"team": "x"}
    job = make_job()
    children = render.static_children(job, render.job_config(job)) + _all_pods(job)
    adopt(children, owner)
    for child in children:
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "rljob.dev/v1alpha1", "kind": "RLTrainingJob", "name": "demo", "uid": "0f7a-uid",
            "controller": True, "blockOwnerDeletion": True,
        }]
        assert child["metadata"]["namespace"] == "ns"
        assert "team" not in child["metadata"]["labels"]


#: The pods' hashes of the examples as a fresh resolution computes them. Pods of a running attempt keep the hashes
#: recorded with their ConfigMap (operator/rljob_operator/resolution.py), so a change here restarts nothing on an
#: upgrade; it changes what a new job or an edited role gets. Changed on purpose by issue 10
#: (spec.trainer.parallelism, precision and activationCheckpointing with their defaults) and issue 11
#: (spec.redis.persistence with its defaults; spec.rollout.rewardFailureDeadlineSeconds with its default); the CPU
#: example's by issue 13 (its cosine learning-rate schedule over 300 steps, docs/learning-robustness.md); the rollout
#: hashes by issue 24 (the trainer fields no rollout process reads, render.TRAINER_ONLY_FIELDS, left out of it). The
#: vLLM example's since issue 23 (which added it). The rollout hashes again by issue 24 item 4 (the data-parallel size
#: left out of them: a topology edit restarts the gang alone). The environment example's since issue 27 item 5 (which
#: added it). The CPU example's job and trainer hashes by issue 26 (its trainer runs ddp, docs/trainer-step.md; the
#: rollout reads no parallelism field, so its hash stayed).
EXAMPLE_HASHES = {
    "grpo-digits-cpu": ("88229f4e3ef79ec6", "122072e0db915ee6", "df85cf321229654f"),
    "grpo-digits-vllm": ("359fc53ae6e17646", "e0de11f1c3f5606c", "9d14f2440fcc217a"),
    "grpo-qwen-math": ("dfe81c83a9716c45", "e2d974bfb04919ef", "ccd909a865910293"),
    "grpo-guess-cpu": ("4650b3a6dd72bb4d", "b8238c74a7f9591f", "a7cc666c1c098cd9"),
}


def test_the_examples_config_hashes_are_those_running_pods_carry():
    examples = Path(__file__).resolve().parents[2] / "examples"
    seen = {}
    for path in ("rljob-cpu.yaml", "rljob-vllm-cpu.yaml", "rljob.yaml", "rljob-environment-cpu.yaml"):
        for doc in yaml.safe_load_all((examples / path).read_text()):
            if doc and doc.get("kind") == "RLTrainingJob":
                job = render.Job(doc["metadata"]["name"], "default", RLTrainingJobSpec.model_validate(doc["spec"]))
                config = render.job_config(job)
                seen[job.name] = (config.config_hash(), render.role_config_hash(config, c.Role.TRAINER),
                                  render.role_config_hash(config, c.Role.ROLLOUT))
    assert seen == EXAMPLE_HASHES


def test_changed_fields_name_what_a_role_reads_as_crd_paths():
    base = render.job_config(make_job())
    edited = render.job_config(make_job(trainer={"optimizer": {"learningRate": 1e-4}, "maxSteps": 7},
                                        rollout={"maxLag": 3, "replicas": 4}))
    assert render.changed_fields(base, edited, c.Role.TRAINER) == (
        "spec.trainer.maxSteps", "spec.trainer.optimizer.learningRate")
    assert render.changed_fields(base, edited, c.Role.ROLLOUT) == ("spec.rollout.maxLag", "spec.trainer.maxSteps")
    assert render.changed_fields(base, base, c.Role.TRAINER) == ()
