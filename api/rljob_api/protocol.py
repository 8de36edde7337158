"""The Redis protocol beyond the stream entries (DESIGN §2, §3): key names, hash fields, the events stream's payloads,
the members heartbeat, and the records of the progress and rollout hashes with their parsing.

Pure definitions and functions over dicts, str and bytes: no Redis client is imported here (rljob_api stays free of
clients, DESIGN §9); each role makes its own Redis calls with these. The stream entries themselves (documents) have
their own codec (rljob_trainer.stream.codec).

Who writes and who reads each key and field is said next to it. This module is longer than most because it is the
whole protocol between four writers and readers (trainer rank 0, trainer ranks, rollout workers, the operator):
splitting it would put the two ends of one record in different files.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional


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
workers, read by trainer rank 0 (rljob_trainer.weights)."""
KEY_DEAD_LETTER = "dead_letter"
"""Stream of malformed entries with their reason (written by trainer ranks)."""
KEY_CHECKPOINT = "checkpoint"
"""Hash: last committed checkpoint (``step``, ``documents_seen``, ``path``); written by trainer rank 0."""


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
"""JSON object {stream reader counter: documents} of the last step, all ranks."""
PROGRESS_UPDATED_AT = "updated_at"
"""Unix seconds of the last write."""
PROGRESS_CHECKPOINT_DOCUMENTS_SEEN = "checkpoint_documents_seen"
"""documents_seen of the checkpoint the trainer's attempt last committed or started from (0 from scratch): the
documents trained since then (documents_seen − this) are still pending in the stream's group, acked by the next
checkpoint. Written by trainer rank 0 at every start and before each checkpoint's acks; rollout workers read it
(rljob_rollout.writer: max lag)."""
PROGRESS_RESTORED_FROM_STEP = "restored_from_step"
"""Step of the checkpoint the trainer's current attempt started from (0 from scratch); written at every start."""
PROGRESS_CHECKPOINT_LOST = "checkpoint_lost"
"""Present (:meth:`LostCheckpoint.to_field`) while the trainer's current attempt started below the checkpoint the
Redis checkpoint hash records, because that checkpoint is gone from the checkpoint volume; deleted by a start that
loses none. Trainer rank 0 writes it; the operator reports it."""


def start_fields(step: int, documents_seen: int) -> dict[str, int]:
    """The progress fields trainer rank 0 sets at every start: the loaded checkpoint's ``step`` and
    ``documents_seen`` (0 from scratch) as step, documents_seen, model_version (= documents_seen, DESIGN §6),
    restored_from_step and checkpoint_documents_seen (nothing trained yet is unacked)."""
    return {PROGRESS_STEP: step, PROGRESS_DOCUMENTS_SEEN: documents_seen, PROGRESS_MODEL_VERSION: documents_seen,
            PROGRESS_RESTORED_FROM_STEP: step, PROGRESS_CHECKPOINT_DOCUMENTS_SEEN: documents_seen}


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
"""Present (:func:`all_rewards_failed_field`) while a worker's last batch had no sample whose reward function
returned; deleted by the next batch that has one. The operator reports it (Reason.ALL_REWARDS_FAILED) instead of
letting the job train on nothing."""
ROLLOUT_REWARD_ERRORS_PREFIX = "reward_errors:"
"""``reward_errors:{exception class}``: samples dropped because the reward function raised that (count)."""
ROLLOUT_REWARD_ERRORS = "reward_errors"
ROLLOUT_DOCUMENTS_WRITTEN = "documents_written"
ROLLOUT_SAMPLES_GENERATED = "samples_generated"
ROLLOUT_GROUPS_FILTERED = "groups_filtered"
ROLLOUT_SAMPLES_FILTERED = "samples_filtered"
ROLLOUT_UPDATED_AT = "updated_at"
ROLLOUT_WORKER_PREFIX = "worker:"
"""``worker:{replica}``: JSON {version, samples_per_second, updated_at} of that worker's last batch."""


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


