"""One episode's connection to an environment: reset with a seed, then steps with the generated text as the action.

Two kinds (``spec.rollout.environment``):

* :class:`OpenEnvSession` — an OpenEnv server (``server``, run by the operator, or ``url``), through OpenEnv's own
  client (``openenv-core``'s :class:`~openenv.core.generic_client.GenericEnvClient`, which sends the action as a plain
  JSON object): one WebSocket per episode, so the server keeps one environment instance per episode.
* :class:`PythonSession` — a class in the rollout process (``python``): an instance per episode, its calls run on a
  thread pool so that a slow one blocks no other episode.

Both speak in plain data: an action is the object ``{actionField: text}`` (an instance of the class's ``action_type``
when an in-process class declares one, as rljob's own OpenEnv environments do); an observation is a JSON object whose
text is :func:`observation_text`, with ``reward`` and ``done`` beside it (OpenEnv's ``StepResult``).

Errors: every failure of a call is an :class:`EpisodeError` (its class name is the kind the worker counts, the message
says what happened); a call that outlives ``turnTimeoutSeconds`` is an :class:`EnvironmentTimeout`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from rljob_api.spec import EnvironmentSpec

OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")
"""Fields every OpenEnv observation carries besides its own: never the observation's text."""


class EpisodeError(Exception):
    """An episode that cannot go on: dropped and counted under its class name (the subclasses below)."""


class EnvironmentTimeout(EpisodeError):
    """A reset or step call outlived ``turnTimeoutSeconds``, or the episode ``episodeTimeoutSeconds``."""


class EnvironmentFailed(EpisodeError):
    """The environment raised, or its server answered with an error or could not be reached."""


class ObservationError(EpisodeError):
    """An observation with no text rljob can append (no such field, not a string, characters the tokenizer lacks,
    longer than the episode's token budget), or a reward that is not a finite number."""


class EpisodeAborted(EpisodeError):
    """A weight update tore while the episode's turn was being generated (DESIGN §3)."""


@dataclass(frozen=True)
class StepResult:
    """What a reset or a step returned.

    Attributes:
        observation: the text appended to the episode's context (:func:`observation_text`).
        reward: the step's reward (0.0 when the environment gives none; a reset's is ignored).
        done: whether the episode ended.
    """

    observation: str
    reward: float
    done: bool


def observation_text(observation: Any, field: Optional[str]) -> str:
    """The text of an observation (a JSON object; a string is its own text): its ``field`` when given; else its only
    string field besides ``done``, ``reward`` and ``metadata``; else its JSON (those three left out, keys sorted).

    Raises:
        ObservationError: ``field`` is missing or not a string (names the field and what the observation has).
    """
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, Mapping):
        raise ObservationError(f"observation is a {type(observation).__name__}, not a JSON object")
    if field is not None:
        value = observation.get(field)
        if not isinstance(value, str):
            raise ObservationError(f"observation has no text field {field!r} (spec.rollout.environment.observationField)"
                                   f"; its fields: {sorted(observation)}")
        return value
    own = {key: value for key, value in observation.items() if key not in OBSERVATION_BASE_FIELDS}
    texts = [value for value in own.values() if isinstance(value, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(own, sort_keys=True)


def step_reward(value: Any) -> float:
    """A step's reward as a float: None is 0.0, a bool 0.0 or 1.0.

    Raises:
        ObservationError: not a finite number.
    """
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return float(value)
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ObservationError(f"reward {value!r} is not a number") from None
    if not math.isfinite(reward):
        raise ObservationError(f"reward {reward} is not finite")
    return reward


def _as_mapping(observation: Any) -> Any:
    """An in-process observation as plain data: a pydantic model dumped, a dataclass-like object's ``__dict__``."""
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    if isinstance(observation, (str, Mapping)):
        return observation
    return vars(observation) if hasattr(observation, "__dict__") else observation


class Session(ABC):
    """One episode's environment. Calls are coroutines run on the runner's event loop (:mod:`.episodes`); each is
    bounded by ``timeout_s`` and raises only :class:`EpisodeError`."""

    def __init__(self, spec: EnvironmentSpec) -> None:
        self.spec = spec
        self.timeout_s = float(spec.turn_timeout_seconds)

    async def reset(self, seed: int) -> StepResult:
        """Start the episode with ``seed``; the result's text is the episode's first observation."""
        return await self._bounded("reset", self._reset(seed))

    async def step(self, text: str) -> StepResult:
        """Act with the generated ``text`` (the action ``{actionField: text}``)."""
        return await self._bounded("step", self._step({self.spec.action_field: text}))

    async def _bounded(self, call: str, coroutine: Any) -> StepResult:
        try:
            return await asyncio.wait_for(coroutine, self.timeout_s)
        except EpisodeError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            raise EnvironmentTimeout(f"{call} took longer than {self.timeout_s:g} s "
                                     "(spec.rollout.environment.turnTimeoutSeconds)") from None
        except Exception as error:  # noqa: BLE001 - whatever the environment or its client raised ends this episode
            raise EnvironmentFailed(f"{call}: {type(error).__name__}: {error}") from error

    def _result(self, observation: Any, reward: Any, done: Any) -> StepResult:
        return StepResult(observation_text(observation, self.spec.observation_field), step_reward(reward), bool(done))

    @abstractmethod
    async def _reset(self, seed: int) -> StepResult: ...

    @abstractmethod
    async def _step(self, action: dict[str, str]) -> StepResult: ...

    async def close(self) -> None:
        """Release the episode's environment (best effort: never raises)."""


class OpenEnvSession(Session):
    """An episode on an OpenEnv server at ``base_url`` (its WebSocket ``/ws``), through OpenEnv's generic client."""

    def __init__(self, spec: EnvironmentSpec, base_url: str) -> None:
        super().__init__(spec)
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=base_url, connect_timeout_s=self.timeout_s,
                                       message_timeout_s=self.timeout_s)

    async def _reset(self, seed: int) -> StepResult:
        result = await self.client.reset(seed=seed)
        return self._result(result.observation, result.reward, result.done)

    async def _step(self, action: dict[str, str]) -> StepResult:
        result = await self.client.step(action)
        return self._result(result.observation, result.reward, result.done)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.client.close(), self.timeout_s)
        except BaseException:  # noqa: BLE001 - closing a dead connection is best effort
            pass


