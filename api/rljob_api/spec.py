"""The RLTrainingJob spec: one pydantic model read by the operator, the trainer and the rollout workers.

Field names are snake_case in Python and camelCase on the wire (the CRD and the resolved config JSON).
Each field's description becomes the CRD's ``description`` (``kubectl explain``); defaults, enums and
bounds become the CRD's schema. Rules that only code can check live in :mod:`rljob_api.validation`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field

from rljob_api import protocol, rules
from rljob_api.api_model import ApiModel, omitted_at_default
from rljob_api.pod_template import PodTemplateOverride, kube_list, pod_template_field

_COUNTS = rules.TRAINER_COUNT_BOUNDS


# --- model ------------------------------------------------------------------------------------
class TinyModelSpec(ApiModel):
    """A randomly initialised Llama-style causal LM built in process (no downloads): for tests and laptops."""

    layers: int = Field(2, ge=1, le=64, description="Number of transformer blocks.")
    hidden_size: int = Field(64, ge=8, le=8192, description="Width of the residual stream.")
    heads: int = Field(4, ge=1, le=128, description="Attention heads; must divide hiddenSize.")
    intermediate_size: int = Field(
        256, ge=8, le=65536, description="Width of the MLP hidden layer."
    )
    max_position_embeddings: int = Field(
        256, ge=16, le=131072, description="Longest document in tokens."
    )


class ModelSpec(ApiModel):
    """Which causal LM is trained and served."""

    source: Literal["tiny", "huggingface", "path"] = Field(
        ...,
        description="Required. `tiny` builds a small random model from `tiny` (tests, no downloads); "
        "`huggingface` loads `name` from the Hugging Face Hub (HF_TOKEN from `hfTokenSecretRef`); "
        "`path` loads a model directory from `path` (a PVC mounted by `volume`).",
    )
    name: Optional[str] = Field(
        None,
        min_length=1,
        max_length=256,
        description="Hugging Face model id (required when source=huggingface); a display name otherwise.",
    )
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    path: Optional[str] = Field(None, description="Model directory inside the pod (source=path).")
    volume: Optional[str] = Field(
        None, description="PersistentVolumeClaim mounted read-only at `path`'s parent (source=path)."
    )
    tiny: TinyModelSpec = Field(default_factory=TinyModelSpec, description="Shape of the tiny model.")


# --- algorithm --------------------------------------------------------------------------------
class ImportanceSamplingSpec(ApiModel):
    """The decoupled PPO objective of asynchronous RL (AReaL, Fu et al. 2025, arXiv:2505.24298) with the behaviour
    weight truncated at ``cap`` (truncated importance sampling, Yao et al. 2025)."""

    enabled: bool = Field(
        False,
        description="Off by default. On: each labelled token's (gspo: each document's) clipped objective is weighted "
        "by min(pi_prox / pi_behaviour, cap), the PPO ratio taken against pi_prox, the trainer's weights at the "
        "start of the step (DESIGN §4, docs/field-reference.md).",
    )
    cap: float = Field(
        rules.DEFAULT_IS_CAP,
        ge=1,
        le=1000,
        description="Largest behaviour weight pi_prox / pi_behaviour; larger weights are truncated to it (at least 1, "
        "so on-policy tokens keep weight 1). Used only with enabled: another cap with enabled false is refused.",
    )


class AlgorithmSpec(ApiModel):
    """The policy-gradient loss and its metrics (DESIGN §4)."""

    loss: Literal["grpo", "gspo"] = Field(
        "grpo",
        description="`grpo` (token-level clipped ratio, DeepSeekMath) or `gspo` (sequence-level "
        "ratio, Qwen GSPO, in Fast-LLM's length-weighted form).",
    )
    epsilon_low: Optional[float] = Field(
        None,
        gt=0,
        lt=1,
        description="Lower clip range, the ratio is clipped at 1 - epsilonLow. "
        "Default 0.2 for grpo, 3e-4 for gspo. Refused with importanceSampling enabled, where the ratio is 1.",
    )
    epsilon_high: Optional[float] = Field(
        None,
        gt=0,
        le=10,
        description="Upper clip range, the ratio is clipped at 1 + epsilonHigh. "
        "Default 0.2 for grpo, 4e-4 for gspo. Refused with importanceSampling enabled, where the ratio is 1.",
    )
    metrics: Literal["none", "basic", "full", "auto"] = Field(
        "auto",
        description="`none`; `basic` (every loss metric but entropy); `full` (basic + entropy, "
        "a second pass over the vocabulary); `auto` (basic when pipelineParallel = 1, else none).",
    )

    dual_clip: Optional[float] = Field(
        None,
        gt=1,
        le=100,
        exclude_if=omitted_at_default(None),
        description="Dual clip for negative advantages (Ye et al. 2020): where A < 0 the clipped surrogate is bounded "
        "below by dualClip x A. Unset (the default): off; 3 is usual. Refused with importanceSampling enabled "
        "(docs/field-reference.md).",
    )
    importance_sampling: ImportanceSamplingSpec = Field(
        default_factory=ImportanceSamplingSpec,
        exclude_if=omitted_at_default(ImportanceSamplingSpec()),
        description="The decoupled objective of asynchronous RL (AReaL, Fu et al. 2025) with truncated importance "
        "sampling (Yao et al. 2025). Off by default.",
    )
    max_staleness: Optional[int] = Field(
        None,
        ge=0,
        exclude_if=omitted_at_default(None),
        description="Documents sampled more than this many documents behind the trainer are dropped before the loss "
        "(counted as dropped_stale, acknowledged with the next checkpoint). Unset (the default): nothing is dropped "
        "(docs/field-reference.md).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=100,
        exclude_if=omitted_at_default(0.0),
        description="Weight of a KL penalty to a frozen reference policy (the model spec.model names, sharded like the "
        "trained one), added to every labelled token's loss; its estimate is the metric kl_ref. 0 (the default): "
        "off, and no reference model is loaded.",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        rules.DEFAULT_KL_ESTIMATOR,
        exclude_if=omitted_at_default(rules.DEFAULT_KL_ESTIMATOR),
        description="Estimator of KL(trained || reference) per token, from the log-ratio d = lp_ref - lp (Schulman, "
        "'Approximating KL Divergence', 2020): k1 = -d (unbiased, may be negative); k3 = exp(d) - 1 - d (unbiased, "
        "never negative; DeepSeekMath's GRPO uses it). Used only with klCoef > 0: k1 with klCoef 0 is refused.",
    )

    def resolved_epsilons(self) -> tuple[float, float]:
        """(epsilon_low, epsilon_high) with the loss's defaults filled in (GRPO 0.2/0.2, GSPO 3e-4/4e-4)."""
        low_default, high_default = (0.2, 0.2) if self.loss == "grpo" else (3e-4, 4e-4)
        return (
            self.epsilon_low if self.epsilon_low is not None else low_default,
            self.epsilon_high if self.epsilon_high is not None else high_default,
        )


