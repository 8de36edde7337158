"""Device check of the trainer: run on one NVIDIA GPU with the trainer's packages installed (trainer_image/Dockerfile).

    python3 trainer_image/device_check_trainer.py                 # one PASS/FAIL line per check, exit 0 = all pass
    python3 trainer_image/device_check_trainer.py --dry-run-cpu   # the same checks on CPU with gloo (tested in CI)
    python3 trainer_image/device_check_trainer.py --redis-url redis://:PASSWORD@HOST:6379/0

It starts its own redis-server (``apt-get install redis-server``) on a free loopback port with a random password
and stops it at the end, also on failure; with ``--redis-url`` it uses that server instead, under a job name of
its own (every key prefixed, deleted at the end; the password comes from the URL or env ``REDIS_PASSWORD``).
About a minute, most of it process start-up; it must stay under 5.

1. Losses on the device: ``grpo_loss`` / ``gspo_loss`` in float32 on the device against the same call on CPU
   (value and gradient), and :class:`~rljob_trainer.loss_metrics.StepMetrics` (full level) accumulated on the
   device and reduced through a one-rank process group of the device's backend (NCCL on GPU) against the same
   on CPU without a group, plus hand values of the reward and staleness metrics (versions above 2**24).
2. Training: writes 12 digit documents (rewards, advantages, per-token model versions) with the real codec, then
   runs ``torchrun --nproc-per-node=1 -m rljob_trainer.train`` (NCCL, bf16 autocast, AdamW, gradient clipping on
   GPU; gloo and float32 in the dry run) for 3 steps of 4 documents and checks its JSON lines (steps, finite
   loss, first-step loss and new log-probabilities against a float64 reference, the reward and staleness
   metrics of the documents written), the committed checkpoints and acks, the weights_ready events, the
   progress hash and the exported weights. Where the trainer ran is read from what it wrote: the weights_ready
   transfer backend (``nccl`` when the weights live on a GPU) and the CUDA RNG state in its checkpoint.

The dry run hides the GPUs with ``CUDA_VISIBLE_DEVICES=""``, in this process and the trainer's: the trainer picks
its device and backend from ``torch.cuda.is_available()`` (``rljob_trainer.parallel.init_distributed``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from safetensors.torch import load_file

from rljob_api import constants as c
from rljob_api.config import JobConfig, RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_trainer.checkpoint import COMMIT_FILE, EXPORT_DIR, committed_checkpoints
from rljob_trainer.loss import grpo_loss, gspo_loss
from rljob_trainer.loss_metrics import StepMetrics
from rljob_wire.model import DigitTokenizer, build_model
from rljob_trainer.parallel import init_distributed, shutdown_distributed
from rljob_wire.codec import Document, encode_document
from rljob_wire.connection import connect

REPO = Path(__file__).resolve().parents[1]
TINY = {"layers": 1, "hiddenSize": 16, "heads": 2, "intermediateSize": 32, "maxPositionEmbeddings": 32}
DOCUMENTS_PER_STEP = 4
MAX_STEPS = 3
TEMPERATURE = 0.7
TRAINER_TIMEOUT_S = 240.0
DEVICE_RTOL, DEVICE_ATOL = 1e-5, 1e-6
"""float32 on the device vs float32 on CPU: only the order of reductions differs."""
REFERENCE_TOLERANCE = {"cuda": 2e-2, "cpu": 1e-4}
"""Trained first step vs a float64 reference, relative to the loss's scale (bf16 autocast on GPU, float32 on CPU)."""


class SetupError(RuntimeError):
    """The machine lacks something the check needs (a GPU, redis-server); the message says what to do."""


@dataclass
class Report:
    """PASS/FAIL lines, printed as they come."""

    results: dict[str, bool] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.results[name] = bool(ok)
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(self.results.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b)


# --- Redis --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RedisTarget:
    """Where the check's Redis is: the connection, its password, and whether it is shared (``--redis-url``)."""

    connection: RedisConnection
    password: str
    shared: bool


