"""Multi-turn episodes against environments (task ``environment``, ``spec.rollout.environment``; docs/environments.md).

* :mod:`.sessions` — one episode's environment: an OpenEnv server through OpenEnv's client, or a class in process.
* :mod:`.episodes` — the episode loop: many episodes in flight, each turn a request to the generation backend.
* :mod:`.task` — the ``environment`` task (a prompt is a seed).
* :mod:`.guess` — rljob's toy environment (guess the number), an OpenEnv environment; :mod:`.serve` serves it.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional

from rljob_api import names
from rljob_api.config import JobConfig
from rljob_rollout.backends.base import GenerationBackend
from rljob_rollout.environments.episodes import Episode, EpisodeRunner
from rljob_rollout.environments.sessions import OpenEnvSession, PythonSession, Session, load_environment_class


def environment_url(config: JobConfig) -> Optional[str]:
    """Base URL of the job's OpenEnv server: ``url``, or the Service of the ``server`` the operator runs
    (:func:`rljob_api.names.environment_url`); None for a ``python`` environment."""
    env = config.spec.rollout.environment
    if env is None or env.python is not None:
        return None
    if env.url is not None:
        return env.url.rstrip("/")
    return names.environment_url(config.name, config.namespace, env.server.port)


def episode_token_budget(config: JobConfig, backend: GenerationBackend) -> int:
    """The most tokens an episode may hold: min(the model's positions, ``trainer.batch.microBatchTokens``). The
    positions: ``model.tiny.maxPositionEmbeddings`` for the tiny model, else the backend's ``max_positions`` where it
    knows them."""
    budget = config.spec.trainer.batch.micro_batch_tokens
    if config.spec.model.source == "tiny":
        return min(budget, config.spec.model.tiny.max_position_embeddings)
    positions = getattr(backend, "max_positions", None)
    return min(budget, positions) if positions else budget


def session_factory(config: JobConfig, code_file: Optional[str] = None) -> Callable[[], Session]:
    """Makes one episode's :class:`Session` for ``spec.rollout.environment``.

    Raises:
        ValueError: a ``python`` class that cannot be loaded (names the field).
    """
    env = config.spec.rollout.environment
    if env is None:
        raise ValueError("spec.rollout.environment: required for task 'environment'")
    if env.python is not None:
        environment_class = load_environment_class(env.python.entrypoint, code_file, env.python.source)
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=episodes_in_flight(config), thread_name_prefix="rljob-environment")
        return lambda: PythonSession(env, environment_class, executor)
    url = environment_url(config)
    return lambda: OpenEnvSession(env, url)


def episodes_in_flight(config: JobConfig) -> int:
    """``environment.episodesInFlight``, default ``promptsPerBatch × samplesPerPrompt``."""
    rollout = config.spec.rollout
    configured = rollout.environment.episodes_in_flight if rollout.environment is not None else None
    return configured or rollout.prompts_per_batch * rollout.samples_per_prompt


def build_runner(config: JobConfig, backend: GenerationBackend, tokenizer: Any, *,
                 version: Callable[[], Optional[int]], observe: Optional[Callable[[Episode], None]] = None,
                 code_file: Optional[str] = None) -> EpisodeRunner:
    """The episode runner of a rollout worker over ``backend`` (the worker's ``version`` gates turns; ``observe``
    gets every finished episode; ``code_file``: the file of ``environment.python.source`` in this container).

    Raises:
        ValueError: a ``python`` class that cannot be loaded (names the field).
    """
    return EpisodeRunner(backend, session_factory(config, code_file), tokenizer, config.spec.rollout.environment,
                         max_tokens=episode_token_budget(config, backend), episodes_in_flight=episodes_in_flight(config),
                         version=version, observe=observe)


__all__ = ["Episode", "EpisodeRunner", "build_runner", "environment_url", "episode_token_budget",
           "episodes_in_flight", "session_factory"]
