"""Progress reporting of the trainer: the Redis progress hash (after each step, at every start and at each
checkpoint: :func:`publish_start`, :func:`publish_checkpointed`), JSON lines on stdout and Prometheus.

Only global rank 0 reports (:class:`RankZeroProgress`); every other rank gets :class:`NoOpProgress`, so the
training loop calls ``report`` unconditionally. The progress hash is the operator's view of the trainer
(DESIGN §2 "Progress"); stdout carries one JSON object per step (logs go to stderr).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional, Protocol, TextIO

import redis
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.config import JobConfig
from rljob_trainer import fence
from rljob_trainer.metrics_registry import WEIGHT_SYNC, WEIGHT_SYNC_OVERLAPPED
from rljob_trainer.step_record import StepRecord
from rljob_trainer.trackers import Trackers, build_trackers

if TYPE_CHECKING:
    from rljob_trainer.weight_publisher import Publication

log = logging.getLogger(__name__)


class Progress(Protocol):
    """A step reporter; see :class:`RankZeroProgress` and :class:`NoOpProgress`."""

    def report(self, record: StepRecord, publication: Optional[Future[Publication]] = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NoOpProgress:
    """The reporter of every rank but global rank 0: does nothing."""

    def report(self, record: StepRecord, publication: Optional[Future[Publication]] = None) -> None:
        """Ignore ``record``."""

    def flush(self) -> None:
        """Nothing is in flight."""

    def close(self) -> None:
        """Nothing to release."""


class RankZeroProgress:
    """Global rank 0's reporter: progress hash, JSON lines, a Prometheus endpoint and the experiment trackers.

    After each step :meth:`report` writes ``HSET keys.progress`` with ``step``, ``documents_seen``,
    ``model_version``, ``tokens_per_second``, ``metrics`` (JSON object), ``stream`` (JSON object) and
    ``updated_at`` (unix seconds), prints the record as one JSON line on ``stdout`` and sets the gauges
    ``rljob_trainer_{step,documents_seen,model_version,tokens_per_second}`` and
    ``rljob_trainer_metric{name=...}``, served on ``config.metrics_port`` (0 = a free port, see
    :attr:`port`) at the address in env ``POD_IP`` (default all interfaces); ``trackers``
    (:mod:`rljob_trainer.trackers`: TensorBoard, W&B, MLflow) get every record on their own thread.

    A Redis error while writing the hash is logged and skipped: the next step writes it again.

    The report runs on a thread of its own (``rljob-progress``), records in order, so that its Redis round trip
    and its Python work leave the training step: :meth:`report` returns at once and raises what an earlier report
    raised (:class:`~rljob_trainer.fence.Fenced`: a later gang attempt owns the job, one step later than a
    report in line would); :meth:`flush` waits for the reports made so far.

    Raises:
        OSError: the metrics port cannot be bound.
    """

    def __init__(
        self,
        config: JobConfig,
        client: redis.Redis,
        *,
        registry: Optional[CollectorRegistry] = None,
        stdout: TextIO = sys.stdout,
        trackers: Optional[Trackers] = None,
    ) -> None:
        self._key, self._keys = config.keys.progress, config.keys
        self._trackers = trackers
        self._client = client
        self._stdout = stdout
        self.registry = registry or CollectorRegistry()
        self._scalars = {
            name: Gauge(f"rljob_trainer_{name}", doc, registry=self.registry)
            for name, doc in (
                ("step", "Optimizer steps done."),
                ("documents_seen", "Documents that entered the loss, all ranks (documents)."),
                ("model_version", "Weights version after the last step (documents)."),
                ("tokens_per_second", "Real tokens per second of the last step, all ranks."),
            )
        }
        self._metric = Gauge(
            "rljob_trainer_metric", "Metrics of the last step: loss metrics (DESIGN §4), loss, grad_norm, "
            "learning_rate, the timings (weight_sync_time_ms, the step phases, checkpoint_*_time_ms).", ["name"], registry=self.registry
        )
        self._weight_sync = Gauge(
            "rljob_trainer_weight_sync_time_ms", "Milliseconds of the last step's weight publication on global rank 0, "
            "by the layout its update went in (packed or per-tensor).", ["layout"], registry=self.registry
        )
        self._stream = Gauge(
            "rljob_trainer_stream", "Stream reader counters, all ranks (documents).", ["counter"], registry=self.registry
        )
        address = os.environ.get(c.ENV_POD_IP, "0.0.0.0")
        self._server, self._thread = start_http_server(config.metrics_port, addr=address, registry=self.registry)
        self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rljob-progress")
        self._in_flight: list[Future[None]] = []

    @property
    def port(self) -> int:
        """The TCP port the Prometheus endpoint listens on."""
        return self._server.server_address[1]

    def report(self, record: StepRecord, publication: Optional[Future[Publication]] = None) -> None:
        """Queue ``record`` for the progress hash, stdout, the gauges and the trackers (see the class docstring).
        With ``publication`` (the step's weight publication, running in the background) the record waits for it and
        goes out with its wall time (``weight_sync_overlapped_time_ms``) and layout: a step is reported after its
        weights are published, as DESIGN §6 orders it. A step whose publication raised (``Fenced``, a failed gather)
        is not reported at all: its error is raised by the next :meth:`report` or :meth:`flush`, as the trainer's
        ``settle`` raises it.

        Raises:
            Whatever an earlier report raised on the reporting thread (other than a Redis error, which is logged).
        """
        self._raise_finished()
        self._in_flight.append(self._reporter.submit(self._publish, record, publication))

    def flush(self) -> None:
        """Wait until every record reported so far is published.

        Raises:
            Whatever a report raised on the reporting thread.
        """
        while self._in_flight:
            self._in_flight.pop(0).result()

    def _raise_finished(self) -> None:
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.pop(0).result()

    def _publish(self, record: StepRecord, publication: Optional[Future[Publication]] = None) -> None:
        if publication is not None:  # a step whose weights did not go out is not reported: its error is raised
            done = publication.result()
            record = dataclasses.replace(record, metrics={**record.metrics, WEIGHT_SYNC_OVERLAPPED: done.duration_ms},
                                         weight_sync_layout=done.layout)
        for name in self._scalars:
            self._scalars[name].set(getattr(record, name))
        for name, value in record.metrics.items():
            self._metric.labels(name=name).set(value)
        for name, value in record.stream.items():
            self._stream.labels(counter=name).set(value)
        synced = record.metrics.get(WEIGHT_SYNC_OVERLAPPED, record.metrics.get(WEIGHT_SYNC))
        if record.weight_sync_layout is not None and synced is not None:
            self._weight_sync.labels(layout=record.weight_sync_layout).set(synced)
        if self._trackers is not None:
            self._trackers.log(record)
        line = {"event": "step", **asdict(record)}
        self._stdout.write(json.dumps(line, allow_nan=True) + "\n")
        self._stdout.flush()
        mapping = protocol.step_fields(record.step, record.documents_seen, record.model_version,
                                       record.tokens_per_second, record.metrics, record.stream, time.time())
        try:
            fence.write(self._client, self._keys, [("HSET", self._key, *fence.flat(mapping))])
        except redis.RedisError as err:
            log.warning("progress: could not write %s after step %d: %s", self._key, record.step, err)

    def close(self) -> None:
        """Publish what is still queued (a failure is logged), log what the trackers still hold and close them, stop
        the Prometheus endpoint (idempotent)."""
        try:
            self.flush()
        except Exception as error:  # noqa: BLE001 - closing must release the rest
            log.warning("progress: a step report failed: %s", error)
        finally:
            self._in_flight.clear()
            self._reporter.shutdown(wait=True)
        if self._trackers is not None:
            self._trackers.close()
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()


def build_progress(config: JobConfig, client: redis.Redis, rank: int, *, stdout: TextIO = sys.stdout) -> Progress:
    """:class:`RankZeroProgress` on global rank 0 (JSON lines to ``stdout``, the trackers the job and the env configure:
    :func:`~rljob_trainer.trackers.build_trackers`), :class:`NoOpProgress` elsewhere."""
    if rank != 0:
        return NoOpProgress()
    return RankZeroProgress(config, client, stdout=stdout, trackers=build_trackers(config, fence.gang_attempt()))


def publish_start(
    client: redis.Redis,
    config: JobConfig,
    step: int,
    documents_seen: int,
    lost: Optional[protocol.LostCheckpoint],
    attempt: Optional[int] = None,
) -> None:
    """Rank 0 at every start: where this attempt starts, in the progress hash, and the rollout hash's rewards of an
    abandoned timeline dropped, in one MULTI/EXEC.

    Sets ``step``, ``documents_seen``, ``model_version`` (= documents_seen), ``restored_from_step`` (= step) and
    ``checkpoint_documents_seen`` (= documents_seen: nothing trained yet is unacked) to the loaded checkpoint's values
    (0 from scratch), ``dropped_stale`` and ``checkpoint_dropped_stale`` to 0 (this attempt dropped nothing yet),
    ``started_attempt`` to ``attempt`` (the operator's phase goes from Starting to Running on it), deletes ``stream``
    (the reader counters are this attempt's from its first step on), and sets ``checkpoint_lost`` (JSON {step, path, restored_from_step, message, attempt}) or deletes it. ``attempt``: the gang attempt (env ``RLJOB_ATTEMPT``, :func:`gang_attempt`), so the operator never shows the
    record of an earlier attempt as this one's.
    The rollout's max lag needs this before the first step (:mod:`rljob_rollout.writer`): an earlier attempt's
    documents_seen would otherwise count this attempt's redelivered documents as trained.

    In the rollout hash it deletes the ``reward_sum:{v}`` / ``reward_count:{v}`` fields with v > ``documents_seen``:
    versions of a timeline this start abandoned (it started over, or from an older checkpoint), which the operator
    would otherwise keep showing as the newest reward (status.rolloutReward). Versions <= ``documents_seen`` and the
    hash's other fields stay. The field names are read with HKEYS under WATCH, so a field a rollout worker adds
    meanwhile reruns the transaction (redis-py :meth:`redis.Redis.transaction`). Not covered: a rollout worker still
    holding the abandoned weights tags its batches with the old version until it loads this start's weights (published
    right after), so such a field can come back for that short while; the operator ignores reward versions above
    the progress hash's model_version.

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries (the attempt fails and is restarted).
    """
    key, rollout = config.keys.progress, config.keys.rollout

    commands: list[fence.Command] = [("HSET", key, *fence.flat(protocol.start_fields(step, documents_seen, attempt))),
                                     ("HDEL", key, protocol.PROGRESS_STREAM)]
    if lost is None:
        commands.append(("HDEL", key, protocol.PROGRESS_CHECKPOINT_LOST))
    else:
        commands.append(("HSET", key, protocol.PROGRESS_CHECKPOINT_LOST,
                         dataclasses.replace(lost, attempt=attempt).to_field()))

    def write(pipe: redis.client.Pipeline) -> None:
        versions = protocol.reward_field_versions(pipe.hkeys(rollout))
        abandoned = [name for name, version in versions.items() if version > documents_seen]
        pipe.multi()
        fence.queue(pipe, config.keys, commands + ([("HDEL", rollout, *abandoned)] if abandoned else []), attempt)

    try:
        client.transaction(write, rollout)
    except redis.ResponseError as err:
        raise fence.refusal(err, attempt) from None


def stream_identity(client: redis.Redis, config: JobConfig) -> str:
    """Rank 0 at every start: the job's stream identity (``{prefix}stream_id``), made now (a random hex string, SET NX)
    when Redis holds none: at the first start, or after Redis forgot everything. The operator compares it on every
    read (status.streamIdentity): another identity, or none, tells it that the stream was lost.

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    key = config.keys.prefix + protocol.KEY_STREAM_ID
    client.set(key, uuid.uuid4().hex, nx=True)
    return protocol.text(client.get(key)) or ""


def publish_checkpointed(client: redis.Redis, config: JobConfig, documents_seen: int, dropped_stale: int = 0) -> None:
    """Rank 0 once a checkpoint is durable and before its entries are acked: ``checkpoint_documents_seen`` =
    ``documents_seen`` and ``checkpoint_dropped_stale`` = ``dropped_stale`` (the stale documents this attempt dropped
    up to that checkpoint, which it covers) in the progress hash, in one HSET: the documents it covers leave the
    rollout's trained-unacked count.

    Raises:
        redis.RedisError: Redis unreachable beyond the client's retries (the acks that follow would fail as well).
    """
    fence.write(client, config.keys, [("HSET", config.keys.progress,
                                       protocol.PROGRESS_CHECKPOINT_DOCUMENTS_SEEN, documents_seen,
                                       protocol.PROGRESS_CHECKPOINT_DROPPED_STALE, dropped_stale)])
