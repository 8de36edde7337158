"""The loss corrections of issue 13 (DESIGN §4), each off by default: dual clip, decoupled objective with truncated
importance sampling, KL penalty to a reference policy (k1, k3), and their one-pass metrics with the sampler/trainer
mismatch. Each against a hand-computed value and against an autograd reference written one token (one document) at a
time."""

from __future__ import annotations

import math

import pytest
import torch
from rljob_trainer.loss import NO_CORRECTIONS, Corrections, grpo_loss, gspo_loss
from rljob_trainer.loss_metrics import StepMetrics
from test_loss import random_micro_batch as loss_micro_batch

torch.set_num_threads(1)
F64 = torch.float64


def tokens(old: list[float], ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(new_logprobs leaf, old_logprobs) with exp(new - old) = ratios."""
    old_t = torch.tensor(old, dtype=F64)
    return (old_t + torch.tensor(ratios, dtype=F64).log()).requires_grad_(), old_t


# Four labelled tokens, clip range [0.8, 1.2]:   r     A
#   t0                                           4    -1
#   t1                                           2    -1
#   t2                                           4    +1
#   t3                                           0.5  -1
RATIOS, ADVANTAGES = [4.0, 2.0, 4.0, 0.5], [-1.0, -1.0, 1.0, -1.0]


def four_tokens():
    new, old = tokens([-1.0, -2.0, -0.5, -3.0], RATIOS)
    return new, old, torch.tensor(ADVANTAGES, dtype=F64), torch.ones(4, dtype=torch.bool), torch.arange(4)


# --- dual clip (Ye et al. 2020) ---------------------------------------------------------------------------------------
def test_dual_clip_by_hand():
    # loss_t = -max(min(rA, clip(r)A), 3A) where A < 0:
    #   t0: min(-4, -1.2) = -4 < -3 -> -3: loss 3, gradient 0 (bound binds; without it: loss 4, gradient -rA/4 = 1)
    #   t1: min(-2, -1.2) = -2 > -3 -> loss 2, gradient -rA/4 = 0.5
    #   t2: A > 0: min(4, 1.2) = 1.2 -> loss -1.2, gradient 0 (upper clip)
    #   t3: min(-0.5, -0.8) = -0.8 -> loss 0.8, gradient 0 (lower clip binds for A < 0)
    # sum 4.6 / 4 = 1.15 (without the dual clip 5.6 / 4 = 1.4)
    new, old, adv, mask, docs = four_tokens()
    out = grpo_loss(new, old, adv, mask, docs, corrections=Corrections(dual_clip=3.0))
    assert out.loss.item() == pytest.approx(1.15, abs=1e-12)
    out.loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0], abs=1e-12)
    assert out.dual_clipped.tolist() == [True, False, False, False]
    plain = grpo_loss(new, old, adv, mask, docs)
    assert plain.loss.item() == pytest.approx(1.4, abs=1e-12) and plain.dual_clipped is None


@pytest.mark.parametrize("form, expected", [("fast-llm", 6.0), ("paper", 3.0)])
def test_dual_clip_of_a_sequence_by_hand(form, expected):
    # One document, two labelled tokens of ratio 4: R = 4, A = -1, min(-4, -1.2) = -4 < 3 x -1 -> l = 3;
    # fast-llm: 2 tokens x 3 / 1 document = 6; paper: 3 / 1.
    new, old = tokens([-1.0, -2.0], [4.0, 4.0])
    adv, mask, docs = torch.full((2,), -1.0, dtype=F64), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    out = gspo_loss(new, old, adv, mask, docs, epsilon_low=0.2, epsilon_high=0.2, form=form,
                    corrections=Corrections(dual_clip=3.0))
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.dual_clipped.tolist() == [True, True]
    (grad,) = torch.autograd.grad(out.loss, new)
    assert grad.tolist() == [0.0, 0.0]


# --- decoupled objective with truncated importance sampling (Fu et al. 2025; Yao et al. 2025) ----------------------
def test_truncated_importance_sampling_by_hand():
    # cap 2: w = min(r, 2) = [2, 2, 2, 0.5], truncated where r > 2: t0, t2. The proximal ratio pi/pi_prox is 1, so the
    # clip never binds and loss_t = -w_t A_t: [2, 2, -2, 0.5], sum 2.5 / 4 = 0.625; gradient -w_t A_t / 4 =
    # [0.5, 0.5, -0.5, 0.125]: t2 and t3, clipped without the correction (gradient 0), now move.
    new, old, adv, mask, docs = four_tokens()
    out = grpo_loss(new, old, adv, mask, docs, corrections=Corrections(is_cap=2.0))
    assert out.loss.item() == pytest.approx(0.625, abs=1e-12)
    out.loss.backward()
    assert new.grad.tolist() == pytest.approx([0.5, 0.5, -0.5, 0.125], abs=1e-12)
    assert out.weight.tolist() == pytest.approx([2.0, 2.0, 2.0, 0.5], abs=1e-12)
    assert out.truncated.tolist() == [True, False, True, False]
    assert out.clipped.tolist() == [False] * 4  # the clip never binds
    assert out.ratio.tolist() == pytest.approx(RATIOS, abs=1e-12)  # the weight before truncation


def test_with_importance_sampling_the_dual_clip_never_binds():
    new, old, adv, mask, docs = four_tokens()
    both = grpo_loss(new, old, adv, mask, docs, corrections=Corrections(dual_clip=3.0, is_cap=2.0))
    alone = grpo_loss(new, old, adv, mask, docs, corrections=Corrections(is_cap=2.0))
    assert both.loss.item() == alone.loss.item() and both.dual_clipped.tolist() == [False] * 4


@pytest.mark.parametrize("cap", [1.0, 1.5, 100.0])
def test_the_decoupled_objective_is_the_truncated_is_policy_gradient(cap):
    """With pi_prox = the detached pi, d loss / d lp_t = -min(r_t, cap) A_t / N for GRPO and -min(R_d, cap) A_d / N_docs
    for every labelled token of d for GSPO (fast-llm form), whatever the clip range."""
    new, old, adv, mask, docs, _ = random_micro_batch(3, noise=0.8)
    for eps in ((0.2, 0.2), (3e-4, 4e-4)):
        out = grpo_loss(new, old, adv, mask, docs, epsilon_low=eps[0], epsilon_high=eps[1],
                        corrections=Corrections(is_cap=cap))
        (grad,) = torch.autograd.grad(out.loss, new)
        r = (new - old).detach().exp()
        torch.testing.assert_close(grad, torch.where(mask, -r.clamp(max=cap) * adv / mask.sum(), 0.0))
        out = gspo_loss(new, old, adv, mask, docs, epsilon_low=eps[0], epsilon_high=eps[1],
                        corrections=Corrections(is_cap=cap))
        (grad,) = torch.autograd.grad(out.loss, new)
        labelled = [d for d in docs.unique().tolist() if mask[docs == d].any()]
        expected = torch.zeros_like(grad)
        for d in labelled:
            sel = (docs == d) & mask
            big_r = (new - old).detach()[sel].mean().exp()
            expected[sel] = -big_r.clamp(max=cap) * adv[sel][0] / len(labelled)
        torch.testing.assert_close(grad, expected)


# --- KL to the reference policy (Schulman 2020) ---------------------------------------------------------------------
# Three tokens, the last masked; d = lp_ref - lp_new = [-0.5, 1.0, (masked)]; advantages 0 (only the KL term moves).
#   k1 = -d = [0.5, -1.0]                         -> 0.1 x -0.5 / 2 = -0.025; d k1 / d lp_new = +1
#   k3 = e^d - 1 - d = [e^-0.5 - 0.5, e - 2]      -> 0.1 x (e^-0.5 + e - 2.5) / 2; d k3 / d lp_new = 1 - e^d
KL_NEW, KL_D = [-1.0, -2.0, -0.5], [-0.5, 1.0, 7.0]


@pytest.mark.parametrize("estimator, expected, gradient", [
    ("k1", -0.025, [0.05, 0.05, 0.0]),
    ("k3", 0.1 * (math.exp(-0.5) + math.e - 2.5) / 2, [0.05 * (1 - math.exp(-0.5)), 0.05 * (1 - math.e), 0.0]),
])
def test_kl_penalty_by_hand(estimator, expected, gradient):
    new = torch.tensor(KL_NEW, dtype=F64, requires_grad=True)
    ref = torch.tensor(KL_NEW, dtype=F64) + torch.tensor(KL_D, dtype=F64)
    zeros, mask, docs = torch.zeros(3, dtype=F64), torch.tensor([True, True, False]), torch.tensor([0, 0, 0])
    corrections = Corrections(kl_coef=0.1, kl_estimator=estimator)
    out = grpo_loss(new, new.detach(), zeros, mask, docs, corrections=corrections, ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    out.loss.backward()
    assert new.grad.tolist() == pytest.approx(gradient, abs=1e-12)
    k = [0.5, -1.0] if estimator == "k1" else [math.exp(-0.5) - 0.5, math.e - 2.0]
    assert out.kl_ref.tolist() == pytest.approx(k + [0.0], abs=1e-12)
    # GSPO: one document of 2 labelled tokens; fast-llm sums the tokens' terms, the paper form takes their mean.
    fast = gspo_loss(new, new.detach(), zeros, mask, docs, corrections=corrections, ref_logprobs=ref).loss
    paper = gspo_loss(new, new.detach(), zeros, mask, docs, form="paper", corrections=corrections, ref_logprobs=ref)
    assert fast.item() == pytest.approx(2 * expected, abs=1e-12)
    assert paper.loss.item() == pytest.approx(expected, abs=1e-12)


def test_kl_needs_the_reference_log_probabilities_and_corrections_check_their_range():
    new, old, adv, mask, docs = four_tokens()
    with pytest.raises(ValueError, match="kl_coef = 0.1 needs ref_logprobs"):
        grpo_loss(new, old, adv, mask, docs, corrections=Corrections(kl_coef=0.1))
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(3,\), new_logprobs \(4,\)"):
        gspo_loss(new, old, adv, mask, docs, corrections=Corrections(kl_coef=0.1), ref_logprobs=old[:3])
    # kl_coef 0: the reference is not read
    assert grpo_loss(new, old, adv, mask, docs, ref_logprobs=old * 7).loss.item() == pytest.approx(1.4)
    for kwargs, message in [({"dual_clip": 1.0}, "dual_clip must be > 1, got 1.0"),
                            ({"is_cap": 0.5}, "is_cap must be >= 1, got 0.5"),
                            ({"kl_coef": -1.0}, "kl_coef must be >= 0, got -1.0"),
                            ({"kl_estimator": "k2"}, "kl_estimator must be 'k1' or 'k3', got 'k2'")]:
        with pytest.raises(ValueError, match=message):
            Corrections(**kwargs)


# --- against an autograd reference, one token (one document) at a time ----------------------------------------------
def random_micro_batch(seed: int, num_docs: int = 8, noise: float = 0.8):
    """test_loss's random micro-batch (one document unlabelled) and reference log-probabilities near the old ones."""
    new, old, adv, mask, docs = loss_micro_batch(seed, num_docs=num_docs, noise=noise)
    ref = old + torch.randn(docs.shape[0], generator=torch.Generator().manual_seed(seed + 1000), dtype=F64) * 0.5
    return new, old, adv, mask, docs, ref


def reference_term(log_ratio, advantage, eps_low, eps_high, c: Corrections):
    """One token's (one document's) corrected objective, from the formulas of DESIGN §4."""
    if c.is_cap is not None:
        weight = torch.clamp(log_ratio.detach().exp(), max=c.is_cap)
        rho = torch.exp(log_ratio - log_ratio.detach())
    else:
        weight, rho = 1.0, torch.exp(log_ratio)
    surrogate = torch.min(rho * advantage, torch.clamp(rho, 1 - eps_low, 1 + eps_high) * advantage)
    if c.dual_clip is not None and advantage < 0:
        surrogate = torch.max(surrogate, c.dual_clip * advantage)
    return -weight * surrogate


def reference_kl(new_t, ref_t, c: Corrections):
    d = ref_t - new_t
    return -d if c.kl_estimator == "k1" else torch.exp(d) - 1 - d


def reference_grpo(new, old, adv, mask, ref, eps, c: Corrections):
    total = new.new_zeros(())
    for t in range(new.shape[0]):
        if mask[t]:
            total = total + reference_term(new[t] - old[t], adv[t], *eps, c)
            if c.kl_coef:
                total = total + c.kl_coef * reference_kl(new[t], ref[t], c)
    return total / int(mask.sum())


def reference_gspo(new, old, adv, mask, docs, ref, eps, c: Corrections, form):
    total, count = new.new_zeros(()), 0
    for d in sorted(set(docs.tolist())):
        labelled = [t for t in range(new.shape[0]) if docs[t] == d and mask[t]]
        if not labelled:
            continue
        count += 1
        n = len(labelled)
        term = reference_term(sum(new[t] - old[t] for t in labelled) / n, sum(adv[t] for t in labelled) / n, *eps, c)
        total = total + term * (n if form == "fast-llm" else 1)
        if c.kl_coef:
            kl = sum(reference_kl(new[t], ref[t], c) for t in labelled)
            total = total + c.kl_coef * (kl if form == "fast-llm" else kl / n)
    return total / count


CORRECTIONS = [
    Corrections(dual_clip=1.5),
    Corrections(is_cap=1.5),
    Corrections(dual_clip=2.0, is_cap=3.0),
    Corrections(kl_coef=0.3, kl_estimator="k1"),
    Corrections(kl_coef=0.3, kl_estimator="k3"),
    Corrections(dual_clip=1.5, kl_coef=0.05),
    Corrections(dual_clip=3.0, is_cap=2.0, kl_coef=0.2, kl_estimator="k1"),
]


@pytest.mark.parametrize("corrections", CORRECTIONS, ids=str)
@pytest.mark.parametrize("seed", [0, 1])  # both exercise every correction (asserted below)
def test_grpo_with_corrections_matches_the_reference_loss_and_gradient(corrections, seed):
    new, old, adv, mask, docs, ref = random_micro_batch(seed)
    out = grpo_loss(new, old, adv, mask, docs, corrections=corrections, ref_logprobs=ref)
    (grad,) = torch.autograd.grad(out.loss, new)
    ref_new = new.detach().clone().requires_grad_()
    expected = reference_grpo(ref_new, old, adv, mask, ref, (0.2, 0.2), corrections)
    (expected_grad,) = torch.autograd.grad(expected, ref_new)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    r = (new - old).detach().exp()[mask]
    if corrections.dual_clip is not None and corrections.is_cap is None:
        assert out.dual_clipped.any()  # the bound binds somewhere: the batch exercises it
        assert (out.dual_clipped == (mask & (adv < 0) & ((new - old).detach().exp() > corrections.dual_clip))).all()
    if corrections.is_cap is not None:  # some weights are truncated, others not
        assert (r > corrections.is_cap).any() and (r < corrections.is_cap).any()


@pytest.mark.parametrize("corrections", CORRECTIONS, ids=str)
@pytest.mark.parametrize("form", ["fast-llm", "paper"])
def test_gspo_with_corrections_matches_the_reference_loss_and_gradient(corrections, form):
    new, old, adv, mask, docs, ref = random_micro_batch(2, noise=0.6)
    eps = (0.05, 0.08)
    out = gspo_loss(new, old, adv, mask, docs, epsilon_low=eps[0], epsilon_high=eps[1], form=form,
                    corrections=corrections, ref_logprobs=ref)
    (grad,) = torch.autograd.grad(out.loss, new)
    ref_new = new.detach().clone().requires_grad_()
    expected = reference_gspo(ref_new, old, adv, mask, docs, ref, eps, corrections, form)
    (expected_grad,) = torch.autograd.grad(expected, ref_new)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_no_corrections_is_the_plain_surrogate():
    new, old, adv, mask, docs, ref = random_micro_batch(1)
    plain = grpo_loss(new, old, adv, mask, docs)
    off = grpo_loss(new, old, adv, mask, docs, corrections=NO_CORRECTIONS, ref_logprobs=ref)
    assert plain.loss.item() == off.loss.item()
    assert (off.dual_clipped, off.weight, off.truncated, off.kl_ref) == (None, None, None, None)
    assert NO_CORRECTIONS.terms == frozenset()


# --- the corrections' metrics and the sampler/trainer mismatch, by hand ----------------------------------------------
# Two documents, each a masked prompt token then two labelled tokens (clip range [0.8, 1.2]):
#   doc 0: r = [4, 2], A = -1, model_version [96, 96]; doc 1: r = [4, 0.5], A = +1, model_version [96, 90]
#   lp_ref - lp_new = doc 0 [-0.5, 1.0], doc 1 [0.0, 0.2]
def metric_batch() -> dict[str, torch.Tensor]:
    old = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5, -3.0], dtype=F64)
    ratios = torch.tensor([1.0, 4.0, 2.0, 1.0, 4.0, 0.5], dtype=F64)
    new = old + ratios.log()
    return {
        "new_logprobs": new,
        "old_logprobs": old,
        "advantages": torch.tensor([9.0, -1.0, -1.0, 9.0, 1.0, 1.0], dtype=F64),
        "label_mask": torch.tensor([False, True, True, False, True, True]),
        "document_index": torch.tensor([0, 0, 0, 1, 1, 1]),
        "reward": torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=F64),
        "model_version": torch.tensor([0, 96, 96, 0, 96, 90]),
        "ref_logprobs": new + torch.tensor([5.0, -0.5, 1.0, 5.0, 0.0, 0.2], dtype=F64),
    }


