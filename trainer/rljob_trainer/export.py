"""The final weights as safetensors in Hugging Face layout, written tensor by tensor from the shards.

No process ever holds the full state dict. The layout of every file is known before any tensor is gathered:
names, dtypes and global shapes come from ``model.state_dict()`` (DTensor shards under fsdp, the replicated
tensors under ddp), so :func:`plan_files` fixes each file's header (the safetensors format of
huggingface/safetensors' README: an 8-byte little-endian header size N, N bytes of UTF-8 JSON
``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with spaces, then the
byte buffer, entirely indexed without holes, little-endian, row-major). :func:`export_hugging_face` then walks the
planned tensors in order: every rank joins each ``DTensor.full_tensor()`` (a collective), the writer (global rank 0)
appends the gathered tensor's bytes to its file and drops it before the next gather. Peak memory on the writer is
one full tensor (plus the all-gather's buffer) above its shards, instead of the whole model
(``benchmarks/checkpoint_export.py`` measures it).

What transformers' ``save_pretrained`` does and this module repeats, so ``from_pretrained`` reads the result the
same way: ``_keys_to_ignore_on_save`` dropped; tied weights (one parameter under two names, e.g.
``lm_head.weight`` = ``model.embed_tokens.weight``) saved once, under the name transformers keeps
(``remove_tied_weights_from_state_dict``); ``__metadata__`` ``{"format": "pt"}``; ``config.json`` with ``dtype``
and ``architectures`` set as transformers sets them, ``generation_config.json`` for generative models; above
``max_shard_bytes`` several files ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
(``{"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}``). Within a file, tensors are
ordered by element size, largest first (as safetensors' own writer does), so each stays aligned to its element.

Not streamed: a model whose class transformers converts on save (``revert_weight_conversion``: e.g. fused MoE
experts split back into per-expert tensors, many-to-one and one-to-many). Its export gathers the full state dict to
the writer and calls ``save_pretrained``, with a warning; the dense decoders rljob trains (Llama, Qwen2, Mistral...)
have no conversion.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rljob_trainer import durable

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""torch dtype → the safetensors dtype name (huggingface/safetensors' ``Dtype``)."""

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Largest safetensors file before the export is split (bytes; transformers 4's ``"5GB"``, a size every loader and
the Hub handle; transformers 5's own default is 50 GB). A single larger tensor gets a file of its own."""
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: ``name``, ``dtype``, global ``shape``, and its bytes
    ``[begin, end)`` relative to the file's byte buffer (``end - begin`` = numel × element size)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsFile:
    """One planned output file: its ``filename`` and its tensors in byte-buffer order."""

    filename: str
    entries: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the byte buffer (the file is 8 + header + this)."""
        return self.entries[-1].end if self.entries else 0

    def header(self, metadata: Mapping[str, str]) -> bytes:
        """The 8-byte little-endian size N, then N bytes of JSON header padded with spaces so that the byte buffer
        starts at a multiple of 8 (as safetensors' writer pads).

        Raises:
            KeyError: a dtype safetensors cannot store (not in :data:`SAFETENSORS_DTYPES`).
        """
        table: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        for e in self.entries:
            table[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        text = json.dumps(table, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text


def plan_files(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], max_shard_bytes: int) -> list[SafetensorsFile]:
    """Split ``tensors`` (name → (dtype, global shape), in state-dict order) into safetensors files.

    Files fill in order like huggingface_hub's ``split_torch_state_dict_into_shards``: a tensor that would take the
    current file above ``max_shard_bytes`` starts the next one (a tensor larger than the limit gets a file alone).
    One file is named ``model.safetensors``; several ``model-0000i-of-0000N.safetensors``. Within a file the tensors
    are ordered by element size, largest first, stably (each stays aligned to its element size).

    Raises:
        ValueError: ``max_shard_bytes`` < 1, or no tensors.
        KeyError: a dtype safetensors cannot store.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    if not tensors:
        raise ValueError("nothing to export: the state dict is empty")
    groups: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in tensors.items():
        SAFETENSORS_DTYPES[dtype]  # noqa: B018 - fail before any gather on a dtype safetensors cannot store
        nbytes = _nbytes(dtype, shape)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = []
    for index, names in enumerate(groups, start=1):
        filename = WEIGHTS_NAME if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        ordered = sorted(names, key=lambda n: -tensors[n][0].itemsize)
        entries, offset = [], 0
        for name in ordered:
            dtype, shape = tensors[name]
            end = offset + _nbytes(dtype, shape)
            entries.append(TensorEntry(name, dtype, tuple(shape), offset, end))
            offset = end
        files.append(SafetensorsFile(filename, tuple(entries)))
    return files


def export_hugging_face(
    model: torch.nn.Module,
    out: Path,
    *,
    writer: bool,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Optional[Path]:
    """Write ``model``'s weights, config and ``tokenizer`` to ``out`` in Hugging Face layout; collective.

    Every rank of the default process group calls it with the same model (transformers ``PreTrainedModel``, FSDP2-
    sharded or not); ``writer`` is True on exactly one rank (global rank 0), which writes. Under fsdp each tensor is
    gathered with ``DTensor.full_tensor()`` on every rank in the planned order, written by the writer and freed before
    the next; unsharded tensors are written from the writer's own copy (on GPU copied to host one at a time). The
    files are written to ``out`` + ``.partial`` (fsynced), then renamed to ``out`` (an older ``out`` is removed first),
    so ``out`` never holds a half-written export. Ends with a barrier.

    Args:
        out: the export directory (``checkpoint_dir/export``).
        writer: whether this rank writes.
        tokenizer: saved beside the weights when it has ``save_pretrained``.
        max_shard_bytes: largest file before the weights are split (:func:`plan_files`).

    Returns:
        ``out`` on the writer, None elsewhere.

    Raises:
        KeyError: a tensor dtype safetensors cannot store.
        RuntimeError: ``sys.byteorder`` is not little (safetensors is little-endian); transformers' errors about
            shared tensors it cannot untie.
        OSError: writing the files.
    """
    if sys.byteorder != "little":
        raise RuntimeError("the safetensors export writes raw tensor bytes and needs a little-endian host")
    state = _saved_state_dict(model)
    if _converts_on_save(model, state):
        log.warning("export: %s converts its weights on save; gathering the full state dict to rank 0 instead of "
                    "streaming tensor by tensor", type(model).__name__)
        return _export_full(model, out, writer=writer, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)
    files = plan_files({name: (t.dtype, tuple(t.shape)) for name, t in state.items()}, max_shard_bytes)
    partial = out.with_name(out.name + ".partial")
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    for planned in files:
        _write_file(planned, state, partial / planned.filename if writer else None)
    if writer:
        if len(files) > 1:
            index = {
                "metadata": {"total_parameters": model.num_parameters(), "total_size": sum(f.nbytes for f in files)},
                "weight_map": {e.name: f.filename for f in files for e in f.entries},
            }
            (partial / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _save_config(model, partial)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(partial)
        durable.fsync_tree(partial)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(partial, out)
        durable.fsync_dir(out.parent)
        log.info("export: wrote %d tensors in %d file(s), %d bytes, to %s",
                 sum(len(f.entries) for f in files), len(files), sum(f.nbytes for f in files), out)
    dist.barrier()
    return out if writer else None


def _saved_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` less what transformers leaves out on save (ignored keys, the second name of tied
    weights); nothing is gathered (shards stay DTensors)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = dict(model.state_dict())
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    with warnings.catch_warnings():  # transformers reads a DTensor's storage through the deprecated TypedStorage
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        return remove_tied_weights_from_state_dict(state, model)


def _converts_on_save(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> bool:
    """Whether transformers would rename or reshape ``state`` on save (tried on meta tensors of the same shapes)."""
    from transformers.core_model_loading import revert_weight_conversion

    meta = {name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for name, t in state.items()}
    reverted = revert_weight_conversion(model, meta)
    if reverted is meta:
        return False
    return list(reverted) != list(meta) or any(
        tuple(reverted[n].shape) != tuple(meta[n].shape) or reverted[n].dtype != meta[n].dtype for n in meta
    )


def _write_file(planned: SafetensorsFile, state: Mapping[str, torch.Tensor], path: Optional[Path]) -> None:
    """Gather (every rank) and write (``path`` not None: the writer) the tensors of one planned file."""
    handle = open(path, "wb") if path is not None else None
    try:
        if handle is not None:
            handle.write(planned.header({"format": "pt"}))
        for entry in planned.entries:
            tensor = state[entry.name]
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # collective: every rank, same order
            elif handle is None:
                continue
            if handle is not None:
                _write_tensor(handle, tensor.detach(), entry)
            del tensor  # freed before the next gather
        if handle is not None:
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        if handle is not None:
            handle.close()


def _write_tensor(handle: Any, tensor: torch.Tensor, entry: TensorEntry) -> None:
    """Append ``tensor``'s bytes (row-major, host order = little-endian) to ``handle``.

    Raises:
        RuntimeError: the tensor does not match its planned dtype, shape or size.
    """
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise RuntimeError(f"export: {entry.name} is {tensor.dtype} {tuple(tensor.shape)}, planned as "
                           f"{entry.dtype} {entry.shape}")
    host = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if host.numel() != entry.end - entry.begin:
        raise RuntimeError(f"export: {entry.name} has {host.numel()} bytes, planned {entry.end - entry.begin}")
    if host.numel():
        handle.write(memoryview(host.numpy()))


def _save_config(model: torch.nn.Module, out: Path) -> None:
    """config.json as ``save_pretrained`` writes it (``dtype`` of the parameters, ``architectures`` without FSDP2's
    class prefix), without changing ``model.config``; generation_config.json for models that generate."""
    config = copy.deepcopy(model.config)
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(out)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def _export_full(model: torch.nn.Module, out: Path, *, writer: bool, tokenizer: Any, max_shard_bytes: int) -> Optional[Path]:
    """The gathered export of a model transformers converts on save: the full state dict on the writer's host."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if writer:
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, state_dict=full, max_shard_size=max_shard_bytes)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(out)
    del full
    dist.barrier()
    return out if writer else None


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype.itemsize
