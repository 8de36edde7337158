"""Every check only code can make, with the exact message the Valid condition shows (field named first).

Each case: (spec overrides, every message it must produce, in order).
"""

from __future__ import annotations

import pytest

from rljob_operator.admission import parse_spec
from rljob_operator.job_status import valid_condition

NOT_YET = "parallelism > 1 is not supported yet (the trainer parallelises over data-parallel ranks only): set it to 1"
CASES = {
    "topology": (
        {"trainer": {"nodes": 3, "tensorParallel": 2}},
        "spec.trainer.nodes: nodes 3 × processesPerNode 1 = 3 ranks is not divisible by tensorParallel 2 × "
        "pipelineParallel 1 = 2: each data-parallel rank needs tensorParallel × pipelineParallel processes",
        f"spec.trainer.tensorParallel: 2: tensor {NOT_YET}",
    ),
    "metrics-pp": (
        {"algorithm": {"metrics": "full"}, "trainer": {"nodes": 2, "pipelineParallel": 2}},
        "spec.algorithm.metrics: metrics=full requires pipelineParallel == 1",
        f"spec.trainer.pipelineParallel: 2: pipeline {NOT_YET}",
    ),
    "tensor-parallel": (
        {"trainer": {"nodes": 2, "tensorParallel": 2}},
        f"spec.trainer.tensorParallel: 2: tensor {NOT_YET}",
    ),
    "pipeline-parallel": (
        {"trainer": {"nodes": 2, "pipelineParallel": 2}},
        f"spec.trainer.pipelineParallel: 2: pipeline {NOT_YET}",
    ),
    "documents-per-step": (
        {"trainer": {"nodes": 2, "batch": {"documentsPerStep": 3}}},
        "spec.trainer.batch.documentsPerStep: documentsPerStep 3 is not divisible by the data-parallel size 2 = nodes "
        "2 × processesPerNode 1 / (tensorParallel 1 × pipelineParallel 1): every data-parallel rank trains the same "
        "number of documents per step; set documentsPerStep to a multiple of the data-parallel size, or change the "
        "topology",
    ),
    "heads": ({"model": {"tiny": {"heads": 3}}}, "spec.model.tiny.heads: heads = 3 does not divide hiddenSize = 64"),
    "model-path": ({"model": {"source": "path"}}, "spec.model.path: required when source is 'path'"),
    "redis-url": ({"redis": {"mode": "external"}}, "spec.redis.url: required when mode is 'external'"),
    "redis-scheme": (
        {"redis": {"mode": "external", "url": "http://cache:6379"}},
        "spec.redis.url: must start with redis:// or rediss://, got 'http://cache:6379'",
    ),
    "redis-ca-without-tls": (
        {"redis": {"mode": "external", "url": "redis://cache:6379", "caSecretRef": {"name": "ca", "key": "ca.crt"}}},
        "spec.redis.caSecretRef: verifies a TLS connection: set mode to 'external' and a rediss:// url, or remove "
        "caSecretRef",
    ),
    "redis-ca-managed": (
        {"redis": {"caSecretRef": {"name": "ca", "key": "ca.crt"}}},
        "spec.redis.caSecretRef: verifies a TLS connection: set mode to 'external' and a rediss:// url, or remove "
        "caSecretRef",
    ),
    "dataset": ({"rollout": {"task": {"name": "math"}}}, "spec.rollout.task.datasetPath: required for task 'math'"),
    "reward-function": (
        {"rollout": {"task": {"name": "custom", "datasetPath": "/d.jsonl"}}},
        "spec.rollout.task.rewardFunction: required for task 'custom'",
    ),
    "reward-function-form": (
        {"rollout": {"task": {"name": "custom", "datasetPath": "/d.jsonl", "rewardFunction": "score"}}},
        "spec.rollout.task.rewardFunction: must be 'module:function', got 'score'",
    ),
    "redis-managed-url": (
        {"redis": {"url": "redis://x:6379"}},
        "spec.redis.url: only used with mode 'external' (the managed Redis is reached through its own Service): "
        "remove url, or set mode to 'external'",
    ),
    "redis-managed-password": (
        {"redis": {"passwordSecretRef": {"name": "mine", "key": "password"}}},
        "spec.redis.passwordSecretRef: only used with mode 'external' (the managed Redis's password is generated into "
        "the Secret <job>-redis-auth): remove passwordSecretRef, or set mode to 'external'",
    ),
    "ranks-per-gpu": (
        {"trainer": {"processesPerNode": 3, "batch": {"documentsPerStep": 96}, "resources": {"limits": {"nvidia.com/gpu": 2}}}},
        "spec.trainer.processesPerNode: 3 ranks per pod but spec.trainer.resources.limits nvidia.com/gpu = 2: each "
        "rank needs a GPU of its own (NCCL); set processesPerNode <= 2 or raise the GPU limit",
    ),
    "gpu-request-only": (
        {"trainer": {"resources": {"requests": {"nvidia.com/gpu": 2}}}},
        "spec.trainer.resources.limits: nvidia.com/gpu is requested but has no limit: GPUs are asked for through "
        "limits (the API server refuses a pod with only a request); move it to limits",
    ),
    "vllm-cpu-head-size": ({"rollout": {"backend": "vllm"}}, (
        "spec.model.tiny: hiddenSize = 64 / heads = 4 gives a head size of 16, which vLLM's CPU attention (backend "
        "'vllm' with gpusPerReplica 0) cannot run: it runs head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, "
        "512; e.g. heads = 2")),
    "vllm-top-p": (
        {"rollout": {"backend": "vllm", "gpusPerReplica": 1, "sampling": {"topP": 0.9, "temperature": 0.7}}},
        "spec.rollout.sampling: topP = 0.9 < 1 with temperature = 0.7 != 1 is not supported by the vllm backend: vLLM "
        "cannot return log-probabilities of the temperature-scaled, untruncated distribution the trainer recomputes. "
        "Use topP = 1, or temperature = 1",
    ),
    "cpu-gpus": (
        {"rollout": {"backend": "cpu", "gpusPerReplica": 2}},
        "spec.rollout.gpusPerReplica: must be 0 with backend 'cpu' (it generates on CPU; 2 would hold 2 GPUs per "
        "rollout pod unused): set it to 0, or backend to 'vllm'",
    ),
    # a setting the job would ignore (also refused by the CRD's CEL rules, which a CRD older than the operator lacks)
    "ddp-reduce": (
        {"trainer": {"parallelism": {"strategy": "ddp"}, "precision": {"reduce": "bf16"}}},
        "spec.trainer.precision.reduce: bf16 is ignored with spec.trainer.parallelism.strategy ddp, which all-reduces "
        "the gradients in float32 (only fsdp reduces in precision.reduce; precision.param applies to both): remove "
        "precision.reduce (fp32, the default) or set parallelism.strategy to fsdp",
    ),
    "kl-estimator": (
        {"algorithm": {"klEstimator": "k1"}},
        "spec.algorithm.klEstimator: k1 is ignored while spec.algorithm.klCoef is 0 (no KL penalty is computed): set "
        "klCoef > 0 to enable the KL penalty, or remove klEstimator",
    ),
    "tensorboard-root": (
        {"trainer": {"tensorboard": {"logDir": "//"}}},
        "spec.trainer.tensorboard.logDir: '//' is the container's root filesystem, which goes with the pod: give a "
        "directory on a volume, e.g. /var/lib/rljob/checkpoints/tensorboard on spec.trainer.checkpoint.volume",
    ),
    "tensorboard-config": (
        {"trainer": {"tensorboard": {"logDir": "/etc//rljob/./tb/"}}},
        "spec.trainer.tensorboard.logDir: '/etc//rljob/./tb/' is at or under a directory rljob mounts in the trainer "
        "container (/etc/rljob, /dev/shm): give a directory on a volume, e.g. /var/lib/rljob/checkpoints/tensorboard "
        "on spec.trainer.checkpoint.volume",
    ),
    "tensorboard-model-volume": (
        {"trainer": {"tensorboard": {"logDir": "/models/tb"}}, "model": {"source": "path", "path": "/models/qwen/",
                                                                         "volume": "weights"}},
        "spec.trainer.tensorboard.logDir: '/models/tb' is at or under a directory rljob mounts in the trainer "
        "container (/etc/rljob, /dev/shm, /models): give a directory on a volume, e.g. "
        "/var/lib/rljob/checkpoints/tensorboard on spec.trainer.checkpoint.volume",
    ),
    # what the CRD schema would have refused, if the CRD was bypassed or is older than the operator
    "schema-bound": ({"trainer": {"nodes": 0}}, "spec.trainer.nodes: Input should be greater than or equal to 1"),
    "schema-unknown": ({"trainer": {"nodez": 2}}, "spec.trainer.nodez: Extra inputs are not permitted"),
    "group-of-one": (  # GRPO and GSPO advantages (reward − group mean) would all be 0
        {"rollout": {"samplesPerPrompt": 1}},
        "spec.rollout.samplesPerPrompt: Input should be greater than or equal to 2",
    ),
    "hub-name": (
        {"model": {"source": "huggingface"}},
        "spec.model.name: required when source is 'huggingface': a Hub model id such as Qwen/Qwen2.5-1.5B-Instruct",
    ),
    # no silent tiny model: a Hub id without a source, or no model at all, is refused (as by the CRD schema)
    "model-source": ({"model": {"name": "Qwen/Qwen2.5-1.5B-Instruct"}}, "spec.model.source: Field required"),
    "no-model": ({"model": None}, "spec.model: Field required"),
}


