"""Guess the number: rljob's toy multi-turn environment, an OpenEnv ``Environment``.

Run in process (``spec.rollout.environment.python.entrypoint: rljob_rollout.environments.guess:GuessNumber``) or as an
OpenEnv server from rljob's own image (``python -m rljob_rollout.environments.serve``, :mod:`.serve`).

An episode: ``reset(seed)`` draws a secret integer in [0, ``high``] from ``seed`` (the same seed, the same secret: a
group of episodes plays one secret) and says ``"guess 0 to 9"``. Each step's action is text; its feedback is a
character, ``"+"`` the secret is higher, ``"-"`` lower, ``"="`` right (reward 1.0, done), ``"?"`` the text is not a
whole number (leading and trailing spaces allowed), followed (but after ``"="``) by the range the secret is still in
given every answer so far, in the words of the first observation: ``"+ 5 to 9"``, ``"- 5 to 6"``, ``"? 5 to 6"``. Every
other step's reward is 0.0, so with ``reward: sum`` an episode scores 1.0 when the secret is found within ``maxTurns``
and 0.0 otherwise. All text is in the ``tiny`` model's text alphabet (``0-9``, space, ``+-=?``, ``a-z``).

Why it can learn, and why the range: with ``high`` 9 a binary search (guess the middle of the range) finds every
secret within 4 guesses, while a policy that ignores the feedback finds it within ``maxTurns`` = 5 guesses at most 5
times in 10 (5 distinct numbers); so a mean reward of 0.8 needs the feedback of earlier turns. An untrained policy
(random characters of the 45-symbol alphabet, one per turn with ``maxNewTokens: 1``) scores about 0.1 and plays nearly
every turn (4.8 of 5). With the sign alone (``"+"``) the guess that follows is a function of every earlier guess and
sign; the tiny model (2 layers, width 64) learnt that slowly (seed 0: mean reward 0.63 after 110 steps of the CPU
example's batch, still rising). Saying the range makes the next guess a function of the last observation, which it
learns: a mean reward of 0.8 at steps 79-90 over 3 seeds with examples/rljob-environment-cpu.yaml
(docs/environment-learning.md); the task stays multi-turn: each guess needs the answer to the one before.
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State

DEFAULT_HIGH = 9
"""The largest secret by default (secrets are 0..9)."""
HIGHER, LOWER, RIGHT, NOT_A_NUMBER = "+", "-", "=", "?"


class GuessAction(Action):
    """A guess: the generated text (rljob sends it as ``{"message": text}``, OpenEnv's text action)."""

    message: str


class GuessObservation(Observation):
    """The environment's words: the task at reset, then one feedback character per guess."""

    message: str


class GuessNumber(Environment):
    """Guess a secret integer in [0, ``high``] (module docstring). One instance plays one episode at a time; the
    OpenEnv server makes one per session.

    Args:
        high: the largest secret, 0 < high <= 999999.

    Raises:
        ValueError: ``high`` out of range.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True
    action_type = GuessAction
    observation_type = GuessObservation

    def __init__(self, high: int = DEFAULT_HIGH) -> None:
        super().__init__()
        if not 0 < high <= 999_999:
            raise ValueError(f"GuessNumber: high must be in 1..999999, got {high}")
        self.high = high
        self.secret: Optional[int] = None
        self.low_left, self.high_left = 0, high  # the range the secret is still in, given the answers so far
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        """Draw the secret from ``seed`` (None: a random one) and say the range."""
        self.secret = random.Random(seed).randint(0, self.high)
        self.low_left, self.high_left = 0, self.high
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(message=f"guess 0 to {self.high}", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        """Answer one guess (module docstring).

        Raises:
            RuntimeError: a step before any reset.
        """
        if self.secret is None:
            raise RuntimeError("GuessNumber: step before reset")
        self._state.step_count += 1
        text = action.message.strip()
        if not text.isdigit():
            return self._answer(NOT_A_NUMBER)
        guess = int(text)
        if guess == self.secret:
            return GuessObservation(message=RIGHT, done=True, reward=1.0)
        if guess < self.secret:
            self.low_left = max(self.low_left, guess + 1)
            return self._answer(HIGHER)
        self.high_left = min(self.high_left, guess - 1)
        return self._answer(LOWER)

    def _answer(self, sign: str) -> GuessObservation:
        """A step's feedback that does not end the episode: the sign and the range the secret is still in."""
        return GuessObservation(message=f"{sign} {self.low_left} to {self.high_left}", done=False, reward=0.0)

    @property
    def state(self) -> State:
        """The episode's id and its steps so far."""
        return self._state
