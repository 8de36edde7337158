"""Loading the trainer's model on the meta device (issue 10 item 3, rljob_trainer/loading.py).

Two real gloo ranks (``init_distributed`` of an fsdp config) build each model with ``load_model``, the trainer's own
path: meta construction, ``fully_shard``, ``to_empty``, then the weights one tensor at a time. Each case compares the
logits of a fixed batch and every gathered parameter with a whole model built in this process the usual way:
``from_pretrained`` of the same Hugging Face directory (a random tiny Llama written by ``save_pretrained`` in
tmp_path: float32 in one file; bfloat16 with tied embeddings in several files with an index, beside a stray
``consolidated.safetensors`` of another layout), or ``build_model``'s seeded tiny Llama. The parameters must be equal
bit for bit (a bf16 file is widened to float32 exactly); the logits within 1e-6 (the same kernels on the same
weights; FSDP only gathers them).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_files import save_tokenizer
from portutil import free_port
from rljob_api.spec import ModelSpec
from rljob_trainer.loading import (
    empty_model,
    init_tiny_weights,
    load_pretrained,
    materialize,
    model_config,
    safetensors_files,
)
from rljob_wire.model import DigitTokenizer, build_model, tiny_config
from train_harness import TINY, make_config, run_ranks

SEED = 5
VOCAB = 41  # odd: the two ranks' shards of the embedding differ (21 and 20 rows)
IDS = torch.tensor([[1, 5, 9, 13, 3, 7, 2, 11, 4, 6], [1, 12, 8, 3, 10, 9, 5, 0, 0, 0]]) % 14  # [2, 10], ids < 14
MASK = (IDS != 0) | (torch.arange(10) < 7)


def save_llama(directory: Path, *, tie: bool, dtype: torch.dtype, shard: bool) -> None:
    """A seeded random Llama (vocab 41, hidden 18, 2 layers, GQA 3/1 heads) written by ``save_pretrained``; ``shard``:
    several safetensors files and ``model.safetensors.index.json``."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=18, intermediate_size=30, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=tie, pad_token_id=0)
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(dtype).save_pretrained(directory, max_shard_size="2KB" if shard else "5GB")


def tiny_spec(tiny: dict) -> ModelSpec:
    return ModelSpec.model_validate({"source": "tiny", "tiny": tiny})


# --- one process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiny", [TINY, {}], ids=["harness-tiny", "default-tiny"])
@pytest.mark.parametrize("seed", [0, SEED])
def test_tiny_replay_equals_build_model_bit_for_bit(tiny, seed):
    spec = tiny_spec(tiny)
    expected = build_model(spec, DigitTokenizer().vocab_size, seed)
    config = tiny_config(spec, DigitTokenizer().vocab_size)
    model = empty_model(config)
    materialize(model, torch.device("cpu"))
    rng = torch.get_rng_state()
    init_tiny_weights(model, config, seed)

    assert torch.equal(torch.get_rng_state(), rng)  # the global generator is left as it was
    assert model.state_dict().keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for name, buffer in expected.named_buffers():  # RoPE's inv_freq, recomputed by materialize
        assert torch.equal(model.get_buffer(name), buffer), name


def test_load_pretrained_in_one_process_equals_from_pretrained(tmp_path):
    save_llama(tmp_path / "m", tie=True, dtype=torch.bfloat16, shard=True)
    assert len(safetensors_files(tmp_path / "m")) > 1
    model = empty_model(model_config(ModelSpec(source="path", path=str(tmp_path / "m")), 0, tmp_path / "m"))
    materialize(model, torch.device("cpu"))
    load_pretrained(model, tmp_path / "m")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)

    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for name, value in expected.state_dict().items():
        assert model.state_dict()[name].dtype == torch.float32
        assert torch.equal(model.state_dict()[name], value), name


def test_a_directory_without_safetensors_is_refused_with_its_name(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"model directory {tmp_path} holds no \\*.safetensors file"):
        safetensors_files(tmp_path)


def test_an_index_naming_a_missing_file_is_refused(tmp_path):
    save_llama(tmp_path, tie=False, dtype=torch.float32, shard=True)
    first = safetensors_files(tmp_path)[0]
    first.unlink()
    with pytest.raises(FileNotFoundError, match=f"names missing files \\['{first.name}'\\]"):
        safetensors_files(tmp_path)


def test_weights_of_another_shape_are_refused_with_the_directory(tmp_path):
    save_llama(tmp_path / "m", tie=False, dtype=torch.float32, shard=False)
    spec = tiny_spec(TINY)  # hidden 16, not 18
    model = empty_model(tiny_config(spec, VOCAB))
    materialize(model, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"model directory {tmp_path / 'm'} does not match LlamaForCausalLM"):
        load_pretrained(model, tmp_path / "m")


