"""A simulated streaming RL pipeline for the rollout autoscaling law (:mod:`rljob_operator.autoscale`), in simulated
time: a trainer, rollout replicas and the bounded stream between them, measured per window the way the law sees them.
Deterministic for a seed; an hour of simulated pipeline takes milliseconds. Used by benchmarks/autoscale.py and
tests/operator/test_autoscale_law.py.

The model (:class:`Pipeline`):

- **Trainer**: takes ``batch_documents`` undelivered documents as soon as there are that many, then trains for
  ``step_s`` seconds (log-normal noise ``step_noise``, mean kept); the time without a full batch is its data wait.
  It consumes ``C = batch_documents / step_s`` documents/s while it does not wait.
- **Rollout replicas**: each starts ``start_s`` seconds after it is added (image, model, first weights), then keeps
  ``concurrency`` groups of ``group_documents`` documents in flight, each taking ``group_s`` seconds on average
  (log-normal noise ``group_noise``, mean kept): ``r = concurrency · group_documents / group_s`` documents/s. After
  ``slowdown_after_documents`` trained documents the groups take ``slowdown`` times longer (answers grow longer as a
  policy learns).
- **Stream and back-pressure**: a group starts only while the undelivered documents plus the documents in flight plus
  its own stay within ``max_lag``; otherwise its slot is held until the trainer takes a batch. A removed replica goes at
  once, abandoning its groups in flight (counted).

Every ``tick_s`` the simulation measures :class:`rljob_operator.autoscale.Signals` over the last ``window_s`` (the
part of it after the last change settled, ``start_s`` after it): the trainer's wait over its wait plus training
time, the replicas' held slot-time over their running slot-time (starting replicas excluded), tokens per second per
running replica, and the undelivered documents at the end. With a policy it then asks
:func:`rljob_operator.autoscale.decide` and applies the decision at once. :func:`timing` gives the tick, window and
cooldown the tests and the benchmark use: a window of :data:`WINDOW_STEPS` trainer steps, and a cooldown of a replica's
start plus a window plus a tick.

Reward (:class:`RewardCurve`) is a function of trained documents only, ``1 − (1 − start)·exp(−documents / scale)``, so
the time to a reward is set by the pipeline's throughput.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from rljob_operator.autoscale import Decision, Direction, Policy, Signals, decide


@dataclass(frozen=True)
class Pipeline:
    """The simulated pipeline's parameters (seconds, documents, tokens)."""

    step_s: float = 8.0
    batch_documents: int = 64
    group_s: float = 22.0
    group_documents: int = 8
    concurrency: int = 4
    tokens_per_document: int = 512
    group_noise: float = 0.3
    step_noise: float = 0.05
    max_lag: int = 1024
    start_s: float = 60.0
    slowdown_after_documents: Optional[int] = None
    slowdown: float = 1.0

    @classmethod
    def needing(cls, needed: float, **fields: Any) -> Pipeline:
        """A pipeline whose trainer needs ``needed`` replicas (``group_s`` set from the other fields)."""
        base = cls(**fields)
        consumption = base.batch_documents / base.step_s
        group_s = base.concurrency * base.group_documents * needed / consumption
        return cls(**{**fields, "group_s": group_s})

    def needed(self, slowed: bool = False) -> float:
        """The replicas that feed the trainer exactly, ``C / r`` (fractional), before or after the slowdown."""
        per_replica = self.concurrency * self.group_documents / (self.group_s * (self.slowdown if slowed else 1.0))
        return self.batch_documents / self.step_s / per_replica


WINDOW_STEPS = 32
"""The measurement window in trainer steps: enough to average out batch boundaries and group noise."""


def timing(pipeline: Pipeline, steps: int = WINDOW_STEPS) -> tuple[float, float, float]:
    """``(tick_s, window_s, cooldown_s)`` for ``pipeline``, seconds: a window of ``steps`` trainer steps, a decision
    every quarter window, and a cooldown of a replica's start plus a window plus a tick."""
    window_s = steps * pipeline.step_s
    tick_s = window_s / 4
    return tick_s, window_s, pipeline.start_s + window_s + tick_s