def one_step(corrections: Corrections, documents_seen: int = 96) -> dict[str, float]:
    metrics = StepMetrics("basic", corrections=corrections)
    metrics.update(**metric_batch(), documents_seen=documents_seen)
    return metrics.reduce()


def test_dual_clip_fraction_by_hand():
    # c = 3: doc 0's first token (r = 4 > 3, A < 0) -> (1/2 + 0) / 2 documents
    assert one_step(Corrections(dual_clip=3.0))["dual_clip_fraction"] == 0.25
    assert one_step(Corrections(dual_clip=5.0))["dual_clip_fraction"] == 0.0


def test_behaviour_weight_metrics_by_hand():
    # cap 2: weights doc 0 [2, 2], doc 1 [2, 0.5] -> mean (2 + 1.25) / 2 = 1.625; largest before truncation 4;
    # truncated: one token of each document -> (1/2 + 1/2) / 2 = 0.5
    out = one_step(Corrections(is_cap=2.0))
    assert (out["behaviour_weight"], out["max_behaviour_weight"], out["behaviour_weight_truncated_fraction"]) == (
        pytest.approx(1.625, abs=1e-12), pytest.approx(4.0, abs=1e-12), 0.5)
    assert out["clipped_ratio_fraction"] == 0.0  # the proximal ratio is 1
    assert out["ratio_new_old"] == pytest.approx(((4 + 2) / 2 + (4 + 0.5) / 2) / 2, abs=1e-12)


