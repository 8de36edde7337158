"""The job's progress as the roles report it in Redis (DESIGN §2 "Progress"): fetch it, and connect to Redis.

The hashes' fields and their parsing are :mod:`rljob_api.protocol`'s (trainer rank 0 writes the progress hash,
rollout workers the rollout hash). The operator reports the newest version's mean reward as
``status.rolloutReward``, the checkpoint hash as ``status.lastCheckpoint``, the rollout hash's ``all_rewards_failed`` as RolloutReady=False/AllRewardsFailed, and the
progress hash's ``checkpoint_lost`` as Running=True/CheckpointLost and a Warning Event.
"""

from __future__ import annotations

import dataclasses
import ssl
from datetime import datetime, timezone
from typing import Any, Optional

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from rljob_api import protocol
from rljob_api.config import RedisConnection, RedisKeys
from rljob_api.protocol import REWARD_DECIMALS, LostCheckpoint, Progress, parse_progress
from rljob_api.status import CheckpointStatus

__all__ = ["REWARD_DECIMALS", "LostCheckpoint", "Progress", "connect", "fetch", "lost_checkpoint_message",
           "parse_progress", "status_fields", "tls_failure"]


def lost_checkpoint_message(lost: LostCheckpoint, attempt: int, volume: Optional[str]) -> str:
    """What Running=True/CheckpointLost says about gang ``attempt`` (:func:`rljob_api.protocol.lost_checkpoint_message`);
    ``volume``: spec.trainer.checkpoint.volume (None: an emptyDir)."""
    return protocol.lost_checkpoint_message(dataclasses.replace(lost, attempt=attempt), volume)


def status_fields(progress: Progress) -> dict[str, Any]:
    """The status fields ``progress`` sets (snake_case names of :class:`RLTrainingJobStatus`)."""
    fields: dict[str, Any] = {
        name: getattr(progress, name)
        for name in ("step", "documents_seen", "model_version", "tokens_per_second", "rollout_reward",
                     "rollout_model_version")
        if getattr(progress, name) is not None
    }
    if progress.metrics:
        fields["last_metrics"] = dict(progress.metrics)
    if progress.checkpoint is not None:
        record = progress.checkpoint
        fields["last_checkpoint"] = CheckpointStatus(
            step=record.step, documents_seen=record.documents_seen, path=record.path,
            time=None if record.committed_at is None else datetime.fromtimestamp(record.committed_at, timezone.utc))
    return fields


async def fetch(client: aioredis.Redis, keys: RedisKeys) -> Progress:
    """Read the progress, rollout and checkpoint hashes in one round trip and parse them.

    Raises:
        redis.RedisError: Redis unreachable or the password is wrong.
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.progress)
        pipe.hgetall(keys.rollout)
        pipe.hgetall(keys.checkpoint)
        pipe.get(keys.prefix + protocol.KEY_STREAM_ID)
        pipe.xinfo_groups(keys.stream)
        progress, rollout, checkpoint, stream_id, groups = await pipe.execute(raise_on_error=False)
    for reply in (progress, rollout, checkpoint, stream_id):
        if isinstance(reply, Exception):
            raise reply
    parsed = parse_progress(progress, rollout, checkpoint)
    backlog = None if isinstance(groups, Exception) else protocol.Backlog.from_groups(groups, keys.group)  # no stream
    return dataclasses.replace(parsed, stream_id=protocol.text(stream_id), backlog=backlog)


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
