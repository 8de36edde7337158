"""status.capacity from the progress hashes (issue 28 item 1, the operator half): what counts, what is not reported,
rounding that keeps a steady job's status unwritten, the law's Signals, and the words `rljob watch` prints."""

from __future__ import annotations

from datetime import timedelta

import pytest

from rljob_api.constants import Phase, Reason
from rljob_api.protocol import Backlog, Progress, WorkerReport
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import capacity, gang, job_status
from rljob_operator.autoscale import Signals

from operator_helpers import T0, rollout, trainer

NOW_S = T0.timestamp()


def report(held: float | None, tokens: float | None, age_s: float = 1.0) -> WorkerReport:
    return WorkerReport(version=64, samples_per_second=2.0, updated_at=NOW_S - age_s, held_share=held,
                        tokens_per_second=tokens, held_seconds=3.0 if held is not None else None,
                        window_s=30.0 if held is not None else None)


def progress(workers: dict[int, WorkerReport], wait: float | None = 0.123, age_s: float = 2.0,
             backlog: Backlog | None = Backlog(pending=64, undelivered=1234), step_ms: float = 900.0) -> Progress:
    metrics = {"step_time_ms": step_ms, "loss": 0.5}
    if wait is not None:
        metrics["data_wait_share"] = wait
    return Progress(step=7, metrics=metrics, updated_at=NOW_S - age_s, backlog=backlog, workers=workers)


def test_fresh_reports_of_replicas_in_the_spec_are_averaged_summed_and_rounded():
    seen = capacity.observe(progress({0: report(0.104, 612.3), 1: report(0.0, 655.0)}), replicas=2, now=T0)
    assert seen.model_dump() == {
        "data_wait_share": 0.12, "held_share": 0.05, "tokens_per_second": 1300.0,
        "tokens_per_second_per_replica": 630.0, "pending": 64, "undelivered": 1200, "replicas_reporting": 2,
        "observed_at": T0}


def test_stale_scaled_away_and_old_workers_count_as_not_reported_never_as_zero():
    workers = {0: report(0.5, 100.0), 1: report(0.9, 900.0, age_s=capacity.FRESH_S + 1),  # stale
               2: report(None, None),  # a worker older than the capacity fields
               3: report(0.9, 900.0)}  # index 3 of a job scaled down to 3 replicas
    seen = capacity.observe(progress(workers), replicas=3, now=T0)
    assert (seen.held_share, seen.tokens_per_second, seen.tokens_per_second_per_replica, seen.replicas_reporting) == (
        0.5, 100.0, 100.0, 1)
    nobody = capacity.observe(progress({2: report(None, None)}, wait=None, backlog=None), replicas=3, now=T0)
    assert nobody.model_dump(exclude_none=True) == {"replicas_reporting": 0, "observed_at": T0}


def test_the_trainers_share_is_fresh_for_two_windows_or_two_of_its_steps():
    assert capacity.observe(progress({}, age_s=61.0), 1, T0).data_wait_share is None
    assert capacity.observe(progress({}, age_s=59.0), 1, T0).data_wait_share == 0.12
    # a 50 s step: its record stays fresh for two steps
    assert capacity.observe(progress({}, age_s=99.0, step_ms=50_000), 1, T0).data_wait_share == 0.12
    assert capacity.observe(progress({}, age_s=101.0, step_ms=50_000), 1, T0).data_wait_share is None


def test_values_move_only_beyond_their_dead_band_and_observed_at_with_them():
    first = capacity.observe(progress({0: report(0.101, 612.0)}), 1, T0)
    later = T0 + timedelta(seconds=20)
    # 0.12 held, 660 tokens/s (+8%), 0.14 wait, 1300 undelivered: each within its band of 0.10, 610, 0.12, 1200
    same = capacity.observe(progress({0: report(0.12, 660.0)}, wait=0.14, backlog=Backlog(64, 1300)), 1, later, first)
    assert same is first  # nothing to write
    moved = capacity.observe(progress({0: report(0.13, 660.0)}), 1, later, first)
    assert (moved.held_share, moved.tokens_per_second, moved.observed_at) == (0.13, 610.0, later)
    assert capacity.observe(progress({0: report(0.101, 700.0)}), 1, later, first).tokens_per_second == 700.0
    gone = capacity.observe(progress({}), 1, later, first)
    assert (gone.held_share, gone.replicas_reporting) == (None, 0)  # not reported is never "close" to a value


