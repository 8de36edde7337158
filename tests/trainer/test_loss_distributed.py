"""Loss and metrics across real torch.distributed gloo ranks (spawned processes, file:// rendezvous).

- DDP with 2 ranks, the step's global normaliser and :func:`scale_for_gradient_mean` gives the single-process
  gradient on the same documents (GRPO and GSPO).
- Reduced metrics are identical on every rank (2 and 3 ranks) and equal the single-process metrics, with and without
  the loss corrections (their metrics, and the sampler/trainer mismatch's token mean over ranks).
- Mixed presence of ``reward`` makes every rank raise the same MetricsInputError, within a bounded time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rljob_trainer.loss import Corrections, count_labels_and_documents, grpo_loss, gspo_loss, scale_for_gradient_mean
from rljob_trainer.loss_metrics import MetricsInputError, StepMetrics
from rljob_trainer.metrics_registry import DEAD_LETTERED_PREFIX, STREAM_COUNTERS
from rljob_trainer.parallel import reduce_small, start_reduce_small
from train_harness import JOIN_TIMEOUT_S, init_gloo, leave_rank, run_ranks

torch.set_num_threads(1)
VOCAB, WIDTH = 11, 8


# --- a tiny policy and its documents ------------------------------------------------------------------
class TinyPolicy(torch.nn.Module):
    """logits of token t = Linear(Embedding(token t-1)): enough parameters for a real DDP gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T] log p(tokens[t] | tokens[t-1]) (position 0 of a document is masked by callers)."""
        previous = torch.roll(tokens, 1)
        log_probs = torch.log_softmax(self.head(self.embed(previous)), dim=-1)
        return log_probs.gather(1, tokens[:, None]).squeeze(1)


def make_documents(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Documents with 1-2 masked prompt tokens, old log-probs = current ones + noise, a per-document advantage."""
    g = torch.Generator().manual_seed(seed)
    policy = TinyPolicy()
    documents = []
    for i in range(count):
        length = int(torch.randint(3, 8, (1,), generator=g))
        tokens = torch.randint(0, VOCAB, (length,), generator=g)
        mask = torch.arange(length) >= int(torch.randint(1, 3, (1,), generator=g))
        with torch.no_grad():
            old = policy(tokens) + 0.4 * torch.randn(length, generator=g)
        documents.append(
            {
                "tokens": tokens,
                "old_logprobs": old,
                "label_mask": mask,
                "advantages": torch.full((length,), float(torch.randn(1, generator=g))),
                "reward": torch.full((length,), float(torch.rand(1, generator=g))),
                "model_version": torch.full((length,), 2**30 + seed * 100 + i, dtype=torch.int64),
            }
        )
    return documents


