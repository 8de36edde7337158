"""Loss metrics of one optimizer step, reduced over the data-parallel ranks (DESIGN §4).

Levels: ``none``; ``basic``, every metric below but ``entropy``; ``full``, basic plus ``entropy`` (a second
pass over the vocabulary); ``auto``, basic when pipeline_parallel = 1 else none. Names follow Fast-LLM's
policy-gradient metrics (``fast_llm/layers/language_model/loss/``) and its PR #562 (reward, staleness).

Units and weighting:

- Means are document-weighted: a labelled token of document d weighs 1 / (labelled tokens of d), so each
  document counts once. Sums accumulate over all micro-batches of the step on every rank and are divided by
  the step's global document count (documents with at least one labelled token) after the all-reduce.
- ``max_*`` / ``min_*`` run over labelled tokens (advantage, staleness) or documents (reward).
- ``num_tokens`` is the step's labelled-token count over all ranks.
- GRPO's ratio metrics are token-level; GSPO's use the sequence ratio R_d (as Fast-LLM logs them).
- ``train_samples_reward`` averages the raw reward over the documents that reached the loss, i.e. over the
  sample-filtered training batch (zero-variance groups dropped, stale or malformed entries dead-lettered):
  it is biased and is *not* a policy-performance metric. The rollout reward (everything generated per model
  version, before filtering) is the one that measures the policy.
- ``staleness`` = documents_seen (at the start of the step) - model_version, in documents, subtracted in
  int64 and only then cast to float64, so counts above 2**24 keep their exact difference.

Every rank builds the same metric list in the same order (it depends on the level only, which comes from the
one resolved config), and :meth:`StepMetrics.reduce` calls exactly three all-reduces (sum, max, min) on every
rank, whatever the rank saw. Missing inputs (a micro-batch without ``reward`` or ``model_version`` while
metrics are on) are counted per rank inside the sum all-reduce, so every rank raises the same
:class:`MetricsInputError` instead of some ranks hanging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
import torch.distributed as dist

from rljob_api import rules
from rljob_trainer.loss import document_means, segment_documents

if TYPE_CHECKING:
    from rljob_api.config import JobConfig
    from rljob_api.spec import RLTrainingJobSpec

MetricsLevel = Literal["none", "basic", "full"]
Reduction = Literal["sum", "max", "min"]


class MetricDef(NamedTuple):
    """One metric: its name, its cross-rank reduction, the lowest level that logs it, and its meaning."""

    name: str
    reduction: Reduction
    level: Literal["basic", "full"]
    description: str


METRICS: tuple[MetricDef, ...] = (
    MetricDef("new_logprobs", "sum", "basic", "mean log-probability of labelled tokens, trained policy"),
    MetricDef("old_logprobs", "sum", "basic", "mean log-probability of labelled tokens, sampling policy"),
    MetricDef("ratio_new_old", "sum", "basic", "mean importance ratio r (GSPO: sequence ratio R_d)"),
    MetricDef("kl_new_old", "sum", "basic", "mean of r - log r - 1 (Schulman's k3 estimate of KL(old||new))"),
    MetricDef("clipped_ratio_fraction", "sum", "basic", "mean of [r outside 1-epsilon_low, 1+epsilon_high]"),
    MetricDef("advantage", "sum", "basic", "mean advantage"),
    MetricDef("max_advantage", "max", "basic", "largest advantage of a labelled token"),
    MetricDef("min_advantage", "min", "basic", "smallest advantage of a labelled token"),
    MetricDef("num_tokens", "sum", "basic", "labelled tokens in the step, all ranks (a count)"),
    MetricDef("entropy", "sum", "full", "mean entropy (nats) of the temperature-scaled token distribution"),
    MetricDef("train_samples_reward", "sum", "basic", "mean raw reward over the step's documents (biased)"),
    MetricDef("max_train_samples_reward", "max", "basic", "largest document reward"),
    MetricDef("min_train_samples_reward", "min", "basic", "smallest document reward"),
    MetricDef("staleness", "sum", "basic", "mean documents_seen - model_version (documents)"),
    MetricDef("max_staleness", "max", "basic", "largest staleness of a labelled token (documents)"),
    MetricDef("min_staleness", "min", "basic", "smallest staleness of a labelled token (documents)"),
)
"""Every metric, in the fixed order of registration and reduction."""

_COUNTS = ("num_tokens",)
"""Sum metrics reported as totals; every other sum metric is divided by the step's document count."""


