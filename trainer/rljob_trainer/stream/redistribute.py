"""Spreading a consumer group's pending entries evenly over the current data-parallel ranks at a start (DESIGN §6):
when the world size changed, the old attempt's entries all belong to the old ranks' consumers, and new ranks would
otherwise need fresh documents that a rollout held at maxPending or max lag never writes. Trainer rank 0 runs it
before every rank reads (see :mod:`rljob_trainer.stream.reader`)."""

from __future__ import annotations

import collections
import heapq
import logging
from dataclasses import dataclass
from typing import Optional

import redis

from rljob_api import protocol
from rljob_api.config import RedisKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Redistribution:
    """What :func:`redistribute_pending` did (all counts in entries = documents)."""

    pending: int
    """Entries pending under data-parallel consumers (current or vanished ranks) before the redistribution."""
    moved: int
    """Entries claimed by another consumer than the one that held them."""
    lost: int
    """Entries to move whose data had been deleted from the stream: Redis drops them from the pending list (nothing
    to train)."""
    removed_consumers: tuple[str, ...]
    """Consumers of ranks >= the data-parallel size, deleted from the group once they held nothing."""


def redistribute_pending(client: redis.Redis, keys: RedisKeys, dp_size: int, *, page: int = 1000) -> Redistribution:
    """Spread the group's pending entries evenly over the consumers of data-parallel ranks 0..dp_size-1.

    Run by ONE process while no rank reads (trainer rank 0 before the start barrier,
    :func:`rljob_trainer.trainer.start_reading`); each rank then re-reads its own pending entries
    (:meth:`StreamReader.start`).

    Of the P entries pending under consumers named ``keys.consumer(r)`` (any r, vanished ranks included), each
    current rank ends with ``P // dp_size`` or one more; the extra ones stay with the ranks that hold the most
    (ties: lower rank), so a group that is already balanced within one entry per rank is left as it is. Only
    surplus entries move: a current rank above its share gives its oldest surplus, a vanished rank (>= dp_size)
    gives everything, in rank order, each entry to the rank furthest below its share (ties: lower rank).
    Consumers of vanished ranks are then deleted. Entries of consumers whose names are not rank names are left
    alone.

    Deterministic and idempotent: a redistribution that died part-way leaves every entry pending under exactly one
    consumer, and the next one (the next attempt's) balances from there. Cost: one XPENDING summary, then XPENDING
    pages of ``page`` ids and one pipelined round trip of XCLAIM ... JUSTID (one per receiving rank) per page, only
    over the entries that move; delivery counters are not incremented.

    Args:
        client: a bytes-mode ``redis.Redis``.
        keys: the job's Redis keys (stream, group, consumer prefix).
        dp_size: the current data-parallel world size.
        page: entry ids per XPENDING page and per pipelined XCLAIM round.

    Raises:
        ValueError: ``dp_size`` or ``page`` < 1.
        redis.RedisError: Redis unreachable beyond the client's retries (entries stay pending, each under one
            consumer; the next start redistributes again).
    """
    if dp_size < 1 or page < 1:
        raise ValueError(f"dp_size={dp_size} and page={page} must be positive")
    try:
        summary = client.xpending(keys.stream, keys.group)
    except redis.ResponseError as error:
        if "NOGROUP" not in str(error):
            raise
        return Redistribution(pending=0, moved=0, lost=0, removed_consumers=())  # no group yet: nothing pending
    ranks = ((_rank_of(keys, row["name"]), int(row["pending"])) for row in summary["consumers"])
    held = {rank: count for rank, count in ranks if rank is not None}
    total = sum(held.values())
    counts = [held.get(rank, 0) for rank in range(dp_size)]
    quota = _shares(counts, total)
    moved, lost = _move_surplus(client, keys, held, counts, quota, page)
    removed = _remove_vanished_consumers(client, keys, dp_size)
    result = Redistribution(pending=total, moved=moved, lost=lost, removed_consumers=tuple(removed))
    if moved or lost or removed:
        log.info(
            "redistributed %d of %d pending entries over %d data-parallel ranks (%d deleted from the stream); "
            "removed consumers %s", moved, total, dp_size, lost, removed,
        )
    return result


