"""The RLTrainingJob status: written only by the operator, read by users, ``kubectl get`` and the tests.

Conditions are shaped like ``metav1.Condition`` (type, status, reason, message, lastTransitionTime,
observedGeneration) and keyed by type. Progress fields (step, documentsSeen, modelVersion, rolloutReward,
lastMetrics) are copied from the Redis progress hashes of DESIGN §2.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Optional

from pydantic import ConfigDict, Field

from rljob_api import constants as c
from rljob_api.spec import ApiModel


class StatusModel(ApiModel):
    """Base of status models: like :class:`ApiModel` but tolerant of fields a newer operator wrote."""

    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """One observation of the job, metav1.Condition shaped."""

    type: c.ConditionType = Field(..., description="Valid, RedisReady, RolloutReady, EnvironmentReady (only with an "
                                  "environment server or url), TrainerReady, Running, Restarting, Suspended, "
                                  "Succeeded or Failed.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field(
        ..., min_length=1, max_length=1024, description="CamelCase reason of the last transition."
    )
    message: str = Field("", max_length=32768, description="What happened and what to do about it.")
    last_transition_time: datetime = Field(
        ..., description="When status last changed (RFC 3339, UTC)."
    )
    observed_generation: Optional[int] = Field(
        None, ge=0, description="The metadata.generation the condition was computed from."
    )


class CheckpointStatus(StatusModel):
    """The newest committed checkpoint as the trainer recorded it (the Redis checkpoint hash), copied into the
    job's status at the first reconcile pass after the commit, so that it stays known when Redis forgets."""

    step: int = Field(..., ge=0, description="Optimizer steps the checkpoint holds.")
    documents_seen: int = Field(..., ge=0, description="Documents trained up to it, all ranks (documents).")
    path: str = Field(..., description="Its directory on the trainer's checkpoint volume.")
    time: Optional[datetime] = Field(None, description="When it was committed.")


class SecretKeyStatus(StatusModel):
    """A key of a Secret in the job's namespace."""

    name: str = Field(..., description="The Secret's name.")
    key: str = Field(..., description="The key inside it.")


class StreamStatus(StatusModel):
    """Where documents go and weights come from, from the job's resolved config: what a producer outside rljob (a
    PipelineRL actor, any writer of the Fast-LLM stream format) needs to feed the trainer (DESIGN §2-§3)."""

    redis_address: str = Field(..., description="host:port/db of the job's Redis (inside the cluster).")
    tls: bool = Field(False, description="Redis speaks TLS (a rediss:// spec.redis.url).")
    password_secret_ref: Optional[SecretKeyStatus] = Field(
        None, description="The Secret key holding the Redis password (AUTH as the default user); absent: none.")
    stream_key: str = Field(..., description="Data stream: XADD one document per entry (DESIGN §3).")
    group: str = Field(..., description="The trainer ranks' consumer group on streamKey; its lag plus pending is the "
                       "backlog that spec.redis.maxPending bounds.")
    events_key: str = Field(..., description="Event stream: weights_ready after each update, training_finished at the "
                            "end.")
    members_key: str = Field(..., description="Hash of weight-transfer members: field = transfer rank, value = JSON "
                             '{"time": Redis TIME seconds, "version": loaded documents_seen or null, "instance": id}.')
    dead_letter_key: str = Field(..., description="Stream of the entries the trainer refused, with kind and reason.")
    first_transfer_rank: int = Field(
        ..., ge=1, description="Lowest weight-transfer rank free for members outside rljob: the first above the rollout "
        "pods' range, 1 + spec.rollout.replicas x max(1, gpusPerReplica) (it moves when the rollout is scaled).")
    weights_address: str = Field(..., description="host:port of trainer pod 0's weight-transfer store (inside the "
                                 "cluster).")


class DocumentCounts(StatusModel):
    """What the trainer's stream readers did besides training, all ranks (entries = documents)."""

    redelivered: int = Field(0, ge=0, description="Re-read at a start (trained by an attempt that ended).")
    dead_lettered: dict[str, int] = Field(default_factory=dict, description="Malformed, by kind (DESIGN §3).")
    dropped_too_long: int = Field(0, ge=0, description="Over trainer.microBatchTokens.")
    dropped_stale: int = Field(0, ge=0, description="Staler than algorithm.maxStaleness.")
    lost_pending: int = Field(0, ge=0, description="Pending, but deleted from the stream before a re-read.")


