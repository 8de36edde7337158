"""Consumer-group reader against a real Redis: competing ranks, redelivery, dead letters, ack and trim, data
timeout (DESIGN §3, §6). World-size changes: test_stream_rebalance.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api.config import RedisConnection
from rljob_wire.codec import Document, MalformedKind, encode_document
from rljob_trainer.stream.reader import DataTimeout, StreamReader

KEYS = resolve("demo", "ns", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}), RedisConnection(host="unused")).keys


def document(i: int, length: int = 4) -> Document:
    """Document number ``i``: its first token is ``i`` so a test can tell documents apart."""
    return Document(
        tokens=np.arange(i, i + length, dtype=np.int64),
        old_log_probabilities=np.full(length, -0.5, np.float32),
        model_version=np.full(length, i, np.int64),
        loss_masking_spans=[(0, 1)],
        advantage=float(i),
        reward=1.0,
    )


def write(client, messages) -> list[str]:
    return [client.xadd(KEYS.stream, m).decode() for m in messages]


def write_docs(client, numbers) -> list[str]:
    return write(client, [encode_document(document(i)) for i in numbers])


def reader(client, rank=0, size=1, **kwargs) -> StreamReader:
    kwargs.setdefault("micro_batch_tokens", 16)
    kwargs.setdefault("require_metrics_fields", True)
    kwargs.setdefault("data_timeout_seconds", 5.0)
    kwargs.setdefault("block_ms", 100)
    return StreamReader(client, KEYS, rank, size, **kwargs)


def firsts(entries) -> list[int]:
    return [int(doc.tokens[0]) for _, doc in entries]


def pending_of(client, consumer: str) -> list[str]:
    rows = client.xpending_range(KEYS.stream, KEYS.group, "-", "+", 1000, consumername=consumer)
    return [r["message_id"].decode() for r in rows]


def wait_pending(client, consumer: str, count: int, timeout: float = 5.0) -> None:
    """Wait until ``consumer`` has ``count`` pending entries (a read-ahead reaches Redis after the call returns)."""
    deadline = time.monotonic() + timeout
    while len(pending_of(client, consumer)) != count:
        assert time.monotonic() < deadline, f"{consumer}: {len(pending_of(client, consumer))} pending, expected {count}"
        time.sleep(0.01)


def test_reads_documents_in_order_and_keeps_them_pending(client):
    ids = write_docs(client, range(5))
    r = reader(client)
    got = r.next_documents(5)
    assert [i for i, _ in got] == ids and firsts(got) == [0, 1, 2, 3, 4]
    assert got[3][1].advantage == 3.0 and got[3][1].model_version.tolist() == [3, 3, 3, 3]
    assert r.pending_ids() == ids == pending_of(client, "fast_llm_consumer_0")
    assert r.counters.documents_read == 5 and r.counters.redeliveries == 0


def test_competing_ranks_get_disjoint_entries(client):
    ids = write_docs(client, range(12))
    ranks = [reader(client, 0, 2), reader(client, 1, 2)]
    seen = {0: [], 1: []}
    for _ in range(3):
        for rank, r in enumerate(ranks):
            seen[rank] += [entry_id for entry_id, _ in r.next_documents(2)]
    assert len(seen[0]) == len(seen[1]) == 6
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(ids)
    assert pending_of(client, "fast_llm_consumer_1") == seen[1]


def test_malformed_entries_are_dead_lettered_acked_and_counted(client):
    valid = encode_document(document(1))
    bad = [
        {k: v for k, v in valid.items() if k != "tokens"},  # missing_field
        dict(valid, old_log_probabilities=b"\x00" * 12),  # length_mismatch (3 values)
        dict(valid, tokens=b"\x00" * 9),  # bad_dtype_size
        dict(valid, data=b'{"advantage": 1, "reward": 1, "loss_masking_spans": [[2, 1]]}'),  # bad_span
        dict(valid, data=b'{"advantage": NaN, "reward": 1}'),  # non_finite
        dict(valid, data=b"{not json"),  # bad_json
        dict(valid, data=b'{"advantage": 1}'),  # missing_metrics_field (reward)
        {k: v for k, v in valid.items() if k != "model_version"},  # missing_metrics_field
    ]
    too_long = encode_document(document(9, length=17))
    bad_ids = write(client, bad[:4])
    good_ids = write_docs(client, [10])
    bad_ids += write(client, bad[4:] + [too_long])
    good_ids += write_docs(client, [11])

    r = reader(client)
    got = r.next_documents(2)
    assert [i for i, _ in got] == good_ids and firsts(got) == [10, 11]
    assert dict(r.counters.dead_lettered) == {
        MalformedKind.MISSING_FIELD: 1,
        MalformedKind.LENGTH_MISMATCH: 1,
        MalformedKind.BAD_DTYPE_SIZE: 1,
        MalformedKind.BAD_SPAN: 1,
        MalformedKind.NON_FINITE: 1,
        MalformedKind.BAD_JSON: 1,
        MalformedKind.MISSING_METRICS_FIELD: 2,
    }
    assert r.counters.dropped_too_long == 1 and r.counters.documents_read == 2
    # Only the valid documents stay pending; dead-lettered and dropped entries are acked.
    assert pending_of(client, "fast_llm_consumer_0") == good_ids

    letters = client.xrange(KEYS.dead_letter)
    assert [f[b"entry_id"].decode() for _, f in letters] == bad_ids[:-1]
    first = letters[0][1]
    assert first[b"kind"] == b"missing_field" and b"tokens" in first[b"reason"]
    assert first[b"original:data"] == valid["data"] and b"original:tokens" not in first
    assert letters[1][1][b"original:old_log_probabilities"] == b"\x00" * 12
    assert letters[1][1][b"reason"] == b"`old_log_probabilities` has 3 values, `tokens` has 4"


@pytest.mark.parametrize("read_ahead", [False, True])
def test_restart_rereads_own_pending_first(client, read_ahead):
    ids = write_docs(client, range(6))
    first = reader(client, read_ahead=read_ahead)
    assert firsts(first.next_documents(4)) == [0, 1, 2, 3]
    # With read-ahead the next read (up to 4 more, 2 exist) went out before the reply was decoded.
    wait_pending(client, "fast_llm_consumer_0", 6 if read_ahead else 4)
    del first  # crash before any checkpoint: nothing acked

    again = reader(client)
    got = again.next_documents(6)
    assert [i for i, _ in got] == ids
    # Read-ahead entries are re-read with the own pending entries, so they count as redeliveries too.
    assert again.counters.redeliveries == (6 if read_ahead else 4) and again.counters.documents_read == 6
    assert again.pending_ids() == ids


def test_restart_acks_ids_the_resumed_checkpoint_covers(client):
    ids = write_docs(client, range(5))
    first = reader(client)
    first.next_documents(5)
    committed = first.pending_ids()[:3]  # checkpoint durable, crash before XACK

    again = reader(client)
    again.start(committed_ids=committed)
    got = again.next_documents(2)
    assert [i for i, _ in got] == ids[3:] and again.counters.redeliveries == 2
    assert pending_of(client, "fast_llm_consumer_0") == ids[3:]


def test_pending_entry_deleted_from_the_stream_is_acked_not_fatal(client):
    ids = write_docs(client, range(3))
    reader(client).next_documents(3)
    client.xdel(KEYS.stream, ids[1])
    again = reader(client)
    got = again.next_documents(2)
    assert [i for i, _ in got] == [ids[0], ids[2]]
    assert again.counters.lost_pending == 1 and again.counters.redeliveries == 2
    assert pending_of(client, "fast_llm_consumer_0") == [ids[0], ids[2]]


def test_trim_removes_only_acked_entries(client):
    ids = write_docs(client, range(8))
    r = reader(client)
    r.next_documents(6)
    assert r.trim_acked() == 0  # nothing acked yet
    assert r.ack([ids[0], ids[1], ids[4]]) == 3
    assert r.pending_ids() == [ids[2], ids[3], ids[5]]
    assert r.trim_acked() == 2  # ids[4] is acked but ids[2] below it is pending
    assert [i.decode() for i, _ in client.xrange(KEYS.stream)] == ids[2:]
    r.ack(r.pending_ids())
    assert r.trim_acked() == 4  # everything delivered; ids[6:] were never delivered and stay
    assert [i.decode() for i, _ in client.xrange(KEYS.stream)] == ids[6:]
    assert r.ack([ids[0]]) == 0  # acking twice is harmless
    assert firsts(r.next_documents(2)) == [6, 7]


def test_a_data_timeout_says_what_the_reader_refused_and_where_the_reasons_are(client):
    no_metrics = [{k: v for k, v in encode_document(document(i)).items() if k != "model_version"} for i in (1, 2)]
    write(client, [*no_metrics, encode_document(document(3, length=20))])  # the third is over microBatchTokens
    with pytest.raises(DataTimeout) as raised:
        reader(client, data_timeout_seconds=0.6).next_documents(1)
    assert str(raised.value) == (
        "fast_llm_consumer_0: no valid document on stream 'fast_llm_streaming' for 0.6 s (have 0 of 1); refused 3 "
        "entries: missing_metrics_field ×2 dead-lettered to 'rljob:ns:demo:dead_letter' (each with its reason); "
        "too_long ×1 dropped (longer than 16 tokens)")
    kinds = [fields[b"kind"] for _, fields in client.xrange(KEYS.dead_letter)]
    assert kinds == [b"missing_metrics_field"] * 2


def test_data_timeout_keeps_what_was_gathered(client):
    ids = write_docs(client, [1, 2])
    r = reader(client, data_timeout_seconds=0.6)
    start = time.monotonic()
    with pytest.raises(DataTimeout, match=r"fast_llm_consumer_0: no valid document .* 0.6 s \(have 2 of 3\)"):
        r.next_documents(3)
    assert 0.5 <= time.monotonic() - start < 3
    assert r.pending_ids() == [] and r.counters.documents_read == 0  # gathered, not handed out
    assert firsts(r.next_documents(1)) == [1]
    write_docs(client, [3])
    assert firsts(r.next_documents(2)) == [2, 3]
    assert r.pending_ids()[:2] == ids and r.counters.documents_read == 3


@pytest.mark.parametrize("read_ahead", [False, True])
def test_redis_error_while_dead_lettering_forgets_nothing(client, read_ahead):
    valid = encode_document(document(1))
    ids = write(client, [valid, dict(valid, data=b"{bad"), encode_document(document(2))])
    client.set(KEYS.dead_letter, b"not a stream")  # XADD to it fails with WRONGTYPE
    r = reader(client, read_ahead=read_ahead)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.next_documents(2)
    # Read 2 (the bad one not acked); with read-ahead the third went out before the two were decoded.
    wait_pending(client, "fast_llm_consumer_0", 3 if read_ahead else 2)
    assert pending_of(client, "fast_llm_consumer_0") == (ids if read_ahead else ids[:2])
    client.delete(KEYS.dead_letter)
    got = r.next_documents(2)
    assert [i for i, _ in got] == [ids[0], ids[2]]
    assert [f[b"entry_id"].decode() for _, f in client.xrange(KEYS.dead_letter)] == [ids[1]]
    assert pending_of(client, "fast_llm_consumer_0") == [ids[0], ids[2]]


def test_empty_stream_times_out_and_rejects_bad_arguments(client):
    with pytest.raises(DataTimeout):
        reader(client, data_timeout_seconds=0.3).next_documents(1)
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside \[0, dp_size=2\)"):
        reader(client, 2, 2)
    with pytest.raises(ValueError, match="decode_responses"):
        StreamReader(
            client.__class__(decode_responses=True),
            KEYS,
            0,
            1,
            micro_batch_tokens=8,
            require_metrics_fields=False,
            data_timeout_seconds=1,
        )
