"""Every name that two roles must agree on: API group, labels, annotations, env, ports, Redis keys,
condition types and reasons.

Who writes and who reads each key is said next to it. Nothing else in the project spells these strings.
"""

from __future__ import annotations

from enum import Enum

# --- API identity -------------------------------------------------------------------------------
GROUP = "rljob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rljob"]
CRD_NAME = f"{PLURAL}.{GROUP}"
FIELD_MANAGER = "rljob-operator"

# --- Labels (written by the operator on every child; read by the operator's selectors) ---------
LABEL_JOB_NAME = f"{GROUP}/job-name"
"""Name of the owning RLTrainingJob, on every child object."""
LABEL_ROLE = f"{GROUP}/role"
"""One of :class:`Role`, on every child object."""
LABEL_ATTEMPT = f"{GROUP}/attempt"
"""Gang attempt number (0-based) on trainer pods; pods of different attempts never coexist."""
LABEL_CONFIG_HASH = f"{GROUP}/config-hash"
"""Short sha256 of the resolved config JSON, on every pod that mounts it."""
LABEL_ROLE_CONFIG_HASH = f"{GROUP}/role-config-hash"
"""Short sha256 of the part of the resolved config that the pod's role reads (trainer pods: the config without the
rollout-only fields; rollout pods: without spec.rollout.replicas), on trainer and rollout pods. Written and read by
the operator: a pod is outdated only when this changes, so a rollout-only change never restarts the trainer gang."""
LABEL_REPLICA_INDEX = f"{GROUP}/replica-index"
"""Trainer node rank or rollout replica index, on pods."""
LABEL_KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
"""Copied from the job's labels to its pods (Kueue compatibility)."""

# --- Annotations -----------------------------------------------------------------------------
ANNOTATION_APPLIED_HASH = f"{GROUP}/applied-hash"
"""Short sha256 of the manifest the operator last applied, on the ConfigMap, the Services and the Redis Deployment.
Written and read by the operator: a restarted operator re-applies a child only when it differs."""


class Role(str, Enum):
    """The value of :data:`LABEL_ROLE`."""

    TRAINER = "trainer"
    ROLLOUT = "rollout"
    REDIS = "redis"
    CONFIG = "config"


# --- Environment variables (set by the operator in pods; read by trainer and rollout) ----------
ENV_CONFIG = "RLJOB_CONFIG"
"""Path of the resolved config JSON inside every pod."""
ENV_REDIS_PASSWORD = "REDIS_PASSWORD"
ENV_REDIS_TLS_CA_FILE = "REDIS_TLS_CA_FILE"
"""Path of a PEM bundle of the CAs that sign the Redis server's TLS certificate (used when ``redis.tls`` is on);
unset: the system CA bundle. Read by trainer and rollout (rljob_trainer.stream.connection)."""
ENV_HF_TOKEN = "HF_TOKEN"
ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_REPLICA_INDEX = "RLJOB_REPLICA_INDEX"
"""Rollout replica index i (pod ``<job>-rollout-<i>``), or trainer node rank."""
ENV_ATTEMPT = "RLJOB_ATTEMPT"

CONFIG_MOUNT_DIR = "/etc/rljob"
CONFIG_FILE_NAME = "config.json"
CONFIG_PATH = f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE_NAME}"
CHECKPOINT_MOUNT_DIR = "/var/lib/rljob/checkpoints"
EXPORT_SUBDIR = "export"
"""Sub-directory of the checkpoint directory where trainer rank 0 writes the final weights (safetensors, Hugging Face
layout) at maxSteps; the operator names ``CHECKPOINT_MOUNT_DIR/EXPORT_SUBDIR`` in the Succeeded condition."""
REDIS_CA_MOUNT_DIR = "/etc/rljob-redis-ca"
"""Where trainer and rollout pods mount ``spec.redis.caSecretRef`` (read-only); env REDIS_TLS_CA_FILE names the file."""
REDIS_CA_PATH = f"{REDIS_CA_MOUNT_DIR}/ca.crt"
SHM_MOUNT_DIR = "/dev/shm"

