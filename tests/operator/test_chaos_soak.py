"""The pure parts of the chaos soak (benchmarks/chaos_soak.py): its seeded schedule, the recovery figure and the
invariants it judges a finished job by, on hand-made records; the soak itself runs outside CI."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_soak.py"
_spec = importlib.util.spec_from_file_location("chaos_soak", SCRIPT)
soak = importlib.util.module_from_spec(_spec)
sys.modules["chaos_soak"] = soak  # dataclasses look their module up
_spec.loader.exec_module(soak)


def test_the_schedule_replays_from_its_seed_and_keeps_its_gaps():
    plan = soak.schedule(7, 1800, 60, 120, 0.25)
    assert plan == soak.schedule(7, 1800, 60, 120, 0.25)
    assert plan != soak.schedule(8, 1800, 60, 120, 0.25)
    assert {kind for _, kind in plan} <= set(soak.FAULT_KINDS)
    times = [t for t, _ in plan]
    assert times == sorted(times) and 60 <= times[0] <= 120 and times[-1] < 1800 + 15
    gaps = [b - a for a, b in zip(times, times[1:])]
    seconds = [g for g in gaps if g <= 15]  # a second fault 2–15 s after the one it overlaps; the next one ≥ 45 s on
    assert seconds and all(2 <= g for g in seconds) and all(g >= 45 for g in gaps if g > 15)
    assert 15 <= len(plan) - len(seconds) <= 30  # 1800 s at 60–120 s apart
    calm = [t for t, _ in soak.schedule(7, 1800, 60, 120, 0.0)]
    assert all(b - a >= 60 for a, b in zip(calm, calm[1:]))


def _samples(*rows):
    return [soak.Sample(t, "Running", attempt, step, 0) for t, attempt, step in rows]


def test_recovery_is_the_first_step_made_within_one_attempt_after_the_fault():
    samples = _samples((0, 0, 10), (2, 0, 11), (4, 0, 11), (6, 1, 11), (8, 1, 5), (10, 1, 5), (12, 1, 6), (14, 1, 7))
    assert soak.recovery_seconds(samples, 3) == 9.0  # the new attempt's 5 → 6 at 12 s (11 → 5 is a restore)
    assert soak.recovery_seconds(samples, 0) == 2.0
    assert soak.recovery_seconds(samples, 13) is None  # one sample after it: no step seen made
    assert soak.recovery_seconds(_samples((0, 0, None), (2, 0, None), (4, 0, 3)), 0) is None


def _record(attempt, reason, end="2026-12-04T16:00:10Z", message="why"):
    return {"attempt": attempt, "startTime": "2026-12-04T16:00:00Z", "endTime": end, "reason": reason,
            "message": message}


def test_the_account_must_explain_every_attempt_and_count_its_restarts():
    attempts = {0: _record(0, "PodDeleted"), 1: _record(1, "JobSuspended"), 2: _record(2, "ConfigChanged"),
                3: {"attempt": 3, "startTime": "2026-12-04T16:01:00Z"}}
    assert soak.check_account(attempts, {"attempt": 3, "restarts": 2}) == []
    assert soak.check_account(attempts, {"attempt": 3, "restarts": 3}) == [
        "status.restarts is 3, but 2 attempts ended in a restart"]
    gap = {k: v for k, v in attempts.items() if k != 1}
    assert soak.check_account(gap, {"attempt": 3, "restarts": 2}) == [
        "attempt 1: no record in status.attempts was ever seen"]
    silent = {**attempts, 0: _record(0, "PodDeleted", message="")}
    (problem,) = soak.check_account(silent, {"attempt": 3, "restarts": 2})
    assert problem.startswith("attempt 0: its record has no message")


def _snapshot(seen=1024, pending=0, dead=0, stream=None):
    return {"progress": {"documents_seen": str(seen), "stream": json.dumps(stream or {"lost_pending": 0})},
            "groups": [{"name": "trainer", "pending": pending}], "dead_letter": dead}


def test_documents_must_be_trained_once_or_counted_as_lost():
    status = {"documentsSeen": 1024, "documentTotals": {"deadLettered": {"vocab": 2}, "lostPending": 3,
                                                        "streamLosses": 1}}
    lost = {0: _record(0, "StreamLost")}
    assert soak.check_documents(_snapshot(dead=2, stream={"lost_pending": 3}), status, 1024, lost) == []
    problems = soak.check_documents(_snapshot(seen=1000, pending=4, dead=5, stream={"lost_pending": 4}),
                                    status, 1024, {})
    assert problems == [
        "documents trained: progress hash 1000, status.documentsSeen 1024, expected maxSteps × documentsPerStep = 1024",
        "consumer groups' pending entries after success: [4] (one group, 0 pending expected)",
        "dead-letter stream holds 5 entries, status.documentTotals.deadLettered counts 2",
        "the last attempt lost 4 pending entries, status.documentTotals.lostPending counts 3",
        "status.documentTotals.streamLosses is 1, but 0 attempts ended StreamLost",
    ]


def test_restarts_are_matched_to_the_faults_of_their_window():
    from datetime import datetime

    started = datetime.fromisoformat("2026-12-04T16:00:00+00:00").timestamp()
    faults = [soak.Injected("rank_killed", 5, 6), soak.Injected("redis_pod_deleted", 200, 201),
              soak.Injected("config_edit", 400, 401, skipped=True)]
    attempts = {0: _record(0, "PodFailed", end="2026-12-04T16:00:10Z"),
                1: _record(1, "PodFailed", end="2026-12-04T16:03:25Z"),
                2: _record(2, "ConfigChanged", end="2026-12-04T16:06:45Z"),
                3: _record(3, "TrainingFinished", end="2026-12-04T16:09:00Z")}
    assert soak.unexpected_restarts(attempts, faults, started) == [
        "attempt 1 ended PodFailed at 205 s; faults near: redis_pod_deleted",
        "attempt 2 ended ConfigChanged at 405 s; faults near: config_edit",  # that edit was never made
    ]


def test_the_summary_gives_median_and_worst_per_kind():
    faults = [soak.Injected("rank_killed", 0, 1, recovery=30.0), soak.Injected("rank_killed", 0, 1, recovery=50.0),
              soak.Injected("rank_killed", 0, 1, recovery=40.0), soak.Injected("operator_forced", 0, 1),
              soak.Injected("config_edit", 0, 1, skipped=True)]
    summary = soak.summarize(faults)
    assert summary["rank_killed"] == {"injected": 3, "skipped": 0, "not_recovered": 0, "recovery_median_s": 40.0,
                                      "recovery_worst_s": 50.0}
    assert summary["operator_forced"]["not_recovered"] == 1
    assert summary["all"] == {"injected": 4, "skipped": 1, "not_recovered": 1, "recovery_median_s": 40.0,
                              "recovery_worst_s": 50.0}


def test_describe_is_compared_above_its_events():
    text = "Name: soak\nStatus:\n  Restarts: 2\nEvents:\n  Normal  GangCreated  1m  rljob  attempt 2\n"
    assert soak.describe_head(text) == "Name: soak\nStatus:\n  Restarts: 2"
    assert soak.describe_head("Name: soak\nEvents: <none>\n") == "Name: soak"
