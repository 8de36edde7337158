"""Prometheus metrics of the operator, served on their own port (``rljob operator --metrics-port``).

- ``rljob_operator_jobs{phase}``: RLTrainingJobs by status.phase, listed from the API server at scrape time
  (a custom collector, so the number is never stale; ``phase="Unknown"`` for jobs without a status yet);
- ``rljob_operator_job_restarts{job_namespace,job_name}``: each job's status.restarts (gang restarts over the job's
  life, whichever operator process decided them), listed at scrape time as well;
- each job's ``status.capacity`` (DESIGN §6 "Capacity signals"), listed at scrape time, labelled
  ``job_namespace``, ``job_name`` (:data:`CAPACITY_GAUGES`): ``rljob_operator_job_data_wait_share``,
  ``rljob_operator_job_rollout_held_share``, ``rljob_operator_job_rollout_tokens_per_second``,
  ``rljob_operator_job_rollout_tokens_per_second_per_replica``, ``rljob_operator_job_stream_entries{state}``
  (``pending``, ``undelivered``) and ``rljob_operator_job_rollout_replicas_reporting``; a value not reported has no
  sample (never a 0), and a job that runs no pod has none;
- ``rljob_operator_gang_restarts_total``: trainer gang restarts decided by this process;
- ``rljob_operator_reconcile_duration_seconds``: wall time of one reconcile pass (seconds);
- ``rljob_operator_reconcile_errors_total{kind}``: passes that ended in an error, by exception class
  (``httpNNN`` for a refused API call; ``StaleStatus`` for a status write refused with 409 because the job changed
  since the pass read it);
- ``rljob_operator_api_requests_total{verb,resource}``: the operator's own API requests (apply, create, get, delete,
  list, patch), not kopf's watches, finalizer patches and Events.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from typing import Any, Awaitable, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rljob_api.constants import Phase

log = logging.getLogger(__name__)

ListJobs = Callable[[], Awaitable[list[dict[str, Any]]]]


def count_phases(jobs: list[dict[str, Any]]) -> dict[str, int]:
    """Jobs per phase; every phase appears (0 when none), jobs without a phase count as ``Unknown``."""
    tally = Tally((job.get("status") or {}).get("phase") or "Unknown" for job in jobs)
    return {**{phase.value: 0 for phase in Phase}, "Unknown": 0, **tally}


CAPACITY_GAUGES = (
    ("rljob_operator_job_data_wait_share", "Share of its time the trainer waited for documents (status.capacity).",
     (("dataWaitShare", ()),)),
    ("rljob_operator_job_rollout_held_share", "Rollout replicas' mean share of time held by back-pressure.",
     (("heldShare", ()),)),
    ("rljob_operator_job_rollout_tokens_per_second", "Tokens sampled per second by the rollout replicas reporting.",
     (("tokensPerSecond", ()),)),
    ("rljob_operator_job_rollout_tokens_per_second_per_replica", "Their tokens per second per replica.",
     (("tokensPerSecondPerReplica", ()),)),
    ("rljob_operator_job_stream_entries", "Stream entries of the trainer's consumer group: pending (delivered, not "
     "acked) and undelivered (documents).", (("pending", ("pending",)), ("undelivered", ("undelivered",)))),
    ("rljob_operator_job_rollout_replicas_reporting", "Rollout replicas with a capacity report of the last 60 s.",
     (("replicasReporting", ()),)),
)
"""(metric name, help, ((status.capacity field, extra label values), ...)); the one extra label is ``state``."""


def capacity_families(jobs: list[dict[str, Any]]) -> list[GaugeMetricFamily]:
    """The gauges of :data:`CAPACITY_GAUGES` for ``jobs`` (as listed), a sample per reported value."""
    families = []
    for name, documentation, fields in CAPACITY_GAUGES:
        extra = ["state"] if fields[0][1] else []
        family = GaugeMetricFamily(name, documentation, labels=["job_namespace", "job_name", *extra])
        for job in jobs:
            meta, reported = job.get("metadata") or {}, (job.get("status") or {}).get("capacity") or {}
            for field, values in fields:
                if reported.get(field) is not None:
                    family.add_metric([meta.get("namespace", ""), meta.get("name", ""), *values], reported[field])
        families.append(family)
    return families


class JobsCollector(Collector):
    """Lists the jobs at scrape time by running ``list_jobs`` on the operator's event loop.

    The scrape runs in prometheus-client's HTTP thread; it waits at most ``timeout_s`` seconds and yields
    nothing (rather than stale numbers) when the API server does not answer.
    """

    def __init__(self, list_jobs: ListJobs, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0) -> None:
        self._list_jobs = list_jobs
        self._loop = loop
        self._timeout_s = timeout_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            jobs = asyncio.run_coroutine_threadsafe(self._list_jobs(), self._loop).result(self._timeout_s)
        except Exception as err:  # a failed scrape must not kill the HTTP thread
            log.warning("metrics: could not list RLTrainingJobs: %s", err)
            return
        family = GaugeMetricFamily("rljob_operator_jobs", "RLTrainingJobs by status.phase.", labels=["phase"])
        for phase, count in sorted(count_phases(jobs).items()):
            family.add_metric([phase], count)
        yield family
        restarts = GaugeMetricFamily("rljob_operator_job_restarts", "Gang restarts of each RLTrainingJob "
                                     "(status.restarts).", labels=["job_namespace", "job_name"])
        for job in jobs:
            meta = job.get("metadata") or {}
            restarts.add_metric([meta.get("namespace", ""), meta.get("name", "")],
                                (job.get("status") or {}).get("restarts") or 0)
        yield restarts
        yield from capacity_families(jobs)


class OperatorMetrics:
    """The operator's metric objects, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gang_restarts = Counter(
            "rljob_operator_gang_restarts", "Trainer gang restarts decided by this operator.", registry=self.registry
        )
        self.reconcile_duration = Histogram(
            "rljob_operator_reconcile_duration_seconds",
            "Wall time of one reconcile pass (seconds).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "rljob_operator_reconcile_errors", "Reconcile passes that ended in an error.", ["kind"],
            registry=self.registry,
        )
        self.api_requests = Counter(
            "rljob_operator_api_requests", "The operator's own API requests (not kopf's watches, finalizer patches "
            "and Events), by verb and resource.", ["verb", "resource"], registry=self.registry,
        )
        self._server: Optional[Any] = None

    def count_request(self, verb: str, resource: str) -> None:
        """Count one API request (the ``on_request`` hook of :class:`~rljob_operator.kube_api.KubeApi`)."""
        self.api_requests.labels(verb=verb, resource=resource).inc()

    def serve(self, port: int, list_jobs: ListJobs, loop: asyncio.AbstractEventLoop, addr: str = "0.0.0.0") -> int:
        """Register the jobs collector and serve /metrics on ``port`` (0 = a free port). Returns the port.

        Raises:
            OSError: the port cannot be bound.
        """
        self.registry.register(JobsCollector(list_jobs, loop))
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
