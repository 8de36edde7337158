"""Device check: rljob's trainer step against the bare loop in bf16 on one GPU (issue 26, item 1). Shipped for a lent
GPU machine; its arguments are tested in CI (tests/trainer/test_trainer_step_bench.py) and ``--dry-run-cpu`` runs the
same modes on CPU.

    python benchmarks/device/trainer_step_gpu.py                    # the example's model, then a 148M Llama, 1 GPU
    python benchmarks/device/trainer_step_gpu.py --cases gpu150m-ddp-1 --steps 20
    python benchmarks/device/trainer_step_gpu.py --dry-run-cpu      # the same modes on CPU, the quick workload

It runs ``benchmarks/trainer_step.py --modes a,b`` (docs in that script): (a) the bare loop and (b) rljob's Trainer fed
by a real Redis stream, one rank on the GPU (NCCL through the trainer's ``init_distributed``), bf16 compute by the
trainer's default ``precision.param`` (DDP under ``torch.autocast``; float32 master weights and AdamW state), the same
micro-batches. Cases: ``example-ddp-1`` (the CPU example's tiny model and batch: a step of a few milliseconds on a GPU,
judged by rljob's fixed cost per step) and ``gpu150m-ddp-1`` (the 148M Llama, 64 documents of 512 tokens per step in
micro-batches of 8192 tokens). (c) is left out: its raw baseline and the publication need a second process on a GPU
of its own for NCCL. On a GPU the phase timers are host-side (no synchronisation is added): device work a phase queued
shows in the next phase that waits for it (``collectives_time_ms``, where the loss is reduced).

Needs on the machine: the trainer's packages (api, wire, trainer, rollout on PYTHONPATH, with redis-py and pydantic)
and ``redis-server`` on PATH; it says which is missing (exit 2). Exit status: trainer_step.py's (0 every target met, 1
one missed, 2 too busy, an error or a missing prerequisite); 2 without a GPU unless ``--dry-run-cpu``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Optional

BENCHMARKS = Path(__file__).resolve().parents[1]
CASES = "example-ddp-1,gpu150m-ddp-1"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="trainer_step.py cases (default %(default)s)")
    parser.add_argument("--steps", type=int, help="timed steps per mode (default per workload)")
    parser.add_argument("--dry-run-cpu", action="store_true", help="run on CPU (the quick workload), GPUs or not")
    return parser.parse_args(argv)


def trainer_step_argv(args: argparse.Namespace) -> list[str]:
    """The arguments this check passes to benchmarks/trainer_step.py."""
    argv = ["--modes", "a,b", "--cases", "example-ddp-1" if args.dry_run_cpu else args.cases]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    return [*argv, "--quick"] if args.dry_run_cpu else argv


def missing_prerequisites() -> list[str]:
    """What the run needs and this machine lacks: ``redis-server`` on PATH, the ``redis`` and ``pydantic`` modules."""
    missing = [] if shutil.which("redis-server") else ["redis-server on PATH"]
    return missing + [f"the Python module {name}" for name in ("redis", "pydantic") if importlib.util.find_spec(name)
                      is None]


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    missing = missing_prerequisites()
    if missing:
        print(f"trainer_step_gpu: missing {', '.join(missing)}")
        return 2
    import torch

    if args.dry_run_cpu:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks inherit it: gloo, float32
    elif not torch.cuda.is_available():
        print("trainer_step_gpu: no CUDA device is visible: run on a GPU machine, or pass --dry-run-cpu")
        return 2
    else:
        print(f"trainer_step_gpu: {torch.cuda.get_device_name(0)}, bf16", flush=True)
    sys.path.insert(0, str(BENCHMARKS))
    import trainer_step

    return trainer_step.main(trainer_step_argv(args))


if __name__ == "__main__":
    sys.exit(main())
