"""The packed weight-transfer layout (DESIGN §3 "Weight transfer", layout ``packed``): many tensors per broadcast.

Between rljob's own ends only (the trainer's publisher and the rollout backends, which announce it): receivers that
speak only the upstream per-tensor layout get that one (:mod:`rljob_wire.transfer` negotiates). After the group of an
update is formed, rank 0 sends

1. one object broadcast (the layout of the per-tensor metadata: an int64 size, then the pickled bytes) holding the
   whole update's :class:`Manifest`: every tensor's name, shape, dtype, bucket and byte offset, and every bucket's size;
2. one broadcast per bucket, in order: a uint8 tensor of the bucket's size holding its tensors' bytes at their
   offsets (each offset a multiple of :data:`ALIGN`), or, for a tensor larger than a bucket, that tensor alone, in its
   own dtype and shape. A tensor of at least ``own_bytes`` (:func:`plan`) fills a bucket of its own: rank 0 sends its
   bytes from the tensor's own memory when it needs no cast, so the large tensors of a model cost no copy (packing
   them would save no collective worth a copy: docs/weight-sync.md), and receivers read it as any other bucket.

So a receiver knows every receive it must post before the first bucket arrives, and gloo (which sends a tensor only
once its receiver has posted it) never waits for a receiver that is reading metadata. Each end keeps two bucket
buffers across updates (:class:`BucketBuffers`): rank 0 packs bucket k+1 while bucket k is on the wire, a receiver
unpacks bucket k while bucket k+1 arrives. Bucket size: ``bucket_bytes`` of :func:`plan` (default
:data:`DEFAULT_BUCKET_BYTES`, measured in docs/weight-sync.md).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

LAYOUT_PACKED = "packed"
LAYOUT_PER_TENSOR = "per-tensor"
LAYOUTS = (LAYOUT_PACKED, LAYOUT_PER_TENSOR)
"""The layouts rljob's receivers read (their ready records and heartbeats announce them)."""
DEFAULT_BUCKET_BYTES = 64 << 20
"""Bytes per bucket unless the publisher is told otherwise (docs/weight-sync.md)."""
OWN_BUCKET_SHARE = 32
"""By default a tensor of at least ``bucket_bytes // OWN_BUCKET_SHARE`` bytes fills a bucket of its own (:func:`plan`):
2 MiB at the default bucket size; smaller tensors (norms, biases) share buckets between the large ones
(docs/weight-sync.md). The publisher plans none from a GPU or when it casts (``own_bytes`` above the bucket size)."""
ALIGN = 64
"""Every tensor starts at a multiple of this many bytes of its bucket (any dtype's alignment, a cache line)."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor travels: bucket index, byte offset in it, and what it is."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class Manifest:
    """A whole packed update: its entries in the order sent, and each bucket's size in bytes. A bucket of one entry
    whose size is that entry's bytes and which is larger than ``bucket_bytes`` travels as the tensor itself
    (:meth:`alone`)."""

    entries: tuple[Entry, ...]
    bucket_sizes: tuple[int, ...]
    bucket_bytes: int
    _by_bucket: dict[int, list[Entry]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_bucket: dict[int, list[Entry]] = defaultdict(list)
        for entry in self.entries:
            by_bucket[entry.bucket].append(entry)
        object.__setattr__(self, "_by_bucket", dict(by_bucket))

    def alone(self, bucket: int) -> Optional[Entry]:
        """The entry that travels alone as bucket ``bucket`` (a tensor larger than a bucket), else None."""
        if self.bucket_sizes[bucket] <= self.bucket_bytes:
            return None
        (entry,) = self.in_bucket(bucket)
        return entry

    def sole(self, bucket: int) -> Optional[Entry]:
        """The entry that fills bucket ``bucket`` by itself (sent alone, or in a bucket of its own), else None."""
        entries = self.in_bucket(bucket)
        if len(entries) == 1 and entries[0].offset == 0 and entries[0].nbytes == self.bucket_sizes[bucket] > 0:
            return entries[0]
        return None

    def in_bucket(self, bucket: int) -> list[Entry]:
        """The entries of bucket ``bucket``, in the order sent."""
        return self._by_bucket.get(bucket, [])

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor (without the alignment gaps)."""
        return sum(e.nbytes for e in self.entries)

    def to_wire(self) -> tuple[Any, ...]:
        """A tuple of builtins, ``torch.Size`` and dtypes only (what the receivers' allow-list unpickles)."""
        return (LAYOUT_PACKED, self.bucket_bytes, tuple(self.bucket_sizes),
                tuple((e.name, tuple(e.shape), e.dtype, e.bucket, e.offset) for e in self.entries))

    @classmethod
    def from_wire(cls, value: Any) -> Manifest:
        """Raises ValueError when ``value`` is not what :meth:`to_wire` makes (names what is wrong)."""
        try:
            layout, bucket_bytes, sizes, entries = value
            if layout != LAYOUT_PACKED:
                raise ValueError(f"layout {layout!r}")
            manifest = cls(tuple(Entry(str(n), tuple(int(d) for d in s), dt, int(b), int(o)) for n, s, dt, b, o in entries),
                           tuple(int(x) for x in sizes), int(bucket_bytes))
        except (TypeError, ValueError) as error:
            raise ValueError(f"packed weight transfer: malformed manifest ({error})") from None
        for e in manifest.entries:
            if not isinstance(e.dtype, torch.dtype) or not 0 <= e.bucket < len(manifest.bucket_sizes) or (
                    e.offset % ALIGN or e.offset + e.nbytes > manifest.bucket_sizes[e.bucket]):
                raise ValueError(f"packed weight transfer: entry {e.name!r} does not fit its bucket: {e}")
        return manifest


