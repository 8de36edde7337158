"""The trainer's model: built on the meta device, sharded, then filled one tensor at a time (issue 10, item 3).

No rank holds the whole model unless its strategy needs it (ddp replicates it by definition):

1. :func:`empty_model`: the transformers model of the config on the meta device, float32, without storage;
2. fsdp: :func:`~rljob_trainer.parallel.wrap_model` shards the meta model (``fully_shard``), then
   :func:`materialize` allocates this rank's shards on the device (``to_empty``) and recomputes the non-persistent
   buffers (RoPE's ``inv_freq``) that ``to_empty`` leaves undefined; ddp: materialise the whole model, then wrap;
3. the initial weights go into the local shards one tensor at a time:

   - ``model.source: huggingface | path``: :func:`load_pretrained`, DCP's Hugging Face reader over the safetensors
     files: each rank reads only its rows of each tensor from the memory-mapped file, converted to float32 as they
     are copied in;
   - ``tiny``: :func:`init_tiny_weights` replays :func:`~rljob_wire.model.build_model`'s seeded initialisation one
     module at a time on CPU, bit for bit (rollout and trainer start equal), and keeps each rank's slice;
   - nothing when a checkpoint (the job's own or ``initFrom``) will be loaded: ``CheckpointManager.load`` reads the
     shards through DCP and overwrites every parameter, so a resume reads no Hugging Face weights at all.

Peak anonymous memory of a rank while loading: its shards, plus the rows of one tensor (safetensors) or one whole
tensor (tiny), measured by ``benchmarks/trainer_memory.py`` (docs/trainer-memory.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from rljob_api import constants as c
from rljob_api.spec import ModelSpec
from rljob_wire.model import load_from, tiny_config
from rljob_trainer.parallel import DataParallelModel, Distributed, wrap_model

INDEX_FILE = "model.safetensors.index.json"
"""The Hugging Face index of a sharded safetensors checkpoint: ``{"weight_map": {tensor name: file name}}``."""

Initialiser = Callable[[torch.nn.Module], None]
"""Writes the initial weights into a materialised model's parameters (their local shards under fsdp)."""


# --- where the weights are ------------------------------------------------------------------------------------------
def pretrained_dir(spec: ModelSpec, weights: bool = True) -> Path:
    """The local directory of a ``huggingface`` or ``path`` model.

    ``path``: ``spec.path`` as it is. ``huggingface``: the Hub snapshot of ``spec.name`` at ``spec.revision`` in the
    Hugging Face cache (token from env ``HF_TOKEN``), downloaded in two passes pinned to one commit: the JSON files
    (config, safetensors index), then, with ``weights``, only the safetensors files the index names (all
    ``*.safetensors`` without an index). Repositories that also carry another layout of the same weights (Mistral's
    ``consolidated.safetensors``) are thus not downloaded twice.

    Raises:
        huggingface_hub.errors.HfHubHTTPError (an OSError): the Hub refuses or cannot be reached.
    """
    if spec.source == "path":
        return Path(spec.path or "")
    from huggingface_hub import snapshot_download

    token = os.environ.get(c.ENV_HF_TOKEN)
    directory = Path(snapshot_download(spec.name, revision=spec.revision, token=token, allow_patterns=["*.json"]))
    if not weights:
        return directory
    index = directory / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["*.safetensors"]
    return Path(snapshot_download(spec.name, revision=directory.name, token=token, allow_patterns=["*.json", *files]))


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files holding the model in ``directory``: those :data:`INDEX_FILE` names, else every
    ``*.safetensors`` file, sorted.

    Raises:
        FileNotFoundError: no index and no safetensors file (a PyTorch ``.bin`` checkpoint: convert it to
            safetensors), or a file the index names is missing; the message names the directory.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"model directory {directory}: {INDEX_FILE} names missing files {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model directory {directory} holds no *.safetensors file (and no {INDEX_FILE}); the trainer loads "
            f"safetensors only: convert the checkpoint (e.g. save_pretrained with transformers)"
        )
    return files


