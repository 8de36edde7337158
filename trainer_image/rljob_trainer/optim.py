"""The optimizer and its learning-rate schedule (DESIGN §4): AdamW with a linear warm-up."""

from __future__ import annotations

import torch

from rljob_api.spec import OptimizerSpec


def build_optimizer(model: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW over every parameter of ``model`` with ``spec``'s learning rate, betas and weight decay (the rate is
    set again before every step by :func:`learning_rate`)."""
    return torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(spec.beta1, spec.beta2),
                             weight_decay=spec.weight_decay)


def learning_rate(step: int, base: float, warmup_steps: int) -> float:
    """Linear warm-up: ``base * (step + 1) / warmup_steps`` for the first ``warmup_steps`` updates, then ``base``.

    ``step`` is the number of updates already done (0 for the first one).
    """
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    return base