def pack(documents: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch: concatenated documents and a 0-based document index."""
    packed = {key: torch.cat([d[key] for d in documents]) for key in documents[0]}
    packed["document_index"] = torch.cat([torch.full((len(d["tokens"]),), i) for i, d in enumerate(documents)])
    return packed


def step_gradient(model, micro_batches, loss_name: str, num_labels, num_documents, world_size: int):
    """One optimizer step's backward over micro-batches (DDP syncs on the last one); returns the gradients."""
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last else None
        inputs = (
            model(batch["tokens"]),
            batch["old_logprobs"],
            batch["advantages"],
            batch["label_mask"],
            batch["document_index"],
        )
        if loss_name == "grpo":
            loss = grpo_loss(*inputs, num_labels_in_batch=num_labels).loss
        else:
            loss = gspo_loss(*inputs, epsilon_low=0.05, epsilon_high=0.05, num_documents_in_batch=num_documents).loss
        if sync is None:
            scale_for_gradient_mean(loss, world_size).backward()
        else:
            with sync:
                scale_for_gradient_mean(loss, world_size).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


DOCUMENTS_PER_RANK = 4


def ddp_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    init_gloo(rank, world_size, tmp_dir)
    documents = make_documents(seed=7, count=DOCUMENTS_PER_RANK * world_size)
    mine = documents[rank * DOCUMENTS_PER_RANK : (rank + 1) * DOCUMENTS_PER_RANK]
    micro_batches = [pack(mine[:2]), pack(mine[2:])]
    counts = torch.stack(
        [torch.stack(count_labels_and_documents(b["label_mask"], b["document_index"])) for b in micro_batches]
    ).sum(0)
    dist.all_reduce(counts)  # the step's global labelled-token and document counts
    result = {}
    for loss_name in ("grpo", "gspo"):
        model = torch.nn.parallel.DistributedDataParallel(TinyPolicy())
        grads = step_gradient(model, micro_batches, loss_name, counts[0], counts[1], world_size)
        result[loss_name] = {name.removeprefix("module."): g for name, g in grads.items()}
    torch.save(result, f"{tmp_dir}/grads_{rank}.pt")
    leave_rank()


def test_two_ddp_ranks_give_the_single_process_gradient(tmp_path):
    run_ranks(ddp_worker, 2, tmp_path)
    documents = make_documents(seed=7, count=DOCUMENTS_PER_RANK * 2)
    whole = pack(documents)
    num_labels, num_documents = count_labels_and_documents(whole["label_mask"], whole["document_index"])
    ranks = [torch.load(tmp_path / f"grads_{r}.pt") for r in range(2)]
    for loss_name in ("grpo", "gspo"):
        single = step_gradient(TinyPolicy(), [whole], loss_name, num_labels, num_documents, world_size=1)
        assert any(g.abs().sum() > 0 for g in single.values())
        for rank_grads in ranks:
            for name, expected in single.items():
                torch.testing.assert_close(rank_grads[loss_name][name], expected, rtol=1e-5, atol=1e-7)


# --- metrics -------------------------------------------------------------------------------------------
def rank_micro_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    documents = make_documents(seed=rank + 1, count=3 + rank)  # ranks see different amounts of data
    return [pack(documents[:2]), pack(documents[2:])]


def metric_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    new = TinyPolicy()(batch["tokens"])
    logits = torch.randn(len(batch["tokens"]), VOCAB, generator=torch.Generator().manual_seed(len(batch["tokens"])))
    return {
        "new_logprobs": new,
        "old_logprobs": batch["old_logprobs"],
        "advantages": batch["advantages"],
        "label_mask": batch["label_mask"],
        "document_index": batch["document_index"],
        "reward": batch["reward"],
        "model_version": batch["model_version"],
        "logits": logits,
    }


DOCUMENTS_SEEN = 2**30 + 1000
CORRECTIONS = Corrections(dual_clip=1.5, is_cap=1.2, kl_coef=0.1)
CURRENT = 2**30 + 100
"""documents_seen at which rank 0's first document is on the trainer's current weights (sampler_mismatch_*)."""


def corrected_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs = metric_inputs(batch)
    del inputs["logits"]
    noise = torch.randn(len(batch["tokens"]), generator=torch.Generator().manual_seed(7))
    return {**inputs, "ref_logprobs": inputs["new_logprobs"].detach() + 0.3 * noise}


def metrics_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    init_gloo(rank, world_size, tmp_dir)
    metrics = StepMetrics("full")
    corrected = StepMetrics("basic", corrections=CORRECTIONS)
    for batch in rank_micro_batches(rank):
        metrics.update(**metric_inputs(batch), documents_seen=DOCUMENTS_SEEN)
        corrected.update(**corrected_inputs(batch), documents_seen=CURRENT)
    Path(f"{tmp_dir}/metrics_{rank}.json").write_text(json.dumps([metrics.reduce(), corrected.reduce()]))
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduced_metrics_are_identical_on_every_rank_and_match_one_process(tmp_path, world_size):
    run_ranks(metrics_worker, world_size, tmp_path)
    results = [json.loads((tmp_path / f"metrics_{r}.json").read_text()) for r in range(world_size)]
    assert all(result == results[0] for result in results)  # exactly equal, not just close
    per_rank = [plain for plain, _ in results]
    single, corrected = StepMetrics("full"), StepMetrics("basic", corrections=CORRECTIONS)
    for rank in range(world_size):
        for batch in rank_micro_batches(rank):
            single.update(**metric_inputs(batch), documents_seen=DOCUMENTS_SEEN)
            corrected.update(**corrected_inputs(batch), documents_seen=CURRENT)
    expected = single.reduce()
    assert per_rank[0] == pytest.approx(expected, rel=1e-12, nan_ok=True)  # no current token: mismatch NaN
    # With every correction on: their metrics, and the mismatch over the one rank that holds current tokens.
    with_corrections = results[0][1]
    assert with_corrections == pytest.approx(corrected.reduce(), rel=1e-12)
    first = rank_micro_batches(0)[0]
    assert with_corrections["sampler_mismatch_tokens"] == float(first["label_mask"][first["document_index"] == 0].sum())
    assert with_corrections["max_behaviour_weight"] > 1.2 and 0 < with_corrections["kl_ref"]
    # Extremes come from different ranks: the newest version is on the last rank, the oldest on rank 0.
    assert per_rank[0]["min_staleness"] == DOCUMENTS_SEEN - (2**30 + world_size * 100 + 2 + world_size - 1)
    assert per_rank[0]["max_staleness"] == DOCUMENTS_SEEN - (2**30 + 100)
    assert per_rank[0]["num_tokens"] == sum(
        float(b["label_mask"].sum()) for r in range(world_size) for b in rank_micro_batches(r)
    )


def mixed_presence_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    init_gloo(rank, world_size, tmp_dir)
    metrics = StepMetrics("basic")
    for i, batch in enumerate(rank_micro_batches(rank)):
        inputs = metric_inputs(batch)
        del inputs["logits"]
        if rank == 1 and i == 1:
            del inputs["reward"]  # as if a reward-less entry got past the decoder on rank 1 only
        metrics.update(**inputs, documents_seen=DOCUMENTS_SEEN)
    try:
        metrics.reduce()
        outcome = "no error"
    except MetricsInputError as err:
        outcome = str(err)
    # The ranks are still in step: one more collective completes.
    check = torch.ones(1)
    dist.all_reduce(check)
    Path(f"{tmp_dir}/outcome_{rank}.txt").write_text(f"{outcome}|{check.item()}")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_mixed_presence_raises_the_same_error_on_every_rank(tmp_path):
    started = time.monotonic()
    run_ranks(mixed_presence_worker, 2, tmp_path)
    outcomes = [(tmp_path / f"outcome_{r}.txt").read_text() for r in range(2)]
    assert outcomes[0] == outcomes[1]
    assert "`reward` missing in 1 micro-batch(es) on rank(s) [1]" in outcomes[0]
    assert outcomes[0].endswith("|2.0")
    assert time.monotonic() - started < JOIN_TIMEOUT_S


def totals_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    init_gloo(rank, world_size, tmp_dir)
    totals = {"loss": 0.25 * (rank + 1), "redeliveries": rank, "dropped_too_long": 1, "dead_lettered": rank,
              "lost_pending": 2 * rank, "dropped_stale": 3 * rank,
              **{name: 0 for name in STREAM_COUNTERS if name.startswith(DEAD_LETTERED_PREFIX)},
              "dead_lettered.bad_value": rank}
    results = [StepMetrics(level).reduce(totals=totals) for level in ("none", "basic")]
    Path(f"{tmp_dir}/totals_{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_step_totals_are_summed_over_ranks_at_every_level(tmp_path):
    # Level none still reduces the loss and the stream counters: every rank joins the SUM every step.
    run_ranks(totals_worker, 2, tmp_path)
    per_rank = [json.loads((tmp_path / f"totals_{r}.json").read_text()) for r in range(2)]
    expected = {"loss": 0.75, "redeliveries": 1, "dropped_too_long": 2, "dead_lettered": 1, "lost_pending": 2,
                "dropped_stale": 3, **{name: 0 for name in STREAM_COUNTERS if name.startswith(DEAD_LETTERED_PREFIX)},
                "dead_lettered.bad_value": 1}
    assert per_rank[0] == per_rank[1]
    none, basic = per_rank[0]
    assert none == expected
    assert {k: basic[k] for k in expected} == expected and basic["num_tokens"] == 0.0


def small_reduction_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    init_gloo(rank, world_size, tmp_dir)
    total = torch.tensor([0.1 * (rank + 1), 2.0**-40 * rank, 2.0**50 + rank], dtype=torch.float64)
    maximum = torch.tensor([float(rank), -float(rank), float("-inf")], dtype=torch.float64)
    gathered = reduce_small(total.clone(), maximum.clone())
    reduced = reduce_small(total.clone(), maximum.clone(), gather_max_world=1)  # two all-reduces
    counts = reduce_small(torch.tensor([rank, 7], dtype=torch.int64))[0]
    # Started asynchronously, with another collective issued (and finished) while it travels, as the trainer's
    # forward and gradient clipping do: the same values, whether gathered or all-reduced.
    started = [start_reduce_small(total.clone(), maximum.clone()),
               start_reduce_small(total.clone(), maximum.clone(), gather_max_world=1)]
    between = torch.tensor([float(rank)])
    dist.all_reduce(between)
    late = [[t.tolist() for t in pending.wait()] for pending in started]
    assert all(pending.wait() is pending.wait() for pending in started)  # waited for once
    Path(f"{tmp_dir}/small_{rank}.json").write_text(json.dumps(
        [[t.tolist() for t in gathered], [t.tolist() for t in reduced], counts.tolist(), late, between.item()]))
    dist.destroy_process_group()


def test_small_reductions_through_a_gather_equal_the_all_reduces_and_agree_on_every_rank(tmp_path):
    run_ranks(small_reduction_worker, 3, tmp_path)
    per_rank = [json.loads((tmp_path / f"small_{r}.json").read_text()) for r in range(3)]
    assert per_rank[0] == per_rank[1] == per_rank[2]  # exactly, not just close
    (gathered_sum, gathered_max), (reduced_sum, reduced_max), counts, late, between = per_rank[0]
    assert late == [[gathered_sum, gathered_max], [reduced_sum, reduced_max]] and between == 3.0
    assert gathered_max == reduced_max == [2.0, 0.0, float("-inf")]
    assert gathered_sum == pytest.approx(reduced_sum, rel=1e-15) and gathered_sum[2] == 3 * 2.0**50 + 3
    assert gathered_sum[0] == pytest.approx(0.6, rel=1e-15) and gathered_sum[1] == 3 * 2.0**-40
    assert counts == [3, 21]


def test_small_reduction_without_a_group_returns_its_inputs_and_refuses_mixed_dtypes():
    total = torch.tensor([1.5])
    assert reduce_small(total) == (total, None)
    with pytest.raises(ValueError, match="maximum is torch.float64 on cpu, total torch.float32 on cpu"):
        reduce_small(total, torch.zeros(1, dtype=torch.float64))
