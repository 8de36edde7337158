"""Parallelism of the trainer gang: the world-size check, the process group and the model wrapping.

Decided in one place, like torchtitan's ``ParallelDims``: :class:`ParallelDims` checks that the degrees
multiply to the world size and that HSDP's replicate degree divides the data-parallel size (DESIGN §5),
:func:`init_distributed` forms the process group (gloo on CPU, NCCL on GPU, with the configured collective
timeout) and, for ``fsdp``, the data-parallel DeviceMesh; :func:`wrap_model` applies DDP or FSDP2
(``fully_shard`` per decoder block, then the root) and :class:`DataParallelModel` gives the training loop one
interface to both: the module to call, the gradient synchronisation of a micro-batch, the compute precision and
the gradient clipping. Under fsdp the checkpoints (``torch.distributed.checkpoint.state_dict``) and the weight
publication (:func:`rljob_trainer.weight_publisher.publish_weights`, one gather at a time on every rank) work on the
shards. Tensor and pipeline parallelism stay refused ("not supported yet").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
import contextlib
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from rljob_api import rules
from rljob_api.config import JobConfig


class WorldSizeMismatch(SystemExit):
    """The launched world does not match the config's data-parallel size; exits the process non-zero.

    A ``SystemExit`` so that an uncaught one ends the rank with status 1 and its message on stderr, without
    a traceback that would hide the numbers.
    """


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of parallelism of one trainer launch.

    ``world_size`` ranks (torchrun's WORLD_SIZE) = ``data_parallel`` × ``tensor_parallel`` ×
    ``pipeline_parallel`` (DESIGN §5). Only data parallelism is implemented: ``strategy`` ``ddp`` replicates the
    model on every data-parallel rank, ``fsdp`` shards it over ``data_parallel / replicate`` ranks within each of
    ``replicate`` groups (HSDP when ``replicate`` > 1).
    """

    world_size: int
    data_parallel: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    strategy: str = "ddp"
    replicate: int = 1

    @classmethod
    def from_config(cls, config: JobConfig, world_size: int) -> "ParallelDims":
        """The degrees of ``config`` for a launch of ``world_size`` ranks; see :meth:`check`."""
        t = config.spec.trainer
        return cls(world_size, config.data_parallel_size, t.tensor_parallel, t.pipeline_parallel,
                   t.parallelism.strategy, t.parallelism.replicate)

    @property
    def shard(self) -> int:
        """Ranks one copy of the model is sharded over: ``data_parallel / replicate`` under fsdp, 1 under ddp."""
        return self.data_parallel // self.replicate if self.strategy == "fsdp" else 1

    def check(self) -> None:
        """Raise :class:`WorldSizeMismatch` unless WORLD_SIZE / (TP × PP) == the configured DP size.

        The message prints every number, e.g. ``WORLD_SIZE=2 / (tensorParallel=1 × pipelineParallel=1) = 2
        but the config's dataParallelSize is 1``.
        """
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if rules.data_parallel(self.world_size, self.tensor_parallel, self.pipeline_parallel) != self.data_parallel:
            raise WorldSizeMismatch(
                f"rljob trainer: WORLD_SIZE={self.world_size} / (tensorParallel={self.tensor_parallel} × "
                f"pipelineParallel={self.pipeline_parallel}) = {self.world_size / model_parallel:g} but the "
                f"config's dataParallelSize is {self.data_parallel}; the trainer pods were launched with a "
                f"different topology than the resolved config (nodes × processesPerNode must equal "
                f"dataParallelSize × tensorParallel × pipelineParallel)"
            )
        if model_parallel != 1:
            raise WorldSizeMismatch(
                f"rljob trainer: tensorParallel={self.tensor_parallel} × pipelineParallel="
                f"{self.pipeline_parallel} > 1 is not supported yet by the builtin backend"
            )
        if not rules.replicate_allowed(self.strategy, self.replicate, self.data_parallel):
            raise WorldSizeMismatch(
                f"rljob trainer: parallelism.replicate={self.replicate} with strategy {self.strategy} does not fit the "
                f"data-parallel size {self.data_parallel} (it must divide it, and be 1 unless the strategy is fsdp)"
            )


