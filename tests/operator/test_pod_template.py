"""``spec.<role>.podTemplate``: every kind of override merged onto the rendered pods with its precedence, what rljob
sets itself refused with the exact message the Valid condition shows, the role hashes each role's template changes,
and the rule that keeps an edit of the Redis's template from emptying a Redis that lives in an emptyDir."""

from __future__ import annotations

import copy
import json

import pytest

from rljob_api import constants as c
from rljob_api.canonical import canonical_json
from rljob_api.config import JobConfig
from rljob_operator import job_status, render, resolution
from rljob_operator.admission import parse_spec, redis_template_problems, refusal_of_spec, refused_field

from operator_helpers import make_job, trainer


def full_template(container: str) -> dict:
    """A podTemplate with an override of every kind, adding to rljob's ``container``."""
    return {
        "metadata": {"labels": {"team": "rl", "kueue.x-k8s.io/priority-class": "high"},
                     "annotations": {"example.com/owner": "alice"}},
        "spec": {
            "serviceAccountName": "trainer-sa",
            "automountServiceAccountToken": True,
            "priorityClassName": "high",
            "runtimeClassName": "nvidia",
            "schedulerName": "volcano",
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                           "whenUnsatisfiable": "DoNotSchedule",
                                           "labelSelector": {"matchLabels": {"rljob.dev/job-name": "demo"}}}],
            "imagePullSecrets": [{"name": "registry"}],
            "securityContext": {"runAsUser": 1000, "fsGroup": 2000},
            "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
                        {"name": "hf-cache", "emptyDir": {}}],
            "initContainers": [
                {"name": "fetch", "image": "busybox:1.36", "command": ["sh", "-c", "cp -r /src /data"]},
                {"name": "log-shipper", "image": "fluent/fluent-bit:3.2", "restartPolicy": "Always",
                 "ports": [{"containerPort": 2020}]},
            ],
            "containers": [{
                "name": container,
                "env": [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
                        {"name": "HF_HOME", "value": "/cache/hf"}],
                "envFrom": [{"configMapRef": {"name": "nccl-settings"}}],
                "volumeMounts": [{"name": "datasets", "mountPath": "/datasets", "readOnly": True},
                                 {"name": "hf-cache", "mountPath": "/cache/hf"}],
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            }],
        },
    }


def _pod(role: str, **spec) -> dict:
    job = make_job(**spec)
    config = render.job_config(job)
    if role == "trainer":
        return render.trainer_pod(job, config, 1, attempt=2)
    if role == "rollout":
        return render.rollout_pod(job, config, 1)
    return render.redis_deployment(job, config)["spec"]["template"]


