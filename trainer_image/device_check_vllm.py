"""Device check of the ``vllm`` rollout backend: run on one GPU in the rollout GPU image (Dockerfile.vllm).

    python3 trainer_image/device_check_vllm.py            # prints one JSON line, exit 0 = pass

It needs no Redis and no trainer; it takes about 2 minutes (vLLM start-up dominates) and must stay under 5.

1. Builds :class:`~rljob_rollout.backends.vllm.VllmBackend` (the real class, real vLLM, eager mode) for a
   small random Llama (2 layers, width 256, the digit tokenizer's 45 tokens), tensor parallel 1.
2. Generation: 8 prompts x 4 samples at temperature 0.7 — shapes, stop/length reasons, finite log-probs <= 0.
3. Log-probabilities: each completion's vLLM log-probabilities against ``sequence_logprobs`` of transformers on
   the same weights at the same temperature (mean and max absolute difference, in nats).
4. One weight update: a sender thread hosts a TCPStore and runs rljob's transfer (gloo, from CPU tensors) with a
   different random model; the engine's workers receive it through the worker extension
   (``collective_rpc``). Afterwards generation must follow the NEW weights: its log-probabilities agree with
   the new model far better than with the old one.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import threading
import time
import uuid

import torch

from rljob_api.config import RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec, SamplingSpec
from rljob_wire.model import DigitTokenizer, build_model, sequence_logprobs
from rljob_rollout.backends.base import UpdateOutcome
from rljob_rollout.backends.vllm import VllmBackend
from rljob_api.protocol import TransferTicket
from rljob_wire.transfer import StoreAddress, send_update

TINY = {"layers": 2, "hiddenSize": 256, "heads": 4, "intermediateSize": 512, "maxPositionEmbeddings": 128}
TEMPERATURE = 0.7
MEAN_TOLERANCE = 0.05
"""Mean |vLLM − transformers| log-probability (nats) allowed: vLLM runs bf16 kernels, the reference fp32."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def differences(groups, prompts, model: torch.nn.Module) -> tuple[float, float]:
    """(mean, max) |vLLM log-prob − recomputed log-prob| over every generated token."""
    diffs = []
    device = next(model.parameters()).device
    for prompt, group in zip(prompts, groups):
        for completion in group:
            ids = torch.tensor([list(prompt) + list(completion.token_ids)], device=device)
            with torch.no_grad():
                ref = sequence_logprobs(model, ids, torch.ones_like(ids), TEMPERATURE)[0, len(prompt):]
            diffs.append((ref.cpu() - torch.tensor(completion.logprobs)).abs())
    flat = torch.cat(diffs)
    return float(flat.mean()), float(flat.max())


def main() -> int:
    started = time.monotonic()
    tokenizer = DigitTokenizer()
    spec = RLTrainingJobSpec.model_validate(
        {"model": {"source": "tiny", "tiny": TINY}, "trainer": {"seed": 1},
         "rollout": {"backend": "vllm", "gpusPerReplica": 1, "sampling": {"temperature": TEMPERATURE, "topP": 1.0}}}
    )
    config = resolve("device-check", "default", spec, RedisConnection(host="127.0.0.1"))
    backend = VllmBackend(
        config, tokenizer, seed=0,
        engine_options={"dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 128},
    )
    report: dict = {"engine_start_s": round(time.monotonic() - started, 1)}
    device = torch.device("cuda")
    vocab = tokenizer.vocab_size
    old = build_model(spec.model, vocab, seed=1).to(torch.bfloat16).float().to(device).eval()  # what vLLM loaded
    new_cpu = build_model(spec.model, vocab, seed=2).to(torch.bfloat16)
    new = new_cpu.float().to(device).eval()

    prompts = [tokenizer.encode(f"{i:04d}|") for i in range(0, 8000, 1000)]
    sampling = SamplingSpec(temperature=TEMPERATURE, top_p=1.0, max_new_tokens=12)
    groups = backend.generate(prompts, 4, sampling)
    checks = {
        "groups": len(groups) == 8 and all(len(g) == 4 for g in groups),
        "lengths": all(1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids) for g in groups for c in g),
        "finish_reasons": all(c.finish_reason in ("stop", "length") for g in groups for c in g),
        "logprobs_finite_nonpositive": all(lp <= 1e-4 and lp == lp for g in groups for c in g for lp in c.logprobs),
    }
    mean, worst = differences(groups, prompts, old)
    report["before_update"] = {"mean_abs_diff": round(mean, 4), "max_abs_diff": round(worst, 4)}
    checks["logprobs_match_transformers"] = mean < MEAN_TOLERANCE

    store = torch.distributed.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=60),
                                       wait_for_workers=False)
    ticket = TransferTicket(uuid.uuid4().hex, (1,), "gloo", join_timeout_s=60.0, timeout_s=120.0)
    sent: dict = {}
    sender = threading.Thread(target=lambda: sent.setdefault(
        "ranks", send_update(store, ticket, new_cpu.named_parameters(), device=torch.device("cpu"))))
    update_started = time.monotonic()
    sender.start()
    outcome = backend.receive_weights(ticket, StoreAddress("127.0.0.1", store.port), (1,), 64)
    sender.join(120)
    report["update_s"] = round(time.monotonic() - update_started, 2)
    checks["update_loaded"] = outcome is UpdateOutcome.LOADED and sent.get("ranks") == [1]

    groups = backend.generate(prompts, 4, sampling)
    mean_new, worst_new = differences(groups, prompts, new)
    mean_old, _ = differences(groups, prompts, old)
    report["after_update"] = {"mean_abs_diff_new": round(mean_new, 4), "max_abs_diff_new": round(worst_new, 4),
                              "mean_abs_diff_old": round(mean_old, 4)}
    checks["generation_follows_new_weights"] = mean_new < MEAN_TOLERANCE and mean_new * 5 < mean_old
    checks["tokens_carry_the_new_version"] = all(c.versions == (64,) * len(c.token_ids) for g in groups for c in g)
    backend.close()
    report["checks"] = checks
    report["total_s"] = round(time.monotonic() - started, 1)
    report["passed"] = all(checks.values())
    print(json.dumps(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