@contextlib.contextmanager
def redis_for_check(url: str | None, data_dir: Path) -> Iterator[RedisTarget]:
    """``url``'s server, or a redis-server started here (random password, free port), stopped on exit.

    Raises:
        SetupError: no redis-server on PATH (and no ``url``), a malformed ``url``, or a server that does not start.
    """
    if url:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise SetupError(f"--redis-url must look like redis://:PASSWORD@HOST:PORT/DB (or rediss://), got {url!r}")
        password = urllib.parse.unquote(parts.password or "") or os.environ.get(c.ENV_REDIS_PASSWORD, "")
        db = int(parts.path.lstrip("/") or 0)
        connection = RedisConnection(host=parts.hostname, port=parts.port or 6379, tls=parts.scheme == "rediss", db=db)
        yield RedisTarget(connection, password, shared=True)
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SetupError(
            "redis-server is not on PATH: install it (apt-get install redis-server) or pass --redis-url "
            "redis://:PASSWORD@HOST:PORT/0"
        )
    port, password = free_port(), secrets.token_hex(16)
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password, "--dir", str(data_dir),
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SetupError(f"redis-server did not start on port {port} (exit status {process.poll()})") from None
                time.sleep(0.05)
        client.close()
        yield RedisTarget(RedisConnection(host="127.0.0.1", port=port), password, shared=False)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def make_config(target: RedisTarget, checkpoint_dir: Path) -> JobConfig:
    """One trainer process, the tiny model, GRPO with basic metrics, 3 steps of 4 documents, checkpoints at 2 and 3."""
    spec = {
        "model": {"source": "tiny", "tiny": TINY},
        "algorithm": {"loss": "grpo", "metrics": "basic"},
        "trainer": {
            "processesPerNode": 1,
            "batch": {"documentsPerStep": DOCUMENTS_PER_STEP, "microBatchTokens": 24},  # 2 micro-batches per step
            "optimizer": {"learningRate": 1e-2, "warmupSteps": 1, "gradClip": 1.0, "weightDecay": 0.01},
            "checkpoint": {"everySteps": 2, "keepLast": 10},
            "maxSteps": MAX_STEPS,
            "collectiveTimeoutSeconds": 120,
            "dataTimeoutSeconds": 60,
        },
        "rollout": {"sampling": {"temperature": TEMPERATURE}, "replicas": 1},
    }
    name = "device-check"
    if target.shared:  # a shared Redis: keys under rljob:{namespace}:{job}:, a job name nobody else uses
        scheme = "rediss" if target.connection.tls else "redis"
        url = f"{scheme}://{target.connection.host}:{target.connection.port}/{target.connection.db}"  # no password
        spec["redis"] = {"mode": "external", "url": url}
        name = f"device-check-{uuid.uuid4().hex[:8]}"
    config = resolve(name, "default", RLTrainingJobSpec.model_validate(spec), target.connection)
    return config.model_copy(
        update={"checkpoint_dir": str(checkpoint_dir), "metrics_port": 0, "weights_port": free_port(),
                "trainer_master_host": "127.0.0.1"}
    )


