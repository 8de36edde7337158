"""The trainer's end of the weight transfer (DESIGN §2 "Weight transfer membership", §3 "Weight transfer"):
:class:`WeightPublisher` announces each update on the events stream and sends it over the wire of
:mod:`rljob_trainer.transfer` to the live rollout members.

Membership: each rollout process heartbeats ``HSET {prefix}members <transfer rank> <JSON>`` every
``HEARTBEAT_INTERVAL_S`` (:func:`rljob_api.protocol.encode_member`). A member is live while its time is less than
``MEMBER_TTL_S`` old (Redis's clock on both sides, so pod clocks never matter); entries older than
``10 · MEMBER_TTL_S`` are deleted by the publisher.

Late joiners: a worker that starts after an update (a restarted pod, or the initial update published before
any worker was up) would otherwise wait for the next optimizer step, which may never come if no other worker
produces data. :class:`WeightPublisher` therefore keeps a CPU copy of the last published weights and a thread
that serves every live member whose reported version differs from it (a repeated ``weights_ready`` event with
the same step and documents_seen, inviting only them).

Timeouts: ``join_timeout_s + timeout_s`` must stay below the trainer's DP collective timeout, because the other
DP ranks wait at their next collective while rank 0 transfers (DESIGN §3). A receiver lost in the middle of an
update makes rank 0's broadcast fail: over gloo at once (connection reset) or after ``timeout_s``; the update
is abandoned (the surviving receivers keep their old weights, see :func:`rljob_trainer.transfer.receive_update`)
and the late-joiner thread serves them again. Over NCCL, PyTorch's NCCL watchdog may instead end the trainer
process when an operation times out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, process-wide): a gang restart, still
never a hang.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import uuid
from typing import Any, Iterable, Iterator, Mapping, Optional

import redis
import torch
from torch.distributed import Store, TCPStore

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.config import JobConfig, RedisKeys
from rljob_api.protocol import MEMBER_TTL_S, MemberInfo, TransferTicket, parse_member
from rljob_trainer import fence
from rljob_trainer.transfer import redis_time, send_update, unwrapped_name

log = logging.getLogger(__name__)


class WeightPublisher:
    """Trainer global rank 0's end of the weight transfer: announces and broadcasts every update.

    Args:
        config: the resolved job config (ports, keys, collective timeout, rollout topology).
        client: a Redis client (events stream and members hash).
        store: a ready master store (tests); default: a new ``TCPStore`` server on ``config.weights_port``,
            listening on every interface.
        join_timeout_s: how long an update waits for invited members (default min(30, collective/4) s).
        transfer_timeout_s: collective timeout of one update's group (default collective/2 s).
        serve_late_joiners: keep a CPU copy of the last weights and a thread that serves members that missed
            them (module docstring). Costs one model's worth of host memory.
        poll_interval_s: how often that thread looks at the members hash.

    Raises:
        ValueError: ``join_timeout_s + transfer_timeout_s`` >= the DP collective timeout (names all three).
        RuntimeError / DistNetworkError: the weights port is taken.
    """

    def __init__(
        self,
        config: JobConfig,
        client: redis.Redis,
        *,
        store: Optional[Store] = None,
        join_timeout_s: Optional[float] = None,
        transfer_timeout_s: Optional[float] = None,
        serve_late_joiners: bool = True,
        poll_interval_s: float = 1.0,
    ) -> None:
        collective = float(config.spec.trainer.collective_timeout_seconds)
        self.join_timeout_s = join_timeout_s if join_timeout_s is not None else min(30.0, collective / 4)
        self.transfer_timeout_s = transfer_timeout_s if transfer_timeout_s is not None else collective / 2
        if self.join_timeout_s + self.transfer_timeout_s >= collective:
            raise ValueError(
                f"weight transfer: join timeout {self.join_timeout_s} s + transfer timeout {self.transfer_timeout_s} s "
                f"must stay below spec.trainer.collectiveTimeoutSeconds = {collective:g} s"
            )
        self._keys = config.keys
        self._client = client
        if store is None:
            host = os.environ.get(c.ENV_POD_IP) or "127.0.0.1"  # the server binds every interface; this is its own client
            store = TCPStore(host, config.weights_port, None, True, datetime.timedelta(seconds=self.transfer_timeout_s), wait_for_workers=False)
        self._store = store
        self._lock = threading.Lock()
        self._snapshot: Optional[list[tuple[str, torch.Tensor]]] = None
        self._current: Optional[tuple[int, int]] = None  # (step, documents_seen) of the snapshot
        self._served: dict[tuple[int, str], int] = {}  # (rank, instance) -> documents_seen received
        self._attempted: dict[tuple[int, str], tuple[int, float]] = {}  # -> (documents_seen, monotonic time)
        self._retry_s = 2 * self.join_timeout_s + 1.0
        self._keep_snapshot = serve_late_joiners
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if serve_late_joiners:
            self._thread = threading.Thread(
                target=self._serve_loop, args=(poll_interval_s,), name="rljob-weights-late-joiners", daemon=True
            )
            self._thread.start()

    # -- membership
    def live_members(self) -> dict[int, MemberInfo]:
        """Members whose heartbeat is younger than :data:`MEMBER_TTL_S`; deletes very old entries.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        raw = self._client.hgetall(self._keys.members)
        now = redis_time(self._client)
        live, dead = {}, []
        for field_name, value in raw.items():
            try:
                rank, info = int(field_name), parse_member(value)
            except ValueError:
                log.warning("weights: ignoring malformed member %r = %r", field_name, value)
                continue
            age = now - info.time
            if age < MEMBER_TTL_S:
                live[rank] = info
            elif age > 10 * MEMBER_TTL_S:
                dead.append(field_name)
        if dead:
            self._client.hdel(self._keys.members, *dead)
        return live

    # -- updates
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, step: int, documents_seen: int) -> int:
        """Announce (weights_ready on the events stream) and broadcast one update to the live members.

        ``named_tensors`` is consumed exactly once and completely, whatever the number of receivers (so a
        generator that runs collectives stays in step on every rank). Names lose DDP/compile prefixes
        (:func:`unwrapped_name`); tensors are sent at their dtype, from CPU (gloo) or from the first tensor's
        CUDA device (nccl).

        Args:
            named_tensors: (Hugging Face parameter name, full tensor) pairs, e.g. ``model.named_parameters()``.
            step: optimizer steps done.
            documents_seen: the weights' version in documents (DESIGN §6).

        Returns:
            The number of rollout processes that received the whole update (0 without members, or when the
            update failed: failures are logged, never raised, and the members are served again by the
            late-joiner thread).
        """
        with self._lock:
            members = self._live_or_none()
            iterator = iter(named_tensors)
            first = next(iterator, None)
            device = first[1].device if first is not None and first[1].is_cuda else torch.device("cpu")
            ticket = self._ticket(sorted(members), "nccl" if device.type == "cuda" else "gloo")
            announced = self._announce(step, documents_seen, ticket)
            snapshot: Optional[list[tuple[str, torch.Tensor]]] = [] if self._keep_snapshot else None

            def stream() -> Iterator[tuple[str, torch.Tensor]]:
                pairs = iterator if first is None else _chain_first(first, iterator)
                for name, tensor in pairs:
                    name, tensor = unwrapped_name(name), tensor.detach()
                    if snapshot is not None:
                        snapshot.append((name, tensor.to("cpu", copy=True)))
                    yield name, tensor

            pairs = stream()
            received: list[int] = []
            try:
                if announced and ticket.members:
                    received = send_update(self._store, ticket, pairs, device=device)
            except Exception as error:  # noqa: BLE001 - any transfer failure must not stop training
                log.warning("weights: update %s (step %d) failed: %s", ticket.id, step, error)
            finally:
                for _ in pairs:  # drain: build the snapshot, keep collective generators in step
                    pass
            if snapshot is not None:
                self._snapshot = snapshot
            self._current = (step, documents_seen)
            self._record(ticket, members, received, documents_seen)
            log.info("weights: step %d (version %d) sent to %d of %d members", step, documents_seen, len(received), len(ticket.members))
            return len(received)

    def serve_late_joiners(self) -> int:
        """Send the last published weights to live members that lack them (see the module docstring).

        Returns:
            How many received them (0 when nobody needed them, nothing was published yet, or Redis is down).
        """
        with self._lock:
            if self._snapshot is None or self._current is None:
                return 0
            step, seen = self._current
            members = self._live_or_none()
            now = time.monotonic()
            needy = []
            for rank, info in members.items():
                key = (rank, info.instance)
                tried = self._attempted.get(key)
                if info.version == seen or self._served.get(key) == seen:
                    continue
                if tried is not None and tried[0] == seen and now - tried[1] < self._retry_s:
                    continue
                needy.append(rank)
            if not needy:
                return 0
            ticket = self._ticket(sorted(needy), "gloo")  # the snapshot lives on CPU
            received: list[int] = []
            if self._announce(step, seen, ticket):
                try:
                    received = send_update(self._store, ticket, iter(self._snapshot), device=torch.device("cpu"))
                except Exception as error:  # noqa: BLE001
                    log.warning("weights: late-joiner update %s failed: %s", ticket.id, error)
            self._record(ticket, members, received, seen)
            log.info("weights: version %d sent to late joiners %s (%d received)", seen, sorted(needy), len(received))
            return len(received)

    def finish(self, *, step: int, documents_seen: int) -> None:
        """Write ``{"type": "training_finished", "step", "documents_seen"}`` to the events stream (rollout workers
        exit 0 on it). ``step`` / ``documents_seen`` are the final ones (optimizer steps, documents); they are extra
        JSON fields that upstream consumers ignore, and let a rollout worker that starts later tell a finished job
        from an earlier attempt's end (:class:`rljob_rollout.worker.RolloutWorker`).

        Raises:
            redis.RedisError: Redis unreachable (after the client's own retries).
        """
        _add_event(self._client, self._keys, protocol.training_finished_event(step, documents_seen))

    def close(self) -> None:
        """Stop the late-joiner thread and the store server."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s + self.transfer_timeout_s + 5)
        self._store = None
        self._snapshot = None

    # -- helpers
    def _live_or_none(self) -> dict[int, MemberInfo]:
        try:
            return self.live_members()
        except redis.RedisError as error:
            log.warning("weights: cannot read members (%s); no receiver this time", error)
            return {}

    def _ticket(self, members: list[int], backend: str) -> TransferTicket:
        return TransferTicket(uuid.uuid4().hex, tuple(members), backend, self.join_timeout_s, self.transfer_timeout_s)

    def _announce(self, step: int, documents_seen: int, ticket: TransferTicket) -> bool:
        try:
            _add_event(self._client, self._keys, protocol.weights_ready_event(step, documents_seen, ticket))
            return True
        except redis.RedisError as error:
            log.warning("weights: cannot write weights_ready for version %d (%s)", documents_seen, error)
            return False

    def _record(self, ticket: TransferTicket, members: dict[int, MemberInfo], received: list[int], seen: int) -> None:
        now = time.monotonic()
        for rank in ticket.members:
            key = (rank, members[rank].instance) if rank in members else (rank, "")
            self._attempted[key] = (seen, now)
            if rank in received:
                self._served[key] = seen

    def _serve_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.serve_late_joiners()
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                log.exception("weights: late-joiner service failed; retrying")


def _chain_first(first: tuple[str, torch.Tensor], rest: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    yield first
    yield from rest


def _add_event(client: redis.Redis, keys: RedisKeys, event: Mapping[str, Any]) -> None:
    """XADD ``event`` to the events stream (capped at about EVENTS_MAXLEN), fenced by the gang attempt.

    Raises:
        rljob_trainer.fence.Fenced: a later gang attempt owns the job.
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    fence.write(client, keys, [("XADD", keys.events, "MAXLEN", "~", protocol.EVENTS_MAXLEN, "*", *fence.flat(event))])
