"""Redis clients for every role: password from env, optional TLS, timeouts, health checks, retries with backoff.

The password reaches every pod as env ``REDIS_PASSWORD`` (DESIGN §2 "Secrets"); upstream Fast-LLM and
PipelineRL connect without password or TLS, which is the gap this module closes (DESIGN §3).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, ConnectionError, TimeoutError
from redis.retry import Retry

from rljob_api import constants as c
from rljob_api.config import JobConfig

T = TypeVar("T")
log = logging.getLogger(__name__)

SOCKET_TIMEOUT_SECONDS = 30.0
"""Read/write timeout of one command. Must exceed every blocking XREADGROUP's BLOCK time."""
CONNECT_TIMEOUT_SECONDS = 10.0
HEALTH_CHECK_INTERVAL_SECONDS = 15
"""A connection idle for longer is PINGed before reuse, so a dead server is noticed before a command."""
COMMAND_RETRIES = 5
"""redis-py retries one command this many times on connection errors and timeouts (jittered backoff ≤ 10 s)."""


class RedisUnavailable(ConnectionError):
    """Redis stayed unreachable for the whole retry window (the message names the operation and the window)."""


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(cap=10.0, base=0.1)


class _Retry(Retry):
    """redis-py's ``Retry``, except that authentication errors (a ``ConnectionError`` subclass in redis-py)
    are raised at once: retrying a wrong password only delays the error."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            return not isinstance(error, AuthenticationError) and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(
    config: JobConfig,
    *,
    password: Optional[str] = None,
    socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
    ssl_ca_certs: Optional[str] = None,
) -> redis.Redis:
    """A Redis client for the job's Redis (``config.redis``), configured but not yet connected.

    Args:
        config: the resolved job config; host, port, db and ``tls`` come from ``config.redis``.
        password: overrides env ``REDIS_PASSWORD`` (unset or empty env: no password).
        socket_timeout: seconds a command may take (must exceed any blocking read's BLOCK time).
        ssl_ca_certs: PEM bundle that signed the server certificate when ``tls`` is on (default: system CAs).

    Returns:
        ``redis.Redis`` with bytes responses (the codec needs raw bytes), TCP keepalive, health checks every
        :data:`HEALTH_CHECK_INTERVAL_SECONDS` s and :data:`COMMAND_RETRIES` retries on connection errors.
        A wrong or missing password raises ``redis.AuthenticationError`` at the first command, without retries.
    """
    if password is None:
        password = os.environ.get(c.ENV_REDIS_PASSWORD) or None
    tls = {"ssl": True, "ssl_cert_reqs": "required", "ssl_ca_certs": ssl_ca_certs} if config.redis.tls else {}
    return redis.Redis(
        host=config.redis.host,
        port=config.redis.port,
        db=config.redis.db,
        password=password,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
        retry=_Retry(_backoff(), COMMAND_RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
        decode_responses=False,
        client_name=f"rljob-{config.name}",
        **tls,
    )


def retry_with_backoff(fn: Callable[[], T], what: str, max_seconds: float) -> T:
    """Call ``fn`` until it succeeds, retrying Redis connection errors and timeouts with jittered exponential
    backoff (redis-py's ``Retry`` + ``ExponentialWithJitterBackoff``, capped at 10 s between tries).

    For waits longer than one command's retries: Redis starting up, a rollout pod waiting for Redis, a
    reconnect after the server went away.

    Args:
        fn: the operation; called with no arguments.
        what: names the operation in logs and in the final error, e.g. "create consumer group".
        max_seconds: give up once this many seconds have passed since the first try.

    The last wait may end up to one backoff (10 s) after ``max_seconds``.

    Raises:
        RedisUnavailable: still failing after ``max_seconds`` (chained to the last error).
        redis.AuthenticationError: wrong or missing password; never retried, retrying cannot fix it.
        Any other exception of ``fn``: not retried.
    """
    deadline = time.monotonic() + max_seconds

    def on_failure(error: Exception, failures: int) -> None:
        if time.monotonic() >= deadline:
            raise RedisUnavailable(
                f"{what}: Redis unreachable for {max_seconds:g} s ({failures} tries): {error}"
            ) from error
        log.warning("%s: Redis unreachable (try %d): %s", what, failures, error)

    return _Retry(_backoff(), retries=-1).call_with_retry(fn, on_failure, with_failure_count=True)
