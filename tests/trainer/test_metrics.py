"""Loss metrics in one process: levels, names, document weighting, staleness exactness, entropy, presence."""

from __future__ import annotations

import math

import pytest
import torch
from rljob_api.config import RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_trainer.loss import Corrections
from rljob_trainer.loss_metrics import MetricsInputError, StepMetrics, token_entropy
from rljob_trainer.metrics_registry import (DEAD_LETTERED_PREFIX, METRICS, STREAM_COUNTERS, metric_definitions,
                                            metrics_level, resolve_metrics_level)

torch.set_num_threads(1)
F64 = torch.float64

BASIC_NAMES = [
    "new_logprobs",
    "old_logprobs",
    "ratio_new_old",
    "kl_new_old",
    "clipped_ratio_fraction",
    "advantage",
    "max_advantage",
    "min_advantage",
    "num_tokens",
    "train_samples_reward",
    "max_train_samples_reward",
    "min_train_samples_reward",
    "staleness",
    "max_staleness",
    "min_staleness",
    "sampler_mismatch_tokens",
    "sampler_mismatch_ratio",
    "sampler_mismatch_kl",
]


# --- levels and definitions ----------------------------------------------------------------------
def test_definitions_per_level():
    assert metric_definitions("none") == ()
    assert [m.name for m in metric_definitions("basic")] == BASIC_NAMES
    full = [m.name for m in metric_definitions("full")]
    assert full == BASIC_NAMES[:9] + ["entropy"] + BASIC_NAMES[9:]
    reductions = {m.name: m.reduction for m in METRICS}
    assert {n for n, r in reductions.items() if r == "max"} == {
        "max_advantage",
        "max_train_samples_reward",
        "max_staleness",
        "max_behaviour_weight",
    }
    assert {n for n, r in reductions.items() if r == "min"} == {
        "min_advantage",
        "min_train_samples_reward",
        "min_staleness",
    }
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        metric_definitions("auto")  # type: ignore[arg-type]


CORRECTION_NAMES = {
    "dual_clip": ["dual_clip_fraction"],
    "importance_sampling": ["behaviour_weight", "max_behaviour_weight", "behaviour_weight_truncated_fraction"],
    "kl": ["kl_ref"],
}


def test_a_corrections_metrics_are_registered_only_when_it_is_on():
    everything = frozenset(CORRECTION_NAMES)
    assert [m.name for m in metric_definitions("basic", everything)] == BASIC_NAMES + [
        name for names in CORRECTION_NAMES.values() for name in names]
    for term, names in CORRECTION_NAMES.items():
        assert [m.name for m in metric_definitions("basic", frozenset({term}))] == BASIC_NAMES + names
    assert metric_definitions("none", everything) == ()
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "algorithm": {
        "dualClip": 3, "klCoef": 0.1, "importanceSampling": {"enabled": True, "cap": 5}}})
    metrics = StepMetrics.from_config(resolve("demo", "default", spec, RedisConnection(host="redis")))
    assert metrics.corrections == Corrections(dual_clip=3.0, is_cap=5.0, kl_coef=0.1, kl_estimator="k3")
    assert [m.name for m in metrics.definitions][len(BASIC_NAMES):] == sum(CORRECTION_NAMES.values(), [])


def test_resolve_level():
    assert resolve_metrics_level("auto", 1) == "basic"
    assert resolve_metrics_level("auto", 2) == "none"
    assert resolve_metrics_level("full", 1) == "full"
    assert resolve_metrics_level("none", 4) == "none"
    with pytest.raises(ValueError, match=r"metrics=basic requires spec.trainer.pipelineParallel == 1, got 2"):
        resolve_metrics_level("basic", 2)
    with pytest.raises(ValueError, match="spec.algorithm.metrics must be one of"):
        resolve_metrics_level("verbose", 1)


def test_from_job_config():
    spec = RLTrainingJobSpec.model_validate(
        {"model": {"source": "tiny"}, "algorithm": {"loss": "gspo", "metrics": "auto"},
         "rollout": {"sampling": {"temperature": 0.7}}}
    )
    config = resolve("demo", "default", spec, RedisConnection(host="redis"))
    assert metrics_level(config) == "basic"
    metrics = StepMetrics.from_config(config)
    assert (metrics.level, metrics.loss, metrics.epsilon_low, metrics.epsilon_high, metrics.temperature) == (
        "basic",
        "gspo",
        3e-4,
        4e-4,
        0.7,
    )
    spec_pp = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "trainer": {"pipelineParallel": 2}})
    assert metrics_level(spec_pp) == "none"


