"""Progress hashes: parsing (tolerant of bad fields) and fetching from a real Redis with a password."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest
import redis

from rljob_api import protocol
from rljob_api.config import RedisConnection
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.status import CheckpointStatus, RLTrainingJobStatus

from rljob_operator import gang, job_status, render
from rljob_operator.redis_io.clients import connect, tls_failure
from rljob_operator.redis_io import reads as redis_reads
from rljob_operator.redis_io.reads import fetch

from operator_helpers import T0, make_job, rollout, trainer


def test_parse_reads_trainer_fields_and_the_newest_rollout_version():
    parsed = protocol.parse_progress(
        {b"step": b"7", b"documents_seen": b"448", b"model_version": b"448", b"tokens_per_second": b"812.5",
         b"metrics": json.dumps({"train_samples_reward": 0.25, "staleness": 64, "bad": "x", "nan": float("nan")}).encode(),
         b"updated_at": b"1700000000.0"},
        {"reward_sum:384": "12.0", "reward_count:384": "16", "reward_sum:448": "3.0", "reward_count:448": "4",
         "reward_count:512": "0", "reward_sum:512": "0", "samples_generated": "120"},
    )
    assert (parsed.step, parsed.documents_seen, parsed.model_version) == (7, 448, 448)
    assert parsed.tokens_per_second == 812.5
    assert parsed.metrics == {"train_samples_reward": 0.25, "staleness": 64.0}
    assert (parsed.rollout_reward, parsed.rollout_model_version) == (0.75, 448)


def test_reward_and_throughput_are_rounded_for_the_printer_columns():
    parsed = protocol.parse_progress({"tokens_per_second": "812.4567"}, {"reward_sum:64": "2.0", "reward_count:64": "3"})
    assert (parsed.rollout_reward, parsed.tokens_per_second) == (0.6667, 812.5)


def test_a_reward_above_the_trainers_version_is_an_abandoned_timeline():
    rollout = {"reward_sum:64": "1.0", "reward_count:64": "4", "reward_sum:512": "3.0", "reward_count:512": "4"}
    restarted = protocol.parse_progress({"model_version": "128"}, rollout)  # started over below 512
    assert (restarted.rollout_reward, restarted.rollout_model_version) == (0.25, 64)
    assert protocol.parse_progress({}, rollout).rollout_model_version == 512  # the trainer's version not known yet


def test_parse_skips_what_it_cannot_read_and_keeps_big_integers_exact():
    parsed = protocol.parse_progress({"step": "abc", "documents_seen": str(2**60 + 1), "metrics": "{not json"},
                            {"reward_count:x": "3", "reward_sum:1": "inf", "reward_count:1": "2"})
    assert parsed.step is None and parsed.documents_seen == 2**60 + 1
    assert parsed.metrics == {} and parsed.rollout_reward is None
    assert job_status.status_fields(protocol.parse_progress({}, {})) == {}


def test_fetch_from_a_real_redis(redis_server):
    job = make_job(redis={"mode": "external", "url": redis_server.url})
    keys = render.job_config(job).keys
    writer = redis_server.client()
    writer.hset(keys.progress, mapping={"step": 3, "documents_seen": 192, "model_version": 192,
                                        "metrics": json.dumps({"kl_new_old": 0.01})})
    writer.hincrbyfloat(keys.rollout, "reward_sum:128", 5.0)
    writer.hincrby(keys.rollout, "reward_count:128", 8)
    # As the trainer's commit thread records checkpoint step 2 (rljob_trainer.checkpoint).
    writer.hset(keys.checkpoint, mapping=protocol.CheckpointRecord(
        step=2, documents_seen=128, path="/var/lib/rljob/checkpoints/step-00000002",
        committed_at=1_800_000_000.25).to_fields())

    async def go():
        connection = RedisConnection(host=redis_server.host, port=redis_server.port)
        good = connect(connection, redis_server.password)
        wrong = connect(connection, "not-the-password")
        try:
            fetched = await fetch(good, keys)
            with pytest.raises(redis.RedisError):
                await fetch(wrong, keys)
        finally:
            await good.aclose()
            await wrong.aclose()
        return fetched

    fetched = asyncio.run(go())
    assert job_status.status_fields(fetched) == {
        "step": 3, "documents_seen": 192, "model_version": 192, "rollout_reward": 0.625,
        "rollout_model_version": 128, "last_metrics": {"kl_new_old": 0.01},
        "last_checkpoint": CheckpointStatus(step=2, documents_seen=128, path="/var/lib/rljob/checkpoints/step-00000002",
                                            time=datetime(2027, 1, 15, 8, 0, 0, 250000, tzinfo=timezone.utc)),
    }


def test_a_checkpoint_record_that_cannot_be_read_is_none_and_a_partial_time_is_left_out():
    good = {b"step": b"10", b"documents_seen": b"640", b"path": b"/ckpt/step-00000010"}
    assert protocol.CheckpointRecord.from_fields(good) == protocol.CheckpointRecord(10, 640, "/ckpt/step-00000010")
    assert protocol.CheckpointRecord.from_fields({**good, b"updated_at": b"nan"}).committed_at is None
    for bad in ({}, {**good, b"step": b"ten"}, {**good, b"documents_seen": b"-1"}, {b"step": b"10", b"path": b"/c"},
                {**good, b"path": b""}):
        assert protocol.CheckpointRecord.from_fields(bad) is None, bad
        assert protocol.parse_progress({}, {}, bad).checkpoint is None


def test_fetch_over_tls_verifies_the_server_with_the_ca_bundle_given(redis_tls_server):
    """The operator's reader verifies a TLS Redis against the PEM text of spec.redis.caSecretRef; a wrong CA or the
    system CAs fail with the verifier's reason (tls_failure), other errors give none."""
    server = redis_tls_server
    keys = render.job_config(make_job(redis={"mode": "external", "url": server.url})).keys
    server.client().hset(keys.progress, mapping={"step": 4, "documents_seen": 256})
    connection = RedisConnection(host=server.host, port=server.port, tls=True)

    async def go():
        outcomes = {}
        for name, ca_data, password in (
            ("private CA", server.tls.ca_file.read_text(), server.password),
            ("foreign CA", server.tls.foreign_ca_file.read_text(), server.password),
            ("system CAs", None, server.password),
            ("wrong password", server.tls.ca_file.read_text(), "not-the-password"),
        ):
            client = connect(connection, password, ca_data=ca_data)
            try:
                outcomes[name] = await fetch(client, keys)
            except redis.RedisError as err:
                outcomes[name] = err
            finally:
                await client.aclose()
        return outcomes

    outcomes = asyncio.run(go())
    assert (outcomes["private CA"].step, outcomes["private CA"].documents_seen) == (4, 256)
    for name in ("foreign CA", "system CAs"):
        assert isinstance(outcomes[name], redis.ConnectionError), outcomes[name]
        assert tls_failure(outcomes[name]) == "self-signed certificate in certificate chain", name
    assert isinstance(outcomes["wrong password"], redis.AuthenticationError)
    assert tls_failure(outcomes["wrong password"]) is None


