"""The job's progress as the roles report it in Redis (DESIGN §2 "Progress"): parse and fetch.

Trainer global rank 0 writes the hash ``{prefix}progress`` after each step (``step``, ``documents_seen``,
``model_version``, ``tokens_per_second``, ``metrics`` as a JSON object); rollout workers add to
``{prefix}rollout`` (``reward_sum:{v}`` and ``reward_count:{v}`` per weights version v). The operator reports
the newest version's mean as ``status.rolloutReward``, and the ``all_rewards_failed`` field (present while a
worker's last batch had no sample whose reward function returned) as RolloutReady=False/AllRewardsFailed. The
progress hash's ``checkpoint_lost`` (present while the trainer's attempt started below the checkpoint Redis records,
because the volume no longer holds it) becomes Running=True/CheckpointLost and a Warning Event.
"""

from __future__ import annotations

import json
import math
import ssl
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from rljob_api import constants as c
from rljob_api.config import RedisConnection, RedisKeys


#: Decimals of status.rolloutReward: what `kubectl get rljob` shows, and fewer status writes for noise.
REWARD_DECIMALS = 4


@dataclass(frozen=True)
class LostCheckpoint:
    """The progress hash's ``checkpoint_lost``: checkpoint ``step`` at ``path`` is recorded in Redis but gone from the
    checkpoint volume, so the trainer started from step ``restored_from_step`` (0: from scratch). ``attempt``: the gang
    attempt whose start found the loss (None: not stamped, e.g. an older trainer). None: unreadable."""

    step: Optional[int]
    path: Optional[str]
    restored_from_step: Optional[int]
    attempt: Optional[int] = None

    def belongs_to(self, attempt: int) -> bool:
        """Whether this record describes gang ``attempt``'s start: until the new gang's rank 0 replaces or deletes
        it, the hash still holds the previous attempt's record. An unstamped record is taken as current."""
        return self.attempt is None or self.attempt == attempt


def lost_checkpoint_message(lost: LostCheckpoint, attempt: int, volume: Optional[str]) -> str:
    """What Running=True/CheckpointLost says, e.g. "attempt 1 started over at step 0: checkpoint step 35 (<path>) was
    lost: an emptyDir checkpoint volume does not survive a gang restart or suspend; set
    spec.trainer.checkpoint.volume to a PersistentVolumeClaim". ``volume``: spec.trainer.checkpoint.volume."""
    where = (f"it is missing from PersistentVolumeClaim {volume} (spec.trainer.checkpoint.volume; was the claim "
             "replaced or cleaned?)" if volume else
             "an emptyDir checkpoint volume does not survive a gang restart or suspend; set "
             "spec.trainer.checkpoint.volume to a PersistentVolumeClaim")
    start = "started over" + (f" at step {lost.restored_from_step}" if lost.restored_from_step is not None else "")
    which = f"checkpoint step {lost.step}" if lost.step is not None else "the last recorded checkpoint"
    return f"attempt {attempt} {start}: {which}" + (f" ({lost.path})" if lost.path else "") + f" was lost: {where}"


@dataclass(frozen=True)
class Progress:
    """Trainer and rollout progress; None where not reported yet.

    ``documents_seen`` and ``model_version`` are in documents; ``rollout_reward`` is the mean raw reward of the
    documents generated with weights version ``rollout_model_version``. ``rewards_failure``: what to tell the user
    while the rollout hash holds ``all_rewards_failed`` (None when it does not). ``checkpoint_lost``: the progress
    hash's ``checkpoint_lost`` (None when absent or unreadable).
    """

    step: Optional[int] = None
    documents_seen: Optional[int] = None
    model_version: Optional[int] = None
    tokens_per_second: Optional[float] = None
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_reward: Optional[float] = None
    rollout_model_version: Optional[int] = None
    rewards_failure: Optional[str] = None
    checkpoint_lost: Optional[LostCheckpoint] = None

    def status_fields(self) -> dict[str, Any]:
        """The status fields this progress sets (snake_case names of :class:`RLTrainingJobStatus`)."""
        fields: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("step", "documents_seen", "model_version", "tokens_per_second", "rollout_reward",
                         "rollout_model_version")
            if getattr(self, name) is not None
        }
        if self.metrics:
            fields["last_metrics"] = dict(self.metrics)
        return fields