# --- 1. losses and metrics on the device -----------------------------------------------------------------------
def loss_inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A packed micro-batch of 3 documents (lengths 5, 7, 4; the first 2 tokens of each unlabelled), float32."""
    lengths = [5, 7, 4]
    index = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    mask = torch.cat([torch.arange(n) >= 2 for n in lengths])
    old = -torch.rand(len(index), generator=generator) * 3 - 0.1
    return {
        "new_logprobs": old + 0.3 * torch.randn(len(index), generator=generator),
        "old_logprobs": old,
        "advantages": torch.randn(len(lengths), generator=generator)[index],
        "label_mask": mask,
        "document_index": index,
    }


def loss_on(device: torch.device, loss_fn: Any, inputs: dict[str, torch.Tensor], **kwargs: Any) -> tuple[float, torch.Tensor]:
    """(loss value, gradient [T] w.r.t. new_logprobs, on CPU) of ``loss_fn`` computed on ``device``."""
    moved = {k: v.to(device, copy=True) for k, v in inputs.items()}  # copies: the inputs never get a gradient
    moved["new_logprobs"].requires_grad_(True)
    loss = loss_fn(**moved, **kwargs).loss
    loss.backward()
    return loss.item(), moved["new_logprobs"].grad.to("cpu", copy=True)


def check_losses(report: Report, device: torch.device) -> None:
    """grpo_loss / gspo_loss in float32 on ``device`` against the same call on CPU: value and gradient."""
    inputs = loss_inputs(torch.Generator().manual_seed(1))
    for name, fn, kwargs in (
        ("grpo_loss", grpo_loss, {"num_labels_in_batch": 20}),
        ("gspo_loss", gspo_loss, {"epsilon_low": 0.05, "epsilon_high": 0.05}),
    ):
        value, grad = loss_on(device, fn, inputs, **kwargs)
        ref_value, ref_grad = loss_on(torch.device("cpu"), fn, inputs, **kwargs)
        grad_diff = float((grad - ref_grad).abs().max())
        ok = close(value, ref_value, DEVICE_RTOL, DEVICE_ATOL) and torch.allclose(grad, ref_grad, DEVICE_RTOL, DEVICE_ATOL)
        ok = ok and float(ref_grad.abs().sum()) > 0
        report.check(f"{name}_{device.type}_matches_cpu", ok,
                     f"loss {value:.8f} vs {ref_value:.8f} on cpu, max |grad diff| {grad_diff:.2e}")


def metrics_on(device: torch.device, inputs: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], seen: int) -> dict[str, float]:
    """StepMetrics (full level, GRPO) of two micro-batches (the inputs, then the inputs reversed) on ``device``."""
    metrics = StepMetrics("full", loss="grpo", epsilon_low=0.2, epsilon_high=0.2, temperature=TEMPERATURE, device=device)
    for reverse in (False, True):
        moved = {k: (v.flip(0) if reverse else v).to(device) for k, v in {**inputs, **extra}.items()}
        metrics.update(
            new_logprobs=moved["new_logprobs"], old_logprobs=moved["old_logprobs"], advantages=moved["advantages"],
            label_mask=moved["label_mask"], document_index=moved["document_index"], documents_seen=seen,
            reward=moved["reward"], model_version=moved["model_version"], logits=moved["logits"],
        )
    return metrics.reduce()


def check_metrics(report: Report, config: JobConfig, device: torch.device) -> None:
    """StepMetrics on ``device``, reduced through a one-rank group of the trainer's backend, against CPU without one;
    and hand values: reward per document, staleness of versions above 2**24 (exact int64 difference)."""
    generator = torch.Generator().manual_seed(2)
    inputs = loss_inputs(generator)
    index = inputs["document_index"]
    rewards = torch.tensor([0.25, 0.5, 1.0])
    seen = 2**40 + 7
    version_by_doc = torch.tensor([seen - 1, seen - 3, seen - 6])  # staleness 1, 3, 6 (float32 would round them)
    extra = {
        "reward": rewards[index],
        "model_version": version_by_doc[index],
        "logits": torch.randn(len(index), 14, generator=generator),
    }
    expected = metrics_on(torch.device("cpu"), inputs, extra, seen)  # no process group: no collective
    where = init_distributed(config)  # a world of one, NCCL on GPU (gloo in the dry run)
    try:
        got = metrics_on(where.device, inputs, extra, seen)
    finally:
        shutdown_distributed()
    # A metric over no token (the sampler mismatch: no token of the trainer's current version here) is NaN on both.
    empty = {k for k in expected if math.isnan(expected[k]) and math.isnan(got.get(k, 0.0))}
    ok = got.keys() == expected.keys() and all(close(got[k], expected[k], DEVICE_RTOL, DEVICE_ATOL)
                                               for k in expected if k not in empty)
    worst = max((k for k in expected if k not in empty), key=lambda k: abs(got.get(k, math.inf) - expected[k]))
    report.check(f"step_metrics_{where.backend}_matches_cpu", ok,
                 f"{len(got)} metrics reduced over a 1-rank {where.backend} group on {where.device}; "
                 f"worst {worst} {got.get(worst, math.nan):.8f} vs {expected[worst]:.8f}")
    hand = {
        "train_samples_reward": (0.25 + 0.5 + 1.0) / 3, "max_train_samples_reward": 1.0, "min_train_samples_reward": 0.25,
        "staleness": (1 + 3 + 6) / 3, "max_staleness": 6.0, "min_staleness": 1.0, "num_tokens": 2 * 10.0,
    }
    ok = all(close(got[k], v, 1e-12, 1e-12) for k, v in hand.items())
    report.check("step_metrics_hand_values", ok, ", ".join(f"{k}={got[k]:g} (want {v:g})" for k, v in hand.items()))


# --- 2. a real training run -------------------------------------------------------------------------------------
def make_documents(count: int, seed: int) -> list[Document]:
    """Digit documents: <bos>, 4 prompt digits, ``|``, 4 completion digits (prompt labels masked).

    Document j of step k (documents_seen 4k before it) was sampled with version ``max(0, 4k - j)``, its last
    token with one version less (floored at 0): staleness differs between documents and within one.
    """
    rng = np.random.default_rng(seed)
    tokenizer = DigitTokenizer()
    docs = []
    for n in range(count):
        step, j = divmod(n, DOCUMENTS_PER_STEP)
        digits = "".join(str(d) for d in rng.integers(0, 10, 8))
        tokens = np.asarray(tokenizer.encode(digits[:4] + "|" + digits[4:]), dtype=np.int64)
        old = np.zeros(len(tokens), dtype=np.float32)
        old[6:] = rng.uniform(-3.0, -1.0, len(tokens) - 6)
        version = np.full(len(tokens), max(0, DOCUMENTS_PER_STEP * step - j), dtype=np.int64)
        version[-1] = max(0, version[-1] - 1)
        docs.append(Document(tokens=tokens, old_log_probabilities=old, model_version=version,
                             loss_masking_spans=[(0, 6)], advantage=float(rng.normal()), reward=float(rng.uniform())))
    return docs


def expected_step_metrics(docs: list[Document], documents_seen: int) -> dict[str, float]:
    """Reward and staleness metrics of one step's documents, by DESIGN §4 (document-weighted means)."""
    staleness = [documents_seen - doc.model_version[doc.label_mask()] for doc in docs]
    rewards = [doc.reward for doc in docs]
    return {
        "train_samples_reward": sum(rewards) / len(docs),
        "max_train_samples_reward": max(rewards),
        "min_train_samples_reward": min(rewards),
        "staleness": sum(float(s.mean()) for s in staleness) / len(docs),
        "max_staleness": float(max(s.max() for s in staleness)),
        "min_staleness": float(min(s.min() for s in staleness)),
        "num_tokens": float(sum(int(doc.label_mask().sum()) for doc in docs)),
    }


