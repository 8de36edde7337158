"""The Redis protocol beyond the stream entries (DESIGN §2, §3): key names, hash fields, the events stream's payloads,
the members heartbeat, and the records of the progress and rollout hashes with their parsing.

Pure definitions and functions over dicts, str and bytes: no Redis client is imported here (rljob_api stays free of
clients, DESIGN §9); each role makes its own Redis calls with these. The stream entries themselves (documents) have
their own codec (rljob_wire.codec).

Who writes and who reads each key and field is said next to it. This module is longer than most because it is the
whole protocol between four writers and readers (trainer rank 0, trainer ranks, rollout workers, the operator):
splitting it would put the two ends of one record in different files.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Optional, Sequence


def text(value: Any) -> Optional[str]:
    """A Redis reply value as str: bytes decoded as UTF-8, None kept, anything else ``str()``."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_order(entry_id: str) -> tuple[int, int]:
    """Sort key of a stream entry id ``<ms>-<seq>`` (Redis orders ids by both numbers, not as strings).

    Raises:
        ValueError: not an entry id.
    """
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# --- Keys (DESIGN §2) --------------------------------------------------------------------------
DEFAULT_STREAM_KEY = "fast_llm_streaming"
DEFAULT_GROUP_NAME = "fast_llm_group"
DEFAULT_CONSUMER_PREFIX = "fast_llm_consumer_"
DEFAULT_EVENTS_KEY = "fast_llm_events"
KEY_PROGRESS = "progress"
"""Hash written by trainer rank 0 after each step; read by the operator and rollout workers."""
KEY_ROLLOUT = "rollout"
"""Hash written by rollout workers; read by the operator."""
KEY_MEMBERS = "members"
"""Hash of rollout worker heartbeats (field = transfer rank, value = :func:`encode_member`). Written by rollout
workers, read by trainer rank 0 (rljob_trainer.weight_publisher)."""
KEY_DEAD_LETTER = "dead_letter"
"""Stream of malformed entries with their reason (written by trainer ranks)."""
KEY_STREAM_ID = "stream_id"
"""String: a random identity of the job's stream, set by trainer rank 0 at every start when absent (SET NX). The
operator keeps the one it saw (status.streamIdentity): another one, or none, means Redis forgot the stream."""
KEY_ATTEMPT = "attempt"
"""String: the gang attempt that owns the job's writes (rljob_trainer.fence); set by trainer rank 0 at every start."""
KEY_CHECKPOINT = "checkpoint"
"""Hash: the last committed checkpoint (:class:`CheckpointRecord`'s fields); written by trainer rank 0's commit thread,
read by the trainer at start (a lost checkpoint) and by the operator (status.lastCheckpoint)."""


def key_prefix(namespace: str, job: str) -> str:
    """Prefix of every rljob key for one job: ``rljob:{namespace}:{job}:``."""
    return f"rljob:{namespace}:{job}:"


# --- Progress hash (trainer global rank 0 writes; the operator and rollout workers read) ----------
PROGRESS_STEP = "step"
PROGRESS_DOCUMENTS_SEEN = "documents_seen"
PROGRESS_MODEL_VERSION = "model_version"
PROGRESS_TOKENS_PER_SECOND = "tokens_per_second"
PROGRESS_METRICS = "metrics"
"""JSON object {metric name: number} of the last step (DESIGN §4 names)."""
PROGRESS_STREAM = "stream"
"""JSON object {stream reader counter: documents} of the current attempt after its last step, all ranks."""
STREAM_DEAD_LETTERED_PREFIX = "dead_lettered."
"""Counters ``dead_lettered.<kind>`` of :data:`PROGRESS_STREAM`: dead-lettered entries by kind
(rljob_wire.codec.MalformedKind), present once non-zero."""
PROGRESS_UPDATED_AT = "updated_at"
"""Unix seconds of the last write."""
PROGRESS_CHECKPOINT_DOCUMENTS_SEEN = "checkpoint_documents_seen"
"""documents_seen of the checkpoint the trainer's attempt last committed or started from (0 from scratch): the
documents trained since then (documents_seen − this) are still pending in the stream's group, acked by the next
checkpoint. Written by trainer rank 0 at every start and before each checkpoint's acks; rollout workers read it
(rljob_rollout.writer: max lag)."""
PROGRESS_DROPPED_STALE = "dropped_stale"
"""Documents the trainer's current attempt dropped before the loss as staler than ``algorithm.maxStaleness``, all ranks
(each reader adds its drops with HINCRBY as it makes them; 0 at every start). They stay pending until the next
checkpoint acks them, like trained documents: rollout workers count dropped_stale − checkpoint_dropped_stale as done
with, not ahead (rljob_rollout.writer), or drops would hold them at max lag while the trainer waits to refill."""
PROGRESS_CHECKPOINT_DROPPED_STALE = "checkpoint_dropped_stale"
"""Of :data:`PROGRESS_DROPPED_STALE`, those the last committed checkpoint covers (acked); 0 at every start. Written by
trainer rank 0 with :data:`PROGRESS_CHECKPOINT_DOCUMENTS_SEEN`."""
PROGRESS_RESTORED_FROM_STEP = "restored_from_step"
"""Step of the checkpoint the trainer's current attempt started from (0 from scratch); written at every start."""
PROGRESS_STARTED_ATTEMPT = "started_attempt"
"""The gang attempt whose trainer last started (written by rank 0 at every start, once the model and the checkpoint are
loaded and every rank is about to read the stream): until it names the current attempt, no step of that attempt can
have been made, and the operator keeps the job in phase Starting (reason TrainerStarting)."""
PROGRESS_CHECKPOINT_LOST = "checkpoint_lost"
"""Present (:meth:`LostCheckpoint.to_field`) while the trainer's current attempt started below the checkpoint the
Redis checkpoint hash records, because that checkpoint is gone from the checkpoint volume; deleted by a start that
loses none. Trainer rank 0 writes it; the operator reports it."""


