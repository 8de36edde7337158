"""Benchmark: the trainer's memory per rank under DDP and FSDP2 at 2 and 4 ranks, and loading on the meta device
(issue 10, items 3 and 7; docs/trainer-memory.md).

    python benchmarks/trainer_memory.py                    # the pinned ~148M Llama: 1 rank, then DDP/FSDP x 2/4 ranks
    python benchmarks/trainer_memory.py --ranks 2
    python benchmarks/trainer_memory.py --quick            # a ~10M Llama, to try the script (its targets are not
                                                           # meaningful: fixed process overheads dominate)

What it starts: one process per rank (torch.multiprocessing, spawn), each joining a real gloo group through the
trainer's ``init_distributed`` (one 1-rank DDP run, then DDP and FSDP at each ``--ranks``). The model is a seeded random
Llama of :data:`MODEL` written once by ``save_pretrained`` (float32 safetensors) to a temporary directory; every rank
loads it through the trainer's own ``rljob_trainer.loading.load_model`` (``model.source: path``): meta-device
construction, ``fully_shard`` (fsdp) or DDP, ``to_empty``, DCP's Hugging Face reader into the shards. Then
``1 + --steps`` optimizer steps of the trainer's computation (``sequence_logprobs``, ``grpo_loss`` with the global
label count, the loss × DP, backward under ``DataParallelModel.micro_batch``, gradient clipping, AdamW), each of
``--micro-batches`` seeded micro-batches of ``--documents`` × ``--tokens`` tokens per rank; DDP and FSDP get the same
batch.

Memory: anonymous resident memory (RssAnon: heap and anonymous mappings; not the memory-mapped safetensors, not shared
libraries) of each rank's process, = (resident − shared) pages of ``/proc/self/statm``, sampled by a thread of the rank
every :data:`SAMPLE_INTERVAL_S` (0.5 ms; a rank's peak holds for far longer: a backward pass, a tensor's copy) and at
each phase boundary. Every figure is a peak minus the rank's baseline: its RssAnon after the imports and the process
group (and DeviceMesh) setup. Units: MB = 10**6 bytes.

The ranks run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``, :data:`MMAP_THRESHOLD`), so
that every tensor's storage of 128 KiB or more is a mapping of its own, returned to the kernel when the tensor is freed.
With glibc's default the threshold rises to the size of each large block freed (up to 32 MiB): FSDP's per-unit
all-gather and reduce-scatter buffers, activations and optimizer temporaries are then carved from the heap, and the
heap keeps their pages after they are freed, so RssAnon reports what the allocator retains rather than what the
trainer holds (measured: 3.49 GB against 1.71 GB for the same FSDP rank at 2 ranks; docs/trainer-memory.md).
``--glibc-dynamic`` measures with glibc's default instead.

Targets (exit 0 only when all are met, 1 otherwise, 2 on an error):

- training, FSDP at N ranks, every rank: peak ≤ 1.15 × 16·P/N (float32 parameters, gradients and AdamW's two moments,
  sharded) + the largest FSDP unit's parameters and gradients, unsharded (float32) + the activation peak of one rank
  at the same micro-batch. The activation peak is measured here on 1 rank (DDP over a world of one): the rise of
  RssAnon during the forward and backward of the last step, whose gradients, DDP buckets and optimizer state already
  exist (gradients zeroed, not freed; DDP reallocates its buckets in the second step, hence ``--steps`` ≥ 2);
- loading (item 3), FSDP at N ranks, every rank: peak while ``load_model`` runs ≤ 1.10 × (the rank's shard of the
  parameters and buffers + the largest tensor, float32).

DDP's figures and the step time of both strategies (median over the timed steps, between barriers) are printed for
comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=1024, tie_word_embeddings=False)
"""The pinned benchmark model: a Llama of 148.3M parameters (embedding and lm_head 24.6M each, 14 blocks of 7.1M).
4 DDP ranks need about 4 × (16 bytes × P = 2.37 GB + DDP's gradient buckets 0.59 GB + activations) ≈ 13 GB."""
QUICK_MODEL = dict(MODEL, vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=4)
"""``--quick``: 7.2M parameters."""
SAMPLE_INTERVAL_S = 0.0005
MMAP_THRESHOLD = 128 * 1024
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` of every rank (bytes), unless ``--glibc-dynamic``."""
TRAIN_FACTOR = 1.15
LOAD_FACTOR = 1.10
MB = 1e6
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- measuring ------------------------------------------------------------------------------------------------------
class AnonSampler:
    """This process's RssAnon in bytes, sampled by a daemon thread: (resident − shared) pages of /proc/self/statm.

    ``peak`` is the highest sample since the last :meth:`mark`, ``highest`` the highest since the start; :meth:`now`
    samples at once (and counts toward both), so a phase's boundaries are never missed.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S):
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._interval = interval_s
        self.peak = self.highest = 0
        self.now()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-anon-sampler", daemon=True)
        self._thread.start()

    def now(self) -> int:
        fields = os.pread(self._fd, 200, 0).split()
        value = (int(fields[1]) - int(fields[2])) * PAGE
        if value > self.peak:
            self.peak = value
        if value > self.highest:
            self.highest = value
        return value

    def mark(self) -> int:
        """Start a new phase: the peak restarts from the current value, which is returned."""
        self.peak = 0
        return self.now()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.now()
            self.samples += 1
            time.sleep(self._interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)


# --- one rank -------------------------------------------------------------------------------------------------------
def job_config(model_dir: Path, ranks: int, strategy: str, args: argparse.Namespace) -> Any:
    """The resolved config of a one-node trainer of ``ranks`` processes loading ``model_dir`` (Redis never contacted)."""
    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec

    spec = RLTrainingJobSpec.model_validate({
        "model": {"source": "path", "path": str(model_dir)},
        "trainer": {"processesPerNode": ranks, "parallelism": {"strategy": strategy},
                    "batch": {"documentsPerStep": ranks * args.micro_batches * args.documents,
                              "microBatchTokens": args.documents * args.tokens},
                    "optimizer": {"learningRate": 1e-5, "warmupSteps": 1, "gradClip": 1.0},
                    "collectiveTimeoutSeconds": 1800},
        "rollout": {"replicas": 1},
    })
    return resolve("bench", "ns", spec, RedisConnection(host="127.0.0.1", port=6379))


def micro_batches(args: argparse.Namespace, vocab: int, rank: int) -> list[dict[str, Any]]:
    """This rank's seeded micro-batches: ``[documents, tokens]`` ids, the first quarter of each document a prompt."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(args.micro_batches):
        b, length = args.documents, args.tokens
        ids = torch.randint(4, vocab, (b, length), generator=g)
        mask = torch.ones(b, length, dtype=torch.bool)
        labels = (torch.arange(length) >= length // 4).expand(b, length)
        out.append({
            "input_ids": ids, "attention_mask": mask, "label_mask": labels[mask],
            "document_index": torch.arange(b)[:, None].expand(b, length)[mask],
            "old_logprobs": -3.0 + 0.1 * torch.randn(b * length, generator=g),
            "advantages": torch.randn(b, 1, generator=g).expand(b, length)[mask],
        })
    return out


def rank_main(rank: int, ranks: int, strategy: str, model_dir: str, out_dir: str, args: argparse.Namespace,
              port: int, keep_gradients: bool) -> None:
    """One rank of one case: baseline, load, train; writes ``out_dir/<strategy>-<ranks>-rank<rank>.json``."""
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported before the baseline
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401
    from torch.distributed.tensor import DTensor

    from rljob_trainer import loss as losses
    from rljob_trainer.loading import load_model
    from rljob_wire.model import sequence_logprobs
    from rljob_trainer.optim import build_optimizer
    from rljob_trainer.parallel import init_distributed, shutdown_distributed
    from rljob_trainer.stream.batch import flat_from_padded

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    config = job_config(Path(model_dir), ranks, strategy, args)
    where = init_distributed(config)
    sampler = AnonSampler()
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.barrier()
        baseline = sampler.mark()
        parallel = load_model(config.spec.model, 0, 0, where, config.spec.trainer)
        sampler.now()
        result["load_peak"] = sampler.peak - baseline
        model = parallel.model
        result["shard_bytes"] = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
        ) + sum(b.numel() * b.element_size() for b in model.buffers())
        result["after_load"] = sampler.now() - baseline
        optimizer = build_optimizer(model, config.spec.trainer.optimizer)
        batches = micro_batches(args, model.config.vocab_size, rank)
        labels = torch.tensor(sum(int(mb["label_mask"].sum()) for mb in batches))
        dist.all_reduce(labels)
        step_times, activation = [], None
        sampler.mark()
        for step in range(1 + args.steps):
            dist.barrier()
            started = time.perf_counter()
            # The last step: DDP rebuilds its gradient buckets at the start of the second one, freeing the first ones.
            before = sampler.mark() if keep_gradients and step == args.steps else None
            for index, mb in enumerate(batches):
                with parallel.micro_batch(last=index == len(batches) - 1):
                    with parallel.autocast():
                        padded = sequence_logprobs(parallel.module, mb["input_ids"], mb["attention_mask"])
                    output = losses.grpo_loss(flat_from_padded(padded, mb["attention_mask"]), mb["old_logprobs"],
                                              mb["advantages"], mb["label_mask"], mb["document_index"],
                                              num_labels_in_batch=int(labels))
                    losses.scale_for_gradient_mean(output.loss, where.world_size).backward()
            if before is not None:
                sampler.now()
                activation = sampler.peak - before
            parallel.clip_grad_norm(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_gradients)
            dist.barrier()
            if step >= 1:
                step_times.append(time.perf_counter() - started)
        sampler.now()
        result.update(train_peak=sampler.highest - baseline, step_times=step_times,
                      activation_peak=activation, baseline=baseline, samples=sampler.samples)
    except BaseException:  # noqa: BLE001 - reported to the parent, which exits 2
        result["error"] = traceback.format_exc()
        raise
    finally:
        sampler.close()
        Path(out_dir, f"{strategy}-{ranks}-rank{rank}.json").write_text(json.dumps(result))
        shutdown_distributed()


# --- the parent -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the targets need of the model: P (parameters), the largest tensor and the largest FSDP unit (elements)."""

    parameters: int
    largest_tensor: int
    largest_unit: int
    largest_unit_name: str


def save_model(model_config: dict, directory: Path) -> ModelFacts:
    """Write the seeded random Llama of ``model_config`` with ``save_pretrained`` (float32 safetensors) and measure it:
    the units are those ``wrap_model`` shards (:func:`~rljob_trainer.parallel.fsdp_units`: each decoder block, the
    embedding and the output projection when untied, then the root with what is left)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rljob_trainer.parallel import fsdp_units

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model_config))
    model.save_pretrained(directory)
    names = {module: name for name, module in model.named_modules()}
    units = {names[module]: sum(p.numel() for p in module.parameters()) for module in fsdp_units(model)}
    total = sum(p.numel() for p in model.parameters())
    units["root (what no other unit holds)"] = total - sum(units.values())
    name = max(units, key=units.get)
    return ModelFacts(total, max(p.numel() for p in model.parameters()), units[name], name)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(strategy: str, ranks: int, model_dir: Path, out_dir: Path, args: argparse.Namespace,
             keep_gradients: bool = False) -> list[dict[str, Any]]:
    """Run one case's ranks to the end; their results, rank 0 first.

    Raises:
        RuntimeError: a rank failed or did not finish within ``--timeout`` seconds (its traceback in the message).
    """
    import torch.multiprocessing as mp

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if not args.glibc_dynamic:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by glibc when each spawned rank starts
    try:
        context = mp.start_processes(rank_main, args=(ranks, strategy, str(model_dir), str(out_dir), args,
                                                      free_port(), keep_gradients),
                                     nprocs=ranks, join=False, start_method="spawn")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    deadline = time.monotonic() + args.timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{strategy} on {ranks} ranks did not finish within {args.timeout} s")
    except mp.ProcessRaisedException as err:
        raise RuntimeError(f"{strategy} on {ranks} ranks failed:\n{err}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [json.loads((out_dir / f"{strategy}-{ranks}-rank{rank}.json").read_text()) for rank in range(ranks)]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to compare (default 2 4)")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps after one warm-up step (>= 2)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank and step")
    parser.add_argument("--documents", type=int, default=2, help="documents per micro-batch")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per document")
    parser.add_argument("--quick", action="store_true", help="the small model of QUICK_MODEL")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per case")
    parser.add_argument("--glibc-dynamic", action="store_true",
                        help="leave glibc's mmap threshold dynamic (its default) in the ranks; see the docstring")
    parser.add_argument("--keep", type=Path, help="write the model and the per-rank results here (kept)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the activation peak is measured in the last one, after DDP's rebuild")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    model_config = QUICK_MODEL if args.quick else MODEL
    load = os.getloadavg()
    print(f"trainer_memory: {os.cpu_count()} CPUs, load average {load[0]:.2f} at the start; micro-batch "
          f"{args.documents} x {args.tokens} tokens, {args.micro_batches} per rank and step, 1 + {args.steps} steps; "
          f"glibc mmap threshold {'dynamic (default)' if args.glibc_dynamic else f'fixed at {MMAP_THRESHOLD} bytes'}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="rljob-trainer-memory-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        facts = save_model(model_config, root / "model")
        print(f"model: {facts.parameters / 1e6:.1f}M parameters, largest tensor {facts.largest_tensor / 1e6:.1f}M, "
              f"largest FSDP unit {facts.largest_unit_name} {facts.largest_unit / 1e6:.1f}M; saved in "
              f"{time.monotonic() - started:.0f} s", flush=True)
        try:
            single = run_case("ddp", 1, root / "model", root, args, keep_gradients=True)[0]
            cases = {(s, n): run_case(s, n, root / "model", root, args) for n in args.ranks for s in ("ddp", "fsdp")}
        except RuntimeError as err:
            print(f"trainer_memory: ERROR {err}", flush=True)
            return 2
    return report(facts, single, cases)


def report(facts: ModelFacts, single: dict[str, Any], cases: dict[tuple[str, int], list[dict[str, Any]]]) -> int:
    """Print every figure and target; 0 when every target is met, else 1."""
    p = facts.parameters
    activation = single["activation_peak"]
    unit = 2 * 4 * facts.largest_unit
    print(f"\n1 rank (ddp): activation peak {activation / MB:.0f} MB (rise during forward+backward with gradients and "
          f"AdamW state allocated); whole run peak {single['train_peak'] / MB:.0f} MB; baseline "
          f"{single['baseline'] / MB:.0f} MB; step {statistics.median(single['step_times']):.2f} s")
    print(f"largest FSDP unit, parameters + gradients (float32, unsharded): {unit / MB:.0f} MB")
    all_met = True
    print("\n| case | rank | load peak | load target | training peak | training target | "
          "16P/N | step time (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (strategy, n), ranks in sorted(cases.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for r in ranks:
            sharded = 16 * p / n if strategy == "fsdp" else 16 * p
            step = statistics.median(r["step_times"])
            load_target = LOAD_FACTOR * (r["shard_bytes"] + 4 * facts.largest_tensor)
            train_target = TRAIN_FACTOR * sharded + unit + activation
            if strategy == "fsdp":
                load_ok = r["load_peak"] <= load_target
                train_ok = r["train_peak"] <= train_target
                all_met &= load_ok and train_ok
                load_cell = f"{load_target / MB:.0f} MB {verdict(load_ok)}"
                train_cell = f"{train_target / MB:.0f} MB {verdict(train_ok)}"
            else:
                load_cell = f"({load_target / MB:.0f} MB, info)"
                train_cell = "(info)"
            print(f"| {strategy} {n} | {r['rank']} | {r['load_peak'] / MB:.0f} MB | {load_cell} | "
                  f"{r['train_peak'] / MB:.0f} MB | {train_cell} | {sharded / MB:.0f} MB | {step:.2f} s |")
    print("\nterms of each FSDP training target: "
          f"{TRAIN_FACTOR} x 16P/N + largest unit {unit / MB:.0f} MB + activation peak {activation / MB:.0f} MB; "
          f"loading: {LOAD_FACTOR} x (shard + largest tensor {4 * facts.largest_tensor / MB:.0f} MB)")
    for n in sorted({n for _, n in cases}):
        if ("ddp", n) in cases and ("fsdp", n) in cases:
            ddp, fsdp = cases[("ddp", n)], cases[("fsdp", n)]
            ratio = max(r["train_peak"] for r in fsdp) / max(r["train_peak"] for r in ddp)
            times = statistics.median([t for r in fsdp for t in r["step_times"]]) / statistics.median(
                [t for r in ddp for t in r["step_times"]])
            print(f"{n} ranks: FSDP peak / DDP peak = {ratio:.2f}; FSDP step time / DDP step time = {times:.2f} "
                  f"(same micro-batches)")
    samples = min(r["samples"] for ranks in cases.values() for r in ranks)
    print(f"fewest RssAnon samples of a rank: {samples}")
    print(f"\ntrainer_memory: {'every target met' if all_met else 'a target MISSED'}")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
