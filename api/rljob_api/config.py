"""The resolved job config: what the operator writes into the ConfigMap and every role reads at start.

``JobConfig`` = the validated spec + what the operator resolved from the cluster (names, addresses, Redis
keys, the data-parallel size). Serialised as camelCase JSON at ``/etc/rljob/config.json`` (env
``RLJOB_CONFIG``); its hash labels every pod, so every rank provably reads the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional

from pydantic import Field, PrivateAttr

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.canonical import canonical_hash, canonical_json
from rljob_api.spec import ApiModel, RLTrainingJobSpec


class RedisKeys(ApiModel):
    """Every Redis key of one job (DESIGN §2 "Keys").

    With managed Redis the stream and event keys keep the upstream names; with external Redis they get
    the job prefix. Every other key always lives under the prefix.
    """

    prefix: str = Field(..., description="The job prefix, `rljob:{namespace}:{job}:`.")
    stream: str
    group: str
    consumer_prefix: str
    events: str
    progress: str
    rollout: str
    members: str
    dead_letter: str
    checkpoint: str

    def consumer(self, dp_rank: int) -> str:
        """Consumer name of one data-parallel rank, e.g. ``fast_llm_consumer_0``."""
        return f"{self.consumer_prefix}{dp_rank}"

    @classmethod
    def build(cls, namespace: str, job: str, spec: RLTrainingJobSpec) -> "RedisKeys":
        prefix = protocol.key_prefix(namespace, job)
        upstream = "" if spec.redis.mode == "managed" else prefix
        return cls(
            prefix=prefix,
            stream=upstream + spec.redis.stream_key,
            group=spec.redis.group_name,
            consumer_prefix=spec.redis.consumer_prefix,
            events=upstream + spec.redis.events_key,
            progress=prefix + protocol.KEY_PROGRESS,
            rollout=prefix + protocol.KEY_ROLLOUT,
            members=prefix + protocol.KEY_MEMBERS,
            dead_letter=prefix + protocol.KEY_DEAD_LETTER,
            checkpoint=prefix + protocol.KEY_CHECKPOINT,
        )


class RedisConnection(ApiModel):
    """Where the roles reach Redis. The password always comes from env ``REDIS_PASSWORD``."""

    host: str
    port: int = c.PORT_REDIS
    tls: bool = False
    db: int = 0


class JobConfig(ApiModel):
    """The one resolved config every role reads (operator renders it, trainer and rollout load it)."""

    name: str = Field(..., description="The RLTrainingJob's name.")
    namespace: str = Field(..., description="The RLTrainingJob's namespace.")
    spec: RLTrainingJobSpec
    data_parallel_size: int = Field(..., ge=1, description="DP = nodes*ppn/(TP*PP).")
    redis: RedisConnection
    keys: RedisKeys
    trainer_service: str = Field(..., description="Headless Service name of the trainer gang.")
    trainer_master_host: str = Field(
        ..., description="DNS name of trainer pod 0 (rendezvous, weight transfer)."
    )
    checkpoint_dir: str = c.CHECKPOINT_MOUNT_DIR
    metrics_port: int = c.PORT_METRICS
    weights_port: int = c.PORT_WEIGHTS
    rendezvous_port: int = c.PORT_RENDEZVOUS

    _recorded: Optional[tuple[str, dict[str, str]]] = PrivateAttr(default=None)

    def to_json(self) -> str:
        """Canonical JSON (camelCase, sorted keys): the bytes the ConfigMap holds and the hash covers (for a config
        :meth:`from_recorded`, exactly the bytes it was read from)."""
        if self._recorded is not None:
            return self._recorded[0]
        return canonical_json(self.model_dump(mode="json", by_alias=True))

    def config_hash(self) -> str:
        """First 16 hex digits of sha256 over :meth:`to_json`'s JSON value (fits a label value)."""
        return canonical_hash(json.loads(self.to_json()), digits=16)

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        return cls.model_validate_json(text)

    @classmethod
    def from_recorded(cls, text: str, role_hashes: Mapping[str, str]) -> "JobConfig":
        """A config as the operator recorded it for running pods (the job's ConfigMap): it keeps those exact bytes
        (:meth:`to_json`, :meth:`config_hash`) and the role hashes those pods carry (:meth:`recorded_role_hash`), even
        where this version would resolve or serialise the same spec differently (a new field, a new default), so
        that an upgraded operator sees the pods as current. Do not ``model_copy`` it: a copy keeps the record.

        Raises:
            pydantic.ValidationError: this version cannot read ``text``.
        """
        config = cls.from_json(text)
        config._recorded = (text, dict(role_hashes))
        return config

    def recorded_role_hash(self, role: str) -> Optional[str]:
        """The role config hash recorded with a config :meth:`from_recorded` for ``role`` (``trainer``,
        ``rollout``); None for a freshly resolved config or an unrecorded role."""
        return None if self._recorded is None else self._recorded[1].get(role)

    @classmethod
    def load(cls, path: Optional[str | os.PathLike[str]] = None) -> "JobConfig":
        """Load and validate the config from ``path`` or env ``RLJOB_CONFIG`` (default /etc/rljob/config.json).

        Raises:
            FileNotFoundError: no file at the path.
            pydantic.ValidationError: the file does not match the model (names the field).
        """
        path = Path(path or os.environ.get(c.ENV_CONFIG, c.CONFIG_PATH))
        return cls.from_json(path.read_text())

    def transfer_rank(self, replica_index: int, local_gpu: int = 0) -> int:
        """Weight-transfer group rank of GPU process ``local_gpu`` of rollout pod ``replica_index`` (DESIGN §2)."""
        per_replica = max(1, self.spec.rollout.gpus_per_replica)
        return 1 + replica_index * per_replica + local_gpu

    def first_external_transfer_rank(self) -> int:
        """The lowest weight-transfer rank a process outside rljob may heartbeat as: the first above the rollout pods'
        range (1 with ``spec.rollout.replicas`` 0). It moves up when the rollout is scaled up."""
        return self.transfer_rank(self.spec.rollout.replicas)


def resolve(name: str, namespace: str, spec: RLTrainingJobSpec, redis: RedisConnection) -> JobConfig:
    """Build the resolved config of one job (the operator's and the tests' single way to make one).

    Raises:
        ValueError: the trainer topology does not divide (see :func:`rljob_api.validation.data_parallel_size`).
    """
    from rljob_api import names
    from rljob_api.validation import data_parallel_size

    service = names.trainer_service(name)
    return JobConfig(
        name=name,
        namespace=namespace,
        spec=spec,
        data_parallel_size=data_parallel_size(spec),
        redis=redis,
        keys=RedisKeys.build(namespace, name, spec),
        trainer_service=service,
        trainer_master_host=names.pod_dns(names.trainer_pod(name, 0), service, namespace),
    )