class PythonSession(Session):
    """An episode on an instance of ``environment_class`` in this process, its calls on ``executor``'s threads.

    The class is built without arguments; ``reset(seed=...)`` and ``step(action)`` return an observation (an OpenEnv
    ``Observation``, any pydantic model, a dict, or a string) whose ``reward`` and ``done`` fields (absent: 0.0 and
    False) go with it. ``step`` gets the action as ``{actionField: text}``, or as ``action_type(**that)`` when the class
    has an ``action_type`` attribute (OpenEnv ``Environment`` subclasses that declare their action class). A call that
    never returns keeps its thread: the episode is dropped at the timeout, the thread is not reclaimed.
    """

    def __init__(self, spec: EnvironmentSpec, environment_class: type,
                 executor: concurrent.futures.ThreadPoolExecutor) -> None:
        super().__init__(spec)
        self.environment_class = environment_class
        self.executor = executor
        self.environment: Any = None

    async def _call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: function(*args, **kwargs))

    def _observed(self, observation: Any) -> StepResult:
        data = _as_mapping(observation)
        get = data.get if isinstance(data, Mapping) else (lambda _key, default=None: default)
        return self._result(data, get("reward"), get("done", False))

    async def _reset(self, seed: int) -> StepResult:
        if self.environment is None:
            self.environment = await self._call(self.environment_class)
        return self._observed(await self._call(self.environment.reset, seed=seed))

    async def _step(self, action: dict[str, str]) -> StepResult:
        action_type = getattr(self.environment_class, "action_type", None)
        value = action_type(**action) if action_type is not None else action
        return self._observed(await self._call(self.environment.step, value))

    async def close(self) -> None:
        close = getattr(self.environment, "close", None)
        if callable(close):
            try:
                await asyncio.wait_for(self._call(close), self.timeout_s)
            except BaseException:  # noqa: BLE001 - best effort
                pass


def load_environment_class(entrypoint: str, file: Optional[str] = None, source: Any = None) -> type:
    """The class ``module:Class`` names (``Class`` may be dotted): from ``file`` when given
    (``spec.rollout.environment.python.source``, loaded as ``module`` by :func:`rljob_rollout.tasks.load_reward_module`),
    else imported from the image.

    Raises:
        ValueError: not ``module:Class``, the module cannot be imported or loaded, or it has no class of that name
            (names ``spec.rollout.environment.python.entrypoint`` or ``.source``).
    """
    from rljob_rollout.tasks import load_reward_module

    field = "spec.rollout.environment.python.entrypoint"
    module_name, sep, attribute = entrypoint.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{field}: must be 'module:Class', got {entrypoint!r}")
    if file is not None:
        module = load_reward_module(module_name, file, source, field="spec.rollout.environment.python.source",
                                    name_field=field)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"{field}: cannot import {module_name!r}: {error}") from error
    found: Any = module
    for part in attribute.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise ValueError(f"{field}: {module_name!r} has no class {attribute!r}")
    return found