# --- two gloo ranks -------------------------------------------------------------------------------------------------
def load_worker(rank: int, world_size: int, tmp_dir: str, port: int, cases: dict) -> None:
    """Build every case's model with ``load_model`` on this rank; rank 0 saves its logits and gathered parameters."""
    from rljob_api.config import JobConfig
    from rljob_trainer.loading import load_model
    from rljob_trainer.parallel import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    config = JobConfig.from_json(Path(tmp_dir, "config.json").read_text())
    where = init_distributed(config)
    try:
        out = {}
        for tag, (spec_json, strategy, frozen) in cases.items():
            trainer = config.spec.trainer
            trainer = trainer.model_copy(update={"parallelism": trainer.parallelism.model_copy(update={"strategy": strategy})})
            parallel = load_model(ModelSpec.model_validate_json(spec_json), DigitTokenizer().vocab_size, SEED, where, trainer,
                                  frozen=frozen)
            with torch.no_grad():
                logits = parallel.module(input_ids=IDS, attention_mask=MASK).logits
            full = {name: value.full_tensor() if hasattr(value, "full_tensor") else value.detach()
                    for name, value in parallel.model.state_dict().items()}
            embedding = parallel.model.get_input_embeddings().weight
            rows = (embedding.to_local() if hasattr(embedding, "to_local") else embedding).shape[0]
            out[tag] = {"logits": logits, "state": full, f"embedding_rows_{rank}": rows,
                        "requires_grad": sorted({p.requires_grad for p in parallel.model.parameters()}),
                        "module": type(parallel.module).__name__, "training": parallel.model.training}
        torch.save(out, Path(tmp_dir, f"rank-{rank}.pt"))
    finally:
        shutdown_distributed()


@pytest.fixture(scope="module")
def two_rank_loads(tmp_path_factory):
    """Every case loaded once by 2 gloo ranks: {tag: (rank 0's output, rank 1's output, expected whole model)}."""
    tmp = tmp_path_factory.mktemp("loading")
    save_llama(tmp / "fp32", tie=False, dtype=torch.float32, shard=False)
    save_llama(tmp / "bf16-tied", tie=True, dtype=torch.bfloat16, shard=True)
    # Another layout of the same weights, as Mistral's repositories carry: the index keeps the reader off it.
    save_file({"model.norm.weight": torch.zeros(3), "tok_embeddings.weight": torch.zeros(2, 2)},
              str(tmp / "bf16-tied" / "consolidated.safetensors"))
    config = make_config(SimpleNamespace(host="127.0.0.1", port=1), tmp / "checkpoints", processes=2,
                         parallelism={"strategy": "fsdp"})  # Redis is never contacted
    (tmp / "config.json").write_text(config.to_json())

    def path(name: str) -> ModelSpec:
        return ModelSpec(source="path", path=str(tmp / name))

    specs = {"tiny-fsdp": (tiny_spec(TINY), "fsdp", False), "fp32-fsdp": (path("fp32"), "fsdp", False),
             "bf16-tied-sharded-fsdp": (path("bf16-tied"), "fsdp", False), "fp32-ddp": (path("fp32"), "ddp", False),
             # the KL penalty's reference policy: frozen, sharded like the trained model
             "tiny-fsdp-frozen": (tiny_spec(TINY), "fsdp", True), "fp32-ddp-frozen": (path("fp32"), "ddp", True)}
    run_ranks(load_worker, 2, tmp, free_port(),
              {tag: (spec.model_dump_json(), s, frozen) for tag, (spec, s, frozen) in specs.items()})
    outputs = [torch.load(tmp / f"rank-{rank}.pt", weights_only=False) for rank in (0, 1)]
    expected = {
        "tiny-fsdp": build_model(tiny_spec(TINY), DigitTokenizer().vocab_size, SEED),
        "fp32-fsdp": AutoModelForCausalLM.from_pretrained(tmp / "fp32", dtype=torch.float32),
        "bf16-tied-sharded-fsdp": AutoModelForCausalLM.from_pretrained(tmp / "bf16-tied", dtype=torch.float32),
        "fp32-ddp": AutoModelForCausalLM.from_pretrained(tmp / "fp32", dtype=torch.float32),
    }
    expected["tiny-fsdp-frozen"], expected["fp32-ddp-frozen"] = expected["tiny-fsdp"], expected["fp32-ddp"]
    return {tag: (outputs[0][tag], outputs[1][tag], expected[tag]) for tag in specs}


@pytest.mark.parametrize("tag", ["tiny-fsdp", "fp32-fsdp", "bf16-tied-sharded-fsdp", "fp32-ddp", "tiny-fsdp-frozen",
                                 "fp32-ddp-frozen"])
def test_two_ranks_load_the_same_model_as_one_process(two_rank_loads, tag):
    rank0, rank1, expected = two_rank_loads[tag]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            expected_logits = expected(input_ids=IDS, attention_mask=MASK).logits
    finally:
        torch.set_num_threads(threads)

    for out in (rank0, rank1):
        torch.testing.assert_close(out["logits"], expected_logits, rtol=1e-6, atol=1e-6)
    assert rank0["state"].keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert rank0["state"][name].dtype == torch.float32, name
        assert torch.equal(rank0["state"][name], value), name


