"""Multi-turn episodes against an environment, many in flight, each turn one request to the generation backend.

:class:`EpisodeRunner` stands where the worker's backend stands for the single-turn tasks (``submit`` a group,
``finished`` returns groups), so the worker's scoring, group advantages, filtering, stream writes, back-pressure and
reward-failure back-off apply to episodes unchanged. A group is ``samplesPerPrompt`` episodes reset with the same seed
(:class:`~rljob_rollout.environments.task.EnvironmentTask` draws one per group); an environment that ignores the seed
makes a group of episodes that merely started together, whose advantages then compare different tasks.

An episode (DESIGN §3 "Episodes"):

1. ``reset(seed)``; its observation's text is the episode's prompt: :func:`~rljob_rollout.tasks.encode_prompt_text`
   (the chat template's user turn and generation prompt, where the tokenizer has one).
2. Generate one turn: a request of the whole context so far, ``sampling.maxNewTokens`` at most (less when the token
   budget leaves less room). The sampled ids, their log-probabilities and versions are appended as they are.
3. ``step({actionField: text})`` with the turn's text (its ids decoded, special tokens skipped). The step's reward is
   recorded. The episode ends when the environment says done, after ``maxTurns`` steps, or when the next observation
   would not leave room for one more token in the budget (then without that observation); otherwise the observation's
   tokens (:class:`ObservationEncoder`) are appended and it goes on at 2.

Earlier turns are never re-tokenized: the context is exactly the sampled ids and the observation ids, in order. The
episode's document (:func:`~rljob_rollout.writer.make_document`) masks every token the model did not sample (the prompt
and each observation, :attr:`Episode.masked_spans`), carries the sampling log-probabilities (0 elsewhere) and each
token's weights version (an observation's tokens carry the version of the turn sampled after them, as a prompt's do).
Its reward is the sum (``reward: sum``) or the last (``last``) of its step rewards.

Token budget: min(the model's positions, ``trainer.batch.microBatchTokens``): a longer document could not be trained
(the trainer drops it). An episode that reaches it ends as ``token_budget`` and is trained with the rewards it has.

Failures: an environment call that raises or outlives ``turnTimeoutSeconds``, an episode that outlives
``episodeTimeoutSeconds``, an observation without text or with characters the tokenizer lacks, or a turn aborted by a
torn weight update: the episode is dropped, returned as an :class:`Episode` with its ``error`` (the worker counts it by
class and message, as a failed reward, and its group goes on with the others; a batch where every episode fails backs
off as failing rewards do). Never a crash.

Concurrency: at most ``episodesInFlight`` episodes run (default promptsPerBatch × samplesPerPrompt); episodes of the
groups submitted beyond wait for a slot. Environment calls run on an event loop of their own (a thread), so a slow
environment blocks no generation; turns of all episodes go to the backend as they come (with ``vllm``, continuous
batching across episodes and turns; ``cpu`` generates the turns waiting at each call in one batch). Weight updates are
the backend's (in flight with ``vllm``); while the worker has no weights (before the first, after a torn update) no
turn is submitted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from rljob_api.spec import EnvironmentSpec, SamplingSpec
from rljob_rollout.backends.base import Completion, GenerationBackend, Group
from rljob_rollout.environments.sessions import (
    EnvironmentTimeout, EpisodeAborted, EpisodeError, ObservationError, Session, StepResult,
)
from rljob_rollout.tasks import Prompt, encode_prompt_text

log = logging.getLogger(__name__)

ENDS = ("done", "max_turns", "token_budget")
"""How a kept episode ended: the environment said done, ``maxTurns`` steps, the token budget."""
IDLE_WAIT_S = 0.005
"""Longest wait for an environment call when no turn is being generated and nothing finished (seconds)."""


@dataclass(frozen=True)
class Episode(Completion):
    """One finished episode, as the worker's documents and metrics read it: a :class:`Completion` whose
    ``token_ids`` are the whole episode (the first observation too; the group's prompt is empty) and whose
    ``masked_spans`` are the observations'.

    Attributes:
        reward: the episode's reward (``reward: sum`` or ``last`` of its steps); None when dropped.
        error: why it was dropped (an :class:`EpisodeError`), None when kept.
        turns: steps taken (generated turns).
        end: one of :data:`ENDS`, or ``error``.
        seconds: wall time from reset to the end (seconds).
    """

    reward: Optional[float] = None
    error: Optional[EpisodeError] = None
    turns: int = 0
    end: str = "error"
    seconds: float = 0.0


class ObservationEncoder:
    """Token ids of an environment's observations, earlier turns never re-tokenized.

    The first observation is a user prompt (:func:`encode_prompt_text`). A later one, without a chat template, is
    ``encode(text)`` without special tokens. With a chat template it is what the template puts between the end of an
    assistant message and the next generation prompt, around a user message of ``text``: the close of the assistant's
    turn (less the end-of-sequence text when the model sampled it), the user turn and the generation prompt, found by
    rendering a two-message conversation with and without that user message.

    Raises (both methods):
        ObservationError: characters the tokenizer lacks, or a chat template that renders earlier messages differently
            once a message is added (no continuation exists then).
    """

    PROBE = ("u", "a")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_text = eos if isinstance(eos, str) else ""
        self.eos_id = getattr(tokenizer, "eos_token_id", None)

    def first(self, text: str) -> list[int]:
        """The ids of the first observation (the episode's prompt)."""
        try:
            return list(encode_prompt_text(self.tokenizer, text))
        except ValueError as error:
            raise ObservationError(f"observation {text[:80]!r}: {error}") from None

    def next(self, text: str, ended_with_eos: bool) -> list[int]:
        """The ids of a later observation, after a turn that ended with the end-of-sequence token or not."""
        try:
            if not self.chat:
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            closing, turn = self._template(text)
            if ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
                closing = closing[len(self.eos_text):]
            return list(self.tokenizer.encode(closing + turn, add_special_tokens=False))
        except ValueError as error:
            raise ObservationError(f"observation {text[:80]!r}: {error}") from None

    def _template(self, text: str) -> tuple[str, str]:
        user, assistant = self.PROBE
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        base = self.tokenizer.apply_chat_template(messages, tokenize=False)
        full = self.tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(base) or assistant not in base:
            raise ValueError("the chat template renders earlier messages differently once a user message follows")
        return base[base.rindex(assistant) + len(assistant):], full[len(base):]


@dataclass
class _Run:
    """One episode in flight (mutable state of :class:`EpisodeRunner`)."""

    group: int
    index: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[Optional[int]] = field(default_factory=list)  # None: an observation's, set by the next turn
    spans: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    started: float = 0.0
    session: Optional[Session] = None
    call: Optional[concurrent.futures.Future] = None  # the environment call in progress
    call_deadline: float = 0.0
    reset: bool = False  # the first observation is in
    waiting_turn: bool = False  # a turn to submit once the worker has weights
    request: Optional[int] = None  # the backend request of the turn in progress
    submitted_version: Optional[int] = None  # the worker's version when that turn was submitted
    ended_with_eos: bool = False


class EpisodeRunner:
    """Runs groups of episodes (module docstring) over ``backend``.

    Args:
        backend: the generation backend (requests of one completion each).
        sessions: makes one episode's :class:`Session`.
        tokenizer: the job's tokenizer (encodes observations, decodes turns).
        spec: ``spec.rollout.environment``.
        max_tokens: the token budget of an episode (module docstring), >= 2.
        episodes_in_flight: most episodes running at once, >= 1.
        version: the worker's weights version now (None: no weights; no turn is submitted then).
        observe: called with every finished :class:`Episode` (metrics).

    Raises:
        ValueError: ``max_tokens`` < 2 or ``episodes_in_flight`` < 1.
    """

    continuous = True
    """Episodes go on across calls of :meth:`finished` (the worker polls it while groups are in flight)."""

    def __init__(self, backend: GenerationBackend, sessions: Callable[[], Session], tokenizer: Any,
                 spec: EnvironmentSpec, *, max_tokens: int, episodes_in_flight: int,
                 version: Callable[[], Optional[int]], observe: Optional[Callable[[Episode], None]] = None) -> None:
        if max_tokens < 2:
            raise ValueError(f"episode token budget must be >= 2, got {max_tokens}")
        if episodes_in_flight < 1:
            raise ValueError(f"spec.rollout.environment.episodesInFlight: must be >= 1, got {episodes_in_flight}")
        self.backend = backend
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.spec = spec
        self.max_tokens = max_tokens
        self.limit = episodes_in_flight
        self.version = version
        self.observe = observe or (lambda episode: None)
        self.encoder = ObservationEncoder(tokenizer)
        self.ends: Counter = Counter()  # finished episodes by end (or error class)
        self._groups: dict[int, list[Optional[Episode]]] = {}  # key -> its episodes, None while running
        self._sampling: dict[int, SamplingSpec] = {}
        self._queued: list[_Run] = []
        self._running: list[_Run] = []
        self._requests: dict[int, _Run] = {}
        self._next_request = 0
        self._closing: set[concurrent.futures.Future] = set()  # sessions being closed
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rljob-environments", daemon=True)
        self._thread.start()

    # --- the backend-like interface the worker uses --------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by :meth:`finished`."""
        return len(self._groups)

    @property
    def episodes_running(self) -> int:
        """Episodes started and not finished (at most ``episodes_in_flight``)."""
        return len(self._running)

    def submit_prompt(self, key: int, prompt: Prompt, n: int, sampling: SamplingSpec) -> None:
        """Queue a group of ``n`` episodes reset with the seed ``prompt.reference``; :meth:`finished` returns them
        under ``key``.

        Raises:
            ValueError: ``key`` already in flight.
        """
        if key in self._groups:
            raise ValueError(f"episodes: group {key} is already in flight")
        self._groups[key] = [None] * n
        self._sampling[key] = sampling
        self._queued.extend(_Run(key, index, int(prompt.reference)) for index in range(n))

    def finished(self, timeout_s: float) -> list[tuple[int, Group]]:
        """Advance every episode (module docstring) and return the groups whose episodes have all ended, waiting up
        to ``timeout_s`` seconds for generation or the environment. Dropped episodes are in their group with their
        ``error``. Raises what the backend raises (an engine failure)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._start_queued()
            progressed = self._advance_calls()
            self._submit_turns()
            wait = max(0.0, deadline - time.monotonic())
            if self.backend.in_flight:
                done = self.backend.finished(timeout_s=min(wait, IDLE_WAIT_S) if self._calls_pending() else wait)
                for request, completions in done:
                    run = self._requests.pop(request, None)
                    if run is not None:  # None: its episode was dropped meanwhile
                        self._turn_done(run, completions)
                progressed = progressed or bool(done)
            elif not progressed and self._calls_pending() and wait > 0:
                concurrent.futures.wait([r.call for r in self._running if r.call is not None],
                                        timeout=min(wait, IDLE_WAIT_S), return_when=concurrent.futures.FIRST_COMPLETED)
            ready = [key for key, episodes in self._groups.items() if all(e is not None for e in episodes)]
            if ready or time.monotonic() >= deadline:
                return [(key, self._pop_group(key)) for key in ready]

    def receive_weights(self, *args: Any, **kwargs: Any) -> Any:
        """The backend's :meth:`~rljob_rollout.backends.base.GenerationBackend.receive_weights` (turns in flight are
        the backend's: kept on a loaded or intact update, aborted on a torn one, which drops their episodes)."""
        return self.backend.receive_weights(*args, **kwargs)

    def close(self) -> None:
        """Close every session (waiting up to ``turnTimeoutSeconds`` for them), stop the event loop and close the
        backend."""
        for run in self._running:
            if run.call is not None:
                run.call.cancel()
            self._close_session(run)
        self._running.clear()
        concurrent.futures.wait(self._closing, timeout=self.spec.turn_timeout_seconds)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.backend.close()

    # --- episodes ------------------------------------------------------------------------------------------------
    def _call(self, run: _Run, coroutine: Any) -> None:
        run.call = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        run.call_deadline = time.monotonic() + self.spec.turn_timeout_seconds + 1.0  # the session's own bound first

    def _calls_pending(self) -> bool:
        return any(run.call is not None for run in self._running)

    def _start_queued(self) -> None:
        while self._queued and len(self._running) < self.limit:
            run = self._queued.pop(0)
            run.started = time.monotonic()
            self._running.append(run)
            try:
                run.session = self.sessions()
            except Exception as error:  # noqa: BLE001 - a client that cannot even be built drops the episode
                self._drop(run, EpisodeError(f"{type(error).__name__}: {error}"))
                continue
            self._call(run, run.session.reset(run.seed))

    def _advance_calls(self) -> bool:
        """Handle the environment calls that returned, and drop the episodes past a deadline. Returns whether any
        call returned."""
        now, progressed = time.monotonic(), False
        for run in list(self._running):
            if now - run.started > self.spec.episode_timeout_seconds:
                self._drop(run, EnvironmentTimeout(f"episode took longer than {self.spec.episode_timeout_seconds} s "
                                                   "(spec.rollout.environment.episodeTimeoutSeconds)"))
                continue
            if run.call is None:
                continue
            if not run.call.done():
                if now > run.call_deadline:  # the session's own timeout did not fire (a stuck event loop call)
                    self._drop(run, EnvironmentTimeout(f"call took longer than {self.spec.turn_timeout_seconds} s "
                                                       "(spec.rollout.environment.turnTimeoutSeconds)"))
                continue
            call, run.call, progressed = run.call, None, True
            try:
                result: StepResult = call.result()
                if not run.reset:
                    self._first_observation(run, result)
                else:
                    self._stepped(run, result)
            except EpisodeError as error:
                self._drop(run, error)
        return progressed

    def _first_observation(self, run: _Run, result: StepResult) -> None:
        ids = self.encoder.first(result.observation)
        if len(ids) + 1 > self.max_tokens:
            raise ObservationError(f"the first observation is {len(ids)} tokens, the episode's token budget "
                                   f"{self.max_tokens} (model positions, trainer.batch.microBatchTokens)")
        self._append_observation(run, ids)
        run.reset = run.waiting_turn = True

    def _stepped(self, run: _Run, result: StepResult) -> None:
        run.rewards.append(result.reward)
        if result.done:
            return self._finish(run, "done")
        if run.turns >= self.spec.max_turns:
            return self._finish(run, "max_turns")
        ids = self.encoder.next(result.observation, run.ended_with_eos)
        if len(run.tokens) + len(ids) + 1 > self.max_tokens:
            return self._finish(run, "token_budget")
        self._append_observation(run, ids)
        run.waiting_turn = True

    def _append_observation(self, run: _Run, ids: Sequence[int]) -> None:
        begin = len(run.tokens)
        run.tokens.extend(ids)
        run.logprobs.extend([0.0] * len(ids))
        run.versions.extend([None] * len(ids))
        if ids:
            run.spans.append((begin, len(run.tokens)))

    def _submit_turns(self) -> None:
        if self.version() is None:
            return  # no weights (before the first update, after a torn one): turns wait
        for run in self._running:
            if not run.waiting_turn:
                continue
            run.waiting_turn = False
            sampling = self._sampling[run.group]
            room = self.max_tokens - len(run.tokens)
            if room < 1:
                self._finish(run, "token_budget")
                continue
            turn = sampling.model_copy(update={"max_new_tokens": min(sampling.max_new_tokens, room)})
            request, self._next_request = self._next_request, self._next_request + 1
            self._requests[request] = run
            run.request = request
            run.submitted_version = self.version()
            self.backend.submit(request, list(run.tokens), 1, turn)

    def _turn_done(self, run: _Run, completions: Group) -> None:
        run.request = None
        if completions is None:
            return self._drop(run, EpisodeAborted("a torn weight update aborted the turn in generation"))
        completion = completions[0]
        ids = list(completion.token_ids)
        submitted = int(run.submitted_version or 0)
        versions = list(completion.versions) if completion.versions is not None else [submitted] * len(ids)
        first = versions[0] if versions else submitted
        run.versions = [first if v is None else v for v in run.versions]
        run.tokens.extend(ids)
        run.logprobs.extend(completion.logprobs)
        run.versions.extend(versions)
        run.turns += 1
        run.ended_with_eos = bool(ids) and ids[-1] == self.encoder.eos_id
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._call(run, run.session.step(text))

    def _finish(self, run: _Run, end: str) -> None:
        rewards = run.rewards
        reward = (sum(rewards) if self.spec.reward == "sum" else rewards[-1]) if rewards else 0.0
        self._end(run, Episode(tuple(run.tokens), tuple(run.logprobs), end, tuple(int(v) for v in run.versions),
                               masked_spans=tuple(run.spans), reward=float(reward), turns=run.turns, end=end,
                               seconds=time.monotonic() - run.started))

    def _drop(self, run: _Run, error: EpisodeError) -> None:
        if run.call is not None:
            run.call.cancel()
        if run.request is not None:
            self._requests.pop(run.request, None)  # its completion is ignored when it comes
        versions = tuple(0 if v is None else int(v) for v in run.versions)
        self._end(run, Episode(tuple(run.tokens), tuple(run.logprobs), "error", versions,
                               masked_spans=tuple(run.spans), error=error, turns=run.turns,
                               seconds=time.monotonic() - run.started))

    def _end(self, run: _Run, episode: Episode) -> None:
        self._running.remove(run)
        run.waiting_turn = False
        self._close_session(run)
        self._groups[run.group][run.index] = episode
        self.ends[episode.end if episode.error is None else type(episode.error).__name__] += 1
        self.observe(episode)

    def _close_session(self, run: _Run) -> None:
        if run.session is not None:
            closing = asyncio.run_coroutine_threadsafe(run.session.close(), self._loop)
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            run.session = None

    def _pop_group(self, key: int) -> list[Episode]:
        self._sampling.pop(key, None)
        return list(self._groups.pop(key))  # type: ignore[arg-type]
