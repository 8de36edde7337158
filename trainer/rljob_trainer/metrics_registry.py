"""The metrics registry: every value a trainer step reduces over the data-parallel ranks after the loss, with its
reduction and the level that logs it (DESIGN §4); the wall-clock timings a step record may carry; and the metrics
level.

:class:`~rljob_trainer.loss_metrics.StepMetrics` accumulates and reduces what is declared here; a new metric is a
:class:`MetricDef` in :data:`METRICS` (loss metrics, by level) or :data:`STEP_TOTALS` (every step, every level); a new
timing (global rank 0's wall clock, not reduced) is a :class:`TimingDef` in :data:`TIMINGS`. Units and weighting:
:mod:`rljob_trainer.loss_metrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

from rljob_api import protocol, rules
from rljob_wire.codec import MalformedKind

if TYPE_CHECKING:
    from rljob_api.config import JobConfig
    from rljob_api.spec import RLTrainingJobSpec

MetricsLevel = Literal["none", "basic", "full"]
Reduction = Literal["sum", "max", "min"]


class MetricDef(NamedTuple):
    """One metric: its name, its cross-rank reduction, the lowest level that logs it (``always``: every level,
    ``none`` included), and its meaning.

    ``needs``: the loss correction it describes (a :attr:`rljob_trainer.loss.Corrections.terms` name:
    ``dual_clip``, ``importance_sampling``, ``kl``), registered only when that correction is on; empty: always.
    ``per`` (sum metrics): what the step's sum is divided by: ``document``, the step's documents (a
    document-weighted mean); ``total``, nothing (a count over labelled tokens); or the name of a ``total`` metric,
    a token mean over the tokens that metric counts.
    """

    name: str
    reduction: Reduction
    level: Literal["always", "basic", "full"]
    description: str
    needs: str = ""
    per: str = "document"


METRICS: tuple[MetricDef, ...] = (
    MetricDef("new_logprobs", "sum", "basic", "mean log-probability of labelled tokens, trained policy"),
    MetricDef("old_logprobs", "sum", "basic", "mean log-probability of labelled tokens, sampling policy"),
    MetricDef("ratio_new_old", "sum", "basic", "mean importance ratio r (GSPO: sequence ratio R_d)"),
    MetricDef("kl_new_old", "sum", "basic", "mean of r - log r - 1 (Schulman's k3 estimate of KL(old||new))"),
    MetricDef("clipped_ratio_fraction", "sum", "basic", "mean of [r outside 1-epsilon_low, 1+epsilon_high]"),
    MetricDef("advantage", "sum", "basic", "mean advantage"),
    MetricDef("max_advantage", "max", "basic", "largest advantage of a labelled token"),
    MetricDef("min_advantage", "min", "basic", "smallest advantage of a labelled token"),
    MetricDef("num_tokens", "sum", "basic", "labelled tokens in the step, all ranks (a count)", per="total"),
    MetricDef("entropy", "sum", "full", "mean entropy (nats) of the temperature-scaled token distribution"),
    MetricDef("train_samples_reward", "sum", "basic", "mean raw reward over the step's documents (biased)"),
    MetricDef("max_train_samples_reward", "max", "basic", "largest document reward"),
    MetricDef("min_train_samples_reward", "min", "basic", "smallest document reward"),
    MetricDef("staleness", "sum", "basic", "mean documents_seen - model_version (documents)"),
    MetricDef("max_staleness", "max", "basic", "largest staleness of a labelled token (documents)"),
    MetricDef("min_staleness", "min", "basic", "smallest staleness of a labelled token (documents)"),
    MetricDef("sampler_mismatch_tokens", "sum", "basic", "labelled tokens sampled with the trainer's current weights "
              "(model_version == documents_seen), all ranks (a count)", per="total"),
    MetricDef("sampler_mismatch_ratio", "sum", "basic", "mean of exp(lp_new - lp_old) over those tokens: the sampler's "
              "and the trainer's numerical mismatch on the same weights (1 when they agree; NaN without such tokens)",
              per="sampler_mismatch_tokens"),
    MetricDef("sampler_mismatch_kl", "sum", "basic", "mean of r - log r - 1 over those tokens (k3 estimate of "
              "KL(sampler||trainer); 0 when they agree)", per="sampler_mismatch_tokens"),
    MetricDef("dual_clip_fraction", "sum", "basic", "mean of [the dual clip's bound dualClip x A replaced the "
              "surrogate] (A < 0 and ratio > dualClip)", needs="dual_clip"),
    MetricDef("behaviour_weight", "sum", "basic", "mean behaviour weight min(pi_prox / pi_behaviour, cap) the loss "
              "applied", needs="importance_sampling"),
    MetricDef("max_behaviour_weight", "max", "basic", "largest behaviour weight pi_prox / pi_behaviour of a labelled "
              "token, before truncation", needs="importance_sampling"),
    MetricDef("behaviour_weight_truncated_fraction", "sum", "basic", "mean of [pi_prox / pi_behaviour > cap]",
              needs="importance_sampling"),
    MetricDef("kl_ref", "sum", "basic", "mean KL estimate to the reference policy (the loss's k1 or k3, nats)",
              needs="kl"),
)
"""Every loss metric, in the fixed order of registration and reduction."""

DEAD_LETTERED_PREFIX = protocol.STREAM_DEAD_LETTERED_PREFIX
"""Step totals ``dead_lettered.<kind>``: the dead-lettered entries by :class:`~rljob_wire.codec.MalformedKind` (a
step record's ``stream`` keeps only the kinds seen; the operator sums them into status.documentTotals)."""

STEP_TOTALS: tuple[MetricDef, ...] = (
    MetricDef("loss", "sum", "always", "the step's loss: each micro-batch's loss (global normaliser), summed"),
    MetricDef("redeliveries", "sum", "always", "entries re-read from pending lists at start, all ranks (count)"),
    MetricDef("dropped_too_long", "sum", "always", "documents over microBatchTokens dropped, all ranks (count)"),
    MetricDef("dead_lettered", "sum", "always", "malformed entries dead-lettered, all ranks (count)"),
    MetricDef("lost_pending", "sum", "always", "pending entries deleted from the stream before re-reading (count)"),
    MetricDef("dropped_stale", "sum", "always", "documents staler than algorithm.maxStaleness dropped before the loss, "
              "all ranks (count; acked with the next checkpoint)"),
    *(MetricDef(f"{DEAD_LETTERED_PREFIX}{kind.value}", "sum", "always",
                f"of dead_lettered, the entries of kind {kind.value}, all ranks (count)") for kind in MalformedKind),
)
"""The totals every step reduces whatever the level, passed to :meth:`StepMetrics.reduce`: the loss (logged with
the metrics) and the readers' counters since this attempt started (logged as ``stream``)."""

STREAM_COUNTERS: tuple[str, ...] = tuple(m.name for m in STEP_TOTALS if m.name != "loss")
"""The reader counters among :data:`STEP_TOTALS` (:class:`~rljob_trainer.stream.reader.ReaderCounters` fields)."""

class TimingDef(NamedTuple):
    """A wall-clock figure in a step record's ``metrics`` (a duration in milliseconds, or a share of wall time):
    measured by global rank 0, not reduced over ranks, not reproducible between runs (compare metrics across runs
    without :data:`TIMINGS`). Present only in the records its ``when`` names."""

    name: str
    when: str
    description: str


CHECKPOINT_BLOCKING = "checkpoint_blocking_time_ms"
CHECKPOINT_SAVE = "checkpoint_save_time_ms"
WEIGHT_SYNC = "weight_sync_time_ms"
STEP_TIME = "step_time_ms"
DATA_WAIT = "data_wait_time_ms"
DECODE = "decode_time_ms"
PACK = "pack_time_ms"
FORWARD_BACKWARD = "forward_backward_time_ms"
METRICS_UPDATE = "metrics_time_ms"
COLLECTIVES = "collectives_time_ms"
OPTIMIZER = "optimizer_time_ms"
WEIGHT_SYNC_WAIT = "weight_sync_wait_time_ms"
WEIGHT_SYNC_OVERLAPPED = "weight_sync_overlapped_time_ms"
STEP_OTHER = "step_other_time_ms"
DATA_WAIT_SHARE = "data_wait_share"
_HOST_CLOCK = ("; global rank 0's time.perf_counter, no device synchronisation added: on a GPU a phase ends when the "
               "host has queued its work, and device work still queued is counted in the next phase that waits for it")
TIMINGS: tuple[TimingDef, ...] = (
    TimingDef(WEIGHT_SYNC, "every step",
              "milliseconds the step spent on its weight publication on global rank 0, named as Fast-LLM logs it. "
              "Within the step (sharded parameters, or a GPU): the whole publication, the weights_ready event, the "
              "join, the gathers of sharded parameters, the sends to the rollout and the late-joiner copy of gathered "
              "or cast tensors (rljob_trainer.weight_publisher.publish_weights; a DDP model's own tensors are copied "
              "afterwards on a thread, waited for before the next optimizer step). Beside the next step (an "
              "unsharded model on CPU, Trainer.overlaps_publication): its start only; the publication's own wall time "
              "is weight_sync_overlapped_time_ms"),
    TimingDef(WEIGHT_SYNC_OVERLAPPED, "every step whose publication ran beside the next step (and did not fail)",
              "milliseconds of the step's weight publication on global rank 0 from its start to its end, on the "
              "publisher's thread while the next step reads and computes (what weight_sync_time_ms covers within "
              "the step); the next step's weight_sync_wait_time_ms is the part it did not hide. The record is "
              "reported once the publication ended"),
    TimingDef(STEP_TIME, "every step",
              "milliseconds of Trainer.train_step on global rank 0, from the start of the read to the end of the weight "
              "publication (to its start when it runs beside the next step); the step phases (STEP_PHASES) partition it. The checkpoint of the step and its report "
              "come after it"),
    TimingDef(DATA_WAIT, "every step",
              "milliseconds in StreamReader.next_documents less its decoding: the XREADGROUP replies awaited (the "
              "step's own read was sent during the previous step, StreamReader.prefetch), staleness drops, dead "
              "letters" + _HOST_CLOCK),
    TimingDef(DECODE, "every step",
              "milliseconds of decoding the step's stream entries into documents (rljob_wire.codec.decode_columns, "
              "inside the reader)" + _HOST_CLOCK),
    TimingDef(PACK, "every step",
              "milliseconds of packing the documents into micro-batches (pack_columns), their copy to the device and "
              "the segmentation of each (segment_documents, which waits for the device once per micro-batch)"
              + _HOST_CLOCK),
    TimingDef(FORWARD_BACKWARD, "every step",
              "milliseconds of the micro-batch loop less the metrics updates: the reference policy's forward (KL), the "
              "forward, log-probabilities, the loss, the backward with the gradient collectives it runs (DDP's "
              "all-reduce in the last backward, FSDP's all-gathers and reduce-scatters: not separable without "
              "synchronising the device)" + _HOST_CLOCK),
    TimingDef(METRICS_UPDATE, "every step",
              "milliseconds of StepMetrics.update in every micro-batch (with the entropy at level full) and of the "
              "step's metrics computed from them at once (StepMetrics.fold); 0 at level none. Their cross-rank "
              "reduction is in collectives_time_ms" + _HOST_CLOCK),
    TimingDef(COLLECTIVES, "every step",
              "milliseconds of the step's collectives outside the backward: their start and the wait for their "
              "result, each started asynchronously (parallel.start_reduce_small) so that it travels while the rank "
              "computes. The counts' sum that gives the loss its global normaliser (started after the packing, "
              "waited for in the first micro-batch's loss, or before its forward under FSDP; then the next step's "
              "read is sent) and "
              "StepMetrics.start_reduce (the sums and, with metrics on, the maxima: one all-gather up to 16 ranks; "
              "started after the backward, waited for after the gradient clip); none at one rank. On a GPU the wait "
              "for the metrics is where the host first waits for the backward" + _HOST_CLOCK),
    TimingDef(OPTIMIZER, "every step",
              "milliseconds of the gradient clip (its norm: an all-reduce under FSDP, read on the host), the learning "
              "rate, AdamW's step and zero_grad" + _HOST_CLOCK),
    TimingDef(WEIGHT_SYNC_WAIT, "every step",
              "milliseconds the optimizer step waited for the previous step's publication when it runs beside this "
              "step, and for its late-joiner copy (background threads still reading the weights: "
              "WeightPublisher.settle)"),
    TimingDef(STEP_OTHER, "every step",
              "step_time_ms less every step phase: the loop's own bookkeeping (stream counters, the record)"),
    TimingDef(DATA_WAIT_SHARE, "every step",
              "the share of the last 30 s (rljob_trainer.data_wait.DataWaitWindow) global rank 0 spent waiting for "
              "documents: data_wait_time_ms over the wall time from step start to step start, 0..1; what rollouts "
              "that do not keep up cost the trainer, the autoscaling signal (DESIGN §6 'Capacity signals')"),
    TimingDef(CHECKPOINT_BLOCKING, "the steps that checkpoint",
              "milliseconds the training loop stood still for the step's checkpoint: waiting for the previous save, a "
              "barrier, the snapshot of model and optimizer state to host memory, the RNG files, the gather of covered "
              "entry ids and the start of the background write (on CPU, a small sharded state's whole write: "
              "checkpoint.WAITED_WRITE_MAX_BYTES)"),
    TimingDef(CHECKPOINT_SAVE, "the first step reported after a checkpoint's commit (the last step for the final one)",
              "milliseconds from the start of a checkpoint's snapshot to the end of its commit: every rank's files "
              "durable, commit file written, checkpoint_documents_seen published, covered entries acked"),
)
"""Every timing a step record may carry, by name."""

STEP_PHASES: tuple[str, ...] = (DATA_WAIT, DECODE, PACK, FORWARD_BACKWARD, METRICS_UPDATE, COLLECTIVES, OPTIMIZER,
                                WEIGHT_SYNC_WAIT, WEIGHT_SYNC, STEP_OTHER)
"""The timings that partition :data:`STEP_TIME` (milliseconds, in the order of the step; they add up to it)."""

GRAD_NORM = "grad_norm"
LEARNING_RATE = "learning_rate"


class ScalarDef(NamedTuple):
    """A value of every step record's ``metrics`` that is neither a loss metric nor a timing."""

    name: str
    description: str


OPTIMIZER_SCALARS: tuple[ScalarDef, ...] = (
    ScalarDef(GRAD_NORM, "total gradient norm before clipping (optimizer.gradClip), all parameters"),
    ScalarDef(LEARNING_RATE, "the learning rate of the step's AdamW update (warm-up, then the schedule)"),
)
"""The optimizer's scalars in every step record (global, not reduced: every rank computes the same value)."""


def record_metric_names() -> frozenset[str]:
    """Every name a step record's ``metrics`` may carry (:class:`~rljob_trainer.progress_report.StepRecord`, the Prometheus
    gauge ``rljob_trainer_metric{name}``, the trackers' ``train/<name>``): the loss metrics of every level and
    correction, ``loss``, the optimizer's scalars and the timings. Stream counters are the record's ``stream``."""
    return frozenset((*(m.name for m in METRICS), "loss", *(m.name for m in OPTIMIZER_SCALARS),
                      *(t.name for t in TIMINGS)))


COUNT_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.per == "total")
"""Sum metrics reported as totals (``per="total"``); the others are divided by the step's document count or by one of
these."""


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


def metric_definitions(level: MetricsLevel, terms: frozenset[str] = frozenset()) -> tuple[MetricDef, ...]:
    """The metrics a level logs, in registration order: none → (), basic → all but entropy, full → all; of those
    describing a loss correction (``needs``), only the ones whose correction is in ``terms``
    (:attr:`rljob_trainer.loss.Corrections.terms`). Every rank reads both from the one resolved config.

    Raises:
        ValueError: an unresolved or unknown level.
    """
    if level not in ("none", "basic", "full"):
        raise ValueError(f"metrics level must be none, basic or full (resolve 'auto' first), got {level!r}")
    levels = {"none": (), "basic": ("basic",), "full": ("basic", "full")}[level]
    return tuple(m for m in METRICS if m.level in levels and (not m.needs or m.needs in terms))
