"""Benchmark: the checkpoint path of an FSDP2 trainer (issue 10 item 4): peak host memory of the final safetensors
export on global rank 0, streamed from the shards vs gathered; and how long a checkpoint save stops training.

Starts ``--ranks`` gloo processes on this machine (spawned, file:// rendezvous), builds the same random Llama on each
(float32, sized by the flags; the default has about 59 M parameters, 226 MiB, with two 15.6 MiB embeddings as its
largest tensors), shards it with ``fully_shard`` per decoder block and at the root, trains one AdamW step, then exports twice
from the same shards:

- streamed: :func:`rljob_trainer.export.export_hugging_face` (each tensor gathered with ``DTensor.full_tensor()``,
  written by rank 0, freed before the next);
- gathered: the previous path, ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` to rank 0, then
  ``save_pretrained``.

Each figure is rank 0's peak resident memory during that export above its resident memory just before it: the
kernel's high-water mark (``VmHWM`` in /proc/self/status) is reset through /proc/self/clear_refs before each export
and read after it; the files written are not mapped, so the growth is anonymous memory (gathered tensors, buffers).
The ranks run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB, so every tensor of a MiB or more is mapped on
allocation and unmapped when freed: otherwise freed heap memory (the unsharded model built before ``fully_shard``)
would be reused without growing the resident set, and the figures would undercount.
Target: streamed ≤ 2 × the largest tensor + 32 MiB (the gathered tensor, the all-gather's own buffer, allocator slack);
the gathered figure (about the whole model) is printed beside it.

Then ``--saves`` checkpoints of the model and its AdamW state through :class:`rljob_trainer.checkpoint.CheckpointManager`
(DCP's asynchronous save, into a directory on this machine's disk), each followed at once by a training step: rank
0 prints the median time the loop stood still (``checkpoint_blocking_time_ms``: the snapshot to host memory and the
start of the write) and the median time to the commit (``checkpoint_save_time_ms``: every rank's files written and
fsynced, the commit file written). Target: blocking ≤ 50 % of the save time. Exits 0 only when both targets are met.

    python benchmarks/checkpoint_export.py               # 2 ranks, default model
    python benchmarks/checkpoint_export.py --ranks 4 --layers 32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--saves", type=int, default=3, help="timed checkpoint saves")
    return parser.parse_args()


def status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_growth_bytes(run) -> tuple[int, float]:
    """(peak RSS above the RSS before ``run()``, seconds ``run()`` took), from the kernel's reset high-water mark."""
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    return (status_kib("VmHWM") - before) * 1024, seconds


def worker(rank: int, world_size: int, tmp_dir: str, args: argparse.Namespace) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    from rljob_trainer.export import export_hugging_face

    torch.set_num_threads(1)
    transformers_logging.disable_progress_bar()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/rendezvous", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=600))
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = Path(tmp_dir)

    def streamed() -> None:
        export_hugging_face(model, out / "streamed", writer=rank == 0)

    def gathered() -> None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(out / "gathered", state_dict=full)
        del full
        dist.barrier()

    figures = {}
    for name, run in (("streamed", streamed), ("gathered", gathered)):
        dist.barrier()
        figures[name] = peak_growth_bytes(run)
    saves = time_saves(model, optimizer, ids, rank, world_size, out / "checkpoints", args.saves)
    if rank == 0:
        result = {"largest": largest, "total": total, "parameters": sum(p.numel() for p in model.parameters()),
                  "saves": saves, **{name: {"peak": peak, "seconds": seconds} for name, (peak, seconds) in figures.items()}}
        (out / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def time_saves(model, optimizer, ids, rank: int, world_size: int, root: Path, count: int) -> list[dict[str, float]]:
    """``count`` checkpoints through the trainer's CheckpointManager, each followed by a training step while it is
    written; returns rank 0's blocking and save milliseconds of each (after one untimed save)."""
    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec
    from rljob_trainer.checkpoint import CheckpointManager
    from rljob_trainer.parallel import Distributed, ParallelDims

    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "trainer": {"processesPerNode": world_size}})
    config = resolve("bench", "ns", spec, RedisConnection(host="127.0.0.1", port=1)).model_copy(
        update={"checkpoint_dir": str(root)})
    where = Distributed(rank, world_size, 0, torch.device("cpu"), "gloo", ParallelDims(world_size, world_size, strategy="fsdp"))
    manager = CheckpointManager(config, where)
    timed = []
    for step in range(count + 1):
        manager.save(step + 1, 0, model, optimizer, [])
        model(input_ids=ids, labels=ids).loss.backward()  # training goes on while the files are written
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        (finished,) = manager.wait()
        if step and rank == 0:
            timed.append({"blocking_ms": finished.blocking_ms, "save_ms": finished.save_ms})
    manager.close()
    return timed


def main() -> int:
    args = parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # read by glibc when each spawned rank starts
    tmp = tempfile.mkdtemp(prefix="rljob-export-bench-")
    try:
        mp.start_processes(worker, args=(args.ranks, tmp, args), nprocs=args.ranks, start_method="spawn")
        result = json.loads((Path(tmp) / "result.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    largest, total = result["largest"], result["total"]
    bound = 2 * largest + 32 * MIB
    print(f"model: {result['parameters'] / 1e6:.1f} M parameters, {total / MIB:.1f} MiB float32, largest tensor "
          f"{largest / MIB:.1f} MiB; {args.ranks} FSDP2 ranks (gloo, CPU), rank 0 measured")
    print(f"{'export':<10} {'peak above start (MiB)':>24} {'x largest tensor':>17} {'x model':>8} {'seconds':>8}")
    for name in ("streamed", "gathered"):
        peak = result[name]["peak"]
        print(f"{name:<10} {peak / MIB:>24.1f} {peak / largest:>17.2f} {peak / total:>8.2f} {result[name]['seconds']:>8.2f}")
    memory_met = result["streamed"]["peak"] <= bound
    print(f"target: streamed <= 2 x largest + 32 MiB = {bound / MIB:.1f} MiB: {'met' if memory_met else 'MISSED'}")
    blocking = statistics.median(s["blocking_ms"] for s in result["saves"])
    save = statistics.median(s["save_ms"] for s in result["saves"])
    state = 3 * total / args.ranks  # parameters and both AdamW moments, float32, per rank
    print(f"\ncheckpoint of {state / MIB:.0f} MiB per rank (parameters + AdamW moments), median of {len(result['saves'])}: "
          f"training stood still {blocking:.0f} ms (checkpoint_blocking_time_ms), committed after {save:.0f} ms "
          f"(checkpoint_save_time_ms): {100 * blocking / save:.0f} %")
    save_met = blocking <= 0.5 * save
    print(f"target: blocking <= 50 % of the save time: {'met' if save_met else 'MISSED'}")
    return 0 if memory_met and save_met else 1


if __name__ == "__main__":
    sys.exit(main())
