"""The rollout hash's reward-failure streak (rljob_api.protocol): how failures are counted, how batches extend the
streak, how it is bounded, read back and told."""

from __future__ import annotations

import json

import pytest

from rljob_api import protocol
from rljob_api.protocol import (EPISODE_ERROR_KINDS, REWARD_ERROR_KINDS_KEPT, REWARD_FAILURE_GAP_S, RewardFailures,
                                after_failing_batch)

T = 1767268800.0  # 2026-01-01T12:00:00Z
ZERO = "ZeroDivisionError: division by zero"


def test_a_failure_is_counted_by_class_and_the_first_line_of_its_message():
    assert protocol.reward_error_key("ZeroDivisionError", "division by zero") == ZERO
    assert protocol.reward_error_key("ValueError", "  bad value: 'x'\nsecond line\n") == "ValueError: bad value: 'x'"
    assert protocol.reward_error_key("KeyError", "") == "KeyError"
    long = protocol.reward_error_key("RuntimeError", "x" * 500)
    assert len(long) == len("RuntimeError: ") + protocol.REWARD_ERROR_MESSAGE_CHARS and long.endswith("x…")
    assert protocol.reward_error_class("ValueError: bad value: 'x'") == "ValueError"
    assert protocol.reward_error_class("KeyError") == "KeyError"


def test_the_first_failing_batch_starts_a_streak_and_the_next_ones_extend_it():
    first = after_failing_batch(None, version=0, samples=16, errors={ZERO: 16}, now=T, own_streak=False)
    assert first == RewardFailures(since=T, updated_at=T, batches=1, samples=16, errors={ZERO: 16}, version=0,
                                   last_samples=16, last_errors={"ZeroDivisionError": 16})
    second = after_failing_batch(first, version=64, samples=16, errors={ZERO: 12, "KeyError: 'x'": 4},
                                 now=T + 30, own_streak=False)  # another worker, 30 s later
    assert second == RewardFailures(since=T, updated_at=T + 30, batches=2, samples=32,
                                    errors={ZERO: 28, "KeyError: 'x'": 4}, version=64, last_samples=16,
                                    last_errors={"ZeroDivisionError": 12, "KeyError": 4})
    assert second.failing_seconds() == 30.0


def test_a_pause_longer_than_the_gap_starts_over_unless_the_writer_kept_failing_itself():
    streak = after_failing_batch(None, version=0, samples=8, errors={ZERO: 8}, now=T, own_streak=False)
    later = T + REWARD_FAILURE_GAP_S + 1
    fresh = after_failing_batch(streak, version=0, samples=8, errors={ZERO: 8}, now=later, own_streak=False)
    assert (fresh.since, fresh.batches, fresh.samples) == (later, 1, 8)  # a new pod after a long pause
    going_on = after_failing_batch(streak, version=0, samples=8, errors={ZERO: 8}, now=later, own_streak=True)
    assert (going_on.since, going_on.batches, going_on.samples) == (T, 2, 16)  # a slow worker, failing throughout
    close = after_failing_batch(streak, version=0, samples=8, errors={ZERO: 8}, now=T + REWARD_FAILURE_GAP_S,
                                own_streak=False)
    assert close.since == T


def test_a_record_without_a_streak_starts_one():
    old = RewardFailures.from_field(json.dumps({"version": 3, "samples": 8, "errors": {"KeyError": 8}}))
    assert old.since is None and old.failing_seconds() is None
    new = after_failing_batch(old, version=3, samples=8, errors={"KeyError": 8}, now=T, own_streak=True)
    assert (new.since, new.batches) == (T, 1)


def test_the_streak_keeps_the_most_frequent_kinds_and_counts_the_rest_together():
    errors = {f"ValueError: value {i}": 10 + i for i in range(REWARD_ERROR_KINDS_KEPT + 2)}  # 10 kinds, 10..19
    record = after_failing_batch(None, version=0, samples=sum(errors.values()), errors=errors, now=T, own_streak=False)
    assert record.errors == {f"ValueError: value {i}": 10 + i for i in range(2, 10)}
    assert record.other_errors == 10 + 11 and record.samples == 145
    assert record.last_errors == {"ValueError": 145}
    more = after_failing_batch(record, version=0, samples=30, errors={"KeyError: 'y'": 30}, now=T + 1, own_streak=True)
    assert len(more.errors) == REWARD_ERROR_KINDS_KEPT and more.errors["KeyError: 'y'"] == 30
    assert more.other_errors == 21 + 12  # value 2 (12 samples) folded in
    assert more.describe().startswith("KeyError: 'y' ×30, ValueError: value 9 ×19, ")
    assert more.describe().endswith("ValueError: value 3 ×13 (and 33 samples of other errors)")