def _shares(counts: list[int], total: int) -> list[int]:
    """Each current rank's share of ``total`` pending entries: ``total // len(counts)``, plus one for the
    ``total % len(counts)`` ranks that hold the most (``counts``; ties: lower rank)."""
    share, extra = divmod(total, len(counts))
    quota = [share] * len(counts)
    for rank in sorted(range(len(counts)), key=lambda rank: (-counts[rank], rank))[:extra]:
        quota[rank] += 1
    return quota


def _claim(client: redis.Redis, keys: RedisKeys, targets: dict[int, list[str]]) -> tuple[int, int]:
    """XCLAIM (min idle 0, JUSTID) each rank's ids to its consumer in one pipelined round trip; ids Redis did not
    return were deleted from the stream (Redis 7 drops them from the pending list; XACK covers older servers).

    Returns:
        (ids claimed, ids lost).
    """
    with client.pipeline(transaction=False) as pipe:
        for rank, ids in targets.items():
            pipe.xclaim(keys.stream, keys.group, keys.consumer(rank), 0, ids, justid=True)
        replies = pipe.execute()
    claimed = {protocol.text(entry_id) for reply in replies for entry_id in reply}
    gone = [entry_id for ids in targets.values() for entry_id in ids if entry_id not in claimed]
    if gone:
        log.warning("%d pending entries were deleted from the stream before they were trained: %s", len(gone),
                    gone[:10])
        client.xack(keys.stream, keys.group, *gone)
    return len(claimed), len(gone)


def _rank_of(keys: RedisKeys, consumer: bytes | str) -> Optional[int]:
    """The data-parallel rank of consumer name ``keys.consumer(rank)``, or None for any other name."""
    name = protocol.text(consumer)
    suffix = name.removeprefix(keys.consumer_prefix)
    return int(suffix) if suffix != name and suffix.isdigit() else None


def _move_surplus(client: redis.Redis, keys: RedisKeys, held: dict[int, int], counts: list[int], quota: list[int],
                  page: int) -> tuple[int, int]:
    """Move each rank's surplus over its share (a vanished rank's: everything) to the ranks furthest below theirs,
    ``page`` entries per round trip; returns (entries moved, entries found deleted from the stream)."""
    dp_size = len(counts)
    # Heap of (-entries still to receive, rank): the rank furthest below its share comes first.
    receivers = [(counts[rank] - quota[rank], rank) for rank in range(dp_size)]
    heapq.heapify(receivers)
    moved = lost = 0
    for rank in sorted(held):
        give = held[rank] - quota[rank] if rank < dp_size else None  # None: everything, however many there are
        after = "-"
        while give is None or give > 0:
            count = page if give is None else min(page, give)
            rows = client.xpending_range(keys.stream, keys.group, after, "+", count, consumername=keys.consumer(rank))
            if not rows:
                break
            ids = [protocol.text(row["message_id"]) for row in rows]
            targets: dict[int, list[str]] = collections.defaultdict(list)
            for entry_id in ids:
                below, target = heapq.heappop(receivers)
                heapq.heappush(receivers, (below + 1, target))
                targets[target].append(entry_id)
            moved_now, lost_now = _claim(client, keys, targets)
            moved, lost = moved + moved_now, lost + lost_now
            give = None if give is None else give - len(ids)
            after = "(" + ids[-1]
    return moved, lost


def _remove_vanished_consumers(client: redis.Redis, keys: RedisKeys, dp_size: int) -> list[str]:
    """Delete the consumers of ranks >= ``dp_size`` that hold nothing; returns their names."""
    removed = []
    for info in client.xinfo_consumers(keys.stream, keys.group):
        rank = _rank_of(keys, info["name"])
        if rank is None or rank < dp_size:
            continue
        name = protocol.text(info["name"])
        if int(info["pending"]):  # never DELCONSUMER with entries: Redis would drop them unacked
            log.error("%s still holds %d pending entries after the redistribution; kept", name, info["pending"])
            continue
        client.xgroup_delconsumer(keys.stream, keys.group, name)
        removed.append(name)
    return removed