def all_rewards_failed_field(version: int, samples: int, errors: Mapping[str, int]) -> str:
    """The ``all_rewards_failed`` JSON {version, samples, errors: {exception class: count}, message}."""
    return json.dumps({"version": version, "samples": samples, "errors": dict(errors),
                       "message": f"every one of {samples} samples failed its reward function: {dict(errors)}"})


def rewards_failure(raw: Any) -> Optional[str]:
    """The message of RolloutReady=False/AllRewardsFailed from the rollout hash's ``all_rewards_failed`` field, or
    None when the field is absent. Unreadable details still give a message, never an error."""
    info = _json_object(raw)
    if info is None:
        return None
    samples, version, errors = info.get("samples"), info.get("version"), info.get("errors")
    counted = {str(kind): n for kind, n in errors.items() if isinstance(n, int)} if isinstance(errors, dict) else {}
    kinds = ", ".join(f"{kind} ×{n}" for kind, n in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0])))
    which = f"every one of the {samples} samples" if isinstance(samples, int) and samples > 0 else "every sample"
    batch = f" (weights version {version})" if isinstance(version, int) else ""
    return (
        f"{which} of a rollout worker's last batch{batch} failed its reward function: {kinds or 'error kind unknown'}; "
        "no document reaches the trainer until rewards succeed again: fix spec.rollout.task (rewardFunction, "
        "datasetPath) or the reward code; the rollout pods' logs hold the tracebacks"
    )


# --- Reading both hashes (the operator's view) ----------------------------------------------------
#: Decimals of the reported mean reward: what `kubectl get rljob` shows, and fewer status writes for noise.
REWARD_DECIMALS = 4


@dataclass(frozen=True)
class Progress:
    """Trainer and rollout progress as the two hashes report it; None where not reported yet.

    ``documents_seen`` and ``model_version`` are in documents; ``rollout_reward`` is the mean raw reward of the
    documents generated with weights version ``rollout_model_version``. ``rewards_failure``: what to tell the user
    while the rollout hash holds ``all_rewards_failed`` (None when it does not). ``checkpoint_lost``: the progress
    hash's ``checkpoint_lost`` (None when absent).
    """

    step: Optional[int] = None
    documents_seen: Optional[int] = None
    model_version: Optional[int] = None
    tokens_per_second: Optional[float] = None
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_reward: Optional[float] = None
    rollout_model_version: Optional[int] = None
    rewards_failure: Optional[str] = None
    checkpoint_lost: Optional[LostCheckpoint] = None


def parse_progress(progress: Mapping[Any, Any], rollout: Mapping[Any, Any]) -> Progress:
    """Parse the progress and rollout hashes (as HGETALL returns them, bytes or str). Unparseable or non-finite
    values are skipped (Kubernetes JSON cannot hold NaN), never raised: a bad field must not stop status updates."""
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
        rewards_failure=rewards_failure({text(k): v for k, v in rollout.items()}.get(ROLLOUT_ALL_REWARDS_FAILED)),
        checkpoint_lost=LostCheckpoint.from_field(progress.get(PROGRESS_CHECKPOINT_LOST)),
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
    """

    id: str
    members: tuple[int, ...]
    backend: str = "gloo"
    join_timeout_s: float = 10.0
    timeout_s: float = 120.0

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
    """One heartbeat of the members hash: Redis time (s), loaded version (None: no weights), process id."""

    time: float
    version: Optional[int]
    instance: str


def encode_member(time_s: float, version: Optional[int], instance: str) -> str:
    """A members-hash value: JSON {"time": Redis TIME in seconds, "version": loaded model_version or null,
    "instance": random id of the worker process}."""
    return json.dumps({"time": time_s, "version": version, "instance": instance})


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
    return MemberInfo(float(body["time"]), int(version) if version is not None else None, str(body.get("instance", "")))
