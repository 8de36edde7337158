"""Asyncio Redis clients shared by the jobs that read the same Redis with the same password (and TLS CA bundle).

Many jobs on one external Redis read their progress hashes through one client (one connection pool) instead of
one client each. A job holds at most one client; the client is closed when the last job holding it lets go (a
job lets go when a pass leaves it idle, when its Redis or password changes, when a read fails, and when its
daemon stops), so idle jobs hold no Redis connection.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import redis.asyncio as aioredis

from rljob_api.config import RedisConnection

from rljob_operator import progress


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

    def __init__(self, connect: Callable[..., aioredis.Redis] = progress.connect) -> None:
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
