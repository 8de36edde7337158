"""Prometheus metrics of one rollout worker (served by ``python -m rljob_rollout`` on ``config.metrics_port``).

Names: ``rljob_rollout_samples_total`` (completions generated), ``rljob_rollout_documents_total`` (documents
written), ``rljob_rollout_reward_errors_total{kind}`` (samples dropped because the reward function raised),
``rljob_rollout_filtered_samples_total`` (zero-variance filter), ``rljob_rollout_aborted_samples_total`` (in
flight when a weight update tore), ``rljob_rollout_samples_dropped_at_stop_total`` (in flight at SIGTERM, past the
drain), ``rljob_rollout_weight_updates_total{outcome}``,
``rljob_rollout_model_version`` (documents), ``rljob_rollout_reward`` (mean reward of the last batch, before
filtering), ``rljob_rollout_samples_per_second``, ``rljob_rollout_waiting`` (1 while back-pressure or max lag
holds the worker), ``rljob_rollout_stream_backlog`` and ``rljob_rollout_stream_ahead`` (documents: what
``redis.maxPending`` and ``rollout.maxLag`` bound, :class:`~rljob_rollout.writer.StreamBacklog`, as of the worker's
last check before a batch). Episodes (task ``environment``): ``rljob_rollout_episodes_total{end}`` (done, max_turns,
token_budget, or the class of the error that dropped it: EnvironmentTimeout, EnvironmentFailed, ObservationError,
EpisodeAborted, EpisodeError), ``rljob_rollout_episode_turns`` and ``rljob_rollout_episode_tokens`` (histograms of the
episodes that ended, dropped ones included), ``rljob_rollout_episode_seconds``. Capacity (:mod:`rljob_rollout.capacity`): ``rljob_rollout_held_seconds_total``,
``rljob_rollout_held_share`` and ``rljob_rollout_tokens_per_second`` (over the last window).
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rljob_rollout.capacity import Capacity
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
        self.dropped_at_stop = Counter("rljob_rollout_samples_dropped_at_stop", "Samples in flight when the worker "
                                       "stopped and not written within its drain.", registry=r)
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
        self.episodes = Counter("rljob_rollout_episodes", "Episodes ended, by how (done, max_turns, token_budget) or "
                                "by the class of the error that dropped them.", ["end"], registry=r)
        self.episode_turns = Histogram("rljob_rollout_episode_turns", "Turns (steps) per episode.",
                                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128), registry=r)
        self.episode_tokens = Histogram("rljob_rollout_episode_tokens", "Tokens per episode (document length).",
                                        buckets=tuple(2**k for k in range(4, 18)), registry=r)
        self.episode_seconds = Histogram("rljob_rollout_episode_seconds", "Wall time per episode (seconds).",
                                         buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.held_seconds = Counter("rljob_rollout_held_seconds", "Time back-pressure (redis.maxPending) or max lag "
                                    "(rollout.maxLag) held the worker (seconds).", registry=r)
        self.held_share = Gauge("rljob_rollout_held_share", "Share of the last window (rljob_rollout.capacity) the "
                                "worker was held (0..1).", registry=r)
        self.tokens_per_second = Gauge("rljob_rollout_tokens_per_second", "Tokens sampled per second over the last "
                                       "window.", registry=r)
        self._held_counted = 0.0
        self._server = None

    def observe_capacity(self, capacity: Capacity) -> None:
        """Set the capacity gauges and advance the held-time counter from one reading."""
        self.held_seconds.inc(max(0.0, capacity.held_seconds - self._held_counted))
        self._held_counted = max(self._held_counted, capacity.held_seconds)
        self.held_share.set(capacity.held_share)
        self.tokens_per_second.set(capacity.tokens_per_second)

    def observe_episode(self, episode: Any) -> None:
        """Count one ended episode (an :class:`~rljob_rollout.environments.episodes.Episode`)."""
        self.episodes.labels(end=episode.end if episode.error is None else type(episode.error).__name__).inc()
        self.episode_turns.observe(episode.turns)
        self.episode_tokens.observe(len(episode.token_ids))
        self.episode_seconds.observe(episode.seconds)

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
