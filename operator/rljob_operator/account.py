"""Pure: the durable account of a job in its status — one record per trainer gang attempt (status.attempts) and the
job's document totals (status.documentTotals) — kept after the attempt's pods, its Events (an hour) and Redis's
records are gone.

A record opens when the attempt's gang is created and closes in the status update that ends it (a restart, a
suspend, a Kueue hold, success, failure, an invalid spec), with that update's phase reason and message: the gang
logic saves the status before it deletes any pod (:class:`.gang.Plan`), so an operator that dies mid-action has
written the reason already. The trainer's progress hash names the attempt whose trainer last started
(``attempt``), the checkpoint step it loaded and its readers' counts after each step: they go into that attempt's
record, open or closed (a last step read after its end still counts), and their growth into the totals.

Events: WorldSizeChanged when an attempt runs another data-parallel size than the one before it, CheckpointLoaded when
a restarted or resumed attempt's trainer reports the checkpoint it loaded, and a Warning EntriesRejected each time
the job's dead-lettered and too-long entries double while they are at least :data:`REJECTED_SHARE` of the entries
read.
"""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from rljob_api.constants import Phase
from rljob_api.protocol import STREAM_DEAD_LETTERED_PREFIX, Backlog, Progress
from rljob_api.status import AttemptStatus, DocumentCounts, DocumentTotals, RLTrainingJobStatus

from rljob_operator.gang import Lifecycle

MAX_ATTEMPTS_KEPT = 20
"""Records status.attempts keeps (the oldest go first; documentTotals keeps their counts)."""

MAX_MESSAGE = 4096
"""Characters of the ending phase's message a record keeps (AttemptStatus.message)."""

REJECTED_SHARE = 0.01
"""Dead-lettered and too-long entries, of all entries read, from which they are worth a Warning."""

ENDED_PHASES = (Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED, Phase.INVALID)
"""Phases in which no attempt runs (with ``gang_created`` false or another attempt number: a restart or a hold)."""

_COUNTED = ("redelivered", "dropped_too_long", "dropped_stale", "lost_pending")
_READER_NAMES = {"redeliveries": "redelivered", "dropped_too_long": "dropped_too_long",
                 "dropped_stale": "dropped_stale", "lost_pending": "lost_pending"}
"""The progress hash's ``stream`` counters (rljob_trainer.metrics_registry.STEP_TOTALS) → DocumentCounts fields."""


def counts_of(stream: dict[str, int]) -> DocumentCounts:
    """DocumentCounts of a progress hash's ``stream`` counters (one attempt, all ranks)."""
    fields = {field: stream.get(counter, 0) for counter, field in _READER_NAMES.items()}
    kinds = {name.removeprefix(STREAM_DEAD_LETTERED_PREFIX): n for name, n in stream.items()
             if name.startswith(STREAM_DEAD_LETTERED_PREFIX) and n > 0}
    return DocumentCounts(dead_lettered=kinds, **fields)


def _grown(totals: DocumentTotals, before: DocumentCounts, after: DocumentCounts) -> DocumentTotals:
    """``totals`` plus what ``after`` counts beyond ``before`` (counters only grow within an attempt; a smaller one adds
    nothing)."""
    fields = {name: getattr(totals, name) + max(getattr(after, name) - getattr(before, name), 0) for name in _COUNTED}
    kinds = dict(totals.dead_lettered)
    for kind, n in after.dead_lettered.items():
        kinds[kind] = kinds.get(kind, 0) + max(n - before.dead_lettered.get(kind, 0), 0)
    return totals.model_copy(update={**fields, "dead_lettered": kinds})


