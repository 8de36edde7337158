"""The weight-transfer wire, both ends (DESIGN §3 "Weight transfer"): the group of one update, the ready/final
handshake on the trainer's store and the object/tensor broadcasts. The trainer's :class:`rljob_trainer.weights.
WeightPublisher` sends with :func:`send_update`; a rollout backend receives with :func:`receive_update`. The events
and heartbeats that announce updates are in :mod:`rljob_api.protocol`.

Group: a dedicated process group outside the data-parallel world. Trainer global rank 0 is group rank 0 and
hosts a ``torch.distributed.TCPStore`` on ``config.weights_port`` (the store's server listens on every
interface; rollout workers connect to ``config.trainer_master_host``). Rollout process t of replica i has the
stable *transfer rank* ``1 + i·gpusPerReplica + t`` (:meth:`rljob_api.config.JobConfig.transfer_rank`); the
group of one update has rank 0 plus the workers that joined it, in ascending transfer-rank order, numbered
densely. Process groups are built directly on the store (``ProcessGroupGloo`` on CPU tensors,
``ProcessGroupNCCL`` on CUDA tensors), never through ``init_process_group``, so the trainer's default group
stays the data-parallel world.

One update (ticket ``U``; keys under ``rljob/weights/U/`` in the store), after the publisher announced it with a
weights_ready event carrying the ticket:

1. Each invited worker sets ``ready/<transfer rank>``. The publisher waits up to ``join_timeout_s`` for them,
   then writes ``final`` = the members that are ready; a dead or busy worker costs one join timeout and is left
   out, never a hang.
2. Rank 0 and the ``final`` members build the group (collective timeout ``timeout_s``). Per tensor: an object
   broadcast of ``(shard name, parameter name, shape, dtype)``, then the tensor; an object broadcast of
   ``None`` ends the update. Object broadcasts use the layout of ``torch.distributed.broadcast_object_list``
   for one object (an int64 size tensor, then the pickled bytes as uint8), the per-tensor layout upstream's
   ``broadcast_object`` produces; receivers unpickle with an allow-list (builtins containers, ``torch.Size``,
   torch dtypes) so a stray peer cannot run code. The ready/final handshake is rljob's own.
"""

from __future__ import annotations

import datetime
import io
import json
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import redis
import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, Store, TCPStore

from rljob_api.protocol import TransferTicket

SHARD_NAME = "weights"
"""Shard name sent with every tensor (Fast-LLM's name for the model weights shard)."""
STORE_PREFIX = "rljob/weights/"
FINAL_MARGIN_S = 10.0
"""A receiver waits join_timeout_s + this for the publisher's `final` list (seconds)."""
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class StoreAddress:
    """Where the trainer's transfer store listens: ``config.trainer_master_host:config.weights_port``."""

    host: str
    port: int



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
