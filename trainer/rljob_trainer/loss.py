"""The policy-gradient losses of the trainer: GRPO (token level) and GSPO (sequence level), DESIGN §4.

Both losses are pure functions of per-token tensors of one packed micro-batch of T tokens, with an explicit
label mask, document index and normaliser; autograd does the backward pass.

Notation per token t of document d: ``lp_new``, ``lp_old`` (log-probabilities of the token under the
trained and the sampling policy, at the sampling temperature), advantage ``A``, label mask ``m`` (True on
labelled completion tokens), ``r = exp(lp_new - lp_old)``, ``clip(x) = clamp(x, 1 - epsilon_low,
1 + epsilon_high)``.

Normaliser and data parallelism: each loss divides by a normaliser that defaults to this micro-batch's own
count. A training loop with several micro-batches and data-parallel ranks passes the count of the whole
optimizer step (all micro-batches, all ranks; see :func:`count_labels_and_documents`) and multiplies the loss
by the data-parallel size (:func:`scale_for_gradient_mean`) to undo DDP's gradient mean, so the gradient equals the
single-process gradient on the same documents.

One pass with the metrics: the trainer segments each micro-batch once (:func:`segment_documents`, the one device
synchronisation), takes the step's counts from those segments, passes them to the loss, and the loss returns a
:class:`PolicyLossOutput`: the loss and the per-token quantities it computed on the way (log-ratio, ratio, clipping
mask, the segments), which :class:`~rljob_trainer.loss_metrics.StepMetrics` reads instead of recomputing them.

Corrections (:class:`Corrections`, DESIGN §4), each off by default, so that by default both losses are exactly the
clipped surrogate above: the dual clip of negative advantages, the decoupled objective with truncated importance
sampling, and a KL penalty to a frozen reference policy. They act on the same per-token (GRPO) or per-document (GSPO)
quantities in the same pass; what their metrics read comes back in :class:`PolicyLossOutput`.

Where a new loss term goes: compute it inside the loss function, add the scalar to ``loss``, and if a metric should
show it, return its detached per-token value as a new :class:`PolicyLossOutput` field; then declare the metric in
``metrics_registry.METRICS`` and map it to that field in ``StepMetrics._per_token`` (loss_metrics.py). Its cross-rank
reduction is then the metrics module's (never a separate all-reduce).

Sources: GRPO, Shao et al., "DeepSeekMath", arXiv:2402.03300, eq. 3 (its KL-to-reference term is ``klCoef``'s k3);
GSPO, Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071, eq. 5-7; ServiceNow Fast-LLM,
``fast_llm/layers/language_model/loss/policy_gradient.py`` (the length-weighted GSPO form); the corrections' sources
are in :class:`Corrections`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Optional

import torch

if TYPE_CHECKING:
    from rljob_api.spec import AlgorithmSpec

Normaliser = int | float | torch.Tensor | None
"""A loss normaliser: a positive number, a scalar tensor (e.g. all-reduced on the device), or None."""

GSPOForm = Literal["fast-llm", "paper"]
KLEstimator = Literal["k1", "k3"]


@dataclass(frozen=True)
class Corrections:
    """The loss terms beyond the clipped surrogate (DESIGN §4), each off by default (the defaults compute exactly the
    surrogate). With ``rho`` the ratio the surrogate clips (r_t for GRPO, R_d for GSPO) and A its advantage:

    - ``dual_clip`` = c > 1 (None: off): where A < 0 the surrogate ``min(rho A, clip(rho) A)`` is bounded below by
      ``c A``, so a ratio far above 1 no longer gives an unbounded loss; where the bound binds the gradient is 0
      (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729,
      eq. 5).
    - ``is_cap`` = C >= 1 (None: off): the decoupled PPO objective of asynchronous RL (Fu et al. 2025, "AReaL",
      arXiv:2505.24298, eq. 5), ``-w min(rho_prox A, clip(rho_prox) A)`` with ``rho_prox = pi / pi_prox`` and the
      behaviour weight ``w = min(pi_prox / pi_behaviour, C)``. The proximal policy is the trainer's weights at the
      start of the step: the detached current log-probabilities (no extra forward), so ``rho_prox`` is 1 in value and
      its clip never binds, and with one optimizer step per batch the objective is the truncated-IS policy gradient
      ``-min(pi / pi_behaviour, C) A grad log pi`` (truncated importance sampling, Yao et al. 2025, "Your Efficient
      RL Framework Secretly Brings You Off-Policy RL Training"), with no trust region beyond the cap. GSPO applies
      it per document to R_d.
    - ``kl_coef`` = beta >= 0 (0: off) with ``kl_estimator`` k1 or k3: ``beta k_t`` is added to every labelled
      token's loss, with ``d_t = lp_ref - lp_new``, ``k1 = -d_t`` and ``k3 = exp(d_t) - 1 - d_t`` (Schulman 2020,
      "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; k3 is DeepSeekMath's eq. 4). Normalised
      like the surrogate: GRPO and GSPO's fast-llm form sum ``beta k_t`` over labelled tokens, GSPO's paper form adds
      ``beta`` times each document's mean of ``k_t``.

    Raises:
        ValueError: a value out of range or an unknown estimator (names the field and the value).
    """

    dual_clip: Optional[float] = None
    is_cap: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"

    def __post_init__(self) -> None:
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.is_cap is not None and not self.is_cap >= 1.0:
            raise ValueError(f"is_cap must be >= 1, got {self.is_cap}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")

    @classmethod
    def from_algorithm(cls, algorithm: AlgorithmSpec) -> Corrections:
        """The corrections ``spec.algorithm`` turns on."""
        sampling = algorithm.importance_sampling
        return cls(algorithm.dual_clip, sampling.cap if sampling.enabled else None, algorithm.kl_coef,
                   algorithm.kl_estimator)

    @property
    def importance_sampling(self) -> bool:
        return self.is_cap is not None

    @property
    def kl(self) -> bool:
        """A reference model is needed (``kl_coef`` > 0)."""
        return self.kl_coef > 0.0

    @property
    def terms(self) -> frozenset[str]:
        """The names of the terms that are on, among ``dual_clip``, ``importance_sampling`` and ``kl`` (the metrics
        registry's ``MetricDef.needs``)."""
        on = {"dual_clip": self.dual_clip is not None, "importance_sampling": self.importance_sampling, "kl": self.kl}
        return frozenset(name for name, enabled in on.items() if enabled)


NO_CORRECTIONS = Corrections()


class DocumentSegments(NamedTuple):
    """The per-document view of a packed micro-batch (documents never span micro-batches).

    ``index`` [T] int64 (0-based document id of each token), ``label_mask`` [T] bool,
    ``labelled_tokens`` [D] float32 (labelled tokens of each document id, D = max id + 1; ids without
    tokens or labels count 0), ``has_labels`` [D] bool.
    """

    index: torch.Tensor
    label_mask: torch.Tensor
    labelled_tokens: torch.Tensor
    has_labels: torch.Tensor

    @property
    def num_labels(self) -> torch.Tensor:
        """Labelled tokens: int64 scalar tensor (GRPO's normaliser count)."""
        return self.label_mask.sum()

    @property
    def num_documents(self) -> torch.Tensor:
        """Documents with at least one labelled token: int64 scalar tensor (GSPO's normaliser count)."""
        return self.has_labels.sum()


class PolicyLossOutput(NamedTuple):
    """One loss call on a micro-batch of T tokens: the loss and what its metrics read (no recomputation). Every
    tensor but ``loss`` is detached; GSPO's per-document values are broadcast to their documents' tokens.

    ``loss``: float scalar (float32, or float64 for float64 inputs), differentiable; divided by the normaliser.
    ``log_ratio``: [T], the loss's compute dtype: the log of the trained-to-sampling ratio. GRPO: ``lp_new -
    lp_old`` on labelled tokens, 0 elsewhere; GSPO: ``log R_d`` on every token of document d (0 for a document
    without labelled tokens). With importance sampling it is also the log of the behaviour weight before truncation
    (pi_prox = pi in value).
    ``ratio``: [T], ``exp(log_ratio)`` (r, or R_d for GSPO).
    ``clipped``: [T] bool, the loss's clip decision: the ratio it clipped outside [1 - epsilon_low, 1 + epsilon_high]
    (whatever the advantage's sign): ``ratio``, or with importance sampling the proximal ratio (1, never clipped).
    ``segments``: the :class:`DocumentSegments` the loss used (passed in, or computed once by the loss).
    ``token_log_ratio``: [T], ``lp_new - lp_old`` on labelled tokens, 0 elsewhere, for both losses (GRPO: the same
    tensor as ``log_ratio``): the sampler/trainer mismatch metric reads it.
    ``dual_clipped``: [T] bool, where the dual clip's bound ``c A`` replaced the surrogate; None when it is off.
    ``weight``: [T], the behaviour weight the loss applied, ``min(exp(log_ratio), cap)``; None without importance
    sampling. ``truncated``: [T] bool, where ``exp(log_ratio)`` exceeded the cap; None likewise.
    ``kl_ref``: [T], the KL estimator's value per labelled token (0 elsewhere); None without a KL penalty.

    As Fast-LLM's policy-gradient loss returns its metrics with the loss
    (``fast_llm/layers/language_model/loss/policy_gradient.py``); the clipping is PPO's (Schulman et al.,
    arXiv:1707.06347, eq. 7).
    """

    loss: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    segments: DocumentSegments
    token_log_ratio: torch.Tensor
    dual_clipped: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None
    kl_ref: Optional[torch.Tensor] = None


class _Surrogate(NamedTuple):
    """:func:`_policy_objective` over N items (tokens or documents): ``objective`` [N] differentiable, the rest [N]
    detached (see :class:`PolicyLossOutput`)."""

    objective: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    truncated: Optional[torch.Tensor]


def segment_documents(label_mask: torch.Tensor, document_index: torch.Tensor) -> DocumentSegments:
    """Group the tokens of a micro-batch by document.

    Args:
        label_mask: [T] bool, True on labelled tokens.
        document_index: [T] integer, the 0-based document id of each token (ids need not be contiguous).

    Raises:
        ValueError: shapes differ, ``label_mask`` is not bool, ``document_index`` is not an integer tensor
            or holds a negative id.

    Reads the largest id back to the host (one device synchronisation).
    """
    _check_same_shape(label_mask=label_mask, document_index=document_index)
    _check_mask_and_index(label_mask, document_index)
    index = document_index.reshape(-1).long()
    mask = label_mask.reshape(-1)
    if index.numel() == 0:
        num_segments = 0
    else:
        low, high = torch.aminmax(index)
        low, high = int(low), int(high)
        if low < 0:
            raise ValueError(f"document_index must be >= 0, got a minimum of {low}")
        num_segments = high + 1
    labelled_tokens = torch.zeros(num_segments, dtype=torch.float32, device=index.device).index_add_(
        0, index, mask.to(torch.float32)
    )
    return DocumentSegments(index, mask, labelled_tokens, labelled_tokens > 0)


def document_means(values: torch.Tensor, segments: DocumentSegments) -> torch.Tensor:
    """Mean of ``values`` over each document's labelled tokens.

    Args:
        values: [T] or [T, K] float (K quantities at once). Unlabelled positions are ignored, even if not
            finite.
        segments: from :func:`segment_documents` on the same micro-batch.

    Returns:
        [D] or [D, K], in ``values``' dtype promoted to at least float32; 0 for documents without labelled
        tokens. Differentiable with respect to ``values``.
    """
    if values.dim() not in (1, 2) or values.shape[0] != segments.index.shape[0]:
        raise ValueError(f"values must be [T] or [T, K] with T = {segments.index.shape[0]}, got {tuple(values.shape)}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    column = (slice(None),) + (None,) * (values.dim() - 1)
    masked = torch.where(segments.label_mask[column], values.to(dtype), 0.0)
    sums = masked.new_zeros((segments.labelled_tokens.shape[0], *values.shape[1:])).index_add(0, segments.index, masked)
    return sums / segments.labelled_tokens.to(dtype).clamp(min=1)[column]


def count_labels_and_documents(
    label_mask: torch.Tensor, document_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two normaliser counts of one micro-batch, to be summed over a step and all-reduced over ranks.

    Returns:
        (labelled tokens, documents with at least one labelled token), both int64 scalar tensors on the
        inputs' device: the GRPO (``num_labels_in_batch``) and GSPO (``num_documents_in_batch``) counts. A loop
        that keeps the micro-batch's :class:`DocumentSegments` reads them from its ``num_labels`` and
        ``num_documents`` instead (one segmentation per micro-batch).

    Raises:
        ValueError: as :func:`segment_documents`.
    """
    segments = segment_documents(label_mask, document_index)
    return segments.num_labels, segments.num_documents


def scale_for_gradient_mean(loss: torch.Tensor, data_parallel_size: int) -> torch.Tensor:
    """``loss * data_parallel_size``: undoes the mean of gradients over data-parallel ranks.

    DDP's all-reduce and FSDP's reduce-scatter (with HSDP's all-reduce across replicas) average gradients over the
    data-parallel ranks. When every rank's loss is already divided by the step's global
    normaliser, the correct gradient is the sum over ranks, so the loop backpropagates this scaled loss.

    Raises:
        ValueError: ``data_parallel_size`` < 1.
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    return loss * data_parallel_size


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    label_mask: torch.Tensor,
    document_index: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    num_labels_in_batch: Normaliser = None,
    segments: DocumentSegments | None = None,
    corrections: Corrections = NO_CORRECTIONS,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GRPO: token-level clipped importance-ratio loss (DeepSeekMath, arXiv:2402.03300; Fast-LLM GRPO).

    ``loss = sum_t m_t * -min(r_t * A_t, clip(r_t) * A_t) / num_labels_in_batch``, with the ``corrections`` that are
    on applied per token (see :class:`Corrections`): the dual clip bounds the surrogate, importance sampling weights
    it and takes the ratio against the proximal policy, the KL penalty adds ``kl_coef * k_t``.

    Args:
        new_logprobs: [T] float, log-probabilities of the tokens under the trained policy (differentiable).
        old_logprobs: [T] float, log-probabilities under the sampling policy.
        advantages: [T] float, the document's advantage broadcast to its tokens.
        label_mask: [T] bool, True on labelled completion tokens.
        document_index: [T] integer, 0-based document id of each token; GRPO's loss does not use it, its
            metrics do (through ``segments``).
        epsilon_low, epsilon_high: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high].
        num_labels_in_batch: labelled tokens the sum is divided by; default this micro-batch's count
            (at least 1, so an all-masked micro-batch gives 0). Pass the optimizer step's global count
            (all micro-batches and data-parallel ranks) to get the step's token mean.
        segments: :func:`segment_documents` of this ``label_mask`` and ``document_index``, when the caller
            has it already (it saves the segmentation's device synchronisation); computed here otherwise.
        corrections: the terms beyond the surrogate; none by default.
        ref_logprobs: [T] float, log-probabilities under the frozen reference policy (no gradient flows into them);
            required when ``corrections.kl_coef`` > 0, ignored otherwise.

    Returns:
        :class:`PolicyLossOutput`: the loss, a float scalar (float32, or float64 for float64 inputs), and the
        token ratios r_t with their clipping mask and what the corrections' metrics read.

    Raises:
        ValueError: shapes differ, a mask or index has the wrong dtype, a negative document id, an epsilon is
            out of range, a numeric normaliser is not positive, ``segments`` of another length, or a KL penalty
            without ``ref_logprobs`` (or of another shape).
    """
    _check_inputs(new_logprobs, old_logprobs, advantages, label_mask, document_index, epsilon_low, epsilon_high)
    _check_reference(corrections, ref_logprobs, new_logprobs)
    segments = _segments(segments, label_mask, document_index)
    mask = segments.label_mask
    dtype = torch.promote_types(new_logprobs.dtype, torch.float32)
    new = new_logprobs.reshape(-1).to(dtype)
    # Masking the log-ratio before exp keeps unlabelled positions from producing inf (and NaN gradients).
    log_ratio = torch.where(mask, new - old_logprobs.reshape(-1).to(dtype), 0.0)
    terms = _policy_objective(log_ratio, advantages.reshape(-1).to(dtype), epsilon_low, epsilon_high, corrections)
    total = torch.where(mask, terms.objective, 0.0).sum()
    kl = _kl_per_token(new, ref_logprobs, mask, corrections)
    if kl is not None:
        total = total + corrections.kl_coef * kl.sum()
    loss = total / _normaliser(num_labels_in_batch, segments.num_labels, "num_labels_in_batch")
    log_ratio = log_ratio.detach()
    return PolicyLossOutput(loss, log_ratio, log_ratio.exp(), terms.clipped, segments, log_ratio, terms.dual_clipped,
                            terms.weight, terms.truncated, None if kl is None else kl.detach())


def gspo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    label_mask: torch.Tensor,
    document_index: torch.Tensor,
    *,
    epsilon_low: float = 3e-4,
    epsilon_high: float = 4e-4,
    num_documents_in_batch: Normaliser = None,
    form: GSPOForm = "fast-llm",
    segments: DocumentSegments | None = None,
    corrections: Corrections = NO_CORRECTIONS,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: sequence-level clipped importance-ratio loss (arXiv:2507.18071; Fast-LLM GSPO).

    Per document d with n_d labelled tokens: ``R_d = exp(mean_{t in d, m_t} (lp_new_t - lp_old_t))`` (the
    geometric mean of the token ratios, i.e. the paper's length-normalised sequence ratio s_i) and
    ``A_d = mean_{t in d, m_t} A_t`` (treated as a constant). With ``l_d = -min(R_d * A_d, clip(R_d) * A_d)``:

    - ``form="fast-llm"`` (default, DESIGN §4): every labelled token of d contributes ``l_d``, so
      ``loss = sum_d n_d * l_d / num_documents_in_batch``. A document weighs by its length, and the gradient
      is the one of GRPO's token sum with the token ratio replaced by R_d.
    - ``form="paper"``: one term per sequence, ``loss = sum_d l_d / num_documents_in_batch``, the paper's
      ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)``: every sequence weighs the same whatever its length.

    The dual clip and importance sampling act on ``l_d`` (R_d, A_d, and the behaviour weight ``min(R_d, cap)``);
    the KL penalty adds ``kl_coef * k_t`` per labelled token (fast-llm) or ``kl_coef`` times d's mean of ``k_t``
    (paper), see :class:`Corrections`.

    Args:
        new_logprobs, old_logprobs, advantages, label_mask: as :func:`grpo_loss`, [T].
        document_index: [T] integer, 0-based document id of each token; a document's tokens all lie in this
            micro-batch.
        epsilon_low, epsilon_high: R_d is clipped to [1 - epsilon_low, 1 + epsilon_high]; the defaults are
            the paper's (3e-4, 4e-4): a sequence ratio moves far less than a token ratio.
        num_documents_in_batch: documents the sum is divided by; default this micro-batch's documents with
            at least one labelled token (at least 1). Pass the optimizer step's global count.
        form: ``"fast-llm"`` or ``"paper"``, see above.
        segments, corrections, ref_logprobs: as :func:`grpo_loss`.

    Returns:
        :class:`PolicyLossOutput`: the loss, a float scalar (float32, or float64 for float64 inputs), and the
        sequence ratios R_d broadcast to their documents' tokens with their clipping mask and what the corrections'
        metrics read.

    Raises:
        ValueError: as :func:`grpo_loss`, or an unknown ``form``.
    """
    _check_inputs(new_logprobs, old_logprobs, advantages, label_mask, document_index, epsilon_low, epsilon_high)
    if form not in ("fast-llm", "paper"):
        raise ValueError(f"form must be 'fast-llm' or 'paper', got {form!r}")
    _check_reference(corrections, ref_logprobs, new_logprobs)
    segments = _segments(segments, label_mask, document_index)
    mask = segments.label_mask
    dtype = torch.promote_types(new_logprobs.dtype, torch.float32)
    new = new_logprobs.reshape(-1).to(dtype)
    token_log_ratio = torch.where(mask, new - old_logprobs.reshape(-1).to(dtype), 0.0)
    sequence_log_ratio = document_means(token_log_ratio, segments)  # [D]
    sequence_advantage = document_means(advantages.detach().reshape(-1), segments)  # [D]
    terms = _policy_objective(sequence_log_ratio, sequence_advantage, epsilon_low, epsilon_high, corrections)
    weight = segments.labelled_tokens if form == "fast-llm" else segments.has_labels
    total = (terms.objective * weight.to(terms.objective.dtype)).sum()
    kl = _kl_per_token(new, ref_logprobs, mask, corrections)
    if kl is not None:
        total = total + corrections.kl_coef * (kl.sum() if form == "fast-llm" else document_means(kl, segments).sum())
    loss = total / _normaliser(num_documents_in_batch, segments.num_documents, "num_documents_in_batch")
    index = segments.index  # the metrics read the per-document values on every token of d

    def per_token(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if value is None else value.detach()[index]

    log_ratio = sequence_log_ratio.detach()[index]
    return PolicyLossOutput(loss, log_ratio, log_ratio.exp(), per_token(terms.clipped), segments,
                            token_log_ratio.detach(), per_token(terms.dual_clipped), per_token(terms.weight),
                            per_token(terms.truncated), None if kl is None else kl.detach())


def _policy_objective(
    log_ratio: torch.Tensor, advantage: torch.Tensor, epsilon_low: float, epsilon_high: float,
    corrections: Corrections,
) -> _Surrogate:
    """The negated surrogate of N items (tokens, or documents for GSPO) with the dual clip and importance sampling of
    ``corrections`` (see :class:`Corrections`).

    Args:
        log_ratio: [N] float, ``log(pi / pi_behaviour)`` of each item, differentiable.
        advantage: [N] float, each item's advantage (a constant).

    Returns:
        :class:`_Surrogate`: ``objective`` = ``-w * max(min(rho A, clip(rho) A), c A if A < 0)`` (w = 1 and no
        ``c A`` bound when those corrections are off), where ``rho`` is ``exp(log_ratio)``, or with importance
        sampling the proximal ratio ``exp(log_ratio - log_ratio.detach())`` (1 in value, gradient of ``log pi``).
        PPO's clip (Schulman et al., arXiv:1707.06347, eq. 7); the rest as :class:`Corrections` cites.
    """
    weight = truncated = None
    if corrections.is_cap is not None:
        behaviour = log_ratio.detach().exp()  # pi_prox / pi_behaviour, pi_prox = the detached pi
        weight, truncated = behaviour.clamp(max=corrections.is_cap), behaviour > corrections.is_cap
        log_ratio = log_ratio - log_ratio.detach()  # log(pi / pi_prox): 0 in value
    ratio = log_ratio.exp()
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * advantage)
    dual_clipped = None
    if corrections.dual_clip is not None:
        bound = corrections.dual_clip * advantage
        dual_clipped = ((advantage < 0) & (surrogate < bound)).detach()
        surrogate = torch.where(advantage < 0, torch.maximum(surrogate, bound), surrogate)
    objective = -surrogate if weight is None else -(weight * surrogate)
    ratio = ratio.detach()
    clipped = (ratio < 1.0 - epsilon_low) | (ratio > 1.0 + epsilon_high)
    return _Surrogate(objective, clipped, dual_clipped, weight, truncated)


def _kl_per_token(
    new: torch.Tensor, ref_logprobs: torch.Tensor | None, mask: torch.Tensor, corrections: Corrections
) -> torch.Tensor | None:
    """[T] ``corrections.kl_estimator``'s value per labelled token (0 elsewhere), differentiable with respect to
    ``new`` (the flat log-probabilities in the compute dtype); None when the KL penalty is off. With ``d = lp_ref -
    lp_new``: k1 = -d, k3 = expm1(d) - d (Schulman 2020)."""
    if not corrections.kl or ref_logprobs is None:
        return None
    d = torch.where(mask, ref_logprobs.detach().reshape(-1).to(new.dtype) - new, 0.0)
    return -d if corrections.kl_estimator == "k1" else torch.expm1(d) - d


def _segments(
    segments: DocumentSegments | None, label_mask: torch.Tensor, document_index: torch.Tensor
) -> DocumentSegments:
    """The caller's segments of this micro-batch (checked for length only: no device synchronisation), or new ones."""
    if segments is None:
        return segment_documents(label_mask, document_index)
    if segments.index.shape[0] != label_mask.numel():
        raise ValueError(f"segments cover {segments.index.shape[0]} tokens, the micro-batch has {label_mask.numel()}")
    return segments


def _normaliser(value: Normaliser, default: torch.Tensor, name: str) -> torch.Tensor | float:
    if value is None:
        return default.clamp(min=1)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.reshape(())
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_reference(corrections: Corrections, ref_logprobs: torch.Tensor | None, new_logprobs: torch.Tensor) -> None:
    if not corrections.kl:
        return
    if ref_logprobs is None:
        raise ValueError(f"kl_coef = {corrections.kl_coef} needs ref_logprobs, the reference policy's log-probabilities")
    if ref_logprobs.shape != new_logprobs.shape:
        raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, new_logprobs {tuple(new_logprobs.shape)}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token inputs must have the same shape [T], got {shapes}")


def _check_mask_and_index(label_mask: torch.Tensor, document_index: torch.Tensor) -> None:
    if label_mask.dtype != torch.bool:
        raise ValueError(f"label_mask must be a bool tensor, got dtype {label_mask.dtype}")
    if document_index.dtype.is_floating_point or document_index.dtype == torch.bool:
        raise ValueError(f"document_index must be an integer tensor, got dtype {document_index.dtype}")


def _check_inputs(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    label_mask: torch.Tensor,
    document_index: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> None:
    _check_same_shape(
        new_logprobs=new_logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        label_mask=label_mask,
        document_index=document_index,
    )
    _check_mask_and_index(label_mask, document_index)
    if not new_logprobs.dtype.is_floating_point:
        raise ValueError(f"new_logprobs must be a floating-point tensor, got dtype {new_logprobs.dtype}")
    if not 0.0 < epsilon_low < 1.0:
        raise ValueError(f"epsilon_low must be in (0, 1), got {epsilon_low}")
    if not epsilon_high > 0.0:
        raise ValueError(f"epsilon_high must be > 0, got {epsilon_high}")