def update(previous: RLTrainingJobStatus, new: RLTrainingJobStatus, lifecycle: Lifecycle, progress: Optional[Progress],
           now: datetime) -> RLTrainingJobStatus:
    """``new`` (the pass's status for ``lifecycle``) with status.attempts and status.documentTotals brought up to date
    from ``previous``'s, the lifecycle change and ``progress`` (None: Redis not read this pass). An attempt that ends
    takes ``lifecycle``'s reason and message; one that appears without having been created in this pass (a job whose
    operator kept no account yet) has no start time."""
    attempts = list(previous.attempts)
    totals = previous.document_totals
    running = lifecycle.gang_created and lifecycle.phase not in ENDED_PHASES
    for i, record in enumerate(attempts):
        if record.end_time is None and not (running and record.attempt == lifecycle.attempt):
            attempts[i] = record.model_copy(update={"end_time": now, "reason": lifecycle.reason.value,
                                                    "message": lifecycle.message[:MAX_MESSAGE]})
    if running and all(record.attempt != lifecycle.attempt for record in attempts):
        fresh = not (previous.gang_created and previous.attempt == lifecycle.attempt)
        attempts.append(AttemptStatus(attempt=lifecycle.attempt, start_time=now if fresh else None,
                                      data_parallel_size=new.data_parallel_size))
    if progress is not None and progress.started_attempt is not None:
        for i, record in enumerate(attempts):
            if record.attempt != progress.started_attempt:
                continue
            counts = counts_of(progress.stream)
            totals = _grown(totals, record.documents, counts)
            update_fields: dict = {"documents": counts}
            if progress.step is not None:
                update_fields["step"] = progress.step
            if record.restored_from_step is None and progress.restored_from_step is not None:
                update_fields["restored_from_step"] = progress.restored_from_step
                checkpoint = progress.checkpoint or new.last_checkpoint
                if checkpoint is not None and checkpoint.step == progress.restored_from_step > 0:
                    update_fields["checkpoint_path"] = checkpoint.path
            attempts[i] = record.model_copy(update=update_fields)
    return new.model_copy(update={"attempts": attempts[-MAX_ATTEMPTS_KEPT:], "document_totals": totals})


def stream_lost(status: RLTrainingJobStatus, backlog: Optional[Backlog]) -> RLTrainingJobStatus:
    """``status`` with one more stream loss in documentTotals, and the entries it took when ``backlog`` (the group's
    counts at the operator's last read before the loss) is known."""
    totals = status.document_totals
    taken = 0 if backlog is None else backlog.pending + (backlog.undelivered or 0)
    totals = totals.model_copy(update={"stream_losses": totals.stream_losses + 1,
                                       "stream_lost_entries": totals.stream_lost_entries + taken})
    return status.model_copy(update={"document_totals": totals})


def rejected(counts: DocumentCounts) -> int:
    """Entries the trainer could not train as written: dead-lettered (every kind) and too long."""
    return sum(counts.dead_lettered.values()) + counts.dropped_too_long


def events(previous: RLTrainingJobStatus, new: RLTrainingJobStatus) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events the account's change from ``previous`` to ``new`` tells."""
    told: list[tuple[str, str, str]] = []
    before = {record.attempt: record for record in previous.attempts}
    earlier: Optional[AttemptStatus] = previous.attempts[-1] if previous.attempts else None
    for record in new.attempts:
        old = before.get(record.attempt)
        if old is None and earlier is not None and record.attempt > earlier.attempt and (
                record.data_parallel_size != earlier.data_parallel_size):
            told.append(("Normal", "WorldSizeChanged", (
                f"attempt {record.attempt} runs data-parallel size {record.data_parallel_size} (attempt "
                f"{earlier.attempt} ran {earlier.data_parallel_size}): its ranks reshard the checkpoint they load and "
                "share the stream's pending entries")))
        loaded = record.restored_from_step
        if loaded is not None and (old is None or old.restored_from_step is None) and (
                record.attempt > 0 or loaded > 0):
            where = "from scratch (no checkpoint)" if loaded == 0 else (
                f"from the checkpoint of step {loaded}" + (f" at {record.checkpoint_path}" if record.checkpoint_path
                                                           else ""))
            told.append(("Normal", "CheckpointLoaded", f"attempt {record.attempt} (data-parallel size "
                         f"{record.data_parallel_size}) started {where}"))
    was, now = rejected(previous.document_totals), rejected(new.document_totals)
    read = now + (new.documents_seen or 0)
    if now > was and was.bit_length() < now.bit_length() and now >= REJECTED_SHARE * read:
        totals = new.document_totals
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(totals.dead_lettered.items(), key=lambda k: (-k[1], k[0])))
        parts = [f"{sum(totals.dead_lettered.values())} dead-lettered ({kinds})"] if totals.dead_lettered else []
        if totals.dropped_too_long:
            parts.append(f"{totals.dropped_too_long} dropped as longer than trainer.microBatchTokens")
        stream = f" (dead-letter stream {new.stream.dead_letter_key})" if new.stream is not None else ""
        told.append(("Warning", "EntriesRejected", (
            f"the trainer could not train {now} of the {read} entries read since the job began "
            f"({100 * now / read:.1f}%): {'; '.join(parts)}{stream}; status.documentTotals keeps the counts")))
    return told