def test_the_field_reads_back_and_unreadable_parts_do_not_raise():
    record = RewardFailures(since=T, updated_at=T + 5, batches=2, samples=32, errors={ZERO: 30}, other_errors=2,
                            version=64, last_samples=16, last_errors={"ZeroDivisionError": 16})
    raw = record.to_field()
    assert RewardFailures.from_field(raw) == RewardFailures.from_field(raw.encode()) == record
    stored = json.loads(raw)
    assert (stored["version"], stored["samples"], stored["errors"]) == (64, 16, {"ZeroDivisionError": 16})
    assert stored["message"] == f"{ZERO} ×30 (and 2 samples of other errors)"
    assert RewardFailures.from_field(None) is None
    assert RewardFailures.from_field("{not json") == RewardFailures()
    odd = RewardFailures.from_field(json.dumps({"since": "x", "updated_at": T, "batches": -3, "failures": {"A": -1, "B": 2.5, "C": 4}}))
    assert (odd.since, odd.updated_at, odd.batches, odd.errors) == (None, None, 0, {"C": 4})


@pytest.mark.parametrize(("started", "since", "seconds"), [
    (None, T, 700.0),
    (T - 50, T, 700.0),          # started before the streak
    (T + 500, T + 500, 200.0),   # resumed after a suspend: the pause is not failing time
    (T + 900, T + 900, 0.0),     # every failing batch predates the (re)start
])
def test_failing_time_runs_between_failing_batches_from_the_later_of_since_and_the_start(started, since, seconds):
    record = RewardFailures(since=T, updated_at=T + 700, batches=12, samples=192, errors={ZERO: 192})
    assert record.failing_since(started) == since and record.failing_seconds(started) == seconds


def test_the_messages_name_the_failures_the_time_and_the_field():
    record = RewardFailures(since=T, updated_at=T + 612, batches=14, samples=512, errors={ZERO: 512}, version=64,
                            last_samples=16, last_errors={"ZeroDivisionError": 16})
    assert record.failed_message(600) == (
        "ZeroDivisionError: division by zero ×512 in spec.rollout.task's reward function since 2026-01-01T12:00:00Z: "
        "every sample of 14 rollout batches failed for 612 s, reaching spec.rollout.rewardFailureDeadlineSeconds = "
        "600; fix the reward code or spec.rollout.task (rewardFunction, datasetPath); the rollout pods' logs hold the "
        "tracebacks (kept when runPolicy.cleanPodPolicy is None)")
    assert record.ready_message(600, T + 60) == (
        "every one of the 16 samples of a rollout worker's last batch (weights version 64) failed its reward "
        "function: ZeroDivisionError ×16 (most often in this streak: ZeroDivisionError: division by zero); no "
        "document reaches the trainer until rewards succeed again: fix the reward code or spec.rollout.task "
        "(rewardFunction, datasetPath); the rollout pods' logs hold the tracebacks; failing since 2026-01-01T12:01:00Z: "
        "the job fails (RewardsFailing) if no sample scores by 2026-01-01T12:11:00Z "
        "(spec.rollout.rewardFailureDeadlineSeconds = 600)")
    assert record.ready_message().endswith("tracebacks; failing since 2026-01-01T12:00:00Z")
    one = RewardFailures(since=T, updated_at=T, batches=1, samples=16, errors={ZERO: 16})
    assert "every sample of 1 rollout batch failed for 0 s" in one.failed_message(1)


def test_environment_failures_point_to_the_environment_not_the_reward_code():
    unreachable = "EnvironmentFailed: cannot reach http://nowhere.invalid:8000"
    record = RewardFailures(since=T, updated_at=T + 30, batches=3, samples=48,
                            errors={"EnvironmentTimeout: step took over 30 s": 40, unreachable: 8}, version=2,
                            last_samples=16, last_errors={"EnvironmentTimeout": 12, "EnvironmentFailed": 4})
    ready = record.ready_message(600)
    assert ready.startswith("every one of the 16 samples of a rollout worker's last batch (weights version 2) failed "
                            "its episode against the environment: EnvironmentTimeout ×12, EnvironmentFailed ×4 (most "
                            "often in this streak: EnvironmentTimeout: step took over 30 s); ")
    assert "fix the environment or spec.rollout.environment (url, or server image, port and command; " in ready
    assert "EnvironmentReady" in ready and "rewardFunction" not in ready
    failed = record.failed_message(600)
    assert failed.startswith("EnvironmentTimeout: step took over 30 s ×40, " + unreachable + " ×8 in "
                             "spec.rollout.environment's episodes since 2026-01-01T12:00:00Z: every sample of 3 "
                             "rollout batches failed for 30 s")
    assert "rewardFunction" not in failed


def test_mixed_failures_name_both_remedies():
    record = RewardFailures(since=T, updated_at=T, batches=1, samples=16, errors={ZERO: 8, "EnvironmentFailed": 8},
                            last_samples=16, last_errors={"ZeroDivisionError": 8, "EnvironmentFailed": 8})
    message = record.ready_message()
    assert "failed its episode or reward function: " in message
    assert "EnvironmentFailed ×8, ZeroDivisionError ×8 (most often in this streak: " + ZERO + ")" in message  # no message: not quoted
    assert "fix the reward code or spec.rollout.task (rewardFunction, datasetPath), or fix the environment" in message
    assert "in spec.rollout's episodes and reward function" in record.failed_message(600)


def test_the_episode_error_kinds_are_the_rollout_workers_classes():
    from rljob_rollout.environments.sessions import EpisodeError

    assert set(EPISODE_ERROR_KINDS) == {c.__name__ for c in EpisodeError.__subclasses__()}
