"""One data-parallel rank's reader of the document stream (DESIGN §3, §6): a Redis consumer-group consumer.

Delivery contract (at-least-once in Redis, exactly-once in committed checkpoints):

* Entries are read with XREADGROUP (no NOACK), so every entry handed out stays in the group's pending list
  (PEL) under this rank's consumer name until :meth:`StreamReader.ack`. The training loop records
  :meth:`StreamReader.pending_ids` in its checkpoint and acks them once that checkpoint is durable.
* On start, a rank first re-reads its own pending entries (entries trained after the last checkpoint of a
  crashed attempt), then claims the pending entries of consumers whose rank is >= the data-parallel size
  (the world shrank): consumer rank r is claimed by rank ``r % dp_size``, so claims are disjoint. Both count
  as redeliveries. Ids already covered by the checkpoint being resumed are acked first
  (``start(committed_ids)``), so a crash between "checkpoint durable" and "XACK" does not train them twice.
* Malformed entries go to the dead-letter stream with their reason and are acked right after (a crash in
  between dead-letters one twice rather than losing it); documents longer than the micro-batch budget are
  dropped, counted and acked. Neither ever raises out of the reader.
* :meth:`StreamReader.trim_acked` trims with XTRIM MINID below the oldest entry that is pending or not yet
  delivered, so only acked entries are ever removed (never MAXLEN). It assumes this group is the stream's
  only consumer group.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import redis

from rljob_api.config import RedisKeys
from rljob_trainer.stream.codec import Document, DocumentTooLong, MalformedEntry, decode_entries

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
    """Entries re-read from this rank's own pending list or claimed from a consumer that no longer exists."""
    dead_lettered: collections.Counter = field(default_factory=collections.Counter)
    """Malformed entries moved to the dead-letter stream, by :class:`~rljob_trainer.stream.codec.MalformedKind`."""
    dropped_too_long: int = 0
    """Documents longer than the micro-batch token budget, dropped (and acked)."""
    lost_pending: int = 0
    """Pending entries whose data was deleted from the stream before they were re-read (acked, nothing to train)."""