def start_fields(step: int, documents_seen: int, attempt: Optional[int] = None) -> dict[str, int]:
    """The progress fields trainer rank 0 sets at every start: the loaded checkpoint's ``step`` and
    ``documents_seen`` (0 from scratch) as step, documents_seen, model_version (= documents_seen, DESIGN §6),
    restored_from_step and checkpoint_documents_seen (nothing trained yet is unacked), the stale-drop counts of
    this attempt at 0, and the gang ``attempt`` as started_attempt (when known)."""
    fields = {PROGRESS_STEP: step, PROGRESS_DOCUMENTS_SEEN: documents_seen, PROGRESS_MODEL_VERSION: documents_seen,
              PROGRESS_RESTORED_FROM_STEP: step, PROGRESS_CHECKPOINT_DOCUMENTS_SEEN: documents_seen,
              PROGRESS_DROPPED_STALE: 0, PROGRESS_CHECKPOINT_DROPPED_STALE: 0}
    if attempt is not None:
        fields[PROGRESS_STARTED_ATTEMPT] = attempt
    return fields


def step_fields(step: int, documents_seen: int, model_version: int, tokens_per_second: float,
                metrics: Mapping[str, float], stream: Mapping[str, int], now: float) -> dict[str, Any]:
    """The progress fields trainer rank 0 sets after each step (``now``: unix seconds)."""
    return {PROGRESS_STEP: step, PROGRESS_DOCUMENTS_SEEN: documents_seen, PROGRESS_MODEL_VERSION: model_version,
            PROGRESS_TOKENS_PER_SECOND: repr(float(tokens_per_second)), PROGRESS_METRICS: json.dumps(dict(metrics)),
            PROGRESS_STREAM: json.dumps(dict(stream)), PROGRESS_UPDATED_AT: repr(now)}


def _integer(value: Any) -> Optional[int]:
    """``value`` when it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class LostCheckpoint:
    """The progress hash's ``checkpoint_lost``: checkpoint ``step`` at ``path`` is recorded in the Redis checkpoint
    hash but gone from the checkpoint volume, so the trainer started from step ``restored_from_step`` (0: from
    scratch). ``attempt``: the gang attempt whose start found the loss (None: not stamped, e.g. a trainer outside
    the operator). Parsed from an unreadable record, the unreadable parts are None."""

    step: Optional[int]
    path: Optional[str]
    restored_from_step: Optional[int]
    attempt: Optional[int] = None

    def belongs_to(self, attempt: int) -> bool:
        """Whether this record describes gang ``attempt``'s start: until the new gang's rank 0 replaces or deletes
        it, the hash still holds the previous attempt's record. An unstamped record is taken as current."""
        return self.attempt is None or self.attempt == attempt

    def to_field(self) -> str:
        """The field's JSON {step, path, restored_from_step, message[, attempt]} (``message``: for humans reading
        the hash; :func:`lost_checkpoint_message` without the volume)."""
        record = {k: v for k, v in asdict(self).items() if k != "attempt" or v is not None}
        return json.dumps({**record, "message": lost_checkpoint_message(self)})

    @classmethod
    def from_field(cls, raw: Any) -> Optional[LostCheckpoint]:
        """Parse the field (bytes or str); None when absent. Never raises: a bad field must not stop status
        updates, so an unreadable record still counts, its unreadable parts None."""
        info = _json_object(raw)
        if info is None:
            return None
        path = info.get("path")
        return cls(step=_integer(info.get("step")), path=path if isinstance(path, str) and path else None,
                   restored_from_step=_integer(info.get("restored_from_step")), attempt=_integer(info.get("attempt")))


_VOLUME_UNKNOWN = object()


def lost_checkpoint_message(lost: LostCheckpoint, volume: Any = _VOLUME_UNKNOWN) -> str:
    """The one description of a lost checkpoint, e.g. "attempt 1 started over at step 0: checkpoint step 35 (<path>)
    was lost: an emptyDir checkpoint volume does not survive a gang restart or suspend; set
    spec.trainer.checkpoint.volume to a PersistentVolumeClaim".

    ``volume``: spec.trainer.checkpoint.volume (None: an emptyDir); not given (the trainer does not know it): both
    cases are named."""
    if volume is _VOLUME_UNKNOWN:
        where = ("an emptyDir checkpoint volume does not survive a gang restart or suspend (set "
                 "spec.trainer.checkpoint.volume to a PersistentVolumeClaim), and a claim's data can be replaced or "
                 "cleaned")
    elif volume:
        where = (f"it is missing from PersistentVolumeClaim {volume} (spec.trainer.checkpoint.volume; was the claim "
                 "replaced or cleaned?)")
    else:
        where = ("an emptyDir checkpoint volume does not survive a gang restart or suspend; set "
                 "spec.trainer.checkpoint.volume to a PersistentVolumeClaim")
    who = f"attempt {lost.attempt}" if lost.attempt is not None else "the trainer"
    start = "started over" + (f" at step {lost.restored_from_step}" if lost.restored_from_step is not None else "")
    which = f"checkpoint step {lost.step}" if lost.step is not None else "the last recorded checkpoint"
    return f"{who} {start}: {which}" + (f" ({lost.path})" if lost.path else "") + f" was lost: {where}"


# --- Checkpoint hash (trainer rank 0 writes at each commit; the trainer at start and the operator read) ----------
CHECKPOINT_STEP = "step"
CHECKPOINT_DOCUMENTS_SEEN = "documents_seen"
CHECKPOINT_PATH = "path"
CHECKPOINT_UPDATED_AT = "updated_at"
"""Unix seconds of the commit (float repr)."""


