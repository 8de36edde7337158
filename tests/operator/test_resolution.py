"""Which resolved config a pass runs (``rljob_operator.resolution``): the one recorded for the running pods while the
user has not edited the spec, so that an upgraded operator with new defaults restarts no gang; a role gets the new
defaults only when the user edits a field that role's hash covers."""

from __future__ import annotations

import json

import pytest

from rljob_api import constants as c
from rljob_api.canonical import canonical_json
from rljob_api.config import JobConfig
from rljob_operator import render, resolution

from operator_helpers import make_job

EARLIER_HASHES = {"trainer": "earlier-trainer", "rollout": "earlier-rollout"}


def recorded_by_an_earlier_version(job: render.Job, generation: int | None = 3) -> resolution.Recorded:
    """The record an earlier operator, which did not know ``spec.trainer.backend`` yet, wrote for ``job``: its bytes
    lack the field this version adds with its default, and its pods carry that version's hashes."""
    data = json.loads(render.job_config(job).to_json())
    del data["spec"]["trainer"]["backend"]
    return resolution.Recorded(JobConfig.from_recorded(canonical_json(data), EARLIER_HASHES), generation)


def lacks_the_new_field(config: JobConfig) -> bool:
    return "backend" not in json.loads(config.to_json())["spec"]["trainer"]


def test_a_new_job_runs_the_fresh_resolution():
    job = make_job()
    assert resolution.effective_config(job, 1, None).to_json() == render.job_config(job).to_json()


def test_an_unedited_job_keeps_its_recorded_config_byte_for_byte():
    job = make_job()
    recorded = recorded_by_an_earlier_version(job, generation=3)
    config = resolution.effective_config(job, 3, recorded)
    assert config.to_json() == recorded.config.to_json() and lacks_the_new_field(config)
    assert config.spec.trainer.backend == "builtin"  # this version reads it with the new field's default
    fresh = render.config_hashes(render.job_config(job))
    kept = render.config_hashes(config)
    assert (kept.trainer, kept.rollout) == ("earlier-trainer", "earlier-rollout")
    assert kept.config == render.config_hashes(recorded.config).config != fresh.config


@pytest.mark.parametrize(("edit", "read_back", "rollout_pods_kept"), [
    ({"replicas": 5}, ("replicas", 5), True),  # no pod reads the replica count
    ({"replicas": 0}, ("replicas", 0), True),  # a trainer-only job: the gang keeps running, fed from outside
    ({"maxLag": 77}, ("max_lag", 77), False),  # rollout pods read it, the trainer does not
])
def test_an_edit_of_rollout_only_fields_keeps_the_trainers_config_and_hash(edit, read_back, rollout_pods_kept):
    recorded = recorded_by_an_earlier_version(make_job())
    config = resolution.effective_config(make_job(rollout=edit), 4, recorded)
    field, value = read_back
    assert getattr(JobConfig.from_json(config.to_json()).spec.rollout, field) == value  # what new pods read
    assert lacks_the_new_field(config)  # the trainer's part is the recorded one
    assert render.role_config_hash(config, c.Role.TRAINER) == "earlier-trainer"
    assert (render.role_config_hash(config, c.Role.ROLLOUT) == "earlier-rollout") is rollout_pods_kept


def test_an_edit_of_a_field_the_trainer_reads_resolves_anew():
    job = make_job()
    edited = make_job(trainer={"maxSteps": 999})
    config = resolution.effective_config(edited, 4, recorded_by_an_earlier_version(job))
    assert config.to_json() == render.job_config(edited).to_json() and not lacks_the_new_field(config)
    assert render.config_hashes(config) == render.config_hashes(render.job_config(edited))


@pytest.mark.parametrize("trainer", [{"optimizer": {"learningRate": 1e-4}}, {"checkpoint": {"everySteps": 3}},
                                     {"processesPerNode": 2}, {"nodes": 4}])  # the topology: a new data-parallel size
def test_an_edit_of_a_trainer_only_field_restarts_the_gang_and_keeps_the_rollout_pods(trainer):
    """The trainer resolves anew; the rollout pods keep the hash recorded with them (here an earlier version's): no
    rollout pod is replaced for a field none of them reads."""
    edited = make_job(trainer=trainer)
    config = resolution.effective_config(edited, 4, recorded_by_an_earlier_version(make_job()))
    assert config.to_json() == render.job_config(edited).to_json()
    assert render.role_config_hash(config, c.Role.TRAINER) == render.role_config_hash(render.job_config(edited),
                                                                                      c.Role.TRAINER)
    assert render.role_config_hash(config, c.Role.ROLLOUT) == "earlier-rollout"
    read_back = JobConfig.from_recorded(config.to_json(), render.role_hashes(config))  # as the ConfigMap records it
    assert render.role_config_hash(read_back, c.Role.ROLLOUT) == "earlier-rollout"


