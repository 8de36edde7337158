"""Pure functions: an RLTrainingJob → the manifests of its children (plain dicts, DESIGN §1 and §2).

Nothing here talks to the API server; :mod:`rljob_operator.kube_api` adds owner references and applies them.

Children of a job ``J`` in namespace ``N`` (names from :mod:`rljob_api.names`, all within 63 characters):

- ConfigMap ``J-config``: the resolved :class:`~rljob_api.config.JobConfig` as ``config.json``, mounted in
  every pod at ``/etc/rljob`` (env ``RLJOB_CONFIG``); its hash labels every pod.
- managed Redis: Secret ``J-redis-auth`` (a generated password), Deployment and headless Service ``J-redis``, and
  with ``spec.redis.persistence`` the PersistentVolumeClaim ``J-redis-data`` holding its append-only file. They are
  rendered from the resolved config the job runs (:mod:`.resolution`), not from the live spec: a config recorded
  before ``spec.redis.persistence`` existed keeps its Redis on an emptyDir (:func:`redis_persistence`).
- headless Service ``J-trainer`` (publishNotReadyAddresses, every port declared) so that
  ``J-trainer-0.J-trainer.N.svc.cluster.local`` resolves before the gang is ready.
- trainer pods ``J-trainer-<i>``: ``torchrun`` with a fixed node count and static rendezvous at pod 0.
- rollout pods ``J-rollout-<i>``: ``python -m rljob_rollout``.
- with ``spec.rollout.environment.server``, the environment server's Deployment, Service and NetworkPolicy
  ``J-environment``: :mod:`.environment`.

A role's ``spec.<role>.podTemplate`` is merged onto its pods (the managed Redis's: onto its Deployment's pod template)
by :mod:`.overrides`, which refuses what rljob sets itself (:func:`override_problems`).

With ``spec.rollout.task.rewardSource`` rollout pods mount the reward code (:func:`reward_source`): the ConfigMap at
``/etc/rljob-reward`` (every key a file) or the claim at ``path``'s parent, with env ``RLJOB_REWARD_SOURCE`` naming the
module's file and, for a ConfigMap, the label ``rljob.dev/reward-source-hash`` of its content.

With ``spec.redis.caSecretRef`` (a private CA for a ``rediss://`` Redis), trainer and rollout pods mount that one
Secret key read-only at ``/etc/rljob-redis-ca/ca.crt`` and get env ``REDIS_TLS_CA_FILE`` naming it.

``runPolicy`` is left out of the config (it is the operator's business, and changing it must not change the
config hash). Pods are replaced only when the part of the config their role reads changes
(:func:`role_config_hash`): a change of rollout-only fields (``spec.rollout.replicas``, image, resources, ...)
scales or replaces rollout pods and never restarts the trainer gang.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from kubernetes.utils import parse_quantity
from pydantic.alias_generators import to_camel

from rljob_api import constants as c
from rljob_api import names, rules
from rljob_api.canonical import canonical_hash, canonical_json
from rljob_api.config import JobConfig, RedisConnection, resolve
from rljob_api.spec import (RedisPersistenceSpec, RedisSpec, RLTrainingJobSpec, RolloutSpec, RunPolicySpec,
                             SecretKeyRef, TrainerSpec)
from rljob_api.validation import SpecProblem

from rljob_operator import overrides
from rljob_operator.gang import ConfigHashes

REDIS_PASSWORD_KEY = "password"
"""Key of the generated password in the managed Redis Secret."""
MANAGED_BY = {"app.kubernetes.io/managed-by": c.FIELD_MANAGER}
TRAINER_COMMAND = ("torchrun",)
TRAINER_MODULE = "rljob_trainer.train"
ROLLOUT_COMMAND = ("python", "-m", "rljob_rollout")
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
"""Of trainer and rollout containers: a container that fails without writing /dev/termination-log gets the tail of
its log as termination message, which the job's conditions and Events quote (its last line: the entrypoint's
"cannot start: ..." or a traceback's exception)."""

TRAINER_PORTS = (
    ("rendezvous", c.PORT_RENDEZVOUS),
    ("master", c.PORT_MASTER),
    ("weights", c.PORT_WEIGHTS),
    ("metrics", c.PORT_METRICS),
)