# --- building -------------------------------------------------------------------------------------------------------
def model_config(spec: ModelSpec, vocab_size: int, directory: Optional[Path]) -> Any:
    """The transformers config of ``spec``: :func:`~rljob_wire.model.tiny_config` for ``tiny``, else
    ``AutoConfig.from_pretrained(directory)`` (``vocab_size`` is then the checkpoint's own).

    Raises:
        OSError: ``directory`` holds no loadable ``config.json``.
    """
    if spec.source == "tiny":
        return tiny_config(spec, vocab_size)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def empty_model(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` (a transformers ``PretrainedConfig``) on the meta device, parameters float32.

    Nothing is allocated and no initialiser runs (transformers skips ``init_weights`` on meta); the buffers are meta
    too until :func:`materialize`.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate ``model``'s storage on ``device`` and recompute its non-persistent buffers.

    ``to_empty``: every parameter (its local shard once ``fully_shard`` ran) gets uninitialised storage of its dtype on
    ``device``. The buffers (RoPE's ``inv_freq``, ``original_inv_freq``) are set to NaN, then recomputed the way
    transformers' ``from_pretrained`` does after a meta-device load: every parameter is marked initialised
    (``_is_hf_initialized``), so ``model.initialize_weights()`` runs the model's ``_init_weights`` for what is left,
    the buffers.

    Parameters shared by several modules (tied embeddings) stay shared: ``to_empty`` gives each module a parameter
    of its own (FSDP2 keeps them shared by itself), so every alias is pointed back at the first one.

    Raises:
        RuntimeError: a floating-point buffer is still NaN afterwards (the model's ``_init_weights`` does not recompute
            it, so it would hold garbage); the message names it.
    """
    first_name: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []  # (alias, the name it shares a parameter with)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first_name:
            aliases.append((name, first_name[id(parameter)]))
        first_name.setdefault(id(parameter), name)
    model.to_empty(device=device)
    for alias, name in aliases:
        owner, _, attribute = alias.rpartition(".")
        shared = model.get_parameter(name)
        if model.get_parameter(alias) is not shared:
            setattr(model.get_submodule(owner), attribute, shared)
    with torch.no_grad():
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
    for parameter in model.parameters():
        parameter._is_hf_initialized = True  # transformers' own mark of a loaded tensor: its initialiser skips it
    model.initialize_weights()
    undefined = [name for name, buffer in model.named_buffers()
                 if buffer.is_floating_point() and bool(torch.isnan(buffer).any())]
    if undefined:
        raise RuntimeError(
            f"rljob trainer: {type(model).__name__}'s _init_weights does not recompute the buffers {undefined} after "
            f"meta-device construction; they would hold garbage"
        )


def build_parallel_model(config: Any, where: Distributed, trainer: Any,
                         initialise: Optional[Initialiser], frozen: bool = False) -> DataParallelModel:
    """The model of ``config`` under ``trainer.parallelism`` (a :class:`~rljob_api.spec.TrainerSpec`), on
    ``where.device``, without ever holding more than this rank's shards plus what ``initialise`` holds at once.

    fsdp: :func:`empty_model` → :func:`~rljob_trainer.parallel.wrap_model` (``fully_shard`` on the meta model) →
    :func:`materialize` → ``initialise``. ddp: :func:`empty_model` → :func:`materialize` → ``initialise`` → wrap (DDP
    broadcasts rank 0's parameters). ``initialise`` None leaves the parameters uninitialised: a checkpoint is loaded
    next. ``frozen``: see :func:`~rljob_trainer.parallel.wrap_model`. Collective under ddp (the broadcast, unless
    ``frozen``) and when ``initialise`` is (:func:`load_pretrained`).
    """
    model = empty_model(config)
    if trainer.parallelism.strategy == "ddp":
        materialize(model, where.device)
        if initialise is not None:
            initialise(model)
        return wrap_model(model, where, trainer, frozen)
    parallel = wrap_model(model, where, trainer, frozen)
    materialize(model, where.device)
    if initialise is not None:
        initialise(model)
    return parallel


def load_model(spec: ModelSpec, vocab_size: int, seed: int, where: Distributed, trainer: Any,
               weights: bool = True, frozen: bool = False) -> DataParallelModel:
    """The trainer's model of ``spec`` (see the module docstring); with ``weights`` its initial weights
    (:func:`init_tiny_weights` with ``seed`` for ``tiny``, :func:`load_pretrained` otherwise), without when a
    checkpoint will be loaded into it. Collective.

    The reference policy of the KL penalty is ``load_model(..., weights=True, frozen=True)``: the same model, sharded
    the same way, with ``spec``'s own weights (never a checkpoint's), evaluated only.

    Args:
        vocab_size: the tokenizer's vocabulary (``tiny`` only; a pretrained model has its own).
        trainer: the :class:`~rljob_api.spec.TrainerSpec` (parallelism, precision, activation checkpointing).
        frozen: see :func:`~rljob_trainer.parallel.wrap_model`.

    Raises:
        StartFailure: the model's directory, ``config.json`` or safetensors files (:func:`safetensors_files`) cannot be
            found or read, said by :func:`~rljob_wire.model.load_from` (field, value; permanent, or transient once
            the Hub was unreachable for :data:`~rljob_wire.model.HUB_RETRY_S`), before any collective.
        ValueError: the safetensors files do not match the model (see :func:`load_pretrained`).
    """
    directory: Optional[Path] = None
    if spec.source == "tiny":
        config = model_config(spec, vocab_size, None)
    else:
        def find() -> tuple[Path, Any]:
            found = pretrained_dir(spec, weights=weights)
            if weights:
                safetensors_files(found)  # refused here, before the collectives, rather than in load_pretrained
            return found, model_config(spec, vocab_size, found)

        directory, config = load_from(spec, "model", find)
    initialise: Optional[Initialiser] = None
    if weights and directory is None:
        initialise = lambda model: init_tiny_weights(model, config, seed)  # noqa: E731
    elif weights:
        initialise = lambda model: load_pretrained(model, directory)  # noqa: E731
    return build_parallel_model(config, where, trainer, initialise, frozen)


# --- initial weights ------------------------------------------------------------------------------------------------
def load_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a Hugging Face checkpoint fills: every parameter once (a tied ``lm_head.weight`` shares the embedding's and
    is not saved) and every persistent buffer, by state-dict name; DTensors under fsdp."""
    targets = dict(model.named_parameters())
    persistent = set(model.state_dict().keys())
    targets.update({name: b for name, b in model.named_buffers() if name in persistent})
    return targets


@contextlib.contextmanager
def _reader_directory(directory: Path, files: list[Path]) -> Iterator[Path]:
    """``directory`` when ``files`` are all its safetensors files, else a temporary directory of links to ``files``
    (DCP's reader reads every ``*.safetensors`` of the directory it is given)."""
    if set(files) == set(directory.glob("*.safetensors")):
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="rljob-safetensors-") as view:
        for f in files:
            os.symlink(f.resolve(), Path(view) / f.name)
        yield Path(view)


def load_pretrained(model: torch.nn.Module, directory: Path) -> None:
    """Copy the weights of the Hugging Face directory ``directory`` into ``model``'s (materialised) tensors.

    DCP's Hugging Face reader (``HuggingFaceStorageReader``) plans, for every tensor of :func:`load_targets`, the rows
    this rank holds (its ``Shard(0)`` slice under fsdp, the whole tensor under ddp), reads them from the memory-mapped
    file (``safe_open(...).get_slice``) and copies them in, converting the file's dtype (bf16, fp16, fp32) to the
    parameter's. Collective over the default process group.

    Raises:
        FileNotFoundError: see :func:`safetensors_files`.
        ValueError: a tensor of the model is missing from the files, or its shape differs (DCP's
            ``CheckpointException``, per rank, in the message).
    """
    files = safetensors_files(directory)
    targets = load_targets(model)
    with _reader_directory(directory, files) as readable, torch.no_grad():
        try:
            dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(readable)))
        except CheckpointException as err:
            raise ValueError(f"model directory {directory} does not match {type(model).__name__}: {err}") from err


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, any device) into ``target``: into its local shard when ``target`` is a DTensor
    (the rows ``__create_chunk_list__`` gives this rank, the chunk DCP would read), else entirely."""
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    (chunk,) = target.__create_chunk_list__()
    part = full
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
        part = part.narrow(dim, offset, size)
    target.to_local().copy_(part)


def init_tiny_weights(model: torch.nn.Module, config: Any, seed: int) -> None:
    """Write :func:`~rljob_wire.model.build_model`'s seeded tiny Llama into ``model`` (materialised, sharded or
    not), bit for bit, one module's tensors at a time.

    ``build_model`` draws, from the CPU generator seeded with ``seed``: each ``nn.Linear`` / ``nn.Embedding``'s
    ``reset_parameters`` as the module is constructed, then transformers' ``_init_weights`` of every module in
    ``initialize_weights``' order, at the end of each ``PreTrainedModel``'s ``__init__`` (``LlamaModel``'s, then
    ``LlamaForCausalLM``'s for the ``lm_head`` left). This replays both on a second meta model of the same class: a
    module's own tensors are allocated on CPU only while it is initialised, the values of its transformers init are
    copied into ``model`` (this rank's slice) and freed. Peak: one module's tensors (the embedding or ``lm_head``).
    The global CPU generator is left as it was.

    Raises:
        RuntimeError: a parameter of ``model`` was not written, or not fully (it would keep ``to_empty``'s garbage),
            i.e. the replay no longer matches transformers' initialisation; the message names it.
    """
    from transformers import LlamaForCausalLM, PreTrainedModel

    with torch.device("meta"):
        scratch = LlamaForCausalLM(config)
    names = {module: name for name, module in scratch.named_modules()}
    written: set[str] = set()

    def keep(module: torch.nn.Module) -> None:
        prefix = names[module] + "." if names[module] else ""
        for name, value in module.named_parameters(recurse=False):
            if bool(torch.isnan(value).any()):
                raise RuntimeError(f"rljob trainer: tiny init replay: {prefix}{name} is not set by _init_weights")
            _copy_into(model.get_parameter(prefix + name), value)
            written.add(prefix + name)
        module.to_empty(device="meta", recurse=False)

    def replaying(pretrained: Any) -> Callable[..., None]:
        original = pretrained._initialize_weights

        def initialize(module: torch.nn.Module, is_custom_code: bool = False) -> None:
            if getattr(module, "_is_hf_initialized", False):
                return
            module.to_empty(device="cpu", recurse=False)
            for value in module.parameters(recurse=False):
                value.fill_(float("nan"))
            original(module, is_custom_code)
            keep(module)

        return initialize

    for module in scratch.modules():
        if isinstance(module, PreTrainedModel):
            module._initialize_weights = replaying(module)

    def construct(module: torch.nn.Module) -> None:
        for child in module.children():
            construct(child)
        if hasattr(module, "reset_parameters") and next(module.parameters(recurse=False), None) is not None:
            module.to_empty(device="cpu", recurse=False)  # the draws of its constructor, values discarded
            module.reset_parameters()
            module.to_empty(device="meta", recurse=False)
        if isinstance(module, PreTrainedModel):
            module.initialize_weights()  # the end of its __init__ (post_init)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(seed)
        construct(scratch)
    missing = sorted(set(dict(model.named_parameters())) - written)
    if missing:
        raise RuntimeError(f"rljob trainer: tiny init replay wrote no value into {missing}")