def test_the_record_is_read_back_from_the_configmap_as_rendered():
    job = make_job()
    config = render.job_config(job)
    config_map = render.config_map(job, config, generation=7)
    recorded = resolution.recorded_config(config_map)
    assert recorded.generation == 7
    assert recorded.config.to_json() == config.to_json()
    assert render.config_hashes(recorded.config) == render.config_hashes(config)
    # an operator before 0.2 wrote neither annotation: this version's hashes of the same bytes, generation unknown
    del config_map["metadata"]["annotations"]
    old = resolution.recorded_config(config_map)
    assert old.generation is None and render.config_hashes(old.config) == render.config_hashes(config)
    # what cannot be read is no record (the pass resolves anew)
    config_map["data"][c.CONFIG_FILE_NAME] = '{"name": "x"}'
    assert resolution.recorded_config(config_map) is None
    assert resolution.recorded_config(None) is None


# --- the managed Redis's storage follows the record until an edit of what the Redis is made of ----------------------
def recorded_before_persistence(job: render.Job, generation: int = 3) -> resolution.Recorded:
    """The record of an operator before ``spec.redis.persistence``: its Redis runs on an emptyDir."""
    data = json.loads(render.job_config(job).to_json())
    del data["spec"]["redis"]["persistence"]
    return resolution.Recorded(JobConfig.from_recorded(canonical_json(data), EARLIER_HASHES), generation)


def test_an_upgrade_keeps_a_running_redis_on_its_emptydir():
    """The API server fills persistence.enabled=true into the stored job without a new generation: the recorded
    config, whose Redis has no claim, is what runs."""
    job = make_job()  # as the API server returns it now: with the new field's defaults
    config = resolution.effective_config(job, 3, recorded_before_persistence(job))
    assert render.redis_persistence(config) is None and render.redis_claim(job, config) is None
    assert "persistence" not in json.loads(config.to_json())["spec"]["redis"]


@pytest.mark.parametrize("edit", [
    {"trainer": {"maxSteps": 999}},  # restarts the gang, does not touch the Redis
    {"redis": {"maxPending": 8192}},  # a Redis field the Deployment is not made of
    {"rollout": {"maxLag": 77}},
])
def test_an_edit_elsewhere_leaves_the_redis_on_its_emptydir(edit):
    job = make_job()
    config = resolution.effective_config(make_job(**edit), 4, recorded_before_persistence(job))
    assert render.redis_persistence(config) is None
    assert "persistence" not in json.loads(config.to_json())["spec"]["redis"]
    if "trainer" in edit:  # a new resolution for the trainer all the same
        assert JobConfig.from_json(config.to_json()).spec.trainer.max_steps == 999
        assert render.role_config_hash(config, c.Role.TRAINER) == render.role_config_hash(
            render.job_config(make_job(**edit)), c.Role.TRAINER)


@pytest.mark.parametrize(("edit", "size"), [
    ({"redis": {"persistence": {"size": "20Gi"}}}, "20Gi"),
    ({"redis": {"persistence": {"storageClassName": "standard"}}}, "10Gi"),
    ({"redis": {"image": "redis:7.4"}}, "10Gi"),  # replaces the Redis pod anyway: it takes the claim now
])
def test_an_edit_of_what_the_redis_is_made_of_takes_this_versions_persistence(edit, size):
    job = make_job()
    config = resolution.effective_config(make_job(**edit), 4, recorded_before_persistence(job))
    assert render.redis_persistence(config).size == size
    assert render.redis_claim(make_job(**edit), config)["metadata"]["name"] == "demo-redis-data"


def test_persistence_switched_off_on_a_durable_job_resolves_to_an_emptydir():
    job = make_job()
    recorded = resolution.Recorded(resolution.as_recorded(render.job_config(job)), 2)
    assert render.redis_persistence(resolution.effective_config(job, 2, recorded)).size == "10Gi"
    off = make_job(redis={"persistence": {"enabled": False}})
    assert render.redis_persistence(resolution.effective_config(off, 3, recorded)) is None
