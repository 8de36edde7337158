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


def _figures(ours: float, casts: list[float]) -> dict:
    return {"bytes": 254e6, "parameters": 127e6, "tensors": 102, "load_start": 0.3, "load_end": 0.4,
            "raw": [0.050, 0.047], "raw_per_tensor": [0.060], "raw_layout": [0.070], "ours": [ours], "per_tensor": [0.15],
            "copies": [0.02], "casts": casts, "bucket_bytes": 64 * 2**20, "staging": 134e6, "late_joiner_copy": 254e6,
            "rollout_digest_ddp": "d", "expected_digest": "d", "published_digest": "d", "rollout_digest_per_tensor": "d",
            "phases": [{"announce": 1.0, "join": 1.0, "group": 0.5, "tensors": 60.0, "end": 20.0, "other": 1.0}]}


def test_a_publication_in_another_dtype_is_judged_against_the_raw_broadcast_plus_the_cast():
    sys.path.insert(0, str(SCRIPT.parents[1]))
    import weight_sync

    args = weight_sync.parse_args(["--dtype", "bfloat16", "--no-fsdp"])
    # 0.047 s raw + 0.025 s cast = 0.072 s: 80% of it at 0.090 s, 78% at 0.092 s.
    text, met = weight_sync.report(args, _figures(0.090, [0.030, 0.025]))
    assert met and "80% of the faster raw + the cast >= 80%: met" in text
    assert "the bound is the faster raw way + this cast: 0.072 s" in text
    text, met = weight_sync.report(args, _figures(0.092, [0.025]))
    assert not met and "78% of the faster raw + the cast >= 80%: MISSED" in text
    text, met = weight_sync.report(weight_sync.parse_args(["--no-fsdp"]), _figures(0.058, []))  # float32: no cast
    assert met and "81% of the faster raw >= 80%: met" in text
