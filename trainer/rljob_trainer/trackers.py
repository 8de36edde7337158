"""Experiment trackers of global rank 0: every step's metrics to TensorBoard event files (``spec.trainer.tensorboard``),
Weights & Biases (env ``WANDB_API_KEY``) and MLflow (env ``MLFLOW_TRACKING_URI``).

Each is off unless configured and none is required: W&B and MLflow are imported only when their env is set, and an
image without the package (they are installed in the GPU trainer image only) logs one warning saying so and trains on.
Every tracker runs on one background thread (:class:`Trackers`), fed by a bounded queue, so a slow disk or tracking
server never holds the training loop: a full queue drops records (counted in a warning), a tracker that fails to start
is left out, and a failed log is retried with the next step.

What is logged, at global step = the optimizer step (:func:`step_scalars`): ``train/<name>`` for every value of the
record's metrics (:func:`rljob_trainer.metrics_registry.record_metric_names`), ``stream/<counter>`` for the reader
counters and ``progress/{tokens_per_second,documents_seen,model_version}``.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, Optional, Protocol

from rljob_api.config import JobConfig
from rljob_trainer.step_record import StepRecord

log = logging.getLogger(__name__)

ENV_WANDB = "WANDB_API_KEY"
ENV_WANDB_PROJECT = "WANDB_PROJECT"
ENV_MLFLOW = "MLFLOW_TRACKING_URI"
ENV_MLFLOW_EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"
ENV_MLFLOW_EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
DEFAULT_WANDB_PROJECT = "rljob"
QUEUE_RECORDS = 1024
"""Step records waiting for the trackers' thread at most; more are dropped (and counted)."""
CLOSE_TIMEOUT_S = 120.0
"""Seconds :meth:`Trackers.close` waits for the queued records to be logged."""


def step_scalars(record: StepRecord) -> dict[str, float]:
    """The scalars every tracker logs for ``record``, by tag (module docstring). Values are floats (NaN kept)."""
    return {
        **{f"train/{name}": float(value) for name, value in record.metrics.items()},
        **{f"stream/{name}": float(value) for name, value in record.stream.items()},
        "progress/tokens_per_second": float(record.tokens_per_second),
        "progress/documents_seen": float(record.documents_seen),
        "progress/model_version": float(record.model_version),
    }


def run_name(config: JobConfig, attempt: Optional[int]) -> str:
    """``<job>-attempt-<n>`` (``<job>`` outside the operator): one tracker run per gang attempt."""
    return config.name if attempt is None else f"{config.name}-attempt-{attempt}"


def run_tags(config: JobConfig, attempt: Optional[int]) -> dict[str, str]:
    """The tags of a tracker run: ``rljob.job``, ``rljob.namespace`` and ``rljob.attempt`` ("None" outside the
    operator)."""
    return {"rljob.job": config.name, "rljob.namespace": config.namespace, "rljob.attempt": str(attempt)}


class Tracker(Protocol):
    """One destination of the step scalars; called on the trackers' thread only."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in ``log_dir`` (torch.utils.tensorboard's ``SummaryWriter``), flushed after every step.

    The writer opens at the first step logged, with ``purge_step`` = that step: TensorBoard then hides what an
    earlier attempt logged at and after it (the steps a resume from an older checkpoint trains again).
    """

    def __init__(self, writer_class: Any, log_dir: str) -> None:
        self._writer_class = writer_class
        self._log_dir = log_dir
        self._writer: Any = None

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            self._writer = self._writer_class(log_dir=self._log_dir, purge_step=step)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbTracker:
    """A Weights & Biases run per gang attempt: project env ``WANDB_PROJECT`` (default ``rljob``), name
    :func:`run_name`, group ``<namespace>/<job>``, tags ``rljob.job:<job>``, ``rljob.namespace:<namespace>`` and
    ``rljob.attempt:<n>`` (MLflow's tags as W&B's plain strings), the job's spec as its config. The key and everything
    else W&B reads from its own env (``WANDB_API_KEY``, ``WANDB_ENTITY``, ``WANDB_BASE_URL``, ``WANDB_MODE``...)."""

    def __init__(self, wandb: Any, config: JobConfig, attempt: Optional[int], environ: Mapping[str, str]) -> None:
        self._run = wandb.init(
            project=environ.get(ENV_WANDB_PROJECT) or DEFAULT_WANDB_PROJECT,
            name=run_name(config, attempt),
            group=f"{config.namespace}/{config.name}",
            job_type="train",
            tags=[f"{key}:{value}" for key, value in run_tags(config, attempt).items()],
            config=config.spec.model_dump(mode="json", by_alias=True),
        )

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run per gang attempt, named :func:`run_name`, in the experiment env ``MLFLOW_EXPERIMENT_ID`` or
    ``MLFLOW_EXPERIMENT_NAME`` names (made when missing), else ``rljob-<namespace>-<job>``; tags ``rljob.job``,
    ``rljob.namespace`` and ``rljob.attempt``. Metrics go in one ``log_batch`` per step; the run ends FINISHED at
    :meth:`close`. Uses an explicit ``MlflowClient``, not MLflow's per-thread active run."""

    def __init__(self, mlflow: Any, config: JobConfig, attempt: Optional[int], environ: Mapping[str, str]) -> None:
        self._mlflow = mlflow
        self._client = mlflow.MlflowClient()
        experiment_id = environ.get(ENV_MLFLOW_EXPERIMENT_ID)
        if not experiment_id:
            name = environ.get(ENV_MLFLOW_EXPERIMENT_NAME) or f"rljob-{config.namespace}-{config.name}"
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name(config, attempt),
                                                   tags=run_tags(config, attempt)).info.run_id

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._mlflow.entities.Metric(tag, value, now, step) for tag, value in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