@pytest.mark.parametrize("tag,rows", [("tiny-fsdp", (7, 7)), ("fp32-fsdp", (21, 20)), ("fp32-ddp", (41, 41)),
                                      ("tiny-fsdp-frozen", (7, 7)), ("fp32-ddp-frozen", (41, 41))])
def test_each_fsdp_rank_holds_only_its_rows(two_rank_loads, tag, rows):
    rank0, rank1, _ = two_rank_loads[tag]
    assert (rank0["embedding_rows_0"], rank1["embedding_rows_1"]) == rows


# --- one rank -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie,dtype,shard", [(False, torch.float32, False), (True, torch.bfloat16, True)],
                         ids=["fp32", "bf16-tied-sharded"])
def test_one_fsdp_rank_loads_the_same_logits_as_from_pretrained(no_torchrun_env, tmp_path, tie, dtype, shard):
    """A world of one (``init_distributed`` without torchrun): ``load_model`` under fsdp shards over a mesh of one
    rank, so its DTensors hold every row; the logits and every parameter equal ``from_pretrained``'s."""
    from rljob_trainer.loading import load_model
    from rljob_trainer.parallel import init_distributed, shutdown_distributed

    save_llama(tmp_path / "m", tie=tie, dtype=dtype, shard=shard)
    spec = {"source": "path", "path": str(tmp_path / "m")}
    config = make_config(SimpleNamespace(host="127.0.0.1", port=1), tmp_path / "checkpoints", processes=1,
                         parallelism={"strategy": "fsdp"}, model=spec)  # Redis is never contacted
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    where = init_distributed(config)
    try:
        parallel = load_model(config.spec.model, 0, SEED, where, config.spec.trainer)
        assert parallel.sharded and where.mesh.size() == 1
        with torch.no_grad():
            logits = parallel.module(input_ids=IDS, attention_mask=MASK).logits
            expected_logits = expected(input_ids=IDS, attention_mask=MASK).logits
        state = {name: value.full_tensor() for name, value in parallel.model.state_dict().items()}
    finally:
        shutdown_distributed()

    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    assert state.keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("tag, module", [("tiny-fsdp", "LlamaForCausalLM"), ("fp32-ddp", "DistributedDataParallel"),
                                         ("tiny-fsdp-frozen", "LlamaForCausalLM"), ("fp32-ddp-frozen", "LlamaForCausalLM")])
def test_a_frozen_reference_is_sharded_like_the_policy_and_needs_no_gradient(two_rank_loads, tag, module):
    """The KL penalty's reference (``frozen``): fsdp shards it as the trained model (same rows above), ddp keeps its
    replica without the DDP wrapper (nothing to reduce); no parameter requires a gradient, and it is in eval mode."""
    for out in two_rank_loads[tag][:2]:
        frozen = tag.endswith("frozen")
        assert (out["requires_grad"], out["training"]) == ([not frozen], not frozen)
        assert out["module"].endswith(module)


# --- a start from a checkpoint --------------------------------------------------------------------------------------
@pytest.mark.parametrize("start", ["initFrom", "own"])
def test_a_start_from_a_checkpoint_reads_no_pretrained_weights(redis_server, tmp_path, monkeypatch, start):
    """``model.source: path`` whose safetensors are gone, and a checkpoint of that model to start from: another job's
    (``initFrom``) or the job's own (a resume): the trainer starts (it never reads the Hugging Face weights) and holds
    the checkpoint's weights after ``resume``."""
    from rljob_trainer.checkpoint import CheckpointManager
    from rljob_trainer.parallel import init_distributed, shutdown_distributed
    from rljob_trainer.trainer import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    save_llama(tmp_path / "model", tie=False, dtype=torch.float32, shard=False)
    save_tokenizer(tmp_path / "model")
    model_spec = {"source": "path", "path": str(tmp_path / "model")}
    client = redis_server.client()

    config = make_config(redis_server, tmp_path / "job", processes=1, model=model_spec,
                         init_from=str(tmp_path / "other-job") if start == "initFrom" else None,
                         parallelism={"strategy": "fsdp"})
    # The job that writes the checkpoint: another one (its default strategy), or this one.
    writer = make_config(redis_server, tmp_path / "other-job", processes=1, model=model_spec) if start == "initFrom" \
        else config
    where = init_distributed(writer)
    try:
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
        with torch.no_grad():
            for parameter in trained.parameters():
                parameter.add_(0.5)  # not the file's weights any more
        optimizer = torch.optim.AdamW(trained.parameters())
        manager = CheckpointManager(writer, where, client)
        try:
            manager.save(3, 12, trained, optimizer, [])
            manager.wait()  # the save is asynchronous: committed before the process group goes
        finally:
            manager.close()
    finally:
        shutdown_distributed()
    for weights in (tmp_path / "model").glob("*.safetensors"):
        weights.unlink()

    where = init_distributed(config)
    trainer = None
    try:
        trainer = Trainer(config, where, client)
        trainer.resume()
        assert (trainer.step, trainer.documents_seen) == (3, 12)
        for name, value in trained.state_dict().items():
            assert torch.equal(trainer.model.state_dict()[name].full_tensor(), value), name
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()