@dataclass(frozen=True)
class CheckpointRecord:
    """The checkpoint hash: the newest committed checkpoint, optimizer step ``step`` having trained
    ``documents_seen`` documents (all ranks), in directory ``path`` of the trainer's checkpoint volume, committed at
    ``committed_at`` (unix seconds; None when unreadable)."""

    step: int
    documents_seen: int
    path: str
    committed_at: Optional[float] = None

    def to_fields(self) -> dict[str, Any]:
        """The hash's fields (HSET mapping)."""
        fields: dict[str, Any] = {CHECKPOINT_STEP: self.step, CHECKPOINT_DOCUMENTS_SEEN: self.documents_seen,
                                  CHECKPOINT_PATH: self.path}
        if self.committed_at is not None:
            fields[CHECKPOINT_UPDATED_AT] = repr(float(self.committed_at))
        return fields

    @classmethod
    def from_fields(cls, raw: Mapping[Any, Any]) -> Optional[CheckpointRecord]:
        """Parse the hash (HGETALL's reply, bytes or str); None when empty or when ``step``, ``documents_seen`` or
        ``path`` is missing or unreadable (never raises: a bad field must not stop status updates)."""
        fields = {text(k): v for k, v in raw.items()}
        step = _number(fields.get(CHECKPOINT_STEP), int)
        documents_seen = _number(fields.get(CHECKPOINT_DOCUMENTS_SEEN), int)
        path = text(fields.get(CHECKPOINT_PATH))
        if step is None or documents_seen is None or step < 0 or documents_seen < 0 or not path:
            return None
        return cls(step=step, documents_seen=documents_seen, path=path,
                   committed_at=_number(fields.get(CHECKPOINT_UPDATED_AT), float))


# --- Rollout hash (rollout workers add to it; the operator reads it) ------------------------------
# Workers add to the counters (HINCRBYFLOAT / HINCRBY), so several workers sum up; the operator reports sum / count
# of the newest model version as status.rolloutReward.
ROLLOUT_REWARD_SUM_PREFIX = "reward_sum:"
"""``reward_sum:{model_version}``: sum of raw rewards of every document generated with that weights version."""
ROLLOUT_REWARD_COUNT_PREFIX = "reward_count:"
"""``reward_count:{model_version}``: number of documents generated with that weights version."""
ROLLOUT_REWARD_VERSIONS_KEPT = 128
"""The rollout hash keeps ``reward_sum:{v}`` / ``reward_count:{v}`` of the newest this many weights versions (by v);
rollout workers delete older pairs in the transaction that adds a batch, so the hash stays bounded over a long run.
128 versions = 128 optimizer steps of reward history, enough for a learning curve; the operator reads only the newest."""
ROLLOUT_REWARD = "reward"
"""Mean reward of ``reward_version`` (sum / count over every worker), set by the worker that wrote last."""
ROLLOUT_REWARD_VERSION = "reward_version"
ROLLOUT_ALL_REWARDS_FAILED = "all_rewards_failed"
"""Present (:meth:`RewardFailures.to_field`) while rewards fail: the batches written since the streak began, by every
worker, had no sample whose reward function returned; deleted by the next batch that has one. A worker sets it in the
transaction that adds its batch (:func:`after_failing_batch`). The operator reports it as RolloutReady=False/
AllRewardsFailed and, once the streak has lasted ``spec.rollout.rewardFailureDeadlineSeconds``, ends the job
Failed/RewardsFailing."""
ROLLOUT_REWARD_ERRORS_PREFIX = "reward_errors:"
"""``reward_errors:{exception class}``: samples dropped because the reward function raised that (count)."""
ROLLOUT_REWARD_ERRORS = "reward_errors"
ROLLOUT_DOCUMENTS_WRITTEN = "documents_written"
ROLLOUT_DOCUMENTS_ABANDONED = "documents_abandoned"
"""Documents a worker generated with weights of a timeline the trainer abandoned (their version above the trainer's
model_version after it resumed from an older checkpoint) and dropped instead of writing."""
ROLLOUT_SAMPLES_GENERATED = "samples_generated"
ROLLOUT_GROUPS_FILTERED = "groups_filtered"
ROLLOUT_SAMPLES_FILTERED = "samples_filtered"
ROLLOUT_UPDATED_AT = "updated_at"
ROLLOUT_STARTS_PREFIX = "starts:"
"""``starts:{replica}``: how many times a worker of that replica index has started (HINCRBY at each start; the seed of
every start after the first mixes it in, ``rljob_rollout.worker.replica_seed``)."""
ROLLOUT_SAMPLES_DROPPED_AT_STOP = "samples_dropped_at_stop"
"""Samples in flight when a worker stopped (scale-down, deletion) and not written within its drain (count)."""
ROLLOUT_WORKER_PREFIX = "worker:"
"""``worker:{replica}``: that worker's :class:`WorkerReport` (JSON), written with each batch and, while back-pressure
holds it, every few seconds."""


@dataclass(frozen=True)
class WorkerReport:
    """A rollout worker's ``worker:{replica}`` field of the rollout hash (JSON of these attributes).

    Attributes:
        version: the weights version of its last batch (documents).
        samples_per_second: completions per second of generation and scoring in its last batch.
        updated_at: unix seconds of the write (the worker's clock).
        held_share: the share of the last window back-pressure or max lag held it (0..1); None from a worker older
            than the field (DESIGN §6 "Capacity signals").
        tokens_per_second: tokens it sampled per second over the window.
        held_seconds: time held since it started (seconds).
        window_s: the window of the two rates (seconds).
    """

    version: Optional[int] = None
    samples_per_second: Optional[float] = None
    updated_at: Optional[float] = None
    held_share: Optional[float] = None
    tokens_per_second: Optional[float] = None
    held_seconds: Optional[float] = None
    window_s: Optional[float] = None

    def to_field(self) -> str:
        """The JSON written to the hash (unset attributes left out)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_field(cls, raw: Any) -> Optional["WorkerReport"]:
        """Parse a field's value (bytes or str); None when it is not a non-empty JSON object. Values of the wrong type, negative
        or not finite are left out; a held share is clipped to [0, 1]."""
        decoded = _json_object(raw)
        if not decoded:
            return None
        values: dict[str, Any] = {"version": _number(decoded.get("version"), int)}
        for name in ("samples_per_second", "updated_at", "held_share", "tokens_per_second", "held_seconds", "window_s"):
            value = _number(decoded.get(name), float)
            values[name] = value if value is not None and value >= 0 else None
        if values["held_share"] is not None:
            values["held_share"] = min(1.0, values["held_share"])
        return cls(**values)


def worker_reports(rollout: Mapping[Any, Any]) -> dict[int, WorkerReport]:
    """{replica index: report} of the rollout hash's ``worker:{replica}`` fields that parse (others skipped)."""
    reports = {}
    for key, raw in rollout.items():
        name = text(key) or ""
        index = name.removeprefix(ROLLOUT_WORKER_PREFIX)
        if name.startswith(ROLLOUT_WORKER_PREFIX) and index.isdigit():
            report = WorkerReport.from_field(raw)
            if report is not None:
                reports[int(index)] = report
    return reports
