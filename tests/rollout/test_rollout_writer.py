"""The document writer: wire format of rollout documents, back-pressure, max lag (also across a trainer restart,
with the real stream reader as the trainer) and the rollout hash."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from rollout_harness import make_config
from rljob_api import protocol
from rljob_rollout.writer import BatchReport, DocumentWriter, StreamBacklog, make_document
from rollout_harness import rollout_rewards
from rljob_wire.codec import decode_entry
from rljob_trainer.stream.reader import DataTimeout, StreamReader
from rljob_trainer.progress_report import publish_checkpointed, publish_start


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


def test_a_lag_larger_than_the_stream_holds_no_worker_back(redis_server):
    """Redis reports a lag larger than the stream after a restart that reloads it from the append-only file, and after
    deletions (redis/redis#13338): the chaos soak saw lag 60416 with 2048 entries in the stream, all of them pending,
    and every worker waited at maxPending for good. Undelivered and pending entries are never trimmed, so the stream's
    length less the pending entries caps the undelivered ones. The lag is set here from outside (XGROUP SETID ...
    ENTRIESREAD)."""
    config = make_config(redis_server, rollout={"maxLag": 100_000}, redis={"maxPending": 8})
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    writer.write(_docs(12))
    client.xgroup_create(config.keys.stream, config.keys.group, id="0")
    delivered = client.xreadgroup(config.keys.group, "fast_llm_consumer_0", {config.keys.stream: ">"}, count=10)
    ids = [entry_id for entry_id, _ in delivered[0][1]]
    client.xack(config.keys.stream, config.keys.group, *ids[:7])
    client.xdel(config.keys.stream, *ids[:7])  # as the trainer trims acked entries: 3 pending and 2 undelivered left
    client.execute_command("XGROUP", "SETID", config.keys.stream, config.keys.group, ids[-1], "ENTRIESREAD", 1)
    (group,) = client.xinfo_groups(config.keys.stream)
    assert (group["lag"], group["pending"], client.xlen(config.keys.stream)) == (11, 3, 5)  # what Redis says
    assert writer.snapshot().undelivered == 2 and writer.backlog() == 5 and writer.wait_reason() is None
    groups = client.xinfo_groups(config.keys.stream)
    assert protocol.Backlog.from_groups(groups, config.keys.group) == protocol.Backlog(pending=3, undelivered=11)
    assert protocol.Backlog.from_groups(groups, config.keys.group, length=5) == protocol.Backlog(3, 2)
    unknown = [{**groups[0], "lag": None}]
    assert protocol.Backlog.from_groups(unknown, config.keys.group, length=5) == protocol.Backlog(3, 2)
    assert protocol.Backlog.from_groups(unknown, config.keys.group) == protocol.Backlog(3, None)


def _reader(client, config):
    """The trainer side: data-parallel rank 0 of 1 reading the job's stream (a real consumer-group consumer)."""
    return StreamReader(client, config.keys, 0, 1, micro_batch_tokens=64, require_metrics_fields=True,
                        data_timeout_seconds=5, read_ahead=False)


def _train_step(client, config, reader, documents_seen, n):
    """One trainer step as the rollout sees it: ``n`` documents handed out, then the progress hash's documents_seen."""
    assert len(reader.next_documents(n)) == n
    client.hset(config.keys.progress, protocol.PROGRESS_DOCUMENTS_SEEN, documents_seen + n)
    return documents_seen + n


def test_max_lag_counts_documents_not_yet_trained_and_not_those_waiting_for_a_checkpoint(redis_server):
    config = make_config(redis_server, rollout={"maxLag": 8}, trainer={"batch": {"documentsPerStep": 4}},
                         redis={"maxPending": 100_000})
    client = redis_server.client()
    writers = [DocumentWriter(client, config, 0), DocumentWriter(client, config, 1)]  # two rollout workers
    assert writers[0].max_ahead == 8
    writers[0].write(_docs(4))
    writers[1].write(_docs(4))
    for writer in writers:  # no group and no progress yet: every written document is ahead
        assert writer.snapshot() == StreamBacklog(undelivered=8, pending=0, trained_unacked=0)
        assert "8 documents ahead of the trainer" in writer.wait_reason()

    publish_start(client, config, 0, 0, None)  # the trainer starts from scratch
    reader = _reader(client, config)
    reader.start()
    seen = _train_step(client, config, reader, 0, 4)
    assert writers[0].snapshot() == StreamBacklog(undelivered=4, pending=4, trained_unacked=4)
    assert writers[1].ahead() == 4 and writers[1].wait_reason() is None
    seen = _train_step(client, config, reader, seen, 4)
    writers[1].write(_docs(8))  # the trained, unacked documents do not hold the workers back
    assert writers[0].snapshot() == StreamBacklog(undelivered=8, pending=8, trained_unacked=8)
    assert "8 documents ahead" in writers[0].wait_reason()
    # documents_written is a statistic: documents the trainer dropped (acked, never seen) cannot stall the workers
    client.hincrby(config.keys.rollout, "documents_written", 1000)
    assert writers[0].ahead() == 8

    # A checkpoint: documents_seen published before the acks (briefly too many ahead, never too few), then the acks.
    publish_checkpointed(client, config, seen)
    assert writers[0].snapshot() == StreamBacklog(undelivered=8, pending=8, trained_unacked=0)
    reader.ack(reader.pending_ids())
    assert writers[0].snapshot() == StreamBacklog(undelivered=8, pending=0, trained_unacked=0)
    _train_step(client, config, reader, seen, 4)
    assert writers[0].ahead() == 4 and writers[0].wait_reason() is None
    # a maxLag below one step is raised to documentsPerStep, so the trainer can always fill a step
    small = make_config(redis_server, rollout={"maxLag": 0}, trainer={"batch": {"documentsPerStep": 16}})
    assert DocumentWriter(client, small, 0).max_ahead == 16


@pytest.mark.parametrize(("restored", "old_rule_ahead"), [(0, 12), (20, 0)], ids=["from-scratch", "from-step-5"])
def test_a_trainer_restart_does_not_stall_the_rollout(redis_server, restored, old_rule_ahead):
    """The stall of a restart (B1): the old attempt wrote 32 documents, checkpointed 20 (acked) and trained 12 more
    (pending); the new attempt (from scratch, the checkpoint lost, or from the step-5 checkpoint) re-reads and trains
    the 12, then needs new documents while nothing is undelivered and only a checkpoint acks the 12."""
    config = make_config(redis_server, rollout={"maxLag": 4},
                         trainer={"batch": {"documentsPerStep": 4}, "checkpoint": {"everySteps": 5}},
                         redis={"maxPending": 20})
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    old = _reader(client, config)
    old.start()
    seen = 0
    for _ in range(8):  # attempt 0: 8 steps, a checkpoint at step 5
        writer.write(_docs(4))
        seen = _train_step(client, config, old, seen, 4)
        if seen == 20:
            publish_checkpointed(client, config, seen)
            old.ack(old.pending_ids())
    old.close()
    assert writer.snapshot() == StreamBacklog(undelivered=0, pending=12, trained_unacked=12)

    publish_start(client, config, restored // 4, restored, None)  # attempt 1
    new = _reader(client, config)
    new.start()
    assert new.counters.redeliveries == 12
    assert writer.ahead() == 12  # the redelivered documents are ahead of the restarted trainer
    seen = restored
    for _ in range(3):
        assert writer.wait_reason() is not None
        seen = _train_step(client, config, new, seen, 4)
    # The trainer waits for a 4th step. The old rule, min(documents_written - documents_seen, undelivered + pending),
    # said 12 documents ahead from scratch (>= max(maxLag, documentsPerStep) = 4: the stall, for good, as only a
    # checkpoint acks the 12), 0 from the step-5 checkpoint.
    written = int(client.hget(config.keys.rollout, "documents_written"))
    assert min(written - seen, writer.backlog()) == old_rule_ahead
    assert writer.snapshot() == StreamBacklog(undelivered=0, pending=12, trained_unacked=12)
    assert writer.ahead() == 0 and writer.wait_reason() is None
    writer.write(_docs(4))
    assert "4 documents ahead" in writer.wait_reason()  # the bound still holds
    _train_step(client, config, new, seen, 4)
    assert writer.wait_reason() is None


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
    assert (float(stored[protocol.ROLLOUT_REWARD]), stored[protocol.ROLLOUT_REWARD_VERSION]) == (1.0, "16")
    assert stored["samples_generated"] == "6"
    assert (stored[f"{protocol.ROLLOUT_REWARD_ERRORS_PREFIX}ValueError"], stored["reward_errors"]) == ("1", "1")
    assert (stored["groups_filtered"], stored["samples_filtered"]) == ("1", "4")
    assert json.loads(stored["worker:1"])["samples_per_second"] == 20.0
    assert protocol.ROLLOUT_ALL_REWARDS_FAILED not in stored

    a.report(BatchReport(16, [], 4, Counter(KeyError=4), 0, 0, 0.1))
    failed = json.loads(client.hget(key, protocol.ROLLOUT_ALL_REWARDS_FAILED))
    assert failed["errors"] == {"KeyError": 4} and failed["samples"] == 4 and "KeyError" in failed["message"]
    assert rollout_rewards(client, key)[16] == (1.0, 2)  # a failed batch adds no reward sample
    a.report(BatchReport(16, [0.0], 1, Counter(), 0, 0, 0.1))
    assert client.hget(key, protocol.ROLLOUT_ALL_REWARDS_FAILED) is None
    np.testing.assert_allclose(rollout_rewards(client, key)[16][0], 2 / 3)


def test_batches_that_all_fail_extend_one_streak_over_workers_on_the_redis_clock(redis_server):
    """Every worker's failing batch extends the same record in the transaction that adds it (Redis TIME, failures by
    class and message); a stale record is continued only by a worker that kept failing itself; a scored batch from
    any worker ends the streak."""
    from dataclasses import replace

    config = make_config(redis_server)
    client = redis_server.client()
    key, field = config.keys.rollout, protocol.ROLLOUT_ALL_REWARDS_FAILED
    zero, missing = "ZeroDivisionError: division by zero", "KeyError: 'x'"

    def redis_now() -> float:
        seconds, microseconds = client.time()
        return seconds + microseconds / 1e6

    def record() -> protocol.RewardFailures:
        return protocol.RewardFailures.from_field(client.hget(key, field))

    a, b, c = (DocumentWriter(client, config, i) for i in range(3))
    before = redis_now()
    a.report(BatchReport(0, [], 4, Counter({zero: 4}), 0, 0, 0.1))
    b.report(BatchReport(16, [], 4, Counter({zero: 3, missing: 1}), 0, 0, 0.1))
    streak = record()
    assert (streak.batches, streak.samples, streak.errors, streak.other_errors) == (2, 8, {zero: 7, missing: 1}, 0)
    assert (streak.version, streak.last_samples, streak.last_errors) == (16, 4, {"ZeroDivisionError": 3, "KeyError": 1})
    assert before <= streak.since <= streak.updated_at <= redis_now()
    stored = client.hgetall(key)
    assert (stored[b"reward_errors:ZeroDivisionError"], stored[b"reward_errors:KeyError"], stored[b"reward_errors"]) == (
        b"7", b"1", b"8")  # the counters stay per class

    # The last failing batch 400 s ago (say the job was suspended): a worker that was not failing starts over ...
    now = redis_now()
    stale = replace(streak, since=now - 1000, updated_at=now - protocol.REWARD_FAILURE_GAP_S - 100)
    client.hset(key, field, stale.to_field())
    c.report(BatchReport(16, [], 4, Counter({zero: 4}), 0, 0, 0.1))
    assert record().since >= now and (record().batches, record().samples) == (1, 4)
    # ... one whose own last batch failed too goes on with it.
    client.hset(key, field, stale.to_field())
    b.report(BatchReport(16, [], 4, Counter({zero: 4}), 0, 0, 0.1))
    assert (record().since, record().batches, record().samples) == (now - 1000, 3, 12)

    c.report(BatchReport(16, [0.5], 4, Counter({zero: 3}), 0, 0, 0.1))  # one sample scored
    assert client.hget(key, field) is None
    b.report(BatchReport(16, [], 4, Counter({zero: 4}), 0, 0, 0.1))  # b failed throughout, but the streak ended
    assert record().batches == 1 and record().since >= now


def test_stale_drops_waiting_for_a_checkpoint_hold_back_no_worker(redis_server):
    """algorithm.maxStaleness: the trainer drops stale documents but only its next checkpoint acks them, and it cannot
    reach that checkpoint before fresh documents refill its step. Pending drops must therefore count neither as ahead
    (max lag) nor in the backlog (maxPending), or the rollout would wait for the trainer and the trainer for it."""
    config = make_config(redis_server, rollout={"maxLag": 0}, trainer={"batch": {"documentsPerStep": 4}},
                         redis={"maxPending": 8}, algorithm={"maxStaleness": 2})
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    publish_start(client, config, 2, 8, None)  # the trainer is at documents_seen 8
    writer.write(_docs(4, version=0))  # sampled 8 documents ago
    assert "4 documents ahead" in writer.wait_reason()
    reader = StreamReader(client, config.keys, 0, 1, micro_batch_tokens=64, require_metrics_fields=True,
                          data_timeout_seconds=0.5, read_ahead=False, max_staleness=2)
    with pytest.raises(DataTimeout):  # all 4 stale: the step waits for fresh documents
        reader.next_documents(4, documents_seen=8)
    assert writer.snapshot() == StreamBacklog(undelivered=0, pending=4, trained_unacked=0, dropped_unacked=4)
    assert writer.ahead() == 0 and writer.backlog() == 0 and writer.wait_reason() is None
    writer.write(_docs(4, version=8))
    assert "4 documents ahead of the trainer (4 undelivered + 4 pending - 0 trained - 4 dropped as stale" in (
        writer.wait_reason())
    assert writer.backlog() == 4  # 8 entries unacked, 4 of them drops: below maxPending 8
    assert len(reader.next_documents(4, documents_seen=8)) == 4  # the step fills
    client.hset(config.keys.progress, protocol.PROGRESS_DOCUMENTS_SEEN, 12)
    assert writer.snapshot() == StreamBacklog(undelivered=0, pending=8, trained_unacked=4, dropped_unacked=4)
    # the checkpoint covers the trained and the dropped documents: published, then acked
    publish_checkpointed(client, config, 12, dropped_stale=4)
    assert writer.snapshot() == StreamBacklog(undelivered=0, pending=8, trained_unacked=0, dropped_unacked=0)
    reader.ack(reader.take_pending_ids())
    assert writer.snapshot() == StreamBacklog(undelivered=0, pending=0, trained_unacked=0, dropped_unacked=0)


def test_a_batch_of_a_timeline_the_trainer_abandoned_is_dropped_and_counted(redis_server):
    """Issue 11 item 4: the trainer trained to version 640, the worker loaded it and generated a batch; meanwhile the
    gang restarted from the checkpoint at 384 (publish_start sets model_version back). The batch is not written:
    counted as documents_abandoned. Once the worker holds the resumed weights (version <= 384) its batches go in."""
    config = make_config(redis_server)
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    assert writer.write(_docs(2, version=5)) == 2  # no trainer yet: nothing to compare with
    client.hset(config.keys.progress, protocol.PROGRESS_MODEL_VERSION, 640)
    assert writer.write(_docs(3, version=640), [640] * 3) == 3
    publish_start(client, config, 6, 384, None)  # the new attempt resumes from an older checkpoint
    assert writer.write(_docs(4, version=640), [640] * 4) == 0
    assert client.xlen(config.keys.stream) == 5
    rollout = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.rollout).items()}
    assert (rollout["documents_written"], rollout["documents_abandoned"]) == ("5", "4")
    assert writer.write(_docs(2, version=384), [384] * 2) == 2 and client.xlen(config.keys.stream) == 7
    # a set finished across the restart: only the documents with a token of the abandoned timeline are dropped
    assert writer.write(_docs(3, version=384), [384, 640, 384]) == 2 and client.xlen(config.keys.stream) == 9
    with pytest.raises(ValueError, match="2 versions for 3 documents"):
        writer.write(_docs(3, version=384), [384, 384])