TRAINER_READS_FROM_ROLLOUT = ("sampling.temperature", "task.name")
"""Fields of ``spec.rollout`` (snake_case paths) that trainer processes read: they score tokens at the sampling
temperature (DESIGN §2 "Token alignment"), and the tiny model's alphabet follows the task name
(``rljob_wire.model.build_tokenizer``). A change of either restarts the gang."""
ROLLOUT_ONLY_FIELDS = (
    "image", "backend", "replicas", "gpus_per_replica", "resources", "node_selector", "tolerations",
    "prompts_per_batch", "samples_per_prompt", "max_lag", "sampling.top_p", "sampling.max_new_tokens",
    "task.dataset_path", "task.reward_function", "task.reward_source", "task.digits", "advantage",
    "filter_zero_variance", "seed", "reward_failure_deadline_seconds", "pod_template", "environment", "autoscaling",
)
"""Fields (or whole sections) of ``spec.rollout`` that no trainer process reads: left out of the trainer pods'
:func:`role_config_hash`. Every rollout field is in exactly one of the two lists (tests check it), so a new field
restarts the gang until someone classifies it."""
POD_ROLES = (c.Role.TRAINER, c.Role.ROLLOUT)
"""The roles whose pods read the config."""
ROLLOUT_READS_FROM_TRAINER = ("max_steps", "seed", "batch", "precision")
"""Fields of ``spec.trainer`` that rollout processes read: ``maxSteps`` (a ``training_finished`` event ends a worker
only at or past it), ``seed`` (the ``tiny`` model's initial weights), ``batch`` (the writer runs at most
``documentsPerStep`` ahead) and ``precision`` (the dtype vLLM runs the model in). A change of one replaces the rollout
pods too."""
TRAINER_ONLY_FIELDS = (
    "image", "backend", "nodes", "processes_per_node", "parallelism", "activation_checkpointing", "tensor_parallel",
    "pipeline_parallel", "resources", "node_selector", "tolerations", "pod_template", "optimizer", "checkpoint",
    "export", "tensorboard", "weight_sync_bucket_megabytes", "collective_timeout_seconds", "rendezvous_timeout_seconds",
    "data_timeout_seconds",
)
"""Fields of ``spec.trainer`` that no rollout process reads: left out of the rollout pods' :func:`role_config_hash`,
so that an edit of one (a learning rate, the checkpoint interval, the topology) restarts the gang alone and keeps the
rollout pods, whose engines take long to start. The data-parallel size, derived from the topology, is left out of it
too."""
ENVIRONMENT_SERVER_POD_FIELDS = ("image", "command", "args", "replicas", "resources", "env", "node_selector",
                                 "tolerations")
"""Fields of ``spec.rollout.environment.server`` that only the environment server's Deployment is made of: the rollout
workers read its ``port`` alone (the Service's address), so an edit of one of these rolls the server's pods and
replaces no rollout pod."""
ROLLOUT_POD_IGNORES = ("replicas", "autoscaling", "reward_failure_deadline_seconds",
                       *(f"environment.server.{path}" for path in ENVIRONMENT_SERVER_POD_FIELDS))
"""Fields of ``spec.rollout`` left out of the rollout pods' :func:`role_config_hash`: a kept replica runs the same
whatever the replica count (a worker checks only that its index is below it, and pods above it are deleted), only
the operator reads the autoscaling policy and the reward-failure deadline, and the environment server's pod fields
make its Deployment alone."""
REDIS_POD_ONLY_FIELDS = ("pod_template",)
"""Fields of ``spec.redis`` that only the managed Redis Deployment is made of (no trainer or rollout process reads
them): left out of both pod roles' :func:`role_config_hash`, so that an edit replaces the Redis pod alone."""
ROLE_IGNORES = {
    c.Role.TRAINER: (*(f"rollout.{path}" for path in ROLLOUT_ONLY_FIELDS),
                     *(f"redis.{path}" for path in REDIS_POD_ONLY_FIELDS)),
    c.Role.ROLLOUT: (*(f"rollout.{path}" for path in ROLLOUT_POD_IGNORES),
                     *(f"trainer.{path}" for path in TRAINER_ONLY_FIELDS),
                     *(f"redis.{path}" for path in REDIS_POD_ONLY_FIELDS)),
}
"""Paths under ``spec`` (snake_case) left out of each pod role's :func:`role_config_hash`."""

