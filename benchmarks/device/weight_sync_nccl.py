"""Device check: a weight publication against a raw broadcast of the same bytes (issue 10 item 5, issue 25 item 5).
Shipped for a lent GPU machine; its CPU dry run is tested in CI (tests/trainer/test_weight_sync_check.py).

    python benchmarks/device/weight_sync_nccl.py                      # Llama-2-7B's shape in bf16
    python benchmarks/device/weight_sync_nccl.py --params 1500 --repeats 3
    python benchmarks/device/weight_sync_nccl.py --dry-run-cpu        # the same run on gloo with a small model

It runs ``benchmarks/weight_sync.py`` (docs/weight-sync.md): trainer rank 0 holds a random Llama of ``--params``
million parameters in float32 (as a DDP rank does) and publishes it in ``--dtype`` (bf16 by default, the trainer's
compute dtype on GPU) with the real publisher, packed and per-tensor, to one receiver that receives as vLLM's worker
extension does (onto its GPU, the group kept, each tensor unpacked into a buffer kept across updates).

- **Two GPUs or more** (``--device cuda``): the trainer on GPU 0, the receiver on GPU 1, NCCL; each tensor cast on
  GPU 0, sent and copied to the pinned late-joiner buffers. The raw baselines are NCCL broadcasts of the same bytes on
  a group formed beforehand.
- **One GPU** (``--device cuda-receiver``; NCCL refuses two ranks of one group on one device): the trainer on the CPU,
  the receiver on GPU 0, gloo; the packed layout's receive and unpack on the GPU (bucket buffers on the device, typed
  views at aligned offsets, a copy per tensor), checked bit for bit against the per-tensor layout and the published
  weights, against gloo broadcasts of the same bytes into the same GPU.

Exit status: weight_sync.py's (0 every target met, 1 one missed, 2 an error); 2 without a GPU unless
``--dry-run-cpu``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

BENCHMARKS = Path(__file__).resolve().parents[1]
DEFAULT_PARAMS = 6740
"""Llama-2-7B's 32 blocks at width 4096 (benchmarks/weight_sync.py ``llama_config``): 6.7B parameters, 13.5 GB in bf16."""
DRY_RUN_PARAMS = 60
"""The dry run's model: one block of width 768 and the 32000-token embedding and head (about 56M parameters)."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, help=f"millions of parameters (default {DEFAULT_PARAMS}; "
                                                     f"{DRY_RUN_PARAMS} with --dry-run-cpu)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="published dtype (default bfloat16; float32 "
                                                                         "with --dry-run-cpu, as a CPU trainer publishes)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of each figure")
    parser.add_argument("--dry-run-cpu", action="store_true", help="gloo on loopback instead of NCCL, a small model")
    args = parser.parse_args(argv)
    if args.params is None:
        args.params = DRY_RUN_PARAMS if args.dry_run_cpu else DEFAULT_PARAMS
    if args.dtype is None:
        args.dtype = "float32" if args.dry_run_cpu else "bfloat16"
    return args


def weight_sync_argv(args: argparse.Namespace, gpus: int = 2) -> list[str]:
    """The arguments this check passes to benchmarks/weight_sync.py on a machine with ``gpus`` GPUs."""
    argv = ["--params", f"{args.params:g}", "--dtype", args.dtype, "--repeats", str(args.repeats), "--no-fsdp"]
    if args.dry_run_cpu:
        return argv
    return [*argv, "--device", "cuda" if gpus >= 2 else "cuda-receiver"]


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    gpus = 0 if args.dry_run_cpu else torch.cuda.device_count()
    if not args.dry_run_cpu and gpus == 0:
        print("weight_sync_nccl: no CUDA device is visible: run on a GPU machine, or pass --dry-run-cpu")
        return 2
    if gpus == 1:
        print(f"weight_sync_nccl: one GPU ({torch.cuda.get_device_name(0)}): NCCL refuses two ranks of one group on one "
              f"device, so the trainer publishes from the CPU over gloo into GPU 0 (--device cuda-receiver); "
              f"{args.params:g}M parameters published as {args.dtype}", flush=True)
    elif gpus > 1:
        print(f"weight_sync_nccl: {torch.cuda.get_device_name(0)} -> {torch.cuda.get_device_name(1)}, "
              f"{args.params:g}M parameters published as {args.dtype}", flush=True)
    sys.path.insert(0, str(BENCHMARKS))
    import weight_sync

    return weight_sync.main(weight_sync_argv(args, gpus))


if __name__ == "__main__":
    sys.exit(main())