REWARD_ERROR_MESSAGE_CHARS = 200
"""An exception's message is cut to this many characters (its first line) in :func:`reward_error_key`."""
REWARD_ERROR_KINDS_KEPT = 8
"""A failure streak counts at most this many ``"Class: message"`` kinds by name (the most frequent); the samples of
the others are counted together, so the record stays bounded whatever the reward function raises."""
REWARD_FAILURE_GAP_S = 300.0
"""A worker whose own previous batch did not fail (a new or restarted pod, or one whose last batch scored) continues
the streak in the rollout hash only when the streak's last failing batch is at most this old (seconds, Redis clock);
otherwise it starts a new one; a worker that failed its previous batch too always continues it. Longer than a rollout pod's restart plus a back-off wait (at most 60 s); a pause longer than this
(rollout pods down, a suspended job) does not count as failing."""


def reward_field_versions(fields: Iterable[bytes | str]) -> dict[str, int]:
    """The ``reward_sum:{v}`` / ``reward_count:{v}`` names among the rollout hash's ``fields``, with their version v
    (documents); fields with another prefix or a suffix that is not an integer are left out."""
    versions: dict[str, int] = {}
    for raw in fields:
        name = text(raw)
        for prefix in (ROLLOUT_REWARD_SUM_PREFIX, ROLLOUT_REWARD_COUNT_PREFIX):
            if name.startswith(prefix):
                try:
                    versions[name] = int(name[len(prefix):])
                except ValueError:
                    pass
    return versions


def stale_reward_fields(fields: Iterable[bytes | str], adding: int, keep: int) -> list[str]:
    """The ``reward_sum:{v}`` / ``reward_count:{v}`` fields to delete once version ``adding`` is written to a hash
    holding ``fields``: those whose v is not one of the ``keep`` largest versions present (``adding`` included),
    and ``adding``'s own pair when it is not one of them. Fields whose suffix is not an integer are never returned."""
    versions = {
        f"{ROLLOUT_REWARD_SUM_PREFIX}{adding}": adding,
        f"{ROLLOUT_REWARD_COUNT_PREFIX}{adding}": adding,
        **reward_field_versions(fields),
    }
    kept = set(sorted(set(versions.values()), reverse=True)[:keep])
    return sorted(name for name, version in versions.items() if version not in kept)


def rewards_by_version(rollout: Mapping[Any, Any]) -> dict[int, tuple[float, int]]:
    """Per weights version (ascending): (mean reward, number of scored samples), from the rollout hash as HGETALL
    returns it; versions with a zero count or unreadable numbers are left out."""
    raw = {text(k): v for k, v in rollout.items()}
    out: dict[int, tuple[float, int]] = {}
    for name, version in reward_field_versions(raw).items():
        if not name.startswith(ROLLOUT_REWARD_COUNT_PREFIX):
            continue
        count = _number(raw[name], float)
        total = _number(raw.get(f"{ROLLOUT_REWARD_SUM_PREFIX}{name[len(ROLLOUT_REWARD_COUNT_PREFIX):]}"), float)
        if count and count > 0 and total is not None:
            out[version] = (total / count, int(count))
    return dict(sorted(out.items()))


def reward_error_key(kind: str, message: str) -> str:
    """How a reward failure is counted: ``"ZeroDivisionError: division by zero"``, the exception class ``kind`` and
    the first line of its ``message`` cut to :data:`REWARD_ERROR_MESSAGE_CHARS`; the class alone when the message is
    empty."""
    first = (message.strip().splitlines() or [""])[0].strip()
    if len(first) > REWARD_ERROR_MESSAGE_CHARS:
        first = first[: REWARD_ERROR_MESSAGE_CHARS - 1] + "…"
    return f"{kind}: {first}" if first else kind


def reward_error_class(key: str) -> str:
    """The exception class of a :func:`reward_error_key`."""
    return key.partition(": ")[0]


def _utc(seconds: float) -> str:
    """Unix ``seconds`` as RFC 3339 UTC, e.g. 2026-01-01T12:00:00Z."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _counts(raw: Any) -> dict[str, int]:
    """A JSON object of counts as {str: int}; entries that are not non-negative integers left out."""
    if not isinstance(raw, dict):
        return {}
    return {str(k): n for k, n in raw.items() if _integer(n) is not None and n >= 0}


def _most_frequent(counts: Mapping[str, int], keep: int) -> tuple[dict[str, int], int]:
    """(the ``keep`` largest counts, the sum of the rest); ties by name."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return dict(ranked[:keep]), sum(n for _, n in ranked[keep:])


