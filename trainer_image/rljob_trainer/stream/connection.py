"""Redis clients for every role: password from env, optional TLS, timeouts, health checks, retries with backoff.

The password reaches every pod as env ``REDIS_PASSWORD`` (DESIGN §2 "Secrets"); with ``redis.tls`` on, the
server certificate is verified (host name included) against env ``REDIS_TLS_CA_FILE`` or the system CAs. Upstream
Fast-LLM and PipelineRL connect without password or TLS, which is the gap this module closes (DESIGN §3).
"""

from __future__ import annotations

import logging
import os
import ssl
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


class RedisTLSError(ConnectionError):
    """The Redis server's TLS certificate failed verification (signed by a CA outside the configured bundle, or not
    issued for the configured host), or the CA bundle file does not exist. The message names the server, the CA
    bundle and the reason. Never retried: retrying cannot fix a wrong CA bundle or host name."""


def _tls_failure(error: Optional[BaseException]) -> Optional[str]:
    """Why the TLS setup behind ``error`` failed for good, or None (redis-py raises ``ConnectionError`` while
    handling the ``ssl.SSLCertVerificationError``, or the ``FileNotFoundError`` of a missing CA bundle)."""
    for _ in range(8):
        if error is None:
            return None
        if isinstance(error, ssl.SSLCertVerificationError):
            return f"the server's certificate did not verify (certificate verify failed: {error.verify_message})"
        if isinstance(error, FileNotFoundError):
            return "the CA bundle file does not exist"
        error = error.__cause__ or error.__context__
    return None


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(cap=10.0, base=0.1)


class _Retry(Retry):
    """redis-py's ``Retry``, except that authentication errors (a ``ConnectionError`` subclass in redis-py) and
    TLS certificate failures are raised at once, the latter as :class:`RedisTLSError`: retrying a wrong password
    or CA bundle only delays the error.

    Args:
        ca_file: the CA bundle the client verifies with (None: system CAs); named in :class:`RedisTLSError`.
    """

    def __init__(self, backoff, retries: int, ca_file: Optional[str] = None) -> None:
        super().__init__(backoff, retries)
        self.ca_file = ca_file

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            if isinstance(error, AuthenticationError) or _tls_failure(error) is not None:
                return False
            return is_retryable is None or is_retryable(error)

        try:
            return super().call_with_retry(do, fail, retryable, with_failure_count)
        except ConnectionError as error:
            reason = _tls_failure(error)
            if reason is None or isinstance(error, RedisTLSError):
                raise
            bundle = f"CA bundle {self.ca_file}" if self.ca_file else f"the system CAs (env {c.ENV_REDIS_TLS_CA_FILE} unset)"
            raise RedisTLSError(
                f"TLS to Redis with {bundle}: {reason}. Set env {c.ENV_REDIS_TLS_CA_FILE} to the PEM bundle of the CA "
                f"that signed the server's certificate, and check that the certificate names the config's redis.host. "
                f"({error})"
            ) from error


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
        ssl_ca_certs: PEM bundle of the CAs that signed the server certificate when ``tls`` is on; overrides env
            ``REDIS_TLS_CA_FILE`` (unset or empty env: the system CAs). The host name is checked too.

    Returns:
        ``redis.Redis`` with bytes responses (the codec needs raw bytes), TCP keepalive, health checks every
        :data:`HEALTH_CHECK_INTERVAL_SECONDS` s and :data:`COMMAND_RETRIES` retries on connection errors.
        A wrong or missing password raises ``redis.AuthenticationError`` at the first command, without retries;
        a server certificate that does not verify raises :class:`RedisTLSError` there, without retries.
    """
    if password is None:
        password = os.environ.get(c.ENV_REDIS_PASSWORD) or None
    tls = {}
    if config.redis.tls:
        if ssl_ca_certs is None:
            ssl_ca_certs = os.environ.get(c.ENV_REDIS_TLS_CA_FILE) or None
        tls = {"ssl": True, "ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_certs": ssl_ca_certs}
    return redis.Redis(
        host=config.redis.host,
        port=config.redis.port,
        db=config.redis.db,
        password=password,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
        retry=_Retry(_backoff(), COMMAND_RETRIES, tls.get("ssl_ca_certs")),
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
        RedisTLSError: the server's TLS certificate did not verify; never retried either.
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
