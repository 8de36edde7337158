"""One data-parallel rank's reader of the document stream (DESIGN §3, §6): a Redis consumer-group consumer.

Delivery contract (at-least-once in Redis, exactly-once in committed checkpoints):

* Entries are read with XREADGROUP (no NOACK), so every entry handed out stays in the group's pending list
  (PEL) under this rank's consumer name until it is acked. The training loop hands
  :meth:`StreamReader.take_pending_ids` to each checkpoint's snapshot, and global rank 0 acks every rank's ids
  (:func:`ack_entries`) once that checkpoint is committed.
* On start, one process first spreads the group's pending entries (trained after the last checkpoint of a
  crashed attempt, or read ahead) evenly over the current data-parallel ranks (:func:`rljob_trainer.stream.redistribute.redistribute_pending`;
  trainer rank 0, then a barrier): when the world size changed, the old attempt's entries all belong to the old
  ranks' consumers, and new ranks would otherwise need fresh documents that a rollout held at maxPending or max
  lag never writes. Then each rank re-reads its own pending entries (``start``), counted as redeliveries. Every
  pending entry has exactly one current owner before any rank reads, so no entry is trained twice. Ids already
  covered by the checkpoint being resumed are acked first (``start(committed_ids)``, or
  :func:`rljob_trainer.checkpoint.acknowledge_covered` before the redistribution), so a crash between "checkpoint
  durable" and "XACK" does not train them twice.
* Malformed entries go to the dead-letter stream with their reason and are acked right after (a crash in
  between dead-letters one twice rather than losing it); documents longer than the micro-batch budget are
  dropped, counted and acked. Neither ever raises out of the reader.
* Stale documents (``max_staleness``, ``algorithm.maxStaleness``): a document whose staleness at the step's
  ``documents_seen`` (minus the smallest ``model_version`` of its labelled tokens) exceeds the bound is dropped when
  :meth:`StreamReader.next_documents` would hand it out, counted (:attr:`ReaderCounters.dropped_stale`) and replaced by
  reading on, so the call still returns exactly ``n`` documents and no rank has an empty step. It is not acked at
  once: its id joins the ids the next checkpoint covers (:meth:`StreamReader.take_pending_ids`), so a crash before
  that checkpoint re-reads it and judges it again against the resumed ``documents_seen``, as the entries trained
  meanwhile are. Each drop is also added to the progress hash's ``dropped_stale`` (HINCRBY), which the rollout's
  back-pressure subtracts with the trained-unacked documents (:mod:`rljob_rollout.writer`): otherwise pending drops
  would hold the rollout at its max lag or maxPending while the trainer waits for fresh documents to refill.
* :meth:`StreamReader.trim_acked` trims with XTRIM MINID below the oldest entry that is pending or not yet
  delivered, so only acked entries are ever removed (never MAXLEN). It assumes this group is the stream's
  only consumer group.

Overlapped reads: new entries are read with XREADGROUP on a connection of the reader's own
(:class:`~rljob_wire.connection.PipelinedConnection`), and the next XREADGROUP is sent *before* the
reply in hand is decoded, so Redis and the network deliver it while this process decodes (and, with read-ahead,
while the caller packs and trains). The next read asks only for what the call still lacks; with read-ahead it may
also ask for the next call's documents, bounded so that the entries buffered and in flight beyond the current
call never exceed the ``n`` of that call (one XREADGROUP COUNT). Entries a read-ahead delivered stay pending under
this rank's consumer like any other (not in :meth:`StreamReader.pending_ids`, so no checkpoint acks them) and
are handed out by the next calls; after a crash they are re-read with the own pending entries (counted as
redeliveries although they were never trained).

Read-ahead and back-pressure: the rollout's backlog is the group's lag + pending (DESIGN §6,
:mod:`rljob_rollout.writer`), so delivering an entry early moves it from lag to pending without changing
the backlog, and max lag counts written − seen, which read-ahead does not change either. With one data-parallel
rank the read-ahead entries are that rank's next documents, so no step can wait on them: read-ahead is on by
default there. With several ranks, one rank's read-ahead can take entries another rank still needs for the
current step; when the rollout is held at its bound (maxPending, or max(maxLag, documentsPerStep) documents
ahead) exactly at that step, the step would never fill. That would need one more step of room in both bounds
(``documentsPerStep × (everySteps + 1) <= maxPending`` and a max-lag floor of two steps), so read-ahead is off
with more than one rank (asking for it raises ``ValueError``). What stays safe with several ranks is
:meth:`StreamReader.prefetch`: the caller sends the next step's read once every rank holds its documents for the
current one (the trainer: once the step's first collective returned, which no rank enters before its read did). Each
rank then asks for its own next share only, as it would at the next step, so the ranks together never hold more than
the next step takes, and no rank's current step can be short of an entry another took.

Connection failures: a failure while an XREADGROUP is in flight may lose a reply whose entries Redis already
delivered to this consumer. The reader then reconnects with the client's retry and backoff, re-reads this
consumer's pending entries above the newest id it has received (where a lost reply's entries lie) and queues the
ones it does not hold (buffered, or handed out and not yet acked), counting them in
:attr:`ReaderCounters.reread_after_connection_loss`; so every entry is handed out once.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import redis

from rljob_api import protocol
from rljob_api.config import RedisKeys
from rljob_trainer import fence
from rljob_wire.codec import DocumentTooLong, MalformedEntry, MalformedKind, decode_columns
from rljob_wire.documents import Document, DocumentColumns
from rljob_wire.connection import PipelinedConnection

log = logging.getLogger(__name__)

Entry = tuple[str, dict[bytes, bytes]]


class DataTimeout(TimeoutError):
    """No valid document arrived for ``data_timeout_seconds`` (the message names the rank, stream and wait)."""


@dataclass
class ReaderCounters:
    """What one rank's reader has seen since it was created (all counts in entries = documents)."""

    documents_read: int = 0
    """Valid documents handed out by :meth:`StreamReader.next_documents`, redeliveries included."""
    redeliveries: int = 0
    """Entries re-read at start from this rank's pending list (its own from a crashed attempt, or entries
    :func:`redistribute_pending` gave it)."""
    dead_lettered: collections.Counter = field(default_factory=collections.Counter)
    """Malformed entries moved to the dead-letter stream, by :class:`~rljob_wire.codec.MalformedKind`."""
    dropped_too_long: int = 0
    """Documents longer than the micro-batch token budget, dropped (and acked)."""
    lost_pending: int = 0
    """Pending entries whose data was deleted from the stream before they were re-read (acked, nothing to train);
    the caller adds :attr:`Redistribution.lost` to the counters of the rank that redistributed."""
    reread_after_connection_loss: int = 0
    """Entries whose XREADGROUP reply a connection failure lost, re-read from this rank's pending list (first
    deliveries to the caller, not redeliveries)."""
    dropped_stale: int = 0
    """Documents staler than ``max_staleness`` at the step they would have entered, dropped before the loss (acked by
    the next checkpoint)."""