# --- trainer ----------------------------------------------------------------------------------
class BatchSpec(ApiModel):
    documents_per_step: int = Field(
        128,
        ge=1,
        description="Documents (sampled completions) per optimizer step, global over "
        "all data-parallel ranks; must be divisible by the data-parallel size.",
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=16,
        description="Token budget of one packed micro-batch per rank; a document longer "
        "than this is dropped and counted, never truncated.",
    )


class OptimizerSpec(ApiModel):
    learning_rate: float = Field(1e-6, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up in steps.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        exclude_if=omitted_at_default("constant"),
        description="Learning rate after the warm-up: constant (the default) keeps learningRate; linear and cosine "
        "decay it to minLearningRate at maxSteps, which needs maxSteps >= warmupSteps + 2 (docs/field-reference.md).",
    )
    min_learning_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        exclude_if=omitted_at_default(0.0),
        description="The floor the linear and cosine schedules decay to, below learningRate. Only with schedule linear "
        "or cosine: another value than 0 with schedule constant is refused.",
    )


class CheckpointSpec(ApiModel):
    every_steps: int = Field(10, ge=1, description="Write a checkpoint every this many steps.")
    keep_last: int = Field(2, ge=1, le=100, description="Checkpoints kept; older ones are deleted.")
    volume: Optional[str] = Field(
        None,
        description="PersistentVolumeClaim for checkpoints (ReadWriteMany when nodes > 1). Without "
        "it checkpoints live in an emptyDir and a gang restart starts from step 0.",
    )
    init_from: Optional[str] = Field(
        None, description="A checkpoint directory to start from (weights, optimizer, step)."
    )


