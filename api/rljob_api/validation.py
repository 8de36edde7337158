"""The operator's check of a spec: every rule, those the CRD's CEL rules enforce too (defined once in
:mod:`rljob_api.rules`) and those only code can make.

Every problem names the field by its camelCase path, so the message reads like the API server's.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Optional

from rljob_api import constants as c, rules
from rljob_api.spec import RewardSourceSpec, RLTrainingJobSpec


@dataclass(frozen=True)
class SpecProblem:
    """One reason a spec cannot run. ``supported=False`` marks a valid but not-yet-implemented request."""

    field: str
    message: str
    supported: bool = True

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def data_parallel_size(spec: RLTrainingJobSpec) -> int:
    """DP = nodes × processesPerNode / (tensorParallel × pipelineParallel) (DESIGN §5, :func:`rules.data_parallel`).

    Raises:
        ValueError: the product does not divide; the message prints the numbers.
    """
    t = spec.trainer
    world = t.nodes * t.processes_per_node
    dp = rules.data_parallel(world, t.tensor_parallel, t.pipeline_parallel)
    if dp is None:
        raise ValueError("spec.trainer: " + rules.TOPOLOGY_MESSAGE.text(
            **topology_numbers(spec), world=world, modelParallel=t.tensor_parallel * t.pipeline_parallel))
    return dp


def topology_numbers(spec: RLTrainingJobSpec) -> dict[str, int]:
    """The trainer's counts by CRD field name (nodes, processesPerNode, tensorParallel, pipelineParallel): the numbers
    the topology's messages (:class:`rules.NumberedMessage`) name."""
    t = spec.trainer
    return {"nodes": t.nodes, "processesPerNode": t.processes_per_node, "tensorParallel": t.tensor_parallel,
            "pipelineParallel": t.pipeline_parallel}


def trainer_gpus(spec: RLTrainingJobSpec) -> int:
    """GPUs per trainer pod: ``spec.trainer.resources.limits["nvidia.com/gpu"]`` (0 when absent or not a whole
    number; the API server refuses a fractional GPU quantity on the pod)."""
    value = ((spec.trainer.resources or {}).get("limits") or {}).get(c.GPU_RESOURCE, 0)
    try:
        return max(int(str(value)), 0)
    except ValueError:
        return 0


