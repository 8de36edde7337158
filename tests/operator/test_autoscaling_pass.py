"""The rollout autoscaler's turn in a pass (rljob_operator.rollout_scaling): the count a job runs, what Kueue is asked
for, and the decision from the capacity status with its status and reason; the bounds checked by
the operator and a worker's index against the autoscaler's count."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from operator_helpers import make_job, make_spec
from rljob_api.status import AutoscalingStatus, CapacityStatus
from rljob_api.validation import check_spec
from rljob_operator import autoscale, capacity, queueing, render, rollout_scaling as rs
from rljob_rollout.__main__ import replica_index

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
AUTO = {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "cooldownSeconds": 120}}


def test_the_count_a_job_runs_and_what_kueue_is_asked_for():
    plain, auto = make_spec(rollout={"replicas": 3}), make_spec(rollout=AUTO)
    assert rs.replicas_to_run(plain, AutoscalingStatus(replicas=7)) == 3  # no autoscaling: the spec, whatever the status
    assert rs.replicas_to_run(auto, None) == 2  # the starting count
    assert rs.replicas_to_run(auto, AutoscalingStatus(replicas=5)) == 5
    assert rs.replicas_to_run(auto, AutoscalingStatus(replicas=12)) == 8  # maxReplicas lowered since
    assert rs.replicas_to_run(make_spec(rollout={"replicas": 0, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}}),
                              None) == 2
    assert (rs.quota_replicas(plain), rs.quota_replicas(auto)) == (3, 8)
    assert rs.with_replicas(auto, 5).rollout.replicas == 5 and rs.with_replicas(auto, 2) is auto


def test_a_queued_autoscaling_job_asks_kueue_for_max_replicas_whatever_it_runs():
    labels = {"kueue.x-k8s.io/queue-name": "team"}
    job = make_job(rollout=AUTO, labels=labels)
    config = render.job_config(job)
    rollouts = lambda spec: next(p for p in queueing.wanted(render.Job("demo", "ns", spec, labels), config, None)
                                 ["spec"]["podSets"] if p["name"] == "rollout")["count"]
    assert rollouts(job.spec) == 8 == rollouts(rs.with_replicas(job.spec, 5))


def measured(wait: float, held: float, per_replica: float = 150.0, undelivered: int = 12) -> autoscale.Signals:
    """The law's signals as the pass reads them from status.capacity (rljob_operator.capacity.signals)."""
    return capacity.signals(CapacityStatus(data_wait_share=wait, held_share=held, tokens_per_second=2 * per_replica,
                                           tokens_per_second_per_replica=per_replica, pending=64,
                                           undelivered=undelivered, replicas_reporting=2, observed_at=T0))


def test_a_waiting_trainer_scales_up_once_with_the_numbers_then_the_cooldown_holds_without_a_write():
    spec = make_spec(rollout=AUTO)
    signals = measured(0.40, 0.05)
    status, decision = rs.decide(spec, None, 2, signals, T0, started=T0 - timedelta(minutes=10))
    assert decision.changed and status.replicas == decision.replicas == 4 and status.last_change_time == T0
    assert status.last_decision == decision.reason and decision.reason.startswith("rollout replicas 2 → 4: the trainer "
                                                                                 "waits for data and the rollouts are not held")
    assert "trainer data-wait 40.0%" in decision.reason
    later = T0 + timedelta(seconds=60)
    held, decision = rs.decide(spec, status, 4, signals, later, started=T0 - timedelta(minutes=10))
    assert held == status and not decision.changed and "cooldown, 60 s of 120 s" in decision.reason
    kept, decision = rs.decide(spec, status, 4, None, later, started=None)  # no signals: the law is not asked
    assert (kept, decision) == (status, None)


def test_held_rollouts_and_a_trainer_that_does_not_wait_scale_down_after_the_job_has_run_a_cooldown():
    spec = make_spec(rollout=AUTO)
    signals = measured(0.0, 0.6, per_replica=100.0, undelivered=300)
    status, decision = rs.decide(spec, AutoscalingStatus(replicas=6), 6, signals, T0, started=T0 - timedelta(seconds=30))
    assert not decision.changed and "cooldown" in decision.reason  # the job's start counts as the last change
    status, decision = rs.decide(spec, AutoscalingStatus(replicas=6), 6, signals, T0, started=T0 - timedelta(hours=1))
    assert decision.direction is autoscale.Direction.DOWN and status.replicas == decision.replicas < 6


def test_bounds_the_wrong_way_round_are_refused_naming_both_values():
    problems = check_spec(make_spec(rollout={"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}))
    assert [(p.field, p.message) for p in problems] == [
        ("spec.rollout.autoscaling.minReplicas", "autoscaling.minReplicas 5 is above autoscaling.maxReplicas 3: the "
         "autoscaler keeps the rollout replicas between the two")]
    with pytest.raises(ValueError, match="spec.rollout.autoscaling is not set"):
        rs.policy(make_spec())
    assert rs.policy(make_spec(rollout=AUTO)) == autoscale.Policy(1, 8, target_wait_share=0.05, cooldown_s=120.0)


def test_a_worker_index_is_checked_against_the_autoscalers_bound():
    config = render.job_config(make_job(rollout=AUTO))
    assert replica_index(config, {"RLJOB_REPLICA_INDEX": "7"}) == 7
    with pytest.raises(ValueError, match=r"8 is outside \[0, spec.rollout.autoscaling.maxReplicas = 8\)"):
        replica_index(config, {"RLJOB_REPLICA_INDEX": "8"})
    plain = render.job_config(make_job(rollout={"replicas": 2}))
    with pytest.raises(ValueError, match=r"2 is outside \[0, spec.rollout.replicas = 2\)"):
        replica_index(plain, {"RLJOB_REPLICA_INDEX": "2"})
