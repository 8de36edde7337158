"""Device check: bf16 FSDP2 training throughput of random 1.5B and 7B Llama configs on the GPUs present (issue 10,
item 7). Shipped for a lent GPU machine; its CPU dry run is tested in CI (tests/trainer/test_fsdp_throughput_check.py).

    python benchmarks/device/fsdp_throughput.py                     # 1.5b, then 7b, on every visible GPU
    python benchmarks/device/fsdp_throughput.py --models 7b --steps 10 --peak-tflops 989
    python benchmarks/device/fsdp_throughput.py --dry-run-cpu       # the tiny config on 2 gloo ranks, GPUs hidden

Needs the trainer's packages (trainer_image/Dockerfile) and PYTHONPATH with api/ and trainer_image/. One process per
GPU (torch.multiprocessing, spawn) joins an NCCL group through the trainer's ``init_distributed`` and builds the model
the trainer's way, ``rljob_trainer.loading.build_parallel_model``: meta device, ``wrap_model`` (``fully_shard`` per
decoder block then the root, parameters all-gathered in bf16, gradients reduced in fp32: ``spec.trainer.precision``
``{param: bf16, reduce: fp32}``), ``to_empty`` on the GPU; its shards are then drawn at random (N(0, 0.02), norms 1:
no weights are read or written). Each step is the trainer's computation on ``--tokens`` tokens per rank
(``--documents`` documents): ``sequence_logprobs``, ``grpo_loss`` over the step's global label count, the loss × DP,
backward, gradient clipping, AdamW (float32 master weights and moments, sharded). ``--warmup`` steps, then ``--steps``
timed ones between barriers (median).

Printed per config: parameters; tokens/s of all ranks and per GPU; MFU = tokens/s × FLOPs per token / (GPUs × peak);
the step time; the peak of ``torch.cuda.max_memory_allocated`` per rank. FLOPs per token (forward + backward):
6 × (parameters − the input embedding) + 12 × layers × hidden × document length (attention scores and values, PaLM's
appendix B convention: no discount for the causal mask; activation checkpointing's recomputation is not counted, as in
MFU). The peak dense bf16 FLOP/s come from ``--peak-tflops`` or :data:`PEAK_TFLOPS` by device name (MFU n/a otherwise).
A config whose estimated memory (:func:`estimated_bytes`) exceeds the GPU's is skipped with a SKIP line. Exit 0 when
every config ran or was skipped, 1 when one failed, 2 on a setup error (no GPU without ``--dry-run-cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen2.5-1.5B's shape as a Llama (no q/k/v biases): 28 blocks, GQA 12/2 heads, tied 151936-token embedding.
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    # Llama-2-7B's shape: 32 blocks of 32 heads, 32000-token vocabulary, untied.
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    # The dry run's.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
}
"""Llama shapes by name; every one gets ``max_position_embeddings`` 8192 and ``rms_norm_eps`` 1e-5."""
DEFAULTS: dict[str, dict[str, Any]] = {
    "1.5b": {"tokens": 8192, "documents": 4, "activation_checkpointing": "none"},
    "7b": {"tokens": 4096, "documents": 1, "activation_checkpointing": "full"},
    "tiny": {"tokens": 64, "documents": 2, "activation_checkpointing": "none"},
}
"""Per config: tokens per rank and step, documents they are split into, activation checkpointing (7B on one H200:
112 GB of float32 state leaves room for checkpointed activations only)."""
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100": 989.0,
               "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
"""Dense bf16 tensor-core peak in TFLOP/s by a substring of ``torch.cuda.get_device_name()`` (vendor data sheets),
matched in this order."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; ``--tokens``, ``--documents`` and ``--activation-checkpointing`` default per config
    (:data:`DEFAULTS`). Raises SystemExit (status 2) on an unknown config name or option."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), help="configs to run (default 1.5b 7b; "
                        "tiny with --dry-run-cpu)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--tokens", type=int, help="tokens per rank and step (default per config)")
    parser.add_argument("--documents", type=int, help="documents the tokens are split into (default per config)")
    parser.add_argument("--activation-checkpointing", choices=["none", "full"], help="default per config")
    parser.add_argument("--ranks", type=int, help="processes (default: the visible GPUs; 2 with --dry-run-cpu)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default from PEAK_TFLOPS)")
    parser.add_argument("--dry-run-cpu", action="store_true", help="hide the GPUs: tiny config, gloo, float32")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per config")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = ["tiny"] if args.dry_run_cpu else ["1.5b", "7b"]
    return args