def test_per_token_versions_reach_the_stream_and_rewards_count_under_a_samples_newest_version(redis_server):
    """A sample that spanned an in-flight weight update (DESIGN §3): each token carries the version that sampled it,
    the prompt the first completion token's, and its reward counts under its newest version."""
    config = make_config(redis_server)
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    spanning = make_document([1, 5, 3], [7, 8, 9], [-0.5, -1.0, -2.0], reward=1.0, advantage=0.5,
                             model_version=[16, 16, 32])
    assert spanning.model_version.tolist() == [16, 16, 16, 16, 16, 32]
    with pytest.raises(ValueError, match="2 versions for 3 completion tokens"):
        make_document([1, 5, 3], [7, 8, 9], [-0.5, -1.0, -2.0], reward=1.0, advantage=0.5, model_version=[16, 32])
    writer.write([spanning], [32])
    [(_id, fields)] = client.xrange(config.keys.stream)
    assert decode_entry(fields, require_metrics_fields=True, max_tokens=64).model_version.tolist() == [16] * 5 + [32]

    writer.report(BatchReport(32, [1.0, 0.0, 0.5], 3, Counter(), 0, 0, 0.1, reward_versions=[32, 16, 16]))
    assert rollout_rewards(client, config.keys.rollout) == {16: (0.25, 2), 32: (1.0, 1)}
    stored = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.rollout).items()}
    assert (float(stored[protocol.ROLLOUT_REWARD]), stored[protocol.ROLLOUT_REWARD_VERSION]) == (1.0, "32")


