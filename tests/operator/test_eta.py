"""Progress percent and the estimated time left (rljob_operator.eta, KEP-2779's fields), and how a pass sets them."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from rljob_api import protocol
from rljob_api.constants import Phase
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import eta, job_status

from operator_helpers import T0, trainer
from test_status_health import READY, RUNNING


def test_the_rate_is_measured_on_the_trainers_writes_over_the_last_ten_minutes():
    rate = eta.StepRate()
    assert rate.per_second() is None
    rate.add(1000.0, 10)
    rate.add(1000.0, 10)  # the same write read again
    rate.add(None, 11)  # unknown time
    assert rate.per_second() is None
    rate.add(1020.0, 12)
    assert rate.per_second() == 0.1  # 2 steps in 20 s
    for second in range(1040, 1700, 20):  # then 1 step per 20 s... until 1680
        rate.add(float(second), 12 + (second - 1020) // 20)
    assert rate.samples[0][0] >= 1680 - eta.WINDOW_S - 20 and rate.per_second() == 0.05
    rate.add(1700.0, 3)  # a gang restart went back to an older checkpoint: the window starts over
    assert list(rate.samples) == [(1700.0, 3)] and rate.per_second() is None


def test_percent_rounds_down_and_the_time_left_is_rounded_up_for_fewer_status_writes():
    assert [eta.progress_percentage(s, 300) for s in (0, 2, 3, 299, 300, 400, -1)] == [0, 0, 1, 99, 100, 100, 0]
    assert eta.remaining_seconds(90, 100, 1.0) == 10  # 10 s
    assert eta.remaining_seconds(91, 100, 1.0) == 10  # 9 s -> 10
    assert eta.remaining_seconds(0, 100, 0.5) == 240  # 200 s -> 4 minutes
    assert eta.remaining_seconds(0, 10_000, 1.0) == 10_200  # 2h46m40s -> 2h50m
    assert eta.remaining_seconds(100, 100, 1.0) == 0
    assert [eta.duration_summary(s) for s in (0, 40, 60, 720, 3600, 4800, 86400, 183600)] == [
        "0s", "40s", "1m", "12m", "1h", "1h20m", "1d", "2d3h"]


def _pass(previous, seconds, phase_lifecycle, fetched, rate):
    return job_status.build_status(
        previous, generation=1, lifecycle=phase_lifecycle, problems=[], data_parallel_size=2, redis=READY,
        pods=[trainer(0, 0), trainer(1, 0)], nodes=2, replicas=1, progress=fetched,
        now=T0 + timedelta(seconds=seconds), max_steps=200, steps_per_second=rate)


def test_a_running_job_shows_percent_and_eta_kept_between_reads_and_cleared_when_it_stops_running():
    at_50 = protocol.parse_progress({"step": "50", "updated_at": "1000.5"}, {})
    assert at_50.updated_at == 1000.5
    first = _pass(RLTrainingJobStatus(), 0, RUNNING, at_50, None)  # one sample: no rate yet
    assert (first.progress_percentage, first.estimated_remaining_seconds) == (25, None)
    running = _pass(first, 5, RUNNING, at_50, 0.5)  # 150 steps at 0.5/s
    assert (running.progress_percentage, running.estimated_remaining_seconds,
            running.estimated_remaining_time_summary) == (25, 300, "5m")
    json = job_status.to_json(running)
    assert (json["progressPercentage"], json["estimatedRemainingSeconds"],
            json["estimatedRemainingTimeSummary"]) == (25, 300, "5m")
    unread = _pass(running, 10, RUNNING, None, 0.5)  # a pass that did not read Redis keeps the estimate
    assert job_status.status_patch(job_status.to_json(running), unread) is None
    restarting = _pass(running, 15, replace(RUNNING, phase=Phase.RESTARTING), None, 0.5)
    assert (restarting.progress_percentage, restarting.estimated_remaining_seconds) == (25, None)
    patch = job_status.status_patch(job_status.to_json(running), restarting)["status"]
    assert (patch["phase"], patch["estimatedRemainingSeconds"], patch["estimatedRemainingTimeSummary"]) == (
        "Restarting", None, None)
    done = _pass(running, 20, replace(RUNNING, phase=Phase.SUCCEEDED),
                 protocol.parse_progress({"step": "200"}, {}), 0.5)
    assert (done.progress_percentage, done.estimated_remaining_seconds, done.estimated_remaining_time_summary) == (
        100, None, None)
