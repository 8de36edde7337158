"""The weight-transfer wire, both ends (DESIGN §3 "Weight transfer"): the ready/final handshake on the trainer's store,
the transfer group and the object/tensor broadcasts. The trainer's :class:`rljob_trainer.weight_publisher.WeightPublisher`
sends with :func:`open_update` (:class:`UpdateSender`) or :func:`send_update`; a rollout backend receives with
:func:`receive_update`. The events and heartbeats that announce updates are in :mod:`rljob_api.protocol`.

Group: a dedicated process group outside the data-parallel world. Trainer global rank 0 is group rank 0 and
hosts a ``torch.distributed.TCPStore`` on ``config.weights_port`` (the store's server listens on every
interface; rollout workers connect to ``config.trainer_master_host``). Rollout process t of replica i has the
stable *transfer rank* ``1 + i·gpusPerReplica + t`` (:meth:`rljob_api.config.JobConfig.transfer_rank`); a group
has rank 0 plus the workers that joined the update that formed it, in ascending transfer-rank order, numbered
densely. Process groups are built directly on the store (``ProcessGroupGloo`` on CPU tensors,
``ProcessGroupNCCL`` on CUDA tensors), never through ``init_process_group``, so the trainer's default group
stays the data-parallel world.

One update (ticket ``U``; keys under ``rljob/weights/U/`` in the store), after the publisher announced it with a
weights_ready event carrying the ticket:

1. Each invited worker sets ``ready/<transfer rank>`` to JSON ``{"group": G}``: the id of the group it kept from
   its last complete update (null when none; any other value, such as an older receiver's ``1``, counts as none).
   The publisher waits up to ``join_timeout_s`` for them; a dead or busy worker costs one join timeout and is
   left out, never a hang.
2. The publisher writes ``group`` and then ``final`` = the members that are ready (a JSON list). It reuses the
   group it kept when ``final`` equals that group's members and every one of them reported its id: ``group`` is
   then that id. Otherwise (a member joined or left, a receiver or the publisher restarted or failed an update)
   both ends drop what they kept, ``group`` is ``U``, and rank 0 and the ``final`` members form a new group on the
   keys ``rljob/weights/U/pg/`` (collective timeout ``timeout_s``). A receiver that reads no ``group`` (an older
   publisher) forms the new group as well. When nobody joined, ``final`` is empty, no ``group`` is written and every
   end keeps what it kept.
3. Per tensor: an object broadcast of ``(shard name, parameter name, shape, dtype)``, then the tensor; an object
   broadcast of ``None`` ends the update. Object broadcasts use the layout of
   ``torch.distributed.broadcast_object_list`` for one object (an int64 size tensor, then the pickled bytes as
   uint8), the per-tensor layout upstream's ``broadcast_object`` produces; receivers unpickle with an allow-list
   (builtins containers, ``torch.Size``, torch dtypes) so a stray peer cannot run code.
4. Each end keeps the group (:class:`GroupKeeper`) once its side of the update is complete: every broadcast
   done, ``None`` included. After a failure it is dropped. Both ends ran the same broadcasts on a kept group, so
   a group that every member and rank 0 kept is in step; the ids in ``ready`` make sure no one reuses a group
   that another end dropped.

The ready/final/group handshake is rljob's own; upstream (Fast-LLM, PipelineRL) forms one group of a fixed size
at the trainer's start and keeps it, which is what a kept group does while the members stay the same.

Speed without changing those bytes (docs/weight-sync.md): the group is kept while the members stay the same (no
rendezvous and no teardown per update); rank 0 writes step 2's keys in one round trip and a receiver reads them in
one, through a store client it keeps across updates (:meth:`GroupKeeper.client`); the sender queues each tensor's
three broadcasts without waiting, two tensors ahead (:class:`UpdateSender`); a receiver reads the next tensor's
metadata and posts its broadcast while the previous tensor is still arriving, and may receive into buffers it keeps
across updates (:class:`ReceiveBuffers`), since fresh memory costs page faults on every update. The ticket's
``timeout_s`` (the publisher's ``transfer_timeout_s``) bounds a whole update on rank 0
(:attr:`UpdateSender.deadline`), not each broadcast, so that the other data-parallel ranks, which wait for rank 0
meanwhile, wait at most ``join_timeout_s + timeout_s`` (DESIGN §3); a receiver allows ``timeout_s`` per broadcast.
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import redis
import torch
from torch.distributed import BroadcastOptions, DistNetworkError, PrefixStore, ProcessGroupGloo, Store, TCPStore

from rljob_api.protocol import TransferTicket
from rljob_wire.packed import LAYOUT_PACKED, LAYOUT_PER_TENSOR, LAYOUTS, BucketBuffers, Manifest, view

SHARD_NAME = "weights"
"""Shard name sent with every tensor (Fast-LLM's name for the model weights shard)."""
STORE_PREFIX = "rljob/weights/"
GROUP_KEY = "group"
"""The key under an update's prefix naming the group it goes over (step 2 of the module docstring)."""
LAYOUT_KEY = "layout"
"""The key under an update's prefix naming its layout (step 2; none: per-tensor)."""
FINAL_MARGIN_S = 10.0
"""A receiver waits join_timeout_s + this for the publisher's `final` list (seconds)."""
READY_POLL_S = 0.05
"""How often rank 0's wait for ready members checks whether it was cancelled (seconds)."""
IN_FLIGHT = 2
"""Tensors rank 0 keeps on the wire at once (:class:`UpdateSender`)."""
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class StoreAddress:
    """Where the trainer's transfer store listens: ``config.trainer_master_host:config.weights_port``."""

    host: str
    port: int



def redis_time(client: redis.Redis) -> float:
    """Redis's clock, seconds (the one clock both sides of the membership compare)."""
    return time_seconds(client.time())


def time_seconds(reply: tuple[int, int]) -> float:
    """Seconds of a TIME reply ``(seconds, microseconds)`` (redis-py's parsed form, also from a pipeline)."""
    seconds, micros = reply
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


def _start_broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast of ``tensor`` (contiguous, on the group's device) from group rank 0; returns its Work."""
    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def _wait(work: Any, seconds: float) -> None:
    """Wait for ``work`` at most ``seconds``. Raises TimeoutError when none are left; RuntimeError / DistError when the
    broadcast failed or timed out."""
    if seconds <= 0:
        raise TimeoutError("weight transfer: the update ran out of time")
    work.wait(datetime.timedelta(seconds=seconds))


def _object_tensors(obj: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``broadcast_object_list([obj], src=0)`` sends for ``obj``: int64 [1] = n, then uint8 [n] = the pickle."""
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    return size.to(device), torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _receive_object(group: Any, size: torch.Tensor, size_work: Any, *, device: torch.device, seconds: float) -> Any:
    """The rest of an object broadcast whose size broadcast (``size``, int64 [1]) was started as ``size_work``."""
    _wait(size_work, seconds)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _wait(_start_broadcast(group, data), seconds)
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


@dataclass(frozen=True)
class KeptGroup:
    """A transfer group one end kept after a complete update (module docstring, step 4).

    Attributes:
        id: the ticket id of the update that formed it (its rendezvous keys are ``rljob/weights/<id>/pg/``).
        members: the receivers' transfer ranks, ascending (group ranks 1, 2, ...).
        group: the process group (``ProcessGroupGloo`` or ``ProcessGroupNCCL``).
    """

    id: str
    members: tuple[int, ...]
    group: Any


class GroupKeeper:
    """Where one end of the transfer keeps its group between updates: at most one per backend (``gloo``, ``nccl``),
    and on a receiver its client of the trainer's store (:meth:`client`).

    :func:`open_update` and :func:`receive_update` take the group out for the length of an update and put it back
    only when their side of it completed, so a group that failed is dropped (and destroyed with its last reference).
    One update at a time per keeper (not thread-safe).
    """

    def __init__(self) -> None:
        self._kept: dict[str, KeptGroup] = {}
        self._client: Optional[tuple[StoreAddress, TCPStore]] = None

    def client(self, address: StoreAddress, timeout_s: float) -> TCPStore:
        """A client of the trainer's store at ``address``, connected once and kept for the next updates (a connection
        costs a round trip and the server's accept on every update otherwise). ``timeout_s``: its connect and default
        wait timeout (seconds). Raises RuntimeError/DistError when the store is not reachable in time."""
        kept = self.kept_client(address)
        if kept is None:
            self._client = None
            kept = connect_store(address, timeout_s)
            self._client = (address, kept)
        return kept

    def kept_client(self, address: StoreAddress) -> Optional[TCPStore]:
        """The client of ``address`` kept from an earlier update, or None."""
        return self._client[1] if self._client is not None and self._client[0] == address else None

    def forget_client(self) -> None:
        """Drop the kept client (after a failure: the store may have restarted, with a new trainer)."""
        self._client = None

    def take(self, backend: str) -> Optional[KeptGroup]:
        """Remove and return the group kept for ``backend`` (None when there is none)."""
        return self._kept.pop(backend, None)

    def keep(self, backend: str, kept: KeptGroup) -> None:
        """Keep ``kept`` for the next update over ``backend`` (drops the one kept before, if any)."""
        self._kept.pop(backend, None)
        self._kept[backend] = kept

    def kept_id(self, backend: str) -> Optional[str]:
        """The id of the group kept for ``backend``, or None."""
        kept = self._kept.get(backend)
        return kept.id if kept is not None else None

    def close(self) -> None:
        """Drop every kept group and the kept client."""
        self._kept.clear()
        self._client = None


def _ready_value(kept: Optional[KeptGroup], layouts: Sequence[str]) -> str:
    return json.dumps({GROUP_KEY: kept.id if kept is not None else None, "layouts": list(layouts)})


def _ready_body(value: bytes) -> dict[str, Any]:
    try:
        body = json.loads(value)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _reported_group(value: bytes) -> Optional[str]:
    """The group id a ``ready/<rank>`` value reports; None for none or for a value of another form (an older
    receiver's ``1``)."""
    group = _ready_body(value).get(GROUP_KEY)
    return group if isinstance(group, str) else None


def _reported_layouts(value: bytes) -> set[str]:
    """The layouts a ``ready/<rank>`` value says its receiver reads beyond per-tensor (none: an older receiver)."""
    layouts = _ready_body(value).get("layouts")
    return {x for x in layouts if isinstance(x, str)} if isinstance(layouts, list) else set()


def _await_ready(
    store: Store, members: Sequence[int], timeout_s: float, cancelled: Optional[Callable[[], bool]] = None
) -> list[int]:
    """Members whose ``ready/<rank>`` key appeared within ``timeout_s`` (ascending); returns as soon as every member
    is ready, or early (with those ready so far) once ``cancelled()`` is true (checked every ``READY_POLL_S``)."""
    deadline = time.monotonic() + timeout_s
    waiting = {rank: f"ready/{rank}" for rank in members}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0 or (cancelled is not None and cancelled()):
            break
        try:
            store.wait(list(waiting.values()), datetime.timedelta(seconds=min(left, READY_POLL_S)))
            waiting = {}
        except RuntimeError:  # DistStoreError: not all of them yet
            waiting = {rank: key for rank, key in waiting.items() if not store.check([key])}
    return sorted(set(members) - set(waiting))


class UpdateSender:
    """Rank 0's end of one update: sends (name, tensor) pairs in the update's layout (:attr:`layout`). Made by
    :func:`open_update`.

    Per-tensor (module docstring, step 3): :meth:`send` starts a tensor's three broadcasts (size, pickled ``(shard,
    name, shape, dtype)``, the tensor) and returns once at most :data:`IN_FLIGHT` tensors are still on the wire: the
    next tensor's broadcasts are queued before the previous one has arrived, so the receiver never waits for rank 0's
    main thread (on a busy machine each such wait costs a scheduling delay). The tensors in flight must stay alive and
    unchanged until :meth:`send` has returned :data:`IN_FLIGHT` more times, or :meth:`wait` or :meth:`finish` has
    returned: send tensors that cost no extra memory (the model's own, or late-joiner buffers), or call :meth:`wait`
    after each.

    Packed (:mod:`rljob_wire.packed`): the manifest goes out when the sender is made; :meth:`send` takes the tensors
    in the manifest's order and copies (casts) each into its bucket, kept in two :class:`~rljob_wire.packed.BucketBuffers`
    slots, and starts a bucket's broadcast once its last tensor is in; before a slot is written again the bucket it
    held has arrived, so at most two buckets are in flight and the sent tensors may change as soon as :meth:`send`
    returns. A tensor larger than a bucket, or one filling a bucket of its own that needs no cast, is sent from its
    own memory and must stay alive and unchanged like a per-tensor one.

    Attributes:
        joined: the transfer ranks in the group (ascending; group ranks 1, 2, ...).
        reused: whether the update goes over a group kept from an earlier update (False: formed for it).
        layout: ``packed`` or ``per-tensor``.
        join_s: seconds :func:`open_update` waited for the invited members (step 1 of the module docstring).
        deadline: ``time.monotonic()`` value past which every wait raises TimeoutError: ``ticket.timeout_s`` after
            the group began to form. Broadcasts are started with the time left as their timeout, so none outlives
            it (dropping the group after a failure waits for what is in flight).

    Raises (every method): TimeoutError past the deadline; RuntimeError / DistError when a broadcast failed (a
    receiver died); ValueError (packed) when a tensor is not the manifest's next one, or :meth:`finish` comes before
    the last. After an error the update is lost: drop the sender.
    """

    def __init__(
        self,
        kept: KeptGroup,
        device: torch.device,
        deadline: float,
        *,
        reused: bool = False,
        keeper: Optional[GroupKeeper] = None,
        backend: str = "gloo",
        manifest: Optional[Manifest] = None,
        staging: Optional[BucketBuffers] = None,
    ) -> None:
        self.joined = list(kept.members)
        self.deadline = deadline
        self.reused = reused
        self.layout = LAYOUT_PACKED if manifest is not None else LAYOUT_PER_TENSOR
        self.join_s = 0.0
        self._kept = kept
        self._group = kept.group
        self._device = device
        self._keeper = keeper
        self._backend = backend
        self._in_flight: collections.deque[list[tuple[Any, torch.Tensor]]] = collections.deque()
        self._manifest = manifest
        self._staging = staging if staging is not None else BucketBuffers()
        self._next = 0  # the manifest's entry to send next
        self._bucket: Optional[torch.Tensor] = None  # the staged bucket being filled
        if manifest is not None:
            self._in_flight.append(self._start_object(manifest.to_wire()))

    def send(self, name: str, tensor: torch.Tensor) -> None:
        """Send one tensor (contiguous, on the sender's device; [shape] of any dtype) under ``name``."""
        if self._manifest is not None:
            self._pack(name, tensor)
            return
        started = self._start_object((SHARD_NAME, name, tuple(tensor.shape), tensor.dtype))
        if tensor.numel():
            started.append(self._start(tensor))
        self._push(started)

    def wait(self) -> None:
        """Return once every broadcast started so far is complete."""
        while self._in_flight:
            self._wait_oldest()
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()  # NCCL's wait only orders the streams

    def finish(self) -> None:
        """End the update (per-tensor: the ``None`` object), then wait for everything; the group is then kept for the
        next update (with a ``keeper``)."""
        if self._manifest is None:
            self._in_flight.append(self._start_object(None))
        elif self._next < len(self._manifest.entries):
            raise ValueError(f"packed weight transfer: finished after {self._next} of "
                             f"{len(self._manifest.entries)} tensors (next: {self._manifest.entries[self._next].name})")
        self.wait()
        if self._keeper is not None:
            self._keeper.keep(self._backend, self._kept)

    def _pack(self, name: str, tensor: torch.Tensor) -> None:
        manifest = self._manifest
        assert manifest is not None
        if self._next >= len(manifest.entries) or manifest.entries[self._next].name != name:
            expected = manifest.entries[self._next].name if self._next < len(manifest.entries) else "none"
            raise ValueError(f"packed weight transfer: got tensor {name!r}, the manifest's next is {expected}")
        entry = manifest.entries[self._next]
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"packed weight transfer: {name} has shape {tuple(tensor.shape)}, the manifest "
                             f"{entry.shape}")
        self._next += 1
        if manifest.alone(entry.bucket) is not None:
            outgoing = tensor.to(device=self._device, dtype=entry.dtype).contiguous()
            self._push([self._start(outgoing)])
            return
        if manifest.sole(entry.bucket) is not None and tensor.dtype == entry.dtype and tensor.is_contiguous() and (
                tensor.device == self._device):
            while len(self._in_flight) > 1:  # at most two buckets in flight, as with staged ones
                self._wait_oldest()
            self._push([self._start(tensor.reshape(-1).view(torch.uint8))])  # its own memory: no copy
            return
        entries = manifest.in_bucket(entry.bucket)
        if entry is entries[0]:
            while len(self._in_flight) > 1:  # the bucket that last used this slot has arrived
                self._wait_oldest()
            self._bucket = self._staging.get(entry.bucket, manifest.bucket_sizes[entry.bucket], self._device)
        assert self._bucket is not None
        view(self._bucket, entry).copy_(tensor)
        if entry is entries[-1]:
            bucket, self._bucket = self._bucket, None
            self._push([self._start(bucket)] if bucket.numel() else [])

    def _push(self, started: list[tuple[Any, torch.Tensor]]) -> None:
        self._in_flight.append(started)
        while len(self._in_flight) > IN_FLIGHT:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        for work, _tensor in self._in_flight.popleft():
            _wait(work, self.deadline - time.monotonic())

    def _start_object(self, obj: Any) -> list[tuple[Any, torch.Tensor]]:
        size, payload = _object_tensors(obj, self._device)
        return [self._start(size), self._start(payload)]

    def _start(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        left = max(self.deadline - time.monotonic(), 1e-3)
        self._group.set_timeout(datetime.timedelta(seconds=left))
        return _start_broadcast(self._group, tensor), tensor


def open_update(
    store: Store,
    ticket: TransferTicket,
    *,
    device: torch.device,
    cancelled: Optional[Callable[[], bool]] = None,
    groups: Optional[GroupKeeper] = None,
    manifest: Optional[Manifest] = None,
    staging: Optional[BucketBuffers] = None,
) -> Optional[UpdateSender]:
    """Rank 0's start of one update: wait for the invited members, write ``group``, ``layout`` and ``final``, reuse the
    kept group or form a new one (module docstring, steps 1-2).

    Args:
        store: the trainer's transfer store (the master ``TCPStore``).
        ticket: the update, already announced on the events stream.
        device: where tensors are sent from (CPU for gloo, the rank's CUDA device for nccl).
        cancelled: polled while waiting for members; once true, nobody more is waited for.
        groups: where rank 0 keeps its groups between updates (None: a new group for every update, dropped after).
            The group is taken out here and kept again by :meth:`UpdateSender.finish`.
        manifest: the update's packed manifest (:func:`rljob_wire.packed.plan` of the tensors to be sent): the update
            is packed when the ticket plans it (``ticket.layout``) and every member that joined says it reads packed
            in its ready record; per-tensor otherwise (an older receiver says nothing).
        staging: rank 0's bucket buffers, kept across updates (None: new ones for this update).

    Returns:
        The sender, or None when no member joined (or ``cancelled`` came first): ``final`` is then empty and a kept
        group stays kept.

    Raises:
        RuntimeError / DistError: the store failed or the group could not form.
    """
    started = time.monotonic()
    scoped = _ticket_store(store, ticket)
    kept = groups.take(ticket.backend) if groups is not None else None
    joined = _await_ready(scoped, ticket.members, ticket.join_timeout_s, cancelled)
    if cancelled is not None and cancelled():
        joined = []
    if not joined:
        scoped.set("final", json.dumps(joined))
        if kept is not None and groups is not None:
            groups.keep(ticket.backend, kept)  # nobody used it: still in step
        return None
    ready_at = time.monotonic()
    deadline = ready_at + ticket.timeout_s
    values = scoped.multi_get([f"ready/{rank}" for rank in joined])
    reported = {_reported_group(value) for value in values}
    reused = kept is not None and kept.members == tuple(joined) and reported == {kept.id}
    if not reused:
        kept = None  # the members changed: drop the old group before the new one forms
    packed = (manifest is not None and ticket.layout == LAYOUT_PACKED
              and all(LAYOUT_PACKED in _reported_layouts(value) for value in values))
    # One round trip; the server sets the keys in this order, so a receiver woken by `final` reads the other two.
    group_id, layout = kept.id if kept is not None else ticket.id, LAYOUT_PACKED if packed else LAYOUT_PER_TENSOR
    scoped.multi_set([GROUP_KEY, LAYOUT_KEY, "final"], [group_id, layout, json.dumps(joined)])
    if kept is None:
        timeout = datetime.timedelta(seconds=ticket.timeout_s)
        kept = KeptGroup(ticket.id, tuple(joined), _new_group(ticket.backend, PrefixStore("pg/", scoped), 0, 1 + len(joined), timeout))
    sender = UpdateSender(kept, device, deadline, reused=reused, keeper=groups, backend=ticket.backend,
                          manifest=manifest if packed else None, staging=staging)
    sender.join_s = ready_at - started
    return sender


def send_update(
    store: Store,
    ticket: TransferTicket,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device,
    cancelled: Optional[Callable[[], bool]] = None,
    groups: Optional[GroupKeeper] = None,
    manifest: Optional[Manifest] = None,
    staging: Optional[BucketBuffers] = None,
) -> list[int]:
    """Rank 0's side of one whole update (:func:`open_update`, then every tensor, then the end).

    Args:
        store, ticket, device, groups, manifest, staging: as :func:`open_update`.
        named_tensors: (parameter name, tensor) pairs; consumed only when at least one member joined; each is
            moved to ``device`` (at most two exist at once: the one in flight and the next).
        cancelled: checked while waiting for members and before each tensor; once true the update is abandoned.

    Returns:
        The transfer ranks that joined and received the whole update.

    Raises:
        TransferCancelled: ``cancelled()`` became true after the group formed (the receivers' updates fail).
        TimeoutError: the update took longer than ``ticket.timeout_s``.
        RuntimeError / DistError: the group could not form or a broadcast failed (a receiver died mid-update).
    """
    sender = open_update(store, ticket, device=device, cancelled=cancelled, groups=groups, manifest=manifest,
                         staging=staging)
    if sender is None:
        return []
    for name, tensor in named_tensors:
        if cancelled is not None and cancelled():
            raise TransferCancelled(f"weight update {ticket.id} cancelled")
        sender.send(name, tensor.detach().to(device).contiguous())
    sender.finish()
    return sender.joined


class TransferCancelled(RuntimeError):
    """An update was abandoned on purpose (:func:`send_update`'s ``cancelled``)."""


class TransferFailed(RuntimeError):
    """A receiver's update did not complete. ``tensors_loaded``: how many tensors the sink had accepted."""

    def __init__(self, message: str, tensors_loaded: int) -> None:
        super().__init__(message)
        self.tensors_loaded = tensors_loaded


class ReceiveBuffers:
    """Tensors a receiver keeps across updates and receives into: one per parameter name, replaced when the
    name's shape, dtype or device changes (the old one is dropped first, so a name never holds two).

    Fresh memory is slow on some machines (every page faults on first touch; measured in docs/weight-sync.md), so
    a receiver that stages a whole update before loading it (the CPU backend) saves that on every update, at the
    price of keeping one copy of the model's published tensors between updates (:attr:`nbytes`). A tensor handed
    to the sink is overwritten by the next update that uses the same buffers: a sink that keeps tensors across
    updates must copy them.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer of ``name``: [shape] of ``dtype`` on ``device``, contents undefined."""
        tensor = self._tensors.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype or tensor.device != torch.device(device):
            self._tensors.pop(name, None)
            del tensor  # freed before its replacement is allocated
            tensor = self._tensors[name] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return tensor

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) of every buffer, in the order the names were first received."""
        return list(self._tensors.items())

    @property
    def nbytes(self) -> int:
        """Bytes held by every buffer."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


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
    buffers: Optional[ReceiveBuffers] = None,
    groups: Optional[GroupKeeper] = None,
    staging: Optional[BucketBuffers] = None,
    layouts: Sequence[str] = LAYOUTS,
) -> bool:
    """A rollout process's side of one update: join, receive every tensor, hand each to ``sink``.

    ``sink(name, tensor)`` gets each tensor once it has arrived, in the order sent ([shape] of the sent dtype, on
    ``device``): in a packed update received with a ``whole`` ``staging`` (:class:`~rljob_wire.packed.BucketBuffers`),
    a view into its bucket, valid until the next update (a tensor sent alone: ``buffers``' buffer, if given); else
    with ``buffers`` that name's buffer (overwritten by the next update, see :class:`ReceiveBuffers`); else, in a
    packed update received with two-slot ``staging``, a view into a kept bucket buffer that is valid only until
    ``sink`` returns; else a tensor of its own. The receive of the next tensor (per-tensor: after reading its
    metadata) or bucket (packed) is posted before the current one is waited for (gloo sends a tensor only once its
    receiver has posted it), so without ``buffers`` two received tensors or buckets exist at once. If ``sink`` raises,
    the rest of the update is still received (so the other receivers are not disturbed) and the first error is raised
    at the end. Each broadcast may take ``ticket.timeout_s`` (seconds). With ``groups``, the group is kept after an
    update whose every broadcast arrived (a ``sink`` error included) and reused when the publisher says so (module
    docstring, steps 2 and 4); without, every update forms its own group. ``layouts``: what the ready record says
    this receiver reads (:data:`rljob_wire.packed.LAYOUTS`; () as an older receiver: per-tensor only).

    Returns:
        True when the whole update arrived; False when this rank was not invited or was left out of the group
        (joined too late): nothing was received.

    Raises:
        TransferFailed: the store was unreachable, the group failed, the manifest was malformed, or ``sink`` raised.
    """
    if transfer_rank not in ticket.members:
        return False
    kept = groups.take(ticket.backend) if groups is not None else None  # kept again only if this update completes
    loaded = 0
    sink_error: Optional[BaseException] = None
    seconds = ticket.timeout_s

    def deliver(name: str, tensor: torch.Tensor) -> None:
        nonlocal loaded, sink_error
        if sink_error is None:
            try:
                sink(name, tensor)
                loaded += 1
            except Exception as error:  # noqa: BLE001 - reported after the update is drained
                sink_error = error

    try:
        scoped = _await_final(address, ticket, transfer_rank, _ready_value(kept, layouts), groups)
        final, group_id, layout = _read_final(scoped, ticket)
        if transfer_rank not in final:
            if not final and kept is not None and groups is not None:
                groups.keep(ticket.backend, kept)  # nobody joined: rank 0 kept its group too
            return False
        if layout not in layouts and layout != LAYOUT_PER_TENSOR:
            raise RuntimeError(f"the publisher sends layout {layout!r}, which this receiver did not announce")
        if kept is not None and kept.id == group_id and kept.members == tuple(final):
            kept.group.set_timeout(datetime.timedelta(seconds=seconds))
        elif group_id != ticket.id:
            raise RuntimeError(f"the publisher reuses group {group_id}, which this receiver does not hold")
        else:
            kept = None  # drop the old group before the new one forms
            timeout = datetime.timedelta(seconds=seconds)
            rank = 1 + final.index(transfer_rank)
            kept = KeptGroup(ticket.id, tuple(final), _new_group(ticket.backend, PrefixStore("pg/", scoped), rank, 1 + len(final), timeout))
        if layout == LAYOUT_PACKED:
            _receive_packed(kept.group, device, seconds, deliver, buffers, staging)
        else:
            _receive_per_tensor(kept.group, device, seconds, deliver, buffers)
    except Exception as error:  # noqa: BLE001 - store/gloo/NCCL errors come in many classes
        if groups is not None:
            groups.forget_client()
        raise TransferFailed(f"weight update {ticket.id} as transfer rank {transfer_rank} failed: {error}", loaded) from error
    if groups is not None:
        groups.keep(ticket.backend, kept)
    if sink_error is not None:
        raise TransferFailed(f"weight update {ticket.id}: loading failed: {sink_error}", loaded) from sink_error
    return True


def _await_final(address: StoreAddress, ticket: TransferTicket, transfer_rank: int, value: str,
                 groups: Optional[GroupKeeper]) -> PrefixStore:
    """A receiver's steps 1-2 (module docstring): set ``ready/<transfer rank>`` of ``ticket`` to ``value`` and wait for
    ``final`` (the publisher writes it at most ``join_timeout_s`` after announcing, and it stays). Goes through the
    keeper's client (a new one without a keeper); a kept one that turns out dead (its trainer restarted: a new store on
    the same address; a set has no reply, so the wait finds out) is replaced once, a new one is not retried. Returns
    the ticket's view of the store.

    Raises:
        RuntimeError / DistError: the store is not reachable within ``ticket.join_timeout_s``, or ``final`` did not
            come within ``join_timeout_s`` + :data:`FINAL_MARGIN_S`.
    """
    def join(client: TCPStore) -> PrefixStore:
        scoped = _ticket_store(client, ticket)
        scoped.set(f"ready/{transfer_rank}", value)
        scoped.wait(["final"], datetime.timedelta(seconds=ticket.join_timeout_s + FINAL_MARGIN_S))
        return scoped

    if groups is None:
        return join(connect_store(address, ticket.join_timeout_s))
    kept = groups.kept_client(address)
    try:
        return join(groups.client(address, ticket.join_timeout_s))
    except DistNetworkError:
        groups.forget_client()
        if kept is None:  # a new connection failed: the store is down, not replaced
            raise
    return join(groups.client(address, ticket.join_timeout_s))


def _read_final(scoped: PrefixStore, ticket: TransferTicket) -> tuple[list[int], str, str]:
    """``final``, ``group`` and ``layout`` of an update whose ``final`` is set (step 2 of the module docstring): one
    round trip when the publisher wrote all three. ``group`` is absent when nobody joined, or both from an older
    publisher: the ticket's own id and per-tensor then."""
    keys = ["final", GROUP_KEY, LAYOUT_KEY]
    if scoped.check(keys[1:]):
        values: list[Optional[bytes]] = list(scoped.multi_get(keys))
    else:
        values = [scoped.get(key) if key == "final" or scoped.check([key]) else None for key in keys]
    final_value, group_value, layout_value = values
    assert final_value is not None
    return (json.loads(final_value), group_value.decode() if group_value is not None else ticket.id,
            layout_value.decode() if layout_value is not None else LAYOUT_PER_TENSOR)


def _receive_per_tensor(group: Any, device: torch.device, seconds: float, deliver: Callable[[str, torch.Tensor], None],
                        buffers: Optional[ReceiveBuffers]) -> None:
    """The broadcasts of a per-tensor update (module docstring, step 3), each tensor handed to ``deliver``."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    size_work = _start_broadcast(group, size)
    arriving: Optional[tuple[str, torch.Tensor, Any]] = None  # (name, tensor, its Work) still on the wire
    while True:
        # The next object's metadata is read while the previous tensor may still arrive, so its tensor's
        # broadcast is posted as soon as the sender can send it.
        meta = _receive_object(group, size, size_work, device=device, seconds=seconds)
        incoming = None
        if meta is not None:
            _shard, name, shape, dtype = meta
            if buffers is not None:
                tensor = buffers.get(name, shape, dtype, device)
            else:
                tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
            incoming = (name, tensor, _start_broadcast(group, tensor) if tensor.numel() else None)
            size = torch.zeros(1, dtype=torch.int64, device=device)  # the next object's size
            size_work = _start_broadcast(group, size)
        if arriving is not None:
            arrived_name, arrived, work = arriving
            if work is not None:
                _wait(work, seconds)
            deliver(arrived_name, arrived)
        if incoming is None:
            return
        arriving = incoming


def _receive_packed(group: Any, device: torch.device, seconds: float, deliver: Callable[[str, torch.Tensor], None],
                    buffers: Optional[ReceiveBuffers], staging: Optional[BucketBuffers]) -> None:
    """The broadcasts of a packed update (:mod:`rljob_wire.packed`): the manifest, then every bucket, the next two
    posted ahead; each tensor handed to ``deliver`` (see :func:`receive_update` for which memory)."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    try:
        manifest = Manifest.from_wire(_receive_object(group, size, _start_broadcast(group, size), device=device,
                                                      seconds=seconds))
    except pickle.UnpicklingError as error:
        raise ValueError(f"packed weight transfer: malformed manifest ({error})") from None
    posted: dict[int, tuple[torch.Tensor, Any]] = {}

    direct = buffers is not None and not (staging is not None and staging.whole)  # each tensor into its buffer

    def post(bucket: int) -> None:
        alone, sole = manifest.alone(bucket), manifest.sole(bucket)
        nbytes = manifest.bucket_sizes[bucket]
        if alone is not None:
            target = (buffers.get(alone.name, alone.shape, alone.dtype, device) if buffers is not None
                      else torch.empty(alone.shape, dtype=alone.dtype, device=device))
        elif sole is not None and direct:
            assert buffers is not None
            target = buffers.get(sole.name, sole.shape, sole.dtype, device).reshape(-1).view(torch.uint8)  # no copy
        elif staging is not None:
            target = staging.get(bucket, nbytes, device)
        else:
            target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        posted[bucket] = (target, _start_broadcast(group, target) if nbytes else None)

    buckets = len(manifest.bucket_sizes)
    for bucket in range(min(2, buckets)):
        post(bucket)
    for bucket in range(buckets):
        target, work = posted.pop(bucket)
        if work is not None:
            _wait(work, seconds)
        sole = manifest.sole(bucket)
        if manifest.alone(bucket) is not None:
            deliver(manifest.alone(bucket).name, target)
        elif sole is not None and direct:
            deliver(sole.name, target.view(sole.dtype).view(sole.shape))
        else:
            for entry in manifest.in_bucket(bucket):
                tensor = view(target, entry)
                if direct:
                    assert buffers is not None
                    tensor = buffers.get(entry.name, entry.shape, entry.dtype, device).copy_(tensor)
                deliver(entry.name, tensor)
        if bucket + 2 < buckets:
            post(bucket + 2)  # into the slot just read


def unwrapped_name(name: str) -> str:
    """A parameter name without DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name
