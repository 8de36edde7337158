"""The ``vllm`` backend: vLLM's offline ``LLM`` engine on the pod's GPUs (an optional extra, rollout GPU image only).

vLLM is imported lazily (only when this backend is built), so the trainer image and the tests never need it.

* Engine: ``LLM(model, tensor_parallel_size=gpusPerReplica, skip_tokenizer_init=True, generation_config="vllm",
  logprobs_mode=..., worker_extension_cls=WeightReceiverExtension)``: prompts go in as token ids (the worker's
  own tokenizer made them), the checkpoint's generation defaults are ignored so only ``spec.rollout.sampling``
  applies, and each GPU worker joins rljob's weight transfer itself (:mod:`.vllm_worker`). A ``tiny`` model is
  saved to a temporary directory first.
* Sampling: ``SamplingParams(n, temperature, top_p, max_tokens, logprobs=0, stop_token_ids=[eos],
  detokenize=False)``; ``logprobs=0`` returns the sampled token's log-probability only.
* Log-probabilities must be of ``softmax(logits / T)`` over the full vocabulary (:mod:`.base`). vLLM's
  ``processed_logprobs`` are taken after temperature *and* top-p, ``raw_logprobs`` before temperature. So:
  top-p = 1 → ``processed_logprobs`` (exactly the temperature-scaled distribution); top-p < 1 at temperature 1
  → ``raw_logprobs`` (the same thing at T = 1); top-p < 1 at another temperature cannot be served exactly and
  is refused at start (:func:`logprobs_mode`).
* Weight updates: ``collective_rpc("rljob_receive_weights", ...)`` runs the receive in every worker at once,
  between ``generate`` calls (the worker loop is single-threaded, so requests in flight finish on the old
  weights first), and each worker reloads in place through vLLM's ``reload_weights`` (:mod:`.vllm_worker`); the
  prefix cache is reset after a successful update, since its KV entries came from the old weights. Only method
  names, JSON, strings and integers cross ``collective_rpc`` (the default multi-process executor serialises
  nothing else).
* :meth:`VllmBackend.close` shuts the engine down: no EngineCore process is left behind.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import tempfile
import time
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence

import torch

from rljob_api.config import JobConfig
from rljob_api.spec import SamplingSpec
from rljob_rollout.backends.base import Completion, GenerationBackend, UpdateOutcome
from rljob_api.protocol import TransferTicket
from rljob_wire.transfer import StoreAddress

log = logging.getLogger(__name__)

EXTENSION = "rljob_rollout.backends.vllm_worker.WeightReceiverExtension"
RECEIVE_METHOD = "rljob_receive_weights"
LOAD_FILE_METHOD = "rljob_load_file"
ENGINE_EXIT_S = 10.0
"""How long :meth:`VllmBackend.close` waits for the engine's processes after asking them to shut down (seconds)."""


def engine_dtype(config: JobConfig) -> str:
    """The dtype vLLM runs the model in: that of the weights the trainer publishes, so the log-probabilities it
    returns are those the trainer recomputes (bfloat16 with ``precision.param`` bf16 on GPUs, float32 otherwise; vLLM's
    own ``auto`` would run a float32 checkpoint in bfloat16 on CPU)."""
    on_gpus = config.spec.rollout.gpus_per_replica > 0
    return "bfloat16" if on_gpus and config.spec.trainer.precision.param == "bf16" else "float32"


def logprobs_mode(sampling: SamplingSpec) -> str:
    """vLLM's ``logprobs_mode`` that yields temperature-only log-probabilities for ``sampling``.

    Raises:
        ValueError: top-p < 1 with a temperature other than 1 (names both fields).
    """
    if sampling.top_p >= 1.0:
        return "processed_logprobs"
    if sampling.temperature == 1.0:
        return "raw_logprobs"
    raise ValueError(
        f"spec.rollout.sampling: topP = {sampling.top_p} < 1 with temperature = {sampling.temperature} != 1 is not "
        "supported by the vllm backend: vLLM cannot return log-probabilities of the temperature-scaled, untruncated "
        "distribution the trainer recomputes. Use topP = 1, or temperature = 1."
    )