def test_a_steady_running_job_writes_nothing_and_an_idle_one_drops_the_block():
    lc = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, reason=Reason.TRAINING, message="attempt 0 runs")
    pods = [trainer(0, 0), trainer(1, 0), rollout(0), rollout(1, deleting=True)]

    def build(previous, read, now, lifecycle=lc):
        return job_status.build_status(
            previous, generation=1, lifecycle=lifecycle, problems=[], data_parallel_size=2,
            redis=job_status.RedisHealth(True, "ok"), pods=pods, nodes=2, replicas=1, progress=read, now=now,
            rollout_selector="rljob.dev/job-name=demo,rljob.dev/role=rollout")

    first = build(RLTrainingJobStatus(), progress({0: report(0.2, 500.0)}), T0)
    assert first.capacity.held_share == 0.2 and first.rollout_replicas == 1
    assert first.rollout_selector == "rljob.dev/job-name=demo,rljob.dev/role=rollout"
    stored = job_status.to_json(first)
    assert stored["capacity"]["observedAt"] == "2026-01-01T12:00:00Z" and stored["rolloutReplicas"] == 1
    again = build(first, progress({0: report(0.201, 503.0)}), T0 + timedelta(seconds=5))
    assert job_status.status_patch(stored, again) is None  # noise within the rounding: no write
    assert build(first, None, T0 + timedelta(seconds=5)).capacity == first.capacity  # Redis not read: kept
    suspended = gang.Lifecycle(phase=Phase.SUSPENDED, reason=Reason.JOB_SUSPENDED, message="suspended")
    idle = build(first, None, T0 + timedelta(seconds=9), suspended)
    assert idle.capacity is None and job_status.status_patch(stored, idle)["status"]["capacity"] is None


def test_signals_need_every_input_and_read_the_undelivered_entries_as_the_backlog():
    seen = capacity.observe(progress({0: report(0.3, 480.0), 1: report(0.1, 520.0)}), 2, T0)
    assert capacity.signals(seen) == Signals(data_wait_share=0.12, held_share=0.2, tokens_per_s_per_replica=500.0,
                                             backlog=1200)
    for missing in ("data_wait_share", "held_share", "tokens_per_second_per_replica", "undelivered"):
        assert capacity.signals(seen.model_copy(update={missing: None})) is None, missing
    assert capacity.signals(None) is None


def test_described_in_words_with_not_reported_where_nothing_is():
    seen = capacity.observe(progress({0: report(0.3, 480.0), 1: report(0.1, 520.0)}), 2, T0)
    assert capacity.describe(job_status.to_json(RLTrainingJobStatus(capacity=seen))["capacity"]) == (
        "capacity: trainer waits 12%, rollouts held 20% (2 replicas reporting), 1000 tokens/s (500 per replica), "
        "backlog 1200 undelivered + 64 pending")
    bare = capacity.observe(progress({}, wait=None, backlog=None), 2, T0)
    assert capacity.describe(job_status.to_json(RLTrainingJobStatus(capacity=bare))["capacity"]) == (
        "capacity: trainer waits not reported, rollouts: no replica reporting, backlog not reported")
    assert capacity.describe(None) == "" and capacity.describe({}) == ""


def test_a_negative_replica_count_is_refused_naming_it():
    with pytest.raises(ValueError, match="replicas must be ≥ 0, got -1"):
        capacity.observe(progress({}), -1, T0)