#: The extended resource of an NVIDIA GPU (device plugin), in pod resources and node capacity.
GPU_RESOURCE = "nvidia.com/gpu"

# --- Ports (declared on the headless trainer Service so DNS names reach them) -----------------
PORT_RENDEZVOUS = 29400
"""torchrun c10d rendezvous store on trainer pod 0."""
PORT_MASTER = 29500
"""torch.distributed master port (MASTER_PORT) on trainer pod 0."""
PORT_WEIGHTS = 29600
"""TCPStore of the weight-transfer group on trainer pod 0 (DESIGN §3)."""
PORT_METRICS = 9400
"""Prometheus endpoint of trainer rank 0 and of rollout workers."""
PORT_REDIS = 6379

# --- Redis keys (DESIGN §2, §3) --------------------------------------------------------------
DEFAULT_STREAM_KEY = "fast_llm_streaming"
DEFAULT_GROUP_NAME = "fast_llm_group"
DEFAULT_CONSUMER_PREFIX = "fast_llm_consumer_"
DEFAULT_EVENTS_KEY = "fast_llm_events"
KEY_PROGRESS = "progress"
"""Hash written by trainer rank 0 after each step; read by the operator."""
KEY_ROLLOUT = "rollout"
"""Hash written by rollout workers; read by the operator."""
KEY_MEMBERS = "members"
"""Hash of rollout worker heartbeats (field = transfer rank, value = JSON {"time": Redis TIME seconds, "version":
loaded model_version or null, "instance": worker process id}; a bare unix time is accepted too). Written by rollout
workers, read by trainer rank 0 (rljob_trainer.weights)."""
KEY_DEAD_LETTER = "dead_letter"
"""Stream of malformed entries with their reason (written by trainer ranks)."""
KEY_CHECKPOINT = "checkpoint"
"""Hash: last committed checkpoint (step, documents_seen, path); written by trainer rank 0."""

# Fields of the progress hash (trainer global rank 0 writes them after each step; the operator reads them).
PROGRESS_STEP = "step"
PROGRESS_DOCUMENTS_SEEN = "documents_seen"
PROGRESS_MODEL_VERSION = "model_version"
PROGRESS_TOKENS_PER_SECOND = "tokens_per_second"
PROGRESS_METRICS = "metrics"
"""JSON object {metric name: number} of the last step (DESIGN §4 names)."""
PROGRESS_CHECKPOINT_DOCUMENTS_SEEN = "checkpoint_documents_seen"
"""documents_seen of the checkpoint the trainer's attempt last committed or started from (0 from scratch): the
documents trained since then (documents_seen − this) are still pending in the stream's group, acked by the next
checkpoint. Written by trainer rank 0 at every start and before each checkpoint's acks; rollout workers read it
(rljob_trainer.rollout.writer: max lag)."""
PROGRESS_RESTORED_FROM_STEP = "restored_from_step"
"""Step of the checkpoint the trainer's current attempt started from (0 from scratch); written at every start."""
PROGRESS_CHECKPOINT_LOST = "checkpoint_lost"
"""Present (JSON {step, path, restored_from_step, message}) while the trainer's current attempt started below the
checkpoint the Redis checkpoint hash records, because that checkpoint is gone from the checkpoint volume (an
emptyDir does not survive a gang restart or suspend); deleted by a start that loses none. Trainer rank 0 writes it;
the operator may report it."""