def settings(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """``name``'s tokens, documents and activation checkpointing: the command line's, else :data:`DEFAULTS`'.

    Raises:
        ValueError: the tokens do not split into the documents evenly.
    """
    chosen = {key: getattr(args, key) if getattr(args, key) is not None else value
              for key, value in DEFAULTS[name].items()}
    if chosen["tokens"] % chosen["documents"]:
        raise ValueError(f"--tokens {chosen['tokens']} is not a multiple of --documents {chosen['documents']}")
    return chosen


def llama_config(name: str) -> Any:
    """The ``transformers.LlamaConfig`` of :data:`CONFIGS` ``[name]``."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIGS[name], max_position_embeddings=8192, rms_norm_eps=1e-5)


def count_parameters(config: Any) -> tuple[int, int]:
    """(parameters, of which the input embedding) of ``config``'s model, counted on the meta device by the trainer's
    builder (a tied ``lm_head`` counts once)."""
    from rljob_trainer.loading import empty_model

    model = empty_model(config)
    return sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()


def flops_per_token(config: Any, parameters: int, embedding: int, document_tokens: int) -> float:
    """Training FLOPs per token, forward + backward: 6 × (``parameters`` − ``embedding``) + 12 × layers × hidden ×
    ``document_tokens`` (see the module docstring)."""
    return 6.0 * (parameters - embedding) + 12.0 * config.num_hidden_layers * config.hidden_size * document_tokens


def peak_tflops(device_name: str, override: Optional[float]) -> Optional[float]:
    """``override``, else the first :data:`PEAK_TFLOPS` entry whose key is in ``device_name``, else None."""
    if override is not None:
        return override
    return next((value for key, value in PEAK_TFLOPS.items() if key in device_name), None)


def estimated_bytes(parameters: int, ranks: int) -> float:
    """A rank's memory for float32 parameters, gradients and AdamW moments, sharded (16 bytes × P / ranks), + 10 %,
    + 8 GB for unsharded bf16 units, activations, logits and the allocator's slack."""
    return 1.1 * 16 * parameters / ranks + 8e9


def job_config(ranks: int, dry_run: bool, activation_checkpointing: str) -> Any:
    """A resolved config of one node of ``ranks`` processes, fsdp, bf16 parameters (fp32 on CPU) and fp32 reduction
    (Redis is never contacted)."""
    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec

    spec = RLTrainingJobSpec.model_validate({
        "model": {"source": "tiny"},  # not used: the model comes from CONFIGS
        "trainer": {"processesPerNode": ranks, "parallelism": {"strategy": "fsdp"},
                    "precision": {"param": "fp32" if dry_run else "bf16", "reduce": "fp32"},
                    "activationCheckpointing": activation_checkpointing,
                    "optimizer": {"learningRate": 1e-5, "warmupSteps": 1, "gradClip": 1.0},
                    "collectiveTimeoutSeconds": 600},
        "rollout": {"replicas": 1},
    })
    return resolve("fsdp-throughput", "ns", spec, RedisConnection(host="127.0.0.1", port=6379))


def random_shards(model: Any) -> None:
    """Draw this rank's shards: N(0, 0.02) for every parameter, 1 for the RMSNorm weights."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)


def rank_main(rank: int, ranks: int, name: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    """One rank of config ``name``: build, train, write ``out_dir/rank<rank>.json`` (step times, peak memory)."""
    import torch
    import torch.distributed as dist

    from rljob_trainer import loss as losses
    from rljob_trainer.loading import build_parallel_model
    from rljob_wire.model import sequence_logprobs
    from rljob_trainer.optim import build_optimizer
    from rljob_trainer.parallel import init_distributed, shutdown_distributed
    from rljob_trainer.stream.batch import flat_from_padded

    chosen = settings(args, name)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if args.dry_run_cpu:
        torch.set_num_threads(1)
    config = job_config(ranks, args.dry_run_cpu, chosen["activation_checkpointing"])
    where = init_distributed(config)
    result: dict[str, Any] = {}
    try:
        parallel = build_parallel_model(llama_config(name), where, config.spec.trainer, random_shards)
        optimizer = build_optimizer(parallel.model, config.spec.trainer.optimizer)
        g = torch.Generator().manual_seed(rank)
        b, length = chosen["documents"], chosen["tokens"] // chosen["documents"]
        ids = torch.randint(0, CONFIGS[name]["vocab_size"], (b, length), generator=g).to(where.device)
        mask = torch.ones(b, length, dtype=torch.bool, device=where.device)
        labels = (torch.arange(length, device=where.device) >= length // 4).expand(b, length).reshape(-1)
        document = torch.arange(b, device=where.device)[:, None].expand(b, length).reshape(-1)
        old = torch.full((b * length,), -3.0, device=where.device)
        advantages = torch.randn(b, 1, generator=g).to(where.device).expand(b, length).reshape(-1)
        global_labels = int(labels.sum()) * ranks
        times = []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            if where.device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            with parallel.micro_batch(last=True), parallel.autocast():
                padded = sequence_logprobs(parallel.module, ids, mask)
                output = losses.grpo_loss(flat_from_padded(padded, mask), old, advantages, labels, document,
                                          num_labels_in_batch=global_labels)
                losses.scale_for_gradient_mean(output.loss, ranks).backward()
            parallel.clip_grad_norm(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if where.device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
            if not torch.isfinite(output.loss.detach()).all():
                raise FloatingPointError(f"step {step}: loss {float(output.loss)}")
        result["step_times"] = times
        result["peak_memory"] = torch.cuda.max_memory_allocated(where.device) if where.device.type == "cuda" else None
    except BaseException:  # noqa: BLE001 - reported by the parent
        result["error"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        shutdown_distributed()


def run_config(name: str, ranks: int, args: argparse.Namespace, device_name: str) -> bool:
    """Run config ``name`` on ``ranks`` processes and print its line; False when a rank failed."""
    import socket

    import torch.multiprocessing as mp

    chosen = settings(args, name)
    config = llama_config(name)
    parameters, embedding = count_parameters(config)
    if not args.dry_run_cpu:
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
        if estimated_bytes(parameters, ranks) > memory:
            print(f"SKIP {name}: {parameters / 1e9:.2f}B parameters need about "
                  f"{estimated_bytes(parameters, ranks) / 1e9:.0f} GB per rank on {ranks} GPUs, {memory / 1e9:.0f} GB "
                  f"each", flush=True)
            return True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="rljob-fsdp-throughput-") as out:
        context = mp.start_processes(rank_main, args=(ranks, name, args, port, out), nprocs=ranks, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not finish within {args.timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as err:
            print(f"FAIL {name}: {err}", flush=True)
            return False
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        results = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(ranks)]
    step = statistics.median(t for r in results for t in r["step_times"])
    tokens_per_s = ranks * chosen["tokens"] / step
    per_token = flops_per_token(config, parameters, embedding, chosen["tokens"] // chosen["documents"])
    peak = peak_tflops(device_name, args.peak_tflops)
    mfu = "MFU n/a (no peak known for this device: pass --peak-tflops)" if peak is None else \
        f"MFU {100 * tokens_per_s * per_token / (ranks * peak * 1e12):.1f}% of {peak:g} TFLOP/s per device"
    memory = [r["peak_memory"] for r in results if r["peak_memory"] is not None]
    memory_text = f", peak memory {max(memory) / 1e9:.1f} GB per rank" if memory else ""
    print(f"PASS {name}: {parameters / 1e6:,.1f}M parameters, {ranks} x {device_name}, {chosen['tokens']} tokens per "
          f"rank and step ({chosen['documents']} documents), activation checkpointing "
          f"{chosen['activation_checkpointing']}: {tokens_per_s:,.0f} tokens/s ({tokens_per_s / ranks:,.0f} per device), "
          f"{mfu}, step {step:.3f} s (median of {len(results[0]['step_times'])}){memory_text}", flush=True)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before the first CUDA call; the spawned ranks inherit it
    import torch

    if args.dry_run_cpu:
        ranks, device_name = args.ranks or 2, "cpu (dry run)"
    elif not torch.cuda.is_available():
        print("fsdp_throughput: no CUDA device is visible: run on a GPU machine, or pass --dry-run-cpu", flush=True)
        return 2
    else:
        ranks, device_name = args.ranks or torch.cuda.device_count(), torch.cuda.get_device_name(0)
    ok = [run_config(name, ranks, args, device_name) for name in args.models]
    print(f"fsdp_throughput: {'PASSED' if all(ok) else 'FAILED'} ({sum(ok)}/{len(ok)} configs)", flush=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