class ExportSpec(ApiModel):
    safetensors: bool = Field(
        True, description="Export final weights as safetensors in Hugging Face layout."
    )


class TensorBoardSpec(ApiModel):
    """TensorBoard event files of the trainer: global rank 0 writes every step's metrics as scalars."""

    log_dir: str = Field(
        ...,
        pattern=r"^/",
        max_length=4096,
        description="Required. Absolute directory in the trainer container, on a volume that outlives the pods, one "
        "per job: global rank 0 writes the event files there, one scalar per step metric. Refused: / and rljob's own "
        "mounts (docs/field-reference.md).",
    )


class ParallelismSpec(ApiModel):
    """How the trainer's data-parallel ranks hold the model (DESIGN §5)."""

    strategy: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="fsdp (the default): parameters, gradients and optimizer state are sharded over the data-parallel "
        "ranks (FSDP2), for every model size; ddp: every rank holds the whole model and optimizer state, a little "
        "faster for models that fit on one GPU (docs/field-reference.md, docs/trainer-memory.md).",
    )
    replicate: int = Field(
        1,
        ge=rules.REPLICATE_BOUNDS[0],
        le=rules.REPLICATE_BOUNDS[1],
        description="fsdp only: data-parallel replica groups (HSDP, a 2-D mesh replicate x shard). Each group holds "
        "one sharded copy of the model over dataParallelSize/replicate ranks; gradients are reduce-scattered within "
        "a group and all-reduced across groups. Must divide the data-parallel size; 1 shards over every rank.",
    )


class PrecisionSpec(ApiModel):
    """Floating-point formats of training (FSDP2's MixedPrecisionPolicy; autocast under ddp). On CPU the trainer
    computes in float32 whatever is set here (no fast bfloat16 there)."""

    param: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="Format of the parameters the forward and backward compute with on GPU (bf16, the field's "
        "usual choice), under both strategies: fsdp all-gathers the parameters in it, ddp computes under autocast to "
        "it. The master weights and the optimizer state stay float32.",
    )
    reduce: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Format in which fsdp reduces gradients across ranks: fp32 (the default) sums without rounding "
        "loss; bf16 halves the bytes sent. ddp always all-reduces the gradients in float32, so bf16 with strategy "
        "ddp is refused.",
    )


