"""The ``vllm`` backend: vLLM's async engine (``AsyncLLM``) on the pod's GPUs, or vLLM's CPU build without them.

vLLM is imported lazily (only when this backend is built), so the trainer image and the tests never need it.

* Engine: ``AsyncLLM`` from ``AsyncEngineArgs(model, tensor_parallel_size=max(1, gpusPerReplica),
  skip_tokenizer_init=True, generation_config="vllm", logprobs_mode=..., worker_extension_cls=WeightReceiverExtension,
  dtype=...)``, driven from an event loop on a thread of its own: prompts go in as token ids (the worker's own
  tokenizer made them), the checkpoint's generation defaults are ignored so only ``spec.rollout.sampling`` applies
  (but for its end-of-sequence ids: vLLM 0.32 adds those of the checkpoint's generation_config.json, else of its
  config.json, to ``stop_token_ids``, so a completion may also end at one the tokenizer does not name), and each
  worker process joins rljob's weight transfer itself (:mod:`.vllm_worker`). A ``tiny`` model is saved to a
  temporary directory first.
* Continuous batching: every group (one prompt, ``n`` samples) is its own request, submitted while others run and
  returned as soon as its samples finish (:meth:`VllmBackend.submit`, :meth:`VllmBackend.finished`), so a long
  completion holds up nothing but its own group.
* Sampling: ``SamplingParams(n, temperature, top_p, max_tokens, logprobs=0, stop_token_ids=[eos],
  detokenize=False, output_kind=FINAL_ONLY)``; ``logprobs=0`` returns the sampled token's log-probability only.
* Log-probabilities must be of ``softmax(logits / T)`` over the full vocabulary (:mod:`.base`). vLLM's
  ``processed_logprobs`` are taken after temperature *and* top-p, ``raw_logprobs`` before temperature. So:
  top-p = 1 → ``processed_logprobs`` (exactly the temperature-scaled distribution); top-p < 1 at temperature 1
  → ``raw_logprobs`` (the same thing at T = 1); top-p < 1 at another temperature cannot be served exactly and
  is refused at start (:func:`logprobs_mode`).
* In-flight weight updates (DESIGN §3): ``pause_generation(mode="keep")`` freezes the running requests, then
  ``collective_rpc("rljob_receive_weights", ...)`` runs the receive in every worker at once and each worker reloads
  in place through vLLM's ``reload_weights`` (:mod:`.vllm_worker`). A loaded update then resets the prefix cache
  *with the running requests* (``reset_running_requests=True``: they are preempted and recompute their KV entries with
  the new weights when they resume, so every token is sampled by one set of weights over its whole context) and
  labels the engine with the new version (``update_weight_version``): vLLM reports each completion's
  ``weight_versions`` spans, which become :attr:`Completion.versions`. A torn update aborts the kept requests (their
  groups come back as None) and leaves the worker without a version; an intact failure keeps them running on the
  old weights. Only method names, JSON, strings and integers cross ``collective_rpc`` (the default multi-process
  executor serialises nothing else).
* Memory on CPU (``gpusPerReplica: 0``): the KV cache is what the container's memory limit leaves after the engine's
  own :data:`~rljob_api.rules.VLLM_CPU_RESERVED_BYTES` and the weights (``kv_cache_memory_bytes``;
  :data:`~rljob_api.rules.VLLM_CPU_DEFAULT_KV_CACHE_BYTES` without a limit), and a limit that cannot hold one
  sequence of the model's full length stops the pod at start with both numbers (:func:`kv_cache_bytes`; admission
  refuses it already for a ``tiny`` model). On GPUs vLLM's ``gpu_memory_utilization`` sizes it.
* :meth:`VllmBackend.close` shuts the engine down: no EngineCore process is left behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import math
import multiprocessing
import queue
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence

import torch

from rljob_api import rules
from rljob_api.config import JobConfig
from rljob_api.spec import ModelSpec, SamplingSpec
from rljob_api.start_failure import StartFailure
from rljob_rollout.backends.base import Completion, GenerationBackend, Group, UpdateOutcome
from rljob_api.protocol import TransferTicket
from rljob_wire.model import load_from
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


def memory_limit_bytes(cgroup_root: str = "/sys/fs/cgroup") -> Optional[int]:
    """This container's memory limit (bytes) from its cgroup (v2 ``memory.max``, v1 ``memory/memory.limit_in_bytes``),
    or None when it has none."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            raw = Path(cgroup_root, name).read_text().strip()
        except OSError:
            continue
        if raw == "max" or int(raw) >= 2**62:  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
            return None
        return int(raw)
    return None


