"""Overlapped reads against a real Redis: the read-ahead's bound and buffer, and connection failures while an
XREADGROUP is in flight (CLIENT KILL, server restart): every entry handed out exactly once, none stuck pending."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import redis

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api.config import RedisConnection
from rljob_wire.codec import Document, encode_document
from rljob_wire.connection import OUTAGE_SECONDS, PipelinedConnection, connect
from test_stream_reader import KEYS, firsts, pending_of, reader, wait_pending, write, write_docs

CONSUMER = "fast_llm_consumer_0"
BIG_TOKENS = 1 << 20
"""Tokens of a "big" document: 20 MiB on the wire (8 + 4 + 8 bytes per token), so two of them (40 MiB) exceed
what the loopback socket buffers hold (tcp_rmem max 32 MiB + tcp_wmem max 4 MiB): a reply that large is still
partly in Redis when its connection is killed, and the client can never read it whole."""


def big_document(i: int) -> Document:
    return Document(
        tokens=np.full(BIG_TOKENS, i, np.int64),
        old_log_probabilities=np.full(BIG_TOKENS, -0.5, np.float32),
        model_version=np.full(BIG_TOKENS, i, np.int64),
        loss_masking_spans=[(0, 1)],
        advantage=float(i),
        reward=1.0,
    )


def reader_connection(client) -> dict:
    """CLIENT LIST row of the reader's own connection: the only one whose last command is XREADGROUP."""
    (row,) = [row for row in client.client_list() if row["cmd"] == "xreadgroup"]
    return row


def ids_of(entries) -> list[str]:
    return [entry_id for entry_id, _ in entries]


def test_read_ahead_stays_within_one_call_and_is_handed_out_next(client):
    ids = write_docs(client, range(10))
    r = reader(client)
    assert r.read_ahead  # one data-parallel rank: on by default
    handed = []
    for n, first, delivered in [(3, 0, 6), (3, 3, 9), (2, 6, 10), (2, 8, 10)]:
        got = r.next_documents(n)
        handed += ids_of(got)
        assert firsts(got) == list(range(first, first + n))
        # The next call's read went out before this call's reply was decoded; it asked for at most n more.
        wait_pending(client, CONSUMER, delivered)
        assert r.pending_ids() == handed == ids[: len(handed)]
        assert delivered - len(handed) <= n
    assert handed == ids
    r.close()

    plain = reader(client, rank=0, size=1, read_ahead=False)
    plain.ack(ids)
    more = write_docs(client, range(20, 30))
    assert ids_of(plain.next_documents(4)) == more[:4]
    time.sleep(0.2)  # a read-ahead would have reached Redis by now
    assert pending_of(client, CONSUMER) == more[:4]


def test_read_ahead_needs_a_single_rank(client):
    assert not reader(client, 0, 2).read_ahead
    with pytest.raises(ValueError, match="read_ahead=True with dp_size=2: one rank's read-ahead can take entries"):
        reader(client, 1, 2, read_ahead=True)


def test_prefetch_at_two_ranks_asks_for_the_next_share_only(client):
    # Two ranks of 3 documents a step: each sends its next share's read once both hold their current one (the
    # trainer: after the step's first collective), so no rank ever holds more than its next step takes.
    ids = write_docs(client, range(9))
    ranks = [reader(client, rank, 2, block_ms=3000) for rank in (0, 1)]
    consumers = [KEYS.consumer(rank) for rank in (0, 1)]
    first = [r.next_documents(3) for r in ranks]
    assert [firsts(got) for got in first] == [[0, 1, 2], [3, 4, 5]]
    ranks[0].prefetch(3)
    wait_pending(client, consumers[0], 6)
    ranks[0].prefetch(3)  # held: nothing more is asked for
    ranks[1].prefetch(3)  # the stream is empty: the read waits in Redis
    time.sleep(0.2)
    assert [len(pending_of(client, c)) for c in consumers] == [6, 3]
    # Prefetched entries are not handed out: no checkpoint covers them before they are trained.
    assert [r.take_pending_ids() for r in ranks] == [ids_of(first[0]), ids_of(first[1])]
    more = write_docs(client, range(9, 12))
    deadline = time.monotonic() + 5
    while len(pending_of(client, consumers[1])) == 3:  # the waiting read is answered by the first new document(s)
        assert time.monotonic() < deadline, "the prefetch waiting in Redis took none of the new documents"
        time.sleep(0.01)
    second = [r.next_documents(3) for r in ranks]
    assert [ids_of(got) for got in second] == [ids[6:], more]
    time.sleep(0.2)
    assert [len(pending_of(client, c)) for c in consumers] == [6, 6]  # next_documents read nothing ahead
    with pytest.raises(ValueError, match="n=0: ask for at least one document"):
        ranks[0].prefetch(0)
    for r in ranks:
        r.close()


def test_lost_read_ahead_reply_is_reread_after_client_kill(client):
    small = write_docs(client, [1, 2])
    big = write(client, [encode_document(big_document(i)) for i in (3, 4)])
    r = reader(client, micro_batch_tokens=BIG_TOKENS)
    assert ids_of(r.next_documents(2)) == small
    wait_pending(client, CONSUMER, 4)  # the read-ahead delivered both big entries to this consumer...
    connection = reader_connection(client)
    assert int(connection["omem"]) > 0  # ...and part of its reply is still in Redis, never sent
    client.client_kill_filter(_id=connection["id"])

    got = r.next_documents(2)
    assert ids_of(got) == big and [int(doc.tokens[0]) for _, doc in got] == [3, 4]
    assert len(got[0][1].tokens) == BIG_TOKENS
    assert r.counters.reread_after_connection_loss == 2 and r.counters.redeliveries == 0
    assert r.pending_ids() == small + big == pending_of(client, CONSUMER)
    r.ack(r.pending_ids())
    assert pending_of(client, CONSUMER) == []
    r.close()


