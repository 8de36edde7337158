"""spec.rollout.task.rewardSource without a cluster: how rollout pods mount it, what it does to the config hashes (a
rollout-only field, absent from the config at its default), how the operator reads its ConfigMap, when a rollout pod is
outdated, RolloutReady, and the spec check."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path

import pytest
import yaml

from rljob_api import constants as c
from rljob_api.canonical import canonical_json
from rljob_api.config import JobConfig
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.status import RLTrainingJobStatus
from rljob_api.validation import check_spec

from rljob_operator import gang, job_status, render, resolution
from rljob_operator.reward_source import RewardSourceState, reward_source_state

from operator_helpers import T0, make_job, make_spec, rollout, trainer

CONFIG_MAP = {"configMapKeyRef": {"name": "rewards", "key": "reward.py"}}


def custom(source: dict | None = None, **task) -> dict:
    """A rollout section with the custom task (and ``source`` as its rewardSource)."""
    task = {"name": "custom", "datasetPath": "/etc/rljob-reward/prompts.jsonl", "rewardFunction": "my_reward:score",
            **task, **({"rewardSource": source} if source is not None else {})}
    return {"replicas": 2, "task": task}


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_configmap_source_is_mounted_whole_and_read_only_and_env_names_the_module_file():
    job = make_job(trainer={"nodes": 2}, rollout=custom(CONFIG_MAP))
    config = render.job_config(job)
    pod = render.rollout_pod(job, config, 1, "0123456789abcdef")
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["reward-source"] == {"name": "reward-source", "configMap": {"name": "rewards"}}  # no items: every key
    assert {"name": "reward-source", "mountPath": "/etc/rljob-reward", "readOnly": True} in container["volumeMounts"]
    assert not any("subPath" in m for m in container["volumeMounts"])  # subPath files are never updated
    assert _env(container)[c.ENV_REWARD_SOURCE] == "/etc/rljob-reward/reward.py"
    assert pod["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH] == "0123456789abcdef"
    for trainer_pod in (render.trainer_pod(job, config, i, 0) for i in range(2)):  # the trainer never loads rewards
        (t,) = trainer_pod["spec"]["containers"]
        assert "reward-source" not in {v["name"] for v in trainer_pod["spec"]["volumes"]}
        assert c.ENV_REWARD_SOURCE not in _env(t) and c.LABEL_REWARD_SOURCE_HASH not in trainer_pod["metadata"]["labels"]
    unlabelled = render.rollout_pod(job, config, 1)  # the ConfigMap not found: no hash to carry
    assert c.LABEL_REWARD_SOURCE_HASH not in unlabelled["metadata"]["labels"]


def test_a_path_source_mounts_its_claim_at_the_files_directory_or_nothing_without_one():
    job = make_job(rollout=custom({"path": "/rewards/code/score.py", "volume": "reward-code"}))
    pod = render.rollout_pod(job, render.job_config(job), 0)
    (container,) = pod["spec"]["containers"]
    assert {"name": "reward-source", "persistentVolumeClaim": {"claimName": "reward-code", "readOnly": True}} in (
        pod["spec"]["volumes"])
    assert {"name": "reward-source", "mountPath": "/rewards/code", "readOnly": True} in container["volumeMounts"]
    assert _env(container)[c.ENV_REWARD_SOURCE] == "/rewards/code/score.py"

    on_model = make_job(model={"source": "path", "path": "/models/qwen", "volume": "models"},
                        rollout=custom({"path": "/models/score.py"}))  # on the model's claim, mounted at /models
    pod = render.rollout_pod(on_model, render.job_config(on_model), 0)
    (container,) = pod["spec"]["containers"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["config", "dshm", "model"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/etc/rljob", "/dev/shm", "/models"]
    assert _env(container)[c.ENV_REWARD_SOURCE] == "/models/score.py"


def test_without_a_source_nothing_changes_and_the_field_is_not_in_the_config():
    job = make_job(rollout=custom())
    config = render.job_config(job)
    document = json.loads(config.to_json())
    assert "rewardSource" not in document["spec"]["rollout"]["task"]
    pod = render.rollout_pod(job, config, 0)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["config", "dshm"]
    assert c.ENV_REWARD_SOURCE not in _env(pod["spec"]["containers"][0])
    # a config recorded before the field existed has the same bytes, so the same hashes
    recorded = JobConfig.from_json(canonical_json(document))
    assert render.config_hashes(recorded) == render.config_hashes(config)


def test_a_source_changes_the_rollout_pods_hash_and_never_the_trainers():
    plain = render.config_hashes(render.job_config(make_job(rollout=custom())))
    sourced = render.config_hashes(render.job_config(make_job(rollout=custom(CONFIG_MAP))))
    other_key = render.config_hashes(render.job_config(make_job(
        rollout=custom({"configMapKeyRef": {"name": "rewards", "key": "v2.py"}}))))
    assert plain.trainer == sourced.trainer == other_key.trainer
    assert len({plain.rollout, sourced.rollout, other_key.rollout}) == 3
    assert len({plain.config, sourced.config, other_key.config}) == 3


@pytest.mark.parametrize("before, after", [(None, CONFIG_MAP), (CONFIG_MAP, None)], ids=["added", "removed"])
def test_adding_or_removing_a_source_on_a_recorded_job_keeps_the_trainers_record(before, after):
    """A rollout-only edit of a recorded job: the trainer keeps its recorded hash, the rollout pods get the edit (a
    field left out of the new resolution at its default is taken out of the record too)."""
    earlier = render.job_config(make_job(rollout=custom(before)))
    recorded = resolution.Recorded(JobConfig.from_recorded(earlier.to_json(), {"trainer": "t-rec", "rollout": "r-rec"}), 3)
    config = resolution.effective_config(make_job(rollout=custom(after)), 4, recorded)
    task = json.loads(config.to_json())["spec"]["rollout"]["task"]
    assert ("rewardSource" in task) == (after is not None)
    assert JobConfig.from_json(config.to_json()).spec.rollout.task == make_spec(rollout=custom(after)).rollout.task
    hashes = render.config_hashes(config)
    assert hashes.trainer == "t-rec" and hashes.rollout not in ("r-rec", render.config_hashes(earlier).rollout)
    assert hashes.rollout == render.config_hashes(render.job_config(make_job(rollout=custom(after)))).rollout


def test_the_configmap_is_read_into_a_content_hash_or_a_problem_naming_it():
    spec = make_spec(rollout=custom(CONFIG_MAP))
    field = "spec.rollout.task.rewardSource.configMapKeyRef"
    assert reward_source_state(make_spec(rollout=custom()), "ns", None) == RewardSourceState(None, None)
    missing = reward_source_state(spec, "team-a", None)
    assert (missing.hash, missing.problem) == (None, (
        f"ConfigMap rewards ({field}) not found in namespace team-a: rollout pods cannot start until it exists "
        "(running ones keep the reward code they loaded)"))
    no_key = reward_source_state(spec, "ns", {"data": {"v2.py": "x", "prompts.jsonl": "{}"}, "binaryData": {"b": "AA=="}})
    assert no_key.problem == (f"ConfigMap rewards has no key reward.py ({field}.key; its keys: b, prompts.jsonl, v2.py): "
                              "rollout pods cannot load the reward module until it exists")
    empty = reward_source_state(spec, "ns", {"metadata": {"name": "rewards"}})
    assert f"({field}.key; its keys: none)" in empty.problem

    one = reward_source_state(spec, "ns", {"data": {"reward.py": "def score(p, c, r): return 1.0\n"}})
    again = reward_source_state(spec, "ns", {"data": {"reward.py": "def score(p, c, r): return 1.0\n"},
                                             "metadata": {"resourceVersion": "99"}})
    edited = reward_source_state(spec, "ns", {"data": {"reward.py": "def score(p, c, r): return 0.5\n"}})
    helper = reward_source_state(spec, "ns", {"data": {"reward.py": "def score(p, c, r): return 1.0\n", "h.py": ""}})
    binary = reward_source_state(spec, "ns", {"binaryData": {"reward.py": "ZGVmIHNjb3JlKCk6IHBhc3MK"}})
    assert one.problem is None and binary.problem is None and len(one.hash) == 16
    assert one.hash == again.hash  # metadata is not content
    assert len({one.hash, edited.hash, helper.hash, binary.hash}) == 4  # any key is code or data the pods read


def test_a_rollout_pod_of_other_reward_content_is_outdated_and_the_trainers_never_are():
    base = render.config_hashes(render.job_config(make_job(rollout=custom(CONFIG_MAP))))
    hashes = gang.ConfigHashes(base.config, base.trainer, base.rollout, reward_source="new")
    current = dict(config_hash=base.config, role_config_hash=base.rollout)
    assert not hashes.outdated(rollout(0, **current, reward_source_hash="new"))
    assert hashes.outdated(rollout(0, **current, reward_source_hash="old"))
    assert hashes.outdated(rollout(0, **current))  # made while the ConfigMap was missing
    assert not hashes.outdated(trainer(0, 0, config_hash=base.config, role_config_hash=base.trainer))
    unknown = gang.ConfigHashes(base.config, base.trainer, base.rollout)  # no source, or the ConfigMap is gone
    assert not unknown.outdated(rollout(0, **current, reward_source_hash="old"))
    assert not unknown.outdated(rollout(0, **current))


def test_a_missing_source_makes_rollout_ready_false_with_a_warning_and_running_says_nothing_reaches_the_trainer():
    problem = "ConfigMap rewards (spec.rollout.task.rewardSource.configMapKeyRef) not found in namespace ns: ..."
    running = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING,
                             message="attempt 0: all 2 trainer pods running")
    waiting = rollout(0, phase="Pending", waiting_reason="")  # ContainerCreating: the kubelet cannot mount it

    def build(previous, reward_source):
        return job_status.build_status(previous, generation=1, lifecycle=running, problems=[], data_parallel_size=2,
                                   redis=job_status.RedisHealth(True, "ok"), pods=[trainer(0, 0), trainer(1, 0), waiting],
                                   nodes=2, replicas=1, progress=None, now=T0, reward_source=reward_source)

    before = build(RLTrainingJobStatus(), None)
    assert before.condition(ConditionType.ROLLOUT_READY).reason == Reason.PODS_NOT_READY.value
    after = build(before, problem)
    ready = after.condition(ConditionType.ROLLOUT_READY)
    assert (ready.status, ready.reason, ready.message) == ("False", "RewardSourceMissing", problem)
    assert after.condition(ConditionType.RUNNING).message.endswith(
        "; no new document reaches the trainer while RolloutReady is False (RewardSourceMissing)")
    events = job_status.transition_events(before, after)
    assert ("Warning", "RewardSourceMissing", f"RolloutReady=False: {problem}") in [
        (e.type, e.reason, e.message) for e in events]


@pytest.mark.parametrize("overrides, problem", [
    ({"rollout": {"task": {"name": "digits-copy", "rewardSource": CONFIG_MAP}}},
     "spec.rollout.task.rewardSource: needs task name 'custom', got 'digits-copy': the built-in tasks score with their "
     "own rewards"),
    ({"rollout": custom({})}, "spec.rollout.task.rewardSource: needs exactly one of configMapKeyRef or path"),
    ({"rollout": custom({**CONFIG_MAP, "path": "/r/score.py"})},
     "spec.rollout.task.rewardSource: needs exactly one of configMapKeyRef or path"),
    ({"rollout": custom({**CONFIG_MAP, "volume": "claim"})},
     "spec.rollout.task.rewardSource.volume: needs path, the module's file on that volume"),
    ({"model": {"source": "path", "path": "/models/qwen", "volume": "models"},
      "rollout": custom({"path": "/models/score.py", "volume": "rewards"})},
     "spec.rollout.task.rewardSource.volume: 'rewards' would be mounted at /models, where spec.model.volume 'models' is "
     "mounted already: put the file on that volume and remove rewardSource.volume, or use another directory"),
    ({"rollout": custom({"path": "/rewards/"})},
     "spec.rollout.task.rewardSource.path: '/rewards/' names a directory: give the file of the module, e.g. "
     "/rewards/reward.py"),
    ({"rollout": custom({"path": "/score.py", "volume": "rewards"})},
     "spec.rollout.task.rewardSource.path: '/score.py': rewardSource.volume 'rewards' would be mounted at its "
     "directory, /, over the container's whole filesystem: give a path in a directory of its own, e.g. "
     "/reward/score.py mounts the claim at /reward"),
    ({"rollout": custom({"path": "/etc//rljob/./code/score.py", "volume": "rewards"})},
     "spec.rollout.task.rewardSource.path: '/etc//rljob/./code/score.py': rewardSource.volume 'rewards' would be "
     "mounted at /etc/rljob/code, at or under a directory rljob mounts in the rollout container (/etc/rljob, "
     "/dev/shm): choose another directory"),
    ({"redis": {"mode": "external", "url": "rediss://redis.example:6380",
                "caSecretRef": {"name": "redis-ca", "key": "ca.crt"}},
      "rollout": custom({"path": "/etc/rljob-redis-ca/score.py", "volume": "rewards"})},
     "spec.rollout.task.rewardSource.path: '/etc/rljob-redis-ca/score.py': rewardSource.volume 'rewards' would be "
     "mounted at /etc/rljob-redis-ca, at or under a directory rljob mounts in the rollout container (/etc/rljob, "
     "/dev/shm, /etc/rljob-redis-ca): choose another directory"),
], ids=["other-task", "no-source", "two-sources", "volume-without-path", "model-volume-directory", "directory",
        "root", "under-config-mount", "under-redis-ca-mount"])
def test_a_source_the_pods_could_not_use_is_a_spec_problem_naming_the_field(overrides, problem):
    assert [str(p) for p in check_spec(make_spec(**overrides))] == [problem]


def test_valid_sources_are_no_problem():
    for source in (CONFIG_MAP, {"path": "/r/score.py"}, {"path": "/r/score.py", "volume": "rewards"},
                   {"path": "/etc/rljob-rewards/score.py", "volume": "rewards"}, {"path": "/score.py"}):
        assert check_spec(make_spec(rollout=custom(source))) == [], source


def test_a_claim_is_refused_at_every_directory_rljob_mounts_in_a_rollout_pod():
    """The directories the check refuses are the ones render mounts (a new rljob mount without a check fails here)."""
    spec = {"redis": {"mode": "external", "url": "rediss://redis.example:6380",
                      "caSecretRef": {"name": "redis-ca", "key": "ca.crt"}}}
    job = make_job(**spec, rollout=custom())
    pod = render.rollout_pod(job, render.job_config(job), 0)
    mounted = [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]]
    assert len(mounted) == 3, mounted
    for directory in mounted:
        source = {"path": f"{directory}/sub/score.py", "volume": "rewards"}
        problems = [str(p) for p in check_spec(make_spec(**spec, rollout=custom(source)))]
        assert len(problems) == 1 and f"would be mounted at {directory}/sub, at or under" in problems[0], problems


def test_the_example_passes_the_code_checks_and_names_keys_its_configmap_holds():
    path = Path(__file__).resolve().parents[2] / "examples" / "rljob-cpu-configmap-reward.yaml"
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    (manifest,) = [d for d in documents if d["kind"] == c.KIND]
    spec = RLTrainingJobSpec.model_validate(manifest["spec"])
    assert check_spec(spec) == []
    assert reward_source_state(spec, "default", config_map).problem is None
    source = render.reward_source(render.Job(manifest["metadata"]["name"], "default", spec))
    assert source.volume == {"name": "reward-source", "configMap": {"name": config_map["metadata"]["name"]}}
    assert source.file == "/etc/rljob-reward/reward.py"
    dataset = spec.rollout.task.dataset_path  # the prompts are a key of the same ConfigMap
    assert posixpath.dirname(dataset) == c.REWARD_SOURCE_MOUNT_DIR and posixpath.basename(dataset) in config_map["data"]
