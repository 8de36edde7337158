"""The document writer: wire format of rollout documents, back-pressure, max lag and the rollout hash."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from rollout_harness import make_config
from rljob_api import constants as c
from rljob_trainer.rollout.writer import BatchReport, DocumentWriter, make_document, rollout_rewards
from rljob_trainer.stream.codec import decode_entry


def _docs(n: int, version: int = 0):
    return [make_document([1, 5, 6, 3], [7, 8], [-0.5, -1.25], reward=0.5, advantage=1.5, model_version=version) for _ in range(n)]


def test_documents_decode_as_the_trainer_reads_them(redis_server):
    config = make_config(redis_server)
    client = redis_server.client()
    DocumentWriter(client, config, 0).write(_docs(1, version=42))
    [(_id, fields)] = client.xrange(config.keys.stream)
    doc = decode_entry(fields, require_metrics_fields=True, max_tokens=64)
    assert doc.tokens.tolist() == [1, 5, 6, 3, 7, 8]
    assert doc.old_log_probabilities.tolist() == [0, 0, 0, 0, -0.5, -1.25]
    assert doc.model_version.tolist() == [42] * 6
    assert doc.loss_masking_spans == [(0, 4)]
    assert doc.label_mask().tolist() == [False] * 4 + [True, True]
    assert (doc.advantage, doc.reward) == (1.5, 0.5)
    assert client.hget(config.keys.rollout, "documents_written") == b"1"


def test_backpressure_counts_undelivered_and_unacked_entries(redis_server):
    config = make_config(redis_server, rollout={"maxLag": 100_000}, redis={"maxPending": 8})
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    assert writer.wait_reason() is None and writer.backlog() == 0  # no stream yet
    writer.write(_docs(8))
    assert writer.backlog() == 8  # no group yet: the stream length
    assert "maxPending" in writer.wait_reason()
    client.xgroup_create(config.keys.stream, config.keys.group, id="0")
    delivered = client.xreadgroup(config.keys.group, "fast_llm_consumer_0", {config.keys.stream: ">"}, count=4)
    ids = [entry_id for entry_id, _ in delivered[0][1]]
    assert writer.backlog() == 8  # 4 undelivered (lag) + 4 pending
    assert writer.wait_reason() is not None
    client.xack(config.keys.stream, config.keys.group, *ids)
    assert writer.backlog() == 4 and writer.wait_reason() is None  # acked entries no longer count (never trimmed)
    assert client.xlen(config.keys.stream) == 8


def test_max_lag_compares_documents_written_with_the_trainers_documents_seen(redis_server):
    config = make_config(redis_server, rollout={"maxLag": 20}, trainer={"batch": {"documentsPerStep": 16}},
                         redis={"maxPending": 100_000})
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    assert writer.max_ahead == 20
    writer.write(_docs(20))
    assert "ahead of the trainer" in writer.wait_reason()
    client.hset(config.keys.progress, c.PROGRESS_DOCUMENTS_SEEN, 5)
    assert writer.ahead(writer.backlog()) == 15 and writer.wait_reason() is None
    # documents the trainer dropped (acked, never seen) cannot stall the workers: ahead is capped by the backlog
    client.xgroup_create(config.keys.stream, config.keys.group, id="$")
    assert writer.backlog() == 0 and writer.ahead(0) == 0
    # a maxLag below one step is raised to documentsPerStep, so the trainer can always fill a step
    small = make_config(redis_server, rollout={"maxLag": 0}, trainer={"batch": {"documentsPerStep": 16}})
    assert DocumentWriter(client, small, 0).max_ahead == 16


def test_rollout_hash_sums_rewards_per_version_over_workers_and_reports_all_failed(redis_server):
    config = make_config(redis_server)
    client = redis_server.client()
    key = config.keys.rollout
    a, b = DocumentWriter(client, config, 0), DocumentWriter(client, config, 1)
    a.report(BatchReport(0, [0.0, 1.0], 3, Counter(ValueError=1), 0, 0, 0.5))
    b.report(BatchReport(0, [0.5], 1, Counter(), 1, 4, 0.5))
    b.report(BatchReport(16, [1.0, 1.0], 2, Counter(), 0, 0, 0.1))
    assert rollout_rewards(client, key) == {0: (0.5, 3), 16: (1.0, 2)}
    stored = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
    assert (float(stored[c.ROLLOUT_REWARD]), stored[c.ROLLOUT_REWARD_VERSION]) == (1.0, "16")
    assert stored["samples_generated"] == "6"
    assert (stored[f"{c.ROLLOUT_REWARD_ERRORS_PREFIX}ValueError"], stored["reward_errors"]) == ("1", "1")
    assert (stored["groups_filtered"], stored["samples_filtered"]) == ("1", "4")
    assert json.loads(stored["worker:1"])["samples_per_second"] == 20.0
    assert c.ROLLOUT_ALL_REWARDS_FAILED not in stored

    a.report(BatchReport(16, [], 4, Counter(KeyError=4), 0, 0, 0.1))
    failed = json.loads(client.hget(key, c.ROLLOUT_ALL_REWARDS_FAILED))
    assert failed["errors"] == {"KeyError": 4} and failed["samples"] == 4 and "KeyError" in failed["message"]
    assert rollout_rewards(client, key)[16] == (1.0, 2)  # a failed batch adds no reward sample
    a.report(BatchReport(16, [0.0], 1, Counter(), 0, 0, 0.1))
    assert client.hget(key, c.ROLLOUT_ALL_REWARDS_FAILED) is None
    np.testing.assert_allclose(rollout_rewards(client, key)[16][0], 2 / 3)