_CONFIG_VOLUME = "config"
_SHM_VOLUME = "dshm"
_CHECKPOINT_VOLUME = "checkpoints"
_MODEL_VOLUME = "model"
_REDIS_DATA_VOLUME = "data"
_REDIS_CA_VOLUME = "redis-ca"
_REWARD_SOURCE_VOLUME = "reward-source"
_REDIS_UID = 999  # the redis user of the official image
REDIS_DATA_DIR = "/data"
"""Where the managed Redis writes its append-only file (the emptyDir or the claim ``<job>-redis-data``)."""
REDIS_APPENDFSYNC = "everysec"
"""fsync policy of the durable managed Redis's append-only file: once a second, in a background thread, so a crash of
its node loses at most the last second or two of writes, and a SIGKILL of Redis alone as a rule nothing it
acknowledged (its writes are in the kernel's page cache; DESIGN §6); ``always`` would fsync every write."""
REDIS_LOCK_FILE = f"{REDIS_DATA_DIR}/redis.lock"
"""flock(1)-ed by the durable Redis for as long as it runs, so that a replacement Redis pod (made by the ReplicaSet as
soon as the old pod is deleted, before it has exited) waits for the old one instead of opening the same append-only
file. Where locks are not supported (some network filesystems) the Redis starts without waiting."""


def durable_redis_script(data_dir: str = REDIS_DATA_DIR, port: int = c.PORT_REDIS) -> str:
    """The durable managed Redis's start script (``sh -c``; the password from env ``REDIS_PASSWORD``): lock
    ``<data_dir>/redis.lock`` (:data:`REDIS_LOCK_FILE`), waiting while another process holds it, then become
    ``redis-server`` with an append-only file in ``data_dir`` (appendfsync :data:`REDIS_APPENDFSYNC`, no RDB
    snapshots). redis-server keeps the lock's file descriptor, so the lock lasts exactly as long as it runs, and it is
    the container's main process, so it gets the SIGTERM of a pod deletion and flushes its file before it exits."""
    lock = posixpath.join(data_dir, posixpath.basename(REDIS_LOCK_FILE))
    return (
        f"exec 9>>{lock}\n"
        f"flock -n 9 || {{ echo \"redis: waiting for the Redis that held {data_dir} before this one to exit\"; "
        "flock 9; }\n"
        f"exec redis-server --port {port} --requirepass \"${c.ENV_REDIS_PASSWORD}\" --appendonly yes "
        f"--appendfsync {REDIS_APPENDFSYNC} --save \"\" --dir {data_dir}\n"
    )


@dataclass(frozen=True)
class Job:
    """What rendering needs of an RLTrainingJob: its name, namespace, validated spec, metadata labels and uid ("" when
    not known: the trainer pods then carry no RLJOB_JOB_UID)."""

    name: str
    namespace: str
    spec: RLTrainingJobSpec
    labels: Mapping[str, str] = field(default_factory=dict)
    uid: str = ""


def redis_connection(job: Job) -> RedisConnection:
    """Where every role reaches Redis: the managed Service's DNS name, or host/port/TLS/db of ``spec.redis.url``.

    Raises:
        ValueError: an external URL without a host (check_spec rejects other malformed URLs first).
    """
    if job.spec.redis.mode == "managed":
        return RedisConnection(host=names.service_dns(names.redis_name(job.name), job.namespace))
    url = urlsplit(job.spec.redis.url or "")
    if not url.hostname:
        raise ValueError(f"spec.redis.url: no host in {job.spec.redis.url!r}")
    db = url.path.strip("/")
    return RedisConnection(
        host=url.hostname, port=url.port or c.PORT_REDIS, tls=url.scheme == "rediss", db=int(db) if db else 0
    )


def job_config(job: Job) -> JobConfig:
    """The resolved config every role reads (``runPolicy`` reset to its defaults, see the module docstring).

    Raises:
        ValueError: the trainer topology does not divide (see :func:`rljob_api.validation.data_parallel_size`).
    """
    spec = job.spec.model_copy(update={"run_policy": RunPolicySpec()})
    return resolve(job.name, job.namespace, spec, redis_connection(job))


def role_config_hash(config: JobConfig, role: c.Role) -> str:
    """Short sha256 (16 hex digits) of the part of ``config`` that pods of ``role`` read: the config with the fields of
    :data:`ROLE_IGNORES` reset to their defaults (left out where a default is left out of a dump); for a recorded
    config (:meth:`~rljob_api.config.JobConfig.from_recorded`), the hash recorded with it. The value of the
    :data:`~rljob_api.constants.LABEL_ROLE_CONFIG_HASH` label.

    Raises:
        ValueError: ``role`` has no pods (Redis, config).
    """
    if ROLE_IGNORES.get(role) is None:
        raise ValueError(f"role {role.value!r} has no pods that read the config")
    if (recorded := config.recorded_role_hash(role.value)) is not None:
        return recorded
    return canonical_hash(_role_view(config, role), digits=16)