class StreamReader:
    """Reads documents for data-parallel rank ``dp_rank`` of ``dp_size`` from the job's stream.

    Args:
        client: a bytes-mode ``redis.Redis`` (see :func:`rljob_trainer.stream.connection.connect`).
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

    Raises:
        ValueError: rank outside [0, dp_size), non-positive budget or timeout, or a client that decodes
            responses to str (the codec needs bytes).
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
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if micro_batch_tokens < 1 or data_timeout_seconds <= 0 or block_ms < 1:
            raise ValueError(
                f"micro_batch_tokens={micro_batch_tokens}, data_timeout_seconds={data_timeout_seconds} and "
                f"block_ms={block_ms} must be positive"
            )
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the Redis client must return bytes (decode_responses=False): entries are binary")
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
        self.counters = ReaderCounters()
        self._started = False
        self._backlog: collections.deque[Entry] = collections.deque()
        self._ready: list[tuple[str, Document]] = []
        self._unacked: dict[str, None] = {}

    # --- start-up ----------------------------------------------------------------------------
    def start(self, committed_ids: Iterable[str] = ()) -> None:
        """Create the group if missing, ack ids a resumed checkpoint already covers, queue redeliveries.

        Args:
            committed_ids: entry ids recorded in the checkpoint being resumed (of every rank; XACK is per group).
        """
        try:
            self.client.xgroup_create(self.keys.stream, self.keys.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self.ack(committed_ids)
        self._recover_own_pending()
        self._claim_orphaned_pending()
        self._started = True
        if self._backlog:
            log.info("%s: %d entries to redeliver", self.consumer, len(self._backlog))

    def _recover_own_pending(self, page: int = 512) -> None:
        last = "0"
        while True:
            response = self.client.xreadgroup(self.keys.group, self.consumer, {self.keys.stream: last}, count=page)
            entries = response[0][1] if response else []
            if not entries:
                return
            for entry_id, fields in entries:
                last = entry_id
                self._queue_redelivery(_str(entry_id), fields)

    def _claim_orphaned_pending(self, page: int = 512) -> None:
        for info in self.client.xinfo_consumers(self.keys.stream, self.keys.group):
            name = _str(info["name"])
            rank = self._rank_of(name)
            if rank is None or rank < self.dp_size or rank % self.dp_size != self.dp_rank:
                continue
            while True:
                pending = self.client.xpending_range(
                    self.keys.stream, self.keys.group, "-", "+", page, consumername=name
                )
                if not pending:
                    break
                ids = [_str(p["message_id"]) for p in pending]
                claimed = self.client.xclaim(self.keys.stream, self.keys.group, self.consumer, 0, ids)
                returned = set()
                for entry_id, fields in claimed:
                    returned.add(_str(entry_id))
                    self._queue_redelivery(_str(entry_id), fields)
                gone = [i for i in ids if i not in returned]
                if gone:  # deleted from the stream: nothing to train; ack so the PEL empties
                    self.counters.lost_pending += len(gone)
                    self.client.xack(self.keys.stream, self.keys.group, *gone)
            self.client.xgroup_delconsumer(self.keys.stream, self.keys.group, name)
            log.info("%s: claimed the pending entries of %s (world size is now %d)", self.consumer, name, self.dp_size)

    def _queue_redelivery(self, entry_id: str, fields: Optional[dict]) -> None:
        if not fields:
            log.warning("%s: pending entry %s was deleted from the stream; acking it", self.consumer, entry_id)
            self.counters.lost_pending += 1
            self.client.xack(self.keys.stream, self.keys.group, entry_id)
            return
        self.counters.redeliveries += 1
        self._backlog.append((entry_id, fields))

    def _rank_of(self, consumer: str) -> Optional[int]:
        suffix = consumer.removeprefix(self.keys.consumer_prefix)
        return int(suffix) if suffix != consumer and suffix.isdigit() else None

    # --- reading ---------------------------------------------------------------------------
    def next_documents(self, n: int) -> list[tuple[str, Document]]:
        """Exactly ``n`` valid documents with their entry ids, redeliveries first, blocking until they arrive.

        Every returned id stays pending (and in :meth:`pending_ids`) until :meth:`ack`.

        Raises:
            DataTimeout: no valid document for ``data_timeout_seconds``. Documents gathered before the timeout
                are kept and returned first by the next call.
            redis.ConnectionError: Redis unreachable beyond the client's retries (nothing is lost: entries
                stay pending in Redis and gathered documents are kept).
        """
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one document")
        if not self._started:
            self.start()
        out, self._ready = self._ready[:n], self._ready[n:]
        deadline = time.monotonic() + self.data_timeout_seconds
        try:
            while len(out) < n:
                if self._backlog:
                    entries = [self._backlog.popleft() for _ in range(min(n - len(out), len(self._backlog)))]
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise DataTimeout(
                            f"{self.consumer}: no valid document on stream {self.keys.stream!r} for "
                            f"{self.data_timeout_seconds:g} s (have {len(out)} of {n})"
                        )
                    entries = self._read_new(n - len(out), min(self.block_ms, math.ceil(remaining * 1000)))
                accepted = self._accept(entries)
                if accepted:
                    out += accepted
                    deadline = time.monotonic() + self.data_timeout_seconds
        except BaseException:
            self._ready = out + self._ready
            raise
        self._unacked.update(dict.fromkeys(entry_id for entry_id, _ in out))
        self.counters.documents_read += n
        return out

    def _read_new(self, count: int, block_ms: int) -> list[Entry]:
        response = self.client.xreadgroup(
            self.keys.group, self.consumer, {self.keys.stream: ">"}, count=count, block=block_ms
        )
        return [(entry_id.decode(), fields) for entry_id, fields in response[0][1]] if response else []  # bytes client

    def _accept(self, entries: list[Entry]) -> list[tuple[str, Document]]:
        """Decode a batch of entries: return the valid ones, dead-letter or drop (and ack) the rest.

        If Redis fails while handling a bad entry, the valid entries decoded so far and every entry not yet
        handled go back to the front of the queue, so nothing this consumer holds pending is forgotten.
        """
        results = decode_entries(
            [fields for _, fields in entries],
            require_metrics_fields=self.require_metrics_fields,
            max_tokens=self.micro_batch_tokens,
            require_advantage=self.require_advantage,
            vocab_size=self.vocab_size,
        )
        accepted = []
        for index, ((entry_id, fields), result) in enumerate(zip(entries, results, strict=True)):
            try:
                if isinstance(result, Document):
                    accepted.append((entry_id, result))
                elif isinstance(result, DocumentTooLong):
                    log.warning("%s: dropping entry %s: %s", self.consumer, entry_id, result.reason)
                    self.client.xack(self.keys.stream, self.keys.group, entry_id)
                    self.counters.dropped_too_long += 1
                else:
                    self._dead_letter(entry_id, fields, result)
            except BaseException:
                kept = {entry_id for entry_id, _ in accepted}
                self._backlog.extendleft(reversed([e for e in entries[:index] if e[0] in kept] + entries[index:]))
                raise
        return accepted

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
        self.client.xadd(self.keys.dead_letter, record, maxlen=self.dead_letter_maxlen, approximate=True)
        self.client.xack(self.keys.stream, self.keys.group, entry_id)
        self.counters.dead_lettered[error.kind] += 1

    # --- delivery bookkeeping -----------------------------------------------------------------
    def pending_ids(self) -> list[str]:
        """Ids handed out by :meth:`next_documents` and not yet acked, oldest first (for the checkpoint)."""
        return list(self._unacked)

    def ack(self, ids: Iterable[str], batch: int = 1000) -> int:
        """XACK ``ids`` (once the checkpoint covering them is durable), ``batch`` ids per command.

        Returns:
            How many of them Redis still had pending (ids acked before count 0).
        """
        ids = [_str(i) for i in ids]
        acked = 0
        for begin in range(0, len(ids), batch):
            chunk = ids[begin : begin + batch]
            acked += self.client.xack(self.keys.stream, self.keys.group, *chunk)
            for entry_id in chunk:
                self._unacked.pop(entry_id, None)
        return acked

    def trim_acked(self) -> int:
        """XTRIM MINID below the group's oldest unacked entry (pending, or not yet delivered).

        The pending summary and the group's last-delivered id are read in one MULTI/EXEC, so an entry
        delivered in between cannot slip under the bound.

        Returns:
            Number of entries removed from the stream.
        """
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xpending(self.keys.stream, self.keys.group)
            pipe.xinfo_groups(self.keys.stream)
            summary, groups = pipe.execute()
        if summary["pending"]:
            bound = _str(summary["min"])
        else:
            group = next(g for g in groups if _str(g["name"]) == self.keys.group)
            milliseconds, sequence = _str(group["last-delivered-id"]).split("-")
            if milliseconds == "0" and sequence == "0":
                return 0
            bound = f"{milliseconds}-{int(sequence) + 1}"
        return self.client.xtrim(self.keys.stream, minid=bound, approximate=False)


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
