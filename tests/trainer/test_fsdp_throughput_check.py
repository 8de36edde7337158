"""The FSDP throughput device check (benchmarks/device/fsdp_throughput.py) on CPU: its configs, FLOP and peak
arithmetic, argument parsing, and its dry run (the tiny config on 2 gloo ranks through the trainer's builder)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "fsdp_throughput.py"
_spec = importlib.util.spec_from_file_location("fsdp_throughput", SCRIPT)
throughput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(throughput)


def llama_parameters(v: int, h: int, i: int, layers: int, heads: int, kv_heads: int, tied: bool) -> int:
    """A Llama's parameters by hand: embedding, per block q/k/v/o + gate/up/down + 2 norms, final norm, lm_head."""
    kv = h // heads * kv_heads
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return v * h + layers * block + h + (0 if tied else v * h)


def test_the_configs_have_the_sizes_they_are_named_after():
    assert throughput.count_parameters(throughput.llama_config("7b")) == (6_738_415_616, 32000 * 4096)  # Llama-2-7B
    one_and_a_half = throughput.count_parameters(throughput.llama_config("1.5b"))
    assert one_and_a_half == (llama_parameters(151936, 1536, 8960, 28, 12, 2, tied=True), 151936 * 1536)
    assert one_and_a_half[0] == 1_543_656_960  # Qwen2.5-1.5B's 1,543,714,304 less its 28 x 2048 q/k/v biases
    tiny = throughput.count_parameters(throughput.llama_config("tiny"))
    assert tiny == (llama_parameters(256, 64, 128, 2, 4, 2, tied=False), 256 * 64)


def test_flops_per_token_and_peaks():
    config = throughput.llama_config("tiny")
    parameters, embedding = throughput.count_parameters(config)
    assert throughput.flops_per_token(config, parameters, embedding, 32) == 6 * (parameters - 256 * 64) + 12 * 2 * 64 * 32
    assert throughput.peak_tflops("NVIDIA H200", None) == 989.0
    assert throughput.peak_tflops("NVIDIA A100-SXM4-80GB", None) == 312.0
    assert throughput.peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert throughput.peak_tflops("cpu (dry run)", None) is None
    assert throughput.peak_tflops("cpu (dry run)", 1.5) == 1.5
    assert throughput.estimated_bytes(6_738_415_616, 1) == pytest.approx(1.1 * 16 * 6_738_415_616 + 8e9)


def test_arguments_and_per_config_defaults():
    args = throughput.parse_args([])
    assert (args.models, args.steps, args.warmup, args.dry_run_cpu) == (["1.5b", "7b"], 5, 2, False)
    assert throughput.settings(args, "7b") == {"tokens": 4096, "documents": 1, "activation_checkpointing": "full"}
    assert throughput.settings(args, "1.5b") == {"tokens": 8192, "documents": 4, "activation_checkpointing": "none"}
    dry = throughput.parse_args(["--dry-run-cpu", "--tokens", "96", "--activation-checkpointing", "full"])
    assert dry.models == ["tiny"]
    assert throughput.settings(dry, "tiny") == {"tokens": 96, "documents": 2, "activation_checkpointing": "full"}
    with pytest.raises(ValueError, match="--tokens 100 is not a multiple of --documents 3"):
        throughput.settings(throughput.parse_args(["--tokens", "100", "--documents", "3"]), "7b")
    with pytest.raises(SystemExit):
        throughput.parse_args(["--models", "13b"])


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_dry_run_trains_the_tiny_config_on_two_gloo_ranks():
    result = run_script("--dry-run-cpu", "--steps", "2", "--warmup", "1", "--activation-checkpointing", "full")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-6000:]}"
    line = next(line for line in result.stdout.splitlines() if line.startswith("PASS tiny:"))
    parameters = llama_parameters(256, 64, 128, 2, 4, 2, tied=False)
    assert f"{parameters / 1e6:,.1f}M parameters, 2 x cpu (dry run), 64 tokens per rank and step (2 documents)" in line
    assert "activation checkpointing full" in line and "tokens/s" in line and "MFU n/a" in line
    assert "(median of 2)" in line
    assert result.stdout.rstrip().endswith("fsdp_throughput: PASSED (1/1 configs)")


def test_without_a_gpu_it_says_so_and_exits_2():
    result = subprocess.run([sys.executable, str(SCRIPT), "--models", "tiny"], capture_output=True, text=True,
                            timeout=120, check=False, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr[-3000:]}"
    assert "no CUDA device is visible: run on a GPU machine, or pass --dry-run-cpu" in result.stdout
