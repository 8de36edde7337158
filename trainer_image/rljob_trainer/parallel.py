"""Parallelism of the trainer gang: the world-size check, the process group and the model wrapping.

Decided in one place, like torchtitan's ``ParallelDims``: :class:`ParallelDims` checks that the degrees
multiply to the world size (DESIGN §5), :func:`init_distributed` forms the data-parallel process group
(gloo on CPU, NCCL on GPU, with the configured collective timeout) and :func:`wrap_model` applies DDP.

Plan for large models (not implemented yet): replace :func:`wrap_model`'s DDP with FSDP2
(``torch.distributed.fsdp.fully_shard`` per decoder block, then on the root), keeping the same interface.
The checkpoint code already goes through ``torch.distributed.checkpoint.state_dict``, which handles
sharded (DTensor) state dicts, and the weight publication already gathers DTensors one at a time on every rank
(:func:`rljob_trainer.weights.publish_weights`). Tensor and pipeline parallelism stay refused by the operator
("not supported yet") until then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
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
    ``pipeline_parallel`` (DESIGN §5). Only data parallelism is implemented.
    """

    world_size: int
    data_parallel: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @classmethod
    def from_config(cls, config: JobConfig, world_size: int) -> "ParallelDims":
        """The degrees of ``config`` for a launch of ``world_size`` ranks; see :meth:`check`."""
        t = config.spec.trainer
        return cls(world_size, config.data_parallel_size, t.tensor_parallel, t.pipeline_parallel)

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


@dataclass(frozen=True)
class Distributed:
    """This process's place in the gang: global ``rank`` of ``world_size``, ``local_rank``, ``device``.

    With DP only, the data-parallel rank is the global rank and the group is the default (WORLD) group.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

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
    ParallelDims.from_config(config, world_size).check()
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
    return Distributed(rank, world_size, local_rank, device, backend)


def shutdown_distributed() -> None:
    """Leave the default process group if one exists (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, where: Distributed) -> DistributedDataParallel:
    """Wrap ``model`` (already on ``where.device``) for data parallelism with DDP.

    DDP broadcasts rank 0's parameters at construction, so every rank starts from the same weights, and
    averages gradients over ranks in the last backward of a step (the loop uses ``no_sync`` before it).
    """
    device_ids = [where.device.index] if where.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)

