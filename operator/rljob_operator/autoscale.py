"""The rollout autoscaling control law (issue 28): how many rollout replicas a job should run, decided from what the
trainer and the rollouts measured over the last window. Pure: no Kubernetes, no clock, no Redis; the caller passes
everything in and posts the decision's reason as an Event.

Signals (:class:`Signals`, one measurement window):

- ``w``: the trainer's **data-wait share**, the share of its step time it spent waiting for documents (0..1);
- ``h``: the rollouts' **back-pressure share**, the replicas' mean share of the window held by back-pressure
  (``maxLag``/``maxPending``) instead of generating (0..1);
- tokens/s per replica and the stream **backlog** (undelivered entries, documents).

**The estimate.** Over a window the documents written match the documents trained (the backlog is bounded by
``maxLag``): ``N·r·(1 − h) ≈ C·(1 − w)``, with ``N`` replicas of ``r`` documents/s each and a trainer that consumes
``C`` documents/s while it does not wait. The replicas whose output the trainer consumes exactly are then::

    needed = C / r ≈ N · (1 − h) / (1 − w)            (1 − w floored at WAIT_FLOOR)

With ``n < needed`` replicas the trainer waits ``1 − n/needed`` of its step. Two counts follow, for the target
data-wait share ``w*`` and the hysteresis band ``b``::

    up_to   = ceil(needed · (1 − w*))    the fewest replicas that keep the trainer's wait at the target
    down_to = ceil(needed · (1 + b))     the fewest that feed the trainer fully with a band of capacity to spare

each clamped to ``[min_replicas, max_replicas]`` and to ``max_step`` replicas from ``N``. The step is proportional to
the imbalance: one replica that leaves the trainer waiting 5/6 of its steps asks for 6.

**The law**, first match wins:

1. ``N`` outside ``[min_replicas, max_replicas]`` (the policy changed): to the nearest bound at once.
2. **Cooldown**: less than ``cooldown_s`` since the last change: hold. The cooldown should exceed a new replica's
   start (image, model, first weights) plus the measurement window, so that a decision sees the last one's effect.
3. No tokens generated in the window: hold, the window says nothing about capacity.
4. **Scale up** to ``up_to`` while the trainer waits and the rollouts are not held: ``w > w* + b``, ``h ≤ held_share``
   and ``up_to > N``.
5. **Scale down** to ``down_to`` while the rollouts are held and the trainer does not wait: ``h > held_share``,
   ``w ≤ w*``, a non-empty backlog (rollouts held with nothing queued wait on checkpoints through ``maxPending``:
   that is not surplus capacity) and ``down_to < N``.
6. Otherwise hold; the reason says which condition kept the count.

**Hysteresis.** Replicas are added when ``needed > N / (1 − w* − b)`` and removed (with the rollouts held) when
``needed ≤ (N − 1) / (1 + b)``: between ``n`` and ``n + 1`` replicas the estimate must move by a factor
``(1 + b) / (1 − w* − b)`` (1.17 with the defaults) before a change is undone, several times the noise of a window of
32 trainer steps (2–3% in the simulation, benchmarks/autoscale_sim.py). On a noise-free pipeline the law holds at the
count it reaches, from either side (``up_to`` keeps the wait within the target, ``down_to`` leaves the rollouts room).
The price of the spare band: coming from above, a need within ``b`` below a whole count keeps one replica more (a need
of exactly 2.0 keeps 3). The cooldown keeps the transients after a change out of the next decision; the signals should
cover enough trainer steps to average out batch boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Optional

WAIT_FLOOR = 0.05
"""``1 − w`` is floored here in the estimate, so a trainer that waited all the window (``w`` = 1) asks for at most
20× the replicas (then bounded by ``max_step`` and ``max_replicas``) instead of infinitely many."""


class Direction(str, Enum):
    """Which way a decision moves the replica count."""

    UP = "up"
    DOWN = "down"
    HOLD = "hold"


def _share(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a share in [0, 1], got {value}")


@dataclass(frozen=True)
class Policy:
    """What the user asks of the autoscaler (``spec.rollout.autoscaling`` later).

    Attributes:
        min_replicas: the fewest rollout replicas (≥ 1).
        max_replicas: the most rollout replicas (≥ ``min_replicas``).
        target_wait_share: the trainer's data-wait share the law aims at (0..1, below 1; default 0.05: 5% of a step).
        cooldown_s: seconds after a change before the next one (default 300); longer than a replica's start plus the
            measurement window.
        band: the hysteresis band (a share, default 0.05): replicas are added only while the wait share exceeds
            ``target_wait_share + band``, and removed only down to the count that feeds the trainer with ``band`` of
            capacity to spare.
        held_share: the back-pressure share above which the rollouts count as held (default 0.10); at or below it they
            count as not held.
        max_step: the most replicas one decision adds or removes (≥ 1; default 4).

    Raises:
        ValueError: a bound or share out of range; the message names the field and its value.
    """

    min_replicas: int
    max_replicas: int
    target_wait_share: float = 0.05
    cooldown_s: float = 300.0
    band: float = 0.05
    held_share: float = 0.10
    max_step: int = 4

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below min_replicas {self.min_replicas}")
        if not 0.0 <= self.target_wait_share < 1.0:
            raise ValueError(f"target_wait_share must be in [0, 1), got {self.target_wait_share}")
        if self.band < 0.0 or self.target_wait_share + self.band >= 1.0:
            raise ValueError(f"band must be ≥ 0 with target_wait_share + band < 1, got {self.band}")
        _share("held_share", self.held_share)
        if self.cooldown_s < 0.0:
            raise ValueError(f"cooldown_s must be ≥ 0, got {self.cooldown_s}")
        if self.max_step < 1:
            raise ValueError(f"max_step must be at least 1, got {self.max_step}")


@dataclass(frozen=True)
class Signals:
    """What the trainer and the rollouts measured over one window.

    Attributes:
        data_wait_share: the trainer's time waiting for documents over its step time (0..1).
        held_share: the rollout replicas' mean share of the window held by back-pressure (0..1).
        tokens_per_s_per_replica: tokens generated per second per replica (≥ 0).
        backlog: undelivered stream entries at the window's end (documents, ≥ 0).

    Raises:
        ValueError: a share outside [0, 1] or a negative rate or backlog.
    """

    data_wait_share: float
    held_share: float
    tokens_per_s_per_replica: float
    backlog: int

    def __post_init__(self) -> None:
        _share("data_wait_share", self.data_wait_share)
        _share("held_share", self.held_share)
        if self.tokens_per_s_per_replica < 0.0:
            raise ValueError(f"tokens_per_s_per_replica must be ≥ 0, got {self.tokens_per_s_per_replica}")
        if self.backlog < 0:
            raise ValueError(f"backlog must be ≥ 0, got {self.backlog}")


@dataclass(frozen=True)
class Decision:
    """The law's answer: ``replicas`` to run (the current count on a hold), the ``direction`` and a one-line
    ``reason`` with the numbers used (an Event message). ``needed`` is the estimate of replicas that would feed the
    trainer exactly (None when the law decided before estimating)."""

    replicas: int
    direction: Direction
    reason: str
    needed: Optional[float] = None

    @property
    def changed(self) -> bool:
        """Whether the count moves (up or down)."""
        return self.direction is not Direction.HOLD


def needed_replicas(replicas: int, signals: Signals) -> float:
    """``N · (1 − h) / (1 − w)``: the replicas whose output the trainer would consume exactly (fractional)."""
    return replicas * (1.0 - signals.held_share) / max(WAIT_FLOOR, 1.0 - signals.data_wait_share)


def _pct(share: float) -> str:
    return f"{100.0 * share:.1f}%"


def decide(policy: Policy, replicas: int, since_last_change_s: float, signals: Signals) -> Decision:
    """The rollout replica count for the next period (the law in this module's docstring).

    Args:
        policy: the bounds, target, band and cooldown.
        replicas: the current count (≥ 0).
        since_last_change_s: seconds since the count last changed, or since the rollouts started; ``math.inf`` when
            there is no such time.
        signals: the last window's measurements.

    Raises:
        ValueError: a negative ``replicas`` or ``since_last_change_s``.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be ≥ 0, got {replicas}")
    if since_last_change_s < 0.0:
        raise ValueError(f"since_last_change_s must be ≥ 0, got {since_last_change_s}")
    lo, hi = policy.min_replicas, policy.max_replicas
    if not lo <= replicas <= hi:
        bound = min(max(replicas, lo), hi)
        return Decision(bound, Direction.UP if bound > replicas else Direction.DOWN,
                        f"rollout replicas {replicas} → {bound}: outside minReplicas {lo} .. maxReplicas {hi}")
    if since_last_change_s < policy.cooldown_s:
        return Decision(replicas, Direction.HOLD, f"rollout replicas held at {replicas}: cooldown, "
                        f"{since_last_change_s:.0f} s of {policy.cooldown_s:.0f} s since the last change")
    w, h, target = signals.data_wait_share, signals.held_share, policy.target_wait_share
    measured = (f"trainer data-wait {_pct(w)} (target {_pct(target)}, band {_pct(policy.band)}), "
                f"rollouts held by back-pressure {_pct(h)} (threshold {_pct(policy.held_share)}), "
                f"{signals.tokens_per_s_per_replica:.0f} tokens/s per replica, backlog {signals.backlog}")
    if signals.tokens_per_s_per_replica <= 0.0:
        return Decision(replicas, Direction.HOLD,
                        f"rollout replicas held at {replicas}: no tokens generated in the window; {measured}")
    needed = needed_replicas(replicas, signals)
    up_to = math.ceil(needed * (1.0 - target) - 1e-9)
    down_to = math.ceil(needed * (1.0 + policy.band) - 1e-9)
    estimate = f"needed ≈ {replicas} × (1 − {h:.3f}) / (1 − {w:.3f}) = {needed:.2f}"
    waits, held = w > target + policy.band, h > policy.held_share
    if waits and not held and up_to > replicas and replicas < hi:
        new = min(up_to, hi, replicas + policy.max_step)
        return Decision(new, Direction.UP, f"rollout replicas {replicas} → {new}: the trainer waits for data and the "
                        f"rollouts are not held; {measured}; {estimate}, {up_to} keep the wait at target", needed)
    surplus = held and w <= target and signals.backlog > 0
    if surplus and down_to < replicas and replicas > lo:
        new = max(down_to, lo, replicas - policy.max_step)
        return Decision(new, Direction.DOWN, f"rollout replicas {replicas} → {new}: the rollouts are held and the "
                        f"trainer does not wait; {measured}; {estimate}, {down_to} feed it with "
                        f"{_pct(policy.band)} to spare", needed)
    if waits and held:
        why = "the trainer waits while the rollouts are held, not a capacity imbalance"
    elif waits:
        why = f"at maxReplicas {hi}" if up_to > replicas else f"the trainer waits but {up_to} would do"
    elif surplus:
        why = (f"at minReplicas {lo}" if down_to < replicas
               else f"the rollouts are held but {down_to} feed the trainer with {_pct(policy.band)} to spare")
    elif held and w > target:
        why = "the rollouts are held but the trainer waits above its target"
    elif held:
        why = "the rollouts are held with an empty backlog (waiting on checkpoints through maxPending, not surplus)"
    else:
        why = "balanced"
    return Decision(replicas, Direction.HOLD, f"rollout replicas held at {replicas}: {why}; {measured}; {estimate}",
                    needed)
