"""The rollout loop: follow the trainer's weights, generate, score, compute advantages, write documents.

At start the worker follows the events stream from its last entry. When that entry is a ``training_finished``
whose ``step`` is at least this config's ``spec.trainer.maxSteps`` (or carries no step: an older trainer), the job
is done and the worker exits 0. One with a lower step is an earlier attempt's end — ``maxSteps`` was raised and
the operator restarted the gang — so the worker stays and waits for the new attempt's weights.

One iteration (:meth:`RolloutWorker.step`):

1. Read new events (without waiting while groups are in flight). A live ``training_finished`` → the worker exits 0,
   whatever its step. The newest ``weights_ready`` that invites one of this pod's transfer ranks → join that
   transfer and load the weights, with groups in flight on a continuous backend (DESIGN §3 "In-flight weight
   updates"); on success the local version becomes the event's ``documents_seen``, even when lower than before (a
   trainer resumed from an older checkpoint).
2. Groups in flight: wait up to :data:`COLLECT_WAIT_S` for finished ones; score them, compute group advantages,
   optionally drop zero-variance groups, write the documents and report them to the rollout hash.
3. Before the first successful update, generate nothing (DESIGN §2): wait for events.
4. While backing off after groups whose every reward failed (below), or while back-pressure or max lag says wait
   (:mod:`.writer`, samples in flight counted as written), wait for events a little and go round again: 250 ms,
   but right after a weight update 5 ms, doubling (:func:`room_wait_ms`), since the trainer makes room for the next
   batch just after it publishes.
5. Top up to ``promptsPerBatch`` groups in flight, as many as the bounds leave room for (DESIGN §6). A backend that
   is not continuous (``cpu``) generates them at once, as one batch.

Following the trainer back: when the trainer resumes from an older checkpoint, a document with a token of the newer
weights of the abandoned timeline (a version above the trainer's model_version) is dropped at write time and counted
(``documents_abandoned`` in the rollout hash, ``rljob_rollout_abandoned_documents_total``); the next iteration loads
the resumed weights the trainer announces at its start.

Version tagging: each token carries the version of the weights that sampled it (:attr:`~.backends.base.Completion.
versions`; from the ``cpu`` backend, whose weights change only between batches, the version the group was submitted
under). A sample spanning an in-flight update counts, for its reward, under its newest version. A transfer that fails
after touching the weights (possible with vLLM, which loads tensor by tensor) aborts the groups in flight and leaves
the worker with no version: it generates nothing until the next update.

Reward failures: a reward function that raises drops that sample; the exception's class name is counted in
the rollout hash and logged once per kind (with its traceback); the worker keeps going. A batch where every
sample failed (``promptsPerBatch`` groups in a row without a scored sample: finished groups with none wait, unreported,
until a scored group reports them with its own or that many have failed) writes nothing and extends the failure streak ``all_rewards_failed`` in the rollout hash (since when,
the exceptions by class and message; the operator ends the job after ``spec.rollout.rewardFailureDeadlineSeconds``).
After such a batch the worker backs off before the next one: jittered exponential back-off, 1 s doubling to 60 s
(:data:`REWARD_BACKOFF_INITIAL_S`, :data:`REWARD_BACKOFF_CAP_S`; each wait drawn in [0.5, 1] × the nominal delay,
:class:`~rljob_rollout.backoff.Backoff`), reset by the first batch with a scored sample. A reward function that
raises on everything then costs about one batch a minute instead of a GPU generating at full speed for nothing. The
wait is spent polling the events stream, so weight updates and ``training_finished`` are handled during it (and the
heartbeats go on); a loaded update does not end the wait.

Stopping (SIGTERM: a scale-down or a deletion of the pod): the worker takes no new prompt, leaves the weight group at
once (its members deleted, so no update waits for it), then for up to :data:`DRAIN_S` collects, scores and writes the
groups still in flight (each group's documents in one transaction: never half a group); samples still in flight then
are dropped and counted (``samples_dropped_at_stop`` in the rollout hash, ``rljob_rollout_samples_dropped_at_stop_total``).

Seeds: prompts are drawn with ``rollout.seed`` + the replica index at the first start of a replica index in a job, so
runs are reproducible; every later start of the same index (a re-created pod, a restarted container) counts its starts
in the rollout hash (``starts:{replica}``) and mixes the count in (:func:`replica_seed`), so it never replays the
prompts its predecessor drew.

Outages: Redis errors (after the client's own retries) make the loop wait with jittered exponential backoff
(0.5 s doubling to 30 s) and try again, forever — no crash loop; an unreachable trainer only makes transfers
fail, and the worker keeps its weights and waits for the next ``weights_ready``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import redis

from rljob_api import protocol
from rljob_api.config import JobConfig
from rljob_rollout.advantages import filter_zero_variance, group_advantages
from rljob_rollout.backoff import Backoff
from rljob_rollout.capacity import CapacityClock, sampled_tokens
from rljob_rollout.backends.base import Completion, GenerationBackend, Group, UpdateOutcome
from rljob_rollout.worker_metrics import RolloutMetrics
from rljob_rollout.tasks import InvalidReward, Prompt, Task
from rljob_rollout.writer import BatchReport, DocumentWriter, make_document
from rljob_wire.connection import RedisTLSError
from rljob_api.protocol import Event
from rljob_rollout.weight_subscriber import WeightSubscriber

log = logging.getLogger(__name__)

WAIT_FOR_WEIGHTS_MS = 1000
"""Longest single wait for events before the first weights (milliseconds)."""
WAIT_FOR_ROOM_MS = 250
"""Wait for events while back-pressure holds the worker (milliseconds)."""
RECHECK_AFTER_UPDATE_MS = 5
"""The first wait for events while held back right after a weight update (milliseconds); each further one doubles, up
to :data:`WAIT_FOR_ROOM_MS` (:func:`room_wait_ms`). The trainer reports a step (progress hash) just after the
publication the worker took part in, so the room that step makes shows within milliseconds. With a flat 250 ms wait a
synchronous job (maxLag 0) lost 0.25-0.35 s on about half of its steps (docs/time-to-reward.md)."""
OUTAGE_BACKOFF_INITIAL_S = 0.5
OUTAGE_BACKOFF_CAP_S = 30.0
"""Waits between tries while Redis is unreachable (seconds; :class:`~rljob_rollout.backoff.Backoff`, doubling)."""
REWARD_BACKOFF_INITIAL_S = 1.0
REWARD_BACKOFF_CAP_S = 60.0
"""Waits between batches whose every reward failed (seconds; doubling, module docstring)."""


DRAIN_S = 10.0
"""After SIGTERM (a scale-down, a deletion), how long the worker goes on collecting, scoring and writing its groups in
flight (seconds), after it has left the weight group; what is still in flight then is dropped and counted. Well within
a pod's default 30 s grace period."""
COLLECT_WAIT_S = 0.05
"""Longest wait for a finished group while groups are in flight (seconds): the delay, at most, before the worker sees a
weights_ready event then."""


