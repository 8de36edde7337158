"""The trainer's data-wait share over a trailing window (rljob_trainer.data_wait)."""

from __future__ import annotations

import pytest

from rljob_trainer.data_wait import DataWaitWindow


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def step(window: DataWaitWindow, clock: FakeClock, wait_s: float, rest_s: float) -> float:
    window.step_started()
    clock.now += wait_s + rest_s
    return window.waited(wait_s * 1e3)


def test_the_share_is_the_wait_over_the_wall_time_of_the_steps_in_the_window():
    clock = FakeClock()
    window = DataWaitWindow(window_s=10, clock=clock)
    assert step(window, clock, 1.0, 1.0) == 0.5
    assert step(window, clock, 0.0, 2.0) == 0.25  # 1 s of 4
    for _ in range(5):  # 10 s without waiting: the first two steps leave the window
        share = step(window, clock, 0.0, 2.0)
    assert share == 0.0
    assert step(window, clock, 2.0, 0.0) == pytest.approx(2.0 / 10.0)  # the steps started in the last 10 s


def test_a_step_longer_than_the_window_is_judged_alone_and_bad_calls_are_refused():
    clock = FakeClock()
    window = DataWaitWindow(window_s=1, clock=clock)
    assert step(window, clock, 3.0, 1.0) == 0.75
    window.step_started()
    assert window.waited(0.0) == 0.75  # the window reaches back to the start of the step that began before it
    with pytest.raises(ValueError, match="a data wait must be >= 0 ms, got -1"):
        window.waited(-1)
    with pytest.raises(ValueError, match="waited\\(\\) before step_started\\(\\)"):
        DataWaitWindow().waited(1.0)
    with pytest.raises(ValueError, match="window_s must be > 0, got -2"):
        DataWaitWindow(window_s=-2)
