"""``algorithm.maxStaleness`` in the stream reader, against a real Redis: documents staler than the bound are dropped
before the loss, counted (per reader and in the progress hash), kept pending with the ids the next checkpoint covers,
and replaced by reading on, so every rank gets exactly its documents (DESIGN §4, §6)."""

from __future__ import annotations

import numpy as np
import pytest

from rljob_api import protocol
from rljob_wire.codec import Document, MalformedKind, encode_document
from rljob_trainer.stream.reader import DataTimeout, document_staleness
from test_stream_reader import KEYS, document, firsts, pending_of, reader, write, write_docs


def test_staleness_is_documents_seen_minus_the_oldest_version_of_a_labelled_token():
    doc = Document(tokens=np.arange(5, dtype=np.int64), old_log_probabilities=np.zeros(5, np.float32),
                   model_version=np.array([0, 9, 5, 3, 7], np.int64), loss_masking_spans=[(0, 2)])
    # labels: position 0 (no prediction) and the span [0, 2) masked: versions 5, 3, 7 -> oldest 3
    assert document_staleness(doc, 10) == 7
    assert document_staleness(doc, 2**62 + 3) == 2**62  # an int64 difference, exact
    all_masked = Document(tokens=np.arange(3, dtype=np.int64), old_log_probabilities=np.zeros(3, np.float32),
                          model_version=np.zeros(3, np.int64), loss_masking_spans=[(0, 3)])
    assert document_staleness(all_masked, 100) is None  # no labelled token: never dropped
    assert document_staleness(Document(tokens=doc.tokens, old_log_probabilities=doc.old_log_probabilities), 1) is None


def test_stale_documents_are_dropped_counted_refilled_and_left_for_the_next_checkpoint(client):
    ids = write_docs(client, range(10))  # document i: every token of version i
    r = reader(client, max_staleness=3)
    got = r.next_documents(4, documents_seen=6)  # staleness 6 - i > 3 for i < 3
    assert firsts(got) == [3, 4, 5, 6]
    assert r.counters.dropped_stale == 3 and r.counters.documents_read == 4
    assert int(client.hget(KEYS.progress, protocol.PROGRESS_DROPPED_STALE)) == 3
    # not acked: pending in Redis, and among the ids the next checkpoint covers (and then acks)
    assert sorted(r.pending_ids()) == sorted(ids[:7]) and set(ids[:7]) <= set(pending_of(client, "fast_llm_consumer_0"))
    assert r.ack(r.take_pending_ids()) == 7
    assert not set(ids[:7]) & set(pending_of(client, "fast_llm_consumer_0"))  # read-ahead ones may be pending
    # read ahead at documents_seen 6, document 7 is 4 behind at 11: dropped when the next step would take it
    assert firsts(r.next_documents(1, documents_seen=11)) == [8] and r.counters.dropped_stale == 4
    assert int(client.hget(KEYS.progress, protocol.PROGRESS_DROPPED_STALE)) == 4


def test_every_rank_refills_to_its_share(client):
    write_docs(client, [0, 0, 0, 0, 8, 8, 8, 8])
    ranks = [reader(client, rank, 2, max_staleness=2) for rank in range(2)]
    got = [r.next_documents(2, documents_seen=8) for r in ranks]
    assert [firsts(g) for g in got] == [[8, 8], [8, 8]]  # no rank is left with an empty step
    assert sum(r.counters.dropped_stale for r in ranks) == 4
    assert int(client.hget(KEYS.progress, protocol.PROGRESS_DROPPED_STALE)) == 4


def test_documents_read_ahead_are_judged_at_the_step_that_takes_them(client):
    write_docs(client, range(2, 10))
    r = reader(client, max_staleness=3)  # one rank: read-ahead on
    assert r.read_ahead and firsts(r.next_documents(2, documents_seen=4)) == [2, 3]
    # documents 4 and 5 were fresh at documents_seen 4; at 8, document 4 is 4 behind: dropped, 6 takes its place
    assert firsts(r.next_documents(2, documents_seen=8)) == [5, 6] and r.counters.dropped_stale == 1


def test_without_model_version_an_entry_is_dead_lettered(client):
    unversioned = Document(tokens=np.arange(4, dtype=np.int64), old_log_probabilities=np.zeros(4, np.float32),
                           loss_masking_spans=[(0, 1)], advantage=1.0)
    write(client, [encode_document(unversioned)])
    write_docs(client, [5])
    r = reader(client, require_metrics_fields=False, max_staleness=3)
    assert firsts(r.next_documents(1, documents_seen=5)) == [5]
    assert r.counters.dead_lettered == {MalformedKind.MISSING_FIELD: 1}
    (_, record), = client.xrange(KEYS.dead_letter)
    assert record[b"reason"] == b"no `model_version` field while algorithm.maxStaleness is set"


def test_stale_documents_do_not_reset_the_data_timeout(client):
    write_docs(client, [0, 1])
    r = reader(client, max_staleness=0, data_timeout_seconds=0.5)
    with pytest.raises(DataTimeout, match="no valid document"):
        r.next_documents(1, documents_seen=10)
    assert r.counters.dropped_stale == 2


def test_arguments_are_checked(client):
    with pytest.raises(ValueError, match="max_staleness must be >= 0 documents, got -1"):
        reader(client, max_staleness=-1)
    with pytest.raises(ValueError, match="max_staleness=3: next_documents needs documents_seen"):
        reader(client, max_staleness=3).next_documents(1)
    write_docs(client, [0])
    assert firsts(reader(client).next_documents(1)) == [0]  # without the bound nothing changes
