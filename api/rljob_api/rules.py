"""The spec rules that three places enforce — the CRD's CEL rules (the API server), the operator's check of a spec
(:mod:`rljob_api.validation`) and the trainer's check at start — each defined once: the Python function, and beside
it the CEL rule that states the same over the CRD's camelCase fields.

- topology: DP = nodes × processesPerNode / (tensorParallel × pipelineParallel) must be a whole number (DESIGN §5);
- metrics need one pipeline stage: metrics ``basic`` or ``full`` only with pipelineParallel == 1 (the metrics read
  the whole vocabulary);
- documentsPerStep is global and divisible by DP (DESIGN §6);
- HSDP: ``parallelism.replicate`` divides DP, and is 1 unless the strategy is fsdp (DESIGN §5);
- the learning-rate floor: ``optimizer.minLearningRate`` <= ``optimizer.learningRate`` (a decay never rises);
- a role's ``podTemplate.spec.containers`` name only rljob's own container of that role (no extra regular container).
- the reward source: ``task.rewardSource`` only with task ``custom``, and exactly one of its ``configMapKeyRef`` and
  ``path`` (``volume`` only with ``path``).
"""

from __future__ import annotations

from typing import Optional

#: Metrics levels that need the whole vocabulary on one pipeline stage.
ONE_STAGE_METRICS = ("basic", "full")

_WORLD = "(self.nodes * self.processesPerNode)"
_MODEL_PARALLEL = "(self.tensorParallel * self.pipelineParallel)"
_DATA_PARALLEL = f"({_WORLD} / {_MODEL_PARALLEL})"
# Out-of-range counts are the schema's to report (minimum/maximum): CEL skips them, so a 0 never divides and a
# count beyond its maximum adds no second, misleading message.
_COUNTS_IN_RANGE = ("self.nodes >= 1 && self.nodes <= 4096 && self.processesPerNode >= 1 && self.processesPerNode <= 64"
                    " && self.tensorParallel >= 1 && self.tensorParallel <= 64"
                    " && self.pipelineParallel >= 1 && self.pipelineParallel <= 64")