Factory = Callable[[], Tracker]


class Trackers:
    """Runs trackers on one daemon thread: each factory is called there (a W&B or MLflow login never holds the
    training loop), then every record :meth:`log` queues is logged by each tracker in turn.

    A factory that raises leaves its tracker out (one warning); a tracker whose ``log`` raises is warned about at the
    first failure of a streak and tried again with the next record. ``queue_size``: records waiting at most; more are
    dropped and counted in a warning.
    """

    def __init__(self, factories: Mapping[str, Factory], queue_size: int = QUEUE_RECORDS) -> None:
        self._factories = dict(factories)
        self._queue: queue.Queue[Optional[StepRecord]] = queue.Queue(queue_size)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        self._thread.start()

    @property
    def names(self) -> list[str]:
        """The configured trackers, started or not."""
        return list(self._factories)

    def log(self, record: StepRecord) -> None:
        """Queue ``record`` for every tracker; never blocks (a full queue drops it, with a warning)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 100 == 0:
                log.warning("trackers: %d step records dropped so far: the trackers (%s) fall behind the training "
                            "loop", self._dropped, ", ".join(self._factories))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Log what is queued, then close every tracker; waits at most ``timeout_s`` seconds (idempotent)."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("trackers: the queue did not drain within %.0f s; the last records are not logged", timeout_s)
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("trackers: still logging after %.0f s; the last records may be missing", timeout_s)

    def _run(self) -> None:
        started: dict[str, Tracker] = {}
        for name, factory in self._factories.items():
            try:
                started[name] = factory()
                log.info("trackers: logging every step to %s", name)
            except Exception as err:  # a tracker is optional: training goes on without it
                log.warning("trackers: %s could not start, not logging to it: %s: %s", name, type(err).__name__, err)
        failing: set[str] = set()
        try:
            while (record := self._queue.get()) is not None:
                scalars = step_scalars(record)
                for name, tracker in started.items():
                    try:
                        tracker.log(scalars, record.step)
                    except Exception as err:
                        if name not in failing:
                            log.warning("trackers: %s could not log step %d (retried with the next step): %s: %s",
                                        name, record.step, type(err).__name__, err)
                        failing.add(name)
                    else:
                        failing.discard(name)
        finally:
            for name, tracker in started.items():
                try:
                    tracker.close()
                except Exception as err:
                    log.warning("trackers: %s did not close cleanly: %s: %s", name, type(err).__name__, err)


def _optional_import(module: str, env: str, what: str) -> Optional[Any]:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        log.warning("trackers: %s is set but the %s package cannot be imported in this image (%s); training goes on "
                    "without %s (the GPU trainer image trainer_image/Dockerfile has it)", env, module, err, what)
        return None


def build_trackers(config: JobConfig, attempt: Optional[int],
                   environ: Mapping[str, str] = os.environ) -> Optional[Trackers]:
    """The trackers configured for this job (module docstring), on their thread; None when there is none.

    TensorBoard with ``spec.trainer.tensorboard``; W&B when env ``WANDB_API_KEY`` is set; MLflow when env
    ``MLFLOW_TRACKING_URI`` is set. A package that cannot be imported is logged (one warning naming the env and the
    package) and left out. ``attempt``: the gang attempt (names each run; None outside the operator).
    """
    factories: dict[str, Factory] = {}
    board = config.spec.trainer.tensorboard
    if board is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            log.warning("trackers: spec.trainer.tensorboard is set but torch.utils.tensorboard cannot be imported in "
                        "this image (%s); no event files are written to %s", err, board.log_dir)
        else:
            factories[f"TensorBoard ({board.log_dir})"] = lambda: TensorBoardTracker(SummaryWriter, board.log_dir)
    if environ.get(ENV_WANDB) and (wandb := _optional_import("wandb", ENV_WANDB, "Weights & Biases")) is not None:
        factories["Weights & Biases"] = lambda: WandbTracker(wandb, config, attempt, environ)
    if environ.get(ENV_MLFLOW) and (mlflow := _optional_import("mlflow", ENV_MLFLOW, "MLflow")) is not None:
        factories[f"MLflow ({environ[ENV_MLFLOW]})"] = lambda: MlflowTracker(mlflow, config, attempt, environ)
    return Trackers(factories) if factories else None
