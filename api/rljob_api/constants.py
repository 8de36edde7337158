"""Every name that two roles must agree on: API group, labels, annotations, env, ports, condition types and reasons
(Redis keys and fields: :mod:`rljob_api.protocol`).

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
LABEL_REWARD_SOURCE_HASH = f"{GROUP}/reward-source-hash"
"""On rollout pods of a job whose reward code comes from a ConfigMap (``spec.rollout.task.rewardSource.
configMapKeyRef``): short sha256 of that ConfigMap's data when the pod was made. Written and read by the operator: a rollout pod whose
value differs from the ConfigMap's current content is replaced (the trainer gang is not)."""
LABEL_KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
"""On a job (set by the user): its pods start only once Kueue admitted the job's Workload in this LocalQueue
(:mod:`rljob_operator.workload`). Never copied to pods, so Kueue's pod integration makes no Workload of its own."""
LABEL_KUEUE_PRIORITY_CLASS = "kueue.x-k8s.io/priority-class"
"""On a queued job (set by the user): the WorkloadPriorityClass whose value the job's Workload gets."""
ANNOTATION_WORKLOAD_PODSETS_HASH = f"{GROUP}/podsets-hash"
"""On a job's Workload: short sha256 of its pod sets as rendered. Written and read by the operator: a Workload whose
pod sets no longer match the spec (Kueue keeps them immutable) is replaced."""
ANNOTATION_WORKLOAD_SHAPE_HASH = f"{GROUP}/podsets-shape-hash"
"""On a job's Workload: short sha256 of its pod sets as rendered with the rollout pod set's count left out. Written and
read by the operator: a Workload that differs from the spec in that count alone is resized (an elastic Workload slice),
any other difference replaces it."""

# --- Kueue (the API the operator writes Workloads to) ------------------------------------------
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/v1beta2"
"""The storage version of the pinned Kueue (v0.17: v1beta2; served since Kueue v0.15)."""

# --- Annotations -----------------------------------------------------------------------------
ANNOTATION_RESOLVED_GENERATION = f"{GROUP}/resolved-generation"
"""On the config ConfigMap: the job's ``metadata.generation`` its config was resolved from. Written and read by the
operator: while the generation is the same, the recorded config is kept as it is (an upgraded operator's new
defaults reach a job only through an edit of the user's)."""
ANNOTATION_ROLE_CONFIG_HASHES = f"{GROUP}/role-config-hashes"
"""On the config ConfigMap: JSON {role: role config hash} of the recorded config, the hashes its pods carry."""
ANNOTATION_ALLOW_REDIS_DATA_LOSS = f"{GROUP}/allow-redis-data-loss"
"""On an RLTrainingJob, set by the user to ``"true"``: an edit of ``spec.redis.podTemplate`` may replace a managed Redis
that keeps its data in an emptyDir (its stream and hashes are lost). Without it such an edit is refused (Valid=False)
and the Redis keeps running as it is. Read by the operator; it stays in force while it is set."""
ANNOTATION_APPLIED_HASH = f"{GROUP}/applied-hash"
"""Short sha256 of the manifest the operator last applied, on the ConfigMap, the Services and the Redis Deployment.
Written and read by the operator: a restarted operator re-applies a child only when it differs."""


class Role(str, Enum):
    """The value of :data:`LABEL_ROLE`."""

    TRAINER = "trainer"
    ROLLOUT = "rollout"
    REDIS = "redis"
    CONFIG = "config"
    ENVIRONMENT = "environment"
    """The environment server the operator runs for a job's rollouts (``spec.rollout.environment.server``): its
    Deployment, Service, NetworkPolicy and pods."""


