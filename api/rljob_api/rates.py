"""Rates of running totals over a trailing window, as the capacity signals use them (DESIGN §6 "Capacity signals"):
the trainer's data-wait share and a rollout worker's held share and tokens per second."""

from __future__ import annotations

from collections import deque


class TrailingRates:
    """Readings of running totals; the rates between the newest reading at least ``window_s`` old (or the oldest one,
    in the first window) and the latest.

    Args:
        window_s: the window (seconds, > 0).
        start: the time of the first reading, every total 0 (seconds, the caller's monotonic clock).
        width: how many totals each reading holds.

    Raises:
        ValueError: a window that is not positive, or a width below 1.
    """

    def __init__(self, window_s: float, start: float, width: int) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.window_s = window_s
        self._readings: deque[tuple[float, tuple[float, ...]]] = deque([(start, (0.0,) * width)])

    def record(self, now: float, totals: tuple[float, ...]) -> tuple[tuple[float, ...], float]:
        """Add the reading ``totals`` at ``now``; return (the totals' rates per second over the window, the window's
        length in seconds). The rates are 0 over a window of no length.

        Raises:
            ValueError: ``totals`` of another width.
        """
        if len(totals) != len(self._readings[0][1]):
            raise ValueError(f"expected {len(self._readings[0][1])} totals, got {len(totals)}")
        self._readings.append((now, totals))
        while len(self._readings) > 2 and self._readings[1][0] <= now - self.window_s:
            self._readings.popleft()
        then, before = self._readings[0]
        span = now - then
        if span <= 0:
            return (0.0,) * len(totals), 0.0
        return tuple((total - old) / span for total, old in zip(totals, before)), span