@pytest.mark.parametrize(("down_s", "outage_seconds"), [(0.5, None), (7.0, OUTAGE_SECONDS)],
                         ids=["a blip, counted retries", "a pod replaced, the trainer's window"])
def test_lost_read_ahead_reply_is_reread_after_a_server_restart(redis_server, down_s, outage_seconds):
    config = resolve("demo", "ns", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}), RedisConnection(host=redis_server.host, port=redis_server.port))
    client = connect(config, password=redis_server.password, outage_seconds=outage_seconds)  # retries with backoff
    small = write_docs(client, [1, 2])
    big = write(client, [encode_document(big_document(i)) for i in (3, 4)])
    r = reader(client, micro_batch_tokens=BIG_TOKENS)
    assert ids_of(r.next_documents(2)) == small
    wait_pending(client, CONSUMER, 4)
    redis_server.stop()  # the append-only file keeps the stream and the group's pending entries
    restarter = threading.Timer(down_s, redis_server.start)
    restarter.start()
    try:
        got = r.next_documents(2)
    finally:
        restarter.join()
    assert ids_of(got) == big and r.counters.reread_after_connection_loss == 2
    assert r.pending_ids() == small + big == pending_of(client, CONSUMER)
    r.close()
    client.close()


def test_killed_blocked_read_reconnects_and_reads_on(client):
    r = reader(client, read_ahead=False, block_ms=2000, data_timeout_seconds=20)
    r.start()
    result = {}
    worker = threading.Thread(target=lambda: result.update(got=r.next_documents(1)))
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while not [row for row in client.client_list() if row["cmd"] == "xreadgroup" and "b" in row["flags"]]:
            assert time.monotonic() < deadline, "the reader's XREADGROUP never blocked"
            time.sleep(0.01)
        client.client_kill_filter(_id=reader_connection(client)["id"])
        ids = write_docs(client, [7])
    finally:
        worker.join(20)
    assert ids_of(result["got"]) == ids and r.counters.reread_after_connection_loss == 0
    assert pending_of(client, CONSUMER) == ids
    r.close()


@pytest.mark.parametrize("read_ahead", [False, True])
def test_connection_kills_during_reads_lose_and_repeat_nothing(client, read_ahead):
    tokens = 2048
    valid = encode_document(Document(
        tokens=np.arange(tokens, dtype=np.int64),
        old_log_probabilities=np.full(tokens, -0.5, np.float32),
        model_version=np.zeros(tokens, np.int64),
        loss_masking_spans=[(0, 1)],
        advantage=1.0,
        reward=1.0,
    ))
    r = reader(client, micro_batch_tokens=tokens, read_ahead=read_ahead)
    killer_client = client.__class__(connection_pool=redis.ConnectionPool(**client.get_connection_kwargs()))
    rng = random.Random(0)
    failures = 0
    for _ in range(5):  # rounds of: write, read under kills, "checkpoint" (ack + trim)
        ids = write(client, [valid] * 300)  # 40 KiB each: a 40-entry reply takes a while to cross the socket
        stop = threading.Event()

        def kill_every_few_milliseconds(stop: threading.Event) -> None:
            while not stop.wait(rng.uniform(0.001, 0.01)):
                killer_client.client_kill_filter(_type="normal", skipme=True)

        killer = threading.Thread(target=kill_every_few_milliseconds, args=(stop,))
        killer.start()
        handed = []
        try:
            while len(handed) < len(ids):
                try:
                    handed += ids_of(r.next_documents(min(40, len(ids) - len(handed))))
                except redis.ConnectionError:  # retries spent: nothing is lost, the next call picks up
                    failures += 1
        finally:
            stop.set()
            killer.join()
        assert handed == ids  # every entry once, in stream order
        # Nothing pending that was not handed out, but for this round's last read-ahead (none: the stream is empty).
        assert pending_of(client, CONSUMER) == ids == r.pending_ids()
        r.ack(ids)
        r.trim_acked()
    killer_client.close()
    print(f"re-read after connection loss: {r.counters.reread_after_connection_loss}, calls failed: {failures}")
    r.close()


def test_pipelined_connection_holds_one_command_in_flight(client):
    connection = PipelinedConnection(client)
    with pytest.raises(RuntimeError, match="no command in flight"):
        connection.receive()
    connection.send("PING")
    with pytest.raises(RuntimeError, match="ECHO sent while the reply of PING is unread"):
        connection.send("ECHO", "x")
    assert connection.receive() is True  # parsed by the client's callbacks
    client.set("text", b"x")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        connection.execute("INCR", "text")
    assert connection.in_flight is None and not connection.reply_lost  # the error was the reply
    assert connection.execute("INCR", "counter") == 1
    connection.send("BLPOP", "nothing", 5)
    connection.close()  # a reply in flight is dropped with the connection
    assert connection.reply_lost and connection.in_flight is None
    assert connection.execute("ECHO", "back") == b"back"  # a fresh connection from the pool
    connection.close()
