"""``spec.rollout.environment`` (issue 27): the checks only code makes, with the exact messages, and what an edit of
each of its fields replaces (the role hashes)."""

from __future__ import annotations

import pytest

from rljob_api import constants as c, names, rules
from rljob_api.spec import EnvironmentSpec, RolloutSpec
from rljob_operator import render
from rljob_operator.admission import parse_spec

from operator_helpers import make_job

SERVER = {"image": "ghcr.io/acme/guess-env:1", "port": 8000}
TASK = {"name": "environment"}


def problems(rollout: dict, **spec) -> list[str]:
    return [str(p) for p in parse_spec("demo", {"model": {"source": "tiny"}, "rollout": rollout, **spec})[1]]


def test_each_kind_of_environment_with_its_task_is_valid():
    for env in ({"server": SERVER}, {"url": "https://env.example.com/guess"},
                {"python": {"entrypoint": "rljob_rollout.environments.guess:GuessNumber"}},
                {"python": {"entrypoint": "mine:Env", "source": {"configMapKeyRef": {"name": "envs", "key": "mine.py"}}}}):
        assert problems({"task": TASK, "environment": env}) == [], env


def test_task_and_environment_come_together_each_direction_named():
    assert problems({"task": TASK}) == [
        "spec.rollout.task.name: 'environment' needs spec.rollout.environment (server, url or python): set one, or "
        "choose another task"]
    assert problems({"environment": {"server": SERVER}}) == [
        "spec.rollout.environment: is set but spec.rollout.task.name is 'digits-copy': environments run only with task "
        "name 'environment'; set it, or remove environment"]
    assert not rules.environment_task_matches("math", True) and not rules.environment_task_matches("environment", False)
    assert rules.environment_task_matches("environment", True) and rules.environment_task_matches("custom", False)


@pytest.mark.parametrize("env, got", [({}, "none"), ({"server": SERVER, "url": "http://e:8000"}, "server and url"),
                                      ({"url": "http://e:8000", "python": {"entrypoint": "m:C"}}, "url and python")])
def test_exactly_one_kind_of_environment(env, got):
    assert problems({"task": TASK, "environment": env}) == [
        f"spec.rollout.environment: needs exactly one of server, url or python, got {got}"]


def test_field_level_refusals_name_the_field():
    assert problems({"task": TASK, "environment": {"url": "ftp://e"}}) == [
        "spec.rollout.environment.url: String should match pattern '^https?://[^\\s/]+'"]
    assert problems({"task": TASK, "environment": {"python": {"entrypoint": "no_class"}}}) == [
        "spec.rollout.environment.python.entrypoint: String should match pattern "
        "'^[A-Za-z_][\\w.]*:[A-Za-z_][\\w.]*$'"]
    assert problems({"task": TASK, "environment": {"server": {"port": 8000}}}) == [
        "spec.rollout.environment.server.image: Field required"]
    assert problems({"task": TASK, "environment": {"server": SERVER, "reward": "mean"}}) == [
        "spec.rollout.environment.reward: Input should be 'sum' or 'last'"]


def test_server_image_turn_timeout_and_python_source_are_checked():
    assert problems({"task": TASK, "environment": {"server": {"image": "Bad Image"}}}) == [
        "spec.rollout.environment.server.image: 'Bad Image' is not a container image reference "
        "([registry[:port]/]name[:tag][@digest], lower-case name)"]
    assert problems({"task": TASK, "environment": {"server": SERVER, "turnTimeoutSeconds": 90,
                                                   "episodeTimeoutSeconds": 60}}) == [
        "spec.rollout.environment.turnTimeoutSeconds: 90 exceeds episodeTimeoutSeconds = 60: a turn is part of its "
        "episode; lower turnTimeoutSeconds or raise episodeTimeoutSeconds"]
    python = {"entrypoint": "mine:Env", "source": {"volume": "code"}}
    assert problems({"task": TASK, "environment": {"python": python}}) == [
        "spec.rollout.environment.python.source: needs exactly one of configMapKeyRef or path",
        "spec.rollout.environment.python.source.volume: needs path, the module's file on that volume"]
    python = {"entrypoint": "mine:Env", "source": {"path": "/etc/rljob/mine.py", "volume": "code"}}
    assert problems({"task": TASK, "environment": {"python": python}}) == [
        "spec.rollout.environment.python.source.path: '/etc/rljob/mine.py': source.volume 'code' would be mounted at "
        "/etc/rljob, at or under a directory rljob mounts in the rollout container (/etc/rljob, /dev/shm): choose "
        "another directory"]


