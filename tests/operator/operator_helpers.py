"""Helpers shared by the operator tests: spec builders and pod views (plain data, no cluster)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


from rljob_api.spec import RLTrainingJobSpec

from rljob_operator import render
from rljob_operator.observe import PodView

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def make_spec(**overrides: Any) -> RLTrainingJobSpec:
    """A spec from camelCase overrides, e.g. make_spec(trainer={"nodes": 2})."""
    return RLTrainingJobSpec.model_validate(overrides)


def make_job(name: str = "demo", namespace: str = "ns", labels: dict | None = None, **overrides: Any) -> render.Job:
    return render.Job(name, namespace, make_spec(**overrides), labels or {})


def trainer(index: int, attempt: int, phase: str = "Running", config_hash: str = "h1", **kw: Any) -> PodView:
    kw.setdefault("uid", f"t{index}-{attempt}")
    return PodView(name=f"demo-trainer-{index}", role="trainer", index=index, attempt=attempt,
                   config_hash=config_hash, phase=phase, **kw)


def rollout(index: int, phase: str = "Running", config_hash: str = "h1", **kw: Any) -> PodView:
    kw.setdefault("uid", f"r{index}")
    return PodView(name=f"demo-rollout-{index}", role="rollout", index=index, attempt=None,
                   config_hash=config_hash, phase=phase, ready=phase == "Running", **kw)