def kv_cache_bytes(limit: Optional[int], weight_bytes: int, sequence_bytes: int) -> int:
    """The KV cache of vLLM on CPU (bytes): :func:`rljob_api.rules.vllm_cpu_kv_cache`.

    Raises:
        StartFailure: (permanent) the limit leaves less than ``sequence_bytes``, the KV entries of one sequence of the model's full
            length (names the field, the limit, what it leaves and what is needed).
    """
    size, problem = rules.vllm_cpu_kv_cache(limit, weight_bytes, sequence_bytes)
    if problem is not None:
        raise StartFailure(f"spec.rollout.resources.limits.memory: {problem}")
    return size


def head_size(hf_config: Any) -> int:
    """The attention head size of the model ``hf_config`` describes: ``head_dim``, or hidden size / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def sequence_kv_bytes(hf_config: Any, dtype_bytes: int) -> int:
    """KV-cache bytes of one sequence of ``max_position_embeddings`` tokens of the model ``hf_config`` describes
    (:func:`rljob_api.rules.kv_bytes_per_sequence`)."""
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return rules.kv_bytes_per_sequence(hf_config.num_hidden_layers, kv_heads, head_size(hf_config), dtype_bytes,
                                       hf_config.max_position_embeddings)


def logprobs_mode(sampling: SamplingSpec) -> str:
    """vLLM's ``logprobs_mode`` that yields temperature-only log-probabilities for ``sampling``.

    Raises:
        ValueError: top-p < 1 with a temperature other than 1 (names both fields).
    """
    problem = rules.vllm_logprobs_problem(sampling.top_p, sampling.temperature)
    if problem is not None:
        raise ValueError(f"spec.rollout.sampling: {problem}")
    return "processed_logprobs" if sampling.top_p >= 1.0 else "raw_logprobs"


class VllmBackend(GenerationBackend):
    """vLLM's async engine on this pod's GPUs, or its CPU build without them (see the module docstring).

    Args:
        config: the resolved job config (model, sampling, gpusPerReplica).
        tokenizer: the job's tokenizer (its eos id stops generation).
        seed: sampling seed (rollout seed + replica index).
        vllm_module: the ``vllm`` module; tests pass a stand-in with the same ``AsyncEngineArgs`` / ``AsyncLLM`` /
            ``SamplingParams`` API.
        engine_options: extra keyword arguments for ``AsyncEngineArgs`` (e.g. ``gpu_memory_utilization``).

    Attributes:
        aborted: groups :meth:`finished` returned as None (aborted by torn updates, or ended by an engine error).

    Raises:
        ImportError: vLLM is not installed (use trainer_image/Dockerfile.vllm on GPUs, trainer_image/Dockerfile.cpu
            without; :func:`~rljob_rollout.backends.build_backend` says so as a StartFailure first).
        ValueError: unsupported sampling settings (:func:`logprobs_mode`).
        StartFailure: on CPU, what :meth:`_cpu_kv_cache` refuses.
    """

    continuous = True

    def __init__(
        self,
        config: JobConfig,
        tokenizer: Any,
        seed: int,
        *,
        vllm_module: Optional[ModuleType] = None,
        engine_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
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
            built = build_model(model, vocab_size, seed=config.spec.trainer.seed)
            built.save_pretrained(self._tmp.name)
            where, revision = self._tmp.name, None
            parameters, hf_config = sum(p.numel() for p in built.parameters()), built.config
        else:
            where = model.path if model.source == "path" else model.name
            revision = model.revision
            parameters, hf_config = None, None
        options = dict(engine_options or {})
        if config.spec.rollout.gpus_per_replica == 0 and "kv_cache_memory_bytes" not in options:
            options["kv_cache_memory_bytes"] = self._cpu_kv_cache(model, where, revision, parameters, hf_config,
                                                                  engine_dtype(config))
        arguments = self._vllm.AsyncEngineArgs(
            model=where,
            revision=revision,
            tensor_parallel_size=max(1, config.spec.rollout.gpus_per_replica),
            seed=seed,
            skip_tokenizer_init=True,
            generation_config="vllm",
            logprobs_mode=mode,
            worker_extension_cls=EXTENSION,
            dtype=engine_dtype(config),
            **options,
        )
        self._final_only = importlib.import_module(self._vllm.SamplingParams.__module__).RequestOutputKind.FINAL_ONLY
        self.aborted = 0
        self._done: queue.Queue = queue.Queue()
        self._running: dict[int, concurrent.futures.Future] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rljob-vllm-engine", daemon=True)
        self._thread.start()
        before = set(multiprocessing.active_children())
        try:
            self.engine = self._call(self._start(arguments))
        except BaseException:
            self._stop_loop()
            raise
        self._engine_processes = [p for p in multiprocessing.active_children() if p not in before]
        self.max_positions: Optional[int] = getattr(getattr(self.engine, "model_config", None), "max_model_len", None)
        """The longest sequence the engine runs (tokens, vLLM's max_model_len); None when it does not say."""

    @staticmethod
    def _cpu_kv_cache(model: ModelSpec, where: str, revision: Optional[str], parameters: Optional[int], hf_config: Any,
                      dtype: str) -> int:
        """The KV cache for vLLM on CPU (:func:`kv_cache_bytes`); a model's shape is read from its config.json and its
        parameter count from its safetensors headers (from the Hub for ``huggingface``, which vLLM downloads next
        anyway).

        Raises:
            StartFailure: (permanent) a head size vLLM's CPU attention cannot run, or a memory limit that cannot hold
                one sequence (:func:`kv_cache_bytes`); a config or safetensors header of ``model`` that cannot be read
                (:func:`~rljob_wire.model.load_from`).
        """
        dtype_bytes = 2 if dtype == "bfloat16" else 4
        if hf_config is None:
            from transformers import AutoConfig

            hf_config = load_from(model, "model", lambda: AutoConfig.from_pretrained(where, revision=revision))
        size = head_size(hf_config)
        if size not in rules.VLLM_CPU_HEAD_SIZES:
            raise StartFailure(
                f"spec.model: {where!r} has attention heads of size {size}, which vLLM's CPU attention (backend "
                f"'vllm' with spec.rollout.gpusPerReplica 0) cannot run: it runs head sizes "
                f"{', '.join(map(str, rules.VLLM_CPU_HEAD_SIZES))}; run this model on GPUs or with backend 'cpu'")
        if parameters is None:
            parameters = load_from(model, "model", lambda: _parameters(where, revision))
        limit = memory_limit_bytes()
        size = kv_cache_bytes(limit, parameters * dtype_bytes, sequence_kv_bytes(hf_config, dtype_bytes))
        log.info("vllm backend: KV cache %.2f GiB on CPU (container memory limit %s)", size / 2**30,
                 "none" if limit is None else f"{limit / 2**30:.2f} GiB")
        return size

    async def _start(self, arguments: Any) -> Any:
        return self._vllm.AsyncLLMEngine.from_engine_args(arguments)

    def _call(self, coroutine: Any, timeout_s: Optional[float] = None) -> Any:
        """Run ``coroutine`` on the engine's event loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def _params(self, n: int, sampling: SamplingSpec) -> Any:
        return self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            stop_token_ids=[self._eos] if self._eos is not None else None,
            detokenize=False,
            output_kind=self._final_only,
        )

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def submit(self, key: int, prompt_token_ids: Sequence[int], n: int, sampling: SamplingSpec) -> None:
        if key in self._running:
            raise ValueError(f"vllm backend: group {key} is already in flight")
        self._running[key] = asyncio.run_coroutine_threadsafe(
            self._sample(key, list(prompt_token_ids), self._params(n, sampling)), self._loop)

    async def _sample(self, key: int, prompt: list[int], params: Any) -> None:
        """One group's request; puts exactly one ``(key, completions | None | error)`` on the queue, whatever happens."""
        try:
            final = None
            async for output in self.engine.generate({"prompt_token_ids": prompt}, params, _request_id(key)):
                final = output
            ended = final is None or any(choice.finish_reason in ("abort", "error") for choice in final.outputs)
            self._done.put((key, None if ended else [_completion(choice) for choice in final.outputs]))
        except BaseException as error:  # noqa: BLE001 - handed to the worker's thread by finished()
            self._done.put((key, error))
            raise

    def finished(self, timeout_s: float) -> list[tuple[int, Group]]:
        """Groups that finished, waiting up to ``timeout_s`` seconds for the first one.

        Raises:
            RuntimeError: the engine failed a group (its error chained).
        """
        done: list[tuple[int, Group]] = []
        try:
            item = self._done.get(timeout=timeout_s) if self._running else None
            while item is not None:
                key, result = item
                self._running.pop(key, None)
                if isinstance(result, BaseException):
                    raise RuntimeError(f"vllm backend: the engine failed group {key}: {result!r}") from result
                self.aborted += result is None
                done.append((key, result))
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        return done

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingSpec) -> list[list[Completion]]:
        """All groups at once, through :meth:`submit` and :meth:`finished`; for tests and tools, with nothing else in
        flight.

        Raises:
            RuntimeError: groups of :meth:`submit` in flight, or the engine failed or aborted a group.
        """
        if self._running:
            raise RuntimeError(f"vllm backend: generate() with {len(self._running)} submitted groups in flight")
        keys = list(range(len(prompt_token_ids)))
        for key, prompt in zip(keys, prompt_token_ids):
            self.submit(key, prompt, n, sampling)
        results: dict[int, Group] = {}
        while len(results) < len(keys):
            results.update(self.finished(timeout_s=1.0))
        if any(results[key] is None for key in keys):
            raise RuntimeError("vllm backend: a weight update tore while generate() waited; its groups were aborted")
        return [results[key] for key in keys]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load host tensors into every worker (for tests and tools; updates use :meth:`receive_weights`): written to a
        temporary safetensors file, which each worker reloads from (:meth:`~.vllm_worker.WeightReceiverExtension.
        rljob_load_file`): only its path crosses the process boundary. Nothing may be in flight."""
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors}
        with tempfile.TemporaryDirectory(prefix="rljob-weights-") as directory:
            path = f"{directory}/weights.safetensors"
            save_file(tensors, path)
            self._call(self.engine.collective_rpc(LOAD_FILE_METHOD, args=(path,)))
        self._call(self.engine.reset_prefix_cache())

    def receive_weights(self, ticket: TransferTicket, address: StoreAddress, transfer_ranks: Sequence[int],
                        version: Optional[int] = None) -> UpdateOutcome:
        return self._call(self._update(ticket, address, transfer_ranks, version))

    async def _update(self, ticket: TransferTicket, address: StoreAddress, transfer_ranks: Sequence[int],
                      version: Optional[int]) -> UpdateOutcome:
        """Pause keeping the requests, receive and reload in every worker, then on success drop every KV entry (the
        kept requests recompute theirs with the new weights) and label what follows ``version``; on a torn update
        abort the kept requests; resume (module docstring)."""
        try:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            replies = await self.engine.collective_rpc(
                RECEIVE_METHOD, args=(ticket.to_json(), address.host, address.port, transfer_ranks[0]))
            outcome = _outcome(ticket, replies)
            if outcome is UpdateOutcome.LOADED:
                if not await self.engine.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError(f"vllm backend: after update {ticket.id} the engine did not drop its KV cache: "
                                       "the requests in flight would go on with entries of the old weights")
                if version is not None:
                    await self.engine.update_weight_version(str(version))
            elif outcome is UpdateOutcome.FAILED_TORN and self._running:
                kept = list(self._running)  # those already finished are not aborted: finished() returns them whole
                log.error("vllm backend: aborting the groups kept across update %s (%d in flight)", ticket.id, len(kept))
                await self.engine.abort([_request_id(key) for key in kept])
            return outcome
        finally:
            await self.engine.resume_generation()

    def close(self) -> None:
        """Shut the engine down and wait for its processes (EngineCore) to end, killing those still there after
        :data:`ENGINE_EXIT_S`; stop the event loop; remove a ``tiny`` model's directory."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=ENGINE_EXIT_S)
        deadline = time.monotonic() + ENGINE_EXIT_S
        for process in getattr(self, "_engine_processes", []):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("vllm backend: engine process %s still there %.0f s after shutdown: killed",
                            process.pid, ENGINE_EXIT_S)
                process.kill()
                process.join(5)
        self._stop_loop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(ENGINE_EXIT_S)