# Fields of the rollout hash. Rollout workers add to them (HINCRBYFLOAT / HINCRBY), so several workers sum up;
# the operator reports sum / count of the newest model version as status.rolloutReward.
ROLLOUT_REWARD_SUM_PREFIX = "reward_sum:"
"""``reward_sum:{model_version}``: sum of raw rewards of every document generated with that weights version."""
ROLLOUT_REWARD_COUNT_PREFIX = "reward_count:"
"""``reward_count:{model_version}``: number of documents generated with that weights version."""
ROLLOUT_REWARD_VERSIONS_KEPT = 128
"""The rollout hash keeps ``reward_sum:{v}`` / ``reward_count:{v}`` of the newest this many weights versions (by v);
rollout workers delete older pairs in the transaction that adds a batch, so the hash stays bounded over a long run.
128 versions = 128 optimizer steps of reward history, enough for a learning curve; the operator reads only the newest."""
ROLLOUT_REWARD = "reward"
"""Mean reward of ``reward_version`` (sum / count over every worker), set by the worker that wrote last."""
ROLLOUT_REWARD_VERSION = "reward_version"
ROLLOUT_ALL_REWARDS_FAILED = "all_rewards_failed"
"""Present (JSON {version, samples, errors: {kind: count}, message}) while a worker's last batch had no sample
whose reward function returned; deleted by the next batch that has one. The operator reports it
(Reason.ALL_REWARDS_FAILED) instead of letting the job train on nothing."""
ROLLOUT_REWARD_ERRORS_PREFIX = "reward_errors:"
"""``reward_errors:{exception class}``: samples dropped because the reward function raised that (count)."""

EVENT_WEIGHTS_READY = "weights_ready"
EVENT_TRAINING_FINISHED = "training_finished"


def key_prefix(namespace: str, job: str) -> str:
    """Prefix of every rljob key for one job: ``rljob:{namespace}:{job}:``."""
    return f"rljob:{namespace}:{job}:"


# --- Conditions (metav1.Condition shaped; written by the operator) ----------------------------
class ConditionType(str, Enum):
    VALID = "Valid"
    REDIS_READY = "RedisReady"
    ROLLOUT_READY = "RolloutReady"
    TRAINER_READY = "TrainerReady"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Phase(str, Enum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    INVALID = "Invalid"


class Reason(str, Enum):
    """Condition and Event reasons (CamelCase, as Kubernetes API conventions ask)."""

    SPEC_VALID = "SpecValid"
    INVALID_SPEC = "InvalidSpec"
    NOT_SUPPORTED = "NotSupported"
    REDIS_AVAILABLE = "RedisAvailable"
    REDIS_UNAVAILABLE = "RedisUnavailable"
    PODS_READY = "PodsReady"
    PODS_NOT_READY = "PodsNotReady"
    UNSCHEDULABLE = "Unschedulable"
    WAITING_FOR_GANG = "WaitingForGang"
    TRAINING = "Training"
    TEARING_DOWN = "TearingDown"
    POD_FAILED = "PodFailed"
    POD_EVICTED = "PodEvicted"
    POD_DELETED = "PodDeleted"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    JOB_SUSPENDED = "JobSuspended"
    JOB_RESUMED = "JobResumed"
    TRAINING_FINISHED = "TrainingFinished"
    CONFIG_CHANGED = "ConfigChanged"
    POD_LOST = "PodLost"
    GANG_CREATED = "GangCreated"
    ALL_REWARDS_FAILED = "AllRewardsFailed"
    CONTAINER_CANNOT_START = "ContainerCannotStart"
    """A pod's container waits for something that will not come by itself (CreateContainerConfigError such as a
    missing Secret, ImagePullBackOff, ErrImagePull, CreateContainerError ...); the message names the kubelet's reason."""
    CONTAINER_FAILING = "ContainerFailing"
    """A pod's container keeps exiting with an error and being restarted (CrashLoopBackOff); the message gives the
    restart count and the last exit code and termination message."""
    CHECKPOINT_LOST = "CheckpointLost"
    """Running=True, but the attempt started below the last recorded checkpoint because it is gone from the checkpoint
    volume (the progress hash's ``checkpoint_lost``)."""
