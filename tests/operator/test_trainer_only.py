"""Trainer-only jobs (spec.rollout.replicas 0): no rollout pod, RolloutReady=True/ExternalProducers naming where
outside producers write, and status.stream, computed from the resolved config, for every job."""

from __future__ import annotations

from datetime import timedelta

import pytest

from rljob_api import constants as c, protocol
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import gang, job_status, render, resolution
from rljob_api.protocol import Progress

from operator_helpers import T0, make_job, rollout, trainer

READY = job_status.RedisHealth(True, "managed Redis demo-redis: 1/1 replicas available")
RUNNING = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING,
                         message="attempt 0: all 2 trainer pods running")
EXTERNAL = ("spec.rollout.replicas is 0: rljob runs no rollout pod; producers outside rljob write documents to stream "
            "fast_llm_streaming (consumer group fast_llm_group) and read events from fast_llm_events at Redis "
            "demo-redis.ns.svc.cluster.local:6379/0; they receive weights by heartbeating in rljob:ns:demo:members as "
            "transfer rank 1 or above (status.stream)")


def stream_of(job: render.Job):
    return job_status.stream_status(render.job_config(job), render.redis_password_ref(job))


def build(job: render.Job, pods, previous=None, lifecycle=RUNNING, progress=None, seconds=0.0, stream=True):
    return job_status.build_status(
        previous or RLTrainingJobStatus(), generation=1, lifecycle=lifecycle, problems=[], data_parallel_size=2,
        redis=READY, pods=pods, nodes=2, replicas=job.spec.rollout.replicas, progress=progress,
        now=T0 + timedelta(seconds=seconds), stream=stream_of(job) if stream else None,
    )


def test_replicas_zero_is_a_valid_spec_and_below_zero_names_the_field():
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "rollout": {"replicas": 0}})
    assert spec.rollout.replicas == 0
    with pytest.raises(ValueError, match=r"rollout\.replicas\n  Input should be greater than or equal to 0"):
        RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, "rollout": {"replicas": -1}})


def test_a_trainer_only_job_is_ready_running_and_says_where_producers_write():
    job = make_job(trainer={"nodes": 2}, rollout={"replicas": 0})
    st = build(job, [trainer(0, 0), trainer(1, 0)])
    ready = st.condition(ConditionType.ROLLOUT_READY)
    assert (ready.status, ready.reason, ready.message) == ("True", "ExternalProducers", EXTERNAL)
    running = st.condition(ConditionType.RUNNING)  # nothing about documents that cannot reach the trainer
    assert (running.status, running.reason, running.message) == ("True", "Training",
                                                                 "attempt 0: all 2 trainer pods running")
    assert job_status.to_json(st)["stream"] == {
        "redisAddress": "demo-redis.ns.svc.cluster.local:6379/0", "tls": False,
        "passwordSecretRef": {"name": "demo-redis-auth", "key": "password"},
        "streamKey": "fast_llm_streaming", "group": "fast_llm_group", "eventsKey": "fast_llm_events",
        "membersKey": "rljob:ns:demo:members", "deadLetterKey": "rljob:ns:demo:dead_letter",
        "firstTransferRank": 1, "weightsAddress": "demo-trainer-0.demo-trainer.ns.svc.cluster.local:29600",
    }
    events = job_status.transition_events(RLTrainingJobStatus(), st)
    assert ("Normal", "ExternalProducers", f"RolloutReady=True: {EXTERNAL}") in [
        (e.type, e.reason, e.message) for e in events]
    again = build(job, [trainer(0, 0), trainer(1, 0)], previous=st, stream=False, seconds=5)  # no stream this pass
    assert job_status.status_patch(job_status.to_json(st), again) is None  # the saved stream is kept, nothing to write


def test_the_gang_runs_with_no_rollout_pod_and_scaling_to_zero_deletes_them_without_a_restart():
    spec = make_job(trainer={"nodes": 2}, rollout={"replicas": 0}).spec
    hashes = render.config_hashes(render.job_config(make_job(trainer={"nodes": 2}, rollout={"replicas": 0})))
    plan = gang.plan("demo", spec, gang.Lifecycle(), [], hashes, T0)
    assert (plan.create_trainers, plan.create_rollouts) == ((0, 1), ())
    running = [trainer(0, 0, config_hash=hashes.config, role_config_hash=hashes.trainer),
               trainer(1, 0, config_hash=hashes.config, role_config_hash=hashes.trainer)]
    plan = gang.plan("demo", spec, plan.after_create, running, hashes, T0)
    assert plan.lifecycle.phase == Phase.RUNNING and (plan.delete, plan.create_rollouts) == ((), ())
    # rollout pods of the spec before the edit (replicas 2 → 0): deleted; the gang keeps running, no restart
    left = [rollout(i, config_hash=hashes.config, role_config_hash=hashes.rollout) for i in (0, 1)]
    plan = gang.plan("demo", spec, plan.lifecycle, running + left, hashes, T0)
    assert plan.delete == ("demo-rollout-0", "demo-rollout-1")
    assert (plan.lifecycle.phase, plan.lifecycle.restarts, plan.lifecycle.attempt) == (Phase.RUNNING, 0, 0)