def reference_first_step(config: JobConfig, docs: list[Document]) -> dict[str, float]:
    """First-step GRPO loss and mean new log-probability of the untrained model, float64 on CPU, one document at a
    time; ``scale`` is the loss with |A| (what a tolerance is relative to)."""
    model = build_model(config.spec.model, DigitTokenizer().vocab_size, config.spec.trainer.seed).double()
    low, high = config.spec.algorithm.resolved_epsilons()
    total = scale = labels = 0.0
    new_means = []
    for doc in docs:
        ids = torch.tensor(doc.tokens)[None]
        with torch.no_grad():
            log_p = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / TEMPERATURE, -1)
        new = log_p.gather(1, ids[0, 1:, None]).squeeze(1)
        mask = torch.tensor(doc.label_mask()[1:])
        ratio = (new - torch.tensor(doc.old_log_probabilities[1:], dtype=torch.float64)).exp()[mask]
        total += -torch.minimum(ratio * doc.advantage, ratio.clamp(1 - low, 1 + high) * doc.advantage).sum().item()
        scale += (ratio * abs(doc.advantage)).sum().item()
        labels += int(mask.sum())
        new_means.append(new[mask].mean().item())
    return {"loss": total / labels, "scale": scale / labels, "new_logprobs": sum(new_means) / len(docs)}


