"""The shared config model: defaults, validation messages, resolved config, names."""

import json

import pytest
from pydantic import ValidationError

from rljob_api import JobConfig, RLTrainingJobSpec, check_spec, data_parallel_size, names, resolve
from rljob_api.config import RedisConnection


def spec(**overrides) -> RLTrainingJobSpec:
    return RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, **overrides})


def test_defaults_and_camel_case_round_trip():
    s = spec(trainer={"nodes": 2, "processesPerNode": 4, "batch": {"documentsPerStep": 64}})
    assert s.trainer.processes_per_node == 4
    assert s.trainer.batch.documents_per_step == 64
    dumped = s.model_dump(by_alias=True)
    assert dumped["trainer"]["processesPerNode"] == 4
    assert dumped["runPolicy"]["backoffLimit"] == 3
    assert RLTrainingJobSpec.model_validate(dumped) == s


def test_unknown_field_is_rejected_with_its_path():
    with pytest.raises(ValidationError) as err:
        spec(trainer={"nodez": 2})
    assert "trainer.nodez" in str(err.value)


def test_bounds_name_the_field():
    with pytest.raises(ValidationError) as err:
        spec(trainer={"nodes": 0})
    assert "trainer.nodes" in str(err.value)


@pytest.mark.parametrize(
    ("nodes", "ppn", "tp", "pp", "dp"), [(1, 1, 1, 1, 1), (2, 1, 1, 1, 2), (1, 2, 1, 1, 2), (2, 8, 2, 2, 4)]
)
def test_data_parallel_size(nodes, ppn, tp, pp, dp):
    s = spec(trainer={"nodes": nodes, "processesPerNode": ppn, "tensorParallel": tp, "pipelineParallel": pp})
    assert data_parallel_size(s) == dp


def test_indivisible_topology_message_prints_the_numbers():
    s = spec(trainer={"nodes": 3, "processesPerNode": 1, "tensorParallel": 2})
    with pytest.raises(ValueError, match="^spec.trainer: nodes 3 × processesPerNode 1 = 3 ranks is not divisible by "
                                         "tensorParallel 2 × pipelineParallel 1 = 2: "):
        data_parallel_size(s)
    fields = [p.field for p in check_spec(s)]
    assert fields[0] == "spec.trainer.nodes"


def test_a_fast_llm_trainer_is_refused_by_the_schema():
    """Launching a Fast-LLM trainer is not supported: ``trainer.backend`` accepts only ``builtin`` (kept, with that
    one value, so that configs resolved by earlier versions keep their hashes)."""
    with pytest.raises(ValidationError, match="trainer.backend"):
        spec(trainer={"backend": "fast-llm"})
    assert spec(trainer={}).trainer.backend == "builtin"


def test_code_checks_name_fields():
    s = spec(
        trainer={"nodes": 2, "pipelineParallel": 2, "batch": {"documentsPerStep": 3}},
        algorithm={"metrics": "basic"},
        redis={"mode": "external"},
        rollout={"task": {"name": "custom"}},
    )
    problems = {p.field: p for p in check_spec(s)}
    assert problems["spec.algorithm.metrics"].message == "metrics=basic requires pipelineParallel == 1"
    assert problems["spec.trainer.pipelineParallel"].supported is False
    assert problems["spec.redis.url"].message == "required when mode is 'external'"
    assert problems["spec.rollout.task.datasetPath"].message == "required for task 'custom'"
    assert problems["spec.rollout.task.rewardFunction"].message == "required for task 'custom'"
    assert "spec.trainer.batch.documentsPerStep" not in problems  # DP = 2 / 2 = 1 divides 3
    s2 = spec(trainer={"nodes": 2, "batch": {"documentsPerStep": 3}})
    assert [str(p) for p in check_spec(s2)] == [
        "spec.trainer.batch.documentsPerStep: documentsPerStep 3 is not divisible by the data-parallel size 2 = nodes "
        "2 × processesPerNode 1 / (tensorParallel 1 × pipelineParallel 1): every data-parallel rank trains the same "
        "number of documents per step; set documentsPerStep to a multiple of the data-parallel size, or change the "
        "topology"
    ]


def test_a_completion_longer_than_the_tiny_models_positions_is_named_with_both_numbers():
    assert check_spec(spec(model={"source": "tiny", "tiny": {"maxPositionEmbeddings": 64}},
                           rollout={"sampling": {"maxNewTokens": 64}})) == []
    (problem,) = check_spec(spec(model={"source": "tiny", "tiny": {"maxPositionEmbeddings": 64}},
                                 rollout={"sampling": {"maxNewTokens": 65}}))
    assert str(problem) == (
        "spec.rollout.sampling.maxNewTokens: 65 is more than the model's 64 positions "
        "(spec.model.tiny.maxPositionEmbeddings), which hold the prompt and the completion: set maxNewTokens below 64, "
        "or raise maxPositionEmbeddings")