def check_spec(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """All problems of a spec, in field order; empty when the job can run."""
    return [*_trainer_problems(spec), *_model_problems(spec), *_redis_problems(spec), *_rollout_problems(spec),
            *_image_problems(spec)]


_NAME_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
IMAGE_REFERENCE = re.compile(
    rf"(?:(?:(?:localhost|{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})+)(?::[0-9]+)?|{_DOMAIN_LABEL}:[0-9]+)/)?"
    rf"{_NAME_COMPONENT}(?:/{_NAME_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)
"""A container image reference as the distribution project's reference grammar states it (``[registry[:port]/]
path[:tag][@digest]``; the first component is a registry only with a dot, a port or ``localhost``; path components
lower-case): what a kubelet can pull."""


def _image_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """Image fields that no kubelet could pull (a pod would wait in InvalidImageName instead)."""
    images = {"spec.trainer.image": spec.trainer.image, "spec.rollout.image": spec.rollout.image}
    if spec.redis.mode == "managed":
        images["spec.redis.image"] = spec.redis.image
    if spec.rollout.environment is not None and spec.rollout.environment.server is not None:
        images["spec.rollout.environment.server.image"] = spec.rollout.environment.server.image
    return [SpecProblem(path, f"{value!r} is not a container image reference ([registry[:port]/]name[:tag][@digest], "
                              "lower-case name)")
            for path, value in images.items() if not IMAGE_REFERENCE.fullmatch(value)]


def _trainer_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """Topology, metrics, the KL estimator, GPUs, the reduce format, batch, learning-rate floor, checkpoint interval
    and TensorBoard directory (spec.trainer, spec.algorithm.metrics and klEstimator)."""
    problems: list[SpecProblem] = []
    t, a = spec.trainer, spec.algorithm
    try:
        dp = data_parallel_size(spec)
    except ValueError as err:
        problems.append(SpecProblem("spec.trainer.nodes", str(err).removeprefix("spec.trainer: ")))
        dp = None
    if not rules.metrics_allowed(a.metrics, t.pipeline_parallel):
        problems.append(
            SpecProblem("spec.algorithm.metrics", f"metrics={a.metrics} requires pipelineParallel == 1")
        )
    problems += _importance_sampling_problems(spec)
    if not rules.kl_estimator_allowed(a.kl_coef, a.kl_estimator):
        problems.append(SpecProblem("spec.algorithm.klEstimator", (
            f"{a.kl_estimator} is ignored while spec.algorithm.klCoef is {a.kl_coef:g} (no KL penalty is computed): "
            "set klCoef > 0 to enable the KL penalty, or remove klEstimator")))
    if t.tensor_parallel != 1:
        problems.append(SpecProblem("spec.trainer.tensorParallel", (
            f"{t.tensor_parallel}: tensor parallelism > 1 is not supported yet (the trainer parallelises over "
            "data-parallel ranks only): set it to 1"), False))
    if t.pipeline_parallel != 1:
        problems.append(SpecProblem("spec.trainer.pipelineParallel", (
            f"{t.pipeline_parallel}: pipeline parallelism > 1 is not supported yet (the trainer parallelises over "
            "data-parallel ranks only): set it to 1"), False))
    problems += _gpu_problems(spec)
    par = t.parallelism
    if par.strategy != "fsdp" and par.replicate != 1:
        problems.append(SpecProblem("spec.trainer.parallelism.replicate",
                                    f"replicate = {par.replicate} (HSDP) requires strategy fsdp, not {par.strategy}"))
    elif dp is not None and not rules.replicate_allowed(par.strategy, par.replicate, dp):
        problems.append(SpecProblem("spec.trainer.parallelism.replicate", rules.REPLICATE_MESSAGE.text(
            replicate=par.replicate, dataParallel=dp, **topology_numbers(spec))))
    if not rules.reduce_format_allowed(par.strategy, t.precision.reduce):
        problems.append(SpecProblem("spec.trainer.precision.reduce", (
            f"{t.precision.reduce} is ignored with spec.trainer.parallelism.strategy {par.strategy}, which all-reduces "
            "the gradients in float32 (only fsdp reduces in precision.reduce; precision.param applies to both): remove "
            "precision.reduce (fp32, the default) or set parallelism.strategy to fsdp")))
    if dp is not None and rules.documents_per_rank(t.batch.documents_per_step, dp) is None:
        problems.append(SpecProblem("spec.trainer.batch.documentsPerStep", rules.DOCUMENTS_PER_STEP_MESSAGE.text(
            documentsPerStep=t.batch.documents_per_step, dataParallel=dp, **topology_numbers(spec))))
    problems += _schedule_problems(spec)
    unacked = t.batch.documents_per_step * t.checkpoint.every_steps
    if unacked > spec.redis.max_pending:
        problems.append(
            SpecProblem(
                "spec.trainer.checkpoint.everySteps",
                f"documentsPerStep × everySteps = {t.batch.documents_per_step} × {t.checkpoint.every_steps} = "
                f"{unacked} must not exceed spec.redis.maxPending = {spec.redis.max_pending}: stream entries are "
                "acknowledged only by a checkpoint and rollout workers stop at maxPending unacknowledged entries, "
                "so training would stall before its first checkpoint",
            )
        )
    return problems + _tensorboard_problems(spec)


def _importance_sampling_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """spec.algorithm: a cap only with importance sampling on, and with it on neither a dual clip nor a clip range,
    which the ratio 1 it leaves never reaches (DESIGN §4)."""
    a, sampling = spec.algorithm, spec.algorithm.importance_sampling
    problems = []
    if not rules.is_cap_used(sampling.enabled, sampling.cap):
        problems.append(SpecProblem("spec.algorithm.importanceSampling.cap", (
            f"{sampling.cap:g} is ignored while importanceSampling.enabled is false (no behaviour weight is applied): "
            "set enabled: true, or remove cap")))
    if not rules.dual_clip_used(a.dual_clip, sampling.enabled):
        problems.append(_never_binds({"dualClip": a.dual_clip}, "above dualClip", "dualClip"))
    if not rules.epsilons_used(a.epsilon_low, a.epsilon_high, sampling.enabled):
        epsilons = {"epsilonLow": a.epsilon_low, "epsilonHigh": a.epsilon_high}
        problems.append(_never_binds({k: v for k, v in epsilons.items() if v is not None}, "clipped",
                                     "epsilonLow and epsilonHigh"))
    return problems


def _never_binds(settings: dict[str, float], never: str, remove: str) -> SpecProblem:
    """The problem of ``settings`` (camelCase name: value, under spec.algorithm) that importance sampling leaves
    nothing to bind: its PPO ratio is 1, never ``never``."""
    values = ", ".join(f"{name} = {value:g}" for name, value in settings.items())
    return SpecProblem(f"spec.algorithm.{next(iter(settings))}", (
        f"{values} never {'binds' if len(settings) == 1 else 'bind'}: {rules.PROXIMAL_RATIO_IS_ONE} never {never}; the "
        f"cap bounds the behaviour weight: remove {remove}, or disable importanceSampling"))


def _schedule_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """spec.trainer.optimizer: a floor only with a decaying schedule, below the rate it decays from, and steps left to
    decay over after the warm-up."""
    t = spec.trainer
    opt, field = t.optimizer, "spec.trainer.optimizer"
    problems: list[SpecProblem] = []
    if not rules.learning_rate_floor_used(opt.min_learning_rate, opt.schedule):
        problems.append(SpecProblem(f"{field}.minLearningRate", (
            f"{opt.min_learning_rate:g} {rules.FLOOR_IGNORED}")))
    elif not rules.learning_rate_floor_allowed(opt.min_learning_rate, opt.learning_rate, opt.schedule):
        problems.append(SpecProblem(f"{field}.minLearningRate", (
            f"minLearningRate = {opt.min_learning_rate:g} must be below learningRate = {opt.learning_rate:g}: schedule "
            f"{opt.schedule} decays from learningRate to minLearningRate (equal, the rate would stay constant)")))
    if not rules.decay_steps_allowed(opt.schedule, opt.warmup_steps, t.max_steps):
        problems.append(SpecProblem(f"{field}.schedule", (
            f"{opt.schedule} decays over the steps after the warm-up, the first of them at learningRate: with "
            f"warmupSteps = {opt.warmup_steps} and spec.trainer.maxSteps = {t.max_steps} nothing is left to decay; "
            "it needs maxSteps >= warmupSteps + 2")))
    return problems


def _tensorboard_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """spec.trainer.tensorboard.logDir: not the root filesystem, and not at or under a directory rljob mounts in the
    trainer container (read-only, or memory that goes with the pod), where rank 0's writes fail or are lost."""
    board = spec.trainer.tensorboard
    if board is None:
        return []
    field, directory = "spec.trainer.tensorboard.logDir", normalized_path(board.log_dir)
    suggestion = f"e.g. {c.CHECKPOINT_MOUNT_DIR}/tensorboard on spec.trainer.checkpoint.volume"
    if directory == "/":
        return [SpecProblem(field, (
            f"{board.log_dir!r} is the container's root filesystem, which goes with the pod: give a directory on a "
            f"volume, {suggestion}"))]
    rljob_dirs = rljob_mounts(spec)
    model = spec.model
    if model.volume and model.path:
        rljob_dirs.append(posixpath.dirname(normalized_path(model.path)))  # read-only
    collision = mount_collision(directory, rljob_dirs, "trainer")
    if collision:
        return [SpecProblem(field, f"{board.log_dir!r} is {collision}: give a directory on a volume, {suggestion}")]
    return []


def _gpu_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """GPUs asked for without a limit, or fewer GPUs than ranks per trainer pod."""
    problems: list[SpecProblem] = []
    t = spec.trainer
    resources = t.resources or {}
    if c.GPU_RESOURCE in (resources.get("requests") or {}) and c.GPU_RESOURCE not in (resources.get("limits") or {}):
        problems.append(SpecProblem(
            "spec.trainer.resources.limits",
            f"{c.GPU_RESOURCE} is requested but has no limit: GPUs are asked for through limits (the API server "
            "refuses a pod with only a request); move it to limits",
        ))
    gpus = trainer_gpus(spec)
    if gpus and t.processes_per_node > gpus:
        problems.append(SpecProblem(
            "spec.trainer.processesPerNode",
            f"{t.processes_per_node} ranks per pod but spec.trainer.resources.limits {c.GPU_RESOURCE} = {gpus}: each "
            f"rank needs a GPU of its own (NCCL); set processesPerNode <= {gpus} or raise the GPU limit",
        ))
    return problems


def _model_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    m = spec.model
    if m.source == "tiny" and m.tiny.hidden_size % m.tiny.heads:
        problems.append(
            SpecProblem(
                "spec.model.tiny.heads", f"heads = {m.tiny.heads} does not divide hiddenSize = {m.tiny.hidden_size}"
            )
        )
    if m.source == "path" and not m.path:
        problems.append(SpecProblem("spec.model.path", "required when source is 'path'"))
    if m.source == "huggingface" and not m.name:
        problems.append(SpecProblem(
            "spec.model.name", "required when source is 'huggingface': a Hub model id such as Qwen/Qwen2.5-1.5B-Instruct"))
    return problems


def _redis_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    redis = spec.redis
    if redis.mode == "external" and not redis.url:
        problems.append(SpecProblem("spec.redis.url", "required when mode is 'external'"))
    if redis.mode == "external" and redis.url and not redis.url.startswith(("redis://", "rediss://")):
        problems.append(SpecProblem("spec.redis.url", f"must start with redis:// or rediss://, got {redis.url!r}"))
    if redis.mode == "managed" and redis.url:
        problems.append(SpecProblem(
            "spec.redis.url",
            "only used with mode 'external' (the managed Redis is reached through its own Service): remove url, or "
            "set mode to 'external'",
        ))
    if redis.mode == "managed" and redis.password_secret_ref is not None:
        problems.append(SpecProblem(
            "spec.redis.passwordSecretRef",
            "only used with mode 'external' (the managed Redis's password is generated into the Secret "
            "<job>-redis-auth): remove passwordSecretRef, or set mode to 'external'",
        ))
    if redis.mode == "external" and redis.pod_template is not None and not redis.pod_template.is_empty():
        problems.append(SpecProblem(
            "spec.redis.podTemplate",
            "only used with mode 'managed' (rljob runs no Redis pod for an external Redis): remove podTemplate, or set "
            "mode to 'managed'",
        ))
    if redis.ca_secret_ref is not None and not (redis.mode == "external" and (redis.url or "").startswith("rediss://")):
        problems.append(SpecProblem(
            "spec.redis.caSecretRef",
            "verifies a TLS connection: set mode to 'external' and a rediss:// url, or remove caSecretRef",
        ))
    return problems


def _rollout_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    r = spec.rollout
    if r.task.name in ("math", "custom") and not r.task.dataset_path:
        problems.append(SpecProblem("spec.rollout.task.datasetPath", f"required for task {r.task.name!r}"))
    if r.task.name == "custom" and not r.task.reward_function:
        problems.append(SpecProblem("spec.rollout.task.rewardFunction", "required for task 'custom'"))
    if r.task.reward_function and ":" not in r.task.reward_function:
        problems.append(
            SpecProblem("spec.rollout.task.rewardFunction", f"must be 'module:function', got {r.task.reward_function!r}")
        )
    problems += _reward_source_problems(spec) + _environment_problems(spec)
    if r.autoscaling is not None and r.autoscaling.min_replicas > r.autoscaling.max_replicas:
        problems.append(SpecProblem("spec.rollout.autoscaling.minReplicas", rules.AUTOSCALING_BOUNDS_MESSAGE.text(
            minReplicas=r.autoscaling.min_replicas, maxReplicas=r.autoscaling.max_replicas)))
    tiny = spec.model.tiny
    if (r.backend == "vllm" and r.gpus_per_replica == 0 and spec.model.source == "tiny"
            and not tiny.hidden_size % tiny.heads
            and tiny.hidden_size // tiny.heads not in rules.VLLM_CPU_HEAD_SIZES):
        sizes = ", ".join(str(size) for size in rules.VLLM_CPU_HEAD_SIZES)
        problems.append(SpecProblem("spec.model.tiny", (
            f"hiddenSize = {tiny.hidden_size} / heads = {tiny.heads} gives a head size of "
            f"{tiny.hidden_size // tiny.heads}, which vLLM's CPU attention (backend 'vllm' with gpusPerReplica 0) "
            f"cannot run: it runs head sizes {sizes}; {_heads_for(tiny.hidden_size)}")))
    if spec.model.source == "tiny" and r.sampling.max_new_tokens > tiny.max_position_embeddings:
        problems.append(SpecProblem("spec.rollout.sampling.maxNewTokens", (
            f"{r.sampling.max_new_tokens} is more than the model's {tiny.max_position_embeddings} positions "
            f"(spec.model.tiny.maxPositionEmbeddings), which hold the prompt and the completion: set maxNewTokens "
            f"below {tiny.max_position_embeddings}, or raise maxPositionEmbeddings")))
    sampling = rules.vllm_logprobs_problem(r.sampling.top_p, r.sampling.temperature)
    if r.backend == "vllm" and sampling is not None:
        problems.append(SpecProblem("spec.rollout.sampling", sampling))
    if r.backend == "cpu" and r.gpus_per_replica > 0:
        problems.append(SpecProblem(
            "spec.rollout.gpusPerReplica",
            f"must be 0 with backend 'cpu' (it generates on CPU; {r.gpus_per_replica} would hold "
            f"{r.gpus_per_replica} GPUs per rollout pod unused): set it to 0, or backend to 'vllm'",
        ))
    return problems


def _heads_for(hidden_size: int) -> str:
    """Advice: a head count giving ``hidden_size`` a head size vLLM's CPU attention runs, or how to get one."""
    for size in rules.VLLM_CPU_HEAD_SIZES:
        if hidden_size % size == 0:
            return f"e.g. heads = {hidden_size // size}"
    return f"no head count does for hiddenSize = {hidden_size}: make it a multiple of 32"


def normalized_path(path: str) -> str:
    """``path`` as the container runtime resolves it: ``//``, ``.`` and a trailing ``/`` dropped (``/etc//rljob/./x/``
    is ``/etc/rljob/x``); ``..`` is the API server's to refuse in a mountPath."""
    return "/" + posixpath.normpath("/" + path).lstrip("/")


def at_or_under(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or inside it, both normalized (:func:`normalized_path`); ``/etc/rljobx`` is
    not under ``/etc/rljob``."""
    path, directory = normalized_path(path), normalized_path(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _reward_source_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """spec.rollout.task.rewardSource: the custom task only, and a well-formed source (:func:`_code_source_problems`).
    """
    task, field = spec.rollout.task, "spec.rollout.task.rewardSource"
    if task.reward_source is None:
        return []
    problems: list[SpecProblem] = []
    if not rules.reward_source_allowed(task.name, True):
        problems.append(SpecProblem(field, f"needs task name 'custom', got {task.name!r}: the built-in tasks score "
                                           "with their own rewards"))
    return problems + _code_source_problems(spec, task.reward_source, field)


def _code_source_problems(spec: RLTrainingJobSpec, source: RewardSourceSpec, field: str) -> list[SpecProblem]:
    """A code source at ``field`` (task.rewardSource, environment.python.source): one source, a volume with a path,
    and no second volume at the directory where model.volume is mounted (the pod would mount two volumes at one
    path)."""
    problems: list[SpecProblem] = []
    if not rules.one_reward_source(source.config_map_key_ref is not None, source.path is not None):
        problems.append(SpecProblem(field, "needs exactly one of configMapKeyRef or path"))
    if source.volume and not source.path:
        problems.append(SpecProblem(f"{field}.volume", "needs path, the module's file on that volume"))
    problems += _source_path_problems(spec, source, field)
    model = spec.model
    if source.volume and source.path and model.volume and model.path:
        here, there = posixpath.dirname(source.path), posixpath.dirname(model.path.rstrip("/"))
        if here == there:
            name = field.rsplit(".", 1)[-1]
            problems.append(SpecProblem(f"{field}.volume", (
                f"{source.volume!r} would be mounted at {here}, where spec.model.volume {model.volume!r} is mounted "
                f"already: put the file on that volume and remove {name}.volume, or use another directory")))
    return problems


def _source_path_problems(spec: RLTrainingJobSpec, source: RewardSourceSpec, field: str) -> list[SpecProblem]:
    """``<field>.path`` of a code source: a file, not a directory; with ``volume``, whose claim is mounted at the
    file's directory, not a directory at ``/`` (the claim would hide the image's whole filesystem) nor at or under a
    directory rljob mounts in the rollout container (the API server would refuse the pod, or the mount would hide
    rljob's)."""
    if source.path is None:
        return []
    name, field = field.rsplit(".", 1)[-1], f"{field}.path"
    if source.path.endswith("/"):
        return [SpecProblem(field, f"{source.path!r} names a directory: give the file of the module, e.g. "
                                   f"{source.path}reward.py")]
    if not source.volume:
        return []
    directory = posixpath.dirname(normalized_path(source.path))
    if directory == "/":
        return [SpecProblem(field, (
            f"{source.path!r}: {name}.volume {source.volume!r} would be mounted at its directory, /, over the "
            "container's whole filesystem: give a path in a directory of its own, e.g. /reward/"
            f"{posixpath.basename(source.path)} mounts the claim at /reward"))]
    collision = mount_collision(directory, rljob_mounts(spec), "rollout")
    if collision:
        return [SpecProblem(field, (
            f"{source.path!r}: {name}.volume {source.volume!r} would be mounted at {directory}, {collision}: "
            "choose another directory"))]
    return []


def _environment_problems(spec: RLTrainingJobSpec) -> list[SpecProblem]:
    """spec.rollout.environment and task name environment: together or not at all, exactly one kind of environment,
    its code source, and a turn no longer than the episode (the image is :func:`_image_problems`')."""
    r, field = spec.rollout, "spec.rollout.environment"
    env = r.environment
    if not rules.environment_task_matches(r.task.name, env is not None):
        if env is None:
            return [SpecProblem("spec.rollout.task.name", f"{r.task.name!r} needs spec.rollout.environment (server, "
                                                          "url or python): set one, or choose another task")]
        return [SpecProblem(field, f"is set but spec.rollout.task.name is {r.task.name!r}: environments run only "
                                   f"with task name {rules.ENVIRONMENT_TASK!r}; set it, or remove environment")]
    if env is None:
        return []
    problems: list[SpecProblem] = []
    kinds = {"server": env.server is not None, "url": env.url is not None, "python": env.python is not None}
    if not rules.one_environment(**{f"has_{k}": v for k, v in kinds.items()}):
        given = [k for k, v in kinds.items() if v]
        problems.append(SpecProblem(field, f"needs exactly one of server, url or python, got "
                                           f"{' and '.join(given) if given else 'none'}"))
    if env.python is not None and env.python.source is not None:
        problems += _code_source_problems(spec, env.python.source, f"{field}.python.source")
    if env.turn_timeout_seconds > env.episode_timeout_seconds:
        problems.append(SpecProblem(f"{field}.turnTimeoutSeconds", (
            f"{env.turn_timeout_seconds} exceeds episodeTimeoutSeconds = {env.episode_timeout_seconds}: a turn is part "
            "of its episode; lower turnTimeoutSeconds or raise episodeTimeoutSeconds")))
    return problems


def rljob_mounts(spec: RLTrainingJobSpec) -> list[str]:
    """The directories rljob mounts in both its trainer and rollout containers besides the checkpoint volume: the
    config (read-only), /dev/shm (memory) and, with spec.redis.caSecretRef, the Redis CA's (read-only)."""
    return [c.CONFIG_MOUNT_DIR, c.SHM_MOUNT_DIR] + ([c.REDIS_CA_MOUNT_DIR] if spec.redis.ca_secret_ref else [])


def mount_collision(directory: str, rljob_dirs: list[str], container: str) -> Optional[str]:
    """What is wrong with a user's ``directory`` in rljob's ``container`` that is at or under one of ``rljob_dirs``
    (:func:`at_or_under`), e.g. "at or under a directory rljob mounts in the rollout container (/etc/rljob,
    /dev/shm)"; None when it is under none."""
    if any(at_or_under(directory, d) for d in rljob_dirs):
        return f"at or under a directory rljob mounts in the {container} container ({', '.join(rljob_dirs)})"
    return None
