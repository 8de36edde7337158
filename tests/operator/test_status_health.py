"""Status honesty, from pod objects as the kubelet writes them (through observe.pod_view): containers that cannot start
or keep failing are named with the kubelet's reason (without a condition flip per restart), Running holds only while
steps can be made, a lost checkpoint is told once per attempt, and a finished job's Event is Succeeded=True."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from rljob_api import protocol
from rljob_api.protocol import Progress
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.status import CheckpointStatus, RLTrainingJobStatus

from rljob_operator import gang, job_status, render
from rljob_operator.observe import pod_view

from operator_helpers import CRASHED, T0, kubelet_pod, kubelet_rollout_pod, make_spec, trainer

READY = job_status.RedisHealth(True, "managed Redis demo-redis: 1/1 replicas available")
RUNNING = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING,
                         message="attempt 0: all 2 trainer pods running")
LAST_LINE = ("2026-01-01 12:00:03,512 ERROR rljob_rollout.__main__: rollout: cannot start: "
             "spec.rollout.task.datasetPath: no file at '/data/nope.jsonl'")


def build(previous, pods, lifecycle=RUNNING, seconds=0.0, fetched=None, redis=READY, volume=None):
    return job_status.build_status(
        previous, generation=1, lifecycle=lifecycle, problems=[], data_parallel_size=2, redis=redis, pods=pods,
        nodes=2, replicas=1, progress=fetched, now=T0 + timedelta(seconds=seconds), checkpoint_volume=volume,
    )


def stamp(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def cond(st, ctype):
    return st.condition(ctype)


def crash_loop(restarts: int, delay: int = 10) -> dict:
    return kubelet_rollout_pod(restartCount=restarts, lastState=CRASHED, state={"waiting": {
        "reason": "CrashLoopBackOff",
        "message": f"back-off {delay}s restarting failed container=rollout pod=demo-rollout-0_ns(r0)"}})


def running_again(restarts: int, since: float) -> dict:
    return kubelet_rollout_pod(restartCount=restarts, lastState=CRASHED, state={"running": {"startedAt": stamp(since)}})


def test_a_crash_looping_rollout_is_named_once_and_its_condition_does_not_flip_on_every_restart():
    trainers = [trainer(0, 0), trainer(1, 0)]
    first = build(RLTrainingJobStatus(), trainers + [pod_view(kubelet_rollout_pod(
        state={"running": {"startedAt": stamp(0)}}))])
    assert cond(first, ConditionType.ROLLOUT_READY).status == "True"

    crashed = build(first, trainers + [pod_view(crash_loop(1))], seconds=5)
    ready = cond(crashed, ConditionType.ROLLOUT_READY)
    assert (ready.status, ready.reason) == ("False", "ContainerFailing")
    assert ready.message == ("0/1 rollout pods ready; failing: demo-rollout-0: container rollout CrashLoopBackOff, "
                             f"1 restart; last run: exit code 2 (Error): {LAST_LINE}")
    assert [(e.type, e.reason, e.message) for e in job_status.transition_events(first, crashed)] == [
        ("Warning", "ContainerFailing", f"RolloutReady=False: {ready.message}")]
    running = cond(crashed, ConditionType.RUNNING)  # the gang still runs and may drain the stream; it says so
    assert (running.status, running.reason) == ("True", "Training")
    assert running.message == ("attempt 0: all 2 trainer pods running; no new document reaches the trainer while "
                               "RolloutReady is False (ContainerFailing)")

    # The kubelet restarts it (Ready for a moment), it crashes again, and again: no flip, no Event.
    steps = [(16, running_again(1, since=15)), (20, crash_loop(2, 20)), (41, running_again(2, since=40)),
             (40 + 119, running_again(2, since=40))]
    previous = crashed
    for seconds, pod in steps:
        now = build(previous, trainers + [pod_view(pod)], seconds=seconds)
        again = cond(now, ConditionType.ROLLOUT_READY)
        assert (again.status, again.reason, again.last_transition_time) == ("False", "ContainerFailing",
                                                                            ready.last_transition_time), seconds
        assert job_status.transition_events(previous, now) == [], seconds
        previous = now
    assert again.message == ("0/1 rollout pods ready; failing: demo-rollout-0: container rollout running again, "
                             f"2 restarts; last run: exit code 2 (Error): {LAST_LINE}")

    # Once its run outlasts 60 s per restart it counts as recovered: one Event.
    recovered = build(previous, trainers + [pod_view(running_again(2, since=40))], seconds=40 + 121)
    assert cond(recovered, ConditionType.ROLLOUT_READY).status == "True"
    assert [(e.type, e.reason) for e in job_status.transition_events(previous, recovered)] == [("Normal", "PodsReady")]
    assert cond(recovered, ConditionType.RUNNING).message == "attempt 0: all 2 trainer pods running"


def waiting_trainer(index: int, reason: str, message: str) -> dict:
    return kubelet_pod("trainer", index, "Pending", attempt=0, state={"waiting": {"reason": reason, "message": message}})


def test_trainer_pods_that_cannot_start_name_the_kubelets_reason_and_message():
    starting = gang.Lifecycle(phase=Phase.STARTING, gang_created=True, reason=Reason.GANG_CREATED,
                              message="created attempt 0: 2 trainer pods")
    created = build(RLTrainingJobStatus(), [trainer(0, 0, "Pending"), trainer(1, 0, "Pending")], starting)
    secret = 'secret "nosuch" not found'
    pods = [pod_view(waiting_trainer(i, "CreateContainerConfigError", secret)) for i in (0, 1)]
    stuck = build(created, pods, starting, seconds=3)
    ready = cond(stuck, ConditionType.TRAINER_READY)
    assert (ready.status, ready.reason) == ("False", "ContainerCannotStart")
    assert ready.message == ("0/2 trainer pods ready; cannot start: demo-trainer-0, demo-trainer-1: container trainer "
                             f"CreateContainerConfigError: {secret}")
    assert [(e.type, e.reason) for e in job_status.transition_events(created, stuck)] == [
        ("Warning", "ContainerCannotStart")]

    # An image that cannot be pulled alternates between two kubelet reasons: one condition reason, no new Event.
    pull = [pod_view(waiting_trainer(0, "ErrImagePull", "not found")), pod_view(waiting_trainer(1, "ImagePullBackOff",
                                                                                                 "Back-off pulling"))]
    pulling = build(stuck, pull, starting, seconds=6)
    assert cond(pulling, ConditionType.TRAINER_READY).message == (
        "0/2 trainer pods ready; cannot start: demo-trainer-0: container trainer ErrImagePull: not found; "
        "demo-trainer-1: container trainer ImagePullBackOff: Back-off pulling")
    assert job_status.transition_events(stuck, pulling) == []

    # One rank unschedulable, one stuck: Unschedulable comes first, both are named.
    mixed = [trainer(0, 0, "Pending", unschedulable="0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
             pod_view(waiting_trainer(1, "CreateContainerConfigError", secret))]
    both = cond(build(created, mixed, starting), ConditionType.TRAINER_READY)
    assert both.reason == "Unschedulable"
    assert both.message == (
        "0/2 trainer pods ready; cannot be scheduled: demo-trainer-0: 0/2 nodes are available: 2 Insufficient "
        "nvidia.com/gpu. (the scheduled ranks wait in rendezvous; this is not counted as a failure); cannot start: "
        f"demo-trainer-1: container trainer CreateContainerConfigError: {secret}")


def test_running_needs_redis_a_running_gang_without_it_stays_starting():
    spec = make_spec(trainer={"nodes": 2})
    hashes = render.config_hashes(render.job_config(render.Job("demo", "ns", spec)))
    pods = [trainer(i, 0, config_hash=hashes.config, role_config_hash=hashes.trainer) for i in (0, 1)]
    down = job_status.RedisHealth(False, "cannot reach Redis at 10.1.2.3:6379: Timeout connecting to server")
    up = build(RLTrainingJobStatus(), pods, RUNNING)
    assert (up.phase, cond(up, ConditionType.RUNNING).status) == (Phase.RUNNING, "True")

    previous = up
    for seconds in (5, 10):  # every pass: the plan says Running, Redis says no
        planned = gang.plan("demo", spec, gang.Lifecycle.from_status(previous), pods, hashes, T0).lifecycle
        assert planned.phase == Phase.RUNNING
        lifecycle = gang.require_redis(planned, down.ready, down.message)
        now = build(previous, pods, lifecycle, seconds=seconds, redis=down)
        running = cond(now, ConditionType.RUNNING)
        assert now.phase == Phase.STARTING
        assert (running.status, running.reason) == ("False", "RedisUnavailable")
        assert running.message == ("attempt 0: all 2 trainer pods running, but no step can be made while Redis is not "
                                   f"ready: {down.message}")
        if seconds == 5:  # one Warning, from RedisReady (Running's says the same)
            assert [(e.type, e.reason, e.message) for e in job_status.transition_events(previous, now)] == [
                ("Warning", "RedisUnavailable", f"RedisReady=False: {down.message}")]
        else:
            assert job_status.status_patch(job_status.to_json(previous), now) is None
        previous = now

    assert gang.require_redis(RUNNING, None, "not checked yet") == RUNNING  # unknown: the plan stands
    starting = replace(RUNNING, phase=Phase.STARTING)
    assert gang.require_redis(starting, False, "down") == starting


LOST = {"step": 35, "path": "/var/lib/rljob/checkpoints/step-00000035", "restored_from_step": 0,
        "message": "checkpoint step 35 at /var/lib/rljob/checkpoints/step-00000035 is gone ..."}


def lost_progress(step: int = 3, lost: dict | None = LOST) -> Progress:
    fields = {"step": str(step), "restored_from_step": "0", "documents_seen": str(step * 64)}
    if lost is not None:
        fields["checkpoint_lost"] = json.dumps(lost)
    return protocol.parse_progress({k.encode(): v.encode() for k, v in fields.items()}, {})


def test_a_lost_checkpoint_is_told_once_per_attempt_in_running_and_a_warning():
    attempt1 = replace(RUNNING, attempt=1, restarts=1, message="attempt 1: all 2 trainer pods running")
    pods = [trainer(0, 1), trainer(1, 1)]
    before = build(RLTrainingJobStatus(attempt=1, restarts=1), pods, attempt1, fetched=lost_progress(0, None))
    lost = build(before, pods, attempt1, seconds=5, fetched=lost_progress())
    running = cond(lost, ConditionType.RUNNING)
    told = ("attempt 1 started over at step 0: checkpoint step 35 (/var/lib/rljob/checkpoints/step-00000035) was "
            "lost: an emptyDir checkpoint volume does not survive a gang restart or suspend; set "
            "spec.trainer.checkpoint.volume to a PersistentVolumeClaim")
    assert (running.status, running.reason, running.message) == (
        "True", "CheckpointLost", f"attempt 1: all 2 trainer pods running; {told}")
    assert [(e.type, e.reason) for e in job_status.transition_events(before, lost)] == [("Warning", "CheckpointLost")]

    later = build(lost, pods, attempt1, seconds=10, fetched=lost_progress(step=9))
    unread = build(later, pods, attempt1, seconds=15)  # a pass that did not read Redis keeps it
    assert job_status.transition_events(lost, later) == [] and job_status.transition_events(later, unread) == []
    assert job_status.status_patch(job_status.to_json(later), unread) is None

    # The gang restarts: Running is False in between, and attempt 2 loses its checkpoint again: one more Warning.
    restarting = gang.Lifecycle(phase=Phase.RESTARTING, attempt=2, restarts=2, gang_created=False,
                                reason=Reason.POD_DELETED, message="trainer pod demo-trainer-1 of attempt 1 was deleted")
    torn = build(unread, [], restarting, seconds=20)
    attempt2 = replace(attempt1, attempt=2, restarts=2, message="attempt 2: all 2 trainer pods running")
    again = build(torn, [trainer(0, 2), trainer(1, 2)], attempt2, seconds=40, fetched=lost_progress(), volume="ckpt")
    assert cond(again, ConditionType.RUNNING).message == (
        "attempt 2: all 2 trainer pods running; attempt 2 started over at step 0: checkpoint step 35 "
        "(/var/lib/rljob/checkpoints/step-00000035) was lost: it is missing from PersistentVolumeClaim ckpt "
        "(spec.trainer.checkpoint.volume; was the claim replaced or cleaned?)")
    assert "CheckpointLost" in [e.reason for e in job_status.transition_events(torn, again)]

    # Until attempt 3's rank 0 starts, the hash still holds attempt 2's record: not told as attempt 3's.
    attempt3 = replace(attempt1, attempt=3, restarts=3, message="attempt 3: all 2 trainer pods running")
    gang3 = [trainer(0, 3), trainer(1, 3)]
    stale = build(again, gang3, attempt3, seconds=42, fetched=lost_progress(lost={**LOST, "attempt": 2}))
    assert cond(stale, ConditionType.RUNNING).reason == "Training"
    current = build(stale, gang3, attempt3, seconds=43, fetched=lost_progress(lost={**LOST, "attempt": 3}))
    assert cond(current, ConditionType.RUNNING).reason == "CheckpointLost"

    cleared = build(again, [trainer(0, 2), trainer(1, 2)], attempt2, seconds=45, fetched=lost_progress(lost=None))
    assert cond(cleared, ConditionType.RUNNING).reason == "Training"
    assert job_status.transition_events(again, cleared) == []


@pytest.mark.parametrize(("raw", "told"), [
    ("{not json", "attempt 1 started over: the last recorded checkpoint was lost"),
    (json.dumps({"step": 7, "restored_from_step": 5}), "attempt 1 started over at step 5: checkpoint step 7 was lost"),
])
def test_an_unreadable_lost_checkpoint_record_still_gives_a_message(raw, told):
    parsed = protocol.parse_progress({"checkpoint_lost": raw}, {})
    assert job_status.lost_checkpoint_message(parsed.checkpoint_lost, 1, None).startswith(told)
    assert protocol.parse_progress({}, {}).checkpoint_lost is None


@pytest.mark.parametrize(("trainer_spec", "export"), [
    ({"checkpoint": {"volume": "ckpt"}}, "final weights exported to /var/lib/rljob/checkpoints/export (safetensors, "
     "Hugging Face layout) on PersistentVolumeClaim ckpt"),
    ({}, "final weights exported to /var/lib/rljob/checkpoints/export (safetensors, Hugging Face layout) on the pod's "
     "emptyDir, which goes with the pod: set spec.trainer.checkpoint.volume to a PersistentVolumeClaim to keep them"),
    ({"export": {"safetensors": False}}, "no export (spec.trainer.export.safetensors is false)"),
])
def test_success_is_one_normal_event_from_succeeded_naming_the_export(trainer_spec, export):
    spec = make_spec(trainer={"nodes": 2, **trainer_spec})
    hashes = render.config_hashes(render.job_config(render.Job("demo", "ns", spec)))
    pods = [trainer(0, 0, "Succeeded", hashes.config, role_config_hash=hashes.trainer),
            trainer(1, 0, "Succeeded", hashes.config, role_config_hash=hashes.trainer)]
    running = build(RLTrainingJobStatus(), pods, RUNNING)
    done = gang.plan("demo", spec, RUNNING, pods, hashes, T0).lifecycle
    finished = build(running, pods, done, seconds=5)
    message = f"trainer pod demo-trainer-0 (global rank 0) of attempt 0 exited 0; {export}"
    assert cond(finished, ConditionType.SUCCEEDED).message == message
    assert [(e.type, e.reason, e.message) for e in job_status.transition_events(running, finished)] == [
        ("Normal", "TrainingFinished", f"Succeeded=True: {message}")]


def test_a_finish_after_a_restart_is_told_by_succeeded_and_exited_ranks_are_not_unready():
    spec = make_spec(trainer={"nodes": 2})
    hashes = render.config_hashes(render.job_config(render.Job("demo", "ns", spec)))

    def gang1(*phases):
        return [trainer(i, 1, phase, hashes.config, role_config_hash=hashes.trainer) for i, phase in enumerate(phases)]

    restarting = gang.Lifecycle(phase=Phase.RESTARTING, attempt=1, restarts=1, gang_created=False,
                                reason=Reason.POD_DELETED, message="trainer pod demo-trainer-1 of attempt 0 was deleted")
    attempt1 = replace(RUNNING, attempt=1, restarts=1, message="attempt 1: all 2 trainer pods running")
    running = build(build(RLTrainingJobStatus(), [], restarting), gang1("Running", "Running"), attempt1, seconds=5)
    closing = build(running, gang1("Succeeded", "Running"), attempt1, seconds=6)  # rank 0 exited first
    ready = cond(closing, ConditionType.TRAINER_READY)
    assert (ready.status, ready.message) == ("True", "2/2 trainer pods ready (1 finished)")
    assert job_status.transition_events(running, closing) == []
    done = gang.plan("demo", spec, attempt1, gang1("Succeeded", "Succeeded"), hashes, T0).lifecycle
    finished = build(closing, gang1("Succeeded", "Succeeded"), done, seconds=7)
    assert cond(finished, ConditionType.RESTARTING).reason == "TrainingFinished"  # False, echoing the finish
    assert [(e.type, e.reason, e.message.split(":")[0]) for e in job_status.transition_events(closing, finished)] == [
        ("Normal", "TrainingFinished", "Succeeded=True")]


@pytest.mark.parametrize(("checkpoint", "resumes"), [
    ({}, "attempt 1 starts over from step 0: the checkpoints were on an emptyDir that goes with the pods (set "
         "spec.trainer.checkpoint.volume to a PersistentVolumeClaim to keep them)"),
    ({"initFrom": "/models/ckpt"}, "attempt 1 starts over from spec.trainer.checkpoint.initFrom: the checkpoints were "
     "on an emptyDir"),
    ({"volume": "ckpt", "everySteps": 5}, "attempt 1 resumes from the newest checkpoint on PersistentVolumeClaim ckpt "
     "(from step 0 if none was written yet: one every 5 steps)"),
])
def test_a_gang_restart_says_where_the_next_attempt_starts(checkpoint, resumes):
    spec = make_spec(trainer={"nodes": 2, "checkpoint": checkpoint})
    hashes = render.config_hashes(render.job_config(render.Job("demo", "ns", spec)))
    pods = [trainer(0, 0, config_hash=hashes.config, role_config_hash=hashes.trainer),
            trainer(1, 0, "Failed", hashes.config, role_config_hash=hashes.trainer, failure="exit code 1")]
    restarting = gang.plan("demo", spec, RUNNING, pods, hashes, T0).lifecycle
    assert restarting.phase == Phase.RESTARTING
    assert f"; tearing down the gang, {resumes}" in restarting.message
    suspended = gang.plan("demo", make_spec(trainer={"nodes": 2, "checkpoint": checkpoint},
                                            runPolicy={"suspend": True}), RUNNING, pods, hashes, T0).lifecycle
    note = ("(from step 0: the checkpoints were on an emptyDir; set spec.trainer.checkpoint.volume to a "
            "PersistentVolumeClaim to keep them)")
    assert (note in suspended.message) == ("volume" not in checkpoint)


def test_a_missing_secret_the_spec_names_is_told_with_its_field():
    spec = make_spec(hfTokenSecretRef={"name": "hf", "key": "token"},
                     redis={"mode": "external", "url": "redis://r:6379", "passwordSecretRef": {"name": "pw", "key": "p"}})
    fields = job_status.secret_fields(spec)
    assert fields == {"hf": "spec.hfTokenSecretRef", "pw": "spec.redis.passwordSecretRef"}
    waiting = dict(phase="Pending", waiting_reason="CreateContainerConfigError", container="trainer")
    pods = [trainer(0, 0, waiting_message='secret "hf" not found', **waiting),
            trainer(1, 0, waiting_message="couldn't find key p in Secret ns/pw", **waiting),
            trainer(2, 0, waiting_message="couldn't find key p in Secret ns/pw-other", **waiting)]
    named = job_status.name_secret_fields(pods, fields)
    assert [p.waiting_message for p in named] == [
        'secret "hf" not found (spec.hfTokenSecretRef)',
        "couldn't find key p in Secret ns/pw (spec.redis.passwordSecretRef)",
        "couldn't find key p in Secret ns/pw-other",  # another Secret: not the spec's
    ]
    assert job_status.name_secret_fields(named, fields) == named  # told once
    built = build(RLTrainingJobStatus(), named[:2], replace(RUNNING, phase=Phase.STARTING))
    assert cond(built, ConditionType.TRAINER_READY).message == (
        '0/2 trainer pods ready; cannot start: demo-trainer-0: container trainer CreateContainerConfigError: secret '
        '"hf" not found (spec.hfTokenSecretRef); demo-trainer-1: container trainer CreateContainerConfigError: '
        "couldn't find key p in Secret ns/pw (spec.redis.passwordSecretRef)")


def test_the_last_checkpoint_is_copied_into_status_and_kept_when_redis_forgets_it():
    """Issue 11 item 2: the status holds the newest committed checkpoint as it happens, so that it stays true when
    Redis loses its hashes (a managed Redis without persistence restarted empty, an external one flushed)."""
    pods = [trainer(0, 0), trainer(1, 0)]
    record = {"step": "30", "documents_seen": "1920", "path": "/var/lib/rljob/checkpoints/step-00000030",
              "updated_at": "1800000000.0"}
    fetched = protocol.parse_progress({b"step": b"31"}, {}, {k.encode(): v.encode() for k, v in record.items()})
    saved = build(RLTrainingJobStatus(), pods, RUNNING, fetched=fetched)
    assert saved.last_checkpoint == CheckpointStatus(step=30, documents_seen=1920,
                                                     path="/var/lib/rljob/checkpoints/step-00000030",
                                                     time=datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc))
    assert job_status.to_json(saved)["lastCheckpoint"] == {"step": 30, "documentsSeen": 1920,
                                                        "path": "/var/lib/rljob/checkpoints/step-00000030",
                                                        "time": "2027-01-15T08:00:00Z"}
    forgotten = build(saved, pods, RUNNING, seconds=5, fetched=protocol.parse_progress({}, {}, {}))
    assert forgotten.last_checkpoint == saved.last_checkpoint and forgotten.step == 31


def test_an_image_without_rljob_is_named_with_its_field_and_value():
    spec = make_spec(rollout={"image": "python:3.11-slim"})
    missing = {"terminated": {"exitCode": 1, "reason": "Error", "message": (
        "Traceback (most recent call last):\n  ...\n/usr/local/bin/python: No module named rljob_rollout\n"),
        "startedAt": "2026-01-01T12:00:02Z", "finishedAt": "2026-01-01T12:00:04Z"}}
    pod = pod_view(kubelet_rollout_pod(restartCount=3, lastState=missing, state={"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}}))
    (named,) = job_status.name_spec_fields([pod], spec)
    assert named.last_failure == (
        "exit code 1 (Error): /usr/local/bin/python: No module named rljob_rollout (spec.rollout.image "
        "'python:3.11-slim' has no rljob: build it FROM rljob's trainer image, or install rljob's packages in it)")
    assert job_status.name_spec_fields([named], spec) == [named]  # told once
    other = pod_view(kubelet_rollout_pod(restartCount=1, lastState=CRASHED, state={"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 10s"}}))
    assert job_status.name_spec_fields([other], spec) == [other]  # another failure: nothing added