@pytest.mark.parametrize("image", ["rljob/trainer-cpu:0.1.0", "registry.k8s.io/pause:3.10.1", "localhost:5000/a/b:t",
                                   "nvcr.io/nvidia/pytorch:24.01-py3", "redis@sha256:" + "ab" * 32])
def test_image_references_a_kubelet_can_pull_pass(image):
    assert check_spec(spec(trainer={"image": image}, rollout={"image": image}, redis={"image": image})) == []


def test_image_references_no_kubelet_could_pull_are_named_with_their_value():
    s = spec(trainer={"image": "rljob/trainer-cpu:"}, rollout={"image": "not an image"}, redis={"image": "Redis:7"})
    assert [str(p) for p in check_spec(s)] == [
        f"{field}: {value!r} is not a container image reference ([registry[:port]/]name[:tag][@digest], lower-case name)"
        for field, value in [("spec.trainer.image", "rljob/trainer-cpu:"), ("spec.rollout.image", "not an image"),
                             ("spec.redis.image", "Redis:7")]
    ]


def test_epsilon_defaults_follow_the_loss():
    assert spec().algorithm.resolved_epsilons() == (0.2, 0.2)
    assert spec(algorithm={"loss": "gspo"}).algorithm.resolved_epsilons() == (3e-4, 4e-4)
    assert spec(algorithm={"loss": "gspo", "epsilonHigh": 0.01}).algorithm.resolved_epsilons() == (3e-4, 0.01)


def test_resolved_config_keys_and_hash():
    s = spec(trainer={"nodes": 2, "batch": {"documentsPerStep": 64}})
    managed = resolve("demo", "ns1", s, RedisConnection(host="demo-redis"))
    assert managed.keys.stream == "fast_llm_streaming"
    assert managed.keys.events == "fast_llm_events"
    assert managed.keys.progress == "rljob:ns1:demo:progress"
    assert managed.keys.consumer(1) == "fast_llm_consumer_1"
    assert managed.data_parallel_size == 2
    assert managed.trainer_master_host == "demo-trainer-0.demo-trainer.ns1.svc.cluster.local"
    external = resolve("demo", "ns1", s.model_copy(update={"redis": s.redis.model_copy(update={"mode": "external"})}),
                       RedisConnection(host="shared"))
    assert external.keys.stream == "rljob:ns1:demo:fast_llm_streaming"
    assert external.keys.events == "rljob:ns1:demo:fast_llm_events"
    again = JobConfig.from_json(managed.to_json())
    assert again == managed and again.config_hash() == managed.config_hash()
    assert len(managed.config_hash()) == 16
    assert json.loads(managed.to_json())["spec"]["trainer"]["nodes"] == 2
    assert managed.config_hash() != external.config_hash()


def test_transfer_ranks_follow_the_design_formula():
    s = spec(rollout={"replicas": 3, "gpusPerReplica": 2, "backend": "vllm"})
    cfg = resolve("j", "n", s, RedisConnection(host="r"))
    assert [cfg.transfer_rank(i, t) for i in range(3) for t in range(2)] == [1, 2, 3, 4, 5, 6]


def test_long_job_names_stay_within_63_characters_and_stay_distinct():
    a = "x" * 60 + "a"
    b = "x" * 60 + "b"
    for job in (a, b):
        for name in (names.rollout_pod(job, 9999), names.trainer_pod(job, 4095), names.redis_secret(job),
                     names.config_map(job), names.trainer_service(job)):
            assert len(name) <= 63, name
    assert names.trainer_pod(a, 0) != names.trainer_pod(b, 0)
    assert names.trainer_pod("short", 1) == "short-trainer-1"


def test_unacknowledged_documents_between_checkpoints_must_fit_under_max_pending():
    ok = spec(trainer={"batch": {"documentsPerStep": 512}, "checkpoint": {"everySteps": 8}}, redis={"maxPending": 4096})
    assert check_spec(ok) == []  # 512 × 8 = 4096: the rollout can still fill the step that checkpoints
    stall = ok.model_copy(update={"trainer": ok.trainer.model_copy(update={
        "checkpoint": ok.trainer.checkpoint.model_copy(update={"every_steps": 9})})})
    (problem,) = check_spec(stall)
    assert problem.field == "spec.trainer.checkpoint.everySteps"
    assert "512 × 9 = 4608 must not exceed spec.redis.maxPending = 4096" in problem.message