# --- values by hand --------------------------------------------------------------------------------
# doc 0: [prompt, 1 labelled token]; doc 1: [prompt, 3 labelled tokens]. Prompt tokens carry values that
# must not leak (advantage 100, model_version 0, reward 9).
#   labelled lp_new: doc0 [-1], doc1 [-2, -4, -6]; lp_old: doc0 [-1], doc1 [-2.5, -4, -6.1]
#   log-ratios: doc0 [0], doc1 [0.5, 0, 0.1]; advantages: doc0 +1, doc1 -1; rewards 0.75, 0.25
#   model_version: doc0 [90], doc1 [96, 96, 98]; documents_seen 100 -> staleness doc0 [10], doc1 [4, 4, 2]
# Document-weighted means (mean per document, then over the 2 documents):
#   new_logprobs  = (-1 + -4) / 2 = -2.5                       (a token mean would give -3.25)
#   old_logprobs  = (-1 + -12.6/3) / 2 = -2.6
#   ratio_new_old = (1 + (e^0.5 + 1 + e^0.1)/3) / 2 = (1 + 3.7538921888/3) / 2 = 1.1256486981
#   kl_new_old    = (0 + ((e^0.5 - 1.5) + 0 + (e^0.1 - 1.1))/3) / 2 = (0.1538921888/3) / 2 = 0.0256486981
#   clipped_ratio_fraction (clip 0.2: only e^0.5 = 1.6487 is outside) = (0 + 1/3) / 2 = 1/6
#   advantage = (1 - 1) / 2 = 0; max 1, min -1; num_tokens 4
#   train_samples_reward = (0.75 + 0.25) / 2 = 0.5; max 0.75, min 0.25
#   staleness = (10 + 10/3) / 2 = 20/3; max 10, min 2
#   no labelled token has staleness 0 (model_version 100): sampler_mismatch_tokens 0, its means NaN
HAND_EXPECTED = {
    "new_logprobs": -2.5,
    "old_logprobs": -2.6,
    "ratio_new_old": 1.1256486981,
    "kl_new_old": 0.0256486981,
    "clipped_ratio_fraction": 1 / 6,
    "advantage": 0.0,
    "max_advantage": 1.0,
    "min_advantage": -1.0,
    "num_tokens": 4.0,
    "train_samples_reward": 0.5,
    "max_train_samples_reward": 0.75,
    "min_train_samples_reward": 0.25,
    "staleness": 20 / 3,
    "max_staleness": 10.0,
    "min_staleness": 2.0,
    "sampler_mismatch_tokens": 0.0,
    "sampler_mismatch_ratio": math.nan,
    "sampler_mismatch_kl": math.nan,
}


def hand_micro_batch() -> dict[str, torch.Tensor]:
    return {
        "new_logprobs": torch.tensor([-0.5, -1.0, -0.3, -2.0, -4.0, -6.0], dtype=F64, requires_grad=True),
        "old_logprobs": torch.tensor([0.0, -1.0, 0.0, -2.5, -4.0, -6.1], dtype=F64),
        "advantages": torch.tensor([100.0, 1.0, 100.0, -1.0, -1.0, -1.0], dtype=F64),
        "label_mask": torch.tensor([False, True, False, True, True, True]),
        "document_index": torch.tensor([0, 0, 1, 1, 1, 1]),
        "reward": torch.tensor([9.0, 0.75, 9.0, 0.25, 0.25, 0.25], dtype=F64),
        "model_version": torch.tensor([0, 90, 0, 96, 96, 98]),
    }