@dataclass(frozen=True)
class Distributed:
    """This process's place in the gang: global ``rank`` of ``world_size``, ``local_rank``, ``device``.

    With DP only, the data-parallel rank is the global rank and the group is the default (WORLD) group. ``mesh``:
    the data-parallel DeviceMesh of an fsdp gang (1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` for HSDP);
    None under ddp.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    dims: ParallelDims = ParallelDims(1, 1)
    mesh: Optional[DeviceMesh] = None

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def init_distributed(config: JobConfig) -> Distributed:
    """Check the world size and join the default process group.

    Under torchrun (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) joins the gang through the
    env:// rendezvous; without it (a single in-process run, e.g. tests) forms a world of one over an
    in-memory store, so the training loop calls the same collectives either way. Backend: NCCL when CUDA
    is available, else gloo. Timeout: ``spec.trainer.collectiveTimeoutSeconds`` (a hang becomes an error,
    which the operator turns into a gang restart; DESIGN §5 rule 6).

    Raises:
        WorldSizeMismatch: WORLD_SIZE / (TP × PP) differs from ``config.data_parallel_size``.
        RuntimeError: a process group already exists in this process.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = ParallelDims.from_config(config, world_size)
    dims.check()
    if dist.is_initialized():
        raise RuntimeError("rljob trainer: a torch.distributed process group is already initialised")
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    timeout = timedelta(seconds=config.spec.trainer.collective_timeout_seconds)
    if "MASTER_ADDR" in os.environ or world_size > 1:
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = None
    if dims.strategy == "fsdp":
        if dims.replicate > 1:
            mesh = init_device_mesh(device.type, (dims.replicate, dims.shard), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (dims.shard,), mesh_dim_names=("shard",))
    return Distributed(rank, world_size, local_rank, device, backend, dims, mesh)


GATHER_MAX_WORLD = 16
"""Largest group whose small per-step reductions (:func:`reduce_small`) go through one all-gather instead of
all-reduces: on gloo over loopback an all-reduce of 20 float64 values took 0.89 ms against 0.36 ms for an all-gather
of them at 2 ranks (2 cores, 2026-12-04), and one gather serves a sum and a maximum at once. An all-gather moves
world × n values and its ring takes world - 1 hops, so above this size two all-reduces are cheaper."""


