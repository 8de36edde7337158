"""Prometheus metrics of one rollout worker (served by ``python -m rljob_rollout`` on ``config.metrics_port``).

Names: ``rljob_rollout_samples_total`` (completions generated), ``rljob_rollout_documents_total`` (documents
written), ``rljob_rollout_reward_errors_total{kind}`` (samples dropped because the reward function raised),
``rljob_rollout_filtered_samples_total`` (zero-variance filter), ``rljob_rollout_aborted_samples_total`` (in
flight when a weight update tore), ``rljob_rollout_weight_updates_total{outcome}``,
``rljob_rollout_model_version`` (documents), ``rljob_rollout_reward`` (mean reward of the last batch, before
filtering), ``rljob_rollout_samples_per_second``, ``rljob_rollout_waiting`` (1 while back-pressure or max lag
holds the worker), ``rljob_rollout_stream_backlog`` and ``rljob_rollout_stream_ahead`` (documents: what
``redis.maxPending`` and ``rollout.maxLag`` bound, :class:`~rljob_rollout.writer.StreamBacklog`, as of the worker's
last check before a batch).
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from rljob_rollout.writer import BatchReport, StreamBacklog


class RolloutMetrics:
    """The worker's Prometheus instruments, in their own registry."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.samples = Counter("rljob_rollout_samples", "Completions generated.", registry=r)
        self.documents = Counter("rljob_rollout_documents", "Documents written to the stream.", registry=r)
        self.reward_errors = Counter(
            "rljob_rollout_reward_errors", "Samples dropped: the reward function raised.", ["kind"], registry=r
        )
        self.filtered = Counter("rljob_rollout_filtered_samples", "Samples of zero-variance groups dropped.", registry=r)
        self.abandoned = Counter("rljob_rollout_abandoned_documents", "Documents dropped: sampled with weights of a "
                                 "timeline the trainer abandoned (it resumed from an older checkpoint).", registry=r)
        self.aborted = Counter("rljob_rollout_aborted_samples", "Samples aborted in flight by a torn weight update.",
                               registry=r)
        self.updates = Counter("rljob_rollout_weight_updates", "Weight updates by outcome.", ["outcome"], registry=r)
        self.model_version = Gauge("rljob_rollout_model_version", "Version of the loaded weights (documents).", registry=r)
        self.reward = Gauge("rljob_rollout_reward", "Mean reward of the last batch, before filtering.", registry=r)
        self.samples_per_second = Gauge("rljob_rollout_samples_per_second", "Generation + scoring rate.", registry=r)
        self.waiting = Gauge("rljob_rollout_waiting", "1 while back-pressure or max lag holds the worker.", registry=r)
        self.stream_backlog = Gauge("rljob_rollout_stream_backlog", "The consumer group's undelivered + pending entries "
                                    "(stale drops aside) that redis.maxPending bounds, at the last check (documents).",
                                    registry=r)
        self.stream_ahead = Gauge("rljob_rollout_stream_ahead", "Documents generated and not yet trained by the "
                                  "trainer's current attempt, that rollout.maxLag bounds, at the last check (documents).",
                                  registry=r)
        self._server = None

    def serve(self, port: int, address: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint; returns the bound port (``port`` 0 picks a free one). Raises OSError."""
        self._server, _thread = start_http_server(port, addr=address, registry=self.registry)
        return self._server.server_address[1]

    def observe_batch(self, batch: BatchReport, documents: int) -> None:
        """Count one written batch."""
        self.samples.inc(batch.samples_generated)
        self.documents.inc(documents)
        self.filtered.inc(batch.samples_filtered)
        for kind, count in batch.errors_by_class.items():
            self.reward_errors.labels(kind=kind).inc(count)
        if batch.rewards:
            self.reward.set(sum(batch.rewards) / len(batch.rewards))
        self.samples_per_second.set(batch.samples_generated / max(batch.seconds, 1e-9))

    def observe_backlog(self, state: StreamBacklog) -> None:
        """Set the stream gauges from the worker's last snapshot of the consumer group."""
        self.stream_backlog.set(state.backlog)
        self.stream_ahead.set(state.ahead)

    def close(self) -> None:
        """Stop the HTTP endpoint, if started."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