def test_all_rewards_failed_becomes_a_warning_condition_and_clears_when_rewards_succeed(redis_server):
    """The real rollout writer flags a batch whose every reward failed; the operator's read of the real Redis turns
    it into RolloutReady=False/AllRewardsFailed with one Warning Event, keeps it while Redis is not read, and
    clears it (one Normal Event) once a batch scores again."""
    from collections import Counter

    from rljob_rollout.writer import BatchReport, DocumentWriter

    config = render.job_config(make_job(redis={"mode": "external", "url": redis_server.url}))
    worker = DocumentWriter(redis_server.client(), config, 0)
    client = connect(RedisConnection(host=redis_server.host, port=redis_server.port), redis_server.password)
    running = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, reason=Reason.TRAINING, message="runs")
    pods = [trainer(0, 0), rollout(0)]

    def build(previous, fetched, **deadline):
        return job_status.build_status(
            previous, generation=1, lifecycle=running, problems=[], data_parallel_size=1,
            redis=job_status.RedisHealth(True, "reached"), pods=pods, nodes=1, replicas=1, progress=fetched, now=T0,
            **deadline,
        )

    async def read_hashes():
        return await fetch(client, config.keys)

    async def go():
        try:
            worker.report(BatchReport(0, [1.0, 0.0], 2, Counter(), 0, 0, 0.1))
            healthy = build(RLTrainingJobStatus(), await read_hashes())
            worker.report(BatchReport(64, [], 16, Counter(ValueError=12, KeyError=4), 0, 0, 0.1))
            read = await read_hashes()
            failing = build(healthy, read)
            told = build(healthy, read, reward_deadline_s=600)
            kept = build(failing, None)  # a pass that did not read Redis
            worker.report(BatchReport(64, [0.5], 2, Counter(KeyError=1), 0, 0, 0.1))
            recovered = build(kept, await read_hashes())
        finally:
            await client.aclose()
        return healthy, failing, told, kept, recovered, read.reward_failures

    healthy, failing, told, kept, recovered, streak = asyncio.run(go())
    ready = failing.condition(ConditionType.ROLLOUT_READY)
    assert (ready.status, ready.reason) == ("False", "AllRewardsFailed")
    assert ready.message.startswith(
        "every one of the 16 samples of a rollout worker's last batch (weights version 64) failed its reward "
        "function: ValueError ×12, KeyError ×4; no document reaches the trainer until rewards succeed again"
    )
    assert "spec.rollout.task" in ready.message
    (event,) = job_status.transition_events(healthy, failing)
    assert (event.type, event.reason) == ("Warning", "AllRewardsFailed")
    assert event.message == f"RolloutReady=False: {ready.message}"
    assert failing.phase == Phase.RUNNING  # the job keeps waiting for data; it is not failed
    since = datetime.fromtimestamp(streak.since, timezone.utc)
    assert told.condition(ConditionType.ROLLOUT_READY).message.endswith(
        f"; failing since {since:%Y-%m-%dT%H:%M:%SZ}: the job fails (RewardsFailing) if no sample scores by "
        f"{since + timedelta(seconds=600):%Y-%m-%dT%H:%M:%SZ} (spec.rollout.rewardFailureDeadlineSeconds = 600)")

    assert job_status.status_patch(job_status.to_json(failing), kept) is None and not job_status.transition_events(failing, kept)

    cleared = recovered.condition(ConditionType.ROLLOUT_READY)
    assert (cleared.status, cleared.reason, cleared.message) == ("True", "PodsReady", "1/1 rollout pods ready")
    assert [(e.type, e.reason) for e in job_status.transition_events(kept, recovered)] == [("Normal", "PodsReady")]


