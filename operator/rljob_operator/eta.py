"""Training progress as a share of ``spec.trainer.maxSteps`` and the time left at the recent step rate, the fields of
Kubeflow Trainer's progress KEP (KEP-2779: ``progressPercentage``, ``estimatedRemainingSeconds``,
``estimatedRemainingTimeSummary``), shown by ``kubectl get rljob`` as Progress and ETA.

The rate is measured on the trainer's own clock: each sample is the progress hash's (``updated_at``, ``step``), the
unix seconds trainer rank 0 wrote that step, so the operator's pass interval and a slow pass do not skew it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

WINDOW_S = 600.0
"""The rate is the mean over the samples of the last 10 minutes (seconds): recent enough to follow a change of
speed (a resumed gang, a slower rollout), long enough to smooth single steps."""


@dataclass
class StepRate:
    """Optimizer steps per second over the trainer's last :data:`WINDOW_S` seconds of progress writes.

    Kept per job in the operator's memory (lost on an operator restart: the estimate returns after two samples).
    A step below the newest sample (a gang restart from an older checkpoint) starts the window over.
    """

    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, updated_at: Optional[float], step: Optional[int]) -> None:
        """Add the progress hash's write of ``step`` at ``updated_at`` (unix seconds); a write already seen, or a
        sample with either value unknown, is ignored."""
        if updated_at is None or step is None:
            return
        if self.samples:
            last_at, last_step = self.samples[-1]
            if step < last_step:
                self.samples.clear()
            elif updated_at <= last_at:
                return
        self.samples.append((updated_at, step))
        while len(self.samples) > 2 and self.samples[-1][0] - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()

    def per_second(self) -> Optional[float]:
        """Steps per second between the oldest and the newest sample of the window; None before two samples with
        progress between them."""
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (s1 - s0) / (t1 - t0)


def progress_percentage(step: int, max_steps: int) -> int:
    """Whole percent of ``max_steps`` done, rounded down (100 only once ``step`` reaches ``max_steps``)."""
    return min(100, 100 * max(0, step) // max_steps)


def remaining_seconds(step: int, max_steps: int, steps_per_second: float) -> int:
    """Seconds until ``max_steps`` at ``steps_per_second``, rounded up to 10 s below two minutes, to a minute below
    an hour and to 10 minutes above (a status write per rounded change, not per pass)."""
    exact = max(0, max_steps - step) / steps_per_second
    unit = 10 if exact < 120 else 60 if exact < 3600 else 600
    return int(math.ceil(exact / unit) * unit)


def duration_summary(seconds: int) -> str:
    """``seconds`` in the two largest units, as Kubernetes shows ages: "40s", "12m", "1h20m", "2d3h"."""
    if seconds < 60:
        return f"{seconds}s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if hours == 0:
        return f"{minutes}m"
    if days == 0:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    rest = hours % 24
    return f"{days}d{rest}h" if rest else f"{days}d"