def balanced_counts(pipeline: Pipeline, policy: Policy, slowed: bool = False) -> range:
    """The replica counts the law holds on this pipeline without noise: from the fewest that keep the trainer's wait
    ``1 − n/needed`` within target + band, to the most it would not remove one from (rollouts held at most
    ``held_share``, or no more than ``ceil(needed · (1 + band))``), clamped to the policy's bounds."""
    needed = pipeline.needed(slowed)
    low = math.ceil(needed * (1.0 - policy.target_wait_share - policy.band) - 1e-9)
    high = max(math.floor(needed / (1.0 - policy.held_share) + 1e-9), math.ceil(needed * (1.0 + policy.band) - 1e-9))
    low = min(max(low, policy.min_replicas), policy.max_replicas)
    high = min(max(high, low), policy.max_replicas)
    return range(low, high + 1)


@dataclass(frozen=True)
class RewardCurve:
    """Reward as a saturating function of trained documents: ``1 − (1 − start)·exp(−documents / scale)``."""

    start: float = 0.1
    scale: float = 13_000.0

    def reward(self, documents: float) -> float:
        return 1.0 - (1.0 - self.start) * math.exp(-documents / self.scale)

    def documents_to(self, reward: float) -> float:
        """Trained documents at which the curve reaches ``reward``.

        Raises:
            ValueError: ``reward`` not in (start, 1).
        """
        if not self.start < reward < 1.0:
            raise ValueError(f"reward {reward} is not between the curve's start {self.start} and 1")
        return self.scale * math.log((1.0 - self.start) / (1.0 - reward))


@dataclass(frozen=True)
class Tick:
    """One decision point: its time (s), the replica count before it, the signals over the measurement window that
    ended then, and the law's decision (None without a policy)."""

    end_s: float
    replicas: int
    signals: Signals
    decision: Optional[Decision]


@dataclass
class Run:
    """What one simulation did: every tick, the time (s) the trained documents reached the target (None if not),
    trained documents, replica-seconds spent (starting ones included), groups abandoned by removed replicas and the
    time (s) the groups slowed down (None if they did not)."""

    ticks: list[Tick] = field(default_factory=list)
    reached_s: Optional[float] = None
    trained: int = 0
    replica_seconds: float = 0.0
    abandoned_groups: int = 0
    slowed_at_s: Optional[float] = None

    @property
    def changes(self) -> list[Tick]:
        """The ticks whose decision changed the count."""
        return [t for t in self.ticks if t.decision is not None and t.decision.changed]


@dataclass(frozen=True)
class _Totals:
    """Raw sums of one tick (seconds, tokens) and the backlog at its end (documents)."""

    start_s: float
    wait: float
    busy: float
    held: float
    running: float
    tokens: int
    backlog: int


@dataclass
class _Slot:
    """One of a replica's ``concurrency`` generation slots (a group at a time)."""

    owner: int
    state: str  # "starting", "generating", "held"
    since: float
    buckets: dict[str, float] = field(default_factory=lambda: {"starting": 0.0, "generating": 0.0, "held": 0.0})


