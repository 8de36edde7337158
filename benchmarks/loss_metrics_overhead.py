"""Benchmark: training-step time with loss metrics none vs basic vs full (DESIGN §4, issue 3 benchmark 9b).

One step = forward + GRPO loss + backward of a small transformers Llama over a few micro-batches, then the
metrics' all-reduces (a real one-rank gloo/NCCL group, so the collectives are timed too). Levels are run
round-robin inside each step so machine noise hits them alike; the table shows the median over the steps, the
ratio to ``none``, and the time spent inside the metrics code itself (less sensitive to noise).
Target: basic < 5 % over none; full (a second pass over the vocabulary) is reported.

    python benchmarks/loss_metrics_overhead.py                # CPU
    python benchmarks/loss_metrics_overhead.py --device cuda  # one GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from rljob_trainer.loss import count_labels_and_documents, grpo_loss
from rljob_trainer.loss_metrics import StepMetrics
from transformers import LlamaConfig, LlamaForCausalLM

LEVELS = ("none", "basic", "full")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per level")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per level")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="documents per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per document")
    parser.add_argument("--prompt-len", type=int, default=32, help="unlabelled prompt tokens per document")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--temperature", type=float, default=1.0)
    return parser.parse_args()


def make_micro_batches(args: argparse.Namespace, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Right-sized documents, one per row. Per-token tensors are [B, L]: position p holds token p+1 (the one
    logits row p scores); the last position has no next token and is unlabelled."""
    g = torch.Generator().manual_seed(0)
    batches = []
    b, length = args.batch, args.seq_len
    for _ in range(args.micro_batches):
        position = torch.arange(length).expand(b, length)
        batches.append(
            {
                key: value.to(device)
                for key, value in {
                    "input_ids": torch.randint(0, args.vocab, (b, length), generator=g),
                    "label_mask": (position >= args.prompt_len - 1) & (position < length - 1),
                    "document_index": torch.arange(b)[:, None].expand(b, length),
                    "noise": 0.05 * torch.randn(b, length, generator=g),
                    "advantages": torch.randn(b, 1, generator=g).expand(b, length),
                    "reward": torch.rand(b, 1, generator=g).expand(b, length),
                    "model_version": torch.randint(900, 1000, (b, 1), generator=g).expand(b, length),
                }.items()
            }
        )
    return batches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(model, batches, metrics: StepMetrics, temperature: float) -> tuple[dict[str, float], float]:
    """One step; returns the reduced metrics and the seconds spent inside the metrics' update and reduce."""
    metric_seconds = 0.0
    num_labels = sum(count_labels_and_documents(b["label_mask"], b["document_index"])[0] for b in batches)
    for batch in batches:
        logits = model(input_ids=batch["input_ids"]).logits  # [B, L, V]
        next_tokens = torch.roll(batch["input_ids"], -1, dims=1)
        log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
        new_logprobs = log_probs.gather(-1, next_tokens[..., None]).squeeze(-1).reshape(-1)
        old_logprobs = new_logprobs.detach() + batch["noise"].reshape(-1)
        flat = {k: batch[k].reshape(-1) for k in ("advantages", "label_mask", "document_index")}
        output = grpo_loss(
            new_logprobs,
            old_logprobs,
            flat["advantages"],
            flat["label_mask"],
            flat["document_index"],
            num_labels_in_batch=num_labels,
        )
        output.loss.backward()
        if metrics.enabled:
            synchronize(metrics.device)
            start = time.perf_counter()
            metrics.update(
                new_logprobs=new_logprobs,
                old_logprobs=old_logprobs,
                advantages=flat["advantages"],
                documents_seen=1000,
                loss_output=output,
                reward=batch["reward"].reshape(-1),
                model_version=batch["model_version"].reshape(-1),
                logits=logits if metrics.level == "full" else None,
            )
            synchronize(metrics.device)
            metric_seconds += time.perf_counter() - start
    start = time.perf_counter()
    reduced = metrics.reduce()
    return reduced, metric_seconds + time.perf_counter() - start


def main() -> int:
    """Run and print the table; 0 when basic costs < 5 % over none (median step time), 1 otherwise."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{store}/rdzv",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
        )
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=args.seq_len,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device)
        if device.type == "cuda":
            model = model.to(torch.bfloat16)
        batches = make_micro_batches(args, device)
        metrics = {level: StepMetrics(level, device=device, temperature=args.temperature) for level in LEVELS}
        times: dict[str, list[float]] = {level: [] for level in LEVELS}
        metric_times: dict[str, list[float]] = {level: [] for level in LEVELS}
        for step in range(args.warmup + args.steps):
            for level in LEVELS:
                model.zero_grad(set_to_none=True)
                synchronize(device)
                start = time.perf_counter()
                reduced, metric_seconds = train_step(model, batches, metrics[level], args.temperature)
                synchronize(device)
                if step >= args.warmup:
                    times[level].append(time.perf_counter() - start)
                    metric_times[level].append(metric_seconds)
                assert len(reduced) == len(metrics[level].definitions)
        dist.destroy_process_group()

    tokens = args.micro_batches * args.batch * args.seq_len
    print(
        f"device={device} threads={args.threads} model: Llama {args.layers} layers, hidden {args.hidden}, "
        f"vocab {args.vocab}; step = {args.micro_batches} micro-batches x {args.batch} docs x "
        f"{args.seq_len} tokens = {tokens} tokens; median of {args.steps} steps"
    )
    base = statistics.median(times["none"])
    print(f"{'metrics':<8} {'median ms':>10} {'min ms':>8} {'vs none':>9} {'in metrics ms':>14} {'share':>7}")
    for level in LEVELS:
        median = statistics.median(times[level])
        inside = statistics.median(metric_times[level])
        print(
            f"{level:<8} {median * 1e3:>10.1f} {min(times[level]) * 1e3:>8.1f} {median / base:>8.3f}x "
            f"{inside * 1e3:>14.2f} {inside / median:>6.1%}"
        )
    print("'in metrics' = time inside StepMetrics.update + reduce (all-reduces included), robust to machine noise.")
    overhead = statistics.median(times["basic"]) / base - 1
    print(f"target basic < 5 % over none: {overhead:+.1%} {'met' if overhead < 0.05 else 'MISSED'}")
    return 0 if overhead < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
