"""Shared Redis clients: one connection pool per Redis endpoint and password, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis

from rljob_api.config import RedisConnection

from rljob_operator.redis_io.clients import RedisClients


def _operator_connections(server) -> int:
    """Clients connected to ``server`` other than the test's own INFO connection."""
    with server.client() as probe:
        return int(probe.info("clients")["connected_clients"]) - 1


def test_jobs_on_one_redis_share_one_client_and_it_closes_with_the_last_holder(redis_server):
    here = RedisConnection(host=redis_server.host, port=redis_server.port)
    other_db = RedisConnection(host=redis_server.host, port=redis_server.port, db=1)
    counts = {}

    async def go():
        clients = RedisClients()
        jobs = [await clients.acquire(("ns", f"job-{i}"), here, redis_server.password) for i in range(50)]
        assert all(client is jobs[0] for client in jobs) and len(clients) == 1
        await asyncio.gather(*(client.hgetall(f"rljob:ns:job-{i}:progress") for i, client in enumerate(jobs)))
        counts["50 jobs"] = _operator_connections(redis_server)

        elsewhere = await clients.acquire(("ns", "job-x"), other_db, redis_server.password)
        wrong = await clients.acquire(("ns", "job-y"), here, "not-the-password")
        assert len({id(jobs[0]), id(elsewhere), id(wrong)}) == 3 and len(clients) == 3
        with pytest.raises(redis.AuthenticationError):
            await wrong.ping()
        # job-y's password Secret was fixed: it moves to the shared client and its old one closes
        assert await clients.acquire(("ns", "job-y"), here, redis_server.password) is jobs[0]
        assert len(clients) == 2

        for i in range(49):
            await clients.release(("ns", f"job-{i}"))
        await clients.release(("ns", "never-held"))
        assert await jobs[0].ping()  # job-49 and job-y still hold it
        await clients.release(("ns", "job-49"))
        await clients.release(("ns", "job-y"))
        assert len(clients) == 1
        await asyncio.sleep(0.1)
        counts["one job left on db 1"] = _operator_connections(redis_server)
        await clients.close()
        assert len(clients) == 0
        await asyncio.sleep(0.1)
        counts["closed"] = _operator_connections(redis_server)

    asyncio.run(go())
    assert counts["50 jobs"] <= 5, counts  # a pool used by 50 concurrent reads, not 50 clients
    assert counts == {**counts, "one job left on db 1": 0, "closed": 0}


def test_jobs_that_verify_tls_with_different_cas_get_different_clients(redis_tls_server):
    server = redis_tls_server
    connection = RedisConnection(host=server.host, port=server.port, tls=True)
    ca, foreign = server.tls.ca_file.read_text(), server.tls.foreign_ca_file.read_text()

    async def go():
        clients = RedisClients()
        try:
            first = await clients.acquire(("ns", "a"), connection, server.password, ca)
            same = await clients.acquire(("ns", "b"), connection, server.password, ca)
            other = await clients.acquire(("ns", "c"), connection, server.password, foreign)
            assert first is same and other is not first and len(clients) == 2
            assert await first.ping()
            with pytest.raises(redis.ConnectionError):
                await other.ping()
            # job c's CA Secret was fixed: it joins the verified client, the one with the foreign CA closes
            assert await clients.acquire(("ns", "c"), connection, server.password, ca) is first
            assert len(clients) == 1
        finally:
            await clients.close()

    asyncio.run(go())
