"""A rollout worker leaving (scale-down) and coming back (scale-up) over real Redis: it leaves the weight group at
once, writes the groups in flight that finish within its drain and counts the rest, and a later start of the same
replica index draws other prompts."""

from __future__ import annotations

import time

import pytest

from rljob_api import protocol
from rljob_rollout.worker import RolloutWorker, replica_seed
from rollout_harness import running, wait_until
from test_environments import _environment_worker, served


def _stopped_while_in_flight(redis_server, entrypoint: str, drain_s: float):
    with served(entrypoint) as url:  # a server process: an in-process step that never returns would hold the exit
        return _stop_while_in_flight(redis_server, url, drain_s)


def _stop_while_in_flight(redis_server, url: str, drain_s: float):
    config, worker = _environment_worker(redis_server, {"url": url, "maxTurns": 2, "turnTimeoutSeconds": 60})
    worker.drain_s = drain_s
    client = redis_server.client()
    try:
        with running(worker) as result:
            wait_until(lambda: worker.backend.in_flight == 2 and client.hlen(config.keys.members) > 0, 30,
                       "two groups in flight and the worker's members heartbeating")
            worker.stop()  # what SIGTERM does
            wait_until(lambda: client.hlen(config.keys.members) == 0, 2, "the members deleted at once")
            assert result["thread"].is_alive() or drain_s < 1, "left the weight group before draining"
            result["thread"].join(drain_s + 30)
            assert result.get("rc") == 0, result
    finally:
        worker.backend.close()
    rollout = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.rollout).items()}
    return client.xlen(config.keys.stream), int(rollout.get(protocol.ROLLOUT_SAMPLES_DROPPED_AT_STOP, 0)), worker


def test_a_stopped_worker_writes_the_groups_that_finish_within_its_drain(redis_server):
    written, dropped, worker = _stopped_while_in_flight(redis_server, "faulty_environments:SlowSteps", drain_s=20)
    assert (written, dropped) == (6, 0)  # 2 groups of 3 episodes, each a document
    assert worker.metrics.dropped_at_stop._value.get() == 0


def test_groups_still_in_flight_after_the_drain_are_dropped_and_counted(redis_server):
    started = time.monotonic()
    written, dropped, worker = _stopped_while_in_flight(redis_server, "faulty_environments:NeverAnswers", drain_s=1)
    assert (written, dropped) == (0, 6) and worker.metrics.dropped_at_stop._value.get() == 6
    assert time.monotonic() - started < 40  # the drain ended the wait, not the 60 s turn timeout


def test_each_start_of_a_replica_index_draws_its_own_seed():
    assert replica_seed(5, 2, 1) == 7  # the first start: reproducible as before
    later = {replica_seed(5, 2, start) for start in range(2, 50)}
    assert len(later) == 48 and 7 not in later and all(0 <= s < 2**63 for s in later)
    assert replica_seed(5, 2, 3) == replica_seed(5, 2, 3) != replica_seed(5, 3, 3)
    with pytest.raises(ValueError, match="start must be >= 1, got 0"):
        replica_seed(5, 2, 0)


def test_a_recreated_replica_counts_its_starts_and_draws_other_prompts(redis_server, monkeypatch):
    from rollout_harness import make_config

    config = make_config(redis_server)
    monkeypatch.setenv("REDIS_PASSWORD", redis_server.password)
    first = RolloutWorker.from_config(config, 1)
    second = RolloutWorker.from_config(config, 1)  # the pod of index 1 re-created
    try:
        prompts = [[p.token_ids for p in worker.task.next_prompts(8)] for worker in (first, second)]
        assert prompts[0] != prompts[1]
        assert redis_server.client().hget(config.keys.rollout, f"{protocol.ROLLOUT_STARTS_PREFIX}1") == b"2"
    finally:
        first.backend.close()
        second.backend.close()