def _text(value: Any) -> Optional[str]:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: Any, kind):
    """``value`` as an int (exactly, also from "12.0") or a finite float; None when it is neither."""
    text = _text(value)
    if text is None:
        return None
    try:
        return int(text) if kind is int else _finite(float(text))
    except ValueError:
        pass
    try:
        number = _finite(float(text))
    except ValueError:
        return None
    return int(number) if kind is int and number is not None and number.is_integer() else None


def _finite(number: float) -> Optional[float]:
    return number if math.isfinite(number) else None


def parse(progress: Mapping[Any, Any], rollout: Mapping[Any, Any]) -> Progress:
    """Parse the two hashes (as HGETALL returns them, bytes or str). Unparseable or non-finite values are
    skipped (Kubernetes JSON cannot hold NaN), never raised: a bad field must not stop status updates."""
    progress = {_text(k): v for k, v in progress.items()}
    rollout = {_text(k): v for k, v in rollout.items()}
    metrics: dict[str, float] = {}
    raw_metrics = _text(progress.get(c.PROGRESS_METRICS))
    if raw_metrics:
        try:
            decoded = json.loads(raw_metrics)
        except json.JSONDecodeError:
            decoded = {}
        for name, value in (decoded.items() if isinstance(decoded, dict) else ()):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                metrics[str(name)] = float(value)
    model_version = _number(progress.get(c.PROGRESS_MODEL_VERSION), int)
    reward, version = _newest_reward(rollout, model_version)
    return Progress(
        step=_number(progress.get(c.PROGRESS_STEP), int),
        documents_seen=_number(progress.get(c.PROGRESS_DOCUMENTS_SEEN), int),
        model_version=model_version,
        tokens_per_second=_rounded(_number(progress.get(c.PROGRESS_TOKENS_PER_SECOND), float), 1),
        metrics=metrics,
        rollout_reward=reward,
        rollout_model_version=version,
        rewards_failure=rewards_failure(rollout.get(c.ROLLOUT_ALL_REWARDS_FAILED)),
        checkpoint_lost=checkpoint_lost(progress.get(c.PROGRESS_CHECKPOINT_LOST)),
    )


def _json_object(raw: Any) -> Optional[dict]:
    """A hash field holding a JSON object: None when absent, {} when present but unreadable or not an object."""
    text = _text(raw)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return info if isinstance(info, dict) else {}


def checkpoint_lost(raw: Any) -> Optional[LostCheckpoint]:
    """The progress hash's ``checkpoint_lost`` field (JSON {step, path, restored_from_step, message, attempt}, written
    by trainer rank 0), or None when absent. An unreadable record still counts, its unreadable parts None; never an error: a bad
    field must not stop status updates."""
    info = _json_object(raw)
    if info is None:
        return None
    def integer(value: Any) -> Optional[int]:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    path = info.get("path")
    return LostCheckpoint(step=integer(info.get("step")), path=path if isinstance(path, str) and path else None,
                          restored_from_step=integer(info.get("restored_from_step")), attempt=integer(info.get("attempt")))