class VllmBackend(GenerationBackend):
    """vLLM generation on this pod's GPUs (see the module docstring).

    Args:
        config: the resolved job config (model, sampling, gpusPerReplica).
        tokenizer: the job's tokenizer (its eos id stops generation).
        seed: sampling seed (rollout seed + replica index).
        vllm_module: the ``vllm`` module; tests pass a stand-in with the same ``LLM`` / ``SamplingParams`` API.
        engine_options: extra keyword arguments for ``vllm.LLM`` (e.g. ``gpu_memory_utilization``).

    Raises:
        ImportError: vLLM is not installed (use the rollout GPU image, trainer_image/Dockerfile.vllm).
        ValueError: unsupported sampling settings (:func:`logprobs_mode`).
    """

    def __init__(
        self,
        config: JobConfig,
        tokenizer: Any,
        seed: int,
        *,
        vllm_module: Optional[ModuleType] = None,
        engine_options: Optional[dict[str, Any]] = None,
    ) -> None:
        sampling = config.spec.rollout.sampling
        mode = logprobs_mode(sampling)
        self._vllm = vllm_module or importlib.import_module("vllm")
        self._eos = getattr(tokenizer, "eos_token_id", None)
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        model = config.spec.model
        if model.source == "tiny":
            from rljob_wire.model import build_model

            self._tmp = tempfile.TemporaryDirectory(prefix="rljob-tiny-")
            vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size  # as the trainer
            build_model(model, vocab_size, seed=config.spec.trainer.seed).save_pretrained(self._tmp.name)
            where, revision = self._tmp.name, None
        else:
            where = model.path if model.source == "path" else model.name
            revision = model.revision
        before = set(multiprocessing.active_children())
        self.llm = self._vllm.LLM(
            model=where,
            revision=revision,
            tensor_parallel_size=max(1, config.spec.rollout.gpus_per_replica),
            seed=seed,
            skip_tokenizer_init=True,
            generation_config="vllm",
            logprobs_mode=mode,
            worker_extension_cls=EXTENSION,
            dtype=engine_dtype(config),
            **(engine_options or {}),
        )
        self._engine_processes = [p for p in multiprocessing.active_children() if p not in before]

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingSpec) -> list[list[Completion]]:
        params = self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            stop_token_ids=[self._eos] if self._eos is not None else None,
            detokenize=False,
        )
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[_completion(choice) for choice in output.outputs] for output in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load host tensors into every worker (for tests and tools; updates use :meth:`receive_weights`): written to a
        temporary safetensors file, which each worker reloads from (:meth:`~.vllm_worker.WeightReceiverExtension.
        rljob_load_file`): only its path crosses the process boundary."""
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors}
        with tempfile.TemporaryDirectory(prefix="rljob-weights-") as directory:
            path = f"{directory}/weights.safetensors"
            save_file(tensors, path)
            self.llm.collective_rpc(LOAD_FILE_METHOD, args=(path,))
        self.llm.reset_prefix_cache()

    def receive_weights(self, ticket: TransferTicket, address: StoreAddress, transfer_ranks: Sequence[int]) -> UpdateOutcome:
        replies = self.llm.collective_rpc(RECEIVE_METHOD, args=(ticket.to_json(), address.host, address.port, transfer_ranks[0]))
        outcomes = {reply["outcome"] for reply in replies}
        if outcomes == {"loaded"}:
            self.llm.reset_prefix_cache()
            return UpdateOutcome.LOADED
        if any(reply["tensors_loaded"] for reply in replies):
            log.error("vllm backend: update %s left mixed weights: %s", ticket.id, replies)
            return UpdateOutcome.FAILED_TORN
        if outcomes == {"not_selected"}:
            return UpdateOutcome.NOT_SELECTED
        log.warning("vllm backend: update %s not loaded: %s", ticket.id, replies)
        return UpdateOutcome.FAILED_INTACT

    def close(self) -> None:
        """Shut the engine down and wait for its processes (EngineCore) to end, killing those still there after
        :data:`ENGINE_EXIT_S`; remove a ``tiny`` model's directory."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        deadline = time.monotonic() + ENGINE_EXIT_S
        for process in self._engine_processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("vllm backend: engine process %s still there %.0f s after shutdown: killed",
                            process.pid, ENGINE_EXIT_S)
                process.kill()
                process.join(5)
        if self._tmp is not None:
            self._tmp.cleanup()


def _completion(choice: Any) -> Completion:
    """A vLLM ``CompletionOutput`` (token_ids, logprobs = one {token id: Logprob} per token) as a :class:`Completion`."""
    tokens = tuple(int(t) for t in choice.token_ids)
    if choice.logprobs is None or len(choice.logprobs) != len(tokens):
        raise RuntimeError(f"vllm backend: expected one logprob entry per generated token, got {choice.logprobs!r}")
    logprobs = tuple(float(entry[token].logprob) for entry, token in zip(choice.logprobs, tokens))
    finish = "stop" if choice.finish_reason == "stop" else "length"
    return Completion(tokens, logprobs, finish)