@pytest.mark.parametrize("estimator, expected", [
    ("k1", ((0.5 - 1.0) / 2 + (0.0 - 0.2) / 2) / 2),
    ("k3", ((math.exp(-0.5) - 0.5 + math.e - 2.0) / 2 + (math.exp(0.2) - 1.2) / 2) / 2),
])
def test_kl_ref_by_hand(estimator, expected):
    assert one_step(Corrections(kl_coef=0.1, kl_estimator=estimator))["kl_ref"] == pytest.approx(expected, abs=1e-12)


def test_sampler_mismatch_by_hand():
    # documents_seen 96: the tokens of version 96 (r = 4, 2, 4) are on the trainer's current weights, the one of
    # version 90 is not: tokens 3, ratio mean (4 + 2 + 4) / 3, k3 mean of r - 1 - log r.
    out = one_step(NO_CORRECTIONS)
    assert out["sampler_mismatch_tokens"] == 3.0
    assert out["sampler_mismatch_ratio"] == pytest.approx(10 / 3, abs=1e-12)
    k3 = [r - 1 - math.log(r) for r in (4.0, 2.0, 4.0)]
    assert out["sampler_mismatch_kl"] == pytest.approx(sum(k3) / 3, abs=1e-12)
    later = one_step(NO_CORRECTIONS, documents_seen=100)  # nothing current: no token, NaN means
    assert later["sampler_mismatch_tokens"] == 0.0 and math.isnan(later["sampler_mismatch_ratio"])


def test_a_correction_metric_without_its_loss_output_is_a_programming_error():
    metrics = StepMetrics("basic", corrections=Corrections(dual_clip=3.0))
    batch = metric_batch()
    del batch["ref_logprobs"]
    output = grpo_loss(batch["new_logprobs"], batch["old_logprobs"], batch["advantages"], batch["label_mask"],
                       batch["document_index"])
    with pytest.raises(ValueError, match="the loss output has no 'dual_clipped'"):
        metrics.update(**batch, documents_seen=96, loss_output=output)