class DocumentTotals(DocumentCounts):
    """Of the whole job: every attempt's :class:`DocumentCounts` summed, and what Redis forgot."""

    stream_losses: int = Field(0, ge=0, description="Times Redis forgot the stream (StreamLost).")
    stream_lost_entries: int = Field(0, ge=0, description="Pending + undelivered at the last read before each loss "
                                     "(an upper bound).")


class AttemptStatus(StatusModel):
    """One trainer gang attempt as the operator saw it; kept after its pods, Events and Redis records are gone."""

    attempt: int = Field(..., ge=0, description="Its number.")
    start_time: Optional[datetime] = Field(None, description="Its gang created.")
    end_time: Optional[datetime] = Field(None, description="Ended (none: running).")
    reason: Optional[str] = Field(None, description="Why it ended (the phase's reason, saved before any pod went).")
    message: str = Field("", max_length=4096, description="Why, in words.")
    data_parallel_size: Optional[int] = Field(None, ge=1, description="Its DP size.")
    restored_from_step: Optional[int] = Field(None, ge=0, description="Checkpoint step its trainer loaded (0: none).")
    checkpoint_path: Optional[str] = Field(None, description="That checkpoint's directory, when known.")
    step: Optional[int] = Field(None, ge=0, description="Last step seen.")
    documents: DocumentCounts = Field(default_factory=DocumentCounts, description="Its readers' counts.")


class AutoscalingStatus(StatusModel):
    """What the rollout autoscaler runs (spec.rollout.autoscaling; the spec is never written)."""

    replicas: int = Field(..., ge=0, description="Rollout replicas the job runs.")
    last_change_time: Optional[datetime] = Field(None, description="When the count last changed.")
    last_decision: Optional[str] = Field(None, max_length=4096, description="Why, with the numbers the law used.")


class CapacityStatus(StatusModel):
    """What the trainer and the rollout replicas measured of their waiting over their last 30 s windows (DESIGN §6
    "Capacity signals"), as the operator last read them; absent fields: not reported. Rounded (shares to 0.01, rates
    and counts to 2 significant figures), so that noise writes nothing."""

    data_wait_share: Optional[float] = Field(None, ge=0, le=1, description="Share of its time the trainer waited for "
                                             "documents (its last step record, while fresh).")
    held_share: Optional[float] = Field(None, ge=0, le=1, description="Rollout replicas' mean share of time held by "
                                        "back-pressure (maxPending, maxLag).")
    tokens_per_second: Optional[float] = Field(None, ge=0, description="Tokens sampled per second, replicas reporting "
                                               "summed.")
    tokens_per_second_per_replica: Optional[float] = Field(None, ge=0, description="Their mean per reporting replica.")
    pending: Optional[int] = Field(None, ge=0, description="Stream entries delivered, not acked (documents).")
    undelivered: Optional[int] = Field(None, ge=0, description="Stream entries written, not read yet (documents).")
    replicas_reporting: int = Field(0, ge=0, description="Rollout replicas below spec.rollout.replicas with a report "
                                    "of the last 60 s.")
    observed_at: datetime = Field(..., description="When the operator read these values (within their dead bands since).")


