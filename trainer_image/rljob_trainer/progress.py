"""Progress reporting of the trainer: the Redis progress hash, JSON lines on stdout and Prometheus.

Only global rank 0 reports (:class:`RankZeroProgress`); every other rank gets :class:`NoOpProgress`, so the
training loop calls ``report`` unconditionally. The progress hash is the operator's view of the trainer
(DESIGN §2 "Progress"); stdout carries one JSON object per step (logs go to stderr).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Protocol, TextIO

import redis
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from rljob_api import constants as c
from rljob_api.config import JobConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step reports.

    ``documents_seen``: documents that entered the loss since the job began, over all ranks (documents);
    ``model_version``: the version of the weights after this step (= documents_seen, DESIGN §6);
    ``tokens_per_second``: real (non-padding) tokens of the step over all ranks / its wall time;
    ``metrics``: the reduced loss metrics (DESIGN §4) plus ``loss``, ``grad_norm`` and ``learning_rate``;
    ``stream``: the stream reader's counters summed over ranks (documents: redelivered, dead-lettered...).
    """

    step: int
    documents_seen: int
    model_version: int
    tokens_per_second: float
    metrics: dict[str, float] = field(default_factory=dict)
    stream: dict[str, int] = field(default_factory=dict)


class Progress(Protocol):
    """A step reporter; see :class:`RankZeroProgress` and :class:`NoOpProgress`."""

    def report(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class NoOpProgress:
    """The reporter of every rank but global rank 0: does nothing."""

    def report(self, record: StepRecord) -> None:
        """Ignore ``record``."""

    def close(self) -> None:
        """Nothing to release."""


class RankZeroProgress:
    """Global rank 0's reporter: progress hash, JSON lines and a Prometheus endpoint.

    After each step :meth:`report` writes ``HSET keys.progress`` with ``step``, ``documents_seen``,
    ``model_version``, ``tokens_per_second``, ``metrics`` (JSON object), ``stream`` (JSON object) and
    ``updated_at`` (unix seconds), prints the record as one JSON line on ``stdout`` and sets the gauges
    ``rljob_trainer_{step,documents_seen,model_version,tokens_per_second}`` and
    ``rljob_trainer_metric{name=...}``, served on ``config.metrics_port`` (0 = a free port, see
    :attr:`port`) at the address in env ``POD_IP`` (default all interfaces).

    A Redis error while writing the hash is logged and skipped: the next step writes it again.

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
    ) -> None:
        self._key = config.keys.progress
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
            "rljob_trainer_metric", "Loss metrics of the last step (DESIGN §4).", ["name"], registry=self.registry
        )
        self._stream = Gauge(
            "rljob_trainer_stream", "Stream reader counters, all ranks (documents).", ["counter"], registry=self.registry
        )
        address = os.environ.get(c.ENV_POD_IP, "0.0.0.0")
        self._server, self._thread = start_http_server(config.metrics_port, addr=address, registry=self.registry)

    @property
    def port(self) -> int:
        """The TCP port the Prometheus endpoint listens on."""
        return self._server.server_address[1]

    def report(self, record: StepRecord) -> None:
        """Publish ``record`` to the progress hash, stdout and the gauges."""
        for name in self._scalars:
            self._scalars[name].set(getattr(record, name))
        for name, value in record.metrics.items():
            self._metric.labels(name=name).set(value)
        for name, value in record.stream.items():
            self._stream.labels(counter=name).set(value)
        line = {"event": "step", **asdict(record)}
        self._stdout.write(json.dumps(line, allow_nan=True) + "\n")
        self._stdout.flush()
        mapping = {
            "step": record.step,
            "documents_seen": record.documents_seen,
            "model_version": record.model_version,
            "tokens_per_second": repr(float(record.tokens_per_second)),
            "metrics": json.dumps(record.metrics),
            "stream": json.dumps(record.stream),
            "updated_at": repr(time.time()),
        }
        try:
            self._client.hset(self._key, mapping=mapping)
        except redis.RedisError as err:
            log.warning("progress: could not write %s after step %d: %s", self._key, record.step, err)

    def close(self) -> None:
        """Stop the Prometheus endpoint (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()


def build_progress(config: JobConfig, client: redis.Redis, rank: int, *, stdout: TextIO = sys.stdout) -> Progress:
    """:class:`RankZeroProgress` on global rank 0 (JSON lines to ``stdout``), :class:`NoOpProgress` elsewhere."""
    return RankZeroProgress(config, client, stdout=stdout) if rank == 0 else NoOpProgress()