def take(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def test_values_by_hand_are_document_weighted():
    metrics = StepMetrics("basic")
    metrics.update(**hand_micro_batch(), documents_seen=100)
    out = metrics.reduce()
    assert list(out) == BASIC_NAMES
    assert out == pytest.approx(HAND_EXPECTED, abs=1e-9, nan_ok=True)


def test_sums_accumulate_over_micro_batches():
    metrics = StepMetrics("basic")
    batch = hand_micro_batch()
    metrics.update(**take(batch, slice(0, 2)), documents_seen=100)
    doc1 = take(batch, slice(2, 6))
    doc1["document_index"] = doc1["document_index"] - 1  # ids are local to a micro-batch
    metrics.update(**doc1, documents_seen=100)
    assert metrics.reduce() == pytest.approx(HAND_EXPECTED, abs=1e-9, nan_ok=True)


def test_reduce_resets_the_step():
    metrics = StepMetrics("basic")
    metrics.update(**hand_micro_batch(), documents_seen=100)
    metrics.reduce()
    metrics.update(**take(hand_micro_batch(), slice(0, 2)), documents_seen=95)
    out = metrics.reduce()
    assert out["num_tokens"] == 1.0 and out["new_logprobs"] == -1.0 and out["staleness"] == 5.0
    empty = metrics.reduce()
    assert empty["num_tokens"] == 0.0 and math.isnan(empty["advantage"]) and math.isnan(empty["max_staleness"])


def test_gspo_ratio_metrics_are_sequence_level():
    # doc1's sequence log-ratio = (0.5 + 0 + 0.1)/3 = 0.2 -> R = e^0.2 = 1.2214027582 (> 1.2: clipped);
    # ratio = (1 + 1.2214027582)/2 = 1.1107013791; kl = (0 + e^0.2 - 1.2)/2 = 0.0107013791; clipped 1/2
    metrics = StepMetrics("basic", loss="gspo", epsilon_low=0.2, epsilon_high=0.2)
    metrics.update(**hand_micro_batch(), documents_seen=100)
    out = metrics.reduce()
    assert out["ratio_new_old"] == pytest.approx(1.1107013791, abs=1e-9)
    assert out["kl_new_old"] == pytest.approx(0.0107013791, abs=1e-9)
    assert out["clipped_ratio_fraction"] == 0.5
    assert out["new_logprobs"] == pytest.approx(-2.5)


def test_staleness_is_exact_above_float32_precision():
    # In float32, 2**25 + 3 rounds to 2**25 + 4: subtracting after a cast would report 4, not 3.
    assert float(torch.tensor(2**25 + 3, dtype=torch.float32)) - 2**25 == 4.0
    metrics = StepMetrics("basic")
    batch = hand_micro_batch()
    batch["model_version"] = torch.full((6,), 2**25, dtype=torch.int64)
    metrics.update(**batch, documents_seen=2**25 + 3)
    out = metrics.reduce()
    assert (out["staleness"], out["max_staleness"], out["min_staleness"]) == (3.0, 3.0, 3.0)
    # Far beyond float64's 2**53 the int64 difference is still exact.
    batch["model_version"] = torch.tensor([0, 2**60, 0, 2**60 - 7, 2**60 - 7, 2**60 - 7])
    metrics.update(**batch, documents_seen=torch.tensor(2**60 + 1))
    out = metrics.reduce()
    assert (out["staleness"], out["max_staleness"], out["min_staleness"]) == (4.5, 8.0, 1.0)


def test_bad_model_version_dtype_is_rejected():
    batch = hand_micro_batch()
    batch["model_version"] = batch["model_version"].float()
    with pytest.raises(ValueError, match="model_version must be an integer tensor"):
        StepMetrics("basic").update(**batch, documents_seen=100)


# --- entropy --------------------------------------------------------------------------------------
def test_token_entropy_values_temperature_and_chunking():
    inf = float("inf")
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [5.0, 5.0, -inf, -inf],  # two equal, two impossible: ln 2 (no NaN from 0*log 0)
            [0.0, 2 * math.log(3), -inf, -inf],
        ]
    )  # at T=2: p = (1/4, 3/4)
    h = token_entropy(logits, temperature=2.0)
    expected_last = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # 0.5623351446
    assert h.tolist() == pytest.approx([math.log(4), math.log(2), expected_last], abs=1e-6)
    assert h.dtype == torch.float32

    x = torch.randn(2, 5, 7, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.rand(10) > 0.4
    chunked = token_entropy(x, temperature=0.7, label_mask=mask, chunk_size=3)
    reference = torch.distributions.Categorical(logits=x.detach().reshape(10, 7).float() / 0.7).entropy()
    torch.testing.assert_close(chunked[mask], reference[mask])
    assert (chunked[~mask] == 0).all() and not chunked.requires_grad
    torch.testing.assert_close(token_entropy(x, chunk_size=1), token_entropy(x, chunk_size=1000))
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(x, temperature=0.0)


def test_full_level_entropy_is_document_weighted():
    # Entropy at labelled positions: doc0 ln 4, doc1 ln 2 (x3) -> mean (ln 4 + ln 2)/2 = 1.5 ln 2.
    inf = float("inf")
    logits = torch.full((6, 4), 3.0)
    logits[3:, 2:] = -inf
    logits[0] = torch.tensor([9.0, -inf, -inf, -inf])  # prompt rows do not count
    metrics = StepMetrics("full")
    metrics.update(**hand_micro_batch(), logits=logits, documents_seen=100)
    out = metrics.reduce()
    assert out["entropy"] == pytest.approx(1.5 * math.log(2), abs=1e-6)
    assert {k: v for k, v in out.items() if k != "entropy"} == pytest.approx(HAND_EXPECTED, abs=1e-9, nan_ok=True)
    metrics.update(**hand_micro_batch(), entropy=torch.full((6,), 2.5), documents_seen=100)
    assert metrics.reduce()["entropy"] == 2.5


# --- presence and level none -----------------------------------------------------------------------
def test_missing_input_raises_and_resets():
    metrics = StepMetrics("basic")
    metrics.update(**hand_micro_batch(), documents_seen=100)
    no_reward = hand_micro_batch()
    del no_reward["reward"]
    metrics.update(**no_reward, documents_seen=100)
    with pytest.raises(MetricsInputError, match=r"`reward` missing in 1 micro-batch\(es\) on rank\(s\) \[0\]") as err:
        metrics.reduce()
    assert err.value.missing == {"reward": [0]}
    metrics.update(**hand_micro_batch(), documents_seen=100)
    assert metrics.reduce() == pytest.approx(HAND_EXPECTED, abs=1e-9, nan_ok=True)


def test_full_level_needs_logits_or_entropy():
    metrics = StepMetrics("full")
    metrics.update(**hand_micro_batch(), documents_seen=100)
    with pytest.raises(MetricsInputError, match="logits or entropy"):
        metrics.reduce()


def test_level_none_is_a_no_op():
    metrics = StepMetrics("none")
    batch = hand_micro_batch()
    del batch["reward"], batch["model_version"]
    metrics.update(**batch, documents_seen=0)
    assert metrics.reduce() == {}


# --- one pass with the loss: values against the formulas of DESIGN §4 -------------------------------------
def random_batch(seed: int, num_docs: int, noise: float) -> dict[str, torch.Tensor]:
    """One packed micro-batch in float64: 1-3 masked prompt tokens per document, the last document unlabelled."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 8, (num_docs,), generator=g)
    docs = torch.repeat_interleave(torch.arange(num_docs), lengths)
    mask = torch.cat([torch.arange(n) >= torch.randint(1, 3, (1,), generator=g) for n in lengths.tolist()])
    mask[docs == num_docs - 1] = False
    old = -torch.rand(len(docs), generator=g, dtype=F64) * 4
    return {
        "new_logprobs": old + torch.randn(len(docs), generator=g, dtype=F64) * noise,
        "old_logprobs": old,
        "advantages": torch.randn(num_docs, generator=g, dtype=F64)[docs],
        "label_mask": mask,
        "document_index": docs,
        "reward": torch.rand(num_docs, generator=g, dtype=F64)[docs],
        "model_version": 2**40 - torch.randint(0, 4, (len(docs),), generator=g),  # a quarter at staleness 0
    }


def reference_metrics(batches, loss: str, eps_low: float, eps_high: float, documents_seen: int) -> dict[str, float]:
    """The step's basic metrics from DESIGN §4, one labelled document at a time (no rljob code): r_t =
    exp(lp_new - lp_old) (GRPO) or R_d = exp(mean_d(lp_new - lp_old)) (GSPO); means over each document's labelled
    tokens, then over documents; extremes over labelled tokens (reward: over documents)."""
    per_doc, advantages, staleness, rewards, num_tokens, current_log_ratios = [], [], [], [], 0, []
    for b in batches:
        for d in b["document_index"].unique().tolist():
            sel = (b["document_index"] == d) & b["label_mask"]
            if not sel.any():
                continue
            log_r = b["new_logprobs"][sel] - b["old_logprobs"][sel]
            r = log_r.exp() if loss == "grpo" else log_r.mean().exp().expand(log_r.shape)
            stale = (documents_seen - b["model_version"][sel]).double()
            per_doc.append({
                "new_logprobs": b["new_logprobs"][sel].mean(),
                "old_logprobs": b["old_logprobs"][sel].mean(),
                "ratio_new_old": r.mean(),
                "kl_new_old": (r - r.log() - 1).mean(),
                "clipped_ratio_fraction": ((r < 1 - eps_low) | (r > 1 + eps_high)).double().mean(),
                "advantage": b["advantages"][sel].mean(),
                "train_samples_reward": b["reward"][sel].mean(),
                "staleness": stale.mean(),
            })
            advantages += b["advantages"][sel].tolist()
            staleness += stale.tolist()
            rewards.append(b["reward"][sel].mean().item())
            num_tokens += int(sel.sum())
            token_log_r = b["new_logprobs"][sel] - b["old_logprobs"][sel]
            current_log_ratios += token_log_r[stale == 0].tolist()
    out = {name: sum(float(doc[name]) for doc in per_doc) / len(per_doc) for name in per_doc[0]}
    out.update(num_tokens=float(num_tokens), max_advantage=max(advantages), min_advantage=min(advantages))
    out.update(max_staleness=max(staleness), min_staleness=min(staleness))
    out.update(max_train_samples_reward=max(rewards), min_train_samples_reward=min(rewards))
    current = torch.tensor(current_log_ratios, dtype=F64)
    out.update(sampler_mismatch_tokens=float(len(current)), sampler_mismatch_ratio=float(current.exp().mean()),
               sampler_mismatch_kl=float((current.exp() - current - 1).mean()))
    return out


@pytest.mark.parametrize("loss, eps, noise", [("grpo", (0.2, 0.2), 0.5), ("gspo", (0.05, 0.08), 0.1)])
def test_one_pass_metrics_equal_the_formulas_and_segment_once(monkeypatch, loss, eps, noise):
    from rljob_trainer import loss as losses

    original, calls = losses.segment_documents, []
    monkeypatch.setattr(losses, "segment_documents", lambda *a: calls.append(1) or original(*a))
    batches = [random_batch(seed, num_docs=4 + seed, noise=noise) for seed in range(3)]
    metrics = StepMetrics("basic", loss=loss, epsilon_low=eps[0], epsilon_high=eps[1])
    loss_fn = losses.grpo_loss if loss == "grpo" else losses.gspo_loss
    loss_sum = 0.0
    for i, b in enumerate(batches):
        segments = losses.segment_documents(b["label_mask"], b["document_index"])
        output = loss_fn(
            b["new_logprobs"], b["old_logprobs"], b["advantages"], b["label_mask"], b["document_index"],
            epsilon_low=eps[0], epsilon_high=eps[1], segments=segments,
        )
        metrics.update(
            new_logprobs=b["new_logprobs"], old_logprobs=b["old_logprobs"], advantages=b["advantages"],
            documents_seen=2**40, loss_output=output, reward=b["reward"], model_version=b["model_version"],
        )
        assert len(calls) == i + 1  # neither the loss nor the metrics segmented the micro-batch again
        loss_sum += output.loss.item()
    expected = reference_metrics(batches, loss, *eps, documents_seen=2**40)
    assert 0 < expected["clipped_ratio_fraction"] < 1  # both clipped and unclipped ratios are exercised
    assert 0 < expected["sampler_mismatch_tokens"] < expected["num_tokens"]  # current and older tokens
    counters = {"redeliveries": 3, "dropped_too_long": 1, "dead_lettered": 0, "lost_pending": 2, "dropped_stale": 5,
                **{name: 0 for name in STREAM_COUNTERS if name.startswith(DEAD_LETTERED_PREFIX)}}
    out = metrics.reduce(totals={"loss": torch.tensor(loss_sum, dtype=F64), **counters})
    assert list(out) == BASIC_NAMES + ["loss", *counters]
    assert {k: out[k] for k in BASIC_NAMES} == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert out["loss"] == pytest.approx(loss_sum, rel=1e-15) and {k: out[k] for k in counters} == counters


def test_step_totals_are_reduced_at_every_level_and_must_be_complete():
    totals = {"loss": 0.5, "redeliveries": 1, "dropped_too_long": 2, "dead_lettered": 3, "lost_pending": 4,
              "dropped_stale": 5, **{name: 0 for name in STREAM_COUNTERS if name.startswith(DEAD_LETTERED_PREFIX)},
              "dead_lettered.bad_json": 2, "dead_lettered.bad_value": 1}
    assert StepMetrics("none").reduce(totals=totals) == totals
    with pytest.raises(ValueError, match=r"totals must name exactly the step totals .* got \['loss'\]"):
        StepMetrics("none").reduce(totals={"loss": 0.5})
