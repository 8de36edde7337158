"""Documents onto the stream (DESIGN §3), with back-pressure and max lag (DESIGN §6), and the rollout hash (§2).

Both bounds read one snapshot of the stream's consumer group (:class:`StreamBacklog`, one MULTI/EXEC):

* ``undelivered``: entries no trainer rank has been handed yet (XINFO GROUPS ``lag``, at most the stream length
  less the pending entries: :meth:`rljob_api.protocol.Backlog.from_groups`; the stream length before the trainer has created the group);
* ``pending``: entries delivered and not yet acknowledged (XINFO GROUPS ``pending``), i.e. not yet covered by a
  committed checkpoint. Some of them the trainer's current attempt has already trained and only waits to ack
  (``trained_unacked``); the rest are being trained, read ahead, or were delivered to an earlier attempt and are
  delivered again after a restart (the group's pending entries spread over the current ranks, then each rank re-reads its own);
* ``trained_unacked`` = the progress hash's ``documents_seen`` − ``checkpoint_documents_seen``: documents the
  current attempt trained since the checkpoint it last committed or started from. Trainer rank 0 writes both at
  every start (the loaded checkpoint's documents_seen, or 0 from scratch), so the difference is right across a
  restart from an older checkpoint or from scratch, where documents_seen goes back.

* ``dropped_unacked`` = the progress hash's ``dropped_stale`` − ``checkpoint_dropped_stale``: documents the current
  attempt dropped as staler than ``algorithm.maxStaleness`` since its last checkpoint; pending like the trained ones
  until that checkpoint acks them (0 at every start, and always without maxStaleness).

Back-pressure: ``backlog`` = undelivered + pending − dropped_unacked. A worker starts a batch only while
``backlog < redis.maxPending``. Stale drops do not count: the trainer needs fresh documents to replace them before it
reaches the checkpoint that acks them, so counting them could stop the rollout for good; the stream then holds up to
maxPending plus the drops of one checkpoint interval.
Nothing is ever trimmed here: only the trainer trims, and only acked entries. (A trainer needs
documentsPerStep × everySteps unacked entries to reach its next checkpoint; the spec check
``documentsPerStep × everySteps <= maxPending`` keeps that reachable.)

Max lag: ``ahead`` = documents generated and not yet trained by the trainer's current attempt = undelivered +
(pending − trained_unacked − dropped_unacked) — entries trained (or dropped as stale) and only waiting for a
checkpoint's ack are not ahead of anything.
A worker starts a batch only while ``ahead < max(rollout.maxLag, trainer.batch.documentsPerStep)``: the floor of one
step's worth keeps the trainer able to fill a step when maxLag is smaller (maxLag = 0 then means "one step ahead at
most", the synchronous limit). A batch may overshoot by its own size, per worker. Documents the trainer drops (too
long, malformed) are acked at once, so they leave both counts; ``documents_written`` is a statistic only.

Between the end of one trainer attempt and the start of the next, the progress hash still describes the old
attempt: the rollout may then run ahead by up to one checkpoint interval more, until the new attempt's start resets
``checkpoint_documents_seen``.

Rollout hash (``keys.rollout``; every worker adds to the same fields, see :mod:`rljob_api.protocol`):
``reward_sum:{v}`` / ``reward_count:{v}`` over every scored sample generated with weights version v, before
filtering, for the newest ``ROLLOUT_REWARD_VERSIONS_KEPT`` versions present (each report deletes older pairs in its
own WATCH/MULTI/EXEC transaction, so the hash stays bounded); ``reward`` / ``reward_version`` = that mean for the
version of the writer's last batch, unless that version was pruned; ``samples_generated``,
``documents_written``, ``reward_errors`` and ``reward_errors:{class}``, ``groups_filtered`` and
``samples_filtered`` (zero-variance filter), ``all_rewards_failed`` (see the constant), ``worker:{replica}`` =
the worker's :class:`~rljob_api.protocol.WorkerReport` (its last batch's version and rate, and its capacity:
:mod:`rljob_rollout.capacity`), ``updated_at``.

Reward-failure streak: a batch with no scored sample extends the hash's ``all_rewards_failed`` record
(:func:`rljob_api.protocol.after_failing_batch`: since when, how many batches and samples, the failures by
"Class: message", Redis clock) in the transaction that adds the batch; a batch with a scored sample deletes it, so
the record always describes failures with no scored sample, from any worker, in between.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import redis

from rljob_api import protocol
from rljob_api.config import JobConfig
from rljob_wire.codec import Document, encode_document

from rljob_rollout.capacity import Capacity

log = logging.getLogger(__name__)

def make_document(prompt_ids: Sequence[int], completion_ids: Sequence[int], completion_logprobs: Sequence[float],
                  *, reward: float, advantage: float, model_version: int | Sequence[int],
                  masked_spans: Sequence[tuple[int, int]] = ()) -> Document:
    """One stream document: prompt + completion tokens, the labels of the prompt and of ``masked_spans`` masked.

    Args:
        model_version: the weights version (documents) of every completion token ([N] ints), or one for all of them.
            The prompt's tokens get the first completion token's: the weights that first read the prompt.
        masked_spans: half-open ``(begin, end)`` ranges of the completion (completion coordinates) the model did not
            sample (an episode's observations, :attr:`~rljob_rollout.backends.base.Completion.masked_spans`).

    Returns:
        :class:`Document` with tokens [T] int64 (T = P + N), old_log_probabilities [T] float32 (0 on the P
        prompt tokens, the sampling log-probabilities on the N completion tokens), model_version [T] int64,
        loss_masking_spans ``[(0, P)]`` (none for an empty prompt) then each masked span shifted by P, the advantage and
        raw reward.

    Raises:
        ValueError: per-token versions whose count is not N; a masked span outside [0, N] or inverted.
    """
    num_prompt = len(prompt_ids)
    tokens = np.asarray(list(prompt_ids) + list(completion_ids), dtype=np.int64)
    old = np.zeros(len(tokens), dtype=np.float32)
    old[num_prompt:] = np.asarray(completion_logprobs, dtype=np.float32)
    if isinstance(model_version, (int, np.integer)):
        versions = np.full(len(tokens), model_version, dtype=np.int64)
    else:
        if len(model_version) != len(completion_ids):
            raise ValueError(f"make_document: {len(model_version)} versions for {len(completion_ids)} completion tokens")
        first = model_version[0] if len(model_version) else 0
        versions = np.asarray([first] * num_prompt + list(model_version), dtype=np.int64)
    spans = [(0, num_prompt)] if num_prompt else []
    for begin, end in masked_spans:
        if not 0 <= begin <= end <= len(completion_ids):
            raise ValueError(f"make_document: masked span [{begin}, {end}) outside the {len(completion_ids)} "
                             "completion tokens")
        spans.append((num_prompt + begin, num_prompt + end))
    return Document(tokens, old, versions, spans, float(advantage), float(reward))


@dataclass(frozen=True)
class BatchReport:
    """What one generated batch contributes to the rollout hash.

    Attributes:
        version: the newest weights version of the batch's samples (documents).
        rewards: rewards of every scored sample (before filtering; failed samples excluded).
        samples_generated: completions generated (scored or not).
        reward_errors: failed samples per :func:`rljob_api.protocol.reward_error_key` ("Class: message", or the
            class alone).
        groups_filtered / samples_filtered: dropped by the zero-variance filter.
        seconds: wall time of generation + scoring (seconds).
        reward_versions: the version each reward's sample counts under (parallel to ``rewards``: the newest version of
            its tokens, DESIGN §3); None: all ``version``.
    """

    version: int
    rewards: Sequence[float]
    samples_generated: int
    reward_errors: Counter
    groups_filtered: int
    samples_filtered: int
    seconds: float
    reward_versions: Optional[Sequence[int]] = None

    def merged(self, other: "BatchReport") -> "BatchReport":
        """This report and ``other`` as one (counts and times added, rewards kept with their versions)."""
        return BatchReport(
            max(self.version, other.version), [*self.rewards, *other.rewards],
            self.samples_generated + other.samples_generated, self.reward_errors + other.reward_errors,
            self.groups_filtered + other.groups_filtered, self.samples_filtered + other.samples_filtered,
            self.seconds + other.seconds,
            [*(self.reward_versions or [self.version] * len(self.rewards)),
             *(other.reward_versions or [other.version] * len(other.rewards))])

    def rewards_by_version(self) -> dict[int, list[float]]:
        """The rewards per version, ``version`` first (it is there even without rewards)."""
        by_version: dict[int, list[float]] = {self.version: []}
        for version, reward in zip(self.reward_versions or [self.version] * len(self.rewards), self.rewards):
            by_version.setdefault(version, []).append(reward)
        return by_version

    @property
    def errors_by_class(self) -> Counter:
        """Failed samples per exception class name."""
        counts: Counter = Counter()
        for key, n in self.reward_errors.items():
            counts[protocol.reward_error_class(key)] += n
        return counts


@dataclass(frozen=True)
class StreamBacklog:
    """One snapshot of the stream's consumer group as the rollout sees it (module docstring); all in documents.

    Attributes:
        undelivered: entries no trainer rank has been handed yet (the group's lag; the stream length before the
            group exists).
        pending: entries delivered to a trainer rank and not yet acknowledged.
        trained_unacked: documents the trainer's current attempt has trained since the checkpoint it last committed
            or started from (progress hash: documents_seen − checkpoint_documents_seen; 0 before the trainer wrote
            them). They are pending until the next checkpoint acks them.
        dropped_unacked: documents the current attempt dropped as stale since that checkpoint (progress hash:
            dropped_stale − checkpoint_dropped_stale; 0 without them), pending until the next checkpoint as well.
    """

    undelivered: int
    pending: int
    trained_unacked: int
    dropped_unacked: int = 0

    @property
    def backlog(self) -> int:
        """Entries not yet acknowledged, stale drops aside: undelivered + pending − dropped_unacked (what
        ``redis.maxPending`` bounds), the pending part floored at 0."""
        return self.undelivered + max(0, self.pending - self.dropped_unacked)

    @property
    def ahead(self) -> int:
        """Documents generated and not yet trained by the current attempt: undelivered + (pending − trained_unacked −
        dropped_unacked), the pending part floored at 0 (the progress hash and the group are written at slightly
        different times)."""
        return self.undelivered + max(0, self.pending - self.trained_unacked - self.dropped_unacked)


class DocumentWriter:
    """Writes one worker's documents and statistics (see the module docstring).

    Args:
        client: a Redis client (bytes responses).
        config: the resolved job config (keys, maxPending, maxLag, documentsPerStep).
        replica_index: this worker's replica index (names its ``worker:{i}`` field).
        reward_versions_kept: per-version reward pairs kept in the rollout hash (the newest versions by number).

    Raises:
        ValueError: ``reward_versions_kept`` < 1.
    """

    def __init__(self, client: redis.Redis, config: JobConfig, replica_index: int,
                 reward_versions_kept: int = protocol.ROLLOUT_REWARD_VERSIONS_KEPT) -> None:
        if reward_versions_kept < 1:
            raise ValueError(f"reward_versions_kept={reward_versions_kept}: keep at least the newest version")
        self.reward_versions_kept = reward_versions_kept
        self._client = client
        self._keys = config.keys
        self.max_pending = config.spec.redis.max_pending
        self.max_ahead = max(config.spec.rollout.max_lag, config.spec.trainer.batch.documents_per_step)
        self._worker_field = f"{protocol.ROLLOUT_WORKER_PREFIX}{replica_index}"
        self._worker = protocol.WorkerReport()  # the last batch's version and rate
        self._last_failed = False  # this writer's last batch had no scored sample

    def snapshot(self) -> StreamBacklog:
        """The group's undelivered and pending entries and the trainer's trained-unacked documents, read in one
        MULTI/EXEC (module docstring). Raises RedisError."""
        pipe = self._client.pipeline(transaction=True)
        pipe.xinfo_groups(self._keys.stream)
        pipe.xlen(self._keys.stream)
        pipe.hmget(self._keys.progress, [protocol.PROGRESS_DOCUMENTS_SEEN, protocol.PROGRESS_CHECKPOINT_DOCUMENTS_SEEN,
                                         protocol.PROGRESS_DROPPED_STALE, protocol.PROGRESS_CHECKPOINT_DROPPED_STALE])
        groups, length, progress = pipe.execute(raise_on_error=False)
        if isinstance(length, Exception) or isinstance(progress, Exception):
            raise length if isinstance(length, Exception) else progress
        seen, checkpointed, dropped, dropped_checkpointed = progress
        trained = max(0, int(seen or 0) - int(checkpointed or 0)) if checkpointed is not None else 0
        dropped = max(0, int(dropped or 0) - int(dropped_checkpointed or 0))
        if isinstance(groups, redis.ResponseError):  # no such stream yet
            return StreamBacklog(undelivered=0, pending=0, trained_unacked=trained, dropped_unacked=dropped)
        if isinstance(groups, Exception):
            raise groups
        backlog = protocol.Backlog.from_groups(groups, self._keys.group, length=int(length))
        if backlog is None:  # the trainer has not created its group yet
            return StreamBacklog(undelivered=int(length), pending=0, trained_unacked=trained, dropped_unacked=dropped)
        return StreamBacklog(int(backlog.undelivered), backlog.pending, trained, dropped)

    def backlog(self) -> int:
        """Undelivered + pending entries (documents): :attr:`StreamBacklog.backlog`. Raises RedisError."""
        return self.snapshot().backlog

    def ahead(self) -> int:
        """Documents generated and not yet trained by the trainer's current attempt: :attr:`StreamBacklog.ahead`.
        Raises RedisError."""
        return self.snapshot().ahead

    def wait_reason(self, state: Optional[StreamBacklog] = None, in_flight: int = 0) -> Optional[str]:
        """Why the worker must not start another group now (back-pressure or max lag), or None, from ``state`` (default:
        a :meth:`snapshot` taken now) and the ``in_flight`` samples it has started and not yet written, which count as
        written (DESIGN §6). Raises RedisError."""
        state = state or self.snapshot()
        dropped = f" - {state.dropped_unacked} dropped as stale" if state.dropped_unacked else ""
        flight = f" + {in_flight} in flight" if in_flight else ""
        if state.backlog + in_flight >= self.max_pending:
            return (
                f"backlog {state.backlog} ({state.undelivered} undelivered + {state.pending} pending{dropped}){flight} "
                f">= spec.redis.maxPending {self.max_pending} documents"
            )
        if state.ahead + in_flight >= self.max_ahead:
            return (
                f"{state.ahead} documents ahead of the trainer ({state.undelivered} undelivered + {state.pending} "
                f"pending - {state.trained_unacked} trained{dropped} and waiting for a checkpoint){flight} >= "
                f"max(maxLag, documentsPerStep) = {self.max_ahead}"
            )
        return None

    def room(self, state: StreamBacklog, in_flight: int = 0) -> int:
        """Samples the worker may still start before back-pressure or max lag holds it (0 when :meth:`wait_reason`
        gives one): min(maxPending − backlog, max(maxLag, documentsPerStep) − ahead) − ``in_flight``."""
        return max(0, min(self.max_pending - state.backlog, self.max_ahead - state.ahead) - in_flight)

    def write(self, documents: Sequence[Document], versions: Optional[Sequence[int]] = None) -> int:
        """XADD the documents and add their count to ``documents_written``, in one MULTI/EXEC, except those of a
        timeline the trainer abandoned: ``versions[i]`` (the newest weights document i was sampled with, documents)
        above the progress hash's ``model_version`` (the trainer's current weights; set back to the checkpoint's
        documents_seen when it resumes from an older one). Those are dropped and counted in ``documents_abandoned``
        instead; the check and the write are one WATCH/MULTI/EXEC on the progress hash, so a trainer start between
        them reruns the check. ``versions`` None: no check. Returns the documents written. Raises RedisError.

        Raises:
            ValueError: ``versions`` and ``documents`` differ in length.
        """
        if versions is not None and len(versions) != len(documents):
            raise ValueError(f"write: {len(versions)} versions for {len(documents)} documents")
        if not documents:
            return 0
        kept: list[Document] = []

        def add(pipe: redis.client.Pipeline) -> None:
            current = pipe.hget(self._keys.progress, protocol.PROGRESS_MODEL_VERSION)
            if versions is None or current is None:
                kept[:] = documents
            else:
                kept[:] = [doc for doc, version in zip(documents, versions) if version <= int(current)]
            pipe.multi()
            if len(kept) < len(documents):
                pipe.hincrby(self._keys.rollout, protocol.ROLLOUT_DOCUMENTS_ABANDONED, len(documents) - len(kept))
            for doc in kept:
                pipe.xadd(self._keys.stream, encode_document(doc))
            if kept:
                pipe.hincrby(self._keys.rollout, protocol.ROLLOUT_DOCUMENTS_WRITTEN, len(kept))

        self._client.transaction(add, self._keys.progress)
        if len(kept) < len(documents):
            log.warning("rollout: dropped %d documents sampled with weights newer than the trainer's (version %s): it "
                        "went back to an older checkpoint; loading its weights next", len(documents) - len(kept),
                        max(versions or [0]))
        return len(kept)

    def count_dropped_at_stop(self, samples: int) -> None:
        """Add ``samples`` to the rollout hash's ``samples_dropped_at_stop``. Raises RedisError."""
        self._client.hincrby(self._keys.rollout, protocol.ROLLOUT_SAMPLES_DROPPED_AT_STOP, samples)

    def report_capacity(self, capacity: Capacity) -> None:
        """Write this worker's :class:`~rljob_api.protocol.WorkerReport` with ``capacity`` between batches (while
        back-pressure holds it), its last batch's version and rate kept. Raises RedisError."""
        self._client.hset(self._keys.rollout, self._worker_field, self._worker_report(capacity, time.time()).to_field())

    def _worker_report(self, capacity: Optional[Capacity], now: Optional[float] = None) -> protocol.WorkerReport:
        report = self._worker if now is None else replace(self._worker, updated_at=now)
        if capacity is None:
            return report
        return replace(report, held_share=round(capacity.held_share, 4),
                       tokens_per_second=round(capacity.tokens_per_second, 1),
                       held_seconds=round(capacity.held_seconds, 3), window_s=round(capacity.window_s, 3))

    def report(self, batch: BatchReport, capacity: Optional[Capacity] = None) -> None:
        """Add one batch to the rollout hash, prune per-version reward pairs beyond the newest
        ``reward_versions_kept``, set or delete the reward-failure streak (module docstring), and write this worker's
        :class:`~rljob_api.protocol.WorkerReport` with ``capacity``. Raises RedisError."""
        key, version = self._keys.rollout, batch.version
        stale: list[str] = []

        def add(pipe: redis.client.Pipeline) -> None:
            # WATCH (by client.transaction) makes the pruning see the fields it deletes, and the streak the record it
            # extends: a concurrent write to the hash aborts the EXEC, and redis-py reruns this function.
            stale[:] = protocol.stale_reward_fields(pipe.hkeys(key), version, self.reward_versions_kept)
            streak = None
            if not batch.rewards:
                seconds, microseconds = pipe.time()
                previous = protocol.RewardFailures.from_field(pipe.hget(key, protocol.ROLLOUT_ALL_REWARDS_FAILED))
                streak = protocol.after_failing_batch(
                    previous, version=version, samples=batch.samples_generated, errors=batch.reward_errors,
                    now=seconds + microseconds / 1e6, own_streak=self._last_failed)
            pipe.multi()
            for each, rewards in batch.rewards_by_version().items():  # ``version`` first: its totals are replies 0, 1
                pipe.hincrbyfloat(key, f"{protocol.ROLLOUT_REWARD_SUM_PREFIX}{each}", float(sum(rewards)))
                pipe.hincrby(key, f"{protocol.ROLLOUT_REWARD_COUNT_PREFIX}{each}", len(rewards))
            pipe.hincrby(key, protocol.ROLLOUT_SAMPLES_GENERATED, batch.samples_generated)
            for kind, count in batch.errors_by_class.items():
                pipe.hincrby(key, f"{protocol.ROLLOUT_REWARD_ERRORS_PREFIX}{kind}", count)
            if batch.reward_errors:
                pipe.hincrby(key, protocol.ROLLOUT_REWARD_ERRORS, sum(batch.reward_errors.values()))
            if batch.groups_filtered:
                pipe.hincrby(key, protocol.ROLLOUT_GROUPS_FILTERED, batch.groups_filtered)
                pipe.hincrby(key, protocol.ROLLOUT_SAMPLES_FILTERED, batch.samples_filtered)
            if stale:
                pipe.hdel(key, *stale)
            if streak is None:
                pipe.hdel(key, protocol.ROLLOUT_ALL_REWARDS_FAILED)
            else:
                pipe.hset(key, protocol.ROLLOUT_ALL_REWARDS_FAILED, streak.to_field())

        total, count = self._client.transaction(add, key)[:2]
        self._last_failed = not batch.rewards
        now = time.time()
        self._worker = protocol.WorkerReport(version, batch.samples_generated / max(batch.seconds, 1e-9), now)
        mapping = {self._worker_field: self._worker_report(capacity).to_field(), protocol.ROLLOUT_UPDATED_AT: repr(now)}
        if count and f"{protocol.ROLLOUT_REWARD_COUNT_PREFIX}{version}" not in stale:
            mapping[protocol.ROLLOUT_REWARD] = repr(float(total) / int(count))
            mapping[protocol.ROLLOUT_REWARD_VERSION] = str(version)
        self._client.hset(key, mapping=mapping)
