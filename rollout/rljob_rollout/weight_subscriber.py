"""A rollout pod's end of the weight transfer, minus the receiving itself (the generation backend receives with
:func:`rljob_wire.transfer.receive_update`, since with vLLM each GPU worker process joins the group): the
members heartbeat and the events stream (:mod:`rljob_api.protocol`)."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Optional

import redis

from rljob_api.config import JobConfig
from rljob_api.protocol import HEARTBEAT_INTERVAL_S, Event, encode_member, parse_event, text
from rljob_wire.packed import LAYOUTS
from rljob_wire.transfer import StoreAddress, redis_time

log = logging.getLogger(__name__)


@dataclass
class WeightSubscriber:
    """A rollout pod's end of the protocol, minus the receiving itself (the generation backend receives, since
    with vLLM each GPU worker process joins the group): heartbeats and the events stream.

    Args:
        config: the resolved job config.
        client: a Redis client.
        replica_index: this pod's replica index i (env ``RLJOB_REPLICA_INDEX``).

    Attributes:
        transfer_ranks: one per GPU process t, ``1 + i·gpusPerReplica + t`` (one rank on CPU).
        address: the trainer's transfer store.
        instance: random id of this process, so the publisher can tell a restarted worker from an old one.
        version: the loaded weights' version (documents), None before the first update; heartbeats report it.
        layouts: the weight-transfer layouts the backend reads (heartbeats report them; () as an older receiver).
    """

    config: JobConfig
    client: redis.Redis
    replica_index: int
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    version: Optional[int] = None
    layouts: tuple[str, ...] = LAYOUTS

    def __post_init__(self) -> None:
        per_replica = max(1, self.config.spec.rollout.gpus_per_replica)
        self.transfer_ranks = tuple(self.config.transfer_rank(self.replica_index, t) for t in range(per_replica))
        self.address = StoreAddress(self.config.trainer_master_host, self.config.weights_port)
        self._cursor: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def heartbeat(self) -> None:
        """One heartbeat for every transfer rank of this pod. Raises redis.RedisError when Redis is down."""
        value = encode_member(redis_time(self.client), self.version, self.instance, self.layouts)
        self.client.hset(self.config.keys.members, mapping={str(rank): value for rank in self.transfer_ranks})

    def start_heartbeats(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Heartbeat every ``interval_s`` seconds on a daemon thread; Redis outages are logged once each."""

        def loop() -> None:
            down = False
            while True:
                try:
                    self.heartbeat()
                    if down:
                        log.info("weights: heartbeats resumed")
                    down = False
                except redis.RedisError as error:
                    if not down:
                        log.warning("weights: heartbeat failed (%s); retrying every %g s", error, interval_s)
                    down = True
                if self._stop.wait(interval_s):
                    return

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="rljob-heartbeat", daemon=True)
        self._thread.start()

    def leave(self) -> None:
        """Stop heartbeating and remove this pod's members (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.client.hdel(self.config.keys.members, *[str(rank) for rank in self.transfer_ranks])
        except redis.RedisError:
            pass

    def follow_from_now(self) -> Optional[Event]:
        """Start following the events stream after its current last entry; return that entry (or None).

        A worker that starts after ``training_finished`` sees it here (possibly an earlier attempt's: compare its
        ``step`` with ``maxSteps``). Raises redis.RedisError.
        """
        last = self.client.xrevrange(self.config.keys.events, count=1)
        if not last:
            self._cursor = "0-0"
            return None
        entry_id, fields = last[0]
        self._cursor = text(entry_id)
        try:
            return parse_event(self._cursor, fields)
        except ValueError:
            return None

    def poll(self, block_ms: Optional[int] = None) -> list[Event]:
        """New events since the last poll (malformed ones logged and skipped).

        Args:
            block_ms: wait up to this many milliseconds for the first new event; None: do not wait.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        if self._cursor is None:
            self.follow_from_now()
        reply = self.client.xread({self.config.keys.events: self._cursor}, count=100, block=block_ms)
        events = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                entry_id = text(entry_id)
                self._cursor = entry_id
                try:
                    events.append(parse_event(entry_id, fields))
                except ValueError as error:
                    log.warning("weights: skipping malformed event: %s", error)
        return events