def _role_view(config: JobConfig, role: c.Role) -> dict[str, Any]:
    """The JSON dump of ``config`` with the fields of :data:`ROLE_IGNORES` for ``role`` reset to their defaults."""
    view = config.model_dump(mode="json")
    defaults = {"trainer": TrainerSpec().model_dump(mode="json"), "rollout": RolloutSpec().model_dump(mode="json"),
                "redis": RedisSpec().model_dump(mode="json")}
    for path in ROLE_IGNORES[role]:
        copy_field(view["spec"], defaults, path)
    if role == c.Role.ROLLOUT:
        del view["data_parallel_size"]  # derived from the trainer's topology, which no rollout process reads either
    return view


def changed_fields(before: JobConfig, after: JobConfig, role: c.Role) -> tuple[str, ...]:
    """The fields pods of ``role`` read whose values differ between two configs, as CRD paths (``spec.trainer.
    optimizer.learningRate``; a list is one field), sorted; derived fields outside ``spec`` (the data-parallel size)
    by their config name."""
    found: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{path}.{to_camel(key)}" if path else to_camel(key))
        elif a != b:
            found.append(path)

    walk(_role_view(before, role), _role_view(after, role), "")
    return tuple(sorted(found))


def copy_field(target: dict[str, Any], source: Mapping[str, Any], path: str) -> None:
    """Set the field at dotted ``path`` of the dump ``target`` to its value in the dump ``source``, or remove it where
    ``source`` leaves it out (a field omitted at its default, :func:`~rljob_api.spec.omitted_at_default`). A section
    on the way that neither dump holds (an optional block such as ``rollout.environment`` unset) is left absent."""
    *parents, leaf = path.split(".")
    for part in parents:
        if not isinstance(target.get(part), dict) and not isinstance(source.get(part), dict):
            return  # neither dump has the section (an optional block left out): nothing to reset
        target, source = target.setdefault(part, {}), source.get(part) or {}
    if leaf in source:
        target[leaf] = source[leaf]
    else:
        target.pop(leaf, None)


def role_hashes(config: JobConfig) -> dict[str, str]:
    """{role: :func:`role_config_hash`} for every role whose pods read the config (:data:`POD_ROLES`)."""
    return {role.value: role_config_hash(config, role) for role in POD_ROLES}


def config_hashes(config: JobConfig) -> ConfigHashes:
    """The hashes pods rendered from ``config`` carry: the whole config's and each role's (:func:`role_config_hash`)."""
    return ConfigHashes(config.config_hash(), role_config_hash(config, c.Role.TRAINER),
                        role_config_hash(config, c.Role.ROLLOUT))


def labels(job: Job, role: c.Role) -> dict[str, str]:
    """Labels on every child: job name (label-safe, ≤ 63 characters), role, managed-by."""
    return {**selector(job, role), **MANAGED_BY}


def _selector(job_name: str, role: c.Role) -> dict[str, str]:
    return {c.LABEL_JOB_NAME: names.job_label(job_name), c.LABEL_ROLE: role.value}


def selector(job: Job, role: c.Role) -> dict[str, str]:
    """Label selector of one role's pods."""
    return _selector(job.name, role)


def selector_text(job_name: str, role: c.Role) -> str:
    """:func:`selector` of the job named ``job_name`` as a label selector string (``kubectl get pods -l``, the /scale
    subresource's status.selector), e.g. ``rljob.dev/job-name=demo,rljob.dev/role=rollout``."""
    return ",".join(f"{key}={value}" for key, value in _selector(job_name, role).items())


def child_meta(name: str, job: Job, role: c.Role, extra: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """``metadata`` of the child ``name`` of ``job`` in ``role``: its namespace and :func:`labels` (plus ``extra``)."""
    return {"name": name, "namespace": job.namespace, "labels": {**labels(job, role), **(extra or {})}}


# --- config, Redis, Services ----------------------------------------------------------------------------------
def config_map(job: Job, config: JobConfig, generation: Optional[int] = None) -> dict[str, Any]:
    """ConfigMap holding ``config.json`` (the canonical JSON the hash covers), annotated with the job ``generation``
    it was resolved from and the role hashes of its pods (what :mod:`.resolution` reads back)."""
    meta = child_meta(names.config_map(job.name), job, c.Role.CONFIG)
    meta["annotations"] = {
        c.ANNOTATION_ROLE_CONFIG_HASHES: canonical_json(role_hashes(config)),
        **({c.ANNOTATION_RESOLVED_GENERATION: str(generation)} if generation is not None else {}),
    }
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {c.CONFIG_FILE_NAME: config.to_json()}}