# --- Environment variables (set by the operator in pods; read by trainer and rollout) ----------
ENV_CONFIG = "RLJOB_CONFIG"
"""Path of the resolved config JSON inside every pod."""
ENV_REDIS_PASSWORD = "REDIS_PASSWORD"
ENV_REDIS_TLS_CA_FILE = "REDIS_TLS_CA_FILE"
"""Path of a PEM bundle of the CAs that sign the Redis server's TLS certificate (used when ``redis.tls`` is on);
unset: the system CA bundle. Read by trainer and rollout (rljob_wire.connection)."""
ENV_HF_TOKEN = "HF_TOKEN"
ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_REPLICA_INDEX = "RLJOB_REPLICA_INDEX"
"""Rollout replica index i (pod ``<job>-rollout-<i>``), or trainer node rank."""
ENV_ATTEMPT = "RLJOB_ATTEMPT"
ENV_REWARD_SOURCE = "RLJOB_REWARD_SOURCE"
"""On rollout pods with ``spec.rollout.task.rewardSource``: the path of the file the reward module is loaded from
(the ConfigMap key under :data:`REWARD_SOURCE_MOUNT_DIR`, or ``rewardSource.path``). Read by rljob_rollout."""
ENV_JOB_UID = "RLJOB_JOB_UID"
"""The RLTrainingJob's metadata.uid on trainer pods: with the attempt, the owner of the job's Redis writes."""
RESERVED_ENV_PREFIX = "RLJOB_"
"""Env names under it are rljob's, now or in a later version: a pod template may not set them, nor import them with an
``envFrom`` prefix."""
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
"""What torchrun sets for every rank of a trainer pod: the trainer's pod template may not set them."""
TORCHELASTIC_ENV_PREFIX = "TORCHELASTIC_"
"""torchrun's own variables (TORCHELASTIC_RUN_ID, ...): refused in the trainer's pod template, as a name or an envFrom
prefix."""

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
REWARD_SOURCE_MOUNT_DIR = "/etc/rljob-reward"
"""Where rollout pods mount the ConfigMap of ``spec.rollout.task.rewardSource.configMapKeyRef`` (read-only, every key a
file)."""
SHM_MOUNT_DIR = "/dev/shm"
TERMINATION_LOG = "/dev/termination-log"
"""The container's termination message file (Kubernetes' default ``terminationMessagePath``): where a trainer or rollout
process that cannot start writes its one line (:mod:`rljob_api.start_failure`), which the kubelet keeps in the pod's
status whatever the process logged after (torchrun's own error report, on trainer pods)."""
ENV_TERMINATION_LOG = "RLJOB_TERMINATION_LOG"
"""Another path for :data:`TERMINATION_LOG` (unset in pods; runs outside Kubernetes and tests point it at a file)."""

# --- Exit codes of the trainer and rollout entry points (sysexits.h) -----------------------------
EXIT_START_FAILED = 78
"""EX_CONFIG: the process cannot start because the config names something this image or cluster does not have (a
model that is not there, a tokenizer missing, a backend the image lacks ...). Retrying cannot help; the operator fails
the job (reason StartFailed) on the termination message :mod:`rljob_api.start_failure` writes with it (a trainer
rank's code does not survive torchrun, which exits 1: the message is what the operator reads)."""
EXIT_START_RETRY = 75
"""EX_TEMPFAIL: the process cannot start for now (the Hugging Face Hub unreachable after its retries): the pod fails
like any other (a counted gang restart; a rollout container's restart with the kubelet's back-off)."""

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

