"""What one operator process keeps per job (:class:`JobRuntime`, in kopf's ``memo``) and what every pass needs
from the operator (:class:`Context`).

Per-job state lives only in this process (locks, what was applied and written, the Redis client held) and is
rebuilt from the cluster after a restart. A pass that starts before the watch has delivered this process's own last
status write reads the job as written (:meth:`JobRuntime.catch_up`), so it is not refused as stale.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Optional

import redis.asyncio as aioredis

from rljob_api.protocol import Backlog
from rljob_api.config import JobConfig
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.validation import SpecProblem

from rljob_operator.kube_api import KubeApi
from rljob_operator.eta import StepRate
from rljob_operator.observe import PodView
from rljob_operator.redis_io.clients import RedisClients
from rljob_operator.job_status import Event, RedisHealth


@dataclass(frozen=True)
class Recorded:
    """The config recorded for a job's pods: ``config`` (:meth:`JobConfig.from_recorded`) and the job ``generation``
    it was resolved from (None: recorded by an operator before 0.2, which kept no generation)."""

    config: JobConfig
    generation: Optional[int]


RETRY_REFUSED_S = 30.0
"""How long a pod refused for naming a PriorityClass, ServiceAccount or RuntimeClass that does not exist stays refused
before a pass tries again (it may have been created since; trying on every pass would create and delete the pods of
the other role each time)."""


@dataclass
class JobRuntime:
    """State of one job in this operator process (lost on restart, rebuilt from the cluster)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    applied: Optional[str] = None
    """Digest of the static children this process last applied or found as rendered (re-applied only when it
    changes)."""
    environment_applied: Optional[str] = None
    """Applied hash of the environment server's Deployment this process last applied or found as rendered
    (:func:`.children.apply_environment`)."""
    rejected: Optional[tuple[int, str]] = None
    """(generation, message) of a child the API server refused (422); cleared by a new generation, or (a pod naming
    an object that does not exist) once it is :data:`RETRY_REFUSED_S` old."""
    rejected_at: float = 0.0
    """time.monotonic() when ``rejected`` was recorded."""
    last_valid: Optional[tuple[Optional[int], RLTrainingJobSpec]] = None
    """(generation, spec) whose children this process last applied: what an invalid edit keeps running."""
    recorded: Optional[Recorded] = None
    """The config recorded for the job's pods (:mod:`.resolution`): read from its ConfigMap once, then what this
    process last applied."""
    created: dict[str, tuple[float, PodView]] = field(default_factory=dict)
    deleted: dict[str, str] = field(default_factory=dict)
    redis: Optional[aioredis.Redis] = None
    """The shared client this job holds (:class:`~rljob_operator.redis_io.clients.RedisClients`), while active."""
    redis_identity: Optional[tuple] = None
    redis_health: RedisHealth = RedisHealth(None, "not checked yet")
    backlog: Optional[Backlog] = None
    """The consumer group's counts at the last read of Redis (what a lost stream held, as far as known)."""
    step_rate: StepRate = field(default_factory=StepRate)
    """The trainer's recent step rate (status.estimatedRemainingSeconds)."""
    queued: bool = False
    """Whether a pass of this process saw the job queued for Kueue (its Workload is deleted when the label goes)."""
    looping: bool = False
    """True while the job's daemon loop runs (the operator's cleanup waits for it)."""
    seen: Optional[tuple] = None
    """What the job's metadata said at the last pass (see ``handlers``): a watch event that changes it wakes the
    daemon, this process's own status writes do not."""
    config_changes: tuple[str, ...] = ()
    """The fields the trainer reads that the last applied edit changed (:func:`.render.changed_fields`): named by a
    ConfigChanged restart. Empty after an operator restart (the earlier config is gone by then)."""
    override_check: Optional[tuple[Any, tuple[SpecProblem, ...]]] = None
    """(key, problems) of the last podTemplate check (:func:`.admission.override_problems`): the pods are rendered for
    it again only when the config, labels or uid change."""
    notices: list[Event] = field(default_factory=list)
    """Events of what a pass did (not condition transitions, e.g. RedisReplaced), posted after the next status write
    (or pass without one): a pass refused as stale keeps them for the next."""
    written: Optional[tuple[frozenset[str], str, dict[str, Any]]] = None
    """(resourceVersions this process's status writes replaced, the resourceVersion and status they left), until
    the watch shows the job at or past that write."""

    def reject(self, generation: Optional[int], message: str) -> None:
        """Record the API server's refusal (``message``) of a child of ``generation`` (see ``rejected``)."""
        self.rejected, self.rejected_at = (generation, message), time.monotonic()

    def catch_up(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body``, or — when it predates this process's last status write — ``body`` with that write's status
        and resourceVersion. A status write carries a resourceVersion precondition, so nothing else changed the
        job between the replaced version and the written one: the result is the job as the API server holds it."""
        if self.written is None:
            return body
        replaced, version, stored = self.written
        meta = body.get("metadata") or {}
        if meta.get("resourceVersion") not in replaced:
            self.written = None  # the watch caught up, or the job moved on since
            return body
        return {**body, "metadata": {**meta, "resourceVersion": version}, "status": stored}

    def remember_write(self, before: Optional[str], updated: Mapping[str, Any]) -> None:
        """Record a status write that moved the job from resourceVersion ``before`` to ``updated``."""
        replaced = self.written[0] if self.written is not None else frozenset()
        self.written = (replaced | {before}, updated["metadata"]["resourceVersion"], dict(updated.get("status") or {}))


@dataclass
class Context:
    """What a pass needs from the operator: the API, intervals (seconds), and hooks for events and metrics."""

    api: KubeApi
    post_event: Callable[[Mapping[str, Any], Event], None]
    redis_clients: RedisClients = field(default_factory=RedisClients)
    on_restart: Callable[[int], None] = lambda n: None
    active_interval_s: float = 5.0
    idle_interval_s: float = 60.0
    read_progress: bool = True
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(timezone.utc).replace(microsecond=0))
