"""Status: conditions from observed pods (GPU-pending pods named), transitions, merge patches and Events."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.status import RLTrainingJobStatus
from rljob_api.validation import SpecProblem

from rljob_operator import gang, job_status
from rljob_api.protocol import Progress

from operator_helpers import T0, rollout, trainer

GPU_MESSAGE = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available."
READY = job_status.RedisHealth(True, "managed Redis demo-redis: 1/1 replicas available")


def build(previous=None, lifecycle=None, pods=(), problems=(), progress=None, now=T0, redis=READY, nodes=2):
    return job_status.build_status(
        previous or RLTrainingJobStatus(), generation=3, lifecycle=lifecycle or gang.Lifecycle(), problems=problems,
        data_parallel_size=2, redis=redis, pods=pods, nodes=nodes, replicas=1, progress=progress, now=now,
    )


def cond(st: RLTrainingJobStatus, ctype: ConditionType):
    return st.condition(ctype)


def test_pods_pending_for_gpus_are_named_with_the_schedulers_reason():
    lc = gang.Lifecycle(phase=Phase.STARTING, gang_created=True, reason=Reason.GANG_CREATED, message="created")
    pods = [trainer(0, 0, "Running"), trainer(1, 0, "Pending", unschedulable=GPU_MESSAGE), rollout(0)]
    st = build(lifecycle=lc, pods=pods)
    ready = cond(st, ConditionType.TRAINER_READY)
    assert (ready.status, ready.reason) == ("False", "Unschedulable")
    assert ready.message == (
        f"1/2 trainer pods ready; cannot be scheduled: demo-trainer-1: {GPU_MESSAGE} "
        "(the scheduled ranks wait in rendezvous; this is not counted as a failure)"
    )
    assert st.phase == Phase.STARTING and st.restarts == 0
    assert cond(st, ConditionType.RUNNING).status == "False"
    assert cond(st, ConditionType.ROLLOUT_READY).status == "True"
    assert cond(st, ConditionType.VALID).reason == "SpecValid"
    assert st.observed_generation == 3 and all(c.observed_generation == 3 for c in st.conditions)


def test_running_gang_and_progress_fields():
    lc = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, reason=Reason.TRAINING, message="attempt 0 runs")
    progress = Progress(step=12, documents_seen=768, model_version=768, tokens_per_second=1500.5,
                        metrics={"train_samples_reward": 0.4, "staleness": 3.0}, rollout_reward=0.55,
                        rollout_model_version=704)
    st = build(lifecycle=lc, pods=[trainer(0, 0), trainer(1, 0), rollout(0)], progress=progress)
    assert [(c.type.value, c.status) for c in st.conditions] == [
        ("Valid", "True"), ("RedisReady", "True"), ("RolloutReady", "True"), ("TrainerReady", "True"),
        ("Running", "True"),
    ]
    assert (st.step, st.documents_seen, st.model_version, st.rollout_reward) == (12, 768, 768, 0.55)
    assert st.last_metrics == {"train_samples_reward": 0.4, "staleness": 3.0}
    # a pass without a progress read keeps the last values
    again = build(previous=st, lifecycle=lc, pods=[trainer(0, 0), trainer(1, 0), rollout(0)])
    assert again.step == 12 and job_status.status_patch(job_status.to_json(st), again) is None


def test_last_transition_time_moves_only_when_the_status_flips():
    lc = gang.Lifecycle(phase=Phase.STARTING, gang_created=True)
    first = build(lifecycle=lc, pods=[trainer(0, 0, "Pending"), trainer(1, 0, "Pending")])
    later = T0 + timedelta(seconds=30)
    second = build(previous=first, lifecycle=lc, pods=[trainer(0, 0, "Running"), trainer(1, 0, "Pending")], now=later)
    assert cond(second, ConditionType.TRAINER_READY).last_transition_time == T0  # message changed, status did not
    assert cond(second, ConditionType.TRAINER_READY).message == "1/2 trainer pods ready; waiting for demo-trainer-1 (Pending)"
    third = build(previous=second, lifecycle=replace(lc, phase=Phase.RUNNING, reason=Reason.TRAINING),
                  pods=[trainer(0, 0), trainer(1, 0)], now=later + timedelta(seconds=5))
    assert cond(third, ConditionType.TRAINER_READY).last_transition_time == later + timedelta(seconds=5)


def test_invalid_spec_condition_names_the_fields_and_not_supported_is_its_own_reason():
    problems = [SpecProblem("spec.trainer.tensorParallel", "2: tensor parallelism > 1 is not supported yet", False)]
    valid = job_status.valid_condition(problems)
    assert (valid.status, valid.reason) == ("False", Reason.NOT_SUPPORTED)
    assert valid.message == ("spec.trainer.tensorParallel: 2: tensor parallelism > 1 is not supported yet; "
                             "fix the spec (kubectl edit rljob)")
    mixed = job_status.valid_condition(problems + [SpecProblem("spec.redis.url", "required when mode is 'external'")])
    assert mixed.reason == Reason.INVALID_SPEC


def test_phase_conditions_appear_on_first_use_and_stay_listed():
    running = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, reason=Reason.TRAINING, message="runs")
    st = build(lifecycle=running, pods=[trainer(0, 0), trainer(1, 0), rollout(0)])
    assert cond(st, ConditionType.SUSPENDED) is None and cond(st, ConditionType.RESTARTING) is None
    suspended = gang.Lifecycle(phase=Phase.SUSPENDED, attempt=1, reason=Reason.JOB_SUSPENDED, message="suspended")
    st2 = build(previous=st, lifecycle=suspended, now=T0 + timedelta(seconds=1))
    assert (cond(st2, ConditionType.SUSPENDED).status, cond(st2, ConditionType.SUSPENDED).reason) == ("True", "JobSuspended")
    assert cond(st2, ConditionType.TRAINER_READY).reason == "JobSuspended"
    resumed = gang.Lifecycle(phase=Phase.PENDING, attempt=1, start_time=T0 + timedelta(seconds=2))
    st3 = build(previous=st2, lifecycle=resumed, now=T0 + timedelta(seconds=2))
    assert (cond(st3, ConditionType.SUSPENDED).status, cond(st3, ConditionType.SUSPENDED).reason) == ("False", "JobResumed")


def test_status_patch_is_none_when_unchanged_and_nulls_removed_fields():
    running = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING)
    pods = [trainer(0, 0), trainer(1, 0), rollout(0)]
    st = build(lifecycle=running, pods=pods, progress=Progress(step=1, metrics={"a": 1.0, "b": 2.0}))
    assert job_status.status_patch(job_status.to_json(st), build(previous=st, lifecycle=running, pods=pods)) is None
    suspended = replace(running, phase=Phase.SUSPENDED, start_time=None, gang_created=False, attempt=1,
                        reason=Reason.JOB_SUSPENDED)
    after = build(previous=st, lifecycle=suspended, progress=Progress(metrics={"a": 1.5}))
    patch = job_status.status_patch(job_status.to_json(st), after)["status"]
    assert patch["startTime"] is None and patch["phase"] == "Suspended" and patch["attempt"] == 1
    assert patch["lastMetrics"] == {"a": 1.5, "b": None}
    assert "step" not in patch  # unchanged fields are not sent
    first = job_status.status_patch({}, st)["status"]  # a new job's status: zero counters are written too
    assert (first["restarts"], first["attempt"], first["failedAttempts"]) == (0, 0, 0)


def test_a_new_job_gets_events_only_for_what_a_user_did_not_expect():
    """A reachable Redis and pods not ready yet are what a new job starts with: no Event; the accepted spec gets one
    (SpecValid). A job created suspended gets one more (every pod condition echoes the same reason), a Redis or spec
    that becomes fine later one."""
    (accepted,) = job_status.transition_events(RLTrainingJobStatus(), build(lifecycle=gang.Lifecycle(), pods=[]))
    assert (accepted.type, accepted.reason) == ("Normal", "SpecValid")
    suspended = gang.Lifecycle(phase=Phase.SUSPENDED, reason=Reason.JOB_SUSPENDED, message="job suspended")
    events = job_status.transition_events(RLTrainingJobStatus(), build(lifecycle=suspended))
    assert [(e.type, e.reason) for e in events] == [("Normal", "SpecValid"), ("Normal", "JobSuspended")]
    assert events[1].message == "Suspended=True: job suspended"

    down = job_status.RedisHealth(False, "the managed Redis Deployment does not exist yet")
    waiting = build(lifecycle=gang.Lifecycle(), redis=down)
    assert [e.reason for e in job_status.transition_events(RLTrainingJobStatus(), waiting)] == ["SpecValid"]
    up = build(previous=waiting, lifecycle=gang.Lifecycle())
    assert [(e.reason, e.message) for e in job_status.transition_events(waiting, up)] == [
        ("RedisAvailable", f"RedisReady=True: {READY.message}")]

    problems = [SpecProblem("spec.model.tiny.heads", "heads = 3 does not divide hiddenSize = 64")]
    invalid = build(lifecycle=gang.Lifecycle(), problems=problems)
    assert [e.type for e in job_status.transition_events(RLTrainingJobStatus(), invalid)] == ["Warning"]
    fixed = build(previous=invalid, lifecycle=gang.Lifecycle())
    assert [e.reason for e in job_status.transition_events(invalid, fixed)] == ["SpecValid"]


def test_events_on_transitions_only():
    quiet = build(lifecycle=gang.Lifecycle(), pods=[])
    restarting = gang.Lifecycle(phase=Phase.RESTARTING, attempt=1, restarts=1, reason=Reason.POD_FAILED,
                                message="trainer pod demo-trainer-1 of attempt 0 failed")
    st = build(previous=quiet, lifecycle=restarting)
    events = {e.reason: e for e in job_status.transition_events(quiet, st)}
    assert events["PodFailed"].type == "Warning"
    assert events["PodFailed"].message == "Restarting=True: trainer pod demo-trainer-1 of attempt 0 failed"
    assert job_status.transition_events(st, build(previous=st, lifecycle=restarting)) == []
    problems = [SpecProblem("spec.redis.url", "required when mode is 'external'")]
    valid = job_status.valid_condition(problems)
    lifecycle = gang.Lifecycle(phase=Phase.INVALID, reason=valid.reason, message=valid.message)
    invalid = build(previous=quiet, lifecycle=lifecycle, problems=problems)
    (event,) = [e for e in job_status.transition_events(quiet, invalid) if e.reason == "InvalidSpec"]
    assert event.type == "Warning" and "spec.redis.url: required when mode is 'external'" in event.message


def test_redis_ready_keeps_the_saved_condition_until_this_process_has_probed_redis():
    """An operator restart (a fresh process has not probed Redis yet) neither writes nor posts anything for an
    idle job; the first real probe decides."""
    suspended = gang.Lifecycle(phase=Phase.SUSPENDED, attempt=1, reason=Reason.JOB_SUSPENDED, message="suspended")
    unprobed = job_status.RedisHealth(None, "not checked yet")
    saved = build(lifecycle=suspended, redis=job_status.RedisHealth(True, "reached Redis at r:6379"))
    restarted = build(previous=saved, lifecycle=suspended, redis=unprobed, now=T0 + timedelta(hours=1))
    assert job_status.status_patch(job_status.to_json(saved), restarted) is None
    assert job_status.transition_events(saved, restarted) == []
    kept = cond(restarted, ConditionType.REDIS_READY)
    assert (kept.status, kept.reason, kept.message, kept.last_transition_time) == (
        "True", "RedisAvailable", "reached Redis at r:6379", T0)

    down = build(previous=restarted, lifecycle=suspended, redis=job_status.RedisHealth(False, "cannot reach Redis"),
                 now=T0 + timedelta(hours=2))
    assert (cond(down, ConditionType.REDIS_READY).status, cond(down, ConditionType.REDIS_READY).reason) == (
        "False", "RedisUnavailable")
    assert [e.reason for e in job_status.transition_events(restarted, down)] == ["RedisUnavailable"]

    fresh = build(lifecycle=suspended, redis=unprobed)  # a job never probed says so
    assert (cond(fresh, ConditionType.REDIS_READY).status, cond(fresh, ConditionType.REDIS_READY).message) == (
        "Unknown", "not checked yet")


def test_a_job_kueue_cannot_queue_is_a_warning_and_one_waiting_for_admission_is_not():
    """No Workload API (or a missing WorkloadPriorityClass), or a LocalQueue Kueue cannot queue to, holds the job
    until someone acts: a Warning, like a claim that cannot bind; waiting for quota is what queueing is for: Normal."""
    no_kueue = gang.Lifecycle(reason=Reason.KUEUE_NOT_AVAILABLE, message="the cluster serves no Workload API")
    events = job_status.transition_events(RLTrainingJobStatus(), build(lifecycle=no_kueue, pods=[]))
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "SpecValid", "Valid=True: the spec is valid"),
        ("Warning", "KueueNotAvailable", "Running=False: the cluster serves no Workload API")]
    no_queue = gang.Lifecycle(reason=Reason.KUEUE_INADMISSIBLE, message="LocalQueue lq of namespace ns: no such")
    events = job_status.transition_events(RLTrainingJobStatus(), build(lifecycle=no_queue, pods=[]))
    assert [(e.type, e.reason, e.message) for e in events][1:] == [
        ("Warning", "KueueInadmissible", "Running=False: LocalQueue lq of namespace ns: no such")]
    waiting = gang.Lifecycle(reason=Reason.WAITING_FOR_ADMISSION, message="QuotaReserved=False (Pending): no quota")
    events = job_status.transition_events(RLTrainingJobStatus(), build(lifecycle=waiting, pods=[]))
    assert [(e.type, e.reason) for e in events] == [("Normal", "SpecValid"), ("Normal", "WaitingForAdmission")]
    # Kueue's first look comes after the job waited for it: Running stays False, its new reason is still news
    before = build(lifecycle=gang.Lifecycle(reason=Reason.WAITING_FOR_ADMISSION, message="not looked at yet"), pods=[])
    events = job_status.transition_events(before, build(before, lifecycle=no_queue, pods=[]))
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Warning", "KueueInadmissible", "Running=False: LocalQueue lq of namespace ns: no such")]
    # still waiting, but Kueue now says why: the Event tells it (kubectl describe shows Kueue's latest word)
    events = job_status.transition_events(before, build(before, lifecycle=waiting, pods=[]))
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "WaitingForAdmission", "Running=False: QuotaReserved=False (Pending): no quota")]
    after = build(before, lifecycle=waiting, pods=[])
    assert job_status.transition_events(after, build(after, lifecycle=waiting, pods=[])) == []  # the same word: no news
    terminating = gang.Lifecycle(reason=Reason.WAITING_FOR_ADMISSION,
                                 message="QuotaReserved=False (Pending): no quota (2 pods still terminating)")
    assert job_status.transition_events(after, build(after, lifecycle=terminating, pods=[])) == []  # pods going: no news