class _Simulation:
    """One run's state, advanced event by event (ticks, replica starts, finished groups, finished steps)."""

    def __init__(self, pipeline: Pipeline, replicas: int, policy: Optional[Policy], seed: int, tick_s: float,
                 window_s: float):
        self.p, self.policy, self.tick_s = pipeline, policy, tick_s
        self.window_ticks = max(1, round(window_s / tick_s))
        self.totals: list[_Totals] = []
        self.rng = random.Random(seed)
        self.now = 0.0
        self.events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, slot id); ids are never reused
        self.seq = 0
        self.undelivered = 0
        self.in_flight = 0
        self.trained = 0
        self.slots: dict[int, _Slot] = {}
        self.owners: list[int] = []  # replica ids, oldest first
        self.next_id = 0
        self.held: list[int] = []  # slot ids in the order they were held
        self.trainer_state, self.trainer_since = "waiting", 0.0
        self.trainer_buckets = {"waiting": 0.0, "training": 0.0}
        self.tick_tokens = 0
        self.last_change = 0.0
        self.run = Run()
        self._add(replicas)

    # ---- events
    def _push(self, at: float, kind: str, slot: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, slot))

    @staticmethod
    def _noisy(mean: float, sigma: float, rng: random.Random) -> float:
        return mean * math.exp(sigma * rng.gauss(0.0, 1.0) - sigma * sigma / 2.0) if sigma > 0 else mean

    # ---- replicas
    def _set(self, sid: int, state: str) -> None:
        slot = self.slots[sid]
        slot.buckets[slot.state] += self.now - slot.since
        slot.state, slot.since = state, self.now

    def _add(self, count: int) -> None:
        for _ in range(count):
            self.owners.append(self.next_id)
            for _ in range(self.p.concurrency):
                self.slots[self.next_id] = _Slot(self.owners[-1], "starting", self.now)
                self._push(self.now + self.p.start_s, "started", self.next_id)
                self.next_id += 1

    def _remove(self, count: int) -> None:
        gone = set(self.owners[len(self.owners) - count:])  # the newest first
        self.owners = self.owners[:len(self.owners) - count]
        for sid in [sid for sid, slot in self.slots.items() if slot.owner in gone]:
            if self.slots.pop(sid).state == "generating":
                self.in_flight -= self.p.group_documents
                self.run.abandoned_groups += 1
        self.held = [sid for sid in self.held if sid in self.slots]
        self._release()

    def _try_generate(self, sid: int) -> None:
        g = self.p.group_documents
        if self.undelivered + self.in_flight + g > self.p.max_lag:
            self._set(sid, "held")
            self.held.append(sid)
            return
        self._set(sid, "generating")
        self.in_flight += g
        mean = self.p.group_s * (self.p.slowdown if self.run.slowed_at_s is not None else 1.0)
        self._push(self.now + self._noisy(mean, self.p.group_noise, self.rng), "group", sid)

    def _release(self) -> None:
        while self.held and self.undelivered + self.in_flight + self.p.group_documents <= self.p.max_lag:
            self._try_generate(self.held.pop(0))

    # ---- trainer
    def _trainer_set(self, state: str) -> None:
        self.trainer_buckets[self.trainer_state] += self.now - self.trainer_since
        self.trainer_state, self.trainer_since = state, self.now

    def _trainer_take(self) -> None:
        if self.trainer_state == "waiting" and self.undelivered >= self.p.batch_documents:
            self.undelivered -= self.p.batch_documents
            self._trainer_set("training")
            self._push(self.now + self._noisy(self.p.step_s, self.p.step_noise, self.rng), "step")
            self._release()

    # ---- measurement and decisions
    def _totals(self) -> _Totals:
        self._trainer_set(self.trainer_state)
        wait, busy = self.trainer_buckets["waiting"], self.trainer_buckets["training"]
        self.trainer_buckets = {"waiting": 0.0, "training": 0.0}
        held = running = 0.0
        for sid, slot in self.slots.items():
            self._set(sid, slot.state)
            held += slot.buckets["held"]
            running += slot.buckets["held"] + slot.buckets["generating"]
            slot.buckets = {"starting": 0.0, "generating": 0.0, "held": 0.0}
        tokens, self.tick_tokens = self.tick_tokens, 0
        c = self.p.concurrency  # slot-seconds to replica-seconds
        return _Totals(self.now - self.tick_s, wait, busy, held / c, running / c, tokens, self.undelivered)

    def _signals(self) -> Signals:
        """Over the last ``window_s`` of ticks that began once the last change settled (``start_s`` after it), or
        the last tick alone before there is one."""
        settled = self.last_change + self.p.start_s
        recent = [t for t in self.totals[-self.window_ticks:] if t.start_s >= settled - 1e-9] or self.totals[-1:]
        wait, busy = sum(t.wait for t in recent), sum(t.busy for t in recent)
        held, running = sum(t.held for t in recent), sum(t.running for t in recent)
        return Signals(data_wait_share=wait / (wait + busy) if wait + busy > 0 else 0.0,
                       held_share=held / running if running > 0 else 0.0,
                       tokens_per_s_per_replica=sum(t.tokens for t in recent) / running if running > 0 else 0.0,
                       backlog=recent[-1].backlog)

    def _tick(self) -> None:
        replicas = len(self.owners)
        self.totals.append(self._totals())
        signals = self._signals()
        decision = None
        if self.policy is not None:
            decision = decide(self.policy, replicas, self.now - self.last_change, signals)
            if decision.direction is Direction.UP:
                self._add(decision.replicas - replicas)
            elif decision.direction is Direction.DOWN:
                self._remove(replicas - decision.replicas)
            if decision.changed:
                self.last_change = self.now
        self.run.ticks.append(Tick(self.now, replicas, signals, decision))

    def simulate(self, until_documents: Optional[float], duration_s: float) -> Run:
        self._push(self.tick_s, "tick")
        while self.events:
            at, _, kind, sid = heapq.heappop(self.events)
            if at > duration_s:
                break
            self.run.replica_seconds += len(self.owners) * (at - self.now)
            self.now = at
            if kind == "tick":
                self._tick()
                self._push(self.now + self.tick_s, "tick")
            elif kind == "started" and sid in self.slots:
                self._try_generate(sid)
            elif kind == "group" and sid in self.slots:  # a removed replica's group was abandoned
                g = self.p.group_documents
                self.in_flight -= g
                self.undelivered += g
                self.tick_tokens += g * self.p.tokens_per_document
                self._try_generate(sid)
                self._trainer_take()
            elif kind == "step":
                self.trained += self.p.batch_documents
                after = self.p.slowdown_after_documents
                if self.run.slowed_at_s is None and after is not None and self.trained >= after:
                    self.run.slowed_at_s = self.now
                self._trainer_set("waiting")
                if until_documents is not None and self.trained >= until_documents:
                    self.run.reached_s = self.now
                    break
                self._trainer_take()
        self.run.trained = self.trained
        return self.run