class RLTrainingJobStatus(StatusModel):
    """What the operator observed of an RLTrainingJob: phase, gang attempt, progress and conditions."""

    phase: Optional[c.Phase] = Field(
        None,
        description="Pending, Starting, Running, Restarting, Suspended, Succeeded, Failed or Invalid; a "
        "summary of the conditions.",
    )
    observed_generation: Optional[int] = Field(
        None, ge=0, description="The metadata.generation this status was computed from."
    )
    attempt: int = Field(
        0,
        ge=0,
        description="Number of the current trainer gang (the `rljob.dev/attempt` label of its pods); "
        "+1 on every gang restart and on every resume.",
    )
    restarts: int = Field(
        0,
        ge=0,
        description="Gang restarts after a trainer pod failure, eviction or deletion, or a change of a spec field the "
        "trainer reads (reason ConfigChanged; docs/field-reference.md).",
    )
    failed_attempts: int = Field(
        0,
        ge=0,
        description="Restarts counted against runPolicy.backoffLimit (evictions, preemptions and "
        "spec changes are not counted).",
    )
    gang_created: bool = Field(
        False,
        description="Every trainer pod of `attempt` has been created; from then on a missing pod is a "
        "deletion that restarts the gang.",
    )
    data_parallel_size: Optional[int] = Field(
        None, ge=1, description="Nodes × processesPerNode / (tensorParallel × pipelineParallel)."
    )
    start_time: Optional[datetime] = Field(
        None,
        description="When the job last started being active (reset on resume, like a Kubernetes Job); "
        "runPolicy.activeDeadlineSeconds counts from here.",
    )
    completion_time: Optional[datetime] = Field(
        None, description="When the job reached Succeeded or Failed."
    )
    step: Optional[int] = Field(None, ge=0, description="Optimizer steps done (from the progress hash).")
    documents_seen: Optional[int] = Field(
        None, ge=0, description="Documents that entered the loss, all ranks (documents)."
    )
    model_version: Optional[int] = Field(
        None, ge=0, description="Version of the trainer's weights, in documents (DESIGN §6)."
    )
    tokens_per_second: Optional[float] = Field(
        None, ge=0, description="Real tokens per second of the last step, all ranks."
    )
    rollout_reward: Optional[float] = Field(
        None,
        description="Mean raw reward of everything generated with the newest weights version "
        "(before filtering; the policy's performance, DESIGN §4).",
    )
    rollout_model_version: Optional[int] = Field(
        None, ge=0, description="The weights version rolloutReward was measured on."
    )
    reward: Optional[float] = Field(
        None,
        description="What the REWARD column of kubectl get shows: rolloutReward, or for a trainer-only job "
        "(spec.rollout.replicas 0, producers outside rljob) the mean reward of the samples the last step trained "
        "(lastMetrics.train_samples_reward).",
    )
    last_metrics: dict[str, float] = Field(
        default_factory=dict, description="Loss metrics of the last step by name (DESIGN §4)."
    )
    progress_percentage: Optional[int] = Field(
        None, ge=0, le=100, description="Percent of spec.trainer.maxSteps done, rounded down (100 once Succeeded)."
    )
    estimated_remaining_seconds: Optional[int] = Field(
        None, ge=0,
        description="Seconds left to maxSteps at the step rate of the last 10 minutes (rounded; only while Running).",
    )
    estimated_remaining_time_summary: Optional[str] = Field(
        None, description='estimatedRemainingSeconds for people, e.g. "12m" or "1h20m" (the ETA column).'
    )
    last_checkpoint: Optional[CheckpointStatus] = Field(
        None,
        description="The newest committed checkpoint: a gang restart goes on from it. Kept when Redis loses its "
        "record; step above it is training not saved yet.",
    )
    stream_identity: Optional[str] = Field(
        None, description="The identity of the job's stream in Redis (key {prefix}stream_id) as last read; another "
        "one, or none, means Redis forgot the stream (Event StreamLost).",
    )
    stream_lost_attempt: Optional[int] = Field(
        None, ge=0, description="The gang attempt during which Redis last forgot the stream; its restart is not "
        "counted against backoffLimit.",
    )
    stream: Optional[StreamStatus] = Field(
        None,
        description="The stream, events and weight-transfer addresses of the job, for producers outside rljob "
        "(spec.rollout.replicas 0, or beside rljob's own rollout pods).",
    )
    autoscaling: Optional[AutoscalingStatus] = Field(None, description="The autoscaler's count (with "
                                                     "spec.rollout.autoscaling).")
    capacity: Optional[CapacityStatus] = Field(
        None, description="Whether the trainer or the rollouts wait, while the job runs pods (docs/dashboards.md).")
    rollout_replicas: int = Field(
        0, ge=0, description="Rollout pods that exist and are not being deleted (/scale status.replicas).")
    rollout_selector: Optional[str] = Field(
        None, description="Label selector of the rollout pods (/scale status.selector, for an HPA).")
    attempts: list[AttemptStatus] = Field(default_factory=list, description="The last 20 gang attempts, oldest first.")
    document_totals: DocumentTotals = Field(default_factory=DocumentTotals,
                                            description="Documents not trained as written, over the whole job.")
    conditions: list[Condition] = Field(default_factory=list, description="The latest observations.")

    def condition(self, type_: c.ConditionType) -> Optional[Condition]:
        """The condition of ``type_``, or None when it was never set."""
        return next((cond for cond in self.conditions if cond.type == type_), None)