@pytest.mark.parametrize("example", ["rljob-cpu.yaml", "rljob-vllm-cpu.yaml", "rljob.yaml", "rljob-environment-cpu.yaml"])
def test_examples_pass_the_code_checks(example):
    from pathlib import Path

    import yaml

    documents = list(yaml.safe_load_all((Path(__file__).resolve().parents[2] / "examples" / example).read_text()))
    (claim,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    (manifest,) = [d for d in documents if d["kind"] == "RLTrainingJob"]
    assert check_spec(RLTrainingJobSpec.model_validate(manifest["spec"])) == []
    # Checkpoints on a claim of the same file, so a gang restart resumes (not an emptyDir).
    assert manifest["spec"]["trainer"]["checkpoint"]["volume"] == claim["metadata"]["name"]



# --- off-policy corrections, reference KL, learning-rate decay (issue 13): off by default ----------------------------
def test_the_corrections_are_off_by_default():
    a = spec().algorithm
    assert (a.dual_clip, a.importance_sampling.enabled, a.max_staleness, a.kl_coef) == (None, False, None, 0.0)
    assert (a.importance_sampling.cap, a.kl_estimator) == (2.0, "k3")
    o = spec().trainer.optimizer
    assert (o.schedule, o.min_learning_rate) == ("constant", 0.0)


@pytest.mark.parametrize("algorithm, field, value", [
    ({"dualClip": 1.0}, "algorithm.dualClip", 1.0),  # a bound at 1 x A would clip on-policy tokens of A < 0
    ({"importanceSampling": {"enabled": True, "cap": 0.5}}, "algorithm.importanceSampling.cap", 0.5),
    ({"maxStaleness": -1}, "algorithm.maxStaleness", -1),
    ({"klCoef": -0.1}, "algorithm.klCoef", -0.1),
    ({"klEstimator": "k2"}, "algorithm.klEstimator", "k2"),
])
def test_correction_bounds_name_the_field_and_the_value(algorithm, field, value):
    with pytest.raises(ValidationError) as err:
        spec(algorithm=algorithm)
    (error,) = err.value.errors()
    assert (".".join(str(part) for part in error["loc"]), error["input"]) == (field, value)


def test_fields_left_at_their_defaults_leave_the_resolved_config_and_its_hash_as_before():
    """A job that sets none of the new fields resolves to the bytes it resolved to before they existed (an older
    trainer image still reads them, and no hash changes); setting one, even to its default value explicitly, as the
    API server does when it fills the CRD's defaults, changes nothing either, and a value that turns a correction on
    does."""
    before = resolve("demo", "ns", spec(), RedisConnection(host="r"))
    document = json.loads(before.to_json())
    for name in ("dualClip", "importanceSampling", "maxStaleness", "klCoef", "klEstimator"):
        assert name not in document["spec"]["algorithm"]
    assert "schedule" not in document["spec"]["trainer"]["optimizer"]
    assert "minLearningRate" not in document["spec"]["trainer"]["optimizer"]
    assert "tensorboard" not in document["spec"]["trainer"]
    assert "weightSyncBucketMegabytes" not in document["spec"]["trainer"]
    filled = spec(algorithm={"importanceSampling": {"enabled": False, "cap": 2.0}, "klCoef": 0.0, "klEstimator": "k3"},
                  trainer={"optimizer": {"schedule": "constant", "minLearningRate": 0.0}})
    assert resolve("demo", "ns", filled, RedisConnection(host="r")).to_json() == before.to_json()
    for on in ({"dualClip": 3.0}, {"importanceSampling": {"enabled": True}}, {"maxStaleness": 64}, {"klCoef": 0.01},
               {"klEstimator": "k1"}):
        changed = resolve("demo", "ns", spec(algorithm=on), RedisConnection(host="r"))
        assert changed.config_hash() != before.config_hash()
        assert JobConfig.from_json(changed.to_json()) == changed
    board = resolve("demo", "ns", spec(trainer={"tensorboard": {"logDir": "/var/lib/rljob/checkpoints/tb"}}),
                    RedisConnection(host="r"))
    assert json.loads(board.to_json())["spec"]["trainer"]["tensorboard"] == {"logDir": "/var/lib/rljob/checkpoints/tb"}
    assert board.config_hash() != before.config_hash() and JobConfig.from_json(board.to_json()) == board
    decayed = resolve("demo", "ns", spec(trainer={"optimizer": {"schedule": "cosine"}}), RedisConnection(host="r"))
    assert json.loads(decayed.to_json())["spec"]["trainer"]["optimizer"]["schedule"] == "cosine"
    buckets = resolve("demo", "ns", spec(trainer={"weightSyncBucketMegabytes": 16}), RedisConnection(host="r"))
    assert json.loads(buckets.to_json())["spec"]["trainer"]["weightSyncBucketMegabytes"] == 16
    assert buckets.config_hash() != before.config_hash() and JobConfig.from_json(buckets.to_json()) == buckets


@pytest.mark.parametrize("value", [0, -1, 4097, 1.5])
def test_the_weight_sync_bucket_size_is_a_whole_number_of_mib_from_1_to_4096(value):
    with pytest.raises(ValidationError) as err:
        spec(trainer={"weightSyncBucketMegabytes": value})
    (error,) = err.value.errors()
    assert (".".join(str(part) for part in error["loc"]), error["input"]) == ("trainer.weightSyncBucketMegabytes", value)


@pytest.mark.parametrize("tensorboard", [{"logDir": "runs/tb"}, {"logDir": ""}, {}])
def test_tensorboard_needs_an_absolute_log_dir(tensorboard):
    with pytest.raises(ValidationError) as err:
        spec(trainer={"tensorboard": tensorboard})
    (error,) = err.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == "trainer.tensorboard.logDir"
