"""Pure: ``status.capacity`` from the progress hashes the operator reads each pass (DESIGN §6 "Capacity signals"), and
the autoscaling law's :class:`~rljob_operator.autoscale.Signals` from it.

What counts:

- the trainer's ``data_wait_share``: the one of its last step record (``lastMetrics``), while the record is fresh:
  written at most :data:`FRESH_S` ago, or two of its own step times (``step_time_ms``) for steps longer than a window;
- each rollout replica's :class:`~rljob_api.protocol.WorkerReport` with the capacity fields (a worker older than them
  reports none: it is not counted, never taken for a 0), of a replica index below ``spec.rollout.replicas`` (a replica
  scaled away leaves its field in the hash), written at most :data:`FRESH_S` ago;
- the consumer group's pending and undelivered entries, as back-pressure reads them.

Ages compare the writers' clocks (``time.time()`` in the trainer and rollout pods) with the operator's: a skew of a
few seconds between nodes is well inside :data:`FRESH_S`.

Values are rounded (:func:`round_share`, :func:`round_rate`) and a value replaces the saved one only when it moved
beyond a dead band (:data:`SHARE_BAND`, :data:`RATE_BAND`), so noise around a rounding boundary does not flip it on
every pass; ``observedAt`` moves only with a value, so a pass that reads the same values leaves the status as it is and
writes nothing (an idle job reads nothing at all).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping, Optional

from rljob_api.protocol import Progress
from rljob_api.status import CapacityStatus

from rljob_operator.autoscale import Signals

FRESH_S = 60.0
"""A report older than this is ignored (seconds): two of the trainer's and the workers' 30 s windows (a held worker
reports every 5 s, a generating one with each batch)."""
DATA_WAIT_METRIC = "data_wait_share"
"""The trainer's step record field (rljob_trainer.data_wait)."""
STEP_TIME_METRIC = "step_time_ms"


SHARE_BAND = 0.02
"""A share replaces the saved one when it differs by more than this (2 percentage points)."""
RATE_BAND = 0.10
"""A rate or count replaces the saved one when it differs by more than this share of it (or by more than 1 from 0)."""
_SHARES = ("data_wait_share", "held_share")


def round_share(share: float) -> float:
    """A share (0..1) to 0.01."""
    return round(share, 2)


def round_rate(value: float) -> float:
    """A rate or count to 2 significant figures (1234 → 1200.0, 0.456 → 0.46, 0 → 0.0)."""
    return float(f"{value:.2g}")


def _fresh(written_at: Optional[float], now_s: float, within_s: float) -> bool:
    return written_at is not None and now_s - written_at <= within_s


def observe(progress: Progress, replicas: int, now: datetime,
            previous: Optional[CapacityStatus] = None) -> CapacityStatus:
    """``status.capacity`` from ``progress`` (this pass's read) for a job with ``replicas`` rollout replicas
    (spec.rollout.replicas), at ``now``; ``observedAt`` stays ``previous``'s when no value changed.

    Raises:
        ValueError: a negative ``replicas``.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be ≥ 0, got {replicas}")
    now_s = now.timestamp()
    step_s = progress.metrics.get(STEP_TIME_METRIC, 0.0) / 1e3
    share = progress.metrics.get(DATA_WAIT_METRIC)
    if not _fresh(progress.updated_at, now_s, max(FRESH_S, 2 * step_s)):
        share = None
    reports = [r for index, r in progress.workers.items()
               if index < replicas and r.held_share is not None and r.tokens_per_second is not None
               and _fresh(r.updated_at, now_s, FRESH_S)]
    held = tokens = per_replica = None
    if reports:
        held = round_share(sum(r.held_share for r in reports) / len(reports))
        total = sum(r.tokens_per_second for r in reports)
        tokens, per_replica = round_rate(total), round_rate(total / len(reports))
    backlog = progress.backlog
    values: dict[str, Any] = dict(
        data_wait_share=None if share is None else round_share(min(1.0, max(0.0, share))),
        held_share=held, tokens_per_second=tokens, tokens_per_second_per_replica=per_replica,
        pending=None if backlog is None else int(round_rate(backlog.pending)),
        undelivered=None if backlog is None or backlog.undelivered is None else int(round_rate(backlog.undelivered)),
        replicas_reporting=len(reports))
    if previous is not None:
        saved = previous.model_dump(exclude={"observed_at"})
        values = {name: saved[name] if _within_band(name, saved[name], value) else value
                  for name, value in values.items()}
        if values == saved:
            return previous
    return CapacityStatus(**values, observed_at=now)


def _within_band(name: str, saved: Any, value: Any) -> bool:
    """Whether ``value`` of the field ``name`` is close enough to the ``saved`` one to keep that (None is close only to
    None; the count of replicas reporting only to itself)."""
    if saved is None or value is None or name == "replicas_reporting":
        return saved == value
    if name in _SHARES:
        return abs(value - saved) <= SHARE_BAND + 1e-9
    return abs(value - saved) <= max(RATE_BAND * abs(saved), 1.0)


def signals(capacity: Optional[CapacityStatus]) -> Optional[Signals]:
    """The law's inputs from ``capacity``, or None when any is not reported (no trainer share, no replica reporting,
    no stream backlog): the law then has nothing to decide on. ``Signals.backlog`` is the undelivered entries (what
    is queued for the trainer; pending ones are being trained)."""
    if capacity is None or None in (capacity.data_wait_share, capacity.held_share,
                                     capacity.tokens_per_second_per_replica, capacity.undelivered):
        return None
    return Signals(data_wait_share=capacity.data_wait_share, held_share=capacity.held_share,
                   tokens_per_s_per_replica=capacity.tokens_per_second_per_replica, backlog=capacity.undelivered)


def _pct(share: Any) -> str:
    return "not reported" if share is None else f"{100 * share:.0f}%"


def _amount(value: Any) -> str:
    return "not reported" if value is None else f"{value:g}"


def describe(capacity: Optional[Mapping[str, Any]]) -> str:
    """``status.capacity`` as the API server stores it (camelCase), in words, e.g. ``capacity: trainer waits 12%,
    rollouts held 0% (2 of 2 replicas reporting), 1200 tokens/s (600 per replica), backlog 0 undelivered + 64
    pending``; "" when there is none."""
    if not capacity:
        return ""
    reporting = capacity.get("replicasReporting") or 0
    rollouts = (f"rollouts held {_pct(capacity.get('heldShare'))} ({reporting} replicas reporting), "
                f"{_amount(capacity.get('tokensPerSecond'))} tokens/s "
                f"({_amount(capacity.get('tokensPerSecondPerReplica'))} per replica)") if reporting \
        else "rollouts: no replica reporting"
    pending, undelivered = capacity.get("pending"), capacity.get("undelivered")
    backlog = "backlog not reported" if pending is None and undelivered is None else \
        f"backlog {_amount(undelivered)} undelivered + {_amount(pending)} pending"
    return f"capacity: trainer waits {_pct(capacity.get('dataWaitShare'))}, {rollouts}, {backlog}"

