"""A rollout worker's capacity signals: time held by back-pressure and tokens sampled, and their rates over a window
(rljob_rollout.capacity), and the worker report that carries them (rljob_api.protocol.WorkerReport)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from rljob_api import protocol
from rljob_rollout.capacity import CapacityClock, sampled_tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_held_time_counts_from_the_first_check_without_room_to_the_next_with_room():
    clock = FakeClock()
    capacity = CapacityClock(window_s=30, clock=clock)
    clock.now += 4
    capacity.hold()
    clock.now += 3
    capacity.hold()  # still held: the hold began 3 s ago
    assert capacity.held and capacity.held_seconds() == 3
    clock.now += 2
    capacity.release()
    clock.now += 1
    capacity.release()
    assert not capacity.held and capacity.held_seconds() == 5
    capacity.generated(400)
    reading = capacity.sample()
    assert (reading.held_share, reading.tokens_per_second, reading.held_seconds, reading.tokens, reading.window_s) == (
        0.5, 40.0, 5.0, 400, 10.0)


def test_rates_cover_the_last_window_once_there_is_one():
    clock = FakeClock()
    capacity = CapacityClock(window_s=30, clock=clock)
    capacity.hold()
    for _ in range(6):  # 60 s held, read every 10 s
        clock.now += 10
        capacity.sample()
    capacity.release()
    for _ in range(3):  # then 30 s generating 100 tokens/s, read every 10 s
        clock.now += 10
        capacity.generated(1000)
        reading = capacity.sample()
    assert reading.window_s == 30 and reading.held_share == 0.0 and reading.tokens_per_second == 100.0
    assert reading.held_seconds == 60 and reading.tokens == 3000
    clock.now += 5
    capacity.hold()
    clock.now += 5
    reading = capacity.sample()  # from the reading 30 s ago (1000 tokens then) to now: 5 s held
    assert reading.window_s == 30 and reading.held_share == pytest.approx(5 / 30)
    assert reading.tokens_per_second == pytest.approx(2000 / 30)


def test_the_first_reading_has_no_window_and_due_follows_the_last_reading():
    clock = FakeClock()
    capacity = CapacityClock(clock=clock)
    assert capacity.sample().window_s == 0.0 and capacity.sample().held_share == 0.0
    assert not capacity.due(5.0)
    clock.now += 5
    assert capacity.due(5.0)
    capacity.sample()
    assert not capacity.due(5.0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="window_s must be > 0, got 0"):
        CapacityClock(window_s=0)
    with pytest.raises(ValueError, match="tokens must be >= 0, got -1"):
        CapacityClock().generated(-1)


@given(st.lists(st.tuples(st.floats(0, 50), st.booleans(), st.integers(0, 10_000)), min_size=1, max_size=30))
def test_shares_stay_in_0_1_and_totals_only_grow(steps):
    clock = FakeClock()
    capacity = CapacityClock(window_s=30, clock=clock)
    held_before = tokens_before = 0
    for seconds, hold, tokens in steps:
        capacity.hold() if hold else capacity.release()
        clock.now += seconds
        capacity.generated(tokens)
        reading = capacity.sample()
        assert 0.0 <= reading.held_share <= 1.0 and reading.tokens_per_second >= 0
        assert reading.held_seconds >= held_before and reading.tokens >= tokens_before
        held_before, tokens_before = reading.held_seconds, reading.tokens


def test_sampled_tokens_leave_out_the_masked_spans():
    assert sampled_tokens(range(20), [(3, 8), (12, 15)]) == 12
    assert sampled_tokens(range(5), []) == 5


def test_worker_reports_parse_what_workers_write_and_skip_what_they_do_not():
    report = protocol.WorkerReport(7, 12.5, 1700000000.0, held_share=0.25, tokens_per_second=300.0, held_seconds=9.5,
                                   window_s=30.0)
    rollout = {
        b"worker:0": report.to_field().encode(),
        "worker:1": json.dumps({"version": 7, "samples_per_second": 3.0, "updated_at": 1.0}),  # a worker older than capacity
        "worker:2": json.dumps({"held_share": 1.5, "tokens_per_second": -4, "held_seconds": "nan", "version": "x"}),
        "worker:x": report.to_field(), "worker:3": "not json", "reward": "0.5",
    }
    reports = protocol.worker_reports(rollout)
    assert reports[0] == report
    assert reports[1] == protocol.WorkerReport(7, 3.0, 1.0)
    assert reports[2] == protocol.WorkerReport(held_share=1.0)  # clipped; negative, non-finite and non-numbers dropped
    assert sorted(reports) == [0, 1, 2]
    assert protocol.parse_progress({}, rollout).workers == reports
    assert json.loads(protocol.WorkerReport(3).to_field()) == {"version": 3}


def test_trailing_rates_refuse_a_bad_width_and_readings_of_another_width():
    from rljob_api.rates import TrailingRates

    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        TrailingRates(1.0, 0.0, 0)
    rates = TrailingRates(1.0, 0.0, 2)
    with pytest.raises(ValueError, match="expected 2 totals, got 1"):
        rates.record(1.0, (1.0,))
    assert rates.record(0.0, (5.0, 5.0)) == ((0.0, 0.0), 0.0)
    assert rates.record(2.0, (4.0, 10.0)) == ((-0.5, 2.5), 2.0)  # from the reading at 0 s that is 1 s or more old
