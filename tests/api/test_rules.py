"""The rules shared by the CRD's CEL, the operator's spec check and the trainer's start check (rljob_api.rules)."""

from __future__ import annotations

import pytest

from rljob_api import rules
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.validation import check_spec


def test_data_parallel_divides_or_says_none():
    assert rules.data_parallel(8, 2, 2) == 2
    assert rules.data_parallel(6, 1, 1) == 6
    assert rules.data_parallel(6, 4, 1) is None


def test_documents_per_rank_divides_or_says_none():
    assert rules.documents_per_rank(64, 4) == 16
    assert rules.documents_per_rank(64, 3) is None


@pytest.mark.parametrize("level, stages, allowed", [
    ("basic", 1, True), ("full", 1, True), ("basic", 2, False), ("full", 2, False), ("none", 2, True),
    ("auto", 2, True),
])
def test_metrics_allowed(level, stages, allowed):
    assert rules.metrics_allowed(level, stages) is allowed


def test_the_operators_check_applies_the_same_rules():
    def fields(**trainer) -> set[str]:
        spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "trainer": trainer})
        return {p.field for p in check_spec(spec)}

    assert "spec.trainer.nodes" in fields(nodes=3, tensorParallel=2)
    assert "spec.trainer.batch.documentsPerStep" in fields(nodes=2, processesPerNode=3, batch={"documentsPerStep": 64})
    assert "spec.trainer.batch.documentsPerStep" not in fields(nodes=2, processesPerNode=2, batch={"documentsPerStep": 64})
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "algorithm": {"metrics": "full"},
                                             "trainer": {"nodes": 2, "pipelineParallel": 2}})
    assert "spec.algorithm.metrics" in {p.field for p in check_spec(spec)}


@pytest.mark.parametrize("strategy, replicate, dp, allowed", [
    ("fsdp", 1, 4, True), ("fsdp", 2, 4, True), ("fsdp", 4, 4, True), ("fsdp", 3, 4, False), ("fsdp", 8, 4, False),
    ("ddp", 1, 4, True), ("ddp", 2, 4, False),
])
def test_replicate_allowed(strategy, replicate, dp, allowed):
    assert rules.replicate_allowed(strategy, replicate, dp) is allowed


def test_the_operators_check_names_the_replicate_and_its_numbers():
    def problems(**parallelism) -> list[str]:
        spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "trainer": {
            "nodes": 2, "processesPerNode": 2, "batch": {"documentsPerStep": 64}, "parallelism": parallelism}})
        return [str(p) for p in check_spec(spec)]

    assert problems(strategy="fsdp", replicate=2) == []
    assert problems(strategy="fsdp", replicate=3) == [
        "spec.trainer.parallelism.replicate: replicate 3 does not divide the data-parallel size 4 = nodes 2 × "
        "processesPerNode 2 / (tensorParallel 1 × pipelineParallel 1): each of the replicate groups (HSDP) shards the "
        "model over the same number of ranks"]
    assert problems(strategy="ddp", replicate=2) == [
        "spec.trainer.parallelism.replicate: replicate = 2 (HSDP) requires strategy fsdp, not ddp"]


@pytest.mark.parametrize("floor, base, schedule, allowed", [
    (0.0, 1e-6, "cosine", True), (1e-6, 1e-6, "cosine", False), (2e-6, 1e-6, "linear", False),
    (1e-7, 1e-6, "linear", True), (2e-6, 1e-6, "constant", True),  # constant: learning_rate_floor_used's to refuse
])
def test_learning_rate_floor_allowed(floor, base, schedule, allowed):
    assert rules.learning_rate_floor_allowed(floor, base, schedule) is allowed


@pytest.mark.parametrize("floor, schedule, used", [
    (0.0, "constant", True), (1e-7, "constant", False), (1e-7, "linear", True), (0.0, "cosine", True)])
def test_learning_rate_floor_used(floor, schedule, used):
    assert rules.learning_rate_floor_used(floor, schedule) is used


@pytest.mark.parametrize("schedule, warmup, max_steps, allowed", [
    ("cosine", 0, 2, True), ("cosine", 0, 1, False), ("linear", 98, 100, True), ("linear", 99, 100, False),
    ("cosine", 100, 100, False), ("cosine", 200, 100, False), ("constant", 200, 100, True)])
def test_decay_steps_allowed(schedule, warmup, max_steps, allowed):
    assert rules.decay_steps_allowed(schedule, warmup, max_steps) is allowed


def optimizer_problems(max_steps: int = 100, **optimizer) -> list[str]:
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"},
                                             "trainer": {"maxSteps": max_steps, "optimizer": optimizer}})
    return [str(p) for p in check_spec(spec)]


