"""The durable account in status (rljob_operator.account): one record per gang attempt, closed with the reason in the
update that ends it, the trainer's start and reader counts per attempt, the job's totals, and the Events it tells."""

from __future__ import annotations

from datetime import timedelta

from rljob_api.constants import Phase, Reason
from rljob_api.protocol import Backlog, CheckpointRecord, Progress
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import account, gang, job_status

from operator_helpers import T0, rollout, trainer

READY = job_status.RedisHealth(True, "managed Redis demo-redis: 1/1 replicas available")


def build(previous: RLTrainingJobStatus, lifecycle: gang.Lifecycle, *, minutes: int, dp: int = 2,
          progress: Progress | None = None) -> RLTrainingJobStatus:
    pods = [trainer(0, lifecycle.attempt), trainer(1, lifecycle.attempt), rollout(0)] if lifecycle.gang_created else []
    return job_status.build_status(previous, generation=1, lifecycle=lifecycle, problems=(), data_parallel_size=dp,
                                   redis=READY, pods=pods, nodes=2, replicas=1, progress=progress,
                                   now=T0 + timedelta(minutes=minutes))


def started(attempt: int) -> gang.Lifecycle:
    return gang.Lifecycle(phase=Phase.STARTING, attempt=attempt, gang_created=True, reason=Reason.GANG_CREATED,
                          message=f"created attempt {attempt}: 2 trainer pods")


def event_list(previous: RLTrainingJobStatus, new: RLTrainingJobStatus) -> list[tuple[str, str, str]]:
    return [(e.type, e.reason, e.message) for e in job_status.transition_events(previous, new)
            if e.reason in ("WorldSizeChanged", "CheckpointLoaded", "EntriesRejected")]


def test_an_attempt_is_recorded_from_its_gang_to_the_update_that_ends_it_with_its_reason():
    s0 = RLTrainingJobStatus()
    s1 = build(s0, started(0), minutes=0)
    assert [r.model_dump() for r in s1.attempts] == [{
        "attempt": 0, "start_time": T0, "end_time": None, "reason": None, "message": "", "data_parallel_size": 2,
        "restored_from_step": None, "checkpoint_path": None, "step": None,
        "documents": {"redelivered": 0, "dead_lettered": {}, "dropped_too_long": 0, "dropped_stale": 0,
                      "lost_pending": 0}}]

    # the trainer of attempt 0 reports its start and steps: 3 bad entries, 1 too long, among 100 trained
    progress = Progress(step=25, documents_seen=100, started_attempt=0, restored_from_step=0,
                        stream={"redeliveries": 0, "dead_lettered": 3, "dead_lettered.bad_value": 2,
                                "dead_lettered.missing_metrics_field": 1, "dropped_too_long": 1})
    s2 = build(s1, gang.Lifecycle(phase=Phase.RUNNING, attempt=0, gang_created=True, reason=Reason.TRAINING,
                                  message="attempt 0: all 2 trainer pods running"), minutes=1, progress=progress)
    (record,) = s2.attempts
    assert (record.restored_from_step, record.step, record.end_time) == (0, 25, None)
    assert record.documents.dead_lettered == {"bad_value": 2, "missing_metrics_field": 1}
    assert s2.document_totals.model_dump() == {
        "redelivered": 0, "dead_lettered": {"bad_value": 2, "missing_metrics_field": 1}, "dropped_too_long": 1,
        "dropped_stale": 0, "lost_pending": 0, "stream_losses": 0, "stream_lost_entries": 0}
    assert event_list(s1, s2) == [("Warning", "EntriesRejected", (
        "the trainer could not train 4 of the 104 entries read since the job began (3.8%): 3 dead-lettered "
        "(bad_value 2, missing_metrics_field 1); 1 dropped as longer than trainer.microBatchTokens; "
        "status.documentTotals keeps the counts"))]

    # a pod deleted: the plan's restarted lifecycle closes attempt 0 in the same status update
    restarting = gang.Lifecycle(phase=Phase.RESTARTING, attempt=1, restarts=1, failed_attempts=1, gang_created=False,
                                reason=Reason.POD_DELETED, message="trainer pod demo-trainer-1 of attempt 0 was deleted")
    s3 = build(s2, restarting, minutes=2)
    assert [(r.attempt, r.end_time, r.reason, r.message) for r in s3.attempts] == [
        (0, T0 + timedelta(minutes=2), "PodDeleted", "trainer pod demo-trainer-1 of attempt 0 was deleted")]

    # attempt 1 with another world size, resumed from step 20's checkpoint: 64 redelivered, 1 more bad entry
    s4 = build(s3, started(1), minutes=3, dp=4)
    assert [(r.attempt, r.start_time, r.data_parallel_size) for r in s4.attempts] == [
        (0, T0, 2), (1, T0 + timedelta(minutes=3), 4)]
    assert event_list(s3, s4) == [("Normal", "WorldSizeChanged", (
        "attempt 1 runs data-parallel size 4 (attempt 0 ran 2): its ranks reshard the checkpoint they load and share "
        "the stream's pending entries"))]
    checkpoint = CheckpointRecord(step=20, documents_seen=80, path="/ckpt/demo/step-20", committed_at=None)
    progress = Progress(step=21, documents_seen=84, started_attempt=1, restored_from_step=20, checkpoint=checkpoint,
                        stream={"redeliveries": 64, "dead_lettered.bad_value": 1})
    s5 = build(s4, started(1), minutes=4, dp=4, progress=progress)
    assert (s5.attempts[1].restored_from_step, s5.attempts[1].checkpoint_path) == (20, "/ckpt/demo/step-20")
    assert event_list(s4, s5) == [("Normal", "CheckpointLoaded", (
        "attempt 1 (data-parallel size 4) started from the checkpoint of step 20 at /ckpt/demo/step-20"))]
    totals = s5.document_totals
    assert (totals.redelivered, totals.dead_lettered, totals.dropped_too_long) == (
        64, {"bad_value": 3, "missing_metrics_field": 1}, 1)
    # the same counts read again add nothing; a grown count adds its growth
    s6 = build(s5, started(1), minutes=5, dp=4, progress=progress)
    assert s6.document_totals == totals and event_list(s5, s6) == []

    # the account survives a round trip through the API server's JSON (what a restarted operator reads back)
    assert RLTrainingJobStatus.model_validate(job_status.to_json(s6)) == s6