def redis_secret(job: Job, password: str) -> dict[str, Any]:
    """Secret with the managed Redis password (created once, never rewritten, so the password is stable)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_meta(names.redis_secret(job.name), job, c.Role.REDIS),
        "stringData": {REDIS_PASSWORD_KEY: password},
    }


def redis_password_ref(job: Job) -> Optional[SecretKeyRef]:
    """Where REDIS_PASSWORD comes from: the generated Secret, the user's Secret, or None (no password)."""
    if job.spec.redis.mode == "managed":
        return SecretKeyRef(name=names.redis_secret(job.name), key=REDIS_PASSWORD_KEY)
    return job.spec.redis.password_secret_ref


def redis_persistence(config: JobConfig) -> Optional[RedisPersistenceSpec]:
    """The claim settings of the managed Redis that ``config`` runs, or None when it keeps its data in an emptyDir:
    external Redis, ``spec.redis.persistence.enabled: false``, or a config recorded by an operator before the field
    existed. Read from the config's bytes (:meth:`JobConfig.to_json`), not its model: the model fills a missing field
    with today's default (enabled), but the Redis of such a record runs on an emptyDir, and rendering it with a claim
    would replace the Redis pod and lose its stream on an operator upgrade."""
    if config.spec.redis.mode != "managed":
        return None
    raw = json.loads(config.to_json())["spec"]["redis"].get("persistence")
    if raw is None:
        return None
    persistence = RedisPersistenceSpec.model_validate(raw)
    return persistence if persistence.enabled else None


def redis_claim(job: Job, config: JobConfig) -> Optional[dict[str, Any]]:
    """The PersistentVolumeClaim ``<job>-redis-data`` of a durable managed Redis (ReadWriteOnce, the size and storage
    class of :func:`redis_persistence`; no class named: the cluster's default), or None without persistence. Created
    once (claims are mostly immutable), deleted with the job."""
    persistence = redis_persistence(config)
    if persistence is None:
        return None
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": persistence.size}}}
    if persistence.storage_class_name is not None:
        spec["storageClassName"] = persistence.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": child_meta(names.redis_claim(job.name), job, c.Role.REDIS), "spec": spec}


