"""What a rollout worker measures of its own capacity (DESIGN §6 "Capacity signals"): the time back-pressure or max lag
held it, and the tokens it sampled, as running totals and as rates over the last :data:`CAPACITY_WINDOW_S` seconds.

A worker is *held* from the first check that finds no room for a group (``redis.maxPending`` or ``rollout.maxLag``,
:meth:`rljob_rollout.writer.DocumentWriter.wait_reason`) to the next check that finds room. Time spent otherwise idle
(no weights yet, the reward back-off) is neither held nor generating. Tokens are those the model sampled: an episode's
observation tokens (:attr:`~rljob_rollout.backends.base.Completion.masked_spans`) are not counted.

The worker reports :meth:`CapacityClock.sample` with every batch and, while held (when it writes no batch), every
:data:`CAPACITY_REPORT_S` seconds: its ``worker:{replica}`` field of the rollout hash
(:class:`rljob_api.protocol.WorkerReport`) and its Prometheus gauges. The operator averages the replicas' held shares
and adds their rates for ``status.capacity`` and the autoscaling law (:mod:`rljob_operator.autoscale`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from rljob_api.rates import TrailingRates

CAPACITY_WINDOW_S = 30.0
"""The window of the reported rates (seconds): long enough to span several trainer steps and batches, short enough
that a scaling decision reads the present."""
CAPACITY_REPORT_S = 5.0
"""How often a held worker, which writes no batch, reports its capacity (seconds)."""


@dataclass(frozen=True)
class Capacity:
    """One reading of :class:`CapacityClock`.

    Attributes:
        held_share: the share of the window the worker was held (0..1).
        tokens_per_second: tokens sampled per second over the window.
        held_seconds: time held since the worker started (seconds).
        tokens: tokens sampled since the worker started.
        window_s: the window the rates cover (seconds; shorter than :data:`CAPACITY_WINDOW_S` in the first one, 0
            at the very first reading, whose rates are then 0).
    """

    held_share: float
    tokens_per_second: float
    held_seconds: float
    tokens: int
    window_s: float


class CapacityClock:
    """Running totals of time held and tokens sampled, and their rates over a trailing window.

    Args:
        window_s: the rates' window (seconds, > 0).
        clock: a monotonic clock in seconds (``time.monotonic``; tests pass their own).

    Raises:
        ValueError: a window that is not positive.
    """

    def __init__(self, window_s: float = CAPACITY_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held_since: Optional[float] = None
        self._held = 0.0
        self.tokens = 0
        self._reported_at = clock()
        self._rates = TrailingRates(window_s, self._reported_at, 2)  # held seconds, tokens

    @property
    def held(self) -> bool:
        """Whether the worker is held now."""
        return self._held_since is not None

    def hold(self) -> None:
        """A check found no room: the worker is held from now (no-op while held)."""
        if self._held_since is None:
            self._held_since = self._clock()

    def release(self) -> None:
        """A check found room: the held time ends now (no-op while not held)."""
        if self._held_since is not None:
            self._held += self._clock() - self._held_since
            self._held_since = None

    def generated(self, tokens: int) -> None:
        """Count ``tokens`` sampled tokens (≥ 0).

        Raises:
            ValueError: a negative count.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self.tokens += tokens

    def held_seconds(self, now: Optional[float] = None) -> float:
        """Time held since the start, the current hold included (seconds)."""
        now = self._clock() if now is None else now
        return self._held + (now - self._held_since if self._held_since is not None else 0.0)

    def due(self, every_s: float = CAPACITY_REPORT_S) -> bool:
        """Whether ``every_s`` seconds have passed since the last :meth:`sample`."""
        return self._clock() - self._reported_at >= every_s

    def sample(self) -> Capacity:
        """The totals now and the rates over the last window: from the newest earlier reading at least ``window_s``
        old (or the oldest, in the first window) to now."""
        now = self._reported_at = self._clock()
        held = self.held_seconds(now)
        (share, tokens_per_second), span = self._rates.record(now, (held, float(self.tokens)))
        return Capacity(min(1.0, max(0.0, share)), tokens_per_second, held, self.tokens, span)


def sampled_tokens(token_ids: Sequence[int], masked_spans: Sequence[tuple[int, int]]) -> int:
    """Tokens of a completion the model sampled: its length less its masked spans (an episode's observations)."""
    return len(token_ids) - sum(end - begin for begin, end in masked_spans)