class SmallReduction:
    """A :func:`start_reduce_small` in flight: :meth:`wait` returns its (sum, maximum), waiting for the collective
    the first time. Until then the inputs must not be changed."""

    def __init__(self, works: list[Any], finish: Callable[[], tuple[torch.Tensor, Optional[torch.Tensor]]]) -> None:
        self._works = works
        self._finish = finish
        self._result: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def wait(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(sum [n], maximum [m] or None), identical on every rank (see :func:`reduce_small`).

        Raises:
            RuntimeError: the collective failed or timed out (``collectiveTimeoutSeconds``).
        """
        if self._result is None:
            for work in self._works:
                work.wait()
            self._result = self._finish()
        return self._result


def start_reduce_small(
    total: torch.Tensor, maximum: Optional[torch.Tensor] = None, group: Optional[dist.ProcessGroup] = None,
    gather_max_world: int = GATHER_MAX_WORLD,
) -> SmallReduction:
    """:func:`reduce_small` started asynchronously (``async_op``): the caller computes on while the values travel,
    and takes the result with :meth:`SmallReduction.wait`. Collectives issued meanwhile (a forward's FSDP gathers, a
    gradient norm's all-reduce) follow it in the same order on every rank, as every collective must.

    Raises:
        ValueError: as :func:`reduce_small`.
    """
    if maximum is not None and (maximum.dtype != total.dtype or maximum.device != total.device):
        raise ValueError(f"maximum is {maximum.dtype} on {maximum.device}, total {total.dtype} on {total.device}")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return SmallReduction([], lambda: (total, maximum))
    if world > gather_max_world:
        works = [dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group, async_op=True)]
        if maximum is not None:
            works.append(dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group, async_op=True))
        return SmallReduction(works, lambda: (total, maximum))
    local = total if maximum is None else torch.cat([total, maximum])
    gathered = local.new_empty(world * local.numel())
    work = dist.all_gather_into_tensor(gathered, local, group=group, async_op=True)

    def finish() -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        rows, n = gathered.view(world, -1), total.numel()
        return rows[:, :n].sum(0), None if maximum is None else rows[:, n:].amax(0)

    return SmallReduction([work], finish)


def reduce_small(
    total: torch.Tensor, maximum: Optional[torch.Tensor] = None, group: Optional[dist.ProcessGroup] = None,
    gather_max_world: int = GATHER_MAX_WORLD,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The sum of ``total`` and the element-wise maximum of ``maximum`` over the ranks of ``group`` (default: the
    world), for the few values each step reduces (its normalisers, its metrics).

    Args:
        total: [n] of any dtype, summed over the ranks.
        maximum: [m] of ``total``'s dtype and device, or None.
        group: the data-parallel process group.
        gather_max_world: the largest group reduced through an all-gather.

    Returns:
        (sum [n], maximum [m] or None), identical on every rank: with one rank (or no process group)
        the inputs themselves and no collective; up to ``gather_max_world`` ranks one all-gather of
        ``cat(total, maximum)`` summed and maximised in rank order on every rank; above it one SUM and one MAX
        all-reduce. Collective: every rank of ``group`` calls it with tensors of the same shapes.

    Raises:
        ValueError: ``maximum`` of another dtype or device than ``total``.
        RuntimeError: the collective failed or timed out.
    """
    return start_reduce_small(total, maximum, group, gather_max_world).wait()


def shutdown_distributed() -> None:
    """Leave the default process group if one exists (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class DataParallelModel:
    """The training loop's one interface to a DDP-wrapped or FSDP2-sharded model (:func:`wrap_model`).

    Attributes:
        module: what the forward calls: the DDP wrapper, or the sharded model itself (``fully_shard`` turns the
            model into an ``FSDPModule`` in place).
        model: the transformers model (parameters are DTensors under fsdp; its state dict keys are the same
            either way).
    """

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, where: Distributed, compute_dtype: torch.dtype):
        self.module = module
        self.model = model
        self.where = where
        self.compute_dtype = compute_dtype

    @property
    def sharded(self) -> bool:
        return isinstance(self.model, FSDPModule)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """The gradient synchronisation of one micro-batch's backward (DESIGN §4).

        ddp: the all-reduce runs only in the step's ``last`` backward (``no_sync`` before it). fsdp: gradients are
        reduce-scattered in every backward, so they stay sharded; HSDP defers only the all-reduce across replica
        groups to the ``last`` backward (``set_requires_all_reduce``).
        """
        if not self.sharded:
            return contextlib.nullcontext() if last else self.module.no_sync()
        if self.where.dims.replicate > 1:
            self.model.set_requires_all_reduce(last, recurse=True)
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 autocast for ddp on GPU with ``precision.param`` bf16; fsdp casts through its mixed-precision
        policy instead, and CPU computes in float32."""
        if not self.sharded and self.compute_dtype == torch.bfloat16:
            return torch.autocast(self.where.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm (over every rank's shards) to ``max_norm`` (``inf``: measure only); returns
        the norm before clipping, the same number on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)


def wrap_model(model: torch.nn.Module, where: Distributed, trainer: Any, frozen: bool = False) -> DataParallelModel:
    """Apply ``trainer.parallelism`` (a :class:`~rljob_api.spec.TrainerSpec`) to ``model`` (float32; under ddp on
    ``where.device`` and identical on every rank; under fsdp on the meta device, to be materialised afterwards
    (:func:`rljob_trainer.loading.build_parallel_model`), or already on ``where.device``).

    ``frozen``: a model that is only evaluated (the reference policy of the KL penalty): its parameters stop requiring
    gradients and it is put in eval mode; fsdp shards it exactly like the trained model, ddp keeps its replica
    unwrapped (DDP has no gradient to reduce), and activation checkpointing is skipped (there is no backward).

    - ``activationCheckpointing: full``: the transformers model's own (non-reentrant) gradient checkpointing of
      every decoder block, applied first.
    - ddp: DDP, which broadcasts rank 0's parameters at construction and averages gradients over ranks in the last
      backward of a step.
    - fsdp: ``fully_shard`` on ``where.mesh`` per decoder block (the classes the model names in
      ``_no_split_modules``), on the input embedding and the output projection when they are not tied, then on the
      root; each rank keeps its shard of every parameter (``Shard(0)``), the
      gradients and the optimizer state built afterwards. Mixed precision (FSDP2's ``MixedPrecisionPolicy``):
      parameters all-gathered in ``precision.param``, gradients reduced in ``precision.reduce``; both float32 on
      CPU.

    Raises:
        ValueError: fsdp without a mesh (:func:`init_distributed` builds it from the same config).
    """
    on_gpu = where.device.type == "cuda"
    precision = trainer.precision
    compute_dtype = torch.bfloat16 if on_gpu and precision.param == "bf16" else torch.float32
    if frozen:
        model.requires_grad_(False)
        model.eval()
    elif trainer.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainer.parallelism.strategy == "ddp":
        if frozen:
            return DataParallelModel(model, model, where, compute_dtype)
        device_ids = [where.device.index] if on_gpu else None
        # Buffers (the rotary frequencies) are built alike on every rank and never trained: DDP's default would
        # broadcast them before every forward, one collective per micro-batch (2 ms a step of the CPU example).
        module = DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
        return DataParallelModel(module, model, where, compute_dtype)
    if where.mesh is None:
        raise ValueError("rljob trainer: strategy fsdp needs the data-parallel mesh of init_distributed")
    reduce_dtype = torch.bfloat16 if on_gpu and precision.reduce == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    for module in fsdp_units(model):
        fully_shard(module, mesh=where.mesh, mp_policy=policy)
    fully_shard(model, mesh=where.mesh, mp_policy=policy)
    return DataParallelModel(model, model, where, compute_dtype)


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules :func:`wrap_model` shards as units of their own before the root, in that order: every decoder
    block (the classes the model names in ``_no_split_modules``), then the input embedding and the output projection
    when they are not tied. The root unit holds the parameters none of them holds (the final norm; the embedding
    too when tied). FSDP gathers one unit at a time, so the largest unit sets the unsharded memory on top of the
    shards (docs/trainer-memory.md)."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    units = [module for module in model.modules() if type(module).__name__ in block_classes]
    if not getattr(model.config, "tie_word_embeddings", False):
        # Untied, the embedding and the output projection are each as large as a few blocks (152k x 3584 for a 7B
        # Qwen): units of their own, so the root's gathered parameters are only the final norm.
        units += [model.get_input_embeddings(), model.get_output_embeddings()]
    return units
