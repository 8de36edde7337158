"""The trainer's data-wait share over a trailing window (DESIGN §6 "Capacity signals"): how much of its time global
rank 0 spends waiting for documents, the signal that says the rollouts do not keep up. Per step the wait is
``data_wait_time_ms`` (the XREADGROUP replies awaited, less decoding) and the wall time runs from one step's start to
the next's, so the reports and checkpoints between steps count as time not waiting."""

from __future__ import annotations

import time
from typing import Callable, Optional

from rljob_api.rates import TrailingRates

DATA_WAIT_WINDOW_S = 30.0
"""The window of the share (seconds), as the rollouts' held share (``rljob_rollout.capacity.CAPACITY_WINDOW_S``)."""


class DataWaitWindow:
    """The share of the last ``window_s`` seconds of steps spent waiting for data.

    Args:
        window_s: the window (seconds, > 0); it reaches back to the start of the step that began before it.
        clock: a monotonic clock in seconds (``time.monotonic``; tests pass their own).

    Raises:
        ValueError: a window that is not positive.
    """

    def __init__(self, window_s: float = DATA_WAIT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._rates: Optional[TrailingRates] = None
        self._waited_s = 0.0

    def step_started(self) -> None:
        """Mark the start of a step (before its read): the first one starts the window."""
        if self._rates is None:
            self._rates = TrailingRates(self.window_s, self._clock(), 1)

    def waited(self, ms: float) -> float:
        """Add a step's data wait (milliseconds, ≥ 0) and return the share (0..1) of the window to now spent waiting;
        0 before the window has a length.

        Raises:
            ValueError: a negative wait, or no step started.
        """
        if ms < 0:
            raise ValueError(f"a data wait must be >= 0 ms, got {ms}")
        if self._rates is None:
            raise ValueError("waited() before step_started()")
        self._waited_s += ms / 1e3
        (share,), _ = self._rates.record(self._clock(), (self._waited_s,))
        return min(1.0, share)
