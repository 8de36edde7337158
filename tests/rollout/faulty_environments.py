"""Environments that fail, served by ``python -m rljob_rollout.environments.serve --entrypoint faulty_environments:...``
in the environment tests (this folder on PYTHONPATH)."""

from __future__ import annotations

import time

from rljob_rollout.environments.guess import GuessAction, GuessNumber


class RaisesOnStep(GuessNumber):
    """Resets fine, raises on every step."""

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        raise ZeroDivisionError("the environment fails on every step")


class NeverAnswers(GuessNumber):
    """Resets fine, never answers a step (sleeps an hour)."""

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        time.sleep(3600)


class SlowSteps(GuessNumber):
    """Answers every step after half a second."""

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        time.sleep(0.5)
        return super().step(action, timeout_s=timeout_s, **kwargs)