def test_the_reward_source_keeps_its_messages():
    source = {"path": "/reward.py", "volume": "code"}
    assert problems({"task": {"name": "custom", "datasetPath": "/d.jsonl", "rewardFunction": "m:f",
                              "rewardSource": source}}) == [
        "spec.rollout.task.rewardSource.path: '/reward.py': rewardSource.volume 'code' would be mounted at its "
        "directory, /, over the container's whole filesystem: give a path in a directory of its own, e.g. "
        "/reward/reward.py mounts the claim at /reward"]


def test_the_cel_rules_name_both_fields():
    assert rules.CEL_ENVIRONMENT_NEEDS_TASK["fieldPath"] == ".environment"
    assert "task.name environment" in rules.CEL_ENVIRONMENT_NEEDS_TASK["message"]
    assert rules.CEL_TASK_NEEDS_ENVIRONMENT["fieldPath"] == ".task.name"
    assert "needs environment" in rules.CEL_TASK_NEEDS_ENVIRONMENT["message"]
    assert rules.cel_one_source("rewardSource") == rules.CEL_ONE_REWARD_SOURCE


def test_defaults_and_an_unset_environment_stay_out_of_the_config():
    env = EnvironmentSpec(url="http://e:8000")
    assert (env.max_turns, env.reward, env.action_field, env.observation_field, env.episodes_in_flight) == (
        8, "sum", "message", None, None)
    assert "environment" not in RolloutSpec().model_dump(by_alias=True)
    assert names.environment_url("demo", "ns", 8000) == "http://demo-environment.ns.svc.cluster.local:8000"


def _config(environment: dict):
    return render.job_config(make_job(rollout={"task": TASK, "environment": environment}))


@pytest.mark.parametrize("change", [{"image": "acme/env:2"}, {"command": ["python"]}, {"args": ["-m", "x"]},
                                    {"replicas": 3}, {"resources": {"limits": {"cpu": "2"}}},
                                    {"env": [{"name": "A", "value": "1"}]}, {"nodeSelector": {"pool": "env"}},
                                    {"tolerations": [{"key": "k", "operator": "Exists"}]}], ids=lambda ch: ",".join(ch))
def test_server_pod_fields_replace_neither_trainer_nor_rollout_pods(change):
    base, changed = _config({"server": SERVER}), _config({"server": {**SERVER, **change}})
    assert changed.config_hash() != base.config_hash()
    for role in (c.Role.TRAINER, c.Role.ROLLOUT):
        assert render.role_config_hash(changed, role) == render.role_config_hash(base, role), role


@pytest.mark.parametrize("environment", [{"server": {**SERVER, "port": 9000}}, {"server": SERVER, "maxTurns": 3},
                                         {"url": "http://e:8000"}, {"server": SERVER, "actionField": "text"}])
def test_what_a_worker_reads_replaces_rollout_pods_only(environment):
    base, changed = _config({"server": SERVER}), _config(environment)
    assert render.role_config_hash(changed, c.Role.TRAINER) == render.role_config_hash(base, c.Role.TRAINER)
    assert render.role_config_hash(changed, c.Role.ROLLOUT) != render.role_config_hash(base, c.Role.ROLLOUT)


def test_copy_field_leaves_an_absent_optional_block_absent():
    view = {"rollout": {"replicas": 2}}
    render.copy_field(view, {"rollout": {"replicas": 1}}, "rollout.environment.server.image")
    assert view == {"rollout": {"replicas": 2}}
    view = {"rollout": {"environment": {"server": {"image": "a", "port": 1}}}}
    render.copy_field(view, {"rollout": {}}, "rollout.environment.server.image")
    assert view == {"rollout": {"environment": {"server": {"port": 1}}}}
