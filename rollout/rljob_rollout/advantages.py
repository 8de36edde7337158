"""Group-relative advantages (GRPO) and the optional zero-variance group filter.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3 / §4.1.2 outcome supervision) scores each of the G samples of one
prompt against its own group: ``A_i = (r_i - mean(r)) / (std(r) + eps)``. The standard deviation is the
unbiased sample standard deviation (ddof = 1), as TRL's ``GRPOTrainer`` and PipelineRL compute it; a group of
one sample has std 0. With ``normalize_std`` off the advantage is ``r_i - mean(r)`` (Dr. GRPO, Liu et al. 2025,
drops the division to remove the per-question difficulty bias).

A group whose rewards are all equal carries no learning signal (every advantage is 0); DAPO (Yu et al. 2025,
"dynamic sampling") drops such groups. :func:`filter_zero_variance` does that when
``spec.rollout.filterZeroVariance`` is on and counts what it dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def group_advantages(rewards: Sequence[float], *, normalize_std: bool = True, epsilon: float = 1e-6) -> np.ndarray:
    """Advantages of the samples of one prompt.

    Args:
        rewards: [G] raw rewards of the group's G >= 1 samples.
        normalize_std: divide by (std + epsilon); off: mean-centred only.
        epsilon: added to the standard deviation before dividing (> 0).

    Returns:
        [G] float64, ``(r - mean(r)) / (std(r, ddof=1) + epsilon)`` or ``r - mean(r)``.

    Raises:
        ValueError: empty group, non-finite reward, or epsilon <= 0.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"group_advantages: expected a non-empty 1-D list of rewards, got shape {list(r.shape)}")
    if not np.isfinite(r).all():
        raise ValueError(f"group_advantages: rewards must be finite, got {r.tolist()}")
    if epsilon <= 0:
        raise ValueError(f"group_advantages: epsilon must be > 0, got {epsilon}")
    centred = r - r.mean()
    if not normalize_std:
        return centred
    std = float(r.std(ddof=1)) if r.size > 1 else 0.0
    return centred / (std + epsilon)


def has_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward of the group is equal (no learning signal)."""
    r = np.asarray(rewards, dtype=np.float64)
    return bool(r.size == 0 or np.all(r == r[0]))


@dataclass(frozen=True)
class FilterResult:
    """What :func:`filter_zero_variance` kept (indices into the input groups) and dropped (counts)."""

    kept: list[int]
    groups_dropped: int
    samples_dropped: int


def filter_zero_variance(groups: Sequence[Sequence[float]], *, enabled: bool) -> FilterResult:
    """Drop the groups whose rewards are all equal, when ``enabled``.

    Args:
        groups: per group, its rewards ([G_g] floats; groups may differ in size after failed rewards).
        enabled: ``spec.rollout.filterZeroVariance``; off keeps every group.

    Returns:
        Indices of the kept groups (input order) and the numbers of groups and samples dropped.
    """
    if not enabled:
        return FilterResult(list(range(len(groups))), 0, 0)
    kept, groups_dropped, samples_dropped = [], 0, 0
    for index, rewards in enumerate(groups):
        if has_zero_variance(rewards):
            groups_dropped += 1
            samples_dropped += len(rewards)
        else:
            kept.append(index)
    return FilterResult(kept, groups_dropped, samples_dropped)