@dataclass(frozen=True)
class Submitted:
    """A group in flight: its prompt, the weights version when it was submitted, and when (time.monotonic())."""

    prompt: Prompt
    version: int
    at: float


def completion_versions(completion: Completion, submitted: int) -> tuple[int, ...]:
    """The version of each of ``completion``'s tokens: the backend's (:attr:`Completion.versions`), or ``submitted``
    for every token when it gives none."""
    return completion.versions if completion.versions is not None else (submitted,) * len(completion.token_ids)


def room_wait_ms(checks_since_update: int) -> int:
    """How long to wait for events (milliseconds) before checking back-pressure and max lag again, when the worker was
    held back ``checks_since_update`` times since its last weight update: 5, 10, 20, 40, 80, 160, then 250 ms."""
    return min(WAIT_FOR_ROOM_MS, RECHECK_AFTER_UPDATE_MS << min(checks_since_update, 16))


def replica_seed(seed: int, replica_index: int, start: int) -> int:
    """The seed of a rollout worker's prompts and sampling: ``seed + replica_index`` at the index's first ``start``
    (1), else a 63-bit integer drawn by numpy's SeedSequence from (seed, index, start), so each start of an index
    draws other prompts.

    Raises:
        ValueError: ``start`` below 1.
    """
    if start < 1:
        raise ValueError(f"start must be >= 1, got {start}")
    if start == 1:
        return seed + replica_index
    import numpy as np

    return int(np.random.SeedSequence([seed, replica_index, start]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _count_start(client: redis.Redis, config: JobConfig, replica_index: int) -> int:
    """Count this start of ``replica_index`` in the rollout hash (``starts:{replica}``) and return the count; a Redis
    outage is waited out as the loop does.

    Raises:
        redis.AuthenticationError / RedisTLSError: a wrong password or CA bundle (never retried).
    """
    outage = Backoff(OUTAGE_BACKOFF_INITIAL_S, OUTAGE_BACKOFF_CAP_S)
    while True:
        try:
            return int(client.hincrby(config.keys.rollout, f"{protocol.ROLLOUT_STARTS_PREFIX}{replica_index}", 1))
        except (redis.AuthenticationError, RedisTLSError):
            raise
        except redis.RedisError as error:
            wait = outage.next_wait()
            log.warning("rollout: Redis unavailable at start (%s); retrying in %.1f s", error, wait)
            time.sleep(wait)


def finished_for(event: Event, max_steps: int) -> bool:
    """Whether a ``training_finished`` event found in the stream at start means a job with ``max_steps`` (optimizer
    steps) is done: its final step is >= ``max_steps``, or it carries no step (an older or upstream trainer)."""
    return event.step is None or event.step >= max_steps


class RolloutWorker:
    """One rollout pod's loop (see the module docstring).

    Args:
        config: the resolved job config.
        replica_index: this pod's index i (``<job>-rollout-<i>``).
        client: a bytes-mode Redis client (:func:`rljob_wire.connection.connect`).
        backend: the generation backend.
        task: prompts and rewards.
        tokenizer: decodes completions for the reward function.
        metrics: Prometheus instruments (a fresh, unserved set by default).
    """

    def __init__(
        self,
        config: JobConfig,
        replica_index: int,
        *,
        client: redis.Redis,
        backend: GenerationBackend,
        task: Task,
        tokenizer: Any,
        metrics: Optional[RolloutMetrics] = None,
    ) -> None:
        self.config = config
        self.spec = config.spec.rollout
        self.backend = backend
        self.task = task
        self.tokenizer = tokenizer
        self.subscriber = WeightSubscriber(config, client, replica_index)
        self.writer = DocumentWriter(client, config, replica_index)
        self.metrics = metrics or RolloutMetrics()
        limit = min(self.spec.sampling.max_new_tokens, task.max_new_tokens or self.spec.sampling.max_new_tokens)
        self.sampling = self.spec.sampling.model_copy(update={"max_new_tokens": limit})
        self.reward_errors: Counter = Counter()
        self.batches = 0
        self.reward_backoff = Backoff(REWARD_BACKOFF_INITIAL_S, REWARD_BACKOFF_CAP_S)
        self._generate_after = 0.0  # time.monotonic() before which no batch starts (reward back-off)
        self._stop = threading.Event()
        self._heartbeats_started = False
        self._last_wait_reason: Optional[str] = None
        self._held_since_update = 16  # checks held back since the last weight update; none yet: the long wait
        self._recheck_at = 0.0  # time.monotonic() before which a held worker with groups in flight does not check again
        self._submitted: dict[int, Submitted] = {}
        self._next_key = 0
        self._written_at = 0.0  # time.monotonic() of the last write: the rate's start
        self.capacity = CapacityClock()
        self.drain_s = DRAIN_S
        self._failed: Optional[BatchReport] = None  # groups with no scored sample since the last report
        self._failed_groups = 0  # groups with no scored sample in a row

    @classmethod
    def from_config(cls, config: JobConfig, replica_index: int, reward_file: Optional[str] = None) -> "RolloutWorker":
        """Build the worker of a rollout pod: tokenizer, backend (sampling seed = rollout seed + i), Redis client, this
        start counted, and the task (its prompts drawn with :func:`replica_seed` of the start).
        ``reward_file``: the file of ``spec.rollout.task.rewardSource`` (or ``environment.python.source``) in this
        container. With ``spec.rollout.environment`` the backend is wrapped in an episode runner
        (:func:`rljob_rollout.environments.build_runner`).

        Raises:
            StartFailure: a model that cannot be loaded or a backend this image cannot run (rljob_wire.model.load_from,
                rljob_rollout.backends.build_backend; names the field and its value).
            ValueError / FileNotFoundError / OSError: a bad task, dataset or reward function (names the field).
        """
        from rljob_wire.model import build_tokenizer
        from rljob_rollout.backends import build_backend
        from rljob_rollout.tasks import build_task
        from rljob_wire.connection import connect

        tokenizer = build_tokenizer(config.spec.model, config.spec.rollout.task)
        # The model first: one that cannot load is reported even while Redis is unreachable.
        backend = build_backend(config, tokenizer, config.spec.rollout.seed + replica_index)
        try:
            client = connect(config)
            start = _count_start(client, config, replica_index)
            # Built once per process (a reward module is loaded once), with this start's seed (module docstring).
            task = build_task(config.spec.rollout.task, tokenizer,
                              replica_seed(config.spec.rollout.seed, replica_index, start), reward_file)
        except BaseException:
            backend.close()
            raise
        worker = cls(config, replica_index, client=client, backend=backend, task=task, tokenizer=tokenizer)
        if config.spec.rollout.environment is not None:
            from rljob_rollout.environments import build_runner

            worker.backend = build_runner(config, backend, tokenizer, version=lambda: worker.version,
                                          observe=worker.metrics.observe_episode, code_file=reward_file)
        return worker

    @property
    def version(self) -> Optional[int]:
        """The loaded weights' version (documents), None before the first update."""
        return self.subscriber.version

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current iteration (SIGTERM, tests)."""
        self._stop.set()

    def run(self) -> int:
        """Loop until ``training_finished`` (returns 0) or :meth:`stop` (returns 0). Redis outages are waited out.

        A ``training_finished`` already in the stream at start ends the loop only when it finished this config's
        ``maxSteps`` (:func:`finished_for`; module docstring).

        Raises:
            redis.AuthenticationError: the Redis password is wrong (never retried).
            RedisTLSError: the server's certificate does not verify against the CA bundle (never retried).
        """
        outage = Backoff(OUTAGE_BACKOFF_INITIAL_S, OUTAGE_BACKOFF_CAP_S)
        try:
            while not self._stop.is_set():
                try:
                    if not self._heartbeats_started:
                        last = self.subscriber.follow_from_now()
                        if last is not None and last.type == protocol.EVENT_TRAINING_FINISHED:
                            max_steps = self.config.spec.trainer.max_steps
                            if finished_for(last, max_steps):
                                log.info("rollout: training already finished (step %s); exiting", last.step)
                                return 0
                            log.info("rollout: ignoring an earlier attempt's training_finished "
                                     "(step %d < maxSteps %d)", last.step, max_steps)
                        self.subscriber.start_heartbeats()
                        self._heartbeats_started = True
                    if self.step():
                        log.info("rollout: training_finished received after %d batches; exiting", self.batches)
                        return 0
                    outage.reset()
                except (redis.AuthenticationError, RedisTLSError):
                    raise  # a wrong password or CA bundle: waiting cannot fix it, the pod's restarts say so
                except redis.RedisError as error:
                    wait = outage.next_wait()
                    log.warning("rollout: Redis unavailable (%s); retrying in %.1f s", error, wait)
                    self._stop.wait(wait)
            self.subscriber.leave()  # at once: no weight update waits for a worker on its way out
            self._drain(self.drain_s)
            return 0
        finally:
            self.subscriber.leave()

    def _drain(self, seconds: float = DRAIN_S) -> None:
        """Write the groups in flight that finish within ``seconds``; count the samples of the rest as dropped."""
        deadline = time.monotonic() + seconds
        try:
            while self.backend.in_flight and time.monotonic() < deadline:
                self._write(self.backend.finished(timeout_s=min(COLLECT_WAIT_S, max(0.0, deadline - time.monotonic()))))
        except redis.RedisError as error:
            log.warning("rollout: stopping: could not write the groups in flight: %s", error)
        dropped = self.backend.in_flight * self.spec.samples_per_prompt
        if not dropped:
            return
        self.metrics.dropped_at_stop.inc(dropped)
        log.warning("rollout: stopping: %d samples still in flight after %.0f s dropped", dropped, seconds)
        try:
            self.writer.count_dropped_at_stop(dropped)
        except redis.RedisError as error:
            log.warning("rollout: could not count %d samples dropped at stop: %s", dropped, error)

    def step(self) -> bool:
        """One iteration (module docstring). Returns True when training has finished. Raises redis.RedisError."""
        backing_off = self._generate_after - time.monotonic()
        if self.backend.in_flight:
            block: Optional[int] = None  # the wait is on the engine, below
        elif self.version is None:
            block = WAIT_FOR_WEIGHTS_MS
        elif backing_off > 0:
            block = min(max(1, math.ceil(backing_off * 1000)), WAIT_FOR_WEIGHTS_MS)
        elif self._last_wait_reason is not None:
            block = room_wait_ms(self._held_since_update)
        else:
            block = None
        if self._handle_events(self.subscriber.poll(block_ms=block)):
            return True
        if self.backend.in_flight:
            self._write(self.backend.finished(timeout_s=COLLECT_WAIT_S))
        if self.version is None or self._stop.is_set() or time.monotonic() < self._generate_after:
            self.capacity.release()  # idle for another reason than back-pressure
            return False
        if self._top_up() and not self.backend.continuous:
            self._write(self.backend.finished(timeout_s=0))  # generated here, with the weights they were submitted under
        return False

    def _top_up(self) -> int:
        """Submit groups while fewer than ``promptsPerBatch`` are in flight and back-pressure and max lag leave room,
        samples in flight counted as written (DESIGN §6). Returns the groups submitted. Raises redis.RedisError."""
        free = self.spec.prompts_per_batch - self.backend.in_flight
        if free <= 0 or time.monotonic() < self._recheck_at:
            return 0
        group_size = self.spec.samples_per_prompt
        in_flight = self.backend.in_flight * group_size
        state = self.writer.snapshot()
        self.metrics.observe_backlog(state)
        reason = self.writer.wait_reason(state, in_flight)
        if reason is not None:
            self.capacity.hold()
            if self.capacity.due():
                self._report_capacity()
            if reason != self._last_wait_reason:
                log.info("rollout: waiting: %s", reason)
            self._last_wait_reason = reason
            self._held_since_update += 1
            self._recheck_at = time.monotonic() + room_wait_ms(self._held_since_update) / 1000 if in_flight else 0.0
            self.metrics.waiting.set(1)
            return 0
        self.capacity.release()
        self._last_wait_reason = None
        self._recheck_at = 0.0
        self.metrics.waiting.set(0)
        return self._submit(min(free, -(-self.writer.room(state, in_flight) // group_size)))

    def _report_capacity(self) -> None:
        """Report the capacity while held (no batch is written meanwhile): the rollout hash and the gauges."""
        capacity = self.capacity.sample()
        self.writer.report_capacity(capacity)
        self.metrics.observe_capacity(capacity)

    def _submit(self, count: int) -> int:
        """Submit ``count`` groups of the task's next prompts under the current version; returns ``count``."""
        now = time.monotonic()
        for prompt in self.task.next_prompts(count):
            key, self._next_key = self._next_key, self._next_key + 1
            self._submitted[key] = Submitted(prompt, self.version, now)
            self.backend.submit_prompt(key, prompt, self.spec.samples_per_prompt, self.sampling)
        return count

    def _handle_events(self, events: list[Event]) -> bool:
        invitation: Optional[Event] = None
        mine = set(self.subscriber.transfer_ranks)
        for event in events:
            if event.type == protocol.EVENT_TRAINING_FINISHED:
                return True
            if event.type != protocol.EVENT_WEIGHTS_READY:
                continue
            if event.ticket is None:
                log.warning("rollout: weights_ready %s carries no transfer ticket (not an rljob trainer?); ignored", event.id)
            elif mine & set(event.ticket.members):
                invitation = event
        if invitation is not None:
            self._update_weights(invitation)
        return False

    def _update_weights(self, event: Event) -> None:
        started, in_flight = time.monotonic(), self.backend.in_flight
        outcome = self.backend.receive_weights(event.ticket, self.subscriber.address, self.subscriber.transfer_ranks,
                                               event.documents_seen)
        self.metrics.updates.labels(outcome=outcome.value).inc()
        if outcome is UpdateOutcome.LOADED:
            previous, self.subscriber.version = self.version, event.documents_seen
            self._held_since_update, self._recheck_at = 0, 0.0
            log.info(
                "rollout: loaded weights of step %d, version %s -> %d (%.2f s, %d groups in flight)",
                event.step, previous, event.documents_seen, time.monotonic() - started, in_flight,
            )
            self.metrics.model_version.set(event.documents_seen)
            self.subscriber.heartbeat()
        elif outcome is UpdateOutcome.FAILED_TORN:
            self.subscriber.version = None
            log.error("rollout: weight update %s failed half-way; generating nothing until the next update", event.ticket.id)
        else:
            log.info("rollout: weight update %s: %s; keeping version %s", event.ticket.id, outcome.value, self.version)

    def generate_batch(self) -> int:
        """Submit ``promptsPerBatch`` groups whatever the stream's room, wait for every group in flight and write them;
        for tests and tools (the loop is :meth:`step`). Returns the documents written. Raises redis.RedisError.

        Raises:
            RuntimeError: no weights loaded yet.
        """
        if self.version is None:
            raise RuntimeError("rollout: generate_batch called before any weights were loaded")
        self._submit(self.spec.prompts_per_batch)
        written = 0
        while self.backend.in_flight:
            written += self._write(self.backend.finished(timeout_s=COLLECT_WAIT_S))
        return written

    def _write(self, done: list[tuple[int, Group]]) -> int:
        """Score the finished groups, compute their advantages, write their documents and report them (module
        docstring). After a set whose every reward failed the next groups wait out the reward back-off; a set with a
        scored sample resets it. Returns the documents written. Raises redis.RedisError."""
        if not done:
            return 0
        finished = [(self._submitted.pop(key), group) for key, group in done]
        aborted = sum(1 for _, group in finished if group is None)
        if aborted:
            self.metrics.aborted.inc(aborted * self.spec.samples_per_prompt)
            log.warning("rollout: %d groups aborted by a torn weight update", aborted)
        finished = [(submitted, group) for submitted, group in finished if group is not None]
        if not finished:
            return 0
        self.capacity.generated(sum(sampled_tokens(completion.token_ids, completion.masked_spans)
                                    for _, group in finished for completion in group))
        now = time.monotonic()
        seconds = now - max(self._written_at, min(submitted.at for submitted, _ in finished))
        self._written_at = now
        errors: Counter = Counter()
        scored = [(submitted, self._score(submitted.prompt, group, errors)) for submitted, group in finished]
        nonempty = [(submitted, group) for submitted, group in scored if group]
        kept = filter_zero_variance([[r for _, r in group] for _, group in nonempty], enabled=self.spec.filter_zero_variance)
        documents, newest = [], []
        for index in kept.kept:
            submitted, group = nonempty[index]
            advantages = group_advantages(
                [r for _, r in group], normalize_std=self.spec.advantage.normalize_std, epsilon=self.spec.advantage.epsilon
            )
            for (completion, reward), advantage in zip(group, advantages):
                versions = completion_versions(completion, submitted.version)
                documents.append(make_document(submitted.prompt.token_ids, completion.token_ids, completion.logprobs,
                                               reward=reward, advantage=float(advantage), model_version=versions,
                                               masked_spans=completion.masked_spans))
                newest.append(max(versions, default=submitted.version))
        samples = [(completion, reward, submitted.version) for submitted, group in scored for completion, reward in group]
        reward_versions = [max(completion_versions(completion, version), default=version)
                           for completion, _, version in samples]
        report = BatchReport(max(reward_versions or [s.version for s, _ in finished]), [r for _, r, _ in samples],
                             len(finished) * self.spec.samples_per_prompt, errors, kept.groups_dropped,
                             kept.samples_dropped, seconds, reward_versions)
        if not report.rewards:  # and so no documents
            self._failed = report if self._failed is None else self._failed.merged(report)
            self._failed_groups += len(finished)
            if self._failed_groups < self.spec.prompts_per_batch:
                return 0  # reported with the next scored groups, or once a batch's worth of groups has failed
            report, self._failed = self._failed, None
        elif self._failed is not None:
            report, self._failed = self._failed.merged(report), None
        self._failed_groups = 0
        written = self.writer.write(documents, newest)
        if written < len(documents):
            self.metrics.abandoned.inc(len(documents) - written)
        capacity = self.capacity.sample()
        self.writer.report(report, capacity)
        self.metrics.observe_batch(report, written)
        self.metrics.observe_capacity(capacity)
        if report.rewards:
            self.reward_backoff.reset()
            self._generate_after = 0.0
        else:
            wait = self.reward_backoff.next_wait()
            self._generate_after = time.monotonic() + wait
            log.error("rollout: every one of the %d samples of the batch failed its reward function or episode (%s); "
                      "nothing written; next groups in %.1f s (back-off)", report.samples_generated,
                      dict(report.errors_by_class), wait)
        self.batches += 1
        return written

    def _score(self, prompt: Prompt, completions: list[Completion], errors: Counter) -> list[tuple[Completion, float]]:
        """(completion, reward) of every completion whose reward could be computed; failures counted in ``errors`` per
        :func:`rljob_api.protocol.reward_error_key` ("Class: message")."""
        group = []
        for completion in completions:
            try:
                reward = float(self.task.score(prompt, completion, self.tokenizer))
                if not math.isfinite(reward):
                    raise InvalidReward(f"reward {reward} is not finite")
            except Exception as error:  # noqa: BLE001 - user code: any exception drops only this sample
                kind = type(error).__name__
                if kind not in self.reward_errors:
                    log.warning("rollout: reward function raised %s; dropping such samples (logged once per kind)", kind, exc_info=True)
                self.reward_errors[kind] += 1
                errors[protocol.reward_error_key(kind, str(error))] += 1
                continue
            group.append((completion, reward))
        return group
