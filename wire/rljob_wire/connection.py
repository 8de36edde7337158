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
OUTAGE_SECONDS = 300.0
"""How long the trainer's client retries one command through a Redis outage (connection errors, timeouts, a Redis
still loading its append-only file) before the error reaches the training loop: long enough for the managed Redis
pod to be replaced (its deletion, eviction or node drain, the new pod scheduled and its claim attached, the file
loaded, the pod ready: seconds on one node, a minute or two where a volume moves between nodes), shorter than the
default collectiveTimeoutSeconds (600), for which the other ranks wait meanwhile (DESIGN §6)."""


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

    def __init__(self, backoff, retries: int, ca_file: Optional[str] = None, window_s: Optional[float] = None) -> None:
        super().__init__(backoff, retries)
        self.ca_file = ca_file
        self.window_s = window_s
        """When set: retry for this many seconds after a call's first failure, however many tries that takes (the
        count ``retries`` is not used)."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            if isinstance(error, AuthenticationError) or _tls_failure(error) is not None:
                return False
            return is_retryable is None or is_retryable(error)

        try:
            if self.window_s is None:
                return super().call_with_retry(do, fail, retryable, with_failure_count)
            return self._call_within_window(do, fail, retryable, with_failure_count)
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


    def _call_within_window(self, do, fail, retryable, with_failure_count):
        """redis-py's retry loop with a deadline instead of a count: the last error is raised once a failure comes
        :attr:`window_s` seconds or more after the first; the backoff never sleeps past the deadline."""
        self._backoff.reset()
        failures, deadline = 0, None
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if not retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.window_s
                if now >= deadline:
                    raise error
                time.sleep(min(self._backoff.compute(failures), deadline - now))


def connect(
    config: JobConfig,
    *,
    password: Optional[str] = None,
    socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
    ssl_ca_certs: Optional[str] = None,
    outage_seconds: Optional[float] = None,
) -> redis.Redis:
    """A Redis client for the job's Redis (``config.redis``), configured but not yet connected.

    Args:
        config: the resolved job config; host, port, db and ``tls`` come from ``config.redis``.
        password: overrides env ``REDIS_PASSWORD`` (unset or empty env: no password).
        socket_timeout: seconds a command may take (must exceed any blocking read's BLOCK time).
        ssl_ca_certs: PEM bundle of the CAs that signed the server certificate when ``tls`` is on; overrides env
            ``REDIS_TLS_CA_FILE`` (unset or empty env: the system CAs). The host name is checked too.
        outage_seconds: retry each command on connection errors and timeouts for this many seconds after its first
            failure (the trainer: :data:`OUTAGE_SECONDS`, riding out a Redis pod restart); None: :data:`COMMAND_RETRIES`
            tries (callers with a retry loop of their own, like the rollout worker).

    Returns:
        ``redis.Redis`` with bytes responses (the codec needs raw bytes), TCP keepalive, health checks every
        :data:`HEALTH_CHECK_INTERVAL_SECONDS` s and retries on connection errors (``outage_seconds``).
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
        retry=_Retry(_backoff(), COMMAND_RETRIES, tls.get("ssl_ca_certs"), outage_seconds),
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


class PipelinedConnection:
    """One connection held out of ``client``'s pool, for a command sent now whose reply is read later (one in flight).

    Sending the next command before working on the previous reply lets Redis execute it and the network carry the
    reply while this process computes (the client-side overlap of redis-py's pipelines, for one command at a time).
    A pipelined command's reply cannot be retried the way redis-py retries a command: if the connection fails
    while a command is in flight, the server may have executed it and its reply is lost. So this class never
    resends; it disconnects, sets :attr:`reply_lost` and leaves the recovery to the caller (for XREADGROUP:
    re-read the consumer's pending entries), which runs its operation again through :meth:`with_retry`.

    Args:
        client: the ``redis.Redis`` whose pool lends the connection, whose response callbacks parse the replies
            and whose ``Retry`` (backoff and number of tries, e.g. :func:`connect`'s) :meth:`with_retry` uses.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.retry: Retry = client.get_retry() or Retry(_backoff(), 0)
        self.in_flight: Optional[str] = None
        """Name of the command sent and not yet answered, or None."""
        self.reply_lost = False
        """A connection failure lost the reply of a command the server may have executed; the caller clears it."""
        self._connection = None

    def send(self, *args) -> None:
        """Send one command (``args[0]`` is its name) without reading its reply.

        Raises:
            RuntimeError: a command is already in flight.
            redis.ConnectionError, redis.TimeoutError: the connection failed (disconnected; :attr:`reply_lost` set
                if it failed while the command was being written, since the server may have received it).
        """
        if self.in_flight is not None:
            raise RuntimeError(f"{args[0]} sent while the reply of {self.in_flight} is unread")
        if self._connection is None:
            self._connection = self.client.connection_pool.get_connection()
        self._connection.connect()  # (re)connect and health-check first: a failure here loses no reply
        self._connection.check_health()
        self.in_flight = str(args[0])
        try:
            self._connection.send_command(*args, check_health=False)
        except BaseException:
            self.lose_reply()
            raise

    def receive(self) -> object:
        """The reply of the command in flight, parsed as ``client`` parses it.

        Raises:
            RuntimeError: no command in flight.
            redis.ResponseError: the server answered with an error (the reply is consumed).
            redis.ConnectionError, redis.TimeoutError: the connection failed before the whole reply arrived
                (disconnected; :attr:`reply_lost` set).
        """
        if self.in_flight is None or self._connection is None:
            raise RuntimeError("no command in flight")
        try:
            reply = self.client.parse_response(self._connection, self.in_flight)
        except redis.ResponseError:
            self.in_flight = None
            raise
        except BaseException:
            self.lose_reply()
            raise
        self.in_flight = None
        return reply

    def execute(self, *args) -> object:
        """Send one command and read its reply (nothing else may be in flight); raises as :meth:`send` and
        :meth:`receive` do."""
        self.send(*args)
        return self.receive()

    def lose_reply(self) -> None:
        """Drop the connection; a command in flight counts as executed with its reply lost (:attr:`reply_lost`)."""
        if self.in_flight is not None:
            self.in_flight = None
            self.reply_lost = True
        if self._connection is not None:
            self._connection.disconnect()

    def with_retry(self, operation: Callable[[], T]) -> T:
        """Run ``operation`` (which sends and receives on this connection), retrying redis ``ConnectionError`` and
        ``TimeoutError`` with the client's ``Retry``: the connection is dropped (:meth:`lose_reply`) and
        reconnected at the next send, after the backoff. ``operation`` must check :attr:`reply_lost` first.

        Raises:
            The last ``ConnectionError`` / ``TimeoutError`` once the client's retries are spent; any other error at once.
            redis-py's ``Retry`` also retries Python's built-in ``TimeoutError``: raise those outside ``operation``.
        """
        return self.retry.call_with_retry(operation, lambda _error: self.lose_reply())

    def close(self) -> None:
        """Give the connection back to the pool (a command in flight is dropped: :attr:`reply_lost`)."""
        if self._connection is not None:
            if self.in_flight is not None:
                self.lose_reply()
            self.client.connection_pool.release(self._connection)
            self._connection = None
