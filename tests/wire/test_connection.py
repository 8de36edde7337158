"""Redis connection: password from env, TLS settings, retry with backoff (real Redis with requirepass)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api.config import RedisConnection
from rljob_wire.connection import RedisUnavailable, connect, retry_with_backoff


def config_for(server, tls: bool = False):
    return resolve("demo", "ns", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}), RedisConnection(host=server.host, port=server.port, tls=tls))


def test_password_comes_from_env(redis_server, monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", redis_server.password)
    client = connect(config_for(redis_server))
    assert client.ping() is True
    client.set("k", b"\x00\xff")
    assert client.get("k") == b"\x00\xff"  # bytes mode, as the codec needs
    client.close()


@pytest.mark.parametrize("password", [None, "wrong"])
def test_missing_or_wrong_password_is_refused(redis_server, monkeypatch, password):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    if password:
        monkeypatch.setenv("REDIS_PASSWORD", password)
    client = connect(config_for(redis_server))
    start = time.monotonic()
    with pytest.raises(redis.AuthenticationError, match="(?i)auth|password"):
        client.ping()
    assert time.monotonic() - start < 2  # refused at once, not after the client's retries
    client.close()


def test_authentication_errors_are_not_retried(redis_server):
    client = connect(config_for(redis_server), password="wrong")
    calls = []

    def ping():
        calls.append(1)
        return client.ping()

    start = time.monotonic()
    with pytest.raises(redis.AuthenticationError):
        retry_with_backoff(ping, "ping", max_seconds=30)
    assert len(calls) == 1 and time.monotonic() - start < 2
    client.close()


def test_retry_waits_for_a_restarting_server(redis_server):
    client = connect(config_for(redis_server), password=redis_server.password)
    client.set("survives", b"1")
    redis_server.stop()
    restarter = threading.Timer(1.5, redis_server.start)
    restarter.start()
    try:
        start = time.monotonic()
        assert retry_with_backoff(lambda: client.get("survives"), "get", max_seconds=60) == b"1"
        assert time.monotonic() - start >= 1.0
    finally:
        restarter.join()
        client.close()


def test_retry_gives_up_after_the_window(redis_server):
    client = connect(config_for(redis_server), password=redis_server.password)
    redis_server.stop()
    start = time.monotonic()
    with pytest.raises(RedisUnavailable, match=r"create group: Redis unreachable for 2 s"):
        retry_with_backoff(client.ping, "create group", max_seconds=2)
    assert 2 <= time.monotonic() - start < 20
    client.close()


def test_the_trainers_client_rides_out_an_outage_longer_than_the_retry_count(redis_server):
    """A Redis down for 7 s (a pod replaced): the rollout's client gives up after its COMMAND_RETRIES tries (at most
    6.2 s of jittered backoff), the trainer's (outage_seconds) waits and reads what the append-only file kept."""
    config = config_for(redis_server)
    counted = connect(config, password=redis_server.password)
    windowed = connect(config, password=redis_server.password, outage_seconds=60)
    windowed.set("survives", b"1")
    redis_server.stop()
    restarter = threading.Timer(7.0, redis_server.start)
    restarter.start()
    result = {}
    reader = threading.Thread(target=lambda: result.update(got=windowed.get("survives"), at=time.monotonic()))
    start = time.monotonic()
    reader.start()
    try:
        with pytest.raises(redis.ConnectionError):
            counted.get("survives")
        assert time.monotonic() - start < 7.0
    finally:
        restarter.join()
        reader.join(30)
    assert result["got"] == b"1" and result["at"] - start >= 7.0
    counted.close()
    windowed.close()


def test_the_window_gives_up(redis_server):
    client = connect(config_for(redis_server), password=redis_server.password, outage_seconds=2)
    redis_server.stop()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert 2 <= time.monotonic() - start < 5  # the backoff never sleeps past the window
    client.close()


def test_tls_setting_selects_a_verifying_ssl_connection(redis_server):
    plain = connect(config_for(redis_server))
    secure = connect(config_for(redis_server, tls=True), ssl_ca_certs="/tmp/ca.pem")
    assert plain.connection_pool.connection_class is redis.Connection
    assert secure.connection_pool.connection_class is redis.SSLConnection
    kwargs = secure.connection_pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_ca_certs"] == "/tmp/ca.pem"
    assert kwargs["socket_timeout"] == 30.0 and kwargs["health_check_interval"] == 15