def rewards_failure(raw: Any) -> Optional[str]:
    """The message of RolloutReady=False/AllRewardsFailed from the rollout hash's ``all_rewards_failed`` field
    (JSON {version, samples, errors: {exception class: count}, message}, written by the rollout worker), or None
    when the field is absent. Unreadable details still give a message, never an error."""
    info = _json_object(raw)
    if info is None:
        return None
    samples, version, errors = info.get("samples"), info.get("version"), info.get("errors")
    counted = {str(kind): n for kind, n in errors.items() if isinstance(n, int)} if isinstance(errors, dict) else {}
    kinds = ", ".join(f"{kind} ×{n}" for kind, n in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0])))
    which = f"every one of the {samples} samples" if isinstance(samples, int) and samples > 0 else "every sample"
    batch = f" (weights version {version})" if isinstance(version, int) else ""
    return (
        f"{which} of a rollout worker's last batch{batch} failed its reward function: {kinds or 'error kind unknown'}; "
        "no document reaches the trainer until rewards succeed again: fix spec.rollout.task (rewardFunction, "
        "datasetPath) or the reward code; the rollout pods' logs hold the tracebacks"
    )


def _rounded(value: Optional[float], decimals: int) -> Optional[float]:
    return None if value is None else round(value, decimals)


def _newest_reward(rollout: Mapping[str, Any], model_version: Optional[int]) -> tuple[Optional[float], Optional[int]]:
    """(sum / count rounded to :data:`REWARD_DECIMALS`, version) for the newest version with a positive count, at
    most the trainer's ``model_version`` when known: a higher one belongs to a timeline a restart abandoned (a rollout
    worker still on those weights may add to it until the new weights reach it)."""
    best: tuple[Optional[float], Optional[int]] = (None, None)
    for key, raw_count in rollout.items():
        if not key.startswith(c.ROLLOUT_REWARD_COUNT_PREFIX):
            continue
        version = _number(key[len(c.ROLLOUT_REWARD_COUNT_PREFIX):], int)
        count = _number(raw_count, float)
        total = _number(rollout.get(f"{c.ROLLOUT_REWARD_SUM_PREFIX}{key[len(c.ROLLOUT_REWARD_COUNT_PREFIX):]}"), float)
        if version is None or not count or count <= 0 or total is None:
            continue
        if model_version is not None and version > model_version:
            continue
        if best[1] is None or version > best[1]:
            best = (round(total / count, REWARD_DECIMALS), version)
    return best


async def fetch(client: aioredis.Redis, keys: RedisKeys) -> Progress:
    """Read both hashes in one round trip and parse them.

    Raises:
        redis.RedisError: Redis unreachable or the password is wrong.
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.progress)
        pipe.hgetall(keys.rollout)
        progress, rollout = await pipe.execute()
    return parse(progress, rollout)


def connect(connection: RedisConnection, password: Optional[str], *, ca_data: Optional[str] = None,
            timeout: float = 3.0, max_connections: int = 4) -> aioredis.Redis:
    """An asyncio Redis client for ``connection`` (nothing is sent until the first command), safe to share
    between jobs: at most ``max_connections`` connections, a read waits up to ``timeout`` seconds for a free one
    (redis.ConnectionError after that), so the connections to one Redis do not grow with the number of jobs.

    With ``connection.tls`` the server's certificate is verified, host name included, against ``ca_data`` (PEM text
    of the CAs from ``spec.redis.caSecretRef``) or, when None, the system CAs; a certificate that does not verify
    fails the first command with redis.ConnectionError (see :func:`tls_failure`).

    No retries (redis-py's default retries for seconds): a failed read is reported at once and the operator
    simply reads again on its next pass, so one unreachable Redis never holds up a reconcile pass.
    """
    tls: dict[str, Any] = {}
    if connection.tls:
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_data": ca_data}
    pool = aioredis.BlockingConnectionPool(
        max_connections=max_connections,
        timeout=timeout,
        connection_class=aioredis.SSLConnection if connection.tls else aioredis.Connection,
        host=connection.host,
        port=connection.port,
        db=connection.db,
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        **tls,
    )
    return aioredis.Redis.from_pool(pool)


def tls_failure(error: BaseException) -> Optional[str]:
    """The verifier's reason when ``error`` (or an error it was raised from) is a TLS certificate verification
    failure, e.g. "unable to get local issuer certificate"; None otherwise."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return current.verify_message or str(current)
        current = current.__cause__ or current.__context__
    return None
