"""The rollout loop over real Redis and a real weight transfer: version tagging, waiting, failures, outages."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import redis
import torch

from rollout_harness import make_config, make_worker, running, tiny_model, wait_until
from rljob_api import protocol
from rljob_wire.model import sequence_logprobs
from rljob_rollout.__main__ import replica_index
from rljob_rollout.backoff import JITTER_LOW, Backoff
from rljob_rollout.worker import REWARD_BACKOFF_CAP_S, REWARD_BACKOFF_INITIAL_S, WAIT_FOR_ROOM_MS, room_wait_ms
from rollout_harness import rollout_rewards
from rljob_wire.codec import decode_entry
from rljob_trainer.weight_publisher import WeightPublisher


@pytest.fixture()
def publisher_for(redis_server):
    made = []

    def make(config):
        publisher = WeightPublisher(config, redis_server.client(), join_timeout_s=3, transfer_timeout_s=10, poll_interval_s=0.3)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def _documents(client, config):
    return [decode_entry(fields, require_metrics_fields=True, max_tokens=None) for _, fields in client.xrange(config.keys.stream)]


def _recomputed(model, doc, temperature):
    ids = torch.from_numpy(doc.tokens.copy())[None]
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), temperature)[0]


def test_tokens_carry_the_version_of_the_weights_that_generated_them(redis_server, publisher_for):
    # Nothing trains here, so max lag must not stop the worker before version 48's documents are written.
    config = make_config(redis_server, rollout={"sampling": {"temperature": 0.7}, "maxLag": 10_000_000},
                         redis={"maxPending": 10_000_000})
    client = redis_server.client()
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    models = {0: tiny_model(config, seed=10), 48: tiny_model(config, seed=11)}
    with running(worker) as result:
        time.sleep(1.5)
        assert client.xlen(config.keys.stream) == 0, "generated before the first weights arrived"
        publisher.publish(models[0].named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: client.xlen(config.keys.stream) >= 32, 30, "documents of version 0")
        publisher.publish(models[48].named_parameters(), step=3, documents_seen=48)
        wait_until(lambda: worker.version == 48, 30, "the worker loading version 48")
        count = client.xlen(config.keys.stream)
        wait_until(lambda: client.xlen(config.keys.stream) >= count + 32, 30, "documents of version 48")
    assert result.get("rc") == 0 and "error" not in result

    versions = []
    for doc in _documents(client, config):
        tags = set(doc.model_version.tolist())
        assert len(tags) == 1, f"one document mixes versions {tags}"
        version = tags.pop()
        versions.append(version)
        labels = torch.from_numpy(doc.label_mask())
        old = torch.from_numpy(doc.old_log_probabilities.copy())[labels]
        own = _recomputed(models[version], doc, 0.7)[labels]
        other = _recomputed(models[48 - version], doc, 0.7)[labels]
        torch.testing.assert_close(own, old, rtol=0, atol=2e-5)
        assert (other - old).abs().max() > 1e-3, "the other version's weights explain the tokens as well"
    assert versions == sorted(versions) and {0, 48} <= set(versions), "versions must switch once, in stream order"


def test_a_lower_version_is_adopted_after_a_trainer_restart(redis_server, publisher_for):
    config = make_config(redis_server)
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    with running(worker):
        publisher.publish(tiny_model(config, 1).named_parameters(), step=5, documents_seen=80)
        wait_until(lambda: worker.version == 80, 30, "version 80")
        publisher.publish(tiny_model(config, 2).named_parameters(), step=2, documents_seen=32)  # resumed from an older checkpoint
        wait_until(lambda: worker.version == 32, 30, "version 32 adopted")


def test_training_finished_ends_the_worker_with_0(redis_server, publisher_for):
    config = make_config(redis_server, trainer={"maxSteps": 40})
    client = redis_server.client()
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    with running(worker) as result:
        publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: worker.version == 0, 30, "first weights")
        publisher.finish(step=40, documents_seen=640)
        result["thread"].join(30)
        assert not result["thread"].is_alive() and result["rc"] == 0
    assert client.hlen(config.keys.members) == 0  # it left the membership
    _, fields = client.xrevrange(config.keys.events, count=1)[0]
    assert json.loads(fields[b"event"]) == {"type": "training_finished", "step": 40, "documents_seen": 640}
    late = make_worker(config, redis_server.password)  # a worker started after the end exits at once
    assert late.run() == 0
    assert client.hlen(config.keys.members) == 0


@pytest.mark.parametrize("event", [
    {"type": "training_finished"},  # an older trainer's, without a step: the job is taken as finished
    {"type": "training_finished", "step": 80, "documents_seen": 1280},
    {"type": "training_finished", "step": 90, "documents_seen": 1440},  # maxSteps was lowered below the last step
])
def test_a_worker_started_after_the_last_step_exits_at_once(redis_server, event):
    config = make_config(redis_server, trainer={"maxSteps": 80})
    redis_server.client().xadd(config.keys.events, {"event": json.dumps(event)})
    assert make_worker(config, redis_server.password).run() == 0


def test_an_earlier_attempts_training_finished_does_not_end_a_new_worker(redis_server, publisher_for):
    # The job trained to maxSteps 40 and announced it; then maxSteps was raised to 80, so the operator restarted the
    # trainer gang and recreated this rollout pod, whose first look at the events stream finds the old end.
    config = make_config(redis_server, trainer={"maxSteps": 80}, rollout={"maxLag": 10_000_000},
                         redis={"maxPending": 10_000_000})
    client = redis_server.client()
    publisher = publisher_for(config)
    publisher.finish(step=40, documents_seen=640)
    worker = make_worker(config, redis_server.password)
    with running(worker) as result:
        wait_until(lambda: client.hlen(config.keys.members) == 1, 30, "the worker joining the membership")
        assert result["thread"].is_alive(), f"the worker exited on the stale training_finished: {result}"
        publisher.publish(tiny_model(config, 1).named_parameters(), step=40, documents_seen=640)  # the new attempt
        wait_until(lambda: worker.version == 640, 30, "the new attempt's weights")
        wait_until(lambda: client.xlen(config.keys.stream) >= 16, 30, "a batch for the new attempt")
        assert {int(v) for d in _documents(client, config) for v in d.model_version} == {640}
        publisher.finish(step=60, documents_seen=960)  # live: ends the worker whatever the step
        result["thread"].join(30)
        assert not result["thread"].is_alive() and result["rc"] == 0 and "error" not in result


def test_backpressure_blocks_the_worker_until_entries_are_acked(redis_server, publisher_for):
    config = make_config(redis_server, rollout={"maxLag": 100_000}, redis={"maxPending": 16})  # one batch = 16 documents
    client = redis_server.client()
    client.xgroup_create(config.keys.stream, config.keys.group, id="0", mkstream=True)
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    with running(worker):
        publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: client.xlen(config.keys.stream) == 16, 30, "the first batch")
        time.sleep(1.5)
        assert client.xlen(config.keys.stream) == 16, "wrote past maxPending"
        delivered = client.xreadgroup(config.keys.group, "fast_llm_consumer_0", {config.keys.stream: ">"}, count=100)
        time.sleep(1.0)
        assert client.xlen(config.keys.stream) == 16, "delivered but unacknowledged entries must still hold it back"
        registry = worker.metrics.registry  # the Prometheus view of the same check: 0 undelivered + 16 pending
        assert registry.get_sample_value("rljob_rollout_stream_backlog") == 16
        assert registry.get_sample_value("rljob_rollout_stream_ahead") == 16  # none trained (no progress hash)
        assert registry.get_sample_value("rljob_rollout_waiting") == 1
        held = worker.capacity.held_seconds()
        assert worker.capacity.held and held >= 2.0  # since the first batch: 1.5 s + 1.0 s and the reads between
        client.xack(config.keys.stream, config.keys.group, *[entry_id for entry_id, _ in delivered[0][1]])
        wait_until(lambda: client.xlen(config.keys.stream) == 32, 30, "the worker resuming after the ack")
        wait_until(lambda: protocol.worker_reports(client.hgetall(config.keys.rollout)).get(0, protocol.WorkerReport())
                   .held_seconds, 30, "the second batch's report")
    report = protocol.worker_reports(client.hgetall(config.keys.rollout))[0]
    assert held <= report.held_seconds < held + 5.0 and 0.0 < report.held_share <= 1.0
    sampled = sum(int(doc.label_mask().sum()) for doc in _documents(client, config))  # every sampled token is labelled
    assert worker.capacity.tokens == sampled and report.tokens_per_second > 0
    assert report.held_share == pytest.approx(report.held_seconds / report.window_s, abs=0.02)  # the first window
    assert registry.get_sample_value("rljob_rollout_held_seconds_total") == pytest.approx(report.held_seconds, abs=1e-3)
    assert registry.get_sample_value("rljob_rollout_held_share") == pytest.approx(report.held_share, abs=1e-4)


def test_held_back_right_after_an_update_the_worker_checks_again_soon():
    # The trainer reports a step just after publishing its weights: the first checks come after 5 ms, doubling.
    assert [room_wait_ms(n) for n in range(9)] == [5, 10, 20, 40, 80, 160, 250, 250, 250]
    assert room_wait_ms(10**6) == WAIT_FOR_ROOM_MS == 250  # long held back (or no update yet): the plain wait


REWARDS = '''
def fails_on_flagged(prompt, completion, record):
    if record["fail"]:
        raise ValueError("flagged record")
    return float(len(completion) % 3)

def always_fails(prompt, completion, record):
    raise KeyError("no reward for you")

def fails_while_flagged_file(prompt, completion, record):
    import os
    if os.path.exists(os.path.join(os.path.dirname(__file__), "failing")):
        return 1 / 0
    return 1.0
'''


@pytest.fixture()
def custom_task(tmp_path, monkeypatch):
    (tmp_path / "worker_test_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "ok 1", "fail": false}\n{"prompt": "bad 2", "fail": true}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda function: {"name": "custom", "datasetPath": str(tmp_path / "prompts.jsonl"),
                            "rewardFunction": f"worker_test_rewards:{function}"}
    sys.modules.pop("worker_test_rewards", None)


def test_a_raising_reward_function_drops_only_its_samples(redis_server, publisher_for, custom_task, caplog):
    config = make_config(redis_server, rollout={"task": custom_task("fails_on_flagged"), "sampling": {"maxNewTokens": 4}})
    client = redis_server.client()
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    with caplog.at_level(logging.WARNING, logger="rljob_rollout.worker"), running(worker) as result:
        publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: worker.batches >= 3, 30, "three batches")
    assert "error" not in result
    stored = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.rollout).items()}
    generated = int(stored["samples_generated"])
    failed = int(stored[f"{protocol.ROLLOUT_REWARD_ERRORS_PREFIX}ValueError"])
    assert generated == 16 * worker.batches and 0 < failed < generated
    assert int(stored["documents_written"]) == generated - failed == client.xlen(config.keys.stream)
    assert sum(n for _, n in rollout_rewards(client, config.keys.rollout).values()) == generated - failed
    ok_prompt = worker.tokenizer.encode("ok 1")
    for doc in _documents(client, config):
        assert doc.tokens[: len(ok_prompt)].tolist() == ok_prompt  # only the unflagged prompt's samples
    assert protocol.ROLLOUT_ALL_REWARDS_FAILED not in stored
    assert sum("raised ValueError" in r.getMessage() for r in caplog.records) == 1  # logged once per kind
    registry = worker.metrics.registry  # the Prometheus view counts the same
    assert registry.get_sample_value("rljob_rollout_samples_total") == generated
    assert registry.get_sample_value("rljob_rollout_documents_total") == generated - failed
    assert registry.get_sample_value("rljob_rollout_reward_errors_total", {"kind": "ValueError"}) == failed
    assert registry.get_sample_value("rljob_rollout_weight_updates_total", {"outcome": "loaded"}) == 1
    assert registry.get_sample_value("rljob_rollout_model_version") == 0


def test_a_job_where_every_reward_fails_says_so_and_writes_nothing(redis_server, publisher_for, custom_task, caplog):
    config = make_config(redis_server, rollout={"task": custom_task("always_fails"), "sampling": {"maxNewTokens": 4}})
    client = redis_server.client()
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    with running(worker) as result:
        publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: worker.batches >= 2, 30, "two batches")
        assert result["thread"].is_alive()
    failed = json.loads(client.hget(config.keys.rollout, protocol.ROLLOUT_ALL_REWARDS_FAILED))
    assert failed["errors"] == {"KeyError": 16} and failed["version"] == 0
    assert client.xlen(config.keys.stream) == 0
    said = [r.getMessage() for r in caplog.records if "every one of the" in r.getMessage()]
    assert said and all(m.startswith("rollout: every one of the 16 samples of the batch failed its reward function "
                                     "or episode ({'KeyError': 16})") for m in said), said  # the batch the hash holds


def test_rewards_that_all_fail_back_off_exponentially_serve_weights_meanwhile_and_recover(
        redis_server, publisher_for, custom_task, tmp_path, caplog):
    """The waits between failing batches follow the schedule (1 s doubling, each drawn in [0.5, 1] × the nominal
    delay) and the batches really are that far apart; new weights are loaded during a wait of at least 4 s (the
    publisher's join timeout is 3 s); the first scored batch ends the streak and the back-off, and batches follow at
    full speed again."""
    (tmp_path / "failing").write_text("")
    config = make_config(redis_server, rollout={"task": custom_task("fails_while_flagged_file"), "maxLag": 10_000_000,
                                                "sampling": {"maxNewTokens": 4}}, redis={"maxPending": 10_000_000})
    client = redis_server.client()
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    schedule = Backoff(REWARD_BACKOFF_INITIAL_S, REWARD_BACKOFF_CAP_S)
    with caplog.at_level(logging.INFO, logger="rljob_rollout.worker"), running(worker) as result:
        publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: worker.batches >= 4, 60, "four failing batches")
        assert worker.reward_backoff.waits == 4  # the 4th wait is drawn in [4, 8] s
        # Received whole within the publisher's 3 s join timeout, so while the worker was backing off:
        assert publisher.publish(tiny_model(config, 2).named_parameters(), step=3, documents_seen=48) == 1
        wait_until(lambda: worker.version == 48, 10, "version 48 loaded")
        streak = protocol.RewardFailures.from_field(client.hget(config.keys.rollout, protocol.ROLLOUT_ALL_REWARDS_FAILED))
        (tmp_path / "failing").unlink()
        wait_until(lambda: client.xlen(config.keys.stream) > 0, 30, "the first scored batch after the back-off")
        recovered = worker.batches
        wait_until(lambda: worker.batches >= recovered + 10, 20, "10 batches at full speed after the recovery")
    assert "error" not in result

    failing = [r for r in caplog.records if "(back-off)" in r.getMessage()]
    waits = [r.args[2] for r in failing]
    assert len(waits) == 4, [r.getMessage() for r in failing]  # the 5th batch scored
    for n, wait in enumerate(waits):
        assert JITTER_LOW * schedule.nominal(n) <= wait <= schedule.nominal(n), (n, wait)
    gaps = [later.created - earlier.created for earlier, later in zip(failing, failing[1:])]
    assert all(gap >= wait - 0.01 for gap, wait in zip(gaps, waits)), (gaps, waits)
    assert [schedule.nominal(n) for n in range(4)] == [1, 2, 4, 8]

    zero = "ZeroDivisionError: division by zero"
    assert (streak.batches, streak.samples, streak.errors, streak.version) == (4, 64, {zero: 64}, 0)
    assert streak.failing_seconds() >= sum(waits[:3]) - 0.01  # Redis clock, first to last failing batch
    assert client.hget(config.keys.rollout, protocol.ROLLOUT_ALL_REWARDS_FAILED) is None
    assert worker.reward_backoff.waits == 0
    assert {int(v) for d in _documents(client, config) for v in d.model_version} == {48}  # loaded before batch 5


def test_the_worker_rides_out_a_redis_restart(redis_server, publisher_for):
    config = make_config(redis_server, rollout={"maxLag": 10_000_000}, redis={"maxPending": 10_000_000})
    client = redis_server.client()
    publisher = publisher_for(config)
    worker = make_worker(config, redis_server.password)
    with running(worker) as result:
        publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0)
        wait_until(lambda: client.xlen(config.keys.stream) >= 32, 30, "documents before the outage")
        redis_server.stop()
        time.sleep(4.0)
        assert result["thread"].is_alive(), f"the worker died with Redis: {result.get('error')!r}"
        redis_server.start()
        client = redis_server.client()
        before = client.xlen(config.keys.stream)
        wait_until(lambda: client.xlen(config.keys.stream) >= before + 32, 60, "documents after the restart")
        assert worker.version == 0
    assert result.get("rc") == 0 and "error" not in result


def test_a_wrong_password_ends_the_worker_instead_of_retrying(redis_server):
    config = make_config(redis_server)
    worker = make_worker(config, "not-the-password")
    with running(worker) as result:
        wait_until(lambda: not result["thread"].is_alive(), 20, "the worker to give up")
    assert isinstance(result.get("error"), redis.AuthenticationError), result


def test_replica_index_comes_from_the_environment(redis_server):
    one = make_config(redis_server)
    three = make_config(redis_server, rollout={"replicas": 3})
    assert replica_index(one, {}) == 0
    assert replica_index(three, {"RLJOB_REPLICA_INDEX": "2"}) == 2
    for env, message in (({}, "required"), ({"RLJOB_REPLICA_INDEX": "x"}, "not an integer"),
                         ({"RLJOB_REPLICA_INDEX": "3"}, "outside")):
        with pytest.raises(ValueError, match=message):
            replica_index(three, env)
    assert three.transfer_rank(2) == 3 and np.array_equal([one.transfer_rank(0)], [1])


def test_the_entry_point_refuses_a_bad_replica_index_with_exit_2(redis_server, tmp_path):
    config = make_config(redis_server, rollout={"replicas": 2})
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    env = dict(os.environ, RLJOB_CONFIG=str(path), RLJOB_REPLICA_INDEX="5", REDIS_PASSWORD=redis_server.password)
    done = subprocess.run([sys.executable, "-m", "rljob_rollout"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "RLJOB_REPLICA_INDEX: 5 is outside [0, spec.rollout.replicas = 2)" in done.stderr