def trainer_env(config_path: Path, password: str, dry_run_cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = [str(REPO / "api"), str(REPO / "trainer_image"), env.get("PYTHONPATH", "")]
    env.update({c.ENV_CONFIG: str(config_path), c.ENV_REDIS_PASSWORD: password, "PYTHONPATH": os.pathsep.join(p for p in path if p)})
    env.setdefault("OMP_NUM_THREADS", "1")
    if dry_run_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_trainer(env: dict[str, str], workdir: Path, client: redis.Redis, config: JobConfig) -> tuple[int | None, list[int], str, str]:
    """``torchrun --nproc-per-node=1 -m rljob_trainer.train`` until it exits or :data:`TRAINER_TIMEOUT_S`.

    Returns (exit status or None on timeout, the progress-hash steps seen while it ran, stdout, stderr).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "rljob_trainer.train"]
    out_path, err_path = workdir / "trainer.stdout", workdir / "trainer.stderr"
    steps_seen: list[int] = []
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=err)
        deadline = time.monotonic() + TRAINER_TIMEOUT_S
        try:
            while process.poll() is None and time.monotonic() < deadline:
                step = client.hget(config.keys.progress, "step")
                if step is not None and (not steps_seen or steps_seen[-1] != int(step)):
                    steps_seen.append(int(step))
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                process.terminate()  # torchrun forwards the signal to its worker and waits for it
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                status = None
            else:
                status = process.returncode
    return status, steps_seen, out_path.read_text(), err_path.read_text()


def check_training(report: Report, config: JobConfig, target: RedisTarget, workdir: Path, dry_run_cpu: bool) -> None:
    """Write documents, run the trainer, check everything it left behind (module docstring, part 2)."""
    device_type = "cpu" if dry_run_cpu else "cuda"
    client = connect(config, password=target.password)
    docs = make_documents(DOCUMENTS_PER_STEP * MAX_STEPS, seed=0)
    ids = [client.xadd(config.keys.stream, encode_document(doc)).decode() for doc in docs]
    progress_before = client.hgetall(config.keys.progress)
    config_path = workdir / "config.json"
    config_path.write_text(config.to_json())
    started = time.monotonic()
    status, steps_seen, stdout, stderr = run_trainer(trainer_env(config_path, target.password, dry_run_cpu), workdir, client, config)
    if not report.check("trainer_exit_0", status == 0, f"exit status {status} after {time.monotonic() - started:.1f} s"):
        print(f"--- trainer stdout (tail)\n{stdout[-3000:]}\n--- trainer stderr (tail)\n{stderr[-6000:]}", file=sys.stderr)

    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    steps = [(x["step"], x["documents_seen"], x["model_version"]) for x in lines]
    want_steps = [(s, DOCUMENTS_PER_STEP * s, DOCUMENTS_PER_STEP * s) for s in range(1, MAX_STEPS + 1)]
    counters_zero = all(v == 0 for x in lines for v in x["stream"].values())
    report.check("steps_completed", steps == want_steps and counters_zero,
                 f"(step, documents_seen, model_version) {steps}, want {want_steps}; stream counters all 0: {counters_zero}")

    finite = all(math.isfinite(x["metrics"][k]) for x in lines for k in ("loss", "grad_norm")) and bool(lines)
    reference = reference_first_step(config, docs[:DOCUMENTS_PER_STEP])
    tolerance = REFERENCE_TOLERANCE[device_type] * reference["scale"]
    first = lines[0]["metrics"] if lines else {"loss": math.nan, "new_logprobs": math.nan}
    ok = finite and close(first["loss"], reference["loss"], 0, tolerance) and close(
        first["new_logprobs"], reference["new_logprobs"], REFERENCE_TOLERANCE[device_type])
    report.check("loss_finite_and_matches_reference", ok,
                 f"losses {[round(x['metrics']['loss'], 6) for x in lines]}; step 1 loss {first['loss']:.6f} vs float64 "
                 f"{reference['loss']:.6f} (tolerance {tolerance:.1e}), new_logprobs {first['new_logprobs']:.5f} vs "
                 f"{reference['new_logprobs']:.5f}")

    for group, names in (("reward", ("train_samples_reward", "max_train_samples_reward", "min_train_samples_reward")),
                         ("staleness", ("staleness", "max_staleness", "min_staleness", "num_tokens"))):
        got, want = [], []
        for k in range(MAX_STEPS):
            step_docs = docs[DOCUMENTS_PER_STEP * k : DOCUMENTS_PER_STEP * (k + 1)]
            expected = expected_step_metrics(step_docs, DOCUMENTS_PER_STEP * k)  # documents_seen 4k before step k+1
            want.append([expected[n] for n in names])
            got.append([lines[k]["metrics"].get(n, math.nan) if k < len(lines) else math.nan for n in names])
        ok = all(close(g, w, 1e-6, 1e-9) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
        shown = [[round(g, 5) for g in gs] for gs in got], [[round(w, 5) for w in ws] for ws in want]
        report.check(f"metrics_{group}", ok, f"{list(names)} per step {shown[0]}, want {shown[1]}")

    checkpoints = committed_checkpoints(Path(config.checkpoint_dir))
    commits = [json.loads((p / COMMIT_FILE).read_text()) for p in checkpoints]
    covered = sorted(e for commit in commits for per_rank in commit["covered_entry_ids"].values() for e in per_rank)
    rng_states = [torch.load(p / "rng" / "rank-0.pt", weights_only=True) for p in checkpoints]
    on_cuda = [("cuda" in state) for state in rng_states]
    group = client.xinfo_groups(config.keys.stream)[0] if client.exists(config.keys.stream) else {}
    ok = [p.name for p in checkpoints] == ["step-00000002", "step-00000003"] and covered == sorted(ids)
    ok = ok and [commit["documents_seen"] for commit in commits] == [8, 12] and group.get("pending") == 0
    report.check("checkpoint_committed", ok,
                 f"{[p.name for p in checkpoints]} covering {len(covered)} of {len(ids)} entries, "
                 f"pending after acks {group.get('pending')}, stream length {client.xlen(config.keys.stream)}")

    events = [json.loads(fields[b"event"]) for _, fields in client.xrange(config.keys.events)]
    announced = [(e["type"], e.get("step"), e.get("documents_seen")) for e in events]
    want_events = [("weights_ready", s, DOCUMENTS_PER_STEP * s) for s in range(MAX_STEPS + 1)]
    want_events.append(("training_finished", MAX_STEPS, DOCUMENTS_PER_STEP * MAX_STEPS))
    backends = sorted({e["transfer"]["backend"] for e in events if "transfer" in e})
    report.check("weights_ready_published", announced == want_events, f"events {announced}")
    want_backend = "gloo" if dry_run_cpu else "nccl"
    report.check(f"trainer_ran_on_{device_type}", backends == [want_backend] and on_cuda == [not dry_run_cpu] * 2,
                 f"weights_ready transfer backend {backends} (want ['{want_backend}']), CUDA RNG state in checkpoints {on_cuda}")

    progress = {k.decode(): v.decode() for k, v in client.hgetall(config.keys.progress).items()}
    final = (progress.get("step"), progress.get("documents_seen"), progress.get("model_version"))
    want_final = (str(MAX_STEPS), str(DOCUMENTS_PER_STEP * MAX_STEPS), str(DOCUMENTS_PER_STEP * MAX_STEPS))
    same_metrics = bool(lines) and json.loads(progress.get("metrics", "{}")).keys() == lines[-1]["metrics"].keys()
    report.check("progress_hash_advanced",
                 not progress_before and final == want_final and steps_seen == sorted(steps_seen) and same_metrics,
                 f"empty before: {not progress_before}; steps seen while running {steps_seen}; final "
                 f"(step, documents_seen, model_version) {final}; metrics keys match the last JSON line: {same_metrics}")

    export = Path(config.checkpoint_dir) / EXPORT_DIR / "model.safetensors"
    trained = load_file(export) if export.is_file() else {}
    initial = build_model(config.spec.model, DigitTokenizer().vocab_size, config.spec.trainer.seed).state_dict()
    changed = [n for n in trained if not torch.equal(trained[n], initial[n])]
    ok = trained.keys() == initial.keys() and all(bool(t.isfinite().all()) for t in trained.values()) and len(changed) > 0
    report.check("weights_trained_and_exported", ok,
                 f"{export.name}: {len(trained)} tensors, {len(changed)} changed by AdamW, all finite: "
                 f"{all(bool(t.isfinite().all()) for t in trained.values())}")
    if target.shared:
        keys = config.keys  # every key of the check's job: the prefixed ones, and the stream and events keys
        client.delete(keys.stream, keys.events, *client.scan_iter(match=keys.prefix + "*"))
    client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run-cpu", action="store_true", help="hide the GPUs: the same checks on CPU with gloo")
    parser.add_argument("--redis-url", help="use this Redis instead of starting redis-server (redis://:PASSWORD@HOST:PORT/DB)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.dry_run_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before the first CUDA call; the trainer inherits it
    torch.set_num_threads(1)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="rljob-device-check-") as tmp:
        workdir = Path(tmp)
        try:
            if torch.cuda.is_available() == args.dry_run_cpu:
                raise SetupError("CUDA is still visible in the dry run" if args.dry_run_cpu else
                                 "no CUDA device is visible: run on a GPU machine, or pass --dry-run-cpu")
            with redis_for_check(args.redis_url, workdir) as target:
                device = torch.device("cpu" if args.dry_run_cpu else "cuda")
                name = "cpu (dry run)" if args.dry_run_cpu else torch.cuda.get_device_name()
                print(f"device_check_trainer: {name}, torch {torch.__version__}, Redis at "
                      f"{target.connection.host}:{target.connection.port}", flush=True)
                config = make_config(target, workdir / "checkpoints")
                check_losses(report, device)
                check_metrics(report, config, device)
                check_training(report, config, target, workdir, args.dry_run_cpu)
        except SetupError as error:
            report.check("setup", False, str(error))
        except Exception as error:  # noqa: BLE001 - reported as a failed check, with the traceback on stderr
            traceback.print_exc()
            report.check("no_unexpected_error", False, repr(error))
    print(f"device_check_trainer: {'PASSED' if report.passed else 'FAILED'} "
          f"({sum(report.results.values())}/{len(report.results)} checks, {time.monotonic() - started:.1f} s)", flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