class MetricsInputError(RuntimeError):
    """Metrics are on but some micro-batch of the step lacked an input; raised identically on every rank.

    ``missing`` maps each input name to the ranks (of the reduction group) that lacked it.
    """

    def __init__(self, message: str, missing: dict[str, list[int]]):
        super().__init__(message)
        self.missing = missing


def resolve_metrics_level(level: str, pipeline_parallel: int) -> MetricsLevel:
    """The effective level: ``auto`` becomes ``basic`` when ``pipeline_parallel == 1``, else ``none``.

    Raises:
        ValueError: an unknown level, or ``basic``/``full`` with ``pipeline_parallel != 1`` (the metrics need
            the whole vocabulary on one stage; admission rejects it too).
    """
    if level == "auto":
        return "basic" if pipeline_parallel == 1 else "none"
    if level not in ("none", "basic", "full"):
        raise ValueError(f"spec.algorithm.metrics must be one of none, basic, full, auto; got {level!r}")
    if not rules.metrics_allowed(level, pipeline_parallel):
        raise ValueError(
            f"spec.algorithm.metrics={level} requires spec.trainer.pipelineParallel == 1, got {pipeline_parallel}"
        )
    return level  # type: ignore[return-value]


def metrics_level(config: JobConfig | RLTrainingJobSpec) -> MetricsLevel:
    """The effective metrics level of a resolved job config (or a spec). Raises as :func:`resolve_metrics_level`."""
    spec = getattr(config, "spec", config)
    return resolve_metrics_level(spec.algorithm.metrics, spec.trainer.pipeline_parallel)


def metric_definitions(level: MetricsLevel) -> tuple[MetricDef, ...]:
    """The metrics a level logs, in registration order: none → (), basic → all but entropy, full → all.

    Raises:
        ValueError: an unresolved or unknown level.
    """
    if level == "none":
        return ()
    if level == "basic":
        return tuple(m for m in METRICS if m.level == "basic")
    if level == "full":
        return METRICS
    raise ValueError(f"metrics level must be none, basic or full (resolve 'auto' first), got {level!r}")


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


