"""The ``environment`` task: each prompt is a seed, each sample an episode (:mod:`.episodes`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rljob_rollout.tasks import Prompt, Task

SEED_BOUND = 2**31
"""Seeds are drawn in [0, 2**31): what every environment's ``reset(seed)`` accepts."""


class EnvironmentTask(Task):
    """Seeds for groups of episodes, and the episodes' own rewards.

    A prompt has no tokens (each episode's prompt is its environment's first observation), ``text`` ``"seed <s>"`` and
    ``reference`` the seed ``s``, drawn from ``seed`` (the rollout seed + the replica index), so every replica plays
    other seeds and a restarted worker the same ones again.
    """

    name = "environment"

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def next_prompts(self, count: int) -> list[Prompt]:
        seeds = self._rng.integers(0, SEED_BOUND, size=count)
        return [Prompt((), f"seed {int(s)}", int(s)) for s in seeds]

    def reward(self, prompt: Prompt, completion_ids: Sequence[int], completion_text: str) -> float:
        """Not used: an episode's reward is its environment's (:meth:`score`).

        Raises:
            TypeError: always (a caller that scores text has no episode).
        """
        raise TypeError("the environment task scores episodes (score), not completion text")

    def score(self, prompt: Prompt, completion: Any, tokenizer: Any) -> float:
        """The episode's reward (:attr:`~rljob_rollout.environments.episodes.Episode.reward`).

        Raises:
            EpisodeError: the episode was dropped (its error, which the worker counts by class and message).
        """
        if completion.error is not None:
            raise completion.error
        return float(completion.reward)
