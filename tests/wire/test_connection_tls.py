"""Redis over TLS against a real TLS-only redis-server: the clients every role builds from the resolved config and
env (``REDIS_PASSWORD``, ``REDIS_TLS_CA_FILE``) verify the server's CA, carry documents from the rollout writer to
the trainer reader, and fail fast with a clear error when the CA bundle is wrong."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api import constants as c
from rljob_api.config import RedisConnection
from rljob_rollout.writer import DocumentWriter, make_document
from rljob_wire.connection import RedisTLSError, connect, retry_with_backoff
from rljob_trainer.stream.reader import StreamReader


def tls_config(server):
    return resolve("demo", "ns", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}), RedisConnection(host=server.host, port=server.port, tls=True))


def test_server_listens_only_on_tls(redis_tls_server):
    client = redis_tls_server.client()
    assert client.config_get("port") == {"port": "0"}  # no plain port: every connection below is TLS
    assert client.config_get("tls-port") == {"tls-port": str(redis_tls_server.port)}
    client.close()


def test_rollout_writer_to_trainer_reader_over_tls(redis_tls_server, monkeypatch):
    monkeypatch.setenv(c.ENV_REDIS_PASSWORD, redis_tls_server.password)
    monkeypatch.setenv(c.ENV_REDIS_TLS_CA_FILE, str(redis_tls_server.tls.ca_file))
    config = tls_config(redis_tls_server)
    writer_client, reader_client = connect(config), connect(config)
    try:
        sent = make_document([3, 1, 4], [1, 5], [-0.25, -2.5], reward=0.75, advantage=-1.5, model_version=1024)
        DocumentWriter(writer_client, config, replica_index=0).write([sent])
        reader = StreamReader(reader_client, config.keys, 0, 1, micro_batch_tokens=64, require_metrics_fields=True,
                              data_timeout_seconds=10, block_ms=200)
        [(entry_id, got)] = reader.next_documents(1)
        assert got.tokens.dtype == np.int64 and got.tokens.tolist() == [3, 1, 4, 1, 5]
        assert got.old_log_probabilities.tolist() == [0, 0, 0, -0.25, -2.5]
        assert got.model_version.tolist() == [1024] * 5
        assert (got.advantage, got.reward, got.loss_masking_spans) == (-1.5, 0.75, [(0, 3)])
        assert reader.ack([entry_id]) == 1
        assert writer_client.hget(config.keys.rollout, "documents_written") == b"1"
    finally:
        writer_client.close()
        reader_client.close()


@pytest.mark.parametrize("bundle", ["foreign CA", "system CAs"])
def test_wrong_ca_fails_at_once_with_a_clear_error(redis_tls_server, monkeypatch, bundle):
    monkeypatch.setenv(c.ENV_REDIS_PASSWORD, redis_tls_server.password)
    if bundle == "foreign CA":
        monkeypatch.setenv(c.ENV_REDIS_TLS_CA_FILE, str(redis_tls_server.tls.foreign_ca_file))
        named = str(redis_tls_server.tls.foreign_ca_file)
    else:
        monkeypatch.delenv(c.ENV_REDIS_TLS_CA_FILE, raising=False)
        named = "the system CAs"
    client = connect(tls_config(redis_tls_server))
    start = time.monotonic()
    # the trainer's start-up wait: retries an unreachable Redis for minutes, but a certificate failure never
    with pytest.raises(RedisTLSError, match="certificate verify failed") as raised:
        retry_with_backoff(client.ping, "connect to Redis", max_seconds=60)
    assert time.monotonic() - start < 3
    message = str(raised.value)
    assert named in message and c.ENV_REDIS_TLS_CA_FILE in message
    assert f"127.0.0.1:{redis_tls_server.port}" in message
    with pytest.raises(RedisTLSError):  # a plain command too, without the client's own retries
        client.xadd("stream", {"k": "v"})
    assert time.monotonic() - start < 3
    client.close()


def test_missing_ca_file_fails_at_once(redis_tls_server, monkeypatch, tmp_path):
    monkeypatch.setenv(c.ENV_REDIS_TLS_CA_FILE, str(tmp_path / "missing.pem"))
    client = connect(tls_config(redis_tls_server), password=redis_tls_server.password)
    start = time.monotonic()
    with pytest.raises(RedisTLSError, match=r"CA bundle \S*missing.pem: the CA bundle file does not exist"):
        client.ping()
    assert time.monotonic() - start < 3
    client.close()


def test_explicit_ca_argument_overrides_the_env(redis_tls_server, monkeypatch):
    monkeypatch.setenv(c.ENV_REDIS_TLS_CA_FILE, str(redis_tls_server.tls.foreign_ca_file))
    client = connect(tls_config(redis_tls_server), password=redis_tls_server.password,
                     ssl_ca_certs=str(redis_tls_server.tls.ca_file))
    client.set("k", b"\x00\xff")
    assert client.get("k") == b"\x00\xff"
    client.close()