def with_tiny_model(raw: dict) -> dict:
    """``raw`` with model.source = tiny unless it sets one (``"model": None`` drops the model)."""
    if "model" in raw and raw["model"] is None:
        return {k: v for k, v in raw.items() if k != "model"}
    model = raw.get("model") or {}
    return {**raw, "model": model if "source" in model or "name" in model else {"source": "tiny", **model}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_code_check_names_its_field(case):
    raw, *messages = CASES[case]
    _, problems = parse_spec("demo", with_tiny_model(raw))
    assert [str(p) for p in problems] == messages
    cond = valid_condition(problems)
    assert cond.status == "False" and cond.message == "; ".join(messages) + "; fix the spec (kubectl edit rljob)"


@pytest.mark.parametrize("name", ["9lives", "my.job", "Upper"])
def test_job_names_that_cannot_name_services_are_refused(name):
    """A name cannot be edited: the message says to recreate the job, and does not also say to edit the spec."""
    _, problems = parse_spec(name, {"model": {"source": "tiny"}})
    message = (f"metadata.name: {name!r} must start with a lowercase letter and hold only lowercase letters, digits "
               "and '-' (it names the job's Services and pod hostnames); a name cannot be changed: delete the job and "
               "create it again under another name")
    assert [str(p) for p in problems] == [message]
    assert valid_condition(problems).message == message
    _, both = parse_spec(name, {"model": {"source": "tiny", "tiny": {"heads": 3}}})
    assert valid_condition(both).message == (f"{message}; spec.model.tiny.heads: heads = 3 does not divide hiddenSize = "
                                             "64; fix the spec (kubectl edit rljob)")


def test_a_valid_spec_has_no_problems():
    spec, problems = parse_spec("grpo-demo", {"model": {"source": "tiny"},
                                              "trainer": {"nodes": 2, "batch": {"documentsPerStep": 64}}})
    assert problems == [] and spec.trainer.nodes == 2


def test_vllm_on_cpu_runs_head_sizes_its_attention_has_and_gpus_run_any():
    def problems(tiny: dict, gpus: int) -> list[str]:
        return [str(p) for p in parse_spec("v", {"model": {"source": "tiny", "tiny": tiny},
                                                 "rollout": {"backend": "vllm", "gpusPerReplica": gpus}})[1]]

    assert problems({"hiddenSize": 64, "heads": 2}, 0) == []
    assert problems({"hiddenSize": 320, "heads": 4}, 0) == []  # 80
    assert problems({"hiddenSize": 64, "heads": 4}, 1) == []  # vLLM's GPU attention: not checked here
    assert problems({"hiddenSize": 48, "heads": 1}, 0) == [
        "spec.model.tiny: hiddenSize = 48 / heads = 1 gives a head size of 48, which vLLM's CPU attention (backend "
        "'vllm' with gpusPerReplica 0) cannot run: it runs head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, "
        "512; no head count does for hiddenSize = 48: make it a multiple of 32"]
    assert problems({"hiddenSize": 64, "heads": 3}, 0) == [  # one message: the division's own
        "spec.model.tiny.heads: heads = 3 does not divide hiddenSize = 64"]


def test_a_ca_for_a_tls_redis_is_valid():
    spec, problems = parse_spec("tls", {"model": {"source": "tiny"}, "redis": {"mode": "external", "url": "rediss://cache.example:6380/2",
                                                  "caSecretRef": {"name": "redis-ca", "key": "ca.crt"}}})
    assert problems == [] and (spec.redis.ca_secret_ref.name, spec.redis.ca_secret_ref.key) == ("redis-ca", "ca.crt")


@pytest.mark.parametrize(("message", "field"), [
    ('Pod "j-trainer-0" is invalid: [spec.containers[0].resources.limits[cpu]: Invalid value: "-2"', "spec.trainer.resources"),
    ('Pod "j-rollout-3" is invalid: spec.tolerations[0].operator: Invalid value', "spec.rollout.tolerations"),
    ('Deployment.apps "j-redis" is invalid: spec.template.spec.containers[0].image: Required value', "spec.redis"),
    ('ConfigMap "j-config" is invalid: data: Too long', "spec"),
])
def test_a_refusal_of_the_api_server_is_reported_against_the_field_it_points_at(message, field):
    from rljob_operator.admission import refused_field

    assert refused_field(message) == field


def test_settings_at_their_defaults_or_in_use_are_not_refused():
    """The checks above look at values, not at whether a field was written: the API server fills the CRD's defaults
    in before the operator reads the job, so a default (fp32, k3) must never trigger them, nor a value in use."""
    for raw in ({"trainer": {"parallelism": {"strategy": "ddp"}}},
                {"trainer": {"parallelism": {"strategy": "ddp"}, "precision": {"param": "bf16", "reduce": "fp32"}}},
                {"trainer": {"parallelism": {"strategy": "ddp"}, "precision": {"param": "fp32"}}},
                {"trainer": {"precision": {"reduce": "bf16"}}},  # fsdp, the default strategy
                {"algorithm": {"klCoef": 0, "klEstimator": "k3"}},
                {"algorithm": {"klCoef": 0.05, "klEstimator": "k1"}},
                {"trainer": {"tensorboard": {"logDir": "/var/lib/rljob/checkpoints/tb"}}},
                {"trainer": {"tensorboard": {"logDir": "/etc/rljob-tb"}}}):
        _, problems = parse_spec("demo", with_tiny_model(raw))
        assert problems == [], raw


@pytest.mark.parametrize(("labels", "messages"), [
    ({"kueue.x-k8s.io/queue-name": ""}, [
        "metadata.labels[kueue.x-k8s.io/queue-name]: is empty, which names no LocalQueue: set it to the name of a "
        "LocalQueue in namespace ns, or remove the label to run the job without Kueue"]),
    ({"kueue.x-k8s.io/queue-name": "GPU_queue", "kueue.x-k8s.io/priority-class": ""}, [
        "metadata.labels[kueue.x-k8s.io/queue-name]: 'GPU_queue' is not a LocalQueue name (lowercase letters, digits, "
        "'-' and '.', starting and ending with a letter or digit): set it to the name of a LocalQueue in namespace ns, "
        "or remove the label to run the job without Kueue",
        "metadata.labels[kueue.x-k8s.io/priority-class]: is empty, which names no WorkloadPriorityClass: set it to the "
        "name of a WorkloadPriorityClass, or remove the label for the default priority"]),
    ({"kueue.x-k8s.io/queue-name": "gpu-training", "kueue.x-k8s.io/priority-class": "high"}, []),
])
def test_a_kueue_label_that_names_nothing_is_refused_not_ignored(labels, messages):
    """An empty queue-name label would make the job run unqueued without a word (Kueue's own webhooks refuse it)."""
    _, problems = parse_spec("demo", {"model": {"source": "tiny"}}, "ns", labels)
    assert [str(p) for p in problems] == messages
    if messages:
        assert valid_condition(problems).status == "False"


def test_vllm_on_cpu_with_a_memory_limit_that_cannot_hold_the_engine_is_refused_naming_both_numbers():
    """A tiny model's rollout pod on vLLM's CPU build: its container's limit must hold the engine's 3 GiB, the weights
    and one full-length sequence's KV entries."""
    def problems(rollout: dict) -> list[str]:
        return [str(p) for p in parse_spec("v", {"model": {"source": "tiny", "tiny": {"heads": 2}},
                                                 "rollout": {"backend": "vllm", "gpusPerReplica": 0, **rollout}})[1]]

    assert problems({}) == [] and problems({"resources": {"limits": {"memory": "3073Mi"}}}) == []
    assert problems({"resources": {"limits": {"memory": "3Gi"}}}) == [
        "spec.rollout.resources.limits.memory: the rollout container's limit of 3072.0 MiB leaves 0.0 MiB for vLLM's "
        "KV cache after 3072 MiB for the engine and 0.5 MiB for the weights, and one sequence of the model's full "
        "length needs 0.25 MiB: set it to at least 3073Mi"]
    assert problems({"gpusPerReplica": 1, "resources": {"limits": {"memory": "1Gi"}}}) == []  # GPUs: vLLM sizes it
