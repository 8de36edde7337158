"""Which resolved config a pass runs: the one recorded for the job's running pods, or a new resolution.

An upgraded operator may resolve the same spec differently (a new field, a new default), and the API server fills a
new CRD's defaults into stored jobs without bumping ``metadata.generation``. Re-resolving on every pass would then
change the pods' config hashes and restart every gang. So the job's config ConfigMap records the resolved config
(its exact bytes), the ``metadata.generation`` it was resolved from and the role hashes its pods carry
(``rljob.dev/resolved-generation``, ``rljob.dev/role-config-hashes``), and :func:`effective_config` decides:

- same generation as recorded: the recorded config, byte for byte, with its recorded hashes;
- a new generation (the user edited the spec): the spec resolved anew (the rollout pods' recorded hash kept when the
  edit changed nothing a rollout pod reads: a learning rate, the checkpoint interval), unless the edit changed nothing
  the trainer reads (its role hash is the same for the recorded spec and the edited one, both resolved by this version): then
  the recorded config with the rollout-only fields (and ``spec.redis.podTemplate``) of the new resolution, the
  trainer's recorded hash kept, and the
  rollout's kept too when the edit changed nothing a rollout pod reads (``replicas``). So a role gets this version's
  defaults only when the user edits a field that role's hash covers;
- nothing recorded (a new job), or a record this version cannot read: the new resolution.

The managed Redis is rendered from the config too (:func:`rljob_operator.render.redis_persistence`), and its storage
follows the same rule: a new resolution keeps the recorded ``spec.redis.persistence`` (absent from a record of an
operator before the field existed: an emptyDir) unless the user edited a field the Redis Deployment and its claim
are made of (:data:`REDIS_STORAGE_FIELDS`). Moving a running Redis between an emptyDir and a claim replaces its pod
and empties its stream, so an upgrade alone, or an edit elsewhere (``trainer.maxSteps``, ``redis.maxPending``),
never does it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from rljob_api import constants as c, names
from rljob_api.canonical import canonical_json
from rljob_api.config import JobConfig

from rljob_operator import render
from rljob_operator.kube_api import KubeApi
from rljob_operator.runtime import JobRuntime, Recorded


REDIS_STORAGE_FIELDS = ("mode", "image", "persistence")
"""Fields of ``spec.redis`` the managed Redis Deployment and its claim are made of: an edit of one of them replaces the
Redis pod anyway (or is the persistence setting itself), so only then does a new resolution take this version's
``spec.redis.persistence`` rather than the recorded one."""


def recorded_config(config_map: Optional[Mapping[str, Any]]) -> Optional[Recorded]:
    """The record in a job's config ConfigMap (as the API server returns it); None when there is none or this version
    cannot read it (edited by hand, or a field this version does not know). A ConfigMap without the role-hash
    annotation (an operator before 0.2) gets the hashes this version computes for its config."""
    if not config_map:
        return None
    annotations = (config_map.get("metadata") or {}).get("annotations") or {}
    try:
        text = config_map["data"][c.CONFIG_FILE_NAME]
        hashes = json.loads(annotations.get(c.ANNOTATION_ROLE_CONFIG_HASHES) or "{}")
        if not isinstance(hashes, dict) or not hashes:
            hashes = render.role_hashes(JobConfig.from_json(text))
        config = JobConfig.from_recorded(text, {str(k): str(v) for k, v in hashes.items()})
    except (KeyError, TypeError, ValueError, ValidationError):
        return None
    raw = annotations.get(c.ANNOTATION_RESOLVED_GENERATION)
    return Recorded(config, int(raw) if raw and raw.isdigit() else None)


def effective_config(job: render.Job, generation: Optional[int], recorded: Optional[Recorded]) -> JobConfig:
    """The config a pass over ``job`` (its spec as read now, ``metadata.generation`` = ``generation``) runs and
    records; see the module docstring.

    Raises:
        ValueError: the spec does not resolve (see :func:`rljob_operator.render.job_config`).
    """
    fresh = render.job_config(job)
    if recorded is None:
        return fresh
    if generation is not None and recorded.generation == generation:
        return recorded.config
    before = render.job_config(render.Job(job.name, job.namespace, recorded.config.spec, job.labels, job.uid))
    if render.role_config_hash(before, c.Role.TRAINER) != render.role_config_hash(fresh, c.Role.TRAINER):
        edited = _keep_redis_storage(fresh, recorded.config, before)
        if render.role_config_hash(before, c.Role.ROLLOUT) != render.role_config_hash(fresh, c.Role.ROLLOUT):
            return edited
        # a trainer-only edit: the rollout pods keep their recorded hash, whatever version computed it
        return JobConfig.from_recorded(edited.to_json(), {
            c.Role.TRAINER.value: render.role_config_hash(edited, c.Role.TRAINER),
            c.Role.ROLLOUT.value: recorded.config.recorded_role_hash(c.Role.ROLLOUT.value)
            or render.role_config_hash(before, c.Role.ROLLOUT)})
    merged = json.loads(recorded.config.to_json())
    new = json.loads(fresh.to_json())
    for path in render.ROLE_IGNORES[c.Role.TRAINER]:  # what the edit changed: the trainer reads none of it
        render.copy_field(merged["spec"], new["spec"], ".".join(to_camel(part) for part in path.split(".")))
    trainer = recorded.config.recorded_role_hash(c.Role.TRAINER.value)
    if render.role_config_hash(before, c.Role.ROLLOUT) == render.role_config_hash(fresh, c.Role.ROLLOUT):
        rollout = recorded.config.recorded_role_hash(c.Role.ROLLOUT.value)
    else:
        rollout = render.role_config_hash(JobConfig.model_validate(merged), c.Role.ROLLOUT)
    return JobConfig.from_recorded(canonical_json(merged), {c.Role.TRAINER.value: trainer, c.Role.ROLLOUT.value: rollout})


def _keep_redis_storage(fresh: JobConfig, recorded: JobConfig, before: JobConfig) -> JobConfig:
    """``fresh`` with the recorded config's ``spec.redis.persistence`` (as recorded: absent stays absent) when the edit
    changed none of :data:`REDIS_STORAGE_FIELDS` (``before``: the recorded spec resolved by this version, so that
    defaults the API server filled into the live spec compare equal); ``fresh`` itself otherwise."""
    def storage(config: JobConfig) -> dict[str, Any]:
        redis = config.spec.redis.model_dump(mode="json")
        return {name: redis[name] for name in REDIS_STORAGE_FIELDS}

    if storage(before) != storage(fresh):
        return fresh
    data = json.loads(fresh.to_json())
    kept = json.loads(recorded.to_json())["spec"]["redis"].get("persistence")
    if data["spec"]["redis"].get("persistence") == kept:
        return fresh
    if kept is None:
        del data["spec"]["redis"]["persistence"]
    else:
        data["spec"]["redis"]["persistence"] = kept
    text = canonical_json(data)
    return JobConfig.from_recorded(text, render.role_hashes(JobConfig.from_json(text)))


def as_recorded(config: JobConfig) -> JobConfig:
    """``config`` as :func:`recorded_config` will read it back once its ConfigMap is written: its bytes and its role
    hashes fixed."""
    return JobConfig.from_recorded(config.to_json(), render.role_hashes(config))


async def known_record(body: Mapping[str, Any], runtime: JobRuntime, api: KubeApi) -> Optional[Recorded]:
    """The record of the job ``body`` this process keeps (``runtime.recorded``): read from its ConfigMap first
    (:func:`read_recorded`) when it has none and the job was reconciled before (it has a status).

    Raises:
        ApiError: the read failed other than with 404.
    """
    if runtime.recorded is None and body.get("status"):
        meta = body["metadata"]
        runtime.recorded = await read_recorded(meta["name"], meta["namespace"], api)
    return runtime.recorded


async def read_recorded(name: str, namespace: str, api: KubeApi) -> Optional[Recorded]:
    """:func:`recorded_config` of the job's config ConfigMap, read from the API server (None on 404).

    Raises:
        ApiError: the read failed other than with 404.
    """
    return recorded_config(await api.get("v1", "ConfigMap", namespace, names.config_map(name)))