class TrainerSpec(ApiModel):
    """The trainer gang: `nodes` pods, each running torchrun with `processesPerNode` ranks."""

    image: str = Field("rljob/trainer-cpu:0.1.0", min_length=1, description="Trainer container image.")
    # The one value runs rljob's own loop. The field stays (with only that value) because the resolved configs of
    # running jobs hold it: dropping it would change their role hashes and restart every gang on an upgrade.
    backend: Literal["builtin"] = Field("builtin", json_schema_extra={"enum": ["builtin"]},
                                        description="The training loop: `builtin`, rljob's own.")
    nodes: int = Field(1, ge=_COUNTS["nodes"][0], le=_COUNTS["nodes"][1],
                       description="Trainer pods in the gang (torchrun nnodes). Editable while the job runs, like "
                                   "processesPerNode: the gang restarts at the new size from the last checkpoint, "
                                   "resharded.")
    processes_per_node: int = Field(
        1, ge=_COUNTS["processesPerNode"][0], le=_COUNTS["processesPerNode"][1],
        description="Ranks per pod (torchrun nproc-per-node), usually GPUs."
    )
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec,
                                         description="Sharded (fsdp, the default) or replicated (ddp) data parallelism.")
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec, description="Compute and gradient-reduce formats.")
    activation_checkpointing: Literal["none", "full"] = Field(
        "none",
        description="full: every decoder block recomputes its activations in the backward instead of keeping them "
        "(about a third more compute, activation memory of one block instead of all); none keeps them.",
    )
    tensor_parallel: int = Field(1, ge=_COUNTS["tensorParallel"][0], le=_COUNTS["tensorParallel"][1],
                                 description="Tensor-parallel degree; only 1 is supported yet.")
    pipeline_parallel: int = Field(1, ge=_COUNTS["pipelineParallel"][0], le=_COUNTS["pipelineParallel"][1],
                                   description="Pipeline-parallel degree; only 1 is supported yet.")
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="Container resources (requests/limits) of each trainer pod, e.g. "
        "{limits: {nvidia.com/gpu: 8}}.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod node selector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations.")
    pod_template: Optional[PodTemplateOverride] = pod_template_field(
        "trainer", "A change restarts the gang from its newest checkpoint, like other trainer fields.")
    batch: BatchSpec = Field(default_factory=BatchSpec, description="Step and micro-batch sizes.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="AdamW settings.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Cadence, storage.")
    export: ExportSpec = Field(default_factory=ExportSpec, description="Final weight export.")
    tensorboard: Optional[TensorBoardSpec] = Field(
        None,
        exclude_if=omitted_at_default(None),
        description="TensorBoard event files of every step's metrics, written by global rank 0. Unset (the default): "
        "none.",
    )
    weight_sync_bucket_megabytes: Optional[int] = Field(
        None,
        ge=1,
        le=4096,
        exclude_if=omitted_at_default(None),
        description="Bucket size, in MiB, of the packed weight publication to rljob's rollout backends (unset: 64). "
        "Trainer rank 0 keeps two buckets on the device it publishes from, a vLLM rollout process up to five during "
        "an update (docs/field-reference.md).",
    )
    max_steps: int = Field(100, ge=1, description="Optimizer steps, then training_finished.")
    seed: int = Field(0, ge=0, description="Model init and data-order seed.")
    collective_timeout_seconds: int = Field(
        600,
        ge=10,
        description="torch.distributed collective timeout; a hang becomes a crash "
        "and a gang restart. Must exceed a weight transfer.",
    )
    rendezvous_timeout_seconds: int = Field(
        900,
        ge=10,
        description="How long scheduled ranks wait for the whole gang.",
    )
    data_timeout_seconds: int = Field(
        1800, ge=1, description="A rank with no stream data for this long exits with an error."
    )


# --- rollout ----------------------------------------------------------------------------------
class SamplingSpec(ApiModel):
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(256, ge=1, le=131072, description="Completion length limit.")


class ConfigMapKeyRef(ApiModel):
    name: str = Field(..., min_length=1, max_length=253, description="ConfigMap name in the job's namespace.")
    key: str = Field(
        ...,
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key of the ConfigMap that holds the reward module's Python source.",
    )


class RewardSourceSpec(ApiModel):
    """The reward function's code when the rollout image does not hold it: a ConfigMap key, or a file on a volume."""

    config_map_key_ref: Optional[ConfigMapKeyRef] = Field(
        None,
        description="A key of a ConfigMap in the job's namespace, mounted whole read-only at /etc/rljob-reward in the "
        "rollout pods, which are replaced when its content changes (docs/rewards.md).",
    )
    path: Optional[str] = Field(
        None,
        min_length=2,
        max_length=4096,
        pattern=r"^/",
        description="Absolute path of the module's file in the rollout container, on `volume` (or on model.volume); "
        "rollout pods keep the code they loaded at start (docs/rewards.md).",
    )
    volume: Optional[str] = Field(
        None,
        min_length=1,
        max_length=253,
        description="PersistentVolumeClaim mounted read-only at path's parent directory in the rollout pods.",
    )


DIGIT_TASKS = ("digits-copy", "digits-reverse", "digits-sort")
"""The built-in toy tasks (DESIGN §10): digit prompts, digit completions, the digits-only tokenizer of a tiny model."""


class TaskSpec(ApiModel):
    name: Literal["digits-copy", "digits-reverse", "digits-sort", "math", "custom", rules.ENVIRONMENT_TASK] = Field(
        "digits-copy",
        description="`digits-copy`/`digits-reverse`/`digits-sort` (built-in toy tasks, DESIGN §10: the completion is "
        "the prompt's digits as they are, reversed, or in ascending order); `math` (JSONL question/answer, numeric "
        "answer); `custom` (prompts from `datasetPath`, reward from `rewardFunction`); `environment` (multi-turn "
        "episodes against spec.rollout.environment).",
    )
    dataset_path: Optional[str] = Field(None, description="JSONL file of prompts (math, custom).")
    reward_function: Optional[str] = Field(
        None, description="`module:function` returning a float reward (custom)."
    )
    digits: int = Field(4, ge=1, le=32, description="Prompt and completion length of the toy task.")
    reward_source: Optional[RewardSourceSpec] = Field(
        None,
        exclude_if=omitted_at_default(None),
        description="Where rewardFunction's module comes from when the rollout image does not hold it (task custom): "
        "exactly one of configMapKeyRef or path; changing it replaces the rollout pods only. Unset (the default): "
        "the image (docs/rewards.md).",
    )


DEFAULT_ENVIRONMENT_PORT = 8000
"""Port of an environment server: OpenEnv's (its servers listen on 8000)."""


class EnvironmentServerSpec(ApiModel):
    """An environment server the operator runs for the job: a Deployment and Service `<job>-environment`."""

    image: str = Field(..., min_length=1, description="Required. Image of the environment server.")
    command: list[Annotated[str, Field(description="A word.")]] = Field(
        default_factory=list, description="Entrypoint; unset: the image's.")
    args: list[Annotated[str, Field(description="A word.")]] = Field(
        default_factory=list, description="Arguments; unset: the image's.")
    port: int = Field(DEFAULT_ENVIRONMENT_PORT, ge=1, le=65535,
                      description="Port the server listens on (HTTP and WebSocket); OpenEnv's is 8000.")
    replicas: int = Field(1, ge=1, le=1024, description="Server pods behind the Service.")
    resources: dict[str, Any] = Field(default_factory=dict, description="Server container resources.")
    env: list[dict[str, Any]] = kube_list("Container.env", "Server container environment variables.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Server pod node selector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Server pod tolerations.")


class EnvironmentPythonSpec(ApiModel):
    """An environment class run inside each rollout worker (no server)."""

    entrypoint: str = Field(
        ..., min_length=3, max_length=512, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
        description="Required. `module:Class`; the class is built without arguments and has reset(seed) and "
        "step(action) (docs/environments.md).")
    source: Optional[RewardSourceSpec] = Field(
        None, description="The module's code when the image lacks it, as task.rewardSource: a ConfigMap key or a "
        "file on a volume, loaded as the module entrypoint names.")


class EnvironmentSpec(ApiModel):
    """Multi-turn episodes (task name environment): reset, then generate and step until done (docs/environments.md).
    Exactly one of server, url or python."""

    server: Optional[EnvironmentServerSpec] = Field(None, description="An OpenEnv server the operator runs.")
    url: Optional[str] = Field(None, max_length=2048, pattern=r"^https?://[^\s/]+",
                               description="Base URL of an OpenEnv server outside the job (http or https).")
    python: Optional[EnvironmentPythonSpec] = Field(None, description="An in-process Python environment.")
    max_turns: int = Field(8, ge=1, le=1024, description="Steps per episode at most; then it ends (counted).")
    turn_timeout_seconds: int = Field(
        60, ge=1, le=86400, description="Longest reset or step call; past it the episode is dropped (counted).")
    episode_timeout_seconds: int = Field(
        600, ge=1, le=86400, description="Longest episode, generation included; past it it is dropped (counted).")
    reward: Literal["sum", "last"] = Field(
        "sum", description="Episode reward: `sum` of the step rewards (the return), or the `last` step's.")
    action_field: str = Field(
        "message", min_length=1, max_length=256,
        description="The generated text is sent as the action {actionField: text}; OpenEnv's text environments "
        "read `message`.")
    observation_field: Optional[str] = Field(
        None, min_length=1, max_length=256,
        description="Observation field whose text is appended to the context; unset: the observation's only "
        "string field, else its JSON.")
    episodes_in_flight: Optional[int] = Field(
        None, ge=1, le=65536,
        description="Episodes a rollout worker runs at once; unset: promptsPerBatch x samplesPerPrompt.")


class AdvantageSpec(ApiModel):
    normalize_std: bool = Field(
        True, description="Divide (reward - group mean) by the group standard deviation."
    )
    epsilon: float = Field(1e-6, gt=0, description="Added to the group std before dividing.")


class AutoscalingSpec(ApiModel):
    """The rollout replicas sized from measured waits (DESIGN §6 "Capacity signals"; the law: docs/autoscaling.md)."""

    min_replicas: int = Field(1, ge=1, le=rules.ROLLOUT_REPLICA_BOUNDS[1], description="The fewest rollout replicas.")
    max_replicas: int = Field(..., ge=1, le=rules.ROLLOUT_REPLICA_BOUNDS[1], description="Required. The most rollout "
                              "replicas; with Kueue, the count the job's quota covers.")
    target_data_wait_share: float = Field(
        0.05, ge=0, lt=0.9, description="The share of the trainer's time waiting for documents to aim at (0.05: 5%); "
        "replicas are added while it waits more than this plus 5 points and the rollouts are not held.")
    cooldown_seconds: int = Field(
        300, ge=0, le=86400, description="Seconds after a change before the next; longer than a new replica's start "
        "plus the 30 s measurement window.")


class RolloutSpec(ApiModel):
    """Rollout workers: generate, score and stream documents; follow the trainer's weights."""

    image: str = Field("rljob/trainer-cpu:0.1.0", min_length=1, description="Rollout container image.")
    backend: Literal["vllm", "cpu"] = Field(
        "cpu", description="`vllm` (vLLM's async engine: on the pod's GPUs, or on CPU with gpusPerReplica 0, which "
        "needs vLLM's CPU build in the image) or `cpu` (transformers generate, tests and laptops)."
    )
    replicas: int = Field(
        1,
        ge=0,
        le=4096,
        description="Rollout pods. 0 runs a trainer-only job, fed by producers outside rljob through the stream "
        "status.stream names (docs/trainer-only.md). Changing it (0 included) never restarts the gang.",
    )
    gpus_per_replica: int = Field(
        0, ge=0, le=64, description="nvidia.com/gpu per rollout pod (tensor parallel of vLLM); 0 runs vLLM on CPU.")
    resources: dict[str, Any] = Field(default_factory=dict, description="Rollout container resources.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod node selector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations.")
    pod_template: Optional[PodTemplateOverride] = pod_template_field(
        "rollout", "A change replaces the rollout pods only, like other rollout fields; the gang keeps running.")
    prompts_per_batch: int = Field(16, ge=1, description="Prompts generated together.")
    samples_per_prompt: int = Field(
        8,
        ge=2,
        le=1024,
        description="Completions per prompt (group size G), at least 2: GRPO and GSPO advantages "
        "are reward minus the group mean, identically 0 in a group of 1.",
    )
    max_lag: int = Field(
        1024,
        ge=0,
        description="Documents a worker may run ahead of the trainer's documents_seen; binds rljob's own rollout "
        "workers only (DESIGN §6, docs/field-reference.md).",
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Generation parameters.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="Prompts and verifiable reward.")
    autoscaling: Optional[AutoscalingSpec] = Field(
        None, exclude_if=omitted_at_default(None),
        description="Size the rollout replicas from the trainer's data wait and the rollouts' back-pressure, between "
        "minReplicas and maxReplicas; the operator keeps the count in status.autoscaling and leaves replicas (the "
        "starting count) as written. Unset (the default): replicas, as written or scaled.")
    environment: Optional[EnvironmentSpec] = Field(
        None, exclude_if=omitted_at_default(None),
        description="The environment of task environment (docs/environments.md). Unset (the default): none.")
    advantage: AdvantageSpec = Field(default_factory=AdvantageSpec, description="Group normalisation.")
    filter_zero_variance: bool = Field(
        False, description="Drop groups whose rewards are all equal (counted)."
    )
    seed: int = Field(0, ge=0, description="Sampling seed (each replica adds its index).")
    reward_failure_deadline_seconds: int = Field(
        600,
        ge=1,
        description="Ends the job Failed (reason RewardsFailing) once the reward function has failed on every sample "
        "of every rollout batch for this long; meanwhile RolloutReady is False (AllRewardsFailed). Changing it "
        "replaces no pod (docs/field-reference.md).",
    )


# --- redis ------------------------------------------------------------------------------------
class SecretKeyRef(ApiModel):
    name: str = Field(..., min_length=1, max_length=253, description="Secret name in the job's namespace.")
    key: str = Field(..., min_length=1, max_length=253, description="Key inside the Secret.")


STORAGE_QUANTITY = r"^[1-9][0-9]*(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
"""A positive storage quantity as Kubernetes writes one, e.g. ``10Gi``, ``500Mi`` (no exponent forms, no zero)."""


class RedisPersistenceSpec(ApiModel):
    """Where the managed Redis keeps its data (DESIGN §6 "Durability of the managed Redis")."""

    enabled: bool = Field(
        True,
        description="Keeps the managed Redis's data (stream, consumer group, progress and checkpoint hashes) on the "
        "PersistentVolumeClaim `<job>-redis-data` (an append-only file), so that it outlives the Redis pod; false: an "
        "emptyDir. Switching it replaces the Redis pod, whose data starts empty (DESIGN §6, docs/field-reference.md).",
    )
    storage_class_name: Optional[str] = Field(
        None,
        max_length=253,
        description="StorageClass of the claim; unset: the cluster's default class; \"\": no class (binds a "
        "PersistentVolume made beforehand). Applies when the claim is created: a claim is not changed afterwards.",
    )
    size: str = Field(
        "10Gi",
        pattern=STORAGE_QUANTITY,
        description="Storage the claim requests, a quantity such as 10Gi. It holds Redis's append-only file: the "
        "stream's entries not yet trimmed (up to maxPending documents plus those not yet acked) about twice over "
        "between rewrites. Applies when the claim is created: a claim is not resized.",
    )


class RedisSpec(ApiModel):
    mode: Literal["managed", "external"] = Field(
        "managed",
        description="`managed` (a per-job Redis Deployment, Service and password Secret) or `external` "
        "(`url` + `passwordSecretRef`; keys are prefixed `rljob:{namespace}:{job}:`).",
    )
    image: str = Field("redis:7.2", description="Managed Redis image.")
    pod_template: Optional[PodTemplateOverride] = pod_template_field(
        "managed Redis", "Only with mode managed. A change replaces the Redis pod: refused for an emptyDir Redis "
        "unless the job has the annotation rljob.dev/allow-redis-data-loss: \"true\".")
    url: Optional[str] = Field(None, description="A redis:// or rediss:// URL of an external Redis (mode=external).")
    password_secret_ref: Optional[SecretKeyRef] = Field(
        None, description="Secret key holding the external Redis password."
    )
    ca_secret_ref: Optional[SecretKeyRef] = Field(
        None,
        description="Secret key holding the PEM bundle of the CAs of the external Redis server's TLS certificate "
        "(mode=external, a rediss:// url), mounted into trainer and rollout pods (docs/install.md). Unset: the system "
        "CAs.",
    )
    stream_key: str = Field(protocol.DEFAULT_STREAM_KEY, min_length=1, description="Data stream key.")
    group_name: str = Field(protocol.DEFAULT_GROUP_NAME, min_length=1, description="Consumer group of trainer ranks.")
    consumer_prefix: str = Field(
        protocol.DEFAULT_CONSUMER_PREFIX, min_length=1, description="Consumer name = prefix + DP rank."
    )
    events_key: str = Field(protocol.DEFAULT_EVENTS_KEY, min_length=1, description="Event stream key.")
    max_pending: int = Field(
        4096,
        ge=1,
        description="Back-pressure: rollout workers start a batch only while the consumer group's backlog (lag plus "
        "pending entries) is below this (documents); nothing unacknowledged is ever trimmed (docs/field-reference.md).",
    )
    persistence: RedisPersistenceSpec = Field(
        default_factory=RedisPersistenceSpec,
        description="Durable managed Redis: an append-only file on a PersistentVolumeClaim (mode=managed).",
    )


class RunPolicySpec(ApiModel):
    backoff_limit: int = Field(
        3, ge=0, description="Gang restarts after failures; evictions and preemptions are not counted."
    )
    active_deadline_seconds: Optional[int] = Field(
        None, ge=1, description="Running time limit; the clock restarts on resume."
    )
    ttl_seconds_after_finished: Optional[int] = Field(
        None, ge=0, description="Delete the job this long after Succeeded or Failed."
    )
    suspend: bool = Field(
        False, description="Delete all pods, keep Redis and data (Kueue-compatible); resume continues."
    )
    clean_pod_policy: Literal["All", "Running", "None"] = Field(
        "All", description="Pods deleted when the job finishes: All, Running (only those still running) or None."
    )


class RLTrainingJobSpec(ApiModel):
    """What an RLTrainingJob runs: the model, the algorithm, the trainer gang, the rollout workers, Redis and the run
    policy."""

    model: ModelSpec = Field(..., description="Required. The causal LM trained and served.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="Loss and metrics.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="The data-parallel gang.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Generation workers.")
    redis: RedisSpec = Field(default_factory=RedisSpec, description="The stream between roles.")
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec, description="Restarts, deadlines, suspend.")
    hf_token_secret_ref: Optional[SecretKeyRef] = Field(
        None, description="Secret key exposed as HF_TOKEN to every pod."
    )
