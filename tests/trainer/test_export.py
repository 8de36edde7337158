"""The safetensors export streamed from the shards (rljob_trainer.export) against transformers' own save.

Two real gloo ranks (spawned, file:// rendezvous) build the tiny Llama, wrap it with DDP and with FSDP2, train one
step and export it twice: streamed (one file, and split into several with a 4 KB limit) and the previous way (the full
state dict gathered to rank 0, ``save_pretrained``). Every tensor, config.json and generation_config.json must be
equal; ``from_pretrained`` reads the split export with its index; a tied-embedding model saves the tied weight once,
as transformers does. A wrapper around ``DTensor.full_tensor`` counts how many gathered tensors are still alive at
each gather: the streamed export holds one at a time (the memory figure itself is in benchmarks/checkpoint_export.py).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from rljob_trainer.export import SafetensorsFile, TensorEntry, plan_files
from rljob_wire.model import DigitTokenizer, build_model
from train_harness import init_gloo, make_config, run_ranks

torch.set_num_threads(1)
SMALL_SHARDS = 4096  # bytes: the tiny model's 12 tensors (~9.5 KB) land in several files


def export_worker(rank: int, world_size: int, tmp_dir: str, trainers: dict, out_root: str) -> None:
    """Each strategy: wrap, train one step, export streamed / split / gathered; then a tied model; record the gathers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from rljob_trainer.export import export_hugging_face
    from rljob_trainer.parallel import Distributed, ParallelDims, wrap_model

    init_gloo(rank, world_size, tmp_dir)
    out = Path(out_root)
    gathers = {"calls": 0, "alive_at_call": []}
    alive: list[weakref.ref] = []
    original = DTensor.full_tensor

    def counting_full_tensor(self, *args, **kwargs):
        gathers["alive_at_call"].append(sum(ref() is not None for ref in alive))
        gathers["calls"] += 1
        full = original(self, *args, **kwargs)
        alive.append(weakref.ref(full))
        return full

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for strategy, trainer in trainers.items():
        model = build_model(make_model_spec(), DigitTokenizer().vocab_size, seed=5)
        dims = ParallelDims(world_size, world_size, strategy=strategy)
        where = Distributed(rank, world_size, 0, torch.device("cpu"), "gloo", dims, mesh if strategy == "fsdp" else None)
        parallel = wrap_model(model, where, trainer)
        optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-2)
        ids = torch.randint(0, DigitTokenizer().vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
        parallel.module(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        DTensor.full_tensor = counting_full_tensor
        alive.clear()
        export_hugging_face(parallel.model, out / strategy / "streamed", writer=rank == 0)
        DTensor.full_tensor = original
        export_hugging_face(parallel.model, out / strategy / "split", writer=rank == 0, max_shard_bytes=SMALL_SHARDS)
        full = get_model_state_dict(parallel.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            parallel.model.save_pretrained(out / strategy / "gathered", state_dict=full)
        dist.barrier()

    config = LlamaConfig(vocab_size=14, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(3)
    tied = LlamaForCausalLM(config)
    if rank == 0:
        tied.save_pretrained(out / "tied" / "reference")  # transformers' own save of the same unsharded weights
    from torch.distributed.fsdp import fully_shard

    for layer in tied.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(tied, mesh=mesh)
    export_hugging_face(tied, out / "tied" / "streamed", writer=rank == 0)
    if rank == 0:
        (out / "gathers.json").write_text(json.dumps(gathers))
    dist.destroy_process_group()


def make_model_spec():
    return make_config(_NoRedis(), Path("/nonexistent"), processes=1).spec.model


class _NoRedis:
    """What make_config reads of a Redis server to resolve a config (nothing connects)."""

    host, port = "127.0.0.1", 1


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    trainers = {s: make_config(_NoRedis(), tmp, parallelism={"strategy": s}).spec.trainer for s in ("ddp", "fsdp")}
    run_ranks(export_worker, 2, tmp, trainers, str(tmp / "out"))
    return tmp / "out"


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}, file
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_streamed_export_equals_transformers_save_of_the_gathered_state(exports, strategy):
    streamed, gathered = exports / strategy / "streamed", exports / strategy / "gathered"
    assert sorted(p.name for p in streamed.iterdir()) == sorted(p.name for p in gathered.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    ours, theirs = load_file(streamed / "model.safetensors"), load_file(gathered / "model.safetensors")
    assert list(ours) != [] and ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype == torch.float32, name
        assert torch.equal(ours[name], theirs[name]), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((streamed / name).read_text()) == json.loads((gathered / name).read_text()), name
    assert json.loads((streamed / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    initial = build_model(make_model_spec(), DigitTokenizer().vocab_size, seed=5).state_dict()
    assert not torch.equal(ours["lm_head.weight"], initial["lm_head.weight"])  # the trained step is in the export


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_split_export_has_an_index_and_loads_with_from_pretrained(exports, strategy):
    from transformers import AutoModelForCausalLM

    split = exports / strategy / "split"
    index = json.loads((split / "model.safetensors.index.json").read_text())
    files = sorted(split.glob("model-*.safetensors"))
    names = [f.name for f in files]
    assert len(files) >= 3 and names == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert set(index["weight_map"].values()) == set(names)
    reference = load_file(exports / strategy / "gathered" / "model.safetensors")
    sizes = {name: t.numel() * t.element_size() for name, t in reference.items()}
    assert index["metadata"] == {"total_size": sum(sizes.values()), "total_parameters": sum(t.numel() for t in reference.values())}
    for file in files:
        held = load_file(file)
        assert {n for n, f in index["weight_map"].items() if f == file.name} == held.keys()
        assert sum(sizes[n] for n in held) <= SMALL_SHARDS or len(held) == 1, file.name
    split_model = AutoModelForCausalLM.from_pretrained(split)
    for name, value in reference.items():
        assert torch.equal(split_model.state_dict()[name], value), name


def test_tied_weights_are_saved_once_as_transformers_saves_them(exports):
    from transformers import AutoModelForCausalLM

    ours, theirs = tensors_of(exports / "tied" / "streamed"), tensors_of(exports / "tied" / "reference")
    assert "lm_head.weight" not in ours and ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(exports / "tied" / "streamed")
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.lm_head.weight, theirs["model.embed_tokens.weight"])


def test_the_streamed_export_holds_one_gathered_tensor_at_a_time(exports):
    gathers = json.loads((exports / "gathers.json").read_text())
    tensors = len(load_file(exports / "fsdp" / "streamed" / "model.safetensors"))
    assert gathers["calls"] == tensors == 12  # one gather per tensor of the fsdp export (ddp gathers nothing)
    assert gathers["alive_at_call"] == [0] * tensors  # the previous one was freed before each gather


def test_plan_files_splits_orders_by_element_size_and_pads_the_header():
    tensors = {
        "a.bf16": (torch.bfloat16, (3,)),  # 6 bytes: an odd element count of a 2-byte type
        "b.f32": (torch.float32, (2, 2)),  # 16 bytes
        "c.i64": (torch.int64, (1,)),  # 8 bytes
        "d.big": (torch.float32, (40,)),  # 160 bytes: above the limit, a file alone
        "e.scalar": (torch.float32, ()),  # 4 bytes
    }
    files = plan_files(tensors, max_shard_bytes=32)
    assert [f.filename for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files[0] == SafetensorsFile(files[0].filename, (
        TensorEntry("c.i64", torch.int64, (1,), 0, 8),
        TensorEntry("b.f32", torch.float32, (2, 2), 8, 24),
        TensorEntry("a.bf16", torch.bfloat16, (3,), 24, 30),
    ))
    assert [e.name for e in files[1].entries] == ["d.big"] and files[1].nbytes == 160
    assert files[2].entries == (TensorEntry("e.scalar", torch.float32, (), 0, 4),)
    header = files[0].header({"format": "pt"})
    size = int.from_bytes(header[:8], "little")
    assert size == len(header) - 8 and len(header) % 8 == 0 and header[8:9] == b"{"
    assert json.loads(header[8:]) == {
        "__metadata__": {"format": "pt"},
        "c.i64": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
        "b.f32": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]},
        "a.bf16": {"dtype": "BF16", "shape": [3], "data_offsets": [24, 30]},
    }
    assert [f.filename for f in plan_files(tensors, max_shard_bytes=10**9)] == ["model.safetensors"]
    with pytest.raises(KeyError):
        plan_files({"x": (torch.complex64, (2,))}, 100)
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        plan_files(tensors, 0)
