"""Connecting to a job's Redis (:func:`connect`, :func:`tls_failure`) and the asyncio clients shared by the jobs that
read the same Redis with the same password (and TLS CA bundle).

Many jobs on one external Redis read their progress hashes through one client (one connection pool) instead of
one client each. A job holds at most one client; the client is closed when the last job holding it lets go (a
job lets go when a pass leaves it idle, when its Redis or password changes, when a read fails, and when its
daemon stops), so idle jobs hold no Redis connection.
"""

from __future__ import annotations

import hashlib
import ssl
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from rljob_api.config import RedisConnection


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


@dataclass(frozen=True)
class Endpoint:
    """What makes two jobs' clients interchangeable: where Redis is, the password and the CA bundle the server's
    TLS certificate is verified with (both as sha256 digests; "" when None)."""

    host: str
    port: int
    db: int
    tls: bool
    password_sha256: str
    ca_sha256: str = ""

    @classmethod
    def of(cls, connection: RedisConnection, password: Optional[str], ca_data: Optional[str] = None) -> "Endpoint":
        return cls(connection.host, connection.port, connection.db, connection.tls, _sha256(password),
                   _sha256(ca_data))


def _sha256(text: Optional[str]) -> str:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else ""


@dataclass
class _Shared:
    client: aioredis.Redis
    holders: set[Hashable] = field(default_factory=set)


class RedisClients:
    """The operator's Redis clients, one per :class:`Endpoint`, each held by the jobs using it.

    Args:
        connect: makes a client for (connection, password, ca_data=PEM text or None); nothing is sent before its
            first command.
    """

    def __init__(self, connect: Callable[..., aioredis.Redis] = connect) -> None:
        self._connect = connect
        self._shared: dict[Endpoint, _Shared] = {}
        self._held: dict[Hashable, Endpoint] = {}

    def __len__(self) -> int:
        """Number of open clients."""
        return len(self._shared)

    async def acquire(self, holder: Hashable, connection: RedisConnection, password: Optional[str],
                      ca_data: Optional[str] = None) -> aioredis.Redis:
        """The shared client of ``connection`` + ``password`` + ``ca_data`` (PEM text of the CAs that verify a TLS
        server, None: the system CAs) for ``holder`` (a job's key); a client ``holder`` held for another endpoint is
        let go first."""
        endpoint = Endpoint.of(connection, password, ca_data)
        if self._held.get(holder) not in (None, endpoint):
            await self.release(holder)
        shared = self._shared.get(endpoint)
        if shared is None:
            shared = self._shared[endpoint] = _Shared(self._connect(connection, password, ca_data=ca_data))
        shared.holders.add(holder)
        self._held[holder] = endpoint
        return shared.client

    async def release(self, holder: Hashable) -> None:
        """``holder`` lets go of its client (if any); the client closes when nobody holds it any more."""
        endpoint = self._held.pop(holder, None)
        shared = self._shared.get(endpoint) if endpoint is not None else None
        if shared is None:
            return
        shared.holders.discard(holder)
        if not shared.holders:
            del self._shared[endpoint]  # before awaiting: a concurrent acquire makes a fresh client
            await shared.client.aclose()

    async def close(self) -> None:
        """Close every client (operator shutdown)."""
        shared, self._shared, self._held = list(self._shared.values()), {}, {}
        for entry in shared:
            await entry.client.aclose()