def test_a_finish_a_suspend_and_an_invalid_spec_close_the_record_and_late_counts_still_reach_it():
    s1 = build(RLTrainingJobStatus(), started(0), minutes=0)
    done = gang.Lifecycle(phase=Phase.SUCCEEDED, attempt=0, gang_created=True, reason=Reason.TRAINING_FINISHED,
                          message="trainer pod demo-trainer-0 (global rank 0) of attempt 0 exited 0")
    late = Progress(step=40, documents_seen=160, started_attempt=0, restored_from_step=0, stream={"dropped_stale": 7})
    s2 = build(s1, done, minutes=9, progress=late)
    (record,) = s2.attempts
    assert (record.reason, record.end_time, record.step, record.documents.dropped_stale) == (
        "TrainingFinished", T0 + timedelta(minutes=9), 40, 7)
    assert s2.document_totals.dropped_stale == 7

    suspended = gang.Lifecycle(phase=Phase.SUSPENDED, attempt=1, gang_created=False, reason=Reason.JOB_SUSPENDED,
                               message="job suspended")
    s3 = build(build(RLTrainingJobStatus(), started(0), minutes=0), suspended, minutes=1)
    assert [(r.reason, r.message) for r in s3.attempts] == [("JobSuspended", "job suspended")]
    invalid = gang.Lifecycle(phase=Phase.INVALID, attempt=0, gang_created=True, reason=Reason.INVALID_SPEC,
                             message="spec.trainer.maxSteps: must be at least the last step")
    s5 = build(build(RLTrainingJobStatus(), started(0), minutes=0), invalid, minutes=1)
    assert [(r.reason, r.end_time) for r in s5.attempts] == [("InvalidSpec", T0 + timedelta(minutes=1))]

    # an older trainer writes no started_attempt: its progress changes no record
    s4 = build(s1, started(0), minutes=1, progress=Progress(step=3, documents_seen=12, stream={"redeliveries": 5}))
    assert s4.attempts == s1.attempts and s4.document_totals.redelivered == 0


def test_an_attempt_found_running_without_a_record_has_no_start_time():
    running = gang.Lifecycle(phase=Phase.RUNNING, attempt=3, restarts=3, gang_created=True, reason=Reason.TRAINING,
                             message="attempt 3: all 2 trainer pods running")
    before = build(RLTrainingJobStatus(), running, minutes=0).model_copy(update={"attempts": []})
    after = build(before, running, minutes=1)
    assert [(r.attempt, r.start_time, r.end_time) for r in after.attempts] == [(3, None, None)]


def test_twenty_attempts_are_kept_and_the_totals_count_every_one():
    status = RLTrainingJobStatus()
    for attempt in range(25):
        status = build(status, started(attempt), minutes=2 * attempt, progress=Progress(
            step=1, documents_seen=1000, started_attempt=attempt, restored_from_step=0, stream={"redeliveries": 2}))
        status = build(status, gang.Lifecycle(phase=Phase.RESTARTING, attempt=attempt + 1, restarts=attempt + 1,
                                              reason=Reason.POD_FAILED, message=f"attempt {attempt} failed"),
                       minutes=2 * attempt + 1)
    assert [r.attempt for r in status.attempts] == list(range(5, 25))
    assert all(r.reason == "PodFailed" for r in status.attempts)
    assert status.document_totals.redelivered == 50


def test_a_stream_loss_adds_what_the_last_read_counted():
    status = account.stream_lost(RLTrainingJobStatus(), Backlog(pending=1024, undelivered=512))
    status = account.stream_lost(status, None)
    assert (status.document_totals.stream_losses, status.document_totals.stream_lost_entries) == (2, 1536)


def test_rejected_entries_warn_each_time_they_double_and_only_above_one_percent():
    def with_bad(bad: int, seen: int) -> RLTrainingJobStatus:
        return RLTrainingJobStatus(documents_seen=seen).model_copy(update={
            "document_totals": RLTrainingJobStatus().document_totals.model_copy(
                update={"dead_lettered": {"bad_json": bad}})})

    warned = [bad for before, bad in zip(range(0, 40), range(1, 41))
              if account.events(with_bad(before, 100 * before), with_bad(bad, 100 * bad))]
    assert warned == []  # under 1% of the entries read
    warned = [bad for before, bad in zip(range(0, 40), range(1, 41))
              if account.events(with_bad(before, 10 * before), with_bad(bad, 10 * bad))]
    assert warned == [1, 2, 4, 8, 16, 32]
