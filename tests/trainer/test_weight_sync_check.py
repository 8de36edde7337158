"""The weight-sync device check (benchmarks/device/weight_sync_nccl.py) on CPU: its arguments, its dry run (the whole
benchmark of benchmarks/weight_sync.py on gloo with a small model) and what it does without GPUs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "weight_sync_nccl.py"
_spec = importlib.util.spec_from_file_location("weight_sync_nccl", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_arguments_pick_a_7b_bf16_publication_over_nccl_into_one_gpu_or_a_small_fp32_one_on_gloo():
    args = check.parse_args([])
    assert check.weight_sync_argv(args) == ["--params", "6740", "--dtype", "bfloat16", "--repeats", "5", "--no-fsdp",
                                            "--device", "cuda"]
    assert check.weight_sync_argv(args, gpus=1)[-2:] == ["--device", "cuda-receiver"]
    dry = check.parse_args(["--dry-run-cpu", "--repeats", "2"])
    assert check.weight_sync_argv(dry) == ["--params", "60", "--dtype", "float32", "--repeats", "2", "--no-fsdp"]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    environment.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=environment, capture_output=True, text=True,
                          timeout=300, check=False)


def test_dry_run_publishes_to_a_rollout_process_and_prints_every_figure():
    result = _run("--dry-run-cpu", "--repeats", "2")
    assert result.returncode in (0, 1), f"{result.stdout}\n{result.stderr[-6000:]}"  # 1: a target missed on a busy machine
    out = result.stdout
    assert re.search(r"model: 63\.3M parameters, 21 tensors, published as float32: 253\.2 MB to 1 rollout process over gloo on loopback", out), out
    for figure in ("raw broadcast, one flat tensor", "raw, the per-tensor layout, all started at once",
                   "publication, DDP trainer, packed", "publication, DDP trainer, per-tensor"):
        assert re.search(re.escape(figure) + r"\s+\d+\.\d{3}\s+\d+\.\d{3}", out), figure
    assert "rollout's received tensors bit-identical to the published ones (DDP, packed and per-tensor): yes" in out
    assert "buckets of 64 MiB; rank 0 keeps" in out
    assert "late-joiner copy on rank 0: 253.2 MB (the published bytes: yes)" in out
    phases = re.search(r"median ms \(Publication.phases_ms; other = bookkeeping\): (.*)", out).group(1)
    assert [part.split()[0] for part in phases.split(", ")] == ["announce", "join", "group", "tensors", "end", "other"]


def test_without_a_gpu_it_says_so_and_exits_2():
    result = _run(CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr[-3000:]}"
    assert "no CUDA device is visible: run on a GPU machine, or pass --dry-run-cpu" in result.stdout