def redis_deployment(job: Job, config: JobConfig) -> dict[str, Any]:
    """One-replica managed Redis of ``config`` (its image and persistence), strategy Recreate (an update never runs
    two Redis pods on one data directory). With persistence (:func:`redis_persistence`) it runs
    :func:`durable_redis_script` (append-only file with appendfsync :data:`REDIS_APPENDFSYNC`, no RDB snapshots,
    :data:`REDIS_LOCK_FILE` held) on the claim :func:`redis_claim`; without, ``redis-server`` with an append-only
    file on an emptyDir, exactly as operators before persistence rendered it (so their Deployments are not
    re-applied)."""
    meta = child_meta(names.redis_name(job.name), job, c.Role.REDIS)
    ref = SecretKeyRef(name=names.redis_secret(job.name), key=REDIS_PASSWORD_KEY)
    persistence = redis_persistence(config)
    if persistence is None:
        command = [
            "redis-server",
            "--port", str(c.PORT_REDIS),
            "--requirepass", f"$({c.ENV_REDIS_PASSWORD})",
            "--appendonly", "yes",
            "--dir", REDIS_DATA_DIR,
        ]
        volume: dict[str, Any] = {"name": _REDIS_DATA_VOLUME, "emptyDir": {}}
    else:
        command = ["sh", "-c", durable_redis_script()]
        volume = {"name": _REDIS_DATA_VOLUME, "persistentVolumeClaim": {"claimName": names.redis_claim(job.name)}}
    container = {
        "name": c.Role.REDIS.value,
        "image": config.spec.redis.image,
        "command": command,
        "env": [_secret_env(c.ENV_REDIS_PASSWORD, ref)],
        "ports": [{"name": "redis", "containerPort": c.PORT_REDIS, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": c.PORT_REDIS}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "volumeMounts": [{"name": _REDIS_DATA_VOLUME, "mountPath": REDIS_DATA_DIR}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    template = {
        "metadata": {"labels": labels(job, c.Role.REDIS)},
        "spec": {
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": _REDIS_UID,
                "runAsGroup": _REDIS_UID,
                "fsGroup": _REDIS_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [volume],
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(job, c.Role.REDIS)},
            "template": overrides.merge(template, config.spec.redis.pod_template, c.Role.REDIS.value,
                                        "spec.redis.podTemplate"),
        },
    }


def redis_service(job: Job) -> dict[str, Any]:
    """Headless Service of the managed Redis: its DNS name resolves straight to the Redis pod."""
    return _service(names.redis_name(job.name), job, c.Role.REDIS, [("redis", c.PORT_REDIS)], publish_not_ready=False)


def trainer_service(job: Job) -> dict[str, Any]:
    """Headless Service of the gang: gives every trainer pod a DNS name, ready or not, on every port."""
    return _service(names.trainer_service(job.name), job, c.Role.TRAINER, TRAINER_PORTS, publish_not_ready=True)


def _service(name: str, job: Job, role: c.Role, ports, *, publish_not_ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(name, job, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": publish_not_ready,
            "selector": selector(job, role),
            "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports],
        },
    }


def static_children(job: Job, config: JobConfig, generation: Optional[int] = None) -> list[dict[str, Any]]:
    """Every child but the pods and the create-only ones (Redis Secret and claim), in apply order; the managed Redis
    as ``config`` runs it (``generation``: see :func:`config_map`)."""
    children = [config_map(job, config, generation), trainer_service(job)]
    if config.spec.redis.mode == "managed":
        children += [redis_service(job), redis_deployment(job, config)]
    return children


def override_problems(job: Job, config: JobConfig) -> list[SpecProblem]:
    """What each role's ``podTemplate`` sets that rljob sets itself (:func:`.overrides.conflicts`), found by rendering
    trainer pod 0, rollout pod 0 and the managed Redis Deployment from ``config`` (what the pass runs for ``job``). A
    job not created yet is rendered with a stand-in uid, so that its pods carry every env rljob sets."""
    job = replace(job, uid=job.uid or "uid")
    renders = [lambda: trainer_pod(job, config, 0, 0), lambda: rollout_pod(job, config, 0)]
    if job.spec.redis.mode == "managed":
        renders.append(lambda: redis_deployment(job, config))
    problems: list[SpecProblem] = []
    for render_one in renders:
        try:
            rendered = render_one()
        except overrides.Refused as refused:
            problems += refused.problems
            continue
        if rendered.get("metadata", {}).get("labels", {}).get(c.LABEL_ROLE) == c.Role.ROLLOUT.value:
            problems += vllm_cpu_memory_problems(job, rendered)
    return problems


def vllm_cpu_memory_problems(job: Job, pod: dict[str, Any]) -> list[SpecProblem]:
    """A ``tiny`` model's rollout pod running vLLM on CPU whose container memory limit cannot hold the engine, the weights (at least: the vocabulary's share aside) and one full-length
    sequence's KV entries (:func:`rljob_api.rules.vllm_cpu_kv_cache`). Other models are checked by the pod at start,
    which reads their shape."""
    spec = job.spec
    if spec.rollout.backend != "vllm" or spec.rollout.gpus_per_replica or spec.model.source != "tiny":
        return []
    container = next(x for x in pod["spec"]["containers"] if x["name"] == c.Role.ROLLOUT.value)
    memory = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    if memory is None:
        return []
    try:
        limit = int(parse_quantity(memory))
    except ValueError:
        return []  # the API server names a malformed quantity itself
    tiny = spec.model.tiny
    head_size = tiny.hidden_size // tiny.heads
    weights = 4 * tiny.layers * (4 * tiny.hidden_size**2 + 3 * tiny.hidden_size * tiny.intermediate_size)
    sequence = rules.kv_bytes_per_sequence(tiny.layers, tiny.heads, head_size, 4, tiny.max_position_embeddings)
    _, problem = rules.vllm_cpu_kv_cache(limit, weights, sequence)
    return [] if problem is None else [SpecProblem("spec.rollout.resources.limits.memory", problem)]


# --- pods ------------------------------------------------------------------------------------------------------
def torchrun_args(job: Job, config: JobConfig, node_rank: int) -> list[str]:
    """``torchrun`` arguments of trainer pod ``node_rank``: fixed node count, static rendezvous at pod 0.

    The static rendezvous gives pod i node rank i, so global rank 0 always runs on pod 0, whose DNS name
    (``config.trainer_master_host``) the rollout workers dial for weights. Ranks wait up to
    ``rendezvousTimeoutSeconds`` for the whole gang; torchrun never restarts workers itself
    (``--max-restarts=0``): gang restarts are the operator's.
    """
    t = job.spec.trainer
    return [
        f"--nnodes={t.nodes}",
        f"--nproc-per-node={t.processes_per_node}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=static",
        f"--master-addr={config.trainer_master_host}",
        f"--master-port={c.PORT_MASTER}",
        f"--rdzv-conf=timeout={t.rendezvous_timeout_seconds}",
        "--max-restarts=0",
        "-m",
        TRAINER_MODULE,
    ]


def trainer_pod(job: Job, config: JobConfig, index: int, attempt: int) -> dict[str, Any]:
    """Trainer pod ``index`` (node rank) of gang ``attempt``; restartPolicy Never (a failure restarts the gang)."""
    t = job.spec.trainer
    name = names.trainer_pod(job.name, index)
    container = {
        "name": c.Role.TRAINER.value,
        "image": t.image,
        "command": [*TRAINER_COMMAND, *torchrun_args(job, config, index)],
        "env": _env(job, index, attempt=attempt),
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in TRAINER_PORTS],
        "resources": dict(t.resources),
        "volumeMounts": _mounts(job, checkpoints=True),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
    pod = _pod(job, config, name, c.Role.TRAINER, index, container, t.node_selector, t.tolerations, "Never",
               {c.LABEL_ATTEMPT: str(attempt)}, checkpoints=True)
    pod["spec"]["hostname"] = name
    pod["spec"]["subdomain"] = names.trainer_service(job.name)
    return overrides.merge(pod, t.pod_template, c.Role.TRAINER.value, "spec.trainer.podTemplate")


def rollout_pod(job: Job, config: JobConfig, index: int, reward_source_hash: Optional[str] = None) -> dict[str, Any]:
    """Rollout pod ``index``; restartPolicy OnFailure (a crash restarts the container, never the gang). With
    ``spec.rollout.task.rewardSource`` it mounts the reward code (:func:`reward_source`) and carries
    ``reward_source_hash`` (the ConfigMap's content, :mod:`.reward_source`; None: no label) as
    :data:`~rljob_api.constants.LABEL_REWARD_SOURCE_HASH`."""
    r = job.spec.rollout
    resources = {key: dict(value) for key, value in r.resources.items()}
    if r.gpus_per_replica:
        resources.setdefault("limits", {})[c.GPU_RESOURCE] = r.gpus_per_replica
    source = reward_source(job)
    env, mounts = _env(job, index, attempt=None), _mounts(job, checkpoints=False)
    if source is not None:
        env.append({"name": c.ENV_REWARD_SOURCE, "value": source.file})
        mounts += [source.mount] if source.mount else []
    container = {
        "name": c.Role.ROLLOUT.value,
        "image": r.image,
        "command": list(ROLLOUT_COMMAND),
        "env": env,
        "ports": [{"name": "metrics", "containerPort": c.PORT_METRICS, "protocol": "TCP"}],
        # Ready once the worker serves its metrics, which it does after its backend started (a vLLM engine takes
        # tens of seconds): RolloutReady then means rollouts can be generated.
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": c.PORT_METRICS}, "periodSeconds": 5},
        "resources": resources,
        "volumeMounts": mounts,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
    extra_labels = {c.LABEL_REWARD_SOURCE_HASH: reward_source_hash} if reward_source_hash else {}
    pod = _pod(job, config, names.rollout_pod(job.name, index), c.Role.ROLLOUT, index, container, r.node_selector,
               r.tolerations, "OnFailure", extra_labels, checkpoints=False)
    if source is not None and source.volume:
        pod["spec"]["volumes"].append(source.volume)
    return overrides.merge(pod, r.pod_template, c.Role.ROLLOUT.value, "spec.rollout.podTemplate")


@dataclass(frozen=True)
class RewardSource:
    """How a rollout pod gets ``spec.rollout.task.rewardSource``: ``file``, the module's path in the container (env
    :data:`~rljob_api.constants.ENV_REWARD_SOURCE`), and the ``volume`` and its ``mount`` that hold it (None: the
    file is on a volume the pod mounts anyway, the model's, or in the image)."""

    file: str
    volume: Optional[dict[str, Any]]
    mount: Optional[dict[str, Any]]


def reward_source(job: Job) -> Optional[RewardSource]:
    """The :class:`RewardSource` of the job's rollout pods: a ConfigMap key is the file ``<key>`` in
    :data:`~rljob_api.constants.REWARD_SOURCE_MOUNT_DIR`, where the whole ConfigMap is mounted read-only (not
    ``subPath``: its files stay the ConfigMap's, and the module can import the keys beside it); a path is the file
    itself, with ``volume``'s claim mounted read-only at its parent directory. None without a reward source."""
    source = job.spec.rollout.task.reward_source
    if source is None:
        return None
    if source.config_map_key_ref is not None:
        ref = source.config_map_key_ref
        return RewardSource(
            posixpath.join(c.REWARD_SOURCE_MOUNT_DIR, ref.key),
            {"name": _REWARD_SOURCE_VOLUME, "configMap": {"name": ref.name}},
            {"name": _REWARD_SOURCE_VOLUME, "mountPath": c.REWARD_SOURCE_MOUNT_DIR, "readOnly": True},
        )
    path = source.path or ""
    if not source.volume:
        return RewardSource(path, None, None)
    return RewardSource(
        path,
        {"name": _REWARD_SOURCE_VOLUME, "persistentVolumeClaim": {"claimName": source.volume, "readOnly": True}},
        {"name": _REWARD_SOURCE_VOLUME, "mountPath": posixpath.dirname(path), "readOnly": True},
    )


def _pod(job, config, name, role, index, container, node_selector, tolerations, restart_policy, extra_labels,
         *, checkpoints: bool) -> dict[str, Any]:
    pod_labels = {
        c.LABEL_CONFIG_HASH: config.config_hash(),
        c.LABEL_ROLE_CONFIG_HASH: role_config_hash(config, role),
        c.LABEL_REPLICA_INDEX: str(index),
        **extra_labels,
    }
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": _volumes(job, checkpoints=checkpoints),
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": child_meta(name, job, role, pod_labels), "spec": spec}


def _env(job: Job, index: int, *, attempt: Optional[int]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": c.ENV_CONFIG, "value": c.CONFIG_PATH},
        {"name": c.ENV_REPLICA_INDEX, "value": str(index)},
    ]
    if attempt is not None:
        env.append({"name": c.ENV_ATTEMPT, "value": str(attempt)})
        if job.uid:
            env.append({"name": c.ENV_JOB_UID, "value": job.uid})
    for name, path in ((c.ENV_POD_IP, "status.podIP"), (c.ENV_POD_NAME, "metadata.name"),
                       (c.ENV_POD_NAMESPACE, "metadata.namespace")):
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    ref = redis_password_ref(job)
    if ref is not None:
        env.append(_secret_env(c.ENV_REDIS_PASSWORD, ref))
    if job.spec.redis.ca_secret_ref is not None:
        env.append({"name": c.ENV_REDIS_TLS_CA_FILE, "value": c.REDIS_CA_PATH})
    if job.spec.hf_token_secret_ref is not None:
        env.append(_secret_env(c.ENV_HF_TOKEN, job.spec.hf_token_secret_ref))
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    return env


def _secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _mounts(job: Job, *, checkpoints: bool) -> list[dict[str, Any]]:
    mounts = [
        {"name": _CONFIG_VOLUME, "mountPath": c.CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": _SHM_VOLUME, "mountPath": c.SHM_MOUNT_DIR},
    ]
    if checkpoints:
        mounts.append({"name": _CHECKPOINT_VOLUME, "mountPath": c.CHECKPOINT_MOUNT_DIR})
    if job.spec.redis.ca_secret_ref is not None:
        mounts.append({"name": _REDIS_CA_VOLUME, "mountPath": c.REDIS_CA_MOUNT_DIR, "readOnly": True})
    if job.spec.model.volume and job.spec.model.path:
        mounts.append({"name": _MODEL_VOLUME, "mountPath": posixpath.dirname(job.spec.model.path.rstrip("/")),
                       "readOnly": True})
    return mounts


def _volumes(job: Job, *, checkpoints: bool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": _CONFIG_VOLUME, "configMap": {"name": names.config_map(job.name)}},
        {"name": _SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
    ]
    if checkpoints:
        claim = job.spec.trainer.checkpoint.volume
        volumes.append(
            {"name": _CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
            if claim
            else {"name": _CHECKPOINT_VOLUME, "emptyDir": {}}
        )
    ca = job.spec.redis.ca_secret_ref
    if ca is not None:  # only the one key, under a fixed file name (REDIS_TLS_CA_FILE)
        volumes.append({"name": _REDIS_CA_VOLUME, "secret": {
            "secretName": ca.name, "items": [{"key": ca.key, "path": posixpath.basename(c.REDIS_CA_PATH)}],
        }})
    if job.spec.model.volume and job.spec.model.path:
        volumes.append(
            {"name": _MODEL_VOLUME, "persistentVolumeClaim": {"claimName": job.spec.model.volume, "readOnly": True}}
        )
    return volumes
