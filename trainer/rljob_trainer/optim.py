"""The optimizer and its learning-rate schedule (DESIGN §4): AdamW, a linear warm-up, then constant, linear or cosine
decay to a floor."""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from rljob_api.spec import OptimizerSpec

Schedule = Literal["constant", "linear", "cosine"]


def build_optimizer(model: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW over every parameter of ``model`` with ``spec``'s learning rate, betas and weight decay (the rate is
    set again before every step by :func:`learning_rate`)."""
    return torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(spec.beta1, spec.beta2),
                             weight_decay=spec.weight_decay)


def learning_rate(step: int, base: float, warmup_steps: int, *, schedule: Schedule = "constant",
                  total_steps: Optional[int] = None, floor: float = 0.0) -> float:
    """The learning rate of update ``step`` (the number of updates already done: 0 for the first one).

    Warm-up: ``base * (step + 1) / warmup_steps`` for the first ``warmup_steps`` updates. Then, with progress
    ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` (0 at the first update after the warm-up, capped at 1):
    ``constant`` keeps ``base``; ``linear`` gives ``floor + (base - floor) * (1 - p)``; ``cosine`` gives ``floor +
    (base - floor) * (1 + cos(pi p)) / 2`` (Loshchilov & Hutter 2017, "SGDR", arXiv:1608.03983, eq. 5, one cycle
    without restarts). The last update (step = total_steps - 1) runs just above the floor, which p = 1 would reach;
    the same progress as transformers' ``get_linear_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup``.

    Args:
        base: the rate after the warm-up (``optimizer.learningRate``), per update.
        total_steps: the updates of the whole run (``maxSteps``); needed by ``linear`` and ``cosine``.
        floor: the rate decay tends to (``optimizer.minLearningRate``), at most ``base``.

    Raises:
        ValueError: an unknown schedule, a decaying schedule without ``total_steps``, or ``floor`` above ``base``.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"schedule must be constant, linear or cosine, got {schedule!r}")
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if schedule == "constant":
        return base
    if total_steps is None:
        raise ValueError(f"the {schedule} schedule needs total_steps (maxSteps)")
    if floor > base:
        raise ValueError(f"floor = {floor:g} must not exceed base = {base:g}")
    span = total_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    factor = 1.0 - progress if schedule == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
    return floor + (base - floor) * factor


def step_learning_rate(step: int, spec: OptimizerSpec, max_steps: int) -> float:
    """:func:`learning_rate` of update ``step`` with ``spec``'s rate, warm-up, schedule and floor over ``max_steps``."""
    return learning_rate(step, spec.learning_rate, spec.warmup_steps, schedule=spec.schedule, total_steps=max_steps,
                         floor=spec.min_learning_rate)