#: CEL rule on ``spec.trainer``: the topology divides (:func:`data_parallel`).
CEL_TOPOLOGY = {
    "rule": f"!({_COUNTS_IN_RANGE}) || {_WORLD} % {_MODEL_PARALLEL} == 0",
    "message": "nodes*processesPerNode must be divisible by tensorParallel*pipelineParallel",
    "fieldPath": ".nodes",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.trainer``: documentsPerStep divides by DP (:func:`documents_per_rank`); a topology that does
#: not divide is :data:`CEL_TOPOLOGY`'s to report.
CEL_DOCUMENTS_PER_STEP = {
    "rule": f"!({_COUNTS_IN_RANGE}) || {_WORLD} % {_MODEL_PARALLEL} != 0 || "
    f"self.batch.documentsPerStep % {_DATA_PARALLEL} == 0",
    "message": "batch.documentsPerStep must be divisible by the data-parallel size "
    "nodes*processesPerNode/(tensorParallel*pipelineParallel)",
    "fieldPath": ".batch.documentsPerStep",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.trainer``: parallelism.replicate divides DP (:func:`replicate_allowed`); a topology that does not
#: divide is :data:`CEL_TOPOLOGY`'s to report, an out-of-range replicate the schema's.
CEL_REPLICATE = {
    "rule": f"!({_COUNTS_IN_RANGE}) || {_WORLD} % {_MODEL_PARALLEL} != 0 || self.parallelism.replicate < 1 || "
    f"{_DATA_PARALLEL} % self.parallelism.replicate == 0",
    "message": "parallelism.replicate must divide the data-parallel size "
    "nodes*processesPerNode/(tensorParallel*pipelineParallel)",
    "fieldPath": ".parallelism.replicate",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.trainer.parallelism``: replicate > 1 (HSDP) needs strategy fsdp.
CEL_REPLICATE_NEEDS_FSDP = {
    "rule": "self.strategy == 'fsdp' || self.replicate == 1",
    "message": "replicate > 1 (HSDP) requires strategy fsdp; ddp replicates over every rank already",
    "fieldPath": ".replicate",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec``: metrics basic or full need pipelineParallel == 1 (:func:`metrics_allowed`).
CEL_METRICS_ONE_STAGE = {
    "rule": f"!(self.algorithm.metrics in {list(ONE_STAGE_METRICS)}) || self.trainer.pipelineParallel == 1",
    "message": "metrics basic or full requires trainer.pipelineParallel == 1",
    "fieldPath": ".algorithm.metrics",
    "reason": "FieldValueInvalid",
}

#: CEL rule on ``spec.trainer.optimizer``: the decay's floor does not exceed the rate it decays from
#: (:func:`learning_rate_floor_allowed`). The message names both fields, not their values: a ``messageExpression``
#: with ``string(double)`` is refused by the API server (its estimated cost exceeds the CRD's budget 100-fold); the
#: operator's check prints the values.
CEL_MIN_LEARNING_RATE = {
    "rule": "self.minLearningRate <= self.learningRate",
    "message": "optimizer.minLearningRate must not exceed optimizer.learningRate",
    "fieldPath": ".minLearningRate",
    "reason": "FieldValueInvalid",
}

#: CEL rule on ``spec.rollout.task``: only the custom task reads a reward source (:func:`reward_source_allowed`).
CEL_REWARD_SOURCE_NEEDS_CUSTOM = {
    "rule": "!has(self.rewardSource) || self.name == 'custom'",
    "message": "rewardSource needs name custom: the built-in tasks score with their own rewards",
    "fieldPath": ".rewardSource",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.rollout.task.rewardSource``: one source (:func:`one_reward_source`).
CEL_ONE_REWARD_SOURCE = {
    "rule": "has(self.configMapKeyRef) != has(self.path)",
    "message": "rewardSource needs exactly one of configMapKeyRef or path",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.rollout.task.rewardSource``: a volume holds the file ``path`` names.
CEL_REWARD_VOLUME_NEEDS_PATH = {
    "rule": "!has(self.volume) || has(self.path)",
    "message": "rewardSource.volume needs path, the module's file on that volume",
    "fieldPath": ".volume",
    "reason": "FieldValueInvalid",
}


def extra_container_message(container: str) -> str:
    """Why ``podTemplate.spec.containers`` may name only rljob's ``container`` (the CEL rule's message and the
    operator's)."""
    return (f"only the {container} container may be listed (to add env, envFrom, volumeMounts or securityContext to "
            f"it): an extra regular container is refused because a pod ends only when all its regular containers "
            f"have exited, so a trainer pod would never reach Succeeded; run it as a native sidecar instead, an "
            f"initContainers entry with restartPolicy: Always")


def cel_own_container_only(container: str) -> dict[str, str]:
    """CEL rule on ``spec.<role>.podTemplate.spec.containers``: every entry names ``container``
    (:func:`own_container_only`)."""
    return {"rule": f"self.all(c, c.name == '{container}')", "message": extra_container_message(container),
            "reason": "FieldValueInvalid"}


def own_container_only(name: str, container: str) -> bool:
    """Whether a ``podTemplate.spec.containers`` entry called ``name`` adds to rljob's ``container`` (not an extra
    regular container)."""
    return name == container


def data_parallel(world_size: int, tensor_parallel: int, pipeline_parallel: int) -> Optional[int]:
    """DP = ``world_size`` ranks / (``tensor_parallel`` × ``pipeline_parallel``); None when it does not divide."""
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        return None
    return world_size // model_parallel


def documents_per_rank(documents_per_step: int, data_parallel_size: int) -> Optional[int]:
    """Documents each data-parallel rank trains per step; None when ``documents_per_step`` does not divide by
    ``data_parallel_size``."""
    if documents_per_step % data_parallel_size:
        return None
    return documents_per_step // data_parallel_size


def metrics_allowed(level: str, pipeline_parallel: int) -> bool:
    """Whether metrics ``level`` can be computed with ``pipeline_parallel`` stages (:data:`ONE_STAGE_METRICS` need
    one)."""
    return level not in ONE_STAGE_METRICS or pipeline_parallel == 1


def replicate_allowed(strategy: str, replicate: int, data_parallel_size: int) -> bool:
    """Whether ``replicate`` HSDP groups fit ``data_parallel_size`` ranks: it divides them, and is 1 unless ``strategy``
    is ``fsdp``."""
    return data_parallel_size % replicate == 0 and (strategy == "fsdp" or replicate == 1)


def learning_rate_floor_allowed(min_learning_rate: float, learning_rate: float) -> bool:
    """Whether a schedule may decay from ``learning_rate`` to the floor ``min_learning_rate`` (it is not above it)."""
    return min_learning_rate <= learning_rate


def reward_source_allowed(task_name: str, has_source: bool) -> bool:
    """Whether a task named ``task_name`` may have a ``rewardSource`` (only ``custom`` calls a user function)."""
    return not has_source or task_name == "custom"


def one_reward_source(has_config_map_key_ref: bool, has_path: bool) -> bool:
    """Whether a ``rewardSource`` names exactly one source: a ConfigMap key or a path."""
    return has_config_map_key_ref != has_path
