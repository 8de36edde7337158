"""The one back-off schedule of the rollout worker (Redis outages, rewards that all fail)."""

from __future__ import annotations

import pytest

from rljob_rollout.backoff import JITTER_LOW, Backoff


def test_the_nominal_delay_doubles_to_the_cap_and_each_wait_is_jittered_below_it():
    backoff = Backoff(1.0, 60.0)
    assert [backoff.nominal(n) for n in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    for n in range(9):
        wait = backoff.next_wait()
        assert JITTER_LOW * backoff.nominal(n) <= wait <= backoff.nominal(n), (n, wait)
    assert backoff.waits == 9


def test_reset_starts_over_at_the_initial_delay():
    backoff = Backoff(0.5, 30.0)
    for _ in range(5):
        backoff.next_wait()
    backoff.reset()
    assert backoff.waits == 0 and 0.25 <= backoff.next_wait() <= 0.5


def test_waits_spread_over_the_jitter_range():
    waits = [Backoff(8.0, 8.0).next_wait() for _ in range(400)]
    assert min(waits) < 4.5 and max(waits) > 7.5  # 400 draws cover [4, 8] at both ends (the chance that they miss one end is below 1e-20)


@pytest.mark.parametrize(("initial", "cap", "factor"), [(0, 1, 2), (2, 1, 2), (1, 2, 0.5)])
def test_bounds_out_of_range_are_refused(initial, cap, factor):
    with pytest.raises(ValueError, match="back-off"):
        Backoff(initial, cap, factor)