@functools.lru_cache(maxsize=None)
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(int(d) for d in shape) * _element_size(dtype)


def plan(tensors: Sequence[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         own_bytes: Optional[int] = None) -> Manifest:
    """The manifest of an update of ``tensors`` ((name, shape, dtype) in the order they will be sent): consecutive
    tensors share a bucket while they fit in ``bucket_bytes`` (each at an offset aligned to :data:`ALIGN`); a tensor
    of at least ``own_bytes`` bytes (None: ``bucket_bytes // OWN_BUCKET_SHARE``) fills a bucket of its own, and one
    larger than ``bucket_bytes`` travels alone (both close the bucket before them).

    Raises:
        ValueError: ``bucket_bytes`` < :data:`ALIGN`, ``own_bytes`` < 1, or a name twice.
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"packed weight transfer: bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    if own_bytes is None:
        own_bytes = max(bucket_bytes // OWN_BUCKET_SHARE, 1)
    if own_bytes < 1:
        raise ValueError(f"packed weight transfer: own_bytes must be at least 1, got {own_bytes}")
    entries: list[Entry] = []
    sizes: list[int] = []
    names: set[str] = set()
    used = None  # bytes used in the open bucket (None: no bucket open)
    for name, shape, dtype in tensors:
        if name in names:
            raise ValueError(f"packed weight transfer: tensor {name!r} twice")
        names.add(name)
        shape = tuple(int(d) for d in shape)
        nbytes = _nbytes(shape, dtype)
        if nbytes >= own_bytes or nbytes > bucket_bytes:
            entries.append(Entry(name, shape, dtype, len(sizes), 0))
            sizes.append(nbytes)
            used = None
            continue
        offset = -(-used // ALIGN) * ALIGN if used is not None else 0
        if used is None or offset + nbytes > bucket_bytes:
            sizes.append(0)
            offset = 0
        entries.append(Entry(name, shape, dtype, len(sizes) - 1, offset))
        used = offset + nbytes
        sizes[-1] = used
    return Manifest(tuple(entries), tuple(sizes), bucket_bytes)


def view(bucket: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor of ``entry`` inside ``bucket`` (uint8 [bucket size]): [entry.shape] of entry.dtype, sharing memory."""
    return bucket[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)


class BucketBuffers:
    """uint8 buffers one end keeps across updates, grown when a bucket needs more and replaced when the device changes.
    Fresh memory costs a page fault per page on every update on some machines (docs/weight-sync.md), kept memory does
    not. By default two slots (slot k % 2 holds bucket k): a bucket's bytes last until bucket k + 2 arrives. With
    ``whole=True`` one slot per bucket: every bucket of an update lasts until the next update, so a receiver that
    stages the whole update before loading it reads its tensors in place (no copy out of the buckets). Bytes held:
    :attr:`nbytes` (two buckets, or the largest update's buckets)."""

    def __init__(self, whole: bool = False) -> None:
        self.whole = whole
        self._slots: list[Optional[torch.Tensor]] = [] if whole else [None, None]

    def get(self, bucket: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """uint8 [nbytes] on ``device`` in the slot of ``bucket``; contents undefined."""
        index = bucket if self.whole else bucket % 2
        if index >= len(self._slots):
            self._slots.extend([None] * (index + 1 - len(self._slots)))
        slot = self._slots[index]
        if slot is None or slot.numel() < nbytes or slot.device != torch.device(device):
            self._slots[index] = None
            del slot  # freed before its replacement is allocated
            slot = self._slots[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return slot[:nbytes]

    def __len__(self) -> int:
        """Slots held (2, or one per bucket of the largest update with ``whole``)."""
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slots if s is not None)
