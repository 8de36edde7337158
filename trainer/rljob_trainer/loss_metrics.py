"""Loss metrics of one optimizer step, and every cross-rank reduction after the loss (DESIGN §4).

One pass: the loss (:mod:`rljob_trainer.loss`) returns a :class:`~rljob_trainer.loss.PolicyLossOutput` with
the ratio, the clipping mask and the document segments it computed; :meth:`StepMetrics.update` reads them (no
second segmentation, log-ratio or clipping). What is reduced is declared in :mod:`rljob_trainer.metrics_registry`:
the loss metrics (``METRICS``) and the step totals that are not loss metrics (``STEP_TOTALS``: the loss value, the
stream counters), reduced in the same SUM all-reduce. The only all-reduce of a step outside this module is the
normaliser counts', before the loss (the loss divides by them).
A new loss term: see the module docstring of :mod:`rljob_trainer.loss`; its metric is a ``MetricDef`` in
``METRICS`` and a line in ``StepMetrics._per_token``.

Levels: ``none``; ``basic``, every metric below but ``entropy``; ``full``, basic plus ``entropy`` (a second
pass over the vocabulary); ``auto``, basic when pipeline_parallel = 1 else none. Names follow Fast-LLM's
policy-gradient metrics (``fast_llm/layers/language_model/loss/``) and its PR #562 (reward, staleness).

Units and weighting:

- Means are document-weighted: a labelled token of document d weighs 1 / (labelled tokens of d), so each
  document counts once. Sums accumulate over all micro-batches of the step on every rank and are divided by
  the step's global document count (documents with at least one labelled token) after the all-reduce.
- ``max_*`` / ``min_*`` run over labelled tokens (advantage, staleness) or documents (reward).
- ``num_tokens`` is the step's labelled-token count over all ranks.
- GRPO's ratio metrics are token-level; GSPO's use the sequence ratio R_d (as Fast-LLM logs them). Both are
  the loss's own ratio and clipping decision (in its compute dtype, float32 in training); ``kl_new_old`` is
  evaluated in float64 from the loss's log-ratio, where r - log r - 1 does not cancel.
- ``train_samples_reward`` averages the raw reward over the documents that reached the loss, i.e. over the
  sample-filtered training batch (zero-variance groups dropped, stale or malformed entries dead-lettered):
  it is biased and is *not* a policy-performance metric. The rollout reward (everything generated per model
  version, before filtering) is the one that measures the policy.
- ``staleness`` = documents_seen (at the start of the step) - model_version, in documents, subtracted in
  int64 and only then cast to float64, so counts above 2**24 keep their exact difference.
- ``sampler_mismatch_*`` are token means over the labelled tokens of staleness 0 (sampled with the weights the
  trainer holds now), counted by ``sampler_mismatch_tokens``: exp(lp_new - lp_old) and its k3 there measure the
  numerical difference of sampler and trainer on the same weights, not staleness; NaN in a step without such tokens.
- The corrections' metrics (``dual_clip_fraction``, ``behaviour_weight``, ``max_behaviour_weight``,
  ``behaviour_weight_truncated_fraction``, ``kl_ref``) are registered only when their correction is on, and read
  what the loss returned (:class:`~rljob_trainer.loss.PolicyLossOutput`).

Every rank builds the same metric list in the same order (it depends on the level only, which comes from the
one resolved config), and :meth:`StepMetrics.reduce` calls the same all-reduces on every rank, whatever the
rank saw: one SUM (metric sums and step totals; the trainer calls it every step, whatever the level) and, when
metrics are on, one MAX (maxima and negated minima). Missing inputs (a micro-batch without ``reward`` or
``model_version`` while metrics are on) are counted per rank inside the SUM all-reduce, so every rank raises the
same :class:`MetricsInputError` instead of some ranks hanging.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Literal, NamedTuple

import torch
import torch.distributed as dist

from rljob_trainer import loss as losses
from rljob_trainer.loss import NO_CORRECTIONS, Corrections, DocumentSegments, PolicyLossOutput
from rljob_trainer.metrics_registry import STEP_TOTALS, MetricsLevel, metric_definitions, metrics_level
from rljob_trainer.parallel import start_reduce_small

if TYPE_CHECKING:
    from rljob_api.config import JobConfig


class MetricsInputError(RuntimeError):
    """Metrics are on but some micro-batch of the step lacked an input; raised identically on every rank.

    ``missing`` maps each input name to the ranks (of the reduction group) that lacked it.
    """

    def __init__(self, message: str, missing: dict[str, list[int]]):
        super().__init__(message)
        self.missing = missing


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    label_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` (nats) of ``softmax(logits / temperature)`` at each position.

    Computed ``chunk_size`` rows at a time in float32, so the extra memory is about
    ``4 * chunk_size * V * 4`` bytes whatever T is.

    Args:
        logits: [T, V] or [B, L, V] (T = B * L), any float dtype; row t is the distribution that scored
            token t (already shifted by the caller).
        temperature: the sampling temperature (> 0).
        label_mask: optional [T] bool; only these rows are computed, the others are 0.
        chunk_size: rows per chunk (>= 1).

    Returns:
        [T] float32.

    Raises:
        ValueError: ``logits`` has fewer than 2 dimensions, a mask of the wrong size, or a non-positive
            temperature or chunk size.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be [T, V] or [B, L, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device)
    if label_mask is None:
        rows = None
        count = flat.shape[0]
    else:
        if label_mask.numel() != flat.shape[0]:
            raise ValueError(f"label_mask has {label_mask.numel()} elements, logits have {flat.shape[0]} rows")
        rows = label_mask.reshape(-1).nonzero().squeeze(1)
        count = rows.numel()
    for start in range(0, count, chunk_size):
        where = slice(start, start + chunk_size) if rows is None else rows[start : start + chunk_size]
        chunk = flat[where] if rows is None else flat.index_select(0, where)
        log_p = torch.log_softmax(chunk.float() / temperature, dim=-1)
        p = log_p.exp()
        out[where] = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
    return out


_REQUIRED_INPUTS = ("reward", "model_version", "logits or entropy")
_CORRECTION_FIELDS = {"dual_clip": ("dual_clipped",), "importance_sampling": ("weight", "truncated"), "kl": ("kl_ref",)}
"""The :class:`~rljob_trainer.loss.PolicyLossOutput` fields the metrics of each correction term read."""


class StepMetrics:
    """Accumulates the loss metrics of one optimizer step and does every cross-rank reduction after the loss.

    Use: for each micro-batch, :meth:`update` with the loss's :class:`~rljob_trainer.loss.PolicyLossOutput`;
    after the step, :meth:`reduce` on every rank with the step totals (the registry's ``STEP_TOTALS``: the loss
    value and the stream counters); it resets the accumulator. With level ``none``, :meth:`update` is a no-op and
    :meth:`reduce` reduces the totals only (``{}`` without totals, and no collective).

    Args:
        level: a resolved level (``none``, ``basic``, ``full``); see :func:`metrics_level`.
        loss: ``grpo`` (token-level ratio metrics) or ``gspo`` (sequence ratio R_d); the loss :meth:`update`
            runs itself when it is given no loss output.
        epsilon_low, epsilon_high: that loss's clip range (``clipped_ratio_fraction``).
        temperature: the sampling temperature, for ``entropy`` from logits.
        device: where the accumulators live; must suit the reduction group's backend (CPU for gloo, CUDA
            for NCCL).
        corrections: the loss's corrections (:class:`~rljob_trainer.loss.Corrections`): their metrics are registered,
            and the loss :meth:`update` runs itself applies them.

    Raises:
        ValueError: an unknown level or loss, or an invalid clip range.
    """

    def __init__(
        self,
        level: MetricsLevel,
        *,
        loss: Literal["grpo", "gspo"] = "grpo",
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        temperature: float = 1.0,
        device: str | torch.device | None = None,
        corrections: Corrections = NO_CORRECTIONS,
    ):
        self.definitions = metric_definitions(level, corrections.terms)
        if loss not in ("grpo", "gspo"):
            raise ValueError(f"loss must be 'grpo' or 'gspo', got {loss!r}")
        if not 0.0 < epsilon_low < 1.0 or not epsilon_high > 0.0:
            raise ValueError(
                f"clip range must satisfy 0 < epsilon_low < 1 and epsilon_high > 0, "
                f"got epsilon_low={epsilon_low}, epsilon_high={epsilon_high}"
            )
        self.level = level
        self.loss = loss
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.temperature = temperature
        self.corrections = corrections
        self.device = torch.device(device or "cpu")
        # Sums: document means (per="document"), then sums over labelled tokens (counts, and token means' numerators).
        self._mean_names = [m.name for m in self.definitions if m.reduction == "sum" and m.per == "document"]
        self._token_names = [m.name for m in self.definitions if m.reduction == "sum" and m.per != "document"]
        self._per = {m.name: m.per for m in self.definitions}
        self._max_names = [m.name for m in self.definitions if m.reduction == "max"]
        self._min_names = [m.name for m in self.definitions if m.reduction == "min"]
        self._required = {"none": (), "basic": _REQUIRED_INPUTS[:2], "full": _REQUIRED_INPUTS}[level]
        self.reset()

    @classmethod
    def from_config(cls, config: JobConfig, device: str | torch.device | None = None) -> StepMetrics:
        """The accumulator a trainer rank builds from the resolved job config (level, loss, clip, temperature,
        corrections)."""
        algorithm = config.spec.algorithm
        epsilon_low, epsilon_high = algorithm.resolved_epsilons()
        return cls(
            metrics_level(config),
            loss=algorithm.loss,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            temperature=config.spec.rollout.sampling.temperature,
            device=device,
            corrections=Corrections.from_algorithm(algorithm),
        )

    @property
    def enabled(self) -> bool:
        return self.level != "none"

    def reset(self) -> None:
        """Forget everything accumulated since the last :meth:`reduce`."""
        f64 = {"dtype": torch.float64, "device": self.device}
        # Sums: the document means, then the token sums, then the step's document count.
        self._sums = torch.zeros(len(self._mean_names) + len(self._token_names) + 1, **f64)
        self._maxes = torch.full((len(self._max_names),), -torch.inf, **f64)
        self._mins = torch.full((len(self._min_names),), torch.inf, **f64)
        self._missing = {name: 0 for name in self._required}
        self._pending: list[_MicroBatchInputs] = []

    @torch.no_grad()
    def update(
        self,
        *,
        new_logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        documents_seen: int | torch.Tensor,
        loss_output: PolicyLossOutput | None = None,
        label_mask: torch.Tensor | None = None,
        document_index: torch.Tensor | None = None,
        reward: torch.Tensor | None = None,
        model_version: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
    ) -> None:
        """Add one micro-batch (T tokens) to the step's metrics. Never raises for a missing input.

        What the metrics read of it (a few [T] tensors, detached; no logits) is kept until :meth:`reduce`, which
        computes the metrics of the step's micro-batches in one pass.

        Args:
            new_logprobs, old_logprobs, advantages: [T] float, as for the loss (``new_logprobs`` is detached).
            documents_seen: documents trained before this step (int or int64 scalar tensor).
            loss_output: what the loss returned for this micro-batch; its ratio, clipping mask and segments are
                read, not recomputed. Without it (standalone use) the configured loss is run here once on
                ``label_mask`` and ``document_index`` ([T] bool and [T] integer, then required).
            reward: [T] float, the document's raw reward broadcast to its tokens.
            model_version: [T] integer, the weights version (documents seen) each token was sampled with.
            logits: [T, V] or [B, L, V], row t scoring token t (full level; see :func:`token_entropy`).
            entropy: [T] float, precomputed token entropy (full level), instead of ``logits``.
            ref_logprobs: [T] float, the reference policy's log-probabilities, for the loss run here when there is
                no ``loss_output`` and the corrections include a KL penalty.

        A missing ``reward`` / ``model_version`` (or, at full level, both ``logits`` and ``entropy``) is
        counted and reported by :meth:`reduce` on every rank.

        Raises:
            ValueError: shapes or dtypes that do not match, or a ``loss_output`` without what a registered correction
                metric reads (a programming error, not a data error).
        """
        if not self.enabled:
            return
        if loss_output is None:
            loss_output = self._run_loss(new_logprobs, old_logprobs, advantages, label_mask, document_index,
                                         ref_logprobs)
        segments = loss_output.segments
        _check_update_inputs(
            segments.index.shape[0], new_logprobs=new_logprobs, old_logprobs=old_logprobs, advantages=advantages,
            reward=reward, model_version=model_version, entropy=entropy, logits=logits,
        )
        present = {
            "reward": reward is not None,
            "model_version": model_version is not None,
            "logits or entropy": logits is not None or entropy is not None,
        }
        for name in self._required:
            self._missing[name] += not present[name]
        if segments.index.numel() == 0:
            return
        for term, fields in _CORRECTION_FIELDS.items():
            if term in self.corrections.terms:
                for field in fields:
                    _read(loss_output, field)  # raises now, not at the step's reduction
        if self.level == "full" and entropy is None and logits is not None:  # now: the logits are not kept
            entropy = token_entropy(logits, temperature=self.temperature, label_mask=segments.label_mask)
        self._pending.append(_MicroBatchInputs(
            loss_output._replace(loss=None), new_logprobs.detach().reshape(-1), old_logprobs.reshape(-1),
            advantages.reshape(-1), None if reward is None else reward.reshape(-1),
            None if model_version is None else _staleness(documents_seen, model_version),
            None if entropy is None else entropy.reshape(-1)))

    def fold(self) -> None:
        """Fold the micro-batches added since the last fold into the step's sums and extremes, all at once: the
        tensor operations run once per step instead of once per micro-batch (their count, not their size, is what
        they cost on a small batch). :meth:`reduce` folds first; calling it before is optional (to time it apart).
        Local: no collective."""
        if not self._pending:
            return
        batch, self._pending = _MicroBatchInputs.concatenate(self._pending), []
        per_token = self._per_token(batch)
        loss_output, segments = batch.output, batch.output.segments
        reward, model_version = batch.reward, batch.staleness
        doc_means = losses.document_means(torch.stack([per_token[name] for name in self._mean_names], 1), segments)
        by_token = torch.stack([per_token[name] for name in self._token_names], 1)
        token_sums = torch.where(segments.label_mask[:, None], by_token, 0.0).sum(0)
        documents = segments.num_documents.to(torch.float64).reshape(1)
        self._sums += torch.cat([doc_means.sum(0), token_sums, documents]).to(self.device)
        reward_by_doc = doc_means[:, self._mean_names.index("train_samples_reward")]
        self._update_extremes(per_token, loss_output, reward_by_doc, segments, reward is not None,
                              model_version is not None)

    def _run_loss(
        self,
        new_logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        label_mask: torch.Tensor | None,
        document_index: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
    ) -> PolicyLossOutput:
        """The configured loss on a micro-batch, for a caller that has no loss output (only what the metrics read is
        used)."""
        if label_mask is None or document_index is None:
            raise ValueError("StepMetrics.update needs loss_output, or label_mask and document_index")
        loss_fn = losses.grpo_loss if self.loss == "grpo" else losses.gspo_loss
        return loss_fn(
            new_logprobs.detach(), old_logprobs, advantages, label_mask, document_index,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, corrections=self.corrections,
            ref_logprobs=ref_logprobs,
        )

    def _per_token(self, batch: _MicroBatchInputs) -> dict[str, torch.Tensor]:
        """{sum metric: [T] float64} of the micro-batches in ``batch``, whose document means (or, for the metrics of
        ``per != "document"``, sums over labelled tokens) the step adds up (DESIGN §4)."""
        f64 = torch.float64
        output, reward, entropy = batch.output, batch.reward, batch.entropy
        new_lp = batch.new_logprobs.to(f64)
        log_ratio = output.log_ratio.to(f64)
        zeros = torch.zeros_like(new_lp)
        staleness = zeros if batch.staleness is None else batch.staleness.to(zeros.device)
        # Tokens sampled with the weights the trainer holds now (staleness exactly 0: an int64 difference).
        current = torch.zeros_like(new_lp, dtype=torch.bool) if batch.staleness is None else staleness == 0
        token_log_ratio = torch.where(current, output.token_log_ratio.to(f64), 0.0)
        per_token = {
            "new_logprobs": new_lp,
            "old_logprobs": batch.old_logprobs.to(f64),
            "ratio_new_old": output.ratio.to(f64),
            # k3 = r - log r - 1 written as expm1(log r) - log r, in float64 from the loss's log-ratio: the
            # difference of the loss's float32 ratio and 1 would cancel for small log-ratios.
            "kl_new_old": torch.expm1(log_ratio) - log_ratio,
            "clipped_ratio_fraction": output.clipped.to(f64),
            "advantage": batch.advantages.to(f64),
            "train_samples_reward": zeros if reward is None else reward.reshape(-1).to(f64),
            "staleness": staleness,
            "num_tokens": torch.ones_like(new_lp),
            "sampler_mismatch_tokens": current.to(f64),
            "sampler_mismatch_ratio": torch.where(current, token_log_ratio.exp(), 0.0),
            "sampler_mismatch_kl": torch.expm1(token_log_ratio) - token_log_ratio,  # 0 where not current
        }
        terms = self.corrections.terms
        if "dual_clip" in terms:
            per_token["dual_clip_fraction"] = _read(output, "dual_clipped").to(f64)
        if "importance_sampling" in terms:
            per_token["behaviour_weight"] = _read(output, "weight").to(f64)
            per_token["behaviour_weight_truncated_fraction"] = _read(output, "truncated").to(f64)
        if "kl" in terms:
            per_token["kl_ref"] = _read(output, "kl_ref").to(f64)
        if self.level == "full":
            per_token["entropy"] = zeros if entropy is None else entropy.to(f64)
        return per_token

    def _update_extremes(
        self,
        per_token: dict[str, torch.Tensor],
        output: PolicyLossOutput,
        reward_by_doc: torch.Tensor,
        segments: DocumentSegments,
        has_reward: bool,
        has_version: bool,
    ) -> None:
        """Fold one micro-batch into the running max/min: labelled tokens for advantage, staleness and the behaviour
        weight before truncation (the loss's ratio), documents for reward."""
        unseen = torch.tensor([-torch.inf, torch.inf], dtype=torch.float64, device=reward_by_doc.device)
        mask = segments.label_mask
        extremes = {  # source metric -> [max, min]
            "advantage": _masked_extremes(per_token["advantage"], mask),
            "train_samples_reward": _masked_extremes(reward_by_doc, segments.has_labels) if has_reward else unseen,
            "staleness": _masked_extremes(per_token["staleness"], mask) if has_version else unseen,
        }
        if "importance_sampling" in self.corrections.terms:
            extremes["behaviour_weight"] = _masked_extremes(output.ratio.to(torch.float64), mask)
        maxes = torch.stack([extremes[name.removeprefix("max_")][0] for name in self._max_names])
        mins = torch.stack([extremes[name.removeprefix("min_")][1] for name in self._min_names])
        self._maxes = torch.maximum(self._maxes, maxes.to(self.device))
        self._mins = torch.minimum(self._mins, mins.to(self.device))

    def reduce(
        self, group: dist.ProcessGroup | None = None, *, totals: Mapping[str, float | torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Reduce the step's metrics and ``totals`` over ``group`` (default: the world, when torch.distributed is
        initialised), and reset the accumulator.

        Args:
            group: the data-parallel process group.
            totals: this rank's value of every step total of ``STEP_TOTALS`` (float or float scalar tensor
                on any device), summed over the ranks; exactly those names. The trainer passes them every step.

        Collectives, identical on every rank: one :func:`~rljob_trainer.parallel.reduce_small` (the sum of the
        metric sums, the totals and the per-rank missing-input counts; with metrics on, the maximum of the maxima
        and the negated minima) whenever metrics are on or ``totals`` is given; none with one rank.

        Returns:
            {metric name: value} in registration order, then the totals in ``STEP_TOTALS`` order; identical
            on every rank. Means are NaN when the step had no document, extremes NaN when nothing was seen.

        Raises:
            ValueError: ``totals`` does not name exactly the step totals (before any collective).
            MetricsInputError: some rank lacked an input in some micro-batch; every rank of the group raises
                it with the same message (after the reduction).
        """
        return self.start_reduce(group, totals=totals)()

    def start_reduce(
        self, group: dist.ProcessGroup | None = None, *, totals: Mapping[str, float | torch.Tensor] | None = None
    ) -> Callable[[], dict[str, float]]:
        """:meth:`reduce` with its collective started asynchronously
        (:func:`~rljob_trainer.parallel.start_reduce_small`): returns the function that waits for it and returns
        what :meth:`reduce` returns, raising what it raises after the reduction (``MetricsInputError``); the
        accumulator is reset at once. The trainer clips the gradients meanwhile.

        Raises:
            ValueError: as :meth:`reduce`, before any collective.
        """
        total_names, total_values = self._totals(totals)
        if not self.enabled and totals is None:
            return dict
        self.fold()
        distributed = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(group), dist.get_rank(group)) if distributed else (1, 0)
        missing = torch.zeros(len(self._required), world, dtype=torch.float64, device=self.device)
        missing[:, rank] = torch.tensor([float(self._missing[name]) for name in self._required], dtype=torch.float64)
        sums = torch.cat([self._sums, total_values, missing.reshape(-1)])
        extremes = torch.cat([self._maxes, -self._mins])  # min(x) = -max(-x): one maximum for both
        self.reset()
        pending = start_reduce_small(sums, extremes if self.enabled else None, group)

        def finish() -> dict[str, float]:
            reduced_sums, reduced = pending.wait()
            self._raise_if_missing(reduced_sums[reduced_sums.numel() - missing.numel() :].reshape(missing.shape))
            return self._named(reduced_sums.tolist(), (extremes if reduced is None else reduced).tolist(), total_names)

        return finish

    def _totals(self, totals: Mapping[str, float | torch.Tensor] | None) -> tuple[tuple[str, ...], torch.Tensor]:
        """(names in ``STEP_TOTALS`` order, [len(names)] float64 on the metrics' device)."""
        if totals is None:
            return (), torch.zeros(0, dtype=torch.float64, device=self.device)
        names = tuple(m.name for m in STEP_TOTALS)
        if set(totals) != set(names):
            raise ValueError(f"totals must name exactly the step totals {list(names)}, got {sorted(totals)}")
        as_f64 = {"dtype": torch.float64, "device": self.device}
        return names, torch.stack([torch.as_tensor(totals[name], **as_f64).reshape(()) for name in names])

    def _named(self, sums: list[float], extremes: list[float], total_names: tuple[str, ...]) -> dict[str, float]:
        """The reduced values by name; ``sums`` as laid out by :meth:`reduce`, ``extremes`` = maxima, -minima."""
        k, c = len(self._mean_names), len(self._token_names)
        documents = sums[k + c]
        nan = float("nan")
        reduced = {name: total / documents if documents > 0 else nan for name, total in zip(self._mean_names, sums)}
        token_sums = dict(zip(self._token_names, sums[k : k + c]))
        for name, total in token_sums.items():
            per = self._per[name]
            reduced[name] = total if per == "total" else (total / token_sums[per] if token_sums[per] > 0 else nan)
        n_max = len(self._max_names)
        for name, value in zip(self._max_names + self._min_names, extremes[:n_max] + [-v for v in extremes[n_max:]]):
            reduced[name] = value if abs(value) != float("inf") else float("nan")
        named = {m.name: reduced[m.name] for m in self.definitions}
        named.update(zip(total_names, sums[k + c + 1 : k + c + 1 + len(total_names)]))
        return named

    def _raise_if_missing(self, missing: torch.Tensor) -> None:
        """``missing`` [inputs, world]: micro-batches that lacked each input, per rank (already reduced)."""
        by_input = {
            name: [r for r, count in enumerate(row) if count > 0] for name, row in zip(self._required, missing.tolist())
        }
        by_input = {name: ranks for name, ranks in by_input.items() if ranks}
        if not by_input:
            return
        counts = missing.sum(1).tolist()
        detail = "; ".join(
            f"`{name}` missing in {int(counts[self._required.index(name)])} micro-batch(es) on rank(s) {ranks}"
            for name, ranks in by_input.items()
        )
        raise MetricsInputError(
            f"loss metrics are on (level {self.level!r}) but inputs were missing this step: {detail}. "
            "Entries without reward or model_version must be dead-lettered at decode time (DESIGN §4).",
            by_input,
        )


class _MicroBatchInputs(NamedTuple):
    """What the metrics read of one micro-batch (T tokens), or of several concatenated: the loss output without its
    loss (no autograd graph is kept), [T] log-probabilities (float, detached), advantages, rewards, staleness
    (float64, ``documents_seen - model_version``) and entropy; None where the micro-batch lacked the input."""

    output: PolicyLossOutput
    new_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    reward: torch.Tensor | None
    staleness: torch.Tensor | None
    entropy: torch.Tensor | None

    @staticmethod
    def concatenate(parts: list[_MicroBatchInputs]) -> _MicroBatchInputs:
        """One batch of ``parts`` in order: tokens concatenated, each part's document ids shifted past the previous
        parts' (its segments become documents of the whole). An input some part lacks is None where every part lacks
        it, else zeros in the parts that lack it (a step with mixed presence raises in :meth:`StepMetrics.reduce`
        whatever the values)."""
        if len(parts) == 1:
            return parts[0]

        def cat(values: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor | None:
            if all(v is None for v in values):
                return None
            return torch.cat([torch.zeros_like(t, dtype=torch.float64) if v is None else v
                              for v, t in zip(values, like, strict=True)])

        outputs = [p.output for p in parts]
        segments = [o.segments for o in outputs]
        offsets = torch.tensor([0] + [s.labelled_tokens.shape[0] for s in segments[:-1]]).cumsum(0).tolist()
        merged = DocumentSegments(
            torch.cat([s.index + offset for s, offset in zip(segments, offsets, strict=True)]),
            torch.cat([s.label_mask for s in segments]),
            torch.cat([s.labelled_tokens for s in segments]),
            torch.cat([s.has_labels for s in segments]),
        )
        tokens = [p.new_logprobs for p in parts]
        fields = {name: cat([getattr(o, name) for o in outputs], tokens) for name in PolicyLossOutput._fields
                  if name not in ("loss", "segments")}
        return _MicroBatchInputs(
            outputs[0]._replace(segments=merged, **fields), torch.cat(tokens), torch.cat([p.old_logprobs for p in parts]),
            torch.cat([p.advantages for p in parts]), cat([p.reward for p in parts], tokens),
            cat([p.staleness for p in parts], tokens), cat([p.entropy for p in parts], tokens))


def _read(output: PolicyLossOutput, field: str) -> torch.Tensor:
    """``output.<field>``; raises ValueError when the loss did not compute it (a correction's metric is registered but
    the loss ran without that correction)."""
    value = getattr(output, field)
    if value is None:
        raise ValueError(f"the loss output has no {field!r}: run the loss with the corrections the metrics were built with")
    return value


def _check_update_inputs(n: int, **tensors: torch.Tensor | None) -> None:
    """Raises ValueError when a per-token input has not ``n`` elements, a bad ``model_version`` dtype, or both
    ``logits`` and ``entropy``."""
    for name, value in tensors.items():
        if name != "logits" and value is not None and value.numel() != n:
            raise ValueError(f"{name} has {value.numel()} elements, the micro-batch has {n} tokens")
    model_version = tensors["model_version"]
    if model_version is not None and (model_version.dtype.is_floating_point or model_version.dtype == torch.bool):
        raise ValueError(f"model_version must be an integer tensor, got dtype {model_version.dtype}")
    if tensors["logits"] is not None and tensors["entropy"] is not None:
        raise ValueError("pass either logits or entropy, not both")


def _staleness(documents_seen: int | torch.Tensor, model_version: torch.Tensor) -> torch.Tensor:
    """[T] float64 ``documents_seen - model_version`` on ``model_version``'s device, subtracted in int64 first: a
    float cast before it would round versions above 2**24 (float32) or 2**53 (float64)."""
    seen = torch.as_tensor(documents_seen, dtype=torch.int64, device=model_version.device)
    return (seen - model_version.reshape(-1).to(torch.int64)).to(torch.float64)


def _masked_extremes(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: (max, min) of ``values`` where ``mask``; (-inf, inf) when nothing is masked in."""
    return torch.stack([torch.where(mask, values, -torch.inf).amax(), torch.where(mask, values, torch.inf).amin()])