class StepMetrics:
    """Accumulates the loss metrics of one optimizer step and reduces them over data-parallel ranks.

    Use: for each micro-batch, :meth:`update`; after the step, :meth:`reduce` on every rank (it resets the
    accumulator). With level ``none`` both are no-ops and :meth:`reduce` returns ``{}`` without collectives.

    Args:
        level: a resolved level (``none``, ``basic``, ``full``); see :func:`metrics_level`.
        loss: ``grpo`` (token-level ratio metrics) or ``gspo`` (sequence ratio R_d).
        epsilon_low, epsilon_high: the loss's clip range, for ``clipped_ratio_fraction``.
        temperature: the sampling temperature, for ``entropy`` from logits.
        device: where the accumulators live; must suit the reduction group's backend (CPU for gloo, CUDA
            for NCCL).

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
    ):
        self.definitions = metric_definitions(level)
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
        self.device = torch.device(device or "cpu")
        self._mean_names = [m.name for m in self.definitions if m.reduction == "sum" and m.name not in _COUNTS]
        self._count_names = [m.name for m in self.definitions if m.name in _COUNTS]
        self._max_names = [m.name for m in self.definitions if m.reduction == "max"]
        self._min_names = [m.name for m in self.definitions if m.reduction == "min"]
        self._required = _REQUIRED_INPUTS if level == "full" else _REQUIRED_INPUTS[:2]
        self.reset()

    @classmethod
    def from_config(cls, config: JobConfig, device: str | torch.device | None = None) -> StepMetrics:
        """The accumulator a trainer rank builds from the resolved job config (level, loss, clip, temperature)."""
        algorithm = config.spec.algorithm
        epsilon_low, epsilon_high = algorithm.resolved_epsilons()
        return cls(
            metrics_level(config),
            loss=algorithm.loss,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            temperature=config.spec.rollout.sampling.temperature,
            device=device,
        )

    @property
    def enabled(self) -> bool:
        return self.level != "none"

    def reset(self) -> None:
        """Forget everything accumulated since the last :meth:`reduce`."""
        f64 = {"dtype": torch.float64, "device": self.device}
        # Sums: the mean metrics, then the count metrics, then the step's document count.
        self._sums = torch.zeros(len(self._mean_names) + len(self._count_names) + 1, **f64)
        self._maxes = torch.full((len(self._max_names),), -torch.inf, **f64)
        self._mins = torch.full((len(self._min_names),), torch.inf, **f64)
        self._missing = {name: 0 for name in self._required}

    @torch.no_grad()
    def update(
        self,
        *,
        new_logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        label_mask: torch.Tensor,
        document_index: torch.Tensor,
        documents_seen: int | torch.Tensor,
        reward: torch.Tensor | None = None,
        model_version: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> None:
        """Add one micro-batch (T tokens) to the step's metrics. Never raises for a missing input.

        Args:
            new_logprobs, old_logprobs, advantages: [T] float, as for the loss (``new_logprobs`` is detached).
            label_mask: [T] bool. document_index: [T] integer, 0-based document id per token.
            documents_seen: documents trained before this step (int or int64 scalar tensor).
            reward: [T] float, the document's raw reward broadcast to its tokens.
            model_version: [T] integer, the weights version (documents seen) each token was sampled with.
            logits: [T, V] or [B, L, V], row t scoring token t (full level; see :func:`token_entropy`).
            entropy: [T] float, precomputed token entropy (full level), instead of ``logits``.

        A missing ``reward`` / ``model_version`` (or, at full level, both ``logits`` and ``entropy``) is
        counted and reported by :meth:`reduce` on every rank.

        Raises:
            ValueError: shapes or dtypes that do not match (a programming error, not a data error).
        """
        if not self.enabled:
            return
        segments = segment_documents(label_mask, document_index)
        mask = segments.label_mask
        n = mask.shape[0]
        for name, value in (
            ("new_logprobs", new_logprobs),
            ("old_logprobs", old_logprobs),
            ("advantages", advantages),
            ("reward", reward),
            ("model_version", model_version),
            ("entropy", entropy),
        ):
            if value is not None and value.numel() != n:
                raise ValueError(f"{name} has {value.numel()} elements, label_mask has {n}")
        if model_version is not None and (model_version.dtype.is_floating_point or model_version.dtype == torch.bool):
            raise ValueError(f"model_version must be an integer tensor, got dtype {model_version.dtype}")
        if logits is not None and entropy is not None:
            raise ValueError("pass either logits or entropy, not both")

        present = {
            "reward": reward is not None,
            "model_version": model_version is not None,
            "logits or entropy": logits is not None or entropy is not None,
        }
        for name in self._required:
            self._missing[name] += not present[name]
        if n == 0:
            return

        f64 = torch.float64
        new_lp = new_logprobs.detach().reshape(-1).to(f64)
        old_lp = old_logprobs.reshape(-1).to(f64)
        adv = advantages.reshape(-1).to(f64)
        log_ratio = torch.where(mask, new_lp - old_lp, 0.0)
        if self.loss == "gspo":
            log_ratio = document_means(log_ratio, segments)[segments.index]
        ratio = log_ratio.exp()
        clipped = (ratio < 1.0 - self.epsilon_low) | (ratio > 1.0 + self.epsilon_high)
        zeros = torch.zeros_like(new_lp)
        if model_version is not None:
            # int64 subtraction first: a float cast before it would round versions above 2**24 (float32).
            seen = torch.as_tensor(documents_seen, dtype=torch.int64, device=model_version.device)
            staleness = (seen - model_version.reshape(-1).to(torch.int64)).to(f64).to(new_lp.device)
        else:
            staleness = zeros
        per_token = {
            "new_logprobs": new_lp,
            "old_logprobs": old_lp,
            "ratio_new_old": ratio,
            "kl_new_old": ratio - log_ratio - 1.0,
            "clipped_ratio_fraction": clipped.to(f64),
            "advantage": adv,
            "train_samples_reward": zeros if reward is None else reward.reshape(-1).to(f64),
            "staleness": staleness,
        }
        if self.level == "full":
            if entropy is None and logits is not None:
                entropy = token_entropy(logits, temperature=self.temperature, label_mask=mask)
            per_token["entropy"] = zeros if entropy is None else entropy.reshape(-1).to(f64)
        doc_means = document_means(torch.stack([per_token[name] for name in self._mean_names], 1), segments)
        counts = torch.stack([mask.sum(), segments.num_documents]).to(f64)
        self._sums += torch.cat([doc_means.sum(0), counts]).to(self.device)

        reward_by_doc = doc_means[:, self._mean_names.index("train_samples_reward")]
        unseen = torch.tensor([-torch.inf, torch.inf], dtype=f64, device=new_lp.device)
        extremes = {  # source metric -> [max, min]
            "advantage": _masked_extremes(adv, mask),
            "train_samples_reward": unseen if reward is None else _masked_extremes(reward_by_doc, segments.has_labels),
            "staleness": unseen if model_version is None else _masked_extremes(staleness, mask),
        }
        maxes = torch.stack([extremes[name.removeprefix("max_")][0] for name in self._max_names])
        mins = torch.stack([extremes[name.removeprefix("min_")][1] for name in self._min_names])
        self._maxes = torch.maximum(self._maxes, maxes.to(self.device))
        self._mins = torch.minimum(self._mins, mins.to(self.device))

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Reduce the step's metrics over ``group`` (default: the world, when torch.distributed is initialised).

        Calls exactly three all-reduces (sum, max, min) on every rank when enabled, none when level is
        ``none``; resets the accumulator.

        Returns:
            {metric name: value} in registration order, identical on every rank. Means are NaN when the step
            had no document, extremes NaN when nothing was seen.

        Raises:
            MetricsInputError: some rank lacked an input in some micro-batch; every rank of the group raises
                it with the same message (after the sum all-reduce, before the other two).
        """
        if not self.enabled:
            return {}
        distributed = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(group), dist.get_rank(group)) if distributed else (1, 0)
        missing = torch.zeros(len(self._required), world, dtype=torch.float64, device=self.device)
        missing[:, rank] = torch.tensor([float(self._missing[name]) for name in self._required], dtype=torch.float64)
        sums = torch.cat([self._sums, missing.reshape(-1)])
        maxes, mins = self._maxes.clone(), self._mins.clone()
        self.reset()

        if distributed:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        self._raise_if_missing(sums[-missing.numel() :].reshape(missing.shape))
        if distributed:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)

        values = torch.cat([sums[: -missing.numel()], maxes, mins]).tolist()
        k = len(self._mean_names)
        documents = values[k + len(self._count_names)]
        reduced: dict[str, float] = {}
        for name, value in zip(self._mean_names, values[:k]):
            reduced[name] = value / documents if documents > 0 else float("nan")
        reduced.update(zip(self._count_names, values[k : k + len(self._count_names)]))
        extremes = values[k + len(self._count_names) + 1 :]
        for name, value in zip(self._max_names + self._min_names, extremes):
            reduced[name] = value if abs(value) != float("inf") else float("nan")
        return {m.name: reduced[m.name] for m in self.definitions}

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


def _masked_extremes(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: (max, min) of ``values`` where ``mask``; (-inf, inf) when nothing is masked in."""
    return torch.stack([torch.where(mask, values, -torch.inf).amax(), torch.where(mask, values, torch.inf).amin()])