@dataclass(frozen=True)
class ReadDocuments:
    """Documents read from the stream with their entry ids: ``ids[i]`` is the entry of ``columns.document(i)``.
    Iterating yields ``(entry id, Document)`` pairs."""

    ids: list[str]
    columns: DocumentColumns

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[str, Document]:
        return self.ids[index], self.columns.document(index % len(self) if index < 0 else index)

    def __iter__(self):
        return iter(zip(self.ids, self.columns.documents(), strict=True))

    def split(self, count: int) -> tuple["ReadDocuments", "ReadDocuments"]:
        """(the first ``count`` documents, the others)."""
        return (ReadDocuments(self.ids[:count], self.columns.head(count)),
                ReadDocuments(self.ids[count:], self.columns.tail(count)))

    def take(self, keep: np.ndarray) -> "ReadDocuments":
        """The documents where ``keep`` ([N] bool) is True, in order."""
        return ReadDocuments([entry_id for entry_id, kept in zip(self.ids, keep.tolist()) if kept],
                             self.columns.take(keep))

    def __add__(self, other: "ReadDocuments") -> "ReadDocuments":
        return ReadDocuments(self.ids + other.ids, DocumentColumns.concatenate([self.columns, other.columns]))


_NOTHING_READ = ReadDocuments([], DocumentColumns.empty())