def test_the_operators_check_names_the_learning_rate_floor_and_both_values():
    assert optimizer_problems(learningRate=1e-5, minLearningRate=3e-5, schedule="cosine") == [
        "spec.trainer.optimizer.minLearningRate: minLearningRate = 3e-05 must be below learningRate = 1e-05: schedule "
        "cosine decays from learningRate to minLearningRate (equal, the rate would stay constant)"]
    assert optimizer_problems(learningRate=1e-5, minLearningRate=1e-5, schedule="linear") == [
        "spec.trainer.optimizer.minLearningRate: minLearningRate = 1e-05 must be below learningRate = 1e-05: schedule "
        "linear decays from learningRate to minLearningRate (equal, the rate would stay constant)"]
    assert optimizer_problems(learningRate=1e-5, minLearningRate=1e-6, schedule="cosine") == []
    rule = rules.CEL_MIN_LEARNING_RATE
    assert rule["rule"] == ("!(self.learningRate > 0.0 && self.learningRate <= 1.0) || self.schedule == 'constant' || "
                            "self.minLearningRate < self.learningRate") and rule["fieldPath"] == ".minLearningRate"
    assert "string(" not in rule["messageExpression"]  # string(double) blows the CRD's CEL cost budget


def test_a_floor_without_a_decay_is_refused_naming_the_floor():
    assert optimizer_problems(minLearningRate=1e-7) == [
        "spec.trainer.optimizer.minLearningRate: 1e-07 is ignored with schedule constant (the rate stays at "
        "learningRate after the warm-up): set schedule linear or cosine to decay to it, or remove minLearningRate"]
    assert optimizer_problems(minLearningRate=2e-6) == optimizer_problems(minLearningRate=2e-6, schedule="constant")
    assert "ignored with schedule constant" in optimizer_problems(minLearningRate=2e-6)[0]  # not a second message
    assert len(optimizer_problems(minLearningRate=2e-6)) == 1
    assert rules.CEL_MIN_LEARNING_RATE_NEEDS_DECAY["rule"] == "self.schedule != 'constant' || self.minLearningRate == 0.0"


def test_a_decay_without_steps_after_the_warm_up_is_refused_with_both_counts():
    assert optimizer_problems(max_steps=100, warmupSteps=200, schedule="cosine") == [
        "spec.trainer.optimizer.schedule: cosine decays over the steps after the warm-up, the first of them at "
        "learningRate: with warmupSteps = 200 and spec.trainer.maxSteps = 100 nothing is left to decay; it needs "
        "maxSteps >= warmupSteps + 2"]
    assert optimizer_problems(max_steps=100, warmupSteps=99, schedule="linear") == [
        "spec.trainer.optimizer.schedule: linear decays over the steps after the warm-up, the first of them at "
        "learningRate: with warmupSteps = 99 and spec.trainer.maxSteps = 100 nothing is left to decay; it needs "
        "maxSteps >= warmupSteps + 2"]
    assert optimizer_problems(max_steps=100, warmupSteps=98, schedule="linear") == []
    assert optimizer_problems(max_steps=100, warmupSteps=200) == []  # constant: a warm-up cut short by maxSteps


@pytest.mark.parametrize("enabled, cap, used", [(False, 2.0, True), (False, 5.0, False), (True, 5.0, True)])
def test_is_cap_used(enabled, cap, used):
    assert rules.is_cap_used(enabled, cap) is used


def algorithm_problems(**algorithm) -> list[str]:
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "algorithm": algorithm})
    return [str(p) for p in check_spec(spec)]


PROXIMAL = ("with importanceSampling enabled the PPO ratio is taken against the trainer's own weights at the start of "
            "the step and is 1 (DESIGN section 4), so it is")


def test_importance_sampling_refuses_what_it_would_ignore_naming_field_and_value():
    on = {"enabled": True, "cap": 3}
    assert algorithm_problems(importanceSampling={"cap": 5}) == [
        "spec.algorithm.importanceSampling.cap: 5 is ignored while importanceSampling.enabled is false (no behaviour "
        "weight is applied): set enabled: true, or remove cap"]
    assert algorithm_problems(importanceSampling=on, dualClip=3) == [
        f"spec.algorithm.dualClip: dualClip = 3 never binds: {PROXIMAL} never above dualClip; the cap bounds the behaviour "
        "weight: remove dualClip, or disable importanceSampling"]
    assert algorithm_problems(importanceSampling=on, epsilonHigh=0.28) == [
        f"spec.algorithm.epsilonHigh: epsilonHigh = 0.28 never binds: {PROXIMAL} never clipped; the cap bounds the "
        "behaviour weight: remove epsilonLow and epsilonHigh, or disable importanceSampling"]
    assert algorithm_problems(importanceSampling=on, epsilonLow=0.1, epsilonHigh=0.3) == [
        f"spec.algorithm.epsilonLow: epsilonLow = 0.1, epsilonHigh = 0.3 never bind: {PROXIMAL} never clipped; the "
        "cap bounds the behaviour weight: remove epsilonLow and epsilonHigh, or disable importanceSampling"]
    assert algorithm_problems(importanceSampling=on) == []
    assert algorithm_problems(importanceSampling={"cap": 2}, dualClip=3, epsilonHigh=0.28) == []  # off: both bind
    assert RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}).algorithm.importance_sampling.cap == \
        rules.DEFAULT_IS_CAP
    assert rules.CEL_IS_CAP_NEEDS_ENABLED["rule"] == "self.enabled || self.cap == 2.0"
    assert rules.CEL_DUAL_CLIP_WITHOUT_IS["rule"] == "!has(self.dualClip) || !self.importanceSampling.enabled"


