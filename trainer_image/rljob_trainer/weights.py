"""Weight transfer from the trainer to the rollout workers, both sides (DESIGN §2 "Weight transfer membership",
§3 "Weight transfer").

Group: a dedicated process group outside the data-parallel world. Trainer global rank 0 is group rank 0 and
hosts a ``torch.distributed.TCPStore`` on ``config.weights_port`` (the store's server listens on every
interface; rollout workers connect to ``config.trainer_master_host``). Rollout process t of replica i has the
stable *transfer rank* ``1 + i·gpusPerReplica + t`` (:meth:`rljob_api.config.JobConfig.transfer_rank`); the
group of one update has rank 0 plus the workers that joined it, in ascending transfer-rank order, numbered
densely. Process groups are built directly on the store (``ProcessGroupGloo`` on CPU tensors,
``ProcessGroupNCCL`` on CUDA tensors), never through ``init_process_group``, so the trainer's default group
stays the data-parallel world.

Membership: each rollout process heartbeats ``HSET {prefix}members <transfer rank> <JSON>`` every
:data:`HEARTBEAT_INTERVAL_S` with ``{"time": Redis TIME in seconds, "version": loaded model_version or null,
"instance": random id of the worker process}``. A member is live while its time is less than
:data:`MEMBER_TTL_S` old (Redis's clock on both sides, so pod clocks never matter); entries older than
``10 · MEMBER_TTL_S`` are deleted by the publisher.

One update (ticket ``U``; keys under ``rljob/weights/U/`` in the store):

1. The publisher reads the live members and writes ``{"type": "weights_ready", "step", "documents_seen",
   "transfer": {"id": U, "members": [...], "backend": "gloo"|"nccl", "join_timeout_s", "timeout_s"}}`` to the
   events stream (upstream consumers ignore the extra ``transfer`` key).
2. Each invited worker sets ``ready/<transfer rank>``. The publisher waits up to ``join_timeout_s`` for them,
   then writes ``final`` = the members that are ready; a dead or busy worker costs one join timeout and is left
   out, never a hang.
3. Rank 0 and the ``final`` members build the group (collective timeout ``timeout_s``). Per tensor: an object
   broadcast of ``(shard name, parameter name, shape, dtype)``, then the tensor; an object broadcast of
   ``None`` ends the update. Object broadcasts use the layout of ``torch.distributed.broadcast_object_list``
   for one object (an int64 size tensor, then the pickled bytes as uint8), the per-tensor layout upstream's
   ``broadcast_object`` produces; receivers unpickle with an allow-list (builtins containers, ``torch.Size``,
   torch dtypes) so a stray peer cannot run code. The ready/final handshake of step 2 is rljob's own.

Late joiners: a worker that starts after an update (a restarted pod, or the initial update published before
any worker was up) would otherwise wait for the next optimizer step, which may never come if no other worker
produces data. :class:`WeightPublisher` therefore keeps a CPU copy of the last published weights and a thread
that serves every live member whose reported version differs from it (a repeated ``weights_ready`` event with
the same step and documents_seen, inviting only them).

Timeouts: ``join_timeout_s + timeout_s`` must stay below the trainer's DP collective timeout, because the other
DP ranks wait at their next collective while rank 0 transfers (DESIGN §3). A receiver lost in the middle of an
update makes rank 0's broadcast fail: over gloo at once (connection reset) or after ``timeout_s``; the update
is abandoned (the surviving receivers keep their old weights, see :func:`receive_update`) and the late-joiner
thread serves them again. Over NCCL, PyTorch's NCCL watchdog may instead end the trainer process when an
operation times out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, process-wide): a gang restart, still never a hang.
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import pickle
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import redis
import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, Store, TCPStore

from rljob_api import constants as c
from rljob_api.config import JobConfig

log = logging.getLogger(__name__)

SHARD_NAME = "weights"
"""Shard name sent with every tensor (Fast-LLM's name for the model weights shard)."""
STORE_PREFIX = "rljob/weights/"
EVENT_FIELD = "event"
"""The one field of an events-stream entry, holding the event JSON (DESIGN §3)."""
TRANSFER_KEY = "transfer"
"""Key of the ticket inside a weights_ready event (an rljob extension)."""
HEARTBEAT_INTERVAL_S = 2.0
MEMBER_TTL_S = 15.0
"""A member whose heartbeat is older than this (seconds, Redis clock) is not invited."""
FINAL_MARGIN_S = 10.0
"""A receiver waits join_timeout_s + this for the publisher's `final` list (seconds)."""
EVENTS_MAXLEN = 10_000
"""Approximate cap of the events stream (events are notifications, not data: old ones may go)."""
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# --- tickets, events, members -----------------------------------------------------------------
@dataclass(frozen=True)
class StoreAddress:
    """Where the trainer's transfer store listens: ``config.trainer_master_host:config.weights_port``."""

    host: str
    port: int


@dataclass(frozen=True)
class TransferTicket:
    """What a receiver needs to join one update; carried in the weights_ready event under ``transfer``.

    Attributes:
        id: unique per update (the store key prefix).
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
        return {**asdict(self), "members": list(self.members)}

    @classmethod
    def from_json(cls, value: Any) -> "TransferTicket":
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


def parse_event(entry_id: str, fields: dict) -> Event:
    """Parse one events-stream entry.

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
    if body["type"] == c.EVENT_TRAINING_FINISHED:
        return Event(entry_id, body["type"], step, seen)
    if body["type"] != c.EVENT_WEIGHTS_READY:
        return Event(entry_id, body["type"])
    if step is None or seen is None:
        raise ValueError(f"event {entry_id}: weights_ready needs integer step and documents_seen, got {body!r}")
    ticket = TransferTicket.from_json(body[TRANSFER_KEY]) if TRANSFER_KEY in body else None
    return Event(entry_id, body["type"], step, seen, ticket)


def _integer(value: Any) -> Optional[int]:
    """``value`` when it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class MemberInfo:
    """One heartbeat of the members hash: Redis time (s), loaded version (None: no weights), process id."""

    time: float
    version: Optional[int]
    instance: str


def encode_member(time_s: float, version: Optional[int], instance: str) -> str:
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


def redis_time(client: redis.Redis) -> float:
    """Redis's clock, seconds (the one clock both sides of the membership compare)."""
    seconds, micros = client.time()
    return seconds + micros / 1e6


# --- the wire: object and tensor broadcasts on a raw process group ---------------------------------
class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles the metadata tuples only: builtins containers/scalars, torch.Size and torch dtypes."""

    _BUILTINS = {"tuple", "list", "dict", "str", "int", "float", "bool", "NoneType"}

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"weight transfer: refusing to unpickle {module}.{name}")


def _broadcast(group: Any, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait(timeout)


def _broadcast_object(group: Any, obj: Any, *, root: bool, device: torch.device, timeout: datetime.timedelta) -> Any:
    """``broadcast_object_list([obj], src=0)`` on a raw group: int64 size tensor [1], then uint8 bytes [size]."""
    if root:
        payload = pickle.dumps(obj)
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(group, size, timeout)
    if root:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(group, data, timeout)
    if root:
        return obj
    return _AllowListUnpickler(io.BytesIO(data.cpu().numpy().tobytes())).load()


def _new_group(backend: str, store: Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return ProcessGroupGloo(store, rank, size, timeout)
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, size, options)


def _ticket_store(store: Store, ticket: TransferTicket) -> PrefixStore:
    return PrefixStore(f"{STORE_PREFIX}{ticket.id}/", store)


def _await_ready(store: Store, members: Sequence[int], timeout_s: float) -> list[int]:
    """Members whose ``ready/<rank>`` key appeared within ``timeout_s`` (ascending)."""
    deadline = time.monotonic() + timeout_s
    waiting = set(members)
    while waiting:
        waiting = {rank for rank in waiting if not store.check([f"ready/{rank}"])}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return sorted(set(members) - waiting)


def send_update(
    store: Store, ticket: TransferTicket, named_tensors: Iterable[tuple[str, torch.Tensor]], *, device: torch.device
) -> list[int]:
    """Rank 0's side of one update: wait for the invited members, then broadcast every tensor.

    Args:
        store: the trainer's transfer store (the master ``TCPStore``).
        ticket: the update, already announced on the events stream.
        named_tensors: (parameter name, tensor) pairs; consumed only when at least one member joined.
        device: where tensors are sent from (CPU for gloo, the rank's CUDA device for nccl).

    Returns:
        The transfer ranks that joined and received the whole update.

    Raises:
        RuntimeError / DistError: the group could not form or a broadcast failed (a receiver died mid-update).
    """
    scoped = _ticket_store(store, ticket)
    joined = _await_ready(scoped, ticket.members, ticket.join_timeout_s)
    scoped.set("final", json.dumps(joined))
    if not joined:
        return []
    timeout = datetime.timedelta(seconds=ticket.timeout_s)
    group = _new_group(ticket.backend, PrefixStore("pg/", scoped), 0, 1 + len(joined), timeout)
    for name, tensor in named_tensors:
        tensor = tensor.detach().to(device).contiguous()
        _broadcast_object(group, (SHARD_NAME, name, tuple(tensor.shape), tensor.dtype), root=True, device=device, timeout=timeout)
        if tensor.numel():
            _broadcast(group, tensor, timeout)
    _broadcast_object(group, None, root=True, device=device, timeout=timeout)
    return joined


class TransferFailed(RuntimeError):
    """A receiver's update did not complete. ``tensors_loaded``: how many tensors the sink had accepted."""

    def __init__(self, message: str, tensors_loaded: int) -> None:
        super().__init__(message)
        self.tensors_loaded = tensors_loaded


def connect_store(address: StoreAddress, timeout_s: float) -> TCPStore:
    """A client of the trainer's transfer store. Raises RuntimeError/DistError when it is not reachable in time."""
    return TCPStore(address.host, address.port, None, False, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def receive_update(
    address: StoreAddress,
    ticket: TransferTicket,
    transfer_rank: int,
    *,
    device: torch.device,
    sink: Callable[[str, torch.Tensor], None],
) -> bool:
    """A rollout process's side of one update: join, receive every tensor, hand each to ``sink``.

    ``sink(name, tensor)`` gets each tensor as it arrives ([shape] of the sent dtype, on ``device``). If it
    raises, the rest of the update is still received (so the other receivers are not disturbed) and the
    first error is raised at the end.

    Returns:
        True when the whole update arrived; False when this rank was not invited or was left out of the group
        (joined too late): nothing was received.

    Raises:
        TransferFailed: the store was unreachable, the group failed, or ``sink`` raised.
    """
    if transfer_rank not in ticket.members:
        return False
    loaded = 0
    sink_error: Optional[BaseException] = None
    timeout = datetime.timedelta(seconds=ticket.timeout_s)
    try:
        # The publisher writes `final` at most join_timeout_s after announcing, and it is there for good after.
        scoped = _ticket_store(connect_store(address, ticket.join_timeout_s), ticket)
        scoped.set(f"ready/{transfer_rank}", b"1")
        scoped.wait(["final"], datetime.timedelta(seconds=ticket.join_timeout_s + FINAL_MARGIN_S))
        final = json.loads(scoped.get("final"))
        if transfer_rank not in final:
            return False
        rank = 1 + final.index(transfer_rank)
        group = _new_group(ticket.backend, PrefixStore("pg/", scoped), rank, 1 + len(final), timeout)
        while True:
            meta = _broadcast_object(group, None, root=False, device=device, timeout=timeout)
            if meta is None:
                break
            _shard, name, shape, dtype = meta
            tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
            if tensor.numel():
                _broadcast(group, tensor, timeout)
            if sink_error is None:
                try:
                    sink(name, tensor)
                    loaded += 1
                except Exception as error:  # noqa: BLE001 - reported after the update is drained
                    sink_error = error
    except Exception as error:  # noqa: BLE001 - store/gloo/NCCL errors come in many classes
        raise TransferFailed(f"weight update {ticket.id} as transfer rank {transfer_rank} failed: {error}", loaded) from error
    if sink_error is not None:
        raise TransferFailed(f"weight update {ticket.id}: loading failed: {sink_error}", loaded) from sink_error
    return True


def unwrapped_name(name: str) -> str:
    """A parameter name without DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


# --- trainer side -------------------------------------------------------------------------------
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
        from an earlier attempt's end (:class:`rljob_trainer.rollout.worker.RolloutWorker`).

        Raises:
            redis.RedisError: Redis unreachable (after the client's own retries).
        """
        event = {"type": c.EVENT_TRAINING_FINISHED, "step": step, "documents_seen": documents_seen}
        self._client.xadd(self._keys.events, {EVENT_FIELD: json.dumps(event)}, maxlen=EVENTS_MAXLEN, approximate=True)

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
        event = {"type": c.EVENT_WEIGHTS_READY, "step": step, "documents_seen": documents_seen, TRANSFER_KEY: ticket.to_json()}
        try:
            self._client.xadd(self._keys.events, {EVENT_FIELD: json.dumps(event)}, maxlen=EVENTS_MAXLEN, approximate=True)
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


# --- rollout side ---------------------------------------------------------------------------------
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
    """

    config: JobConfig
    client: redis.Redis
    replica_index: int
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    version: Optional[int] = None

    def __post_init__(self) -> None:
        per_replica = max(1, self.config.spec.rollout.gpus_per_replica)
        self.transfer_ranks = tuple(self.config.transfer_rank(self.replica_index, t) for t in range(per_replica))
        self.address = StoreAddress(self.config.trainer_master_host, self.config.weights_port)
        self._cursor: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def heartbeat(self) -> None:
        """One heartbeat for every transfer rank of this pod. Raises redis.RedisError when Redis is down."""
        value = encode_member(redis_time(self.client), self.version, self.instance)
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
        self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
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
                entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._cursor = entry_id
                try:
                    events.append(parse_event(entry_id, fields))
                except ValueError as error:
                    log.warning("weights: skipping malformed event: %s", error)
        return events
