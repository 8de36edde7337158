"""The trainer's end of the weight transfer (DESIGN §2 "Weight transfer membership", §3 "Weight transfer"):
:func:`publish_weights`, which every trainer rank calls after each optimizer step, and :class:`WeightPublisher`
(global rank 0 only), which announces each update on the events stream and sends it over the wire of
:mod:`rljob_wire.transfer` to the live rollout members.

Every rank takes part: with FSDP a parameter is a DTensor sharded over the data-parallel ranks and
``DTensor.full_tensor()`` is a collective, so every rank iterates the same generator (:func:`full_tensors`), which
gathers one tensor at a time in ``state_dict`` order; rank 0 sends each and drops it before the next is gathered,
the other ranks drop theirs at once. Only rank 0 owns the store and the rollout groups. With DDP the generator
yields the parameters themselves and the other ranks return at once.

Groups: rank 0 keeps the transfer group of a complete update and sends the next update over it while the members
that join are the same and all kept it too; a member that joins or leaves, or a failed update, makes the next update
form a new group (:mod:`rljob_wire.transfer`, DESIGN §3).

Membership: each rollout process heartbeats ``HSET {prefix}members <transfer rank> <JSON>`` every
``HEARTBEAT_INTERVAL_S`` (:func:`rljob_api.protocol.encode_member`). A member is live while its time is less than
``MEMBER_TTL_S`` old (Redis's clock on both sides, so pod clocks never matter); entries older than
``10 · MEMBER_TTL_S`` are deleted by the publisher.

Late joiners: a worker that starts after an update (a restarted pod, or the initial update published before
any worker was up) would otherwise wait for the next optimizer step, which may never come if no other worker
produces data. :class:`WeightPublisher` therefore keeps a host copy of the last published weights, in the
published dtype (:class:`LateJoinerCopy`: one buffer per tensor, allocated once and overwritten by each
publication, so rank 0 never holds two copies), and a thread that serves every live member whose reported
version differs from it (a repeated ``weights_ready`` event with the same step and documents_seen, inviting only
them). A publication preempts that thread: a late-joiner update in progress is abandoned within one tensor (its
receivers are invited to the publication instead). The copy of tensors sent as they are (DDP at the model's dtype)
is made after the broadcast on a background thread, so the rollout does not wait for it; rank 0 calls
:meth:`WeightPublisher.settle` before the next optimizer step changes them. Gathered (FSDP) or cast tensors are
copied as they come and sent from the copy.

Memory of rank 0 during a publication: the late-joiner copy plus, per-tensor, one tensor in flight (a gathered,
cast or moved tensor; none with DDP at the model's dtype, whose parameters are sent as they are); packed, two bucket
buffers and at most two tensors sent from their own memory (gathered ones kept alive until they have arrived) besides
the one being made.

Beside the next step: :meth:`WeightPublisher.in_background` runs a publication on the publisher's own thread (the
trainer does so for an unsharded model on CPU, whose publication runs no collective of the DP group); :meth:`settle`
waits for it and raises what it raised.

Timeouts: ``join_timeout_s + transfer_timeout_s`` must stay below the trainer's DP collective timeout. The
other DP ranks wait for rank 0 meanwhile: with DDP at their next collective, for the whole publication (for its
rest when it runs beside the next step, at the collective after that step's :meth:`settle`); with FSDP
in the next gather, for the join (before the first tensor) and then one tensor's send at a time. Rank 0 waits for
members at most ``join_timeout_s`` and bounds the rest of an update by ``transfer_timeout_s`` (the group's
formation and every tensor, :attr:`rljob_wire.transfer.UpdateSender.deadline`), so both waits stay below it;
the late-joiner copy (a host memory copy) comes on top. A receiver lost in the middle of an update makes rank 0's
broadcast fail: over gloo at once (connection reset) or at the deadline; the update is abandoned (the surviving
receivers keep their old weights, see :func:`rljob_wire.transfer.receive_update`) and its group dropped on every
end (the next update forms a new one), the generator is still
consumed to its end (the gathers stay in step on every rank, the late-joiner copy completes) and the late-joiner
thread serves them again. Over NCCL, PyTorch's NCCL watchdog may instead end the trainer process when an
operation times out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, process-wide): a gang restart, still never a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, TypeVar

import redis
import torch
from torch.distributed import Store, TCPStore
from torch.distributed.tensor import DTensor

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.config import JobConfig, RedisKeys
from rljob_api.protocol import MEMBER_TTL_S, MemberInfo, TransferTicket, parse_member
from rljob_trainer import fence
from rljob_wire.packed import DEFAULT_BUCKET_BYTES, LAYOUT_PACKED, LAYOUT_PER_TENSOR, BucketBuffers, Manifest, plan
from rljob_wire.transfer import (GroupKeeper, TransferCancelled, UpdateSender, open_update, send_update,
                                    time_seconds, unwrapped_name)

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightPublisher:
    """Trainer global rank 0's end of the weight transfer: announces and broadcasts every update.

    Args:
        config: the resolved job config (ports, keys, collective timeout, rollout topology).
        client: a Redis client (events stream and members hash).
        store: a ready master store (tests); default: a new ``TCPStore`` server on ``config.weights_port``,
            listening on every interface.
        join_timeout_s: how long an update waits for invited members (default min(30, collective/4) s).
        transfer_timeout_s: how long the rest of one update may take: its group's formation and every tensor
            (default collective/2 s).
        serve_late_joiners: keep a host copy of the last published weights and a thread that serves members that
            missed them (module docstring). Costs one model's worth of host memory in the published dtype.
        poll_interval_s: how often that thread looks at the members hash.
        bucket_bytes: bucket size of the packed layout (bytes; :mod:`rljob_wire.packed`), used when every receiver of
            an update reads it and the publication names its tensors upfront (``tensors`` of :meth:`publish`); None:
            per-tensor always. Rank 0 keeps two buckets between updates.

    Attributes:
        last_phases: where the last :meth:`publish` spent its time on this rank (milliseconds): ``announce`` (the
            members hash, the first tensor (a gather under FSDP) and the weights_ready event), ``join`` (waiting for
            the invited members to be ready), ``group`` (reusing the kept group, or forming a new one), ``tensors``
            (every tensor made and queued on the wire; the gathers under FSDP), ``end`` (the closing ``None`` and the
            wait for the tensors still in flight). What the duration holds beyond them is bookkeeping (and a failed
            group's teardown).
        last_layout: the layout of the last publication's update (``packed`` or ``per-tensor``; None when it had no
            receiver).
        last_manifest: the packed plan of the last publication's update (None unless it went packed).

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
        bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES,
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
        self._groups = GroupKeeper()  # the transfer groups kept while the members stay the same
        self._lock = threading.Lock()
        self._preempt = threading.Event()  # a publication waits for the lock: the late-joiner service lets go
        self._snapshot: Optional[LateJoinerCopy] = LateJoinerCopy() if serve_late_joiners else None
        self._current: Optional[tuple[int, int]] = None  # (step, documents_seen) of a complete snapshot
        self._served: dict[tuple[int, str], int] = {}  # (rank, instance) -> documents_seen received
        self._attempted: dict[tuple[int, str], tuple[int, float]] = {}  # -> (documents_seen, monotonic time)
        self._retry_s = 2 * self.join_timeout_s + 1.0
        self._copier: Optional[threading.Thread] = None  # the late-joiner copy of the last publication
        self._background: Optional[Future[Any]] = None  # a publication running beside the training step
        self._publishing: Optional[ThreadPoolExecutor] = None  # its thread, made at the first one
        self.last_phases: dict[str, float] = {}
        self.last_layout: Optional[str] = None
        self.last_manifest: Optional[Manifest] = None
        self.bucket_bytes = bucket_bytes
        self._staging = BucketBuffers()  # the packed layout's two buckets, kept between updates
        self._manifests: dict[tuple, Manifest] = {}  # the last plan, by the tensors it was made for
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if serve_late_joiners:
            self._thread = threading.Thread(
                target=self._serve_loop, args=(poll_interval_s,), name="rljob-weights-late-joiners", daemon=True
            )
            self._thread.start()

    @property
    def late_joiner_copy(self) -> Optional[LateJoinerCopy]:
        """The host copy late joiners are served from (None without ``serve_late_joiners`` or after :meth:`close`),
        complete: waits for the last publication's copy (:meth:`settle`)."""
        self.settle()
        return self._snapshot

    # -- membership
    def live_members(self) -> dict[int, MemberInfo]:
        """Members whose heartbeat is younger than :data:`MEMBER_TTL_S`; deletes very old entries.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        pipe = self._client.pipeline(transaction=False)  # one round trip: the hash and Redis's clock
        pipe.hgetall(self._keys.members)
        pipe.time()
        raw, reply = pipe.execute()
        now = time_seconds(reply)
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
    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        step: int,
        documents_seen: int,
        dtype: Optional[torch.dtype] = None,
        transient: bool = False,
        tensors: Optional[Iterable[tuple[str, tuple[int, ...], torch.dtype]]] = None,
    ) -> int:
        """Announce (weights_ready on the events stream) and broadcast one update to the live members.

        ``named_tensors`` is consumed exactly once and completely, whatever the number of receivers or failures (so
        a generator that runs collectives stays in step on every rank). Names lose DDP/compile prefixes
        (:func:`unwrapped_name`); floating-point tensors are sent in ``dtype``, from CPU (gloo) or from the first
        tensor's CUDA device (nccl). The late-joiner copy is made without delaying the broadcast where possible:

        - the model's own tensors (DDP) that need no conversion, or that the packed layout casts on its way into
          a bucket, are sent as they are, without waiting for one before the next one's metadata goes out, and
          copied (cast) after the broadcast on a background thread: call :meth:`settle` before the weights change
          (the next optimizer step);
        - ``transient`` tensors (gathered from shards), and on CPU tensors that need a cast and travel per-tensor or
          in a packed bucket of their own, are copied (cast) into the late-joiner copy and sent from there, each
          dropped before the next is asked for, so the next one is gathered while this one is on the wire;
        - otherwise (a GPU tensor to cast, per-tensor) the converted tensor is sent and copied at the same time.

        Args:
            named_tensors: (Hugging Face parameter name, full tensor) pairs, e.g. ``model.state_dict().items()``
                or :func:`full_tensors`.
            step: optimizer steps done.
            documents_seen: the weights' version in documents (DESIGN §6).
            dtype: the published dtype of floating-point tensors (None: each tensor's own), e.g. torch.bfloat16
                for float32 master weights.
            transient: the tensors were made for this publication (gathered from shards) rather than being the
                model's own.
            tensors: (name, shape, dtype) of every tensor of ``named_tensors``, in the same order, before any is
                made (the packed layout's manifest); None: the update goes per-tensor.

        Returns:
            The number of rollout processes that received the whole update (0 without members, or when the
            update failed: failures are logged, never raised, and the members are served again by the
            late-joiner thread).

        Raises:
            Whatever ``named_tensors`` raises (a failed gather): the late-joiner copy is then marked incomplete.
            rljob_trainer.fence.Fenced: a later gang attempt owns the job (the weights_ready event was refused).
        """
        self._settle_copy()
        self._preempt.set()
        with self._lock:
            self._preempt.clear()
            clock = [time.perf_counter()]
            members = self._live_or_none()
            iterator = iter(named_tensors)
            first = next(iterator, None)
            device = first[1].device if first is not None and first[1].is_cuda else torch.device("cpu")
            manifest = self._manifest(tensors, dtype, transient, device)
            ticket = self._ticket(members, sorted(members), "nccl" if device.type == "cuda" else "gloo", manifest)
            announced = self._announce(step, documents_seen, ticket)
            clock.append(time.perf_counter())
            sender = self._open(ticket, device, manifest, step) if announced and ticket.members else None
            join_s, reused = (sender.join_s, sender.reused) if sender is not None else (0.0, False)
            self.last_layout = sender.layout if sender is not None else None
            self.last_manifest = manifest if self.last_layout == LAYOUT_PACKED else None
            clock.append(time.perf_counter())
            pairs = iterator if first is None else _chain_first(first, iterator)
            del first
            self._current = None
            if self._snapshot is not None:
                self._snapshot.begin()
            sole = frozenset(e.name for e in manifest.entries if manifest.sole(e.bucket)) if manifest else frozenset()
            later, sender = self._send_all(pairs, sender, ticket, step, device, dtype, transient, sole)
            clock.append(time.perf_counter())
            received = self._end(sender, ticket, step)
            sender = None  # a group that failed is torn down here
            clock.append(time.perf_counter())
            self.last_phases = {name: seconds * 1e3 for name, seconds in (
                ("announce", clock[1] - clock[0]), ("join", join_s), ("group", clock[2] - clock[1] - join_s),
                ("tensors", clock[3] - clock[2]), ("end", clock[4] - clock[3]))}
            self._record(ticket, members, received, documents_seen)
            log.info("weights: step %d (version %d) sent to %d of %d members (%s group, %s)", step, documents_seen,
                     len(received), len(ticket.members), "kept" if reused else "new", self.last_layout or "no layout")
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the late-joiner copies from the GPU have landed
            if self._snapshot is None or not later:
                self._complete(step, documents_seen)
        if self._snapshot is not None and later:
            self._copier = threading.Thread(target=self._copy_later, args=(later, step, documents_seen, dtype),
                                            name="rljob-weights-copy", daemon=True)
            self._copier.start()
        return len(received)

    def in_background(self, publication: Callable[[], T]) -> Future[T]:
        """Run ``publication`` (a call of :meth:`publish` through :func:`publish_weights`) on the publisher's own
        thread and return at once (after :meth:`settle`, so one publication runs at a time). The weights it reads must
        not change before :meth:`settle`; only a publication without collectives of the data-parallel group may run
        here (an unsharded model: its transfer group is the only process group it uses)."""
        self.settle()
        if self._publishing is None:
            self._publishing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rljob-weights-publish")
        self._background = self._publishing.submit(publication)
        return self._background

    def settle(self) -> None:
        """Wait until the last publication, and its late-joiner copy, are complete. Call it before the published
        weights change (before each optimizer step): until then a background thread may still be reading them.

        Raises:
            Whatever a publication started by :meth:`in_background` raised (rljob_trainer.fence.Fenced).
        """
        background, self._background = self._background, None
        if background is not None:
            background.result()
        self._settle_copy()

    def _settle_copy(self) -> None:
        if self._copier is not None:
            self._copier.join()
            self._copier = None

    def _open(self, ticket: TransferTicket, device: torch.device, manifest: Optional[Manifest],
              step: int) -> Optional[UpdateSender]:
        """The sender of an announced update (its group joined), or None when that failed (logged)."""
        try:
            return open_update(self._store, ticket, device=device, groups=self._groups, manifest=manifest,
                               staging=self._staging)
        except Exception as error:  # noqa: BLE001 - any transfer failure must not stop training
            log.warning("weights: update %s (step %d) failed: %s", ticket.id, step, error)
            return None

    def _send_all(
        self, pairs: Iterator[tuple[str, torch.Tensor]], sender: Optional[UpdateSender], ticket: TransferTicket,
        step: int, device: torch.device, dtype: Optional[torch.dtype], transient: bool, sole: frozenset[str],
    ) -> tuple[list[tuple[str, torch.Tensor]], Optional[UpdateSender]]:
        """Consume ``pairs`` completely, sending each tensor while ``sender`` works and keeping the late-joiner
        copy (see :meth:`publish`). ``sole``: the names a packed update sends from their own memory (alone, or in a
        bucket of their own): cast on CPU, those go through the late-joiner copy rather than a bucket slot or fresh
        memory.

        Returns:
            The model's own tensors to copy after the broadcast, and the sender (None once it failed).
        """
        later: list[tuple[str, torch.Tensor]] = []
        packed = sender is not None and sender.layout == LAYOUT_PACKED
        for name, tensor in pairs:
            name, tensor = unwrapped_name(name), tensor.detach()
            out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            cast_later = sender is None or (packed and (device.type == "cuda" or name not in sole))  # into a bucket
            stable = not transient and tensor.device == device and (tensor.dtype == out_dtype or cast_later)
            if stable:
                later.append((name, tensor))
                if self._snapshot is not None:
                    self._snapshot.place(name)
            if sender is not None:
                try:
                    self._send(sender, name, tensor, device, out_dtype, stable)
                except Exception as error:  # noqa: BLE001
                    log.warning("weights: update %s (step %d) failed at %s: %s", ticket.id, step, name, error)
                    sender = None
            if not stable and self._snapshot is not None and not self._snapshot.holds(name):
                self._snapshot.store(name, tensor, out_dtype)
            del tensor  # before the next one is gathered
        return later, sender

    @staticmethod
    def _end(sender: Optional[UpdateSender], ticket: TransferTicket, step: int) -> list[int]:
        """Finish the update; the transfer ranks that received all of it ([] when it failed, logged)."""
        if sender is None:
            return []
        try:
            sender.finish()
            return sender.joined
        except Exception as error:  # noqa: BLE001
            log.warning("weights: update %s (step %d) failed at its end: %s", ticket.id, step, error)
            return []

    def _send(
        self, sender: UpdateSender, name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, stable: bool
    ) -> None:
        """One tensor of a publication (see :meth:`publish`); the late-joiner copy of a tensor that is not
        ``stable`` is made here too."""
        if stable:
            sender.send(name, tensor.contiguous())  # in flight while the next ones are queued
            return
        if self._snapshot is not None and device.type == "cpu":
            sender.send(name, self._snapshot.store(name, tensor, dtype))  # in flight from the copy
            return
        outgoing = tensor.to(device=device, dtype=dtype).contiguous()
        sender.send(name, outgoing)
        if self._snapshot is not None:
            self._snapshot.store(name, outgoing)  # while it is on the wire
        if sender.layout == LAYOUT_PER_TENSOR:
            sender.wait()  # one tensor in flight (packed: copied into a bucket, or kept alive by the sender's queue)

    def _copy_later(self, pairs: list[tuple[str, torch.Tensor]], step: int, documents_seen: int,
                    dtype: Optional[torch.dtype]) -> None:
        """The late-joiner copy of the model's own tensors :meth:`publish` sent without a copy of their own (a
        background thread), floating-point ones cast to ``dtype`` (None: their own)."""
        with self._lock:
            try:
                assert self._snapshot is not None
                stream = torch.cuda.Stream(pairs[0][1].device) if pairs[0][1].is_cuda else None
                if stream is not None:
                    stream.wait_stream(torch.cuda.default_stream(pairs[0][1].device))
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for name, tensor in pairs:
                        self._snapshot.store(name, tensor, dtype if tensor.is_floating_point() else None)
                if stream is not None:
                    stream.synchronize()
                self._complete(step, documents_seen)
            except Exception:  # noqa: BLE001 - the copy stays incomplete: late joiners wait for the next one
                log.exception("weights: the late-joiner copy of version %d failed", documents_seen)

    def _complete(self, step: int, documents_seen: int) -> None:
        if self._snapshot is not None:
            self._snapshot.complete()
        self._current = (step, documents_seen)

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
            items = self._snapshot.items()
            manifest = self._manifest([(name, tuple(t.shape), t.dtype) for name, t in items], None)
            ticket = self._ticket(members, sorted(needy), "gloo", manifest)  # the snapshot lives on CPU
            received: list[int] = []
            if self._announce(step, seen, ticket):
                try:
                    received = send_update(self._store, ticket, items, device=torch.device("cpu"),
                                           cancelled=self._preempt.is_set, groups=self._groups, manifest=manifest,
                                           staging=self._staging)
                except TransferCancelled:
                    log.info("weights: late-joiner update %s gave way to a publication", ticket.id)
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
        """Wait for a publication in flight (its failure is logged), stop the late-joiner thread, drop the kept
        transfer groups and stop the store server."""
        try:
            self.settle()
        except Exception as error:  # noqa: BLE001 - closing must release the rest
            log.warning("weights: the last publication failed: %s", error)
        if self._publishing is not None:
            self._publishing.shutdown(wait=True)
            self._publishing = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s + self.transfer_timeout_s + 5)
        with self._lock:
            self._groups.close()
        self._store = None
        self._snapshot = None

    # -- helpers
    def _live_or_none(self) -> dict[int, MemberInfo]:
        try:
            return self.live_members()
        except redis.RedisError as error:
            log.warning("weights: cannot read members (%s); no receiver this time", error)
            return {}

    def _manifest(self, tensors: Optional[Iterable[tuple[str, tuple[int, ...], torch.dtype]]],
                  dtype: Optional[torch.dtype], transient: bool = False,
                  device: torch.device = torch.device("cpu")) -> Optional[Manifest]:
        """The packed plan of a publication of ``tensors`` sent in ``dtype`` from ``device`` (None: without ``tensors``
        or ``bucket_bytes``); the last one is kept, since the model's tensors stay the same from step to step.

        Tensors get buckets of their own (:func:`rljob_wire.packed.plan`'s ``own_bytes``) only from a CPU that casts
        nothing on the way (``transient`` tensors come cast from the gather): there a bucket copy costs as much as the
        send, while a cast is a copy anyway and pipelines best into full buckets, and on a GPU a copy runs at memory
        speed and fewer, larger broadcasts win (docs/weight-sync.md)."""
        if tensors is None or self.bucket_bytes is None:
            return None
        tensors = list(tensors)
        key = tuple((unwrapped_name(name), tuple(shape), dtype if dtype is not None and d.is_floating_point else d)
                    for name, shape, d in tensors)
        casts = not transient and dtype is not None and any(d.is_floating_point and d != dtype for _, _, d in tensors)
        own = self.bucket_bytes + 1 if casts or device.type != "cpu" else None
        if (self.bucket_bytes, own, key) not in self._manifests:
            self._manifests = {(self.bucket_bytes, own, key): plan(key, self.bucket_bytes, own)}
        return self._manifests[(self.bucket_bytes, own, key)]

    def _ticket(self, infos: Mapping[int, MemberInfo], members: list[int], backend: str,
                manifest: Optional[Manifest] = None) -> TransferTicket:
        """A ticket for ``members``: packed when there is a ``manifest`` and each member's heartbeat reads it."""
        packed = manifest is not None and all(LAYOUT_PACKED in infos[rank].layouts for rank in members if rank in infos)
        return TransferTicket(uuid.uuid4().hex, tuple(members), backend, self.join_timeout_s, self.transfer_timeout_s,
                              LAYOUT_PACKED if packed else LAYOUT_PER_TENSOR)

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
    del first  # before the next tensor is made
    yield from rest


def _add_event(client: redis.Redis, keys: RedisKeys, event: Mapping[str, Any]) -> None:
    """XADD ``event`` to the events stream (capped at about EVENTS_MAXLEN), fenced by the gang attempt.

    Raises:
        rljob_trainer.fence.Fenced: a later gang attempt owns the job.
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    fence.write(client, keys, [("XADD", keys.events, "MAXLEN", "~", protocol.EVENTS_MAXLEN, "*", *fence.flat(event))])


class LateJoinerCopy:
    """Rank 0's host copy of the last published weights, in the published dtype: one buffer per tensor name,
    allocated at the first publication (pinned when the source is on a GPU) and overwritten by every later one, so
    it costs one model's worth of host memory and no allocation per publication (fresh memory faults on every page:
    docs/weight-sync.md).

    A publication calls :meth:`begin`, :meth:`store` for every tensor in order and :meth:`complete`; :meth:`items`
    is the complete copy in that order. A buffer whose shape or dtype changes is replaced (the old one freed first);
    names a publication did not store are dropped at :meth:`complete`.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._order: list[str] = []
        self._stored: set[str] = set()

    def begin(self) -> None:
        """Start overwriting: until :meth:`complete` the copy mixes versions."""
        self._order = []
        self._stored = set()

    def place(self, name: str) -> None:
        """Give ``name`` its place in :meth:`items` now, for a tensor stored later (the publication's order)."""
        if name not in self._order:
            self._order.append(name)

    def holds(self, name: str) -> bool:
        """Whether ``name`` was stored since :meth:`begin`."""
        return name in self._stored

    def store(self, name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Copy ``tensor`` ([shape], any device) into the buffer of ``name``, cast to ``dtype`` (default its own);
        returns the buffer (contiguous, on CPU). From a CUDA tensor the copy is asynchronous (pinned memory) on the
        current stream: complete once that stream is."""
        dtype = dtype or tensor.dtype
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != dtype:
            self._buffers.pop(name, None)
            del buffer  # freed before its replacement is allocated
            buffer = self._buffers[name] = torch.empty(tensor.shape, dtype=dtype, pin_memory=tensor.is_cuda)
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if name not in self._stored:
            self.place(name)
            self._stored.add(name)
        return buffer

    def complete(self) -> None:
        """End a publication: drop the buffers of names it did not store. Copies from a GPU must be complete (the
        caller synchronised their stream)."""
        for name in set(self._buffers) - self._stored:
            del self._buffers[name]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) in the last publication's order."""
        return [(name, self._buffers[name]) for name in self._order if name in self._buffers]

    @property
    def nbytes(self) -> int:
        """Bytes held by every buffer."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


@dataclass(frozen=True)
class Publication:
    """What one call of :func:`publish_weights` cost on this rank.

    Attributes:
        duration_ms: its wall time (milliseconds); on global rank 0 the whole publication (announce, join, the
            group (kept or new), gathers, sends, the late-joiner copy of gathered or cast tensors), reported as the
            step metric ``weight_sync_time_ms``, or ``weight_sync_overlapped_time_ms`` when it ran beside the next
            step (:meth:`WeightPublisher.in_background`); a DDP model's own tensors are copied afterwards on a thread
            (:meth:`WeightPublisher.settle`).
        gather_ms: the part spent in ``DTensor.full_tensor()`` (milliseconds; 0 without sharded parameters).
        receivers: rollout processes that received the whole update (global rank 0), None on other ranks.
        phases_ms: on global rank 0, where the publication's time went (:attr:`WeightPublisher.last_phases`);
            empty on other ranks.
        layout: on global rank 0, the update's layout (:attr:`WeightPublisher.last_layout`); None elsewhere.
    """

    duration_ms: float
    gather_ms: float
    receivers: Optional[int]
    phases_ms: Mapping[str, float] = field(default_factory=dict)
    layout: Optional[str] = None


def full_tensors(
    model: torch.nn.Module, *, dtype: Optional[torch.dtype] = None, gather_seconds: Optional[list[float]] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of ``model.state_dict()``, in its order, made one at a time.

    A DTensor (an FSDP2 shard) is cast to ``dtype`` shard by shard and then gathered with ``full_tensor()``, a
    collective: every rank of its mesh must consume this generator in step. A plain tensor (DDP, a buffer) is
    yielded as it is, detached (not cast: the publisher casts where it sends). The generator keeps no reference to
    a yielded tensor once it is asked for the next one.

    Args:
        model: the unwrapped model (FSDP2's ``fully_shard`` keeps the names; a DDP wrapper's ``module.`` prefix is
            stripped by the publisher).
        dtype: the published dtype of floating-point tensors, applied to shards before gathering (half the gather
            traffic in bf16).
        gather_seconds: a one-element list to which the time spent gathering is added (seconds).

    Raises:
        RuntimeError / DistError: a gather failed (a rank died): the gang restarts.
    """
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            started = time.perf_counter()
            shard = value.to(dtype) if dtype is not None and value.is_floating_point() else value
            full = shard.full_tensor()
            del shard
            if gather_seconds is not None:
                gather_seconds[0] += time.perf_counter() - started
        else:
            full = value
        del value
        yield name, full.detach()
        del full


def publish_weights(
    model: torch.nn.Module,
    publisher: Optional[WeightPublisher],
    *,
    step: int,
    documents_seen: int,
    dtype: Optional[torch.dtype] = None,
) -> Publication:
    """One weight publication; every trainer rank calls it, in the same place of the loop.

    Global rank 0 passes its :class:`WeightPublisher`, which sends every tensor of :func:`full_tensors` to the
    rollout; the other ranks pass None and only take part in the gathers of sharded parameters, dropping each full
    tensor at once (with DDP they return at once). See the module docstring for memory and timeouts.

    Args:
        model: the unwrapped model, the same on every rank (plain tensors or FSDP2 DTensors).
        publisher: rank 0's publisher, None on every other rank.
        step: optimizer steps done.
        documents_seen: the weights' version in documents.
        dtype: the published dtype (None: the parameters' own).

    Returns:
        What it cost on this rank (:class:`Publication`).

    Raises:
        RuntimeError / DistError: a gather failed. Transfer failures are logged by the publisher, never raised.
        rljob_trainer.fence.Fenced: (rank 0) a later gang attempt owns the job; the process must stop.
    """
    started = time.perf_counter()
    gather_seconds = [0.0]
    pairs = full_tensors(model, dtype=dtype, gather_seconds=gather_seconds)
    receivers: Optional[int] = None
    phases: dict[str, float] = {}
    layout: Optional[str] = None
    if publisher is not None:
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        tensors = [(name, tuple(value.shape), value.dtype) for name, value in model.state_dict().items()]
        receivers = publisher.publish(pairs, step=step, documents_seen=documents_seen, dtype=dtype, transient=sharded,
                                      tensors=tensors)
        phases = dict(publisher.last_phases)
        layout = publisher.last_layout
    else:
        for item in pairs:
            del item
    return Publication((time.perf_counter() - started) * 1e3, gather_seconds[0] * 1e3, receivers, phases, layout)