@pytest.mark.parametrize("strategy, reduce, allowed", [
    ("fsdp", "fp32", True), ("fsdp", "bf16", True), ("ddp", "fp32", True), ("ddp", "bf16", False),
])
def test_reduce_format_allowed(strategy, reduce, allowed):
    assert rules.reduce_format_allowed(strategy, reduce) is allowed


@pytest.mark.parametrize("kl_coef, estimator, allowed", [
    (0.0, "k3", True), (0.0, "k1", False), (0.05, "k1", True), (0.05, "k3", True),
])
def test_kl_estimator_allowed(kl_coef, estimator, allowed):
    assert rules.kl_estimator_allowed(kl_coef, estimator) is allowed


def test_the_ignored_settings_rules_are_on_values_the_api_server_defaults_never_trigger():
    """The CRD fills precision.reduce (fp32) and klEstimator (k3) in before CEL runs, so the rules can only refuse a
    value other than the default; the default of the model and of the CEL rule are the same constant."""
    assert RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}).algorithm.kl_estimator == \
        rules.DEFAULT_KL_ESTIMATOR
    assert rules.CEL_KL_ESTIMATOR_NEEDS_KL["rule"] == "self.klCoef > 0.0 || self.klEstimator == 'k3'"
    assert rules.CEL_REDUCE_NEEDS_FSDP["rule"] == (
        "self.parallelism.strategy == 'fsdp' || self.precision.reduce == 'fp32'")
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"},
                                             "trainer": {"parallelism": {"strategy": "ddp"}}})
    assert spec.trainer.precision.reduce == "fp32" and check_spec(spec) == []


def test_trainer_count_bounds_are_the_schemas_and_the_cel_rules():
    """One home for the trainer's count bounds: the CRD schema's minimum/maximum (from the pydantic Fields) and the
    range the topology rules skip are both rules.TRAINER_COUNT_BOUNDS."""
    from rljob_api.spec import TrainerSpec

    schema = TrainerSpec.model_json_schema(by_alias=True)["properties"]
    for name, (low, high) in rules.TRAINER_COUNT_BOUNDS.items():
        assert (schema[name]["minimum"], schema[name]["maximum"]) == (low, high), name
        assert f"self.{name} >= {low} && self.{name} <= {high}" in rules.CEL_TOPOLOGY["rule"], name


def test_the_divisibility_refusals_name_the_numbers_from_one_template_for_the_operator_and_the_api_server():
    """The operator's message and the CEL rule's messageExpression come from one template; the API server's rendering
    of the digits is asserted against a real API server in tests/operator/test_cluster.py."""
    import string

    for rule, message in ((rules.CEL_TOPOLOGY, rules.TOPOLOGY_MESSAGE),
                          (rules.CEL_DOCUMENTS_PER_STEP, rules.DOCUMENTS_PER_STEP_MESSAGE),
                          (rules.CEL_REPLICATE, rules.REPLICATE_MESSAGE)):
        assert rule["messageExpression"] == message.cel()
        fields = {name for _, name, _, _ in string.Formatter().parse(message.template) if name}
        assert fields == set(message.values)
    assert rules.cel_decimal("self.nodes", 4096) == (
        "(self.nodes>=1000?\"0123456789\".substring(self.nodes/1000%10).substring(0,1):\"\")+"
        "(self.nodes>=100?\"0123456789\".substring(self.nodes/100%10).substring(0,1):\"\")+"
        "(self.nodes>=10?\"0123456789\".substring(self.nodes/10%10).substring(0,1):\"\")+"
        "\"0123456789\".substring(self.nodes%10).substring(0,1)")
    assert rules.DOCUMENTS_PER_STEP_MESSAGE.text(
        documentsPerStep=512, dataParallel=3, nodes=1, processesPerNode=3, tensorParallel=1, pipelineParallel=1
    ).startswith("documentsPerStep 512 is not divisible by the data-parallel size 3 = nodes 1 × processesPerNode 3 / "
                 "(tensorParallel 1 × pipelineParallel 1): ")
