"""The trainer memory benchmark (benchmarks/trainer_memory.py) without running it: the FSDP units its target counts are
the ones ``wrap_model`` shards, and its verdict follows every rank's figures against their targets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rljob_trainer.parallel import fsdp_units

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_memory.py"
_spec = importlib.util.spec_from_file_location("trainer_memory", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up while the script is executed
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("tied", [False, True])
def test_the_fsdp_units_of_the_pinned_model(tied):
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**dict(bench.MODEL, tie_word_embeddings=tied)))
    units = fsdp_units(model)
    blocks = list(model.model.layers)
    assert sum(p.numel() for p in blocks[0].parameters()) == pytest.approx(7.1e6, rel=1e-2)
    if tied:  # the shared embedding stays in the root unit
        assert units == blocks
        return
    assert units == [*blocks, model.model.embed_tokens, model.lm_head]
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(148.3e6, rel=1e-3)  # as MODEL's doc says


def test_the_largest_unit_is_the_untied_embedding_not_the_root(tmp_path):
    facts = bench.save_model(bench.QUICK_MODEL, tmp_path / "model")
    embedding = bench.QUICK_MODEL["vocab_size"] * bench.QUICK_MODEL["hidden_size"]
    assert (facts.largest_unit_name, facts.largest_unit, facts.largest_tensor) == (
        "model.embed_tokens", embedding, embedding)
    assert (tmp_path / "model" / "model.safetensors").is_file()


def rank(rank: int, load_peak: float, train_peak: float, shard_mb: float) -> dict:
    return {"rank": rank, "load_peak": load_peak * bench.MB, "train_peak": train_peak * bench.MB,
            "shard_bytes": shard_mb * bench.MB, "step_times": [1.0, 1.2], "samples": 1000}


def test_the_verdict_needs_every_fsdp_rank_within_both_targets(capsys):
    # P = 10M: 16P/2 = 80 MB; largest unit 1M elements: 8 MB unsharded; activations 20 MB.
    facts = bench.ModelFacts(parameters=10_000_000, largest_tensor=1_000_000, largest_unit=1_000_000,
                             largest_unit_name="model.embed_tokens")
    single = {"activation_peak": 20 * bench.MB, "train_peak": 200 * bench.MB, "baseline": 400 * bench.MB,
              "step_times": [1.0, 1.0]}
    # training target 1.15 x 80 + 8 + 20 = 120 MB; loading target 1.1 x (20 + 4) = 26.4 MB.
    ddp = [rank(0, 900, 900, 40), rank(1, 900, 900, 40)]  # DDP's figures are information only
    assert bench.report(facts, single, {("ddp", 2): ddp, ("fsdp", 2): [rank(0, 26, 119, 20), rank(1, 26, 119.9, 20)]}) == 0
    out = capsys.readouterr().out
    assert "| fsdp 2 | 1 | 26 MB | 26 MB met | 120 MB | 120 MB met | 80 MB |" in out
    assert "every target met" in out
    assert bench.report(facts, single, {("fsdp", 2): [rank(0, 26, 119, 20), rank(1, 26, 121, 20)]}) == 1
    assert "| fsdp 2 | 1 | 26 MB | 26 MB met | 121 MB | 120 MB MISSED |" in capsys.readouterr().out
    assert bench.report(facts, single, {("fsdp", 2): [rank(0, 27, 119, 20), rank(1, 26, 119, 20)]}) == 1
