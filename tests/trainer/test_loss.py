"""GRPO and GSPO losses: hand-computed values, gradients against a per-document loop, normaliser semantics."""

from __future__ import annotations

import math

import pytest
import torch
from rljob_trainer.loss import (
    count_labels_and_documents,
    document_means,
    grpo_loss,
    gspo_loss,
    scale_for_gradient_mean,
    segment_documents,
)

torch.set_num_threads(1)
F64 = torch.float64


def tokens(old: list[float], ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(new_logprobs leaf, old_logprobs) with exp(new - old) = ratios."""
    old_t = torch.tensor(old, dtype=F64)
    return (old_t + torch.tensor(ratios, dtype=F64).log()).requires_grad_(), old_t


# --- GRPO, by hand -------------------------------------------------------------------------------
# clip range [0.8, 1.2]; loss_t = -min(r*A, clip(r)*A)
#   a: r=1.5, A=+1 -> min(1.5, 1.2) = 1.2   -> -1.2  (upper clip binds, gradient 0)
#   b: r=0.5, A=+1 -> min(0.5, 0.8) = 0.5   -> -0.5  (lower clip ignored for A>0, d/dlp = -r*A = -0.5)
#   c: r=0.5, A=-2 -> min(-1.0, -1.6) = -1.6 -> +1.6 (lower clip binds, gradient 0)
#   d: r=1.5, A=-2 -> min(-3.0, -2.4) = -3.0 -> +3.0 (upper clip ignored for A<0, d/dlp = -r*A = +3.0)
#   e: r=1.1, A=+1 -> 1.1 (inside)          -> -1.1  (d/dlp = -1.1)
#   f: masked (r=3, A=5)                    -> ignored
# sum = -1.2 - 0.5 + 1.6 + 3.0 - 1.1 = 1.8; 5 labelled tokens -> 0.36
GRPO_RATIOS = [1.5, 0.5, 0.5, 1.5, 1.1, 3.0]
GRPO_ADVANTAGES = [1.0, 1.0, -2.0, -2.0, 1.0, 5.0]
GRPO_MASK = [True, True, True, True, True, False]
GRPO_DOCS = [0, 0, 1, 1, 2, 2]


def grpo_inputs():
    new, old = tokens([-1.0, -2.0, -0.5, -3.0, -1.0, -2.0], GRPO_RATIOS)
    return new, old, torch.tensor(GRPO_ADVANTAGES, dtype=F64), torch.tensor(GRPO_MASK), torch.tensor(GRPO_DOCS)


def test_grpo_by_hand_both_clip_sides_and_signs():
    new, old, adv, mask, docs = grpo_inputs()
    loss = grpo_loss(new, old, adv, mask, docs).loss
    assert loss.item() == pytest.approx(0.36, abs=1e-12)
    loss.backward()
    # d loss / d lp_new_t = -r_t*A_t / 5 where the unclipped term is the minimum, else 0.
    assert new.grad.tolist() == pytest.approx([0.0, -0.1, 0.0, 0.6, -0.22, 0.0], abs=1e-12)


def test_grpo_explicit_normaliser_and_epsilons():
    new, old, adv, mask, docs = grpo_inputs()
    assert grpo_loss(new, old, adv, mask, docs, num_labels_in_batch=10).loss.item() == pytest.approx(0.18, abs=1e-12)
    tensor_normaliser = grpo_loss(new, old, adv, mask, docs, num_labels_in_batch=torch.tensor(10.0)).loss
    assert tensor_normaliser.item() == pytest.approx(0.18)
    # clip range [0.6, 1.6]: a: min(1.5, 1.5) -> -1.5; b: min(0.5, 0.6) -> -0.5; c: min(-1.0, -1.2) -> +1.2;
    # d: min(-3.0, -3.0) -> +3.0; e -> -1.1.  sum = 1.1 -> /5 = 0.22
    loss = grpo_loss(new, old, adv, mask, docs, epsilon_low=0.4, epsilon_high=0.6).loss
    assert loss.item() == pytest.approx(0.22, abs=1e-12)


# --- GSPO, by hand -------------------------------------------------------------------------------
# clip range [0.8, 1.2] (explicit, to hand-compute); R_d = geometric mean of labelled token ratios.
#   doc 0: prompt token masked, labelled ratios (4, 1) -> R = 2,   A = +1 -> min(2, 1.2) = 1.2  -> l = -1.2
#   doc 1: labelled ratios (0.5, 0.5, 0.5) -> R = 0.5, A = -2 -> min(-1.0, -1.6) = -1.6 -> l = +1.6
#   doc 2: labelled ratios (1.1, 1.1) -> R = 1.1, A = +0.5 -> 0.55 (inside) -> l = -0.55
#   doc 3: only masked tokens -> not a document of the normaliser
# fast-llm: (2*-1.2 + 3*1.6 + 2*-0.55) / 3 = (-2.4 + 4.8 - 1.1) / 3 = 1.3 / 3
# paper:    (-1.2 + 1.6 - 0.55) / 3 = -0.15 / 3 = -0.05
# gradient: docs 0 and 1 clipped -> 0; doc 2: d/dlp_t = -R*A/3 * (n_d weight)/n_d
#   fast-llm: -1.1*0.5/3 = -0.18333..  paper: -1.1*0.5/3/2 = -0.091666..
def gspo_inputs():
    new, old = tokens(
        [-0.1, -2.0, -1.0, -1.5, -0.7, -2.2, -0.3, -0.4, -1.0, -2.0],
        [9.0, 4.0, 1.0, 0.5, 0.5, 0.5, 1.1, 1.1, 7.0, 0.1],
    )
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0, -2.0, 0.5, 0.5, 3.0, 3.0], dtype=F64)
    mask = torch.tensor([False, True, True, True, True, True, True, True, False, False])
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    return new, old, adv, mask, docs


@pytest.mark.parametrize(
    "form, expected, doc2_grad",
    [("fast-llm", 1.3 / 3, -1.1 * 0.5 / 3), ("paper", -0.05, -1.1 * 0.5 / 3 / 2)],
)
def test_gspo_by_hand(form, expected, doc2_grad):
    new, old, adv, mask, docs = gspo_inputs()
    loss = gspo_loss(new, old, adv, mask, docs, epsilon_low=0.2, epsilon_high=0.2, form=form).loss
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0] * 6 + [doc2_grad] * 2 + [0.0, 0.0], abs=1e-12)


def test_gspo_default_clip_range_is_the_papers():
    # One document of 2 labelled tokens with log-ratio 1e-3 each: R = exp(1e-3) = 1.0010005 > 1 + 4e-4,
    # A = +1 -> min(R, 1.0004) = 1.0004 -> fast-llm loss = -2 * 1.0004 / 1 = -2.0008.
    # A = -1: min(-R, -1.0004) = -R -> loss = 2 * exp(1e-3) = 2.002001 (the upper clip never binds for A<0).
    lp = torch.tensor([-1.0, -1.0], dtype=F64)
    mask, docs = torch.tensor([True, True]), torch.tensor([0, 0])
    up = gspo_loss(lp + 1e-3, lp, torch.tensor([1.0, 1.0], dtype=F64), mask, docs).loss
    assert up.item() == pytest.approx(-2.0008, abs=1e-12)
    down = gspo_loss(lp + 1e-3, lp, torch.tensor([-1.0, -1.0], dtype=F64), mask, docs).loss
    assert down.item() == pytest.approx(2 * math.exp(1e-3), abs=1e-12)
    # Lower side: log-ratio -1e-3 -> R = 0.9990005 < 1 - 3e-4 = 0.9997, A = -1 -> -min(-R, -0.9997) = 0.9997*2.
    low = gspo_loss(lp - 1e-3, lp, torch.tensor([-1.0, -1.0], dtype=F64), mask, docs).loss
    assert low.item() == pytest.approx(2 * 0.9997, abs=1e-12)


# --- against an independent per-document reference -------------------------------------------------
def reference_grpo(new, old, adv, mask, eps_low, eps_high, normaliser):
    total = new.new_zeros(())
    for t in range(new.shape[0]):
        if mask[t]:
            r = torch.exp(new[t] - old[t])
            total = total - torch.min(r * adv[t], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[t])
    return total / normaliser


def reference_gspo(new, old, adv, mask, docs, eps_low, eps_high, form, normaliser):
    total = new.new_zeros(())
    for d in sorted(set(docs.tolist())):
        labelled = [t for t in range(new.shape[0]) if docs[t] == d and mask[t]]
        if not labelled:
            continue
        ratio = torch.exp(sum(new[t] - old[t] for t in labelled) / len(labelled))
        advantage = sum(adv[t] for t in labelled) / len(labelled)
        term = -torch.min(ratio * advantage, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage)
        total = total + term * (len(labelled) if form == "fast-llm" else 1)
    return total / normaliser


def random_micro_batch(seed: int, num_docs: int = 7, noise: float = 0.3, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (num_docs,), generator=g)
    docs = torch.repeat_interleave(torch.arange(num_docs), lengths)
    prompt = torch.cat([torch.arange(n) < torch.randint(1, n, (1,), generator=g) for n in lengths.tolist()])
    mask = ~prompt
    mask[docs == num_docs - 1] = False  # one document without labels
    old = -torch.rand(docs.shape[0], generator=g, dtype=dtype) * 4
    new = (old + torch.randn(docs.shape[0], generator=g, dtype=dtype) * noise).requires_grad_()
    adv = torch.randn(num_docs, generator=g, dtype=dtype)[docs]
    return new, old, adv, mask, docs


@pytest.mark.parametrize("seed", [1, 2, 4])
def test_grpo_matches_reference_loss_and_gradient(seed):
    new, old, adv, mask, docs = random_micro_batch(seed, noise=0.5)
    ratio = (new - old).exp()[mask]
    assert (ratio > 1.2).any() and (ratio < 0.8).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    loss = grpo_loss(new, old, adv, mask, docs).loss
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_()
    ref = reference_grpo(ref_new, old, adv, mask, 0.2, 0.2, int(mask.sum()))
    (ref_grad,) = torch.autograd.grad(ref, ref_new)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()


@pytest.mark.parametrize("form", ["fast-llm", "paper"])
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.08)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_reference_loss_and_gradient(form, eps, seed):
    new, old, adv, mask, docs = random_micro_batch(seed, noise=0.05)
    loss = gspo_loss(new, old, adv, mask, docs, epsilon_low=eps[0], epsilon_high=eps[1], form=form).loss
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_()
    num_docs = len(set(docs[mask].tolist()))
    ref = reference_gspo(ref_new, old, adv, mask, docs, eps[0], eps[1], form, num_docs)
    (ref_grad,) = torch.autograd.grad(ref, ref_new)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert (grad[mask] != 0).any()


def test_gspo_fast_llm_form_weights_documents_by_length():
    # Two documents with the same ratio and advantage but lengths 1 and 3: the fast-llm form is the paper
    # form times the mean labelled length (2) when every document has the same per-sequence term.
    new, old = tokens([-1.0] * 4, [1.1] * 4)
    adv, mask, docs = torch.full((4,), 0.5, dtype=F64), torch.ones(4, dtype=torch.bool), torch.tensor([0, 1, 1, 1])
    fast = gspo_loss(new, old, adv, mask, docs, epsilon_low=0.2, epsilon_high=0.2).loss
    paper = gspo_loss(new, old, adv, mask, docs, epsilon_low=0.2, epsilon_high=0.2, form="paper").loss
    assert paper.item() == pytest.approx(-0.55, abs=1e-12)
    assert fast.item() == pytest.approx(-0.55 * 4 / 2, abs=1e-12)


# --- normaliser semantics -----------------------------------------------------------------------------
def split(tensors, boundary):
    return [t[:boundary] for t in tensors], [t[boundary:] for t in tensors]


@pytest.mark.parametrize("loss_name", ["grpo", "gspo"])
def test_micro_batches_with_step_normaliser_equal_one_batch(loss_name):
    new, old, adv, mask, docs = random_micro_batch(3)
    boundary = int((docs < 3).sum())  # documents never span micro-batches
    parts = split((new, old, adv, mask, docs), boundary)
    counts = [count_labels_and_documents(p[3], p[4]) for p in parts]
    labels = sum(c[0] for c in counts)
    documents = sum(c[1] for c in counts)
    if loss_name == "grpo":
        whole = grpo_loss(new, old, adv, mask, docs).loss
        pieces = sum(grpo_loss(*p, num_labels_in_batch=labels).loss for p in parts)
        assert labels.item() == int(mask.sum())
    else:
        whole = gspo_loss(new, old, adv, mask, docs, epsilon_low=0.05, epsilon_high=0.05).loss
        pieces = sum(
            gspo_loss(*p, epsilon_low=0.05, epsilon_high=0.05, num_documents_in_batch=documents).loss for p in parts
        )
        assert documents.item() == 6  # 7 documents, the last has no labelled token
    torch.testing.assert_close(pieces, whole)
    torch.testing.assert_close(torch.autograd.grad(pieces, new)[0], torch.autograd.grad(whole, new)[0])


def test_default_normaliser_is_the_micro_batch_count():
    new, old, adv, mask, docs = random_micro_batch(4)
    torch.testing.assert_close(
        grpo_loss(new, old, adv, mask, docs).loss,
        grpo_loss(new, old, adv, mask, docs, num_labels_in_batch=int(mask.sum())).loss,
    )
    torch.testing.assert_close(
        gspo_loss(new, old, adv, mask, docs).loss, gspo_loss(new, old, adv, mask, docs, num_documents_in_batch=6).loss
    )


@pytest.mark.parametrize("loss_fn", [grpo_loss, gspo_loss])
def test_all_masked_micro_batch_gives_zero_loss_and_finite_zero_gradient(loss_fn):
    new, old, adv, _, docs = random_micro_batch(5)
    old = old.clone()
    old[0] = -1e4  # a huge ratio on a masked token must not leak inf/NaN into the gradient
    loss = loss_fn(new, old, adv, torch.zeros_like(docs, dtype=torch.bool), docs).loss
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_scale_for_gradient_mean():
    assert scale_for_gradient_mean(torch.tensor(0.25), 4).item() == 1.0
    with pytest.raises(ValueError, match="data_parallel_size"):
        scale_for_gradient_mean(torch.tensor(1.0), 0)


def test_document_helpers():
    mask = torch.tensor([False, True, True, True, False, False])
    docs = torch.tensor([0, 0, 0, 2, 2, 3])  # id 1 absent, id 3 without labels
    segments = segment_documents(mask, docs)
    assert segments.labelled_tokens.tolist() == [2.0, 0.0, 1.0, 0.0]
    assert segments.num_documents.item() == 2
    values = torch.tensor([[100.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [float("inf"), 0.0], [8.0, 9.0]])
    assert document_means(values, segments).tolist() == [[3.0, 4.0], [0.0, 0.0], [6.0, 7.0], [0.0, 0.0]]
    labels, documents = count_labels_and_documents(mask, docs)
    assert (labels.item(), documents.item()) == (3, 2)


# --- bad input ---------------------------------------------------------------------------------------
def test_bad_inputs_name_the_problem():
    new, old, adv, mask, docs = grpo_inputs()
    with pytest.raises(ValueError, match="same shape"):
        grpo_loss(new, old[:-1], adv, mask, docs)
    with pytest.raises(ValueError, match="label_mask must be a bool"):
        grpo_loss(new, old, adv, mask.long(), docs)
    with pytest.raises(ValueError, match="document_index must be an integer"):
        gspo_loss(new, old, adv, mask, docs.double())
    with pytest.raises(ValueError, match="document_index must be >= 0"):
        gspo_loss(new, old, adv, mask, docs - 1)
    with pytest.raises(ValueError, match="epsilon_low"):
        grpo_loss(new, old, adv, mask, docs, epsilon_low=1.0)
    with pytest.raises(ValueError, match="epsilon_high"):
        gspo_loss(new, old, adv, mask, docs, epsilon_high=0.0)
    with pytest.raises(ValueError, match="num_labels_in_batch must be positive"):
        grpo_loss(new, old, adv, mask, docs, num_labels_in_batch=0)
    with pytest.raises(ValueError, match="num_documents_in_batch must be a scalar"):
        gspo_loss(new, old, adv, mask, docs, num_documents_in_batch=torch.ones(2))
    with pytest.raises(ValueError, match="form"):
        gspo_loss(new, old, adv, mask, docs, form="sequence")  # type: ignore[arg-type]