# --- Conditions (metav1.Condition shaped; written by the operator) ----------------------------
class ConditionType(str, Enum):
    VALID = "Valid"
    REDIS_READY = "RedisReady"
    ROLLOUT_READY = "RolloutReady"
    ENVIRONMENT_READY = "EnvironmentReady"
    """Only on jobs with ``spec.rollout.environment.server`` or ``url``: whether the environment their rollouts step
    answers (rljob_operator.job_status)."""
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
    EXTERNAL_PRODUCERS = "ExternalProducers"
    """RolloutReady=True of a trainer-only job (``spec.rollout.replicas`` 0): rljob runs no rollout pod, producers
    outside rljob write the stream; the message names the stream, group, events key and Redis address."""
    REWARDS_FAILING = "RewardsFailing"
    """Failed: the reward function failed on every sample of every rollout batch for
    ``spec.rollout.rewardFailureDeadlineSeconds``; the message counts the exceptions by class and message."""
    CONTAINER_CANNOT_START = "ContainerCannotStart"
    """A pod's container waits for something that will not come by itself (CreateContainerConfigError such as a
    missing Secret, ImagePullBackOff, ErrImagePull, CreateContainerError ...); the message names the kubelet's reason."""
    CONTAINER_FAILING = "ContainerFailing"
    """A pod's container keeps exiting with an error and being restarted (CrashLoopBackOff); the message gives the
    restart count and the last exit code and termination message."""
    STREAM_LOST = "StreamLost"
    """Redis forgot the job's stream (its identity key changed or vanished: a managed Redis without persistence
    restarted, an external one flushed or failed over): a Warning Event says what was lost; the gang restart that
    follows is not counted against backoffLimit."""
    CLAIM_PENDING = "ClaimPending"
    """RedisReady=False: the managed Redis's data claim (``spec.redis.persistence``) cannot bind; the message names the
    claim, its storage class and the reason of the claim's Event (e.g. 'storageclass.storage.k8s.io "fast" not
    found')."""
    REDIS_REPLACED = "RedisReplaced"
    """Warning Event: ``spec.redis.persistence.enabled`` was switched on a job whose managed Redis existed, so the Redis
    pod was replaced and its data (stream, consumer group, pending entries, progress and checkpoint hashes) started
    empty."""
    REWARD_SOURCE_MISSING = "RewardSourceMissing"
    """RolloutReady=False: the ConfigMap of ``spec.rollout.task.rewardSource.configMapKeyRef``, or its key, does not
    exist, so rollout pods cannot start (the kubelet cannot mount it); the message names the ConfigMap and key."""
    WAITING_FOR_ADMISSION = "WaitingForAdmission"
    """Pending: the job's Workload is not admitted by Kueue (yet); the message quotes Kueue's condition."""
    EVICTED_BY_KUEUE = "EvictedByKueue"
    """Pending: Kueue evicted the job's Workload (preemption, a stopped queue, deactivation ...): its pods are deleted
    like a suspend, not counted against backoffLimit, and the job waits to be admitted again."""
    SCALE_UP_WAITING_FOR_QUOTA = "ScaleUpWaitingForQuota"
    """RolloutReady=False of a queued job scaled up: the Workload slice for the new ``spec.rollout.replicas`` waits for
    Kueue (the message quotes it) while the job runs on the admitted count; nothing restarts."""
    ELASTIC_JOBS_OFF = "ElasticJobsOff"
    """Warning Event: Kueue refused to lower a queued job's admitted rollout count in place (its feature gate
    ElasticJobsViaWorkloadSlices is off), so the Workload is made again and the job queues anew."""
    ROLLOUTS_SCALED = "RolloutsScaled"
    """Event: the rollout autoscaler changed the replica count (spec.rollout.autoscaling); the message is the law's
    reason, with the numbers it used."""
    KUEUE_INADMISSIBLE = "KueueInadmissible"
    """Pending: Kueue cannot queue the job's Workload (its QuotaReserved condition's reason Inadmissible): the
    LocalQueue the job's label names, or its ClusterQueue, does not exist or is stopped; the message quotes Kueue and
    names the LocalQueue and namespace."""
    KUEUE_NOT_AVAILABLE = "KueueNotAvailable"
    """Pending: the job asks for a Kueue queue but the cluster serves no Kueue Workload API, or the job's
    WorkloadPriorityClass does not exist."""
    START_FAILED = "StartFailed"
    """Failed: a trainer pod of the current attempt or a rollout pod could not start for a reason retrying cannot fix
    (:data:`EXIT_START_FAILED`, :mod:`rljob_api.start_failure`); the message names the pod, the spec field and its value
    (e.g. ``spec.model.name``: not in the pod's Hugging Face cache with HF_HUB_OFFLINE set)."""
    TRAINER_STARTING = "TrainerStarting"
    """Starting (Running=False): the attempt's trainer pods run, but its rank 0 has not reported the attempt's start yet
    (the progress hash's ``started_attempt``, written once the model and checkpoint are loaded): no step can be made
    before."""
    ENVIRONMENT_AVAILABLE = "EnvironmentAvailable"
    """EnvironmentReady=True: every replica of the environment server's Deployment is available (ready on its port)."""
    READINESS_FAILING = "ReadinessFailing"
    """EnvironmentReady=False: an environment server container has run for a while but nothing answers on
    ``spec.rollout.environment.server.port`` (its readiness probe, a TCP connection to that port, does not pass); the
    message names the field and the port."""
    EXTERNAL_ENVIRONMENT = "ExternalEnvironment"
    """EnvironmentReady=Unknown: ``spec.rollout.environment.url`` is a server outside the job, which the operator does
    not probe (from the operator's network a probe would not tell whether the rollout pods reach it)."""
    CHECKPOINT_LOST = "CheckpointLost"
    """Running=True, but the attempt started below the last recorded checkpoint because it is gone from the checkpoint
    volume (the progress hash's ``checkpoint_lost``)."""