@pytest.mark.parametrize("role", ["trainer", "rollout", "redis"])
def test_every_kind_of_override_is_merged_onto_the_rendered_pod_with_its_precedence(role):
    template = full_template(role)
    base = _pod(role)
    pod = _pod(role, **{role: {"podTemplate": copy.deepcopy(template)}})
    meta, spec, wanted = pod["metadata"], pod["spec"], template["spec"]
    hashes = (c.LABEL_CONFIG_HASH, c.LABEL_ROLE_CONFIG_HASH)  # the template is part of the config

    def labels(pod_meta: dict) -> dict:
        return {k: v for k, v in pod_meta["labels"].items() if k not in hashes}

    assert labels(meta) == {**labels(base["metadata"]), **template["metadata"]["labels"]}
    assert meta["annotations"] == template["metadata"]["annotations"]
    for field in ("serviceAccountName", "automountServiceAccountToken", "priorityClassName", "runtimeClassName",
                  "schedulerName", "affinity", "topologySpreadConstraints", "imagePullSecrets", "initContainers"):
        assert spec[field] == wanted[field], field  # rljob renders none of them but automountServiceAccountToken
    assert base["spec"]["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {**base["spec"].get("securityContext", {}), **wanted["securityContext"]}
    assert spec["volumes"] == base["spec"]["volumes"] + wanted["volumes"]
    (container,), (before,) = spec["containers"], base["spec"]["containers"]
    added = wanted["containers"][0]
    assert container["env"] == before["env"] + added["env"]
    assert container["envFrom"] == added["envFrom"]
    assert container["volumeMounts"] == before["volumeMounts"] + added["volumeMounts"]
    assert container["securityContext"] == {**before.get("securityContext", {}), **added["securityContext"]}
    for field in ("name", "image", "command", "ports", "resources"):  # rljob's
        assert container.get(field) == before.get(field), field
    others = {k: v for k, v in spec.items() if k not in wanted and k != "containers"}
    assert others == {k: v for k, v in base["spec"].items() if k not in wanted and k != "containers"}


def test_the_redis_template_merges_over_rljobs_security_context_and_leaves_the_deployment_alone():
    template = {"metadata": {"labels": {"team": "rl"}},
                "spec": {"securityContext": {"runAsUser": 1001},
                         "containers": [{"name": "redis", "securityContext": {"readOnlyRootFilesystem": False}}]}}
    job = make_job(redis={"podTemplate": template})
    base = render.redis_deployment(make_job(), render.job_config(make_job()))
    deployment = render.redis_deployment(job, render.job_config(job))
    pod = deployment["spec"]["template"]
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 999,
                                              "fsGroup": 999, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert {k: v for k, v in deployment.items() if k != "spec"} == {k: v for k, v in base.items() if k != "spec"}
    assert deployment["spec"]["selector"] == base["spec"]["selector"]  # the template's labels select nothing


@pytest.mark.parametrize("empty", [{}, {"metadata": {}, "spec": {}}, {"metadata": {"labels": {}}},
                                   {"spec": {"containers": [], "volumes": [], "initContainers": []}}],
                         ids=["{}", "empty-sections", "empty-labels", "empty-lists"])
def test_an_empty_pod_template_renders_and_resolves_exactly_as_none(empty):
    """Upgrade safety: jobs that do not use the field (or set it empty) keep their config bytes, hashes and pods."""
    base = make_job(trainer={"nodes": 2})
    base_config = render.job_config(base)
    job = make_job(trainer={"nodes": 2, "podTemplate": empty}, rollout={"podTemplate": empty},
                   redis={"podTemplate": empty})
    config = render.job_config(job)
    assert config.to_json() == base_config.to_json()
    assert "podTemplate" not in json.loads(config.to_json())["spec"]["trainer"]
    assert render.config_hashes(config) == render.config_hashes(base_config)
    assert render.trainer_pod(job, config, 1, 0) == render.trainer_pod(base, base_config, 1, 0)
    assert render.rollout_pod(job, config, 0) == render.rollout_pod(base, base_config, 0)
    assert render.redis_deployment(job, config) == render.redis_deployment(base, base_config)


def test_a_set_template_is_recorded_as_written_and_read_back_by_every_role():
    template = {"metadata": {"labels": {"team": "rl"}}, "spec": {"automountServiceAccountToken": False}}
    config = render.job_config(make_job(trainer={"podTemplate": template}))
    assert json.loads(config.to_json())["spec"]["trainer"]["podTemplate"] == template  # nothing unset in the bytes
    assert JobConfig.from_json(config.to_json()) == config


TEMPLATE = {"metadata": {"labels": {"team": "rl"}}}


@pytest.mark.parametrize(("role", "trainer_changes", "rollout_changes"), [
    ("trainer", True, False),  # the gang restarts; the rollout pods keep running
    ("rollout", False, True),  # the rollout pods are replaced; the gang keeps running
    ("redis", False, False),  # only the Redis Deployment's pod is replaced
])
def test_a_roles_template_changes_only_that_roles_hash(role, trainer_changes, rollout_changes):
    base = render.job_config(make_job())
    changed = render.job_config(make_job(**{role: {"podTemplate": TEMPLATE}}))
    assert changed.config_hash() != base.config_hash()
    assert (render.role_config_hash(changed, c.Role.TRAINER) != render.role_config_hash(base, c.Role.TRAINER)) \
        == trainer_changes
    assert (render.role_config_hash(changed, c.Role.ROLLOUT) != render.role_config_hash(base, c.Role.ROLLOUT)) \
        == rollout_changes
    redis_changed = render.redis_deployment(make_job(), changed) != render.redis_deployment(make_job(), base)
    assert redis_changed == (role == "redis")


def test_an_edit_of_the_redis_template_keeps_both_pod_roles_recorded_config_and_hashes():
    job = make_job()
    record = resolution.Recorded(resolution.as_recorded(render.job_config(job)), 3)
    edited = make_job(redis={"podTemplate": TEMPLATE})
    config = resolution.effective_config(edited, 4, record)
    hashes, recorded = render.config_hashes(config), render.config_hashes(record.config)
    assert (hashes.trainer, hashes.rollout) == (recorded.trainer, recorded.rollout) and hashes.config != recorded.config
    assert config.spec.redis.pod_template.metadata.labels == {"team": "rl"}
    assert render.redis_deployment(edited, config)["spec"]["template"]["metadata"]["labels"]["team"] == "rl"
    reverted = resolution.effective_config(job, 5, resolution.Recorded(resolution.as_recorded(config), 4))
    assert reverted.to_json() == record.config.to_json()  # the template is removed again, nothing else moves


PROBLEMS = {
    "reserved-labels": (
        {"trainer": {"podTemplate": {"metadata": {"labels": {"rljob.dev/attempt": "9", "team": "rl",
                                                             "app.kubernetes.io/managed-by": "me"}}}}},
        "spec.trainer.podTemplate.metadata.labels: 'rljob.dev/attempt' is rljob's: keys under rljob.dev/ and the "
        "labels rljob sets on these pods (app.kubernetes.io/managed-by, rljob.dev/attempt, rljob.dev/config-hash, "
        "rljob.dev/job-name, rljob.dev/replica-index, rljob.dev/role, rljob.dev/role-config-hash) are refused; "
        "remove it",
        "spec.trainer.podTemplate.metadata.labels: 'app.kubernetes.io/managed-by' is rljob's: keys under rljob.dev/ "
        "and the labels rljob sets on these pods (app.kubernetes.io/managed-by, rljob.dev/attempt, "
        "rljob.dev/config-hash, rljob.dev/job-name, rljob.dev/replica-index, rljob.dev/role, "
        "rljob.dev/role-config-hash) are refused; remove it",
    ),
    "reserved-annotation": (
        {"rollout": {"podTemplate": {"metadata": {"annotations": {"rljob.dev/note": "x"}}}}},
        "spec.rollout.podTemplate.metadata.annotations: 'rljob.dev/note' is rljob's: keys under rljob.dev/ are "
        "refused; remove it",
    ),
    "rljob-env": (
        {"trainer": {"podTemplate": {"spec": {"containers": [{"name": "trainer", "env": [
            {"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "RLJOB_JOB_UID", "value": "x"}]}]}}}},
        "spec.trainer.podTemplate.spec.containers[0].env[1].name: 'RLJOB_JOB_UID' is set by rljob in the trainer "
        "container (RLJOB_CONFIG, RLJOB_REPLICA_INDEX, RLJOB_ATTEMPT, RLJOB_JOB_UID, POD_IP, POD_NAME, POD_NAMESPACE, "
        "REDIS_PASSWORD, PYTHONUNBUFFERED): remove it",
    ),
    "rljob-env-redis": (
        {"redis": {"podTemplate": {"spec": {"containers": [{"name": "redis", "env": [
            {"name": "REDIS_PASSWORD", "value": "guessable"}]}]}}}},
        "spec.redis.podTemplate.spec.containers[0].env[0].name: 'REDIS_PASSWORD' is set by rljob in the redis "
        "container (REDIS_PASSWORD): remove it",
    ),
    "reserved-env": (
        {"rollout": {"podTemplate": {"spec": {"containers": [{"name": "rollout", "env": [
            {"name": "MASTER_ADDR", "value": "ok on a rollout pod"}, {"name": "RLJOB_EXTRA", "value": "x"}],
            "envFrom": [{"prefix": "APP_", "configMapRef": {"name": "a"}},
                        {"prefix": "RLJOB_", "configMapRef": {"name": "b"}}]}]}}}},
        "spec.rollout.podTemplate.spec.containers[0].env[1].name: 'RLJOB_EXTRA': names under RLJOB_ are rljob's: "
        "rename it",
        "spec.rollout.podTemplate.spec.containers[0].envFrom[1].prefix: 'RLJOB_' would import names that are not the "
        "template's (names under RLJOB_ are rljob's): choose another prefix",
    ),
    "torchrun-env": (
        {"trainer": {"podTemplate": {"spec": {"containers": [{"name": "trainer", "env": [
            {"name": "MASTER_ADDR", "value": "10.0.0.1"}, {"name": "TORCHELASTIC_RUN_ID", "value": "r"}],
            "envFrom": [{"prefix": "TORCHELASTIC_", "secretRef": {"name": "s"}}]}]}}}},
        *[f"spec.trainer.podTemplate.spec.containers[0].{field}: {what}torchrun sets it for every rank (MASTER_ADDR, "
          "MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, "
          f"ROLE_WORLD_SIZE, ROLE_NAME, TORCHELASTIC_*){then}"
          for field, what, then in (
              ("env[0].name", "'MASTER_ADDR': ", ": rename it"),
              ("env[1].name", "'TORCHELASTIC_RUN_ID': ", ": rename it"),
              ("envFrom[0].prefix", "'TORCHELASTIC_' would import names that are not the template's (", "): choose "
               "another prefix"))],
    ),
    "rljob-volume": (
        {"rollout": {"podTemplate": {"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}}},
        "spec.rollout.podTemplate.spec.volumes[0].name: 'dshm' is the name of one of rljob's volumes in these pods "
        "(config, dshm): rename it, and the volumeMounts that use it",
    ),
    "rljob-mounts": (
        {"trainer": {"podTemplate": {"spec": {"containers": [{"name": "trainer", "volumeMounts": [
            {"name": "a", "mountPath": "/etc/rljob"}, {"name": "b", "mountPath": "/etc/rljob-other"},
            {"name": "c", "mountPath": "/var/lib/rljob/checkpoints/more/"},
            {"name": "d", "mountPath": "/etc//rljob/./more"}, {"name": "e", "mountPath": "/dev/shm/../shm/x"}]}]}}}},
        "spec.trainer.podTemplate.spec.containers[0].volumeMounts[0].mountPath: '/etc/rljob' is at or under a "
        "directory rljob mounts in the trainer container (/etc/rljob, /dev/shm, /var/lib/rljob/checkpoints): choose "
        "another",
        "spec.trainer.podTemplate.spec.containers[0].volumeMounts[2].mountPath: '/var/lib/rljob/checkpoints/more/' is "
        "at or under a directory rljob mounts in the trainer container (/etc/rljob, /dev/shm, "
        "/var/lib/rljob/checkpoints): choose another",
        "spec.trainer.podTemplate.spec.containers[0].volumeMounts[3].mountPath: '/etc//rljob/./more' is at or under a "
        "directory rljob mounts in the trainer container (/etc/rljob, /dev/shm, /var/lib/rljob/checkpoints): choose "
        "another",
        "spec.trainer.podTemplate.spec.containers[0].volumeMounts[4].mountPath: '/dev/shm/../shm/x' is at or under a "
        "directory rljob mounts in the trainer container (/etc/rljob, /dev/shm, /var/lib/rljob/checkpoints): choose "
        "another",
    ),
    "redis-data-mount": (
        {"redis": {"podTemplate": {"spec": {"containers": [{"name": "redis", "volumeMounts": [
            {"name": "x", "mountPath": "/data"}]}]}}}},
        "spec.redis.podTemplate.spec.containers[0].volumeMounts[0].mountPath: '/data' is at or under a directory rljob "
        "mounts in the redis container (/data): choose another",
    ),
    "init-containers": (
        {"trainer": {"podTemplate": {"spec": {"initContainers": [
            {"name": "trainer", "image": "busybox"},
            {"name": "proxy", "image": "envoy", "restartPolicy": "OnFailure", "ports": [{"containerPort": 29500}]}]}}}},
        "spec.trainer.podTemplate.spec.initContainers[0].name: 'trainer' is the name of rljob's container: rename it",
        "spec.trainer.podTemplate.spec.initContainers[1].restartPolicy: 'OnFailure': an init container runs to "
        "completion before trainer starts (restartPolicy unset) or runs beside it as a native sidecar (restartPolicy: "
        "Always)",
        "spec.trainer.podTemplate.spec.initContainers[1].ports[0].containerPort: 29500 is a port of rljob's trainer "
        "container (29400, 29500, 29600, 9400): the containers of a pod share its network, so a sidecar must listen "
        "on another",
    ),
    "extra-container": (
        {"trainer": {"podTemplate": {"spec": {"containers": [{"name": "trainer"}, {"name": "logger"}]}}}},
        "spec.trainer.podTemplate.spec.containers[1].name: 'logger' is not rljob's trainer container: "
        "podTemplate.spec.containers only adds env, envFrom, volumeMounts, securityContext to rljob's own container, "
        "named trainer, and cannot add a container (a pod ends only when all its regular containers have exited, so a "
        "trainer pod would never reach Succeeded); run a sidecar as a native sidecar instead: move it to "
        "podTemplate.spec.initContainers with restartPolicy: Always",
    ),
    "extra-container-redis": (
        {"redis": {"podTemplate": {"spec": {"containers": [{"name": "exporter"}]}}}},
        "spec.redis.podTemplate.spec.containers[0].name: 'exporter' is not rljob's redis container: "
        "podTemplate.spec.containers only adds env, envFrom, volumeMounts, securityContext to rljob's own container, "
        "named redis, and cannot add a container (a pod ends only when all its regular containers have exited, so a "
        "trainer pod would never reach Succeeded); run a sidecar as a native sidecar instead: move it to "
        "podTemplate.spec.initContainers with restartPolicy: Always",
    ),
    "external-redis": (
        {"redis": {"mode": "external", "url": "redis://cache:6379",
                   "podTemplate": {"metadata": {"labels": {"team": "rl"}}}}},
        "spec.redis.podTemplate: only used with mode 'managed' (rljob runs no Redis pod for an external Redis): "
        "remove podTemplate, or set mode to 'managed'",
    ),
}


@pytest.mark.parametrize("case", sorted(PROBLEMS))
def test_what_rljob_sets_itself_is_refused_naming_the_field(case):
    raw, *messages = PROBLEMS[case]
    _, problems = parse_spec("demo", {"model": {"source": "tiny"}, **raw}, "ns")
    assert [str(p) for p in problems] == messages


def test_kueues_queue_label_is_refused_on_pods_queued_job_or_not():
    raw = {"model": {"source": "tiny"},
           "trainer": {"podTemplate": {"metadata": {"labels": {c.LABEL_KUEUE_QUEUE_NAME: "other"}}}}}
    for job_labels in ({}, {c.LABEL_KUEUE_QUEUE_NAME: "team-a"}):
        (problem,) = parse_spec("demo", raw, "ns", job_labels)[1]
        assert str(problem) == (
            "spec.trainer.podTemplate.metadata.labels: 'kueue.x-k8s.io/queue-name' on pods would make Kueue's pod "
            "integration queue each pod as a workload of its own; put it on the RLTrainingJob (one Workload for the "
            'whole job, docs/kueue.md) and remove it here'), str(problem)


def test_a_template_of_every_kind_is_valid_for_every_role():
    raw = {"model": {"source": "tiny"}, **{role: {"podTemplate": full_template(role)}
                                           for role in ("trainer", "rollout", "redis")}}
    spec, problems = parse_spec("demo", raw, "ns")
    assert problems == [] and spec.rollout.pod_template.spec.init_containers[1]["restartPolicy"] == "Always"


def _recorded(persistence: dict | None, template: dict | None = None) -> resolution.Recorded:
    """The record of a running job whose Redis has ``persistence`` (None: recorded before the field existed)."""
    redis = {"persistence": persistence or {}, **({"podTemplate": template} if template else {})}
    data = json.loads(render.job_config(make_job(redis=redis)).to_json())
    if persistence is None:
        del data["spec"]["redis"]["persistence"]
    text = canonical_json(data)
    return resolution.Recorded(JobConfig.from_recorded(text, render.role_hashes(JobConfig.from_json(text))), 3)


EMPTYDIR_MESSAGE = (
    "spec.redis.podTemplate: changing it replaces the managed Redis pod, and this Redis keeps its data in an emptyDir "
    "(spec.redis.persistence.enabled is false, or the Redis was made before persistence existed): the new pod would "
    "start without the stream, its consumer group and the progress and checkpoint hashes, and the gang would restart "
    "from its newest checkpoint. Enable spec.redis.persistence instead (that also replaces the Redis pod, once), or "
    "accept the loss: kubectl annotate rljob demo rljob.dev/allow-redis-data-loss=true")


@pytest.mark.parametrize(("recorded", "redis", "annotations", "refused"), [
    ({"enabled": False}, {"persistence": {"enabled": False}, "podTemplate": TEMPLATE}, {}, True),
    (None, {"podTemplate": TEMPLATE}, {}, True),  # a Redis made before persistence stays on its emptyDir
    ({"enabled": False}, {"persistence": {"enabled": False}, "podTemplate": TEMPLATE},
     {c.ANNOTATION_ALLOW_REDIS_DATA_LOSS: "true"}, False),  # the loss accepted
    ({"enabled": False}, {"persistence": {"enabled": False}, "podTemplate": TEMPLATE},
     {c.ANNOTATION_ALLOW_REDIS_DATA_LOSS: "yes"}, True),  # only "true" accepts it
    ({"enabled": True}, {"podTemplate": TEMPLATE}, {}, False),  # durable: the new pod reads the same file
    ({"enabled": False}, {"persistence": {"enabled": True}, "podTemplate": TEMPLATE}, {}, False),  # moves to a claim
    ({"enabled": False}, {"persistence": {"enabled": False}, "maxPending": 99}, {}, False),  # no template change
], ids=["emptydir", "pre-persistence", "accepted", "not-true", "durable", "to-a-claim", "elsewhere"])
def test_a_redis_template_edit_that_would_empty_an_emptydir_redis_is_refused(recorded, redis, annotations, refused):
    job = make_job(redis=redis)
    problems = redis_template_problems(job, resolution.effective_config(job, 4, _recorded(recorded)),
                                       _recorded(recorded), annotations)
    assert [str(p) for p in problems] == ([EMPTYDIR_MESSAGE] if refused else [])
    assert redis_template_problems(job, render.job_config(job), None, annotations) == []  # a new job: no Redis yet


def test_removing_the_redis_template_of_an_emptydir_redis_is_refused_too():
    recorded = _recorded({"enabled": False}, TEMPLATE)
    removed = make_job(redis={"persistence": {"enabled": False}})
    assert [str(p) for p in redis_template_problems(removed, resolution.effective_config(removed, 4, recorded), recorded,
                                                    {})] == [EMPTYDIR_MESSAGE]
    kept = make_job(redis={"persistence": {"enabled": False}, "podTemplate": TEMPLATE})
    assert redis_template_problems(kept, resolution.effective_config(kept, 4, recorded), recorded, {}) == []


@pytest.mark.parametrize(("message", "field"), [
    ('Pod "j-trainer-0" is invalid: spec.containers[0].volumeMounts[3].name: Not found: "nosuch"',
     "spec.trainer.podTemplate"),
    ('Pod "j-rollout-1" is invalid: spec.initContainers[0].image: Required value', "spec.rollout.podTemplate"),
    ('Pod "j-trainer-0" is invalid: metadata.labels: Invalid value: "-x-"', "spec.trainer.podTemplate"),
    ('Deployment.apps "j-redis" is invalid: spec.template.spec.volumes[1].name: Duplicate value: "x"',
     "spec.redis.podTemplate"),
    ('Pod "j-trainer-0" is invalid: [spec.containers[0].resources.limits[cpu]: Invalid value: "-2"',
     "spec.trainer.resources"),  # the part spec.trainer has a field for comes first
    ('pods "j-trainer-0" is forbidden: no PriorityClass with name high was found',
     "spec.trainer.podTemplate.spec.priorityClassName"),
    ('pods "j-rollout-2" is forbidden: error looking up service account ns/sa: serviceaccount "sa" not found',
     "spec.rollout.podTemplate.spec.serviceAccountName"),
    ('pods "j-trainer-1" is forbidden: pod rejected: RuntimeClass "nvidia" not found',
     "spec.trainer.podTemplate.spec.runtimeClassName"),
])
def test_a_refusal_of_a_templated_part_points_at_the_pod_template(message, field):
    assert refused_field(message) == field


@pytest.mark.parametrize(("status", "message", "spec_fault"), [
    (422, 'Pod "j-trainer-0" is invalid: spec.volumes[2].name: Duplicate value: "x"', True),
    (403, 'pods "j-trainer-0" is forbidden: no PriorityClass with name high was found', True),
    (403, 'pods "j-rollout-0" is forbidden: pod rejected: RuntimeClass "nvidia" not found', True),
    (403, 'pods is forbidden: User "system:serviceaccount:rljob-system:op" cannot create resource "pods" in API '
          'group "" in the namespace "ns"', False),  # the operator's RBAC: not the spec's to fix
    (403, 'pods "j-trainer-0" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=8', False),  # frees up
    (500, "etcdserver: request timed out", False),
])
def test_which_refusals_are_the_specs_to_fix(status, message, spec_fault):
    assert refusal_of_spec(status, message) is spec_fault


def test_a_missing_secret_a_template_names_is_told_with_its_field():
    spec = make_job(trainer={"podTemplate": full_template("trainer")},
                    rollout={"podTemplate": {"spec": {"volumes": [
                        {"name": "creds", "secret": {"secretName": "s3"}},
                        {"name": "both", "projected": {"sources": [{"secret": {"name": "wandb"}},
                                                                   {"secret": {"name": "gcs"}}]}}]}}}).spec
    assert job_status.secret_fields(spec) == {"wandb": "spec.trainer.podTemplate", "s3": "spec.rollout.podTemplate",
                                          "gcs": "spec.rollout.podTemplate"}
    pod = trainer(0, 0, phase="Pending", waiting_reason="CreateContainerConfigError", container="trainer",
                  waiting_message='secret "wandb" not found')
    (named,) = job_status.name_secret_fields([pod], job_status.secret_fields(spec))
    assert named.waiting_message == 'secret "wandb" not found (spec.trainer.podTemplate)'
