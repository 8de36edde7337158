"""Generation backends behind one interface (:class:`~.base.GenerationBackend`): ``cpu`` and ``vllm``."""

from __future__ import annotations

import importlib.util
from typing import Any

from rljob_api.config import JobConfig
from rljob_api.start_failure import StartFailure
from rljob_rollout.backends.base import Completion, GenerationBackend, UpdateOutcome


def build_backend(config: JobConfig, tokenizer: Any, seed: int) -> GenerationBackend:
    """The backend named by ``spec.rollout.backend``, seeded with ``seed``.

    Raises:
        StartFailure: ``vllm`` on an image without vLLM, or with GPUs on an image whose vLLM is the CPU build
            (permanent; names the field, its value and the image), or what :class:`~rljob_rollout.backends.vllm.VllmBackend` refuses at start.
        ValueError: sampling settings the backend cannot serve exactly (names the field).
    """
    if config.spec.rollout.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise StartFailure(
                f"spec.rollout.backend: 'vllm' needs vLLM, which the rollout image {config.spec.rollout.image!r} does "
                "not have: set spec.rollout.image to an image with vLLM (GPUs: trainer_image/Dockerfile.vllm; "
                "gpusPerReplica 0: rljob/trainer-cpu, trainer_image/Dockerfile.cpu), or backend to 'cpu'")
        gpus = config.spec.rollout.gpus_per_replica
        if gpus > 0 and vllm_cpu_build():
            raise StartFailure(
                f"spec.rollout.gpusPerReplica: {gpus}, but the vLLM of the rollout image {config.spec.rollout.image!r} "
                "is its CPU build (vllm-cpu), which runs no GPU: set spec.rollout.image to an image with vLLM for GPUs "
                "(trainer_image/Dockerfile.vllm), or gpusPerReplica to 0 to run it on CPU")
        from rljob_rollout.backends.vllm import VllmBackend

        return VllmBackend(config, tokenizer, seed)
    from rljob_rollout.backends.cpu import CpuBackend

    return CpuBackend.from_config(config, tokenizer, seed)


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution, rljob/trainer-cpu's)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


__all__ = ["Completion", "GenerationBackend", "UpdateOutcome", "build_backend"]