@pytest.mark.parametrize(("raw", "start"), [
    ("{not json", "every sample of a rollout worker's last batch failed its reward function: error kind unknown;"),
    (json.dumps({"samples": 0, "errors": {"E": "x"}}), "every sample of a rollout worker's last batch failed"),
    (json.dumps({"samples": 3, "version": 7, "errors": {"B": 1, "A": 1, "C": 1}}),
     "every one of the 3 samples of a rollout worker's last batch (weights version 7) failed its reward function: "
     "A ×1, B ×1, C ×1;"),
])
def test_unreadable_failure_details_still_give_a_message(raw, start):
    parsed = protocol.parse_progress({}, {"all_rewards_failed": raw})
    assert parsed.reward_failures.ready_message().startswith(start)
    assert protocol.parse_progress({}, {}).reward_failures is None


@pytest.mark.parametrize(("before", "after", "managed", "ready", "reads"), [
    (Phase.RUNNING, Phase.RUNNING, True, True, True),
    (Phase.RUNNING, Phase.RUNNING, True, None, False),  # a managed Redis that is not ready yet: no connection
    (Phase.RUNNING, Phase.RUNNING, False, None, True),  # external: the read is the probe
    (Phase.STARTING, Phase.SUCCEEDED, True, False, True),  # the finishing pass reads the final step regardless
    (Phase.RUNNING, Phase.FAILED, True, None, True),
    (Phase.SUCCEEDED, Phase.SUCCEEDED, False, True, False),  # idle: nothing changes there
    (Phase.SUSPENDED, Phase.SUSPENDED, False, True, False),
    (Phase.SUSPENDED, Phase.STARTING, True, False, False),
    (Phase.RUNNING, Phase.SUSPENDED, True, True, True),
])
def test_which_passes_read_the_progress_hashes(before, after, managed, ready, reads):
    assert redis_reads.reads_progress(before, after, managed, ready) is reads
