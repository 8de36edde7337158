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
        "spec.trainer.parallelism.replicate: replicate = 3 does not divide the data-parallel size 4"]
    assert problems(strategy="ddp", replicate=2) == [
        "spec.trainer.parallelism.replicate: replicate = 2 (HSDP) requires strategy fsdp, not ddp"]


@pytest.mark.parametrize("floor, base, allowed", [(0.0, 1e-6, True), (1e-6, 1e-6, True), (2e-6, 1e-6, False)])
def test_learning_rate_floor_allowed(floor, base, allowed):
    assert rules.learning_rate_floor_allowed(floor, base) is allowed


def test_the_operators_check_names_the_learning_rate_floor_and_both_values():
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "trainer": {
        "optimizer": {"learningRate": 1e-5, "minLearningRate": 3e-5, "schedule": "cosine"}}})
    assert [str(p) for p in check_spec(spec)] == [
        "spec.trainer.optimizer.minLearningRate: minLearningRate = 3e-05 must not exceed learningRate = 1e-05"]
    rule = rules.CEL_MIN_LEARNING_RATE
    assert rule["rule"] == "self.minLearningRate <= self.learningRate" and rule["fieldPath"] == ".minLearningRate"
    assert "messageExpression" not in rule  # string(double) blows the CRD's CEL cost budget: the API server refuses it


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
