"""The metrics registry: every value a trainer step reduces over the data-parallel ranks after the loss, with its
reduction and the level that logs it (DESIGN §4); the wall-clock timings a step record may carry; and the metrics
level.

:class:`~rljob_trainer.loss_metrics.StepMetrics` accumulates and reduces what is declared here; a new metric is a
:class:`MetricDef` in :data:`METRICS` (loss metrics, by level) or :data:`STEP_TOTALS` (every step, every level).
Units and weighting: :mod:`rljob_trainer.loss_metrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

from rljob_api import rules

if TYPE_CHECKING:
    from rljob_api.config import JobConfig
    from rljob_api.spec import RLTrainingJobSpec

MetricsLevel = Literal["none", "basic", "full"]
Reduction = Literal["sum", "max", "min"]


class MetricDef(NamedTuple):
    """One metric: its name, its cross-rank reduction, the lowest level that logs it (``always``: every level,
    ``none`` included), and its meaning."""

    name: str
    reduction: Reduction
    level: Literal["always", "basic", "full"]
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
"""Every loss metric, in the fixed order of registration and reduction."""

STEP_TOTALS: tuple[MetricDef, ...] = (
    MetricDef("loss", "sum", "always", "the step's loss: each micro-batch's loss (global normaliser), summed"),
    MetricDef("redeliveries", "sum", "always", "entries re-read from pending lists at start, all ranks (count)"),
    MetricDef("dropped_too_long", "sum", "always", "documents over microBatchTokens dropped, all ranks (count)"),
    MetricDef("dead_lettered", "sum", "always", "malformed entries dead-lettered, all ranks (count)"),
    MetricDef("lost_pending", "sum", "always", "pending entries deleted from the stream before re-reading (count)"),
)
"""The totals every step reduces whatever the level, passed to :meth:`StepMetrics.reduce`: the loss (logged with
the metrics) and the readers' counters since this attempt started (logged as ``stream``)."""

STREAM_COUNTERS: tuple[str, ...] = tuple(m.name for m in STEP_TOTALS if m.name != "loss")
"""The reader counters among :data:`STEP_TOTALS` (:class:`~rljob_trainer.stream.reader.ReaderCounters` fields)."""

class TimingDef(NamedTuple):
    """A wall-clock duration in a step record's ``metrics``: measured by global rank 0, not reduced over ranks, not
    reproducible between runs (compare metrics across runs without :data:`TIMINGS`). Present only in the records
    its ``when`` names."""

    name: str
    when: str
    description: str


CHECKPOINT_BLOCKING = "checkpoint_blocking_time_ms"
CHECKPOINT_SAVE = "checkpoint_save_time_ms"
TIMINGS: tuple[TimingDef, ...] = (
    TimingDef(CHECKPOINT_BLOCKING, "the steps that checkpoint",
              "milliseconds the training loop stood still for the step's checkpoint: waiting for the previous save, a "
              "barrier, the snapshot of model and optimizer state to host memory, the RNG files, the gather of covered "
              "entry ids and the start of the background write"),
    TimingDef(CHECKPOINT_SAVE, "the first step reported after a checkpoint's commit (the last step for the final one)",
              "milliseconds from the start of a checkpoint's snapshot to the end of its commit: every rank's files "
              "durable, commit file written, checkpoint_documents_seen published, covered entries acked"),
)
"""Every timing a step record may carry, by name."""

COUNT_METRICS: tuple[str, ...] = ("num_tokens",)
"""Sum metrics reported as totals; every other sum metric is divided by the step's document count."""


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
