"""Fencing by gang attempt (rljob_trainer.fence, DESIGN §6 "Fencing"), against a real Redis: the claim, the guarded
writes, and a live 2-rank trainer of attempt 0 that loses the job to attempt 1 while it runs (the fault injected from
outside: the test claims the job as a new attempt's rank 0 would), after which it acks, commits, publishes and reports
nothing; attempt 1 then resumes from the last checkpoint attempt 0 committed and finishes with every entry trained in
exactly one committed checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from rljob_api import constants as c
from rljob_api import protocol
from rljob_trainer import fence
from rljob_trainer.checkpoint import COMMIT_FILE
from rljob_trainer.progress_report import publish_start
from rljob_trainer.stream.reader import ack_entries
from train_harness import (
    Torchrun,
    XackMonitor,
    covered_by_checkpoint,
    free_port,
    json_lines,
    make_config,
    make_documents,
    read_events,
    wait_for_commit,
    wait_until,
    write_config,
    write_documents,
)


@pytest.fixture
def setup(redis_server, tmp_path):
    config = make_config(redis_server, tmp_path / "ckpt", processes=2, documents_per_step=4, max_steps=6,
                         every_steps=2)
    return config, redis_server.client()


def test_a_claim_moves_forward_only_and_guarded_writes_run_only_for_the_owner(setup):
    config, client = setup
    keys = config.keys
    assert fence.attempt_key(keys) == "rljob:ns:job:attempt"
    assert fence.claim(client, keys, attempt=2) is None  # nobody owned it
    assert fence.claim(client, keys, attempt=2) == ":2"  # a restarted rank 0 of the same attempt
    with pytest.raises(fence.Fenced, match="belongs to gang attempt 1, but attempt 2 owns the job"):
        fence.claim(client, keys, attempt=1)
    assert client.get(fence.attempt_key(keys)) == b":2"  # <job uid>:<attempt>, no uid outside the operator

    replies = fence.write(client, keys, [("HSET", "h", "a", "1"), ("HINCRBY", "h", "a", "2"), ("GET", "nothing")],
                          attempt=2)
    assert replies == [1, 3, None]
    with pytest.raises(fence.Fenced) as refused:
        fence.write(client, keys, [("HSET", "h", "a", "100"), ("SET", "other", "x")], attempt=1)
    assert (refused.value.attempt, refused.value.current, refused.value.owner) == (1, 2, ":2")
    assert client.hget("h", "a") == b"3" and client.get("other") is None  # nothing of a refused write ran
    with pytest.raises(fence.Fenced, match="gang attempt 3, but attempt 2"):
        fence.check(client, keys, attempt=3)  # a later attempt that has not claimed yet does not own it either
    fence.check(client, keys, attempt=2)

    assert fence.claim(client, keys, attempt=3) == ":2"
    with pytest.raises(fence.Fenced):
        fence.write(client, keys, [("HSET", "h", "a", "100")], attempt=2)

    client.delete(fence.attempt_key(keys))  # Redis forgot (restarted empty, flushed)
    with pytest.raises(fence.Fenced, match="no attempt owns the job") as forgotten:
        fence.write(client, keys, [("HSET", "h", "a", "100")], attempt=3)
    assert forgotten.value.current is None and forgotten.value.owner is None

    fence.claim(client, keys, attempt=4)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # a failing command is not taken for a refusal
        fence.write(client, keys, [("LPUSH", "h", "x")], attempt=4)


def test_a_new_job_object_of_the_same_name_takes_the_keys_over_and_fences_the_old_one(setup, monkeypatch):
    """A job deleted and created again under the same name on a shared (external) Redis finds the old object's keys:
    its attempt 0 takes them over, whatever attempt the old object reached, and a leftover of the old object is
    refused."""
    config, client = setup
    keys = config.keys
    monkeypatch.setenv(c.ENV_JOB_UID, "uid-old")
    fence.claim(client, keys, attempt=4)
    monkeypatch.setenv(c.ENV_JOB_UID, "uid-new")
    assert fence.claim(client, keys, attempt=0) == "uid-old:4"
    assert client.get(fence.attempt_key(keys)) == b"uid-new:0"
    assert fence.write(client, keys, [("SET", "k", "new")], attempt=0) == [b"OK"]
    monkeypatch.setenv(c.ENV_JOB_UID, "uid-old")
    with pytest.raises(fence.Fenced, match=r"another RLTrainingJob of this name owns its keys \(uid-new:0\)"):
        fence.write(client, keys, [("SET", "k", "old")], attempt=4)
    with pytest.raises(fence.Fenced):
        fence.check(client, keys, attempt=5)
    assert client.get("k") == b"new"


def test_outside_the_operator_nothing_is_claimed_and_writes_are_plain(setup, monkeypatch):
    config, client = setup
    monkeypatch.delenv(c.ENV_ATTEMPT, raising=False)
    assert fence.gang_attempt() is None
    assert fence.claim(client, config.keys) is None and client.get(fence.attempt_key(config.keys)) is None
    assert fence.write(client, config.keys, [("SET", "k", "v"), ("GET", "k")]) == [b"OK", b"v"]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # the commands after a failing one do not run
        fence.write(client, config.keys, [("LPUSH", "k", "x"), ("SET", "k", "after")])
    assert client.get("k") == b"v"
    monkeypatch.setenv(c.ENV_ATTEMPT, "5")
    with pytest.raises(fence.Fenced, match="attempt 5, but no attempt"):
        fence.write(client, config.keys, [("SET", "k", "w")])
    fence.claim(client, config.keys)
    assert fence.write(client, config.keys, [("SET", "k", "w")]) == [b"OK"]  # the script's status reply, raw


def test_a_stale_attempts_acks_and_start_record_are_refused(setup, monkeypatch):
    config, client = setup
    keys = config.keys
    ids = write_documents(client, config, make_documents(3, seed=0))
    client.xgroup_create(keys.stream, keys.group, id="0")
    client.xreadgroup(keys.group, keys.consumer(0), {keys.stream: ">"})
    fence.claim(client, keys, attempt=1)
    monkeypatch.setenv(c.ENV_ATTEMPT, "0")
    with pytest.raises(fence.Fenced):
        ack_entries(client, keys, ids)
    with pytest.raises(fence.Fenced):
        publish_start(client, config, 0, 0, None, attempt=0)
    assert client.xpending(keys.stream, keys.group)["pending"] == 3 and not client.exists(keys.progress)
    monkeypatch.setenv(c.ENV_ATTEMPT, "1")
    assert ack_entries(client, keys, ids) == 3
    publish_start(client, config, 0, 0, None, attempt=1)
    assert client.hget(keys.progress, protocol.PROGRESS_STEP) == b"0"


def test_a_running_attempt_that_loses_the_job_stops_writing_and_the_new_attempt_finishes(setup, redis_server,
                                                                                       tmp_path, monkeypatch):
    config, client = setup
    keys = config.keys
    config_path = write_config(config, tmp_path / "config.json")
    docs = make_documents(24, seed=3)
    monitor = XackMonitor(redis_server)
    try:
        ids = write_documents(client, config, docs[:12])  # 3 steps: attempt 0 then blocks reading step 4
        monkeypatch.setenv(c.ENV_ATTEMPT, "0")
        old = Torchrun(config_path, 2, free_port(), redis_server.password, tmp_path, "attempt0")
        wait_until(lambda: client.hget(keys.progress, "step") == b"3", 240, "attempt 0 at step 3", old.logs)
        wait_for_commit(client, config, 2, old.logs)
        assert client.get(fence.attempt_key(keys)) == b":0"

        fence.claim(client, keys, attempt=1)  # attempt 1's rank 0 starts (the old gang is still running)
        events_before = client.xlen(keys.events)
        checkpoint_before = client.hgetall(keys.checkpoint)
        acks_before = dict(monitor.acks)
        ids += write_documents(client, config, docs[12:16])  # attempt 0 trains step 4, then must write something
        assert old.wait(240) != 0, old.logs()
        stderr = old.stderr_path.read_text()
        assert "fenced: this process belongs to gang attempt 0, but attempt 1 owns the job" in stderr, old.logs()
        old.kill()

        # Nothing of attempt 0 landed after the claim: no ack, no event, no progress, no commit.
        assert dict(monitor.acks) == acks_before and set(acks_before) == set(ids[:8])
        assert client.xlen(keys.events) == events_before
        assert client.hget(keys.progress, "step") == b"3" and client.hgetall(keys.checkpoint) == checkpoint_before
        assert not (Path(config.checkpoint_dir) / "step-00000004" / COMMIT_FILE).exists()
        commit = json.loads((Path(config.checkpoint_dir) / "step-00000002" / COMMIT_FILE).read_text())
        assert commit["attempt"] == 0

        wait_until(lambda: not any("b" in cl["flags"] for cl in client.client_list()), 30, "blocked clients gone")
        ids += write_documents(client, config, docs[16:])
        monkeypatch.setenv(c.ENV_ATTEMPT, "1")
        new = Torchrun(config_path, 2, free_port(), redis_server.password, tmp_path, "attempt1")
        assert new.wait(240) == 0, new.logs()
        new.kill()
    finally:
        acks = monitor.stop()

    assert set(acks) == set(ids) and set(acks.values()) == {1}, acks  # each entry acked once, by its owner
    covered = covered_by_checkpoint(tmp_path / "ckpt")
    every = [entry for entries in covered.values() for entry in entries]
    assert sorted(every) == sorted(ids) and len(every) == len(set(every))  # one committed timeline, no gap
    assert [(x["step"], x["documents_seen"]) for x in json_lines(new)] == [(s, 4 * s) for s in range(3, 7)]
    assert read_events(client, config)[-1] == {"type": "training_finished", "step": 6, "documents_seen": 24}
    assert client.get(fence.attempt_key(keys)) == b":1"


def test_the_stream_identity_is_made_once_and_again_after_redis_forgot(setup):
    from rljob_trainer.progress_report import stream_identity
    config, client = setup
    first = stream_identity(client, config)
    assert len(first) == 32 and stream_identity(client, config) == first  # a restart keeps it
    assert client.get(config.keys.prefix + protocol.KEY_STREAM_ID) == first.encode()
    client.flushall()  # Redis forgot: the next start makes another, which the operator tells from the first
    second = stream_identity(client, config)
    assert len(second) == 32 and second != first
