"""What one optimizer step reports (:class:`StepRecord`): the progress report (:mod:`.progress_report`) and the
experiment trackers (:mod:`.trackers`) both take it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step reports.

    ``documents_seen``: documents that entered the loss since the job began, over all ranks (documents);
    ``model_version``: the version of the weights after this step (= documents_seen, DESIGN §6);
    ``tokens_per_second``: real (non-padding) tokens of the step over all ranks / its wall time;
    ``metrics``: the reduced loss metrics (DESIGN §4) plus ``loss``, ``grad_norm``, ``learning_rate`` and rank 0's
    wall-clock timings (milliseconds, :data:`~rljob_trainer.metrics_registry.TIMINGS`: ``weight_sync_time_ms``,
    ``step_time_ms`` and the step phases that partition it every step, the checkpoint timings in some records);
    ``stream``: the stream reader's counters summed over ranks (documents: redelivered, dead-lettered...);
    ``weight_sync_layout``: the layout the step's weight update went in (``packed`` or ``per-tensor``; None when it
    reached no receiver), the ``layout`` label of ``rljob_trainer_weight_sync_time_ms``.
    """

    step: int
    documents_seen: int
    model_version: int
    tokens_per_second: float
    metrics: dict[str, float] = field(default_factory=dict)
    stream: dict[str, int] = field(default_factory=dict)
    weight_sync_layout: Optional[str] = None