def _listed(counts: Mapping[str, int]) -> str:
    """"A ×3, B ×1", most frequent first."""
    return ", ".join(f"{kind} ×{n}" for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


EPISODE_ERROR_KINDS = ("EnvironmentTimeout", "EnvironmentFailed", "ObservationError", "EpisodeAborted")
"""The exception classes a multi-turn episode is dropped with (``rljob_rollout.environments.sessions``): failures of
the environment the episode ran against, not of a reward function — a streak of them points to
spec.rollout.environment."""

_REWARD_FIX = "fix the reward code or spec.rollout.task (rewardFunction, datasetPath)"
_ENVIRONMENT_FIX = ("fix the environment or spec.rollout.environment (url, or server image, port and command; "
                    "turnTimeoutSeconds, episodeTimeoutSeconds; EnvironmentReady says whether the server's pods accept "
                    "connections, not whether it replies: EnvironmentTimeout is a server that did not reply in time)")


def _failure_source(kinds: Iterable[str]) -> tuple[str, str, str]:
    """(what failed, where, the remedy) for failures of these exception classes: the environment when every class
    is one of :data:`EPISODE_ERROR_KINDS`, the reward function when none is, both otherwise."""
    episode = [kind in EPISODE_ERROR_KINDS for kind in kinds]
    logs = "; the rollout pods' logs hold the errors"
    if episode and all(episode):
        return "its episode against the environment", "spec.rollout.environment's episodes", _ENVIRONMENT_FIX + logs
    if any(episode):
        return ("its episode or reward function", "spec.rollout's episodes and reward function",
                f"{_REWARD_FIX}, or {_ENVIRONMENT_FIX}{logs}")
    return ("its reward function", "spec.rollout.task's reward function",
            _REWARD_FIX + "; the rollout pods' logs hold the tracebacks")


@dataclass(frozen=True)
class RewardFailures:
    """The rollout hash's ``all_rewards_failed`` record: a streak of batches, over every worker, in which no sample's
    reward function returned.

    Attributes:
        since: Redis time (unix seconds) of the streak's first failing batch; None in a record written by a worker
            that kept no streak (before this field existed): then only the last batch is known.
        updated_at: Redis time (unix seconds) of the streak's last failing batch (None likewise).
        batches: failing batches in the streak.
        samples: their samples, every one failed.
        errors: failed samples per :func:`reward_error_key` over the streak, at most :data:`REWARD_ERROR_KINDS_KEPT`
            kinds (the most frequent).
        other_errors: failed samples of the kinds left out of ``errors``.
        version: weights version (documents) of the last failing batch.
        last_samples: samples of the last failing batch.
        last_errors: the last batch's failed samples per exception class.
    """

    since: Optional[float] = None
    updated_at: Optional[float] = None
    batches: int = 0
    samples: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    other_errors: int = 0
    version: Optional[int] = None
    last_samples: Optional[int] = None
    last_errors: dict[str, int] = field(default_factory=dict)

    def to_field(self) -> str:
        """The field's JSON: {version, samples, errors} of the last batch (errors per exception class; the keys
        workers before the streak wrote), the streak {since, updated_at, batches, failed_samples, failures,
        other_failures}, and ``message`` for humans reading the hash."""
        return json.dumps({
            "version": self.version, "samples": self.last_samples, "errors": self.last_errors,
            "since": self.since, "updated_at": self.updated_at, "batches": self.batches,
            "failed_samples": self.samples, "failures": self.errors, "other_failures": self.other_errors,
            "message": self.describe(),
        })

    @classmethod
    def from_field(cls, raw: Any) -> Optional[RewardFailures]:
        """Parse the field (bytes or str); None when absent. Never raises: a bad field must not stop status updates,
        so an unreadable record still counts, its unreadable parts None or empty."""
        info = _json_object(raw)
        if info is None:
            return None
        since, updated = (_number(info.get(k), float) for k in ("since", "updated_at"))
        return cls(
            since=since, updated_at=updated if since is not None else None,
            batches=max(_integer(info.get("batches")) or 0, 0), samples=max(_integer(info.get("failed_samples")) or 0, 0),
            errors=_counts(info.get("failures")), other_errors=max(_integer(info.get("other_failures")) or 0, 0),
            version=_integer(info.get("version")), last_samples=_integer(info.get("samples")),
            last_errors=_counts(info.get("errors")),
        )

    def failing_since(self, started: Optional[float] = None) -> Optional[float]:
        """When the failing counted against a deadline began (unix seconds): ``since``, or ``started`` (the job's
        ``status.startTime``, which a resume resets) when later — a suspended job's pause is not failing time. None
        when the record keeps no streak."""
        if self.since is None:
            return None
        return self.since if started is None else max(self.since, started)

    def failing_seconds(self, started: Optional[float] = None) -> Optional[float]:
        """Seconds from :meth:`failing_since` to the last failing batch (None when the record keeps no streak):
        measured between batches that failed, so time without batches after the last one does not count."""
        begin = self.failing_since(started)
        if begin is None or self.updated_at is None:
            return None
        return max(0.0, self.updated_at - begin)

    def describe(self) -> str:
        """The failures counted in the streak, e.g. "ZeroDivisionError: division by zero ×512, KeyError: 'x' ×3 (and
        4 samples of other errors)"; the last batch's classes when the record keeps no streak."""
        listed = _listed(self.errors) or _listed(self.last_errors) or "error kind unknown"
        return listed + (f" (and {self.other_errors} samples of other errors)" if self.other_errors else "")

    def ready_message(self, deadline_s: Optional[int] = None, started: Optional[float] = None) -> str:
        """RolloutReady=False/AllRewardsFailed's message: what failed (the reward function, or for environment
        errors (:data:`EPISODE_ERROR_KINDS`) the episodes against spec.rollout.environment) with the streak's most
        frequent error and its message (:func:`reward_error_key`), since when, and
        (``deadline_s``: spec.rollout.rewardFailureDeadlineSeconds; ``started``: the job's startTime, unix seconds)
        when the job fails if no sample scores. Stable while a streak lasts (no count of batches), so it is not rewritten on
        every batch."""
        samples = self.last_samples
        which = f"every one of the {samples} samples" if isinstance(samples, int) and samples > 0 else "every sample"
        batch = f" (weights version {self.version})" if self.version is not None else ""
        last = _listed(self.last_errors) or "error kind unknown"
        quoted = [key for key, _ in sorted(self.errors.items(), key=lambda kv: (-kv[1], kv[0])) if ": " in key]
        if quoted:
            last += f" (most often in this streak: {quoted[0]})"
        what, _, fix = _failure_source(self.last_errors or map(reward_error_class, self.errors))
        message = (f"{which} of a rollout worker's last batch{batch} failed {what}: {last}; no document "
                   f"reaches the trainer until rewards succeed again: {fix}")
        begin = self.failing_since(started)
        if begin is not None:
            message += f"; failing since {_utc(begin)}"
            if deadline_s is not None:
                message += (f": the job fails (RewardsFailing) if no sample scores by {_utc(begin + deadline_s)} "
                            f"(spec.rollout.rewardFailureDeadlineSeconds = {deadline_s})")
        return message

    def failed_message(self, deadline_s: int, started: Optional[float] = None) -> str:
        """Failed/RewardsFailing's message, e.g. "ZeroDivisionError: division by zero ×512 in spec.rollout.task's
        reward function since 2026-01-01T12:00:00Z: ...", or "... in spec.rollout.environment's episodes ..." with the
        environment's remedy when every failure is an environment error (:data:`EPISODE_ERROR_KINDS`)."""
        begin = self.failing_since(started)
        since = f" since {_utc(begin)}" if begin is not None else ""
        seconds = self.failing_seconds(started)
        lasted = f" for {seconds:.0f} s" if seconds is not None else ""
        batches = f"{self.batches} rollout batch" + ("" if self.batches == 1 else "es")
        _, where, fix = _failure_source(map(reward_error_class, self.errors or self.last_errors))
        return (f"{self.describe()} in {where}{since}: every sample of "
                f"{batches} failed{lasted}, reaching spec.rollout.rewardFailureDeadlineSeconds = "
                f"{deadline_s}; {fix} (kept when runPolicy.cleanPodPolicy is None)")


def after_failing_batch(previous: Optional[RewardFailures], *, version: int, samples: int, errors: Mapping[str, int],
                        now: float, own_streak: bool) -> RewardFailures:
    """The record once a batch whose every sample failed is added to ``previous`` (the hash's record, None when
    absent).

    Args:
        version: the batch's weights version (documents).
        samples: its samples (all failed).
        errors: its failed samples per :func:`reward_error_key`.
        now: Redis time (unix seconds).
        own_streak: the writing worker's own previous batch failed too (it saw the failing go on).

    The streak goes on (``since`` kept, counts added) when ``previous`` keeps one and either ``own_streak`` or its
    last failing batch is at most :data:`REWARD_FAILURE_GAP_S` old; otherwise a new streak starts at ``now``.
    """
    last_errors: dict[str, int] = {}
    for key, n in errors.items():
        kind = reward_error_class(key)
        last_errors[kind] = last_errors.get(kind, 0) + n
    goes_on = (previous is not None and previous.since is not None and previous.updated_at is not None
               and (own_streak or now - previous.updated_at <= REWARD_FAILURE_GAP_S))
    base = previous if goes_on else RewardFailures(since=now)
    merged = dict(base.errors)
    for key, n in errors.items():
        merged[key] = merged.get(key, 0) + n
    kept, folded = _most_frequent(merged, REWARD_ERROR_KINDS_KEPT)
    return RewardFailures(since=base.since, updated_at=now, batches=base.batches + 1, samples=base.samples + samples,
                          errors=kept, other_errors=base.other_errors + folded, version=version,
                          last_samples=samples, last_errors=last_errors)


# --- Reading both hashes (the operator's view) ----------------------------------------------------
#: Decimals of the reported mean reward: what `kubectl get rljob` shows, and fewer status writes for noise.
REWARD_DECIMALS = 4


@dataclass(frozen=True)
class Progress:
    """Trainer and rollout progress as the two hashes report it; None where not reported yet.

    ``documents_seen`` and ``model_version`` are in documents; ``rollout_reward`` is the mean raw reward of the
    documents generated with weights version ``rollout_model_version``. ``reward_failures``: the rollout hash's
    ``all_rewards_failed`` record (None when absent: rewards score). ``checkpoint_lost``: the progress hash's
    ``checkpoint_lost`` (None when absent). ``checkpoint``: the checkpoint hash (None when absent or unreadable). ``updated_at``: unix seconds of trainer rank 0's
    last write of the progress hash (its own clock). ``stream_id``: the stream identity key (None: absent).
    ``backlog``: the consumer group's entries (None: no stream or no group). ``started_attempt``: the gang attempt whose
    trainer last reported its start (:data:`PROGRESS_STARTED_ATTEMPT`; None: none did, or a trainer older than it);
    ``restored_from_step``: the checkpoint step it loaded; ``stream``: that attempt's stream reader counters after its
    last step, all ranks ({} before its first step). ``workers``: each rollout worker's last :class:`WorkerReport`.
    """

    step: Optional[int] = None
    documents_seen: Optional[int] = None
    model_version: Optional[int] = None
    tokens_per_second: Optional[float] = None
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_reward: Optional[float] = None
    rollout_model_version: Optional[int] = None
    reward_failures: Optional[RewardFailures] = None
    checkpoint_lost: Optional[LostCheckpoint] = None
    checkpoint: Optional[CheckpointRecord] = None
    updated_at: Optional[float] = None
    stream_id: Optional[str] = None
    backlog: Optional["Backlog"] = None
    started_attempt: Optional[int] = None
    restored_from_step: Optional[int] = None
    stream: dict[str, int] = field(default_factory=dict)
    workers: dict[int, WorkerReport] = field(default_factory=dict)

    def started(self, attempt: int) -> bool:
        """Whether the trainer of gang ``attempt`` reported its start (:data:`PROGRESS_STARTED_ATTEMPT`). A hash
        without that field but with a step written (``updated_at``) was written by a trainer older than the field:
        it counts as started, as the operator did before it."""
        if self.started_attempt is not None:
            return self.started_attempt == attempt
        return self.updated_at is not None


@dataclass(frozen=True)
class Backlog:
    """The consumer group's entries as XINFO GROUPS counts them (documents): ``pending`` delivered to a trainer rank
    and not acked yet (trained, or being trained, since the last checkpoint), ``undelivered`` written and not read
    yet (the group's lag; None when Redis cannot tell, e.g. after entries were deleted)."""

    pending: int
    undelivered: Optional[int]

    @classmethod
    def from_groups(cls, groups: Any, group: str, length: Optional[int] = None) -> Optional[Backlog]:
        """The entry of ``group`` in XINFO GROUPS' reply (a list of dicts, bytes or str); None when absent.

        ``length``: the stream's XLEN read with it. Undelivered and pending entries are never trimmed (the trainer trims
        acked ones only), so there are at most ``length − pending`` undelivered ones: the lag is capped there, since
        Redis reports one too large after a restart that reloads the stream from its append-only file, and after
        deletions (redis/redis#13338, valkey-io/valkey#1952; the chaos soak saw 41984 on an empty stream, which held
        every rollout worker at maxPending for good), and the cap stands for a lag Redis cannot tell (None)."""
        for info in groups or []:
            fields = {text(k): v for k, v in info.items()}
            if text(fields.get("name")) == group:
                pending = _number(fields.get("pending"), int) or 0
                lag = _number(fields.get("lag"), int)
                if length is not None:
                    room = max(0, length - pending)
                    lag = room if lag is None else min(lag, room)
                return cls(pending=pending, undelivered=lag)
        return None


def parse_progress(progress: Mapping[Any, Any], rollout: Mapping[Any, Any],
                   checkpoint: Optional[Mapping[Any, Any]] = None) -> Progress:
    """Parse the progress, rollout and checkpoint hashes (as HGETALL returns them, bytes or str). Unparseable or
    non-finite values are skipped (Kubernetes JSON cannot hold NaN), never raised: a bad field must not stop status
    updates."""
    progress = {text(k): v for k, v in progress.items()}
    metrics: dict[str, float] = {}
    decoded = _json_object(progress.get(PROGRESS_METRICS)) or {}
    for name, value in decoded.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            metrics[str(name)] = float(value)
    model_version = _number(progress.get(PROGRESS_MODEL_VERSION), int)
    reward, version = _newest_reward(rewards_by_version(rollout), model_version)
    tokens_per_second = _number(progress.get(PROGRESS_TOKENS_PER_SECOND), float)
    return Progress(
        step=_number(progress.get(PROGRESS_STEP), int),
        documents_seen=_number(progress.get(PROGRESS_DOCUMENTS_SEEN), int),
        model_version=model_version,
        tokens_per_second=None if tokens_per_second is None else round(tokens_per_second, 1),
        metrics=metrics,
        rollout_reward=reward,
        rollout_model_version=version,
        reward_failures=RewardFailures.from_field({text(k): v for k, v in rollout.items()}.get(ROLLOUT_ALL_REWARDS_FAILED)),
        checkpoint_lost=LostCheckpoint.from_field(progress.get(PROGRESS_CHECKPOINT_LOST)),
        checkpoint=CheckpointRecord.from_fields(checkpoint or {}),
        updated_at=_number(progress.get(PROGRESS_UPDATED_AT), float),
        started_attempt=_number(progress.get(PROGRESS_STARTED_ATTEMPT), int),
        restored_from_step=_number(progress.get(PROGRESS_RESTORED_FROM_STEP), int),
        stream={str(name): value for name, value in (_json_object(progress.get(PROGRESS_STREAM)) or {}).items()
                if _integer(value) is not None and value >= 0},
        workers=worker_reports(rollout),
    )


def _newest_reward(rewards: Mapping[int, tuple[float, int]],
                   model_version: Optional[int]) -> tuple[Optional[float], Optional[int]]:
    """(mean rounded to :data:`REWARD_DECIMALS`, version) of the newest version, at most the trainer's
    ``model_version`` when known: a higher one belongs to a timeline a restart abandoned (a rollout worker still on
    those weights may add to it until the new weights reach it)."""
    versions = [v for v in rewards if model_version is None or v <= model_version]
    if not versions:
        return None, None
    newest = max(versions)
    return round(rewards[newest][0], REWARD_DECIMALS), newest


def _json_object(raw: Any) -> Optional[dict]:
    """A hash field holding a JSON object: None when absent, {} when present but unreadable or not an object."""
    value = text(raw)
    if value is None:
        return None
    try:
        info = json.loads(value)
    except json.JSONDecodeError:
        return {}
    return info if isinstance(info, dict) else {}


def _number(value: Any, kind: type) -> Any:
    """``value`` as an int (exactly, also from "12.0") or a finite float; None when it is neither."""
    raw = text(value)
    if raw is None:
        return None
    try:
        return int(raw) if kind is int else _finite(float(raw))
    except ValueError:
        pass
    try:
        number = _finite(float(raw))
    except ValueError:
        return None
    return int(number) if kind is int and number is not None and number.is_integer() else None


def _finite(number: float) -> Optional[float]:
    return number if math.isfinite(number) else None


# --- Events stream (trainer rank 0 writes; rollout workers read) ----------------------------------
EVENT_FIELD = "event"
"""The one field of an events-stream entry, holding the event JSON (DESIGN §3)."""
EVENT_WEIGHTS_READY = "weights_ready"
EVENT_TRAINING_FINISHED = "training_finished"
TRANSFER_KEY = "transfer"
"""Key of the ticket inside a weights_ready event (an rljob extension; upstream consumers ignore it)."""
EVENTS_MAXLEN = 10_000
"""Approximate cap of the events stream (events are notifications, not data: old ones may go)."""


@dataclass(frozen=True)
class TransferTicket:
    """What a receiver needs to join one weight update; carried in the weights_ready event under ``transfer``.

    Attributes:
        id: unique per update (the transfer store's key prefix).
        members: transfer ranks invited, ascending.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        join_timeout_s: seconds the publisher waits for invited members to be ready.
        timeout_s: collective timeout of the update's group, seconds.
        layout: the layout the publisher plans, ``packed`` (every invited member's heartbeat says it reads it) or
            ``per-tensor``; the one the update uses is in the transfer store (``rljob_wire.transfer.LAYOUT_KEY``),
            per-tensor when a member that joined does not read the planned one.
    """

    id: str
    members: tuple[int, ...]
    backend: str = "gloo"
    join_timeout_s: float = 10.0
    timeout_s: float = 120.0
    layout: str = "per-tensor"

    def to_json(self) -> dict[str, Any]:
        """The ticket as a JSON object."""
        return {**asdict(self), "members": list(self.members)}

    @classmethod
    def from_json(cls, value: Any) -> TransferTicket:
        """Raises ValueError when ``value`` is not a ticket object (names the bad key)."""
        if not isinstance(value, dict):
            raise ValueError(f"transfer: expected an object, got {type(value).__name__}")
        try:
            ticket = cls(
                id=str(value["id"]),
                members=tuple(int(m) for m in value["members"]),
                backend=str(value.get("backend", "gloo")),
                join_timeout_s=float(value.get("join_timeout_s", 10.0)),
                timeout_s=float(value.get("timeout_s", 120.0)),
                layout=str(value.get("layout", "per-tensor")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"transfer: malformed ticket {value!r}: {error!r}") from None
        if ticket.backend not in ("gloo", "nccl"):
            raise ValueError(f"transfer.backend: expected 'gloo' or 'nccl', got {ticket.backend!r}")
        return ticket


@dataclass(frozen=True)
class Event:
    """One parsed entry of the events stream.

    Attributes:
        id: the stream entry id.
        type: ``weights_ready``, ``training_finished`` or anything else (ignored by workers).
        step: optimizer step of a weights_ready event, or the final step of a training_finished event (None when
            that event carries none: an older or upstream trainer).
        documents_seen: the weights' version (documents) of a weights_ready event, or the final documents_seen of a
            training_finished event (None when it carries none).
        ticket: the transfer ticket, or None when the event came without one (an upstream trainer).
    """

    id: str
    type: str
    step: Optional[int] = None
    documents_seen: Optional[int] = None
    ticket: Optional[TransferTicket] = None


def weights_ready_event(step: int, documents_seen: int, ticket: TransferTicket) -> dict[str, str]:
    """The entry fields of a weights_ready event: {"event": JSON {type, step, documents_seen, transfer}}."""
    body = {"type": EVENT_WEIGHTS_READY, "step": step, "documents_seen": documents_seen, TRANSFER_KEY: ticket.to_json()}
    return {EVENT_FIELD: json.dumps(body)}


def training_finished_event(step: int, documents_seen: int) -> dict[str, str]:
    """The entry fields of a training_finished event: {"event": JSON {type, step, documents_seen}}."""
    return {EVENT_FIELD: json.dumps({"type": EVENT_TRAINING_FINISHED, "step": step, "documents_seen": documents_seen})}


def parse_event(entry_id: str, fields: Mapping[Any, Any]) -> Event:
    """Parse one events-stream entry (fields as XREAD returns them, bytes or str keys).

    A training_finished event's ``step`` / ``documents_seen`` are optional: missing or non-integer values parse
    as None (the event still ends training), so an upstream trainer's bare ``{"type": "training_finished"}`` works.

    Raises:
        ValueError: no ``event`` field, invalid JSON, or a weights_ready event without integer ``step`` /
            ``documents_seen``, or with a malformed ticket.
    """
    raw = fields.get(EVENT_FIELD.encode(), fields.get(EVENT_FIELD))
    if raw is None:
        raise ValueError(f"event {entry_id}: no '{EVENT_FIELD}' field")
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"event {entry_id}: not JSON ({error})") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise ValueError(f"event {entry_id}: expected an object with a string 'type', got {body!r}")
    step, seen = _integer(body.get("step")), _integer(body.get("documents_seen"))
    if body["type"] == EVENT_TRAINING_FINISHED:
        return Event(entry_id, body["type"], step, seen)
    if body["type"] != EVENT_WEIGHTS_READY:
        return Event(entry_id, body["type"])
    if step is None or seen is None:
        raise ValueError(f"event {entry_id}: weights_ready needs integer step and documents_seen, got {body!r}")
    ticket = TransferTicket.from_json(body[TRANSFER_KEY]) if TRANSFER_KEY in body else None
    return Event(entry_id, body["type"], step, seen, ticket)


# --- Members hash (rollout workers heartbeat; trainer rank 0 reads) ----------------------------------
HEARTBEAT_INTERVAL_S = 2.0
"""Seconds between a rollout worker's heartbeats."""
MEMBER_TTL_S = 15.0
"""A member whose heartbeat is older than this (seconds, Redis clock) is not invited."""


@dataclass(frozen=True)
class MemberInfo:
    """One heartbeat of the members hash: Redis time (s), loaded version (None: no weights), process id, the weight
    transfer layouts it reads beyond per-tensor (none: an older receiver)."""

    time: float
    version: Optional[int]
    instance: str
    layouts: tuple[str, ...] = ()


def encode_member(time_s: float, version: Optional[int], instance: str, layouts: Sequence[str] = ()) -> str:
    """A members-hash value: JSON {"time": Redis TIME in seconds, "version": loaded model_version or null,
    "instance": random id of the worker process, "layouts": the weight-transfer layouts it reads}."""
    return json.dumps({"time": time_s, "version": version, "instance": instance, "layouts": list(layouts)})


def parse_member(value: bytes | str) -> MemberInfo:
    """Parse a members-hash value: the JSON of :func:`encode_member`, or a bare unix time.

    Raises:
        ValueError: neither form.
    """
    body = json.loads(value)
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        return MemberInfo(float(body), None, "")
    if not isinstance(body, dict) or not isinstance(body.get("time"), (int, float)):
        raise ValueError(f"members: malformed heartbeat {value!r}")
    version = body.get("version")
    layouts = body.get("layouts")
    return MemberInfo(float(body["time"]), int(version) if version is not None else None, str(body.get("instance", "")),
                      tuple(x for x in layouts if isinstance(x, str)) if isinstance(layouts, list) else ())