def test_a_reward_streak_of_earlier_rollout_pods_is_not_a_trainer_only_jobs_concern():
    failures = protocol.RewardFailures(since=T0.timestamp(), updated_at=T0.timestamp(), batches=3, samples=48,
                                       errors={"ZeroDivisionError: division by zero": 48})
    job = make_job(trainer={"nodes": 2}, rollout={"replicas": 0})
    st = build(job, [trainer(0, 0), trainer(1, 0)], progress=Progress(step=1, reward_failures=failures))
    assert st.condition(ConditionType.ROLLOUT_READY).reason == "ExternalProducers"


def test_status_stream_of_an_external_redis_names_the_prefixed_keys_tls_db_and_the_users_secret():
    job = make_job(trainer={"nodes": 2}, rollout={"replicas": 2, "gpusPerReplica": 4, "backend": "vllm"},
                   redis={"mode": "external", "url": "rediss://redis.example.com:6380/3",
                          "passwordSecretRef": {"name": "shared-redis", "key": "pw"}})
    stream = job_status.to_json(build(job, [trainer(0, 0), trainer(1, 0)]))["stream"]
    assert stream == {
        "redisAddress": "redis.example.com:6380/3", "tls": True,
        "passwordSecretRef": {"name": "shared-redis", "key": "pw"},
        "streamKey": "rljob:ns:demo:fast_llm_streaming", "group": "fast_llm_group",
        "eventsKey": "rljob:ns:demo:fast_llm_events", "membersKey": "rljob:ns:demo:members",
        "deadLetterKey": "rljob:ns:demo:dead_letter",
        "firstTransferRank": 9,  # 2 rollout pods x 4 GPU processes hold transfer ranks 1..8
        "weightsAddress": "demo-trainer-0.demo-trainer.ns.svc.cluster.local:29600",
    }
    no_password = make_job(redis={"mode": "external", "url": "redis://r:6379"})
    assert stream_of(no_password).password_secret_ref is None


@pytest.mark.parametrize(("before", "after"), [(0, 3), (3, 0)])
def test_scaling_between_zero_and_n_keeps_the_gangs_config_and_moves_the_first_transfer_rank(before, after):
    job = make_job(trainer={"nodes": 2}, rollout={"replicas": before})
    recorded = resolution.Recorded(resolution.as_recorded(render.job_config(job)), 4)
    config = resolution.effective_config(make_job(trainer={"nodes": 2}, rollout={"replicas": after}), 5, recorded)
    assert render.role_config_hash(config, c.Role.TRAINER) == render.role_config_hash(recorded.config, c.Role.TRAINER)
    assert render.role_config_hash(config, c.Role.ROLLOUT) == render.role_config_hash(recorded.config, c.Role.ROLLOUT)
    assert config.config_hash() != recorded.config.config_hash()  # the replica count itself is recorded anew
    assert job_status.stream_status(config, None).first_transfer_rank == 1 + after


def test_the_reward_column_shows_the_trained_reward_of_a_trainer_only_job_and_the_rollout_reward_otherwise():
    trained = Progress(step=3, metrics={"train_samples_reward": 0.623456, "loss": 0.1})
    only = build(make_job(trainer={"nodes": 2}, rollout={"replicas": 0}), [trainer(0, 0), trainer(1, 0)],
                 progress=trained)
    assert only.reward == 0.6235 and only.rollout_reward is None
    assert job_status.to_json(only)["reward"] == 0.6235
    both = Progress(step=3, metrics={"train_samples_reward": 0.62}, rollout_reward=0.8125, rollout_model_version=64)
    with_rollouts = build(make_job(trainer={"nodes": 2}), [trainer(0, 0), trainer(1, 0), rollout(0)], progress=both)
    assert with_rollouts.reward == with_rollouts.rollout_reward == 0.8125
    kept = build(make_job(trainer={"nodes": 2}, rollout={"replicas": 0}), [trainer(0, 0), trainer(1, 0)],
                 previous=only, seconds=5)  # a pass that did not read Redis keeps it
    assert kept.reward == 0.6235