def test_samples_in_flight_count_as_written_for_back_pressure_and_max_lag(redis_server):
    config = make_config(redis_server, rollout={"maxLag": 8}, trainer={"batch": {"documentsPerStep": 4}},
                         redis={"maxPending": 12})
    client = redis_server.client()
    writer = DocumentWriter(client, config, 0)
    writer.write(_docs(4))
    state = writer.snapshot()
    assert writer.wait_reason(state, in_flight=3) is None and writer.room(state, in_flight=3) == 1
    assert writer.wait_reason(state, in_flight=4) == (
        "4 documents ahead of the trainer (4 undelivered + 0 pending - 0 trained and waiting for a checkpoint) + 4 in "
        "flight >= max(maxLag, documentsPerStep) = 8")
    assert writer.room(state, in_flight=6) == 0
    publish_start(client, config, 0, 0, None)
    reader = _reader(client, config)
    reader.start()
    _train_step(client, config, reader, 0, 4)  # the 4 documents trained, waiting for a checkpoint
    writer.write(_docs(6))
    state = writer.snapshot()
    assert (state.backlog, state.ahead, writer.room(state)) == (10, 6, 2)
    assert writer.wait_reason(state, in_flight=2).startswith(
        "backlog 10 (6 undelivered + 4 pending) + 2 in flight >= spec.redis.maxPending 12")


def test_reports_merge_counts_and_keep_each_reward_with_its_version():
    a = BatchReport(16, [], 8, Counter({"KeyError: 'x'": 8}), 0, 0, 0.5)
    b = BatchReport(32, [1.0, 0.0], 8, Counter({"KeyError: 'x'": 2}), 1, 4, 0.25, reward_versions=[32, 16])
    merged = a.merged(b)
    assert (merged.version, merged.samples_generated, merged.seconds) == (32, 16, 0.75)
    assert merged.reward_errors == Counter({"KeyError: 'x'": 10})
    assert (merged.groups_filtered, merged.samples_filtered) == (1, 4)
    assert merged.rewards_by_version() == {32: [1.0], 16: [0.0]}
    assert BatchReport(8, [0.5], 2, Counter(), 0, 0, 0.1).merged(a).rewards_by_version() == {16: [], 8: [0.5]}
