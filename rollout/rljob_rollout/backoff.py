"""Jittered exponential back-off, the one schedule a rollout worker waits by (Redis outages, rewards that all fail).

The n-th consecutive wait (n = 0, 1, 2, ...) is ``uniform(JITTER_LOW, 1) × min(initial × factor^n, cap)`` seconds:
the nominal delay grows by ``factor`` up to ``cap``, and each wait is drawn between half of it and all of it, so
workers that started failing together do not retry in step. :meth:`Backoff.reset` starts over at ``initial``.
"""

from __future__ import annotations

import random

JITTER_LOW = 0.5
"""A wait is drawn uniformly between JITTER_LOW × the nominal delay and the nominal delay."""


class Backoff:
    """One back-off schedule (module docstring).

    Args:
        initial_s: the first nominal delay (seconds), > 0.
        cap_s: the largest nominal delay (seconds), >= ``initial_s``.
        factor: growth of the nominal delay per wait, >= 1.

    Attributes:
        waits: waits drawn since the last :meth:`reset`.

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, initial_s: float, cap_s: float, factor: float = 2.0) -> None:
        if not 0 < initial_s <= cap_s or factor < 1:
            raise ValueError(f"back-off: need 0 < initial_s ({initial_s}) <= cap_s ({cap_s}) and factor ({factor}) >= 1")
        self.initial_s, self.cap_s, self.factor = initial_s, cap_s, factor
        self.waits = 0

    def nominal(self, n: int) -> float:
        """The nominal delay of the ``n``-th consecutive wait (n = 0 first): min(initial × factor^n, cap), seconds."""
        delay = self.initial_s
        for _ in range(n):
            delay = min(delay * self.factor, self.cap_s)
            if delay == self.cap_s:
                break
        return delay

    def next_wait(self) -> float:
        """The next wait (seconds), drawn in [JITTER_LOW, 1] × :meth:`nominal` of the waits so far; counts it."""
        wait = random.uniform(JITTER_LOW, 1.0) * self.nominal(self.waits)
        self.waits += 1
        return wait

    def reset(self) -> None:
        """Start over: the next wait is drawn around ``initial_s`` again."""
        self.waits = 0