class StreamReader:
    """Reads documents for data-parallel rank ``dp_rank`` of ``dp_size`` from the job's stream.

    Args:
        client: a bytes-mode ``redis.Redis`` (see :func:`rljob_wire.connection.connect`).
        keys: the job's Redis keys (stream, group, consumer prefix, dead-letter stream).
        dp_rank: this rank, 0 <= dp_rank < dp_size; consumer name ``keys.consumer(dp_rank)``.
        dp_size: the data-parallel world size.
        micro_batch_tokens: token budget of one micro-batch; longer documents are dropped and counted.
        require_metrics_fields: metrics are on, so entries without ``reward`` or ``model_version`` are
            dead-lettered (DESIGN §4: every rank then sees the same field presence).
        data_timeout_seconds: :meth:`next_documents` raises :class:`DataTimeout` after this many seconds
            without a valid document.
        block_ms: longest single XREADGROUP BLOCK, in milliseconds (must stay below the client's socket timeout).
        require_advantage: entries without ``advantage`` are dead-lettered (the RL losses need it).
        vocab_size: if given, entries with a token id >= vocab_size are dead-lettered.
        dead_letter_maxlen: approximate length cap of the dead-letter stream (it holds copies, not the data).
        read_ahead: after each call's documents are read, send the XREADGROUP for the next call's (see the module
            docstring). None (default): on with one data-parallel rank, off with several.
        max_staleness: drop documents staler than this many documents (``algorithm.maxStaleness``; see the module
            docstring); entries without ``model_version`` are then dead-lettered. None: nothing is dropped.

    Raises:
        ValueError: rank outside [0, dp_size), non-positive budget or timeout, a client that decodes
            responses to str (the codec needs bytes), ``read_ahead=True`` with ``dp_size > 1``, or a negative
            ``max_staleness``.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        dp_rank: int,
        dp_size: int,
        *,
        micro_batch_tokens: int,
        require_metrics_fields: bool,
        data_timeout_seconds: float,
        block_ms: int = 1000,
        require_advantage: bool = True,
        vocab_size: Optional[int] = None,
        dead_letter_maxlen: int = 10_000,
        read_ahead: Optional[bool] = None,
        max_staleness: Optional[int] = None,
    ):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 documents, got {max_staleness}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if micro_batch_tokens < 1 or data_timeout_seconds <= 0 or block_ms < 1:
            raise ValueError(
                f"micro_batch_tokens={micro_batch_tokens}, data_timeout_seconds={data_timeout_seconds} and "
                f"block_ms={block_ms} must be positive"
            )
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the Redis client must return bytes (decode_responses=False): entries are binary")
        if read_ahead and dp_size > 1:
            raise ValueError(
                f"read_ahead=True with dp_size={dp_size}: one rank's read-ahead can take entries another rank needs "
                "for the current step, which stalls when the rollout is held at maxPending or max lag"
            )
        self.client = client
        self.keys = keys
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumer = keys.consumer(dp_rank)
        self.micro_batch_tokens = micro_batch_tokens
        self.require_metrics_fields = require_metrics_fields
        self.require_advantage = require_advantage
        self.vocab_size = vocab_size
        self.data_timeout_seconds = data_timeout_seconds
        self.block_ms = block_ms
        self.dead_letter_maxlen = dead_letter_maxlen
        self.read_ahead = dp_size == 1 if read_ahead is None else read_ahead
        self.max_staleness = max_staleness
        self.counters = ReaderCounters()
        self._unpublished_drops = 0
        """Stale drops not yet added to the progress hash (its HINCRBY failed); added with the next ones."""
        self._started = False
        self._connection = PipelinedConnection(client)
        self._backlog: collections.deque[Entry] = collections.deque()
        """Entries received and not yet decoded, oldest first (redeliveries before new entries)."""
        self._ready = _NOTHING_READ
        """Valid documents not yet handed out."""
        self._unacked: dict[str, None] = {}
        self._newest_id = "0"
        """Highest id this reader has received from Redis: entries of a lost reply lie above it."""
        self.decode_seconds = 0.0
        """Seconds spent decoding entries (:func:`~rljob_wire.codec.decode_columns`) since the reader was made, by
        ``time.perf_counter``; the trainer reports each step's difference (``decode_time_ms``)."""

    # --- start-up ----------------------------------------------------------------------------
    def start(self, committed_ids: Iterable[str] = ()) -> None:
        """Create the group if missing, ack ids a resumed checkpoint already covers, queue this consumer's pending
        entries as redeliveries.

        Entries pending under consumers of other ranks are not read here: after a world-size change they reach this
        rank only through :func:`redistribute_pending`, run by one process before any rank starts.

        Args:
            committed_ids: entry ids recorded in the checkpoint being resumed (of every rank; XACK is per group).
        """
        try:
            self.client.xgroup_create(self.keys.stream, self.keys.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self.ack(committed_ids)
        for entry_id, fields in self._connection.with_retry(self._read_own_pending):
            self._queue_pending(entry_id, fields, redelivery=True)
        self._connection.reply_lost = False  # a lost reply of the reads from id 0 delivered nothing new
        if self._backlog:
            self._newest_id = max((entry_id for entry_id, _ in self._backlog), key=protocol.entry_order)
        self._started = True
        if self._backlog:
            log.info("%s: %d entries to redeliver", self.consumer, len(self._backlog))

    def _read_own_pending(self, after: str = "0", page: int = 512) -> list[tuple[str, Optional[dict]]]:
        """The entries pending under this consumer with ids above ``after`` (XREADGROUP from that id, ``page`` per
        command), oldest first; ``None`` fields for an entry deleted from the stream."""
        entries: list[tuple[str, Optional[dict]]] = []
        while True:
            last = entries[-1][0] if entries else after
            reply = self._connection.execute(
                "XREADGROUP", "GROUP", self.keys.group, self.consumer, "COUNT", page, "STREAMS", self.keys.stream, last
            )
            batch = reply[0][1] if reply else []
            if not batch:
                return entries
            entries += [(protocol.text(entry_id), fields) for entry_id, fields in batch]

    def _queue_pending(self, entry_id: str, fields: Optional[dict], *, redelivery: bool) -> None:
        if not fields:
            log.warning("%s: pending entry %s was deleted from the stream; acking it", self.consumer, entry_id)
            self.counters.lost_pending += 1
            fence.write(self.client, self.keys, [("XACK", self.keys.stream, self.keys.group, entry_id)])
            return
        if redelivery:
            self.counters.redeliveries += 1
        else:
            self.counters.reread_after_connection_loss += 1
        self._backlog.append((entry_id, fields))

    # --- reading ---------------------------------------------------------------------------
    def next_documents(self, n: int, documents_seen: Optional[int] = None) -> ReadDocuments:
        """Exactly ``n`` valid documents with their entry ids, redeliveries first, blocking until they arrive.

        Every returned id stays pending (and in :meth:`pending_ids`) until :meth:`ack`. Documents read beyond
        ``n`` (read-ahead, see the module docstring) are kept for the next call. With ``max_staleness``, documents
        staler than it at ``documents_seen`` are dropped instead (their ids join :meth:`pending_ids` too) and the call
        reads on until it has ``n`` others.

        Args:
            documents_seen: the documents the trainer has trained before this step (the staleness reference);
                required with ``max_staleness``.

        Raises:
            DataTimeout: no valid (and fresh enough) document for ``data_timeout_seconds``. Documents gathered
                before the timeout are kept and returned first by the next call.
            redis.ConnectionError: Redis unreachable beyond the client's retries (nothing is lost: entries
                stay pending in Redis, gathered documents are kept, and a lost reply is re-read at the next call).
            ValueError: ``n`` < 1, or ``max_staleness`` without ``documents_seen``.
        """
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one document")
        if self.max_staleness is not None and documents_seen is None:
            raise ValueError(f"max_staleness={self.max_staleness}: next_documents needs documents_seen")
        if not self._started:
            self.start()
        deadline = time.monotonic() + self.data_timeout_seconds
        self._ready = self._drop_stale(self._ready, documents_seen)  # read ahead for an earlier step
        while len(self._ready) < n:
            if not self._backlog:
                if self._connection.in_flight is None and self._block_ms(deadline) <= 0:
                    raise DataTimeout(
                        f"{self.consumer}: no valid document on stream {self.keys.stream!r} for "
                        f"{self.data_timeout_seconds:g} s (have {len(self._ready)} of {n}){self._refused()}"
                    )
                self._on_connection(self._receive_next, n, deadline)
                if not self._backlog:
                    continue
            self._on_connection(self._send_next, n, deadline)  # travels while the backlog is decoded
            take = min(n - len(self._ready), len(self._backlog))
            accepted = self._drop_stale(self._accept([self._backlog.popleft() for _ in range(take)]), documents_seen)
            if accepted:
                self._ready += accepted
                deadline = time.monotonic() + self.data_timeout_seconds
        out, self._ready = self._ready.split(n)
        self._unacked.update(dict.fromkeys(out.ids))
        self.counters.documents_read += n
        return out

    def prefetch(self, n: int) -> None:
        """Send the XREADGROUP for the next call's ``n`` documents now (``BLOCK block_ms``), unless a read is in
        flight or ``n`` are already held; its reply is taken by that call. With several data-parallel ranks, call it
        only once every rank holds its documents for the current step (module docstring, "Read-ahead and
        back-pressure").

        Raises:
            redis.ConnectionError: Redis unreachable beyond the client's retries (nothing is lost: the next call
                reads again, re-reading a lost reply's entries first).
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one document")
        if not self._started:
            self.start()

        def send(count: int, _deadline: float) -> None:
            held = len(self._ready) + len(self._backlog)
            if self._connection.in_flight is None and held < count:
                self._send_read(count - held, self.block_ms)

        self._on_connection(send, n, 0.0)

    def _refused(self) -> str:
        """What this reader refused since it started, for :class:`DataTimeout`'s message, e.g. "; refused 12 entries:
        missing_metrics_field ×12 dead-lettered to 'rljob:ns:job:dead_letter' (each with its reason)", or ""."""
        said = []
        if self.counters.dead_lettered:
            kinds = sorted(self.counters.dead_lettered.items(), key=lambda kind: (-kind[1], kind[0]))
            said.append(", ".join(f"{kind} ×{n}" for kind, n in kinds)
                        + f" dead-lettered to {self.keys.dead_letter!r} (each with its reason)")
        if self.counters.dropped_too_long:
            said.append(f"{MalformedKind.TOO_LONG.value} ×{self.counters.dropped_too_long} dropped (longer than "
                        f"{self.micro_batch_tokens} tokens)")
        total = sum(self.counters.dead_lettered.values()) + self.counters.dropped_too_long
        return f"; refused {total} {'entry' if total == 1 else 'entries'}: {'; '.join(said)}" if total else ""

    def _drop_stale(self, documents: ReadDocuments, documents_seen: Optional[int]) -> ReadDocuments:
        """``documents`` without those staler than ``max_staleness`` at ``documents_seen``
        (:meth:`DocumentColumns.staleness`); each dropped one is counted, stays pending with the ids the next checkpoint
        covers, and is added to the progress hash's ``dropped_stale``. A failed HINCRBY is logged and retried with the
        next drops, never raised: the documents are already accounted for here."""
        if self.max_staleness is None or not len(documents):
            return documents
        staleness, known = documents.columns.staleness(documents_seen)
        stale = known & (staleness > self.max_staleness)
        if not stale.any():
            return documents
        dropped = [entry_id for entry_id, drop in zip(documents.ids, stale.tolist()) if drop]
        self._unacked.update(dict.fromkeys(dropped))
        self.counters.dropped_stale += len(dropped)
        self._unpublished_drops += len(dropped)
        log.info("%s: dropped %d documents staler than maxStaleness %d at documents_seen %d", self.consumer,
                 len(dropped), self.max_staleness, documents_seen)
        try:
            fence.write(self.client, self.keys,
                        [("HINCRBY", self.keys.progress, protocol.PROGRESS_DROPPED_STALE, self._unpublished_drops)])
            self._unpublished_drops = 0
        except redis.RedisError as error:
            log.warning("%s: could not add %d stale drops to %s: %s", self.consumer, self._unpublished_drops,
                        self.keys.progress, error)
        return documents.take(~stale)

    def close(self) -> None:
        """Give the reader's connection back to the client's pool. Entries of a read still in flight stay pending
        in Redis under this consumer; if the reader is used again it re-reads them first."""
        self._connection.close()

    def _on_connection(self, operation: Callable[[int, float], None], n: int, deadline: float) -> None:
        """Run ``operation(n, deadline)`` on the reader's connection with the client's retry and backoff, first
        recovering the entries of a reply that a connection failure lost."""

        def attempt() -> None:
            if self._connection.reply_lost:
                self._recover_lost_reply()
            operation(n, deadline)

        self._connection.with_retry(attempt)

    def _recover_lost_reply(self) -> None:
        """Queue the entries a lost XREADGROUP reply delivered to this consumer.

        They are pending under this consumer with ids above every id this reader has received (XREADGROUP ``>``
        delivers ids above the group's last-delivered id, which no earlier delivery exceeds), so only the pending
        entries after :attr:`_newest_id` are re-read: re-reading from id 0 would send every entry handed out and
        not yet acked again (up to a checkpoint interval's data), on each failure. Ids the reader holds are
        skipped all the same.
        """
        held = set(self._ready.ids)
        held.update(entry_id for entry_id, _ in self._backlog)
        held.update(self._unacked)
        lost = [e for e in self._read_own_pending(after=self._newest_id) if e[0] not in held]
        if lost:
            log.warning("%s: re-read %d entries whose reply a connection failure lost", self.consumer, len(lost))
        for entry_id, fields in lost:
            self._queue_pending(entry_id, fields, redelivery=False)
            self._newest_id = entry_id
        self._connection.reply_lost = False  # only now: a failure above re-runs the recovery, which skips what is queued

    def _receive_next(self, n: int, deadline: float) -> None:
        """Move the reply of the read in flight into the backlog, sending a read for what the call lacks first if
        none is in flight (unless recovery already filled the backlog)."""
        if self._backlog:
            return
        if self._connection.in_flight is None:
            self._send_read(n - len(self._ready), max(1, self._block_ms(deadline)))
        reply = self._connection.receive()
        entries = [(entry_id.decode(), fields) for entry_id, fields in reply[0][1]] if reply else []  # bytes ids
        if entries:
            self._backlog.extend(entries)
            self._newest_id = entries[-1][0]

    def _send_next(self, n: int, deadline: float) -> None:
        """Send the next read before the backlog is decoded: for what the call still lacks if the backlog cannot
        cover it, else (read-ahead) for the next call, keeping buffered + in flight beyond this call <= ``n``."""
        if self._connection.in_flight is not None:
            return
        held = len(self._ready) + len(self._backlog)
        if held < n:
            block_ms = self._block_ms(deadline)
            if block_ms > 0:
                self._send_read(n - held, block_ms)
        elif self.read_ahead and held < 2 * n:
            self._send_read(2 * n - held, self.block_ms)

    def _send_read(self, count: int, block_ms: int) -> None:
        self._connection.send(
            "XREADGROUP", "GROUP", self.keys.group, self.consumer, "COUNT", count, "BLOCK", block_ms,
            "STREAMS", self.keys.stream, ">",
        )

    def _block_ms(self, deadline: float) -> int:
        return min(self.block_ms, math.ceil((deadline - time.monotonic()) * 1000))

    def _accept(self, entries: list[Entry]) -> ReadDocuments:
        """Decode a batch of entries: return the valid ones, dead-letter or drop (and ack) the rest.

        If Redis fails while handling a bad entry, the valid entries and every bad entry not yet handled go back to
        the front of the queue, so nothing this consumer holds pending is forgotten.
        """
        started = time.perf_counter()
        columns, rows, errors = decode_columns(
            [fields for _, fields in entries],
            require_metrics_fields=self.require_metrics_fields,
            max_tokens=self.micro_batch_tokens,
            require_advantage=self.require_advantage,
            vocab_size=self.vocab_size,
        )
        if self.max_staleness is not None and len(columns):
            unversioned = ~columns.versioned
            if unversioned.any():
                for index in rows[unversioned].tolist():
                    errors[index] = MalformedEntry("no `model_version` field while algorithm.maxStaleness is set",
                                                   MalformedKind.MISSING_FIELD)
                columns, rows = columns.take(~unversioned), rows[~unversioned]
        self.decode_seconds += time.perf_counter() - started
        bad = sorted(errors)
        for handled, index in enumerate(bad):
            entry_id, fields = entries[index]
            error = errors[index]
            try:
                if isinstance(error, DocumentTooLong):
                    log.warning("%s: dropping entry %s: %s", self.consumer, entry_id, error.reason)
                    fence.write(self.client, self.keys, [("XACK", self.keys.stream, self.keys.group, entry_id)])
                    self.counters.dropped_too_long += 1
                else:
                    self._dead_letter(entry_id, fields, error)
            except BaseException:
                unhandled = set(rows.tolist()) | set(bad[handled:])
                self._backlog.extendleft(reversed([e for i, e in enumerate(entries) if i in unhandled]))
                raise
        return ReadDocuments([entries[index][0] for index in rows.tolist()], columns)

    def _dead_letter(self, entry_id: str, fields: dict[bytes, bytes], error: MalformedEntry) -> None:
        log.warning("%s: dead-lettering entry %s (%s): %s", self.consumer, entry_id, error.kind, error.reason)
        record: dict[bytes | str, bytes | str] = {
            "entry_id": entry_id,
            "reason": error.reason,
            "kind": error.kind,
            "stream": self.keys.stream,
            "consumer": self.consumer,
        }
        record.update({b"original:" + _bytes(name): value for name, value in fields.items()})
        fence.write(self.client, self.keys, [
            ("XADD", self.keys.dead_letter, "MAXLEN", "~", self.dead_letter_maxlen, "*", *fence.flat(record)),
            ("XACK", self.keys.stream, self.keys.group, entry_id),
        ])
        self.counters.dead_lettered[error.kind] += 1

    # --- delivery bookkeeping -----------------------------------------------------------------
    def pending_ids(self) -> list[str]:
        """Ids handed out (or dropped as stale) by :meth:`next_documents` and not yet acked or taken, oldest first."""
        return list(self._unacked)

    def take_pending_ids(self) -> list[str]:
        """The ids :meth:`pending_ids` returns, which this reader then forgets: a checkpoint snapshot covers them
        from here on, and global rank 0 acks them once that checkpoint is committed (:func:`ack_entries`, from its
        commit thread), so the next checkpoint does not cover them again. They stay pending in Redis until then
        (a crash first re-reads them). A connection loss never re-reads them either: they lie at or below the newest id
        this reader has received, and only pending entries above it are recovered."""
        ids, self._unacked = list(self._unacked), {}
        return ids

    def ack(self, ids: Iterable[str], batch: int = 1000) -> int:
        """XACK ``ids`` (once the checkpoint covering them is durable) with :func:`ack_entries` and forget them.

        Returns:
            How many of them Redis still had pending (ids acked before count 0).
        """
        ids = [protocol.text(i) for i in ids]
        acked = ack_entries(self.client, self.keys, ids, batch)
        for entry_id in ids:
            self._unacked.pop(entry_id, None)
        return acked

    def trim_acked(self) -> int:
        """:func:`trim_acked` on this reader's stream."""
        return trim_acked(self.client, self.keys)


def document_staleness(document: Document, documents_seen: int) -> Optional[int]:
    """``documents_seen`` minus the smallest ``model_version`` of ``document``'s labelled tokens, in documents (an
    int64 difference: exact), or None when it has no labelled token or no ``model_version``
    (:meth:`DocumentColumns.staleness` of one document)."""
    staleness, known = DocumentColumns.from_documents([document]).staleness(documents_seen)
    return int(staleness[0]) if known[0] else None


def ack_entries(client: redis.Redis, keys: RedisKeys, ids: Iterable[str | bytes], batch: int = 1000) -> int:
    """XACK ``ids`` in the job's consumer group, ``batch`` ids per command, whichever consumer holds them.

    Stateless (uses only ``client``, whose connection pool is thread-safe), so a checkpoint's commit thread may
    call it while the training loop reads.

    Returns:
        How many of them Redis still had pending (ids acked before count 0).

    Raises:
        rljob_trainer.fence.Fenced: a later gang attempt owns the job (each batch is fenced).
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    ids = [protocol.text(i) for i in ids]
    acked = 0
    for begin in range(0, len(ids), batch):
        acked += fence.write(client, keys, [("XACK", keys.stream, keys.group, *ids[begin : begin + batch])])[0]
    return acked


def trim_acked(client: redis.Redis, keys: RedisKeys) -> int:
    """XTRIM MINID below the group's oldest unacked entry (pending, or not yet delivered).

    The pending summary and the group's last-delivered id are read in one MULTI/EXEC, so an entry delivered in
    between cannot slip under the bound. Stateless like :func:`ack_entries`.

    Returns:
        Number of entries removed from the stream.

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    with client.pipeline(transaction=True) as pipe:
        pipe.xpending(keys.stream, keys.group)
        pipe.xinfo_groups(keys.stream)
        summary, groups = pipe.execute()
    if summary["pending"]:
        bound = protocol.text(summary["min"])
    else:
        group = next(g for g in groups if protocol.text(g["name"]) == keys.group)
        milliseconds, sequence = protocol.text(group["last-delivered-id"]).split("-")
        if milliseconds == "0" and sequence == "0":
            return 0
        bound = f"{milliseconds}-{int(sequence) + 1}"
    return fence.write(client, keys, [("XTRIM", keys.stream, "MINID", bound)])[0]


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