def _parameters(where: str, revision: Optional[str]) -> int:
    """Parameters in the safetensors files of the local directory ``where``, or of the Hub model ``where`` (its files'
    headers only)."""
    if not Path(where).is_dir():
        from huggingface_hub import get_safetensors_metadata

        return sum(get_safetensors_metadata(where, revision=revision).parameter_count.values())
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(where).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                total += math.prod(weights.get_slice(name).get_shape())
    return total


def _request_id(key: int) -> str:
    return f"rljob-{key}"


def _outcome(ticket: TransferTicket, replies: Sequence[dict[str, Any]]) -> UpdateOutcome:
    """One update's outcome from every worker's reply (:meth:`~.vllm_worker.WeightReceiverExtension.
    rljob_receive_weights`): loaded only when every worker loaded; torn as soon as one loaded a tensor otherwise."""
    outcomes = {reply["outcome"] for reply in replies}
    if outcomes == {"loaded"}:
        return UpdateOutcome.LOADED
    if any(reply["tensors_loaded"] for reply in replies):
        log.error("vllm backend: update %s left mixed weights: %s", ticket.id, replies)
        return UpdateOutcome.FAILED_TORN
    if outcomes == {"not_selected"}:
        return UpdateOutcome.NOT_SELECTED
    log.warning("vllm backend: update %s not loaded: %s", ticket.id, replies)
    return UpdateOutcome.FAILED_INTACT


def _completion(choice: Any) -> Completion:
    """A vLLM ``CompletionOutput`` (token_ids, logprobs = one {token id: Logprob} per token) as a :class:`Completion`."""
    tokens = tuple(int(t) for t in choice.token_ids)
    if choice.logprobs is None or len(choice.logprobs) != len(tokens):
        raise RuntimeError(f"vllm backend: expected one logprob entry per generated token, got {choice.logprobs!r}")
    logprobs = tuple(float(entry[token].logprob) for entry, token in zip(choice.logprobs, tokens))
    finish = "stop" if choice.finish_reason == "stop" else "length"
    return Completion(tokens, logprobs, finish, _token_versions(getattr(choice, "weight_versions", None), len(tokens)))


def _token_versions(spans: Optional[Sequence[Any]], count: int) -> Optional[tuple[int, ...]]:
    """The version of each of ``count`` tokens from vLLM's ``WeightVersionSpan``s (version label, [start, end)), or
    None when a token has no integer label (generated before the first update labelled the engine)."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        try:
            label = int(span.version)
        except (TypeError, ValueError):
            return None
        versions.extend([label] * (span.end - span.start))
    return tuple(versions) if len(versions) == count else None