def simulate(pipeline: Pipeline, replicas: int, policy: Optional[Policy] = None, seed: int = 0,
             tick_s: float = 60.0, window_s: float = 240.0, duration_s: float = 4 * 3600.0,
             until_documents: Optional[float] = None) -> Run:
    """Run ``pipeline`` from ``replicas`` replicas (all starting at time 0) for ``duration_s`` simulated seconds, or
    until the trainer has trained ``until_documents``. Every ``tick_s`` seconds the signals are measured over the last
    ``window_s`` seconds (only the part after the last change settled) and, with ``policy``, the law decides; without
    one the count stays fixed.

    Raises:
        ValueError: ``replicas`` below 0, or a tick or window of 0 s or less.
    """
    if replicas < 0 or tick_s <= 0 or window_s <= 0:
        raise ValueError(f"replicas must be ≥ 0 and tick_s, window_s > 0, got {replicas}, {tick_s}, {window_s}")
    return _Simulation(pipeline, replicas, policy, seed, tick_s, window_s).simulate(until_documents, duration_s)


def balanced_after(run: Run, counts: range, from_s: float = 0.0,
                   until_s: Optional[float] = None) -> Optional[tuple[float, int]]:
    """When the count entered ``counts`` for good between ``from_s`` and ``until_s`` (s; the run's end when None): the
    time of the change that brought it there (``from_s`` when it was there already) and how many changes after
    ``from_s`` that took; None when the count is outside ``counts`` at ``until_s``."""
    end = math.inf if until_s is None else until_s
    changes = [t for t in run.changes if from_s <= t.end_s < end]
    first = next((t.replicas for t in run.ticks if t.end_s >= from_s), None)
    if first is None:
        return None
    seq = [first] + [t.decision.replicas for t in changes]
    times = [from_s] + [t.end_s for t in changes]
    if seq[-1] not in counts:
        return None
    k = len(seq) - 1
    while k > 0 and seq[k - 1] in counts:
        k -= 1
    return times[k], k


def reversals(run: Run, within_s: float) -> list[tuple[Tick, Tick]]:
    """The pairs of consecutive changes that went opposite ways less than ``within_s`` seconds apart."""
    changes = run.changes
    return [(a, b) for a, b in zip(changes, changes[1:])
            if a.decision.direction is not b.decision.direction and b.end_s - a.end_s < within_s]
