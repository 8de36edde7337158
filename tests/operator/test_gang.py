"""The gang state machine of DESIGN §5, driven like the operator drives it, over simulated pod state."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from rljob_api.constants import Phase, Reason
from rljob_api.protocol import RewardFailures

from rljob_operator import gang, render
from rljob_operator.observe import NodeView, PodView

from operator_helpers import T0, make_spec, rollout, trainer


class Sim:
    """Pods as the API server would hold them after the operator's actions (kubelet steps are explicit).

    The config hashes come from the renderer, for the spec of the moment (tests change ``sim.spec``)."""

    def __init__(self, spec):
        self.spec, self.now = spec, T0
        self.pods: dict[str, PodView] = {}
        self.lc = gang.Lifecycle()
        self.plans: list[gang.Plan] = []
        self.created = 0
        self.changed: tuple[str, ...] = ()

    @property
    def hashes(self) -> gang.ConfigHashes:
        hashes = render.config_hashes(render.job_config(render.Job("demo", "ns", self.spec)))
        return replace(hashes, changed=self.changed)

    def step(self, rewards=None, trained_step=None) -> gang.Plan:
        hashes = self.hashes
        plan = gang.plan("demo", self.spec, self.lc, list(self.pods.values()), hashes, self.now, rewards,
                         trained_step=trained_step)
        self.plans.append(plan)
        for name in plan.delete:
            self.pods[name] = replace(self.pods[name], deleting=True)
        for i in plan.create_trainers:
            self.pods[f"demo-trainer-{i}"] = trainer(i, plan.lifecycle.attempt, "Pending", hashes.config,
                                                     role_config_hash=hashes.trainer)
        for i in plan.create_rollouts:
            self.created += 1
            self.pods[f"demo-rollout-{i}"] = rollout(i, "Pending", hashes.config, role_config_hash=hashes.rollout,
                                                     uid=f"r{i}-{self.created}")
        self.lc = plan.after_create or plan.lifecycle
        return plan

    def kubelet_runs_everything(self):
        for name, pod in self.pods.items():
            if pod.phase == "Pending" and not pod.deleting:
                self.pods[name] = replace(pod, phase="Running", ready=True)

    def kubelet_removes_deleted(self):
        self.pods = {n: p for n, p in self.pods.items() if not p.deleting}

    def set(self, name, **changes):
        self.pods[name] = replace(self.pods[name], **changes)

    def attempts(self):
        return sorted({p.attempt for p in self.pods.values() if p.role == "trainer"})


def running_sim(**spec) -> Sim:
    sim = Sim(make_spec(**{**spec, "trainer": {"nodes": 2, **spec.get("trainer", {})}}))
    sim.step()
    sim.kubelet_runs_everything()
    sim.step()
    assert sim.lc.phase == Phase.RUNNING
    return sim


def test_a_new_job_creates_the_whole_gang_and_its_rollouts_then_runs():
    sim = Sim(make_spec(trainer={"nodes": 2}, rollout={"replicas": 1}))
    plan = sim.step()
    assert plan.create_trainers == (0, 1) and plan.create_rollouts == (0,)
    assert plan.lifecycle.phase == Phase.PENDING and plan.lifecycle.start_time == T0
    assert plan.after_create.gang_created and plan.after_create.phase == Phase.STARTING
    assert plan.after_create.reason == Reason.GANG_CREATED
    assert sim.step().create_trainers == ()  # created once, never twice
    sim.kubelet_runs_everything()
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.RUNNING and plan.lifecycle.message == "attempt 0: all 2 trainer pods running"
    assert (plan.delete, plan.create_trainers, plan.create_rollouts) == ((), (), ())


def test_a_one_pod_gang_is_told_in_the_singular():
    sim = Sim(make_spec(trainer={"nodes": 1, "processesPerNode": 2}))
    assert sim.step().after_create.message == "created attempt 0: 1 trainer pod"
    sim.kubelet_runs_everything()
    assert sim.step().lifecycle.message == "attempt 0: the trainer pod is running"


def test_pod_failure_tears_down_waits_and_only_then_starts_attempt_plus_one():
    sim = running_sim()
    sim.set("demo-trainer-1", phase="Failed", failure="container trainer exited with code 1 (Error)")
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.RESTARTING and plan.lifecycle.reason == Reason.POD_FAILED
    assert (plan.lifecycle.attempt, plan.lifecycle.restarts, plan.lifecycle.failed_attempts) == (1, 1, 1)
    assert plan.delete == ("demo-trainer-0", "demo-trainer-1") and plan.create_trainers == ()
    assert plan.lifecycle.message.startswith(
        "trainer pod demo-trainer-1 of attempt 0 container trainer exited with code 1 (Error); tearing down the gang"
    )
    # old pods still terminating: wait, create nothing, count nothing twice
    plan = sim.step()
    assert plan.create_trainers == () and plan.delete == ()
    assert (plan.lifecycle.phase, plan.lifecycle.restarts) == (Phase.RESTARTING, 1)
    assert sim.attempts() == [0]
    sim.kubelet_removes_deleted()
    plan = sim.step()
    assert plan.create_trainers == (0, 1) and plan.lifecycle.attempt == 1
    assert sim.attempts() == [1]  # attempts never mix
    sim.kubelet_runs_everything()
    assert sim.step().lifecycle.phase == Phase.RUNNING
    assert (sim.lc.restarts, sim.lc.failed_attempts) == (1, 1)


@pytest.mark.parametrize("how", ["evicted-failed", "disruption-deleting", "node-lost"])
def test_evictions_preemptions_and_node_loss_restart_without_counting(how):
    sim = running_sim()
    change = {
        "evicted-failed": dict(phase="Failed", disrupted=True, failure="Evicted: node pressure"),
        "disruption-deleting": dict(deleting=True, disrupted=True),
        "node-lost": dict(phase="Unknown"),
    }[how]
    sim.set("demo-trainer-0", **change)
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.RESTARTING
    assert (plan.lifecycle.restarts, plan.lifecycle.failed_attempts) == (1, 0)
    assert plan.lifecycle.reason == (Reason.POD_LOST if how == "node-lost" else Reason.POD_EVICTED)


def test_a_deleted_or_missing_pod_counts_as_a_failure_and_is_named():
    sim = running_sim()
    del sim.pods["demo-trainer-1"]
    plan = sim.step()
    assert plan.lifecycle.reason == Reason.POD_DELETED and plan.lifecycle.failed_attempts == 1
    assert "trainer pod demo-trainer-1 of attempt 0 is gone (deleted)" in plan.lifecycle.message


def test_backoff_limit_exhausted_fails_the_job():
    sim = running_sim(runPolicy={"backoffLimit": 1})
    sim.set("demo-trainer-0", phase="Failed", failure="container trainer exited with code 2 (Error)")
    sim.step()
    sim.kubelet_removes_deleted()
    sim.step()
    sim.kubelet_runs_everything()
    sim.step()
    sim.set("demo-trainer-1", phase="Failed", failure="container trainer exited with code 2 (Error)")
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.FAILED and plan.lifecycle.reason == Reason.BACKOFF_LIMIT_EXCEEDED
    assert plan.lifecycle.message == (
        "trainer pod demo-trainer-1 of attempt 1 container trainer exited with code 2 (Error); "
        "backoffLimit = 1 reached (1 counted restarts)"
    )
    assert plan.lifecycle.completion_time == T0 and plan.lifecycle.restarts == 1
    assert set(plan.delete) == {"demo-trainer-0", "demo-trainer-1"}  # cleanPodPolicy All
    # finished: nothing is ever created again
    sim.kubelet_removes_deleted()
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.FAILED and plan.create_trainers == () and plan.create_rollouts == ()


def test_backoff_limit_zero_fails_on_the_first_failure_but_not_on_an_eviction():
    sim = running_sim(runPolicy={"backoffLimit": 0})
    sim.set("demo-trainer-0", phase="Failed", disrupted=True)
    assert sim.step().lifecycle.phase == Phase.RESTARTING
    sim.kubelet_removes_deleted()
    sim.step()
    sim.kubelet_runs_everything()
    sim.step()
    sim.set("demo-trainer-0", phase="Failed")
    assert sim.step().lifecycle.phase == Phase.FAILED


@pytest.mark.parametrize("change", [
    {"trainer": {"nodes": 2, "maxSteps": 7}},
    {"trainer": {"nodes": 2}, "rollout": {"sampling": {"temperature": 0.7}}},  # the trainer scores at it
    {"trainer": {"nodes": 2}, "rollout": {"task": {"name": "digits-reverse"}}},  # it picks the tiny alphabet
])
def test_a_change_the_trainer_reads_restarts_the_gang_without_counting_and_recreates_rollouts(change):
    sim = running_sim()
    sim.spec = make_spec(**change)
    plan = sim.step()
    assert plan.lifecycle.reason == Reason.CONFIG_CHANGED and plan.lifecycle.phase == Phase.RESTARTING
    assert (plan.lifecycle.restarts, plan.lifecycle.failed_attempts) == (1, 0)
    assert "a spec field the trainer reads changed" in plan.lifecycle.message
    assert "demo-rollout-0" in plan.delete


def _trainer_pods(sim: Sim) -> dict[str, tuple[str, int, bool]]:
    return {n: (p.uid, p.attempt, p.deleting) for n, p in sim.pods.items() if p.role == "trainer"}


def test_rollout_only_changes_scale_or_replace_rollout_pods_and_never_restart_the_gang():
    sim = running_sim(rollout={"replicas": 1})
    trainers = _trainer_pods(sim)
    kept = sim.pods["demo-rollout-0"]

    sim.spec = make_spec(trainer={"nodes": 2}, rollout={"replicas": 3})  # scale up: the running replica stays
    plan = sim.step()
    assert (plan.create_rollouts, plan.delete, plan.create_trainers) == ((1, 2), (), ())
    assert (plan.lifecycle.phase, plan.lifecycle.attempt, plan.lifecycle.restarts) == (Phase.RUNNING, 0, 0)
    assert sim.pods["demo-rollout-0"] == kept
    sim.kubelet_runs_everything()

    # every other rollout-only field replaces the rollout pods, one by one as their hash changes, never the gang
    sim.spec = make_spec(trainer={"nodes": 2}, rollout={
        "replicas": 3, "image": "rollout:2", "samplesPerPrompt": 4, "maxLag": 64, "sampling": {"topP": 0.9},
        "resources": {"requests": {"cpu": "2"}}, "advantage": {"normalizeStd": False}, "seed": 5,
    })
    plan = sim.step()
    assert plan.delete == ("demo-rollout-0", "demo-rollout-1", "demo-rollout-2") and plan.create_trainers == ()
    assert (plan.lifecycle.phase, plan.lifecycle.restarts) == (Phase.RUNNING, 0)
    sim.kubelet_removes_deleted()
    assert sim.step().create_rollouts == (0, 1, 2)
    sim.kubelet_runs_everything()

    sim.spec = make_spec(trainer={"nodes": 2}, rollout={"replicas": 1, "image": "rollout:2", "samplesPerPrompt": 4,
                                                         "maxLag": 64, "sampling": {"topP": 0.9},
                                                         "resources": {"requests": {"cpu": "2"}},
                                                         "advantage": {"normalizeStd": False}, "seed": 5})
    plan = sim.step()  # scale down: only the pods above the count go
    assert plan.delete == ("demo-rollout-1", "demo-rollout-2") and plan.lifecycle.restarts == 0

    assert _trainer_pods(sim) == trainers and sim.attempts() == [0]
    assert all(not any(name.startswith("demo-trainer") for name in p.delete) for p in sim.plans)
    assert sim.lc.phase == Phase.RUNNING and (sim.lc.restarts, sim.lc.attempt) == (0, 0)


def test_pods_of_an_operator_without_role_hashes_are_compared_by_the_whole_config():
    """An operator upgrade leaves running gangs alone (their pods carry only rljob.dev/config-hash)."""
    sim = running_sim()
    for name, pod in sim.pods.items():
        sim.pods[name] = replace(pod, role_config_hash=None)
    plan = sim.step()
    assert plan.delete == () and plan.lifecycle.phase == Phase.RUNNING
    sim.spec = make_spec(trainer={"nodes": 2}, rollout={"replicas": 2})
    assert sim.step().lifecycle.reason == Reason.CONFIG_CHANGED  # their hash covers everything: restart once


def test_rollout_pod_loss_recreates_it_and_never_touches_the_gang():
    sim = running_sim(rollout={"replicas": 2})
    sim.set("demo-rollout-1", phase="Failed", disrupted=True)
    plan = sim.step()
    assert plan.delete == ("demo-rollout-1",) and plan.lifecycle.phase == Phase.RUNNING
    assert plan.lifecycle.restarts == 0 and plan.create_trainers == ()
    sim.kubelet_removes_deleted()
    plan = sim.step()
    assert plan.create_rollouts == (1,) and plan.lifecycle == sim.plans[-2].lifecycle
    # scaling rollouts down deletes the surplus pod, again without touching the gang
    sim.spec = make_spec(trainer={"nodes": 2}, rollout={"replicas": 1})
    plan = sim.step()
    assert plan.delete == ("demo-rollout-1",) and plan.lifecycle.restarts == 0


def test_suspend_deletes_every_pod_and_resume_starts_a_new_attempt_with_a_fresh_clock():
    sim = running_sim(runPolicy={"suspend": False, "activeDeadlineSeconds": 600})
    sim.now = T0 + timedelta(seconds=300)
    sim.spec = make_spec(trainer={"nodes": 2}, runPolicy={"suspend": True, "activeDeadlineSeconds": 600})
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.SUSPENDED and plan.lifecycle.reason == Reason.JOB_SUSPENDED
    assert set(plan.delete) == {"demo-trainer-0", "demo-trainer-1", "demo-rollout-0"}
    assert plan.lifecycle.start_time is None and plan.lifecycle.attempt == 1 and plan.lifecycle.restarts == 0
    sim.kubelet_removes_deleted()
    assert sim.step().delete == () and sim.lc.phase == Phase.SUSPENDED
    # resume 1000 s later: the deadline counts from the resume, not from the first start
    sim.now = T0 + timedelta(seconds=1300)
    sim.spec = make_spec(trainer={"nodes": 2}, runPolicy={"suspend": False, "activeDeadlineSeconds": 600})
    plan = sim.step()
    assert plan.create_trainers == (0, 1) and plan.lifecycle.attempt == 1
    assert plan.lifecycle.start_time == sim.now and plan.requeue_after == 600
    assert (plan.lifecycle.restarts, plan.lifecycle.failed_attempts) == (0, 0)


def test_a_config_change_restart_names_the_changed_fields():
    sim = running_sim()
    sim.spec = make_spec(trainer={"nodes": 2, "optimizer": {"learningRate": 1e-4}})
    sim.changed = ("spec.trainer.optimizer.learningRate",)  # what the operator found the edit changed
    restart = sim.step()
    assert restart.lifecycle.reason == Reason.CONFIG_CHANGED
    assert "runs an outdated config (spec.trainer.optimizer.learningRate changed)" in restart.lifecycle.message
    assert restart.create_rollouts == () and not [n for n in restart.delete if "rollout" in n]  # no rollout replaced


@pytest.mark.parametrize(("trainer", "pods"), [
    ({"nodes": 4}, ("demo-trainer-0", "demo-trainer-1", "demo-trainer-2", "demo-trainer-3")),  # pods the gang never had
    ({"nodes": 1, "processesPerNode": 4}, ("demo-trainer-0",)),
])
def test_a_topology_edit_restarts_the_gang_uncounted_with_the_new_pods_and_keeps_the_rollout_pods(trainer, pods):
    sim = running_sim()
    rollout_uid = sim.pods["demo-rollout-0"].uid
    sim.spec = make_spec(trainer=trainer)
    sim.changed = tuple(f"spec.trainer.{name}" for name in sorted(trainer))
    restart = sim.step()
    assert (restart.lifecycle.reason, restart.lifecycle.phase) == (Reason.CONFIG_CHANGED, Phase.RESTARTING)
    assert (restart.lifecycle.restarts, restart.lifecycle.failed_attempts) == (1, 0)
    assert f"runs an outdated config ({', '.join(sim.changed)} changed)" in restart.lifecycle.message
    assert sorted(restart.delete) == ["demo-trainer-0", "demo-trainer-1"]
    sim.kubelet_removes_deleted()
    created = sim.step()
    assert created.create_trainers == tuple(range(len(pods))) and created.lifecycle.attempt == 1
    assert sorted(n for n, p in sim.pods.items() if p.role == "trainer") == list(pods)
    assert sim.pods["demo-rollout-0"].uid == rollout_uid and created.create_rollouts == ()


def test_a_suspend_after_the_last_step_lets_the_gang_finish_and_the_job_succeed():
    sim = running_sim(trainer={"nodes": 2, "maxSteps": 40})
    sim.spec = make_spec(trainer={"nodes": 2, "maxSteps": 40}, runPolicy={"suspend": True})
    plan = sim.step(trained_step=40)
    assert plan.delete == () and plan.lifecycle.phase == Phase.RUNNING, plan
    assert plan.lifecycle.message == ("attempt 0: all 2 trainer pods running; the suspend waits: all 40 steps are done "
                                      "and the gang is finishing (the job Succeeds)")
    sim.set("demo-trainer-1", phase="Succeeded")  # its share done, pod 0 still exporting
    assert sim.step(trained_step=40).lifecycle.phase == Phase.RUNNING
    sim.set("demo-trainer-0", phase="Succeeded")
    plan = sim.step(trained_step=40)
    assert plan.lifecycle.phase == Phase.SUCCEEDED and plan.lifecycle.reason == Reason.TRAINING_FINISHED
    assert sim.step(trained_step=40).lifecycle.phase == Phase.SUCCEEDED  # a finished job stays so, suspended or not


@pytest.mark.parametrize("trained_step", [None, 39])
def test_a_suspend_before_the_last_step_deletes_the_gang(trained_step):
    sim = running_sim(trainer={"nodes": 2, "maxSteps": 40})
    sim.spec = make_spec(trainer={"nodes": 2, "maxSteps": 40}, runPolicy={"suspend": True})
    plan = sim.step(trained_step=trained_step)
    assert plan.lifecycle.phase == Phase.SUSPENDED
    assert set(plan.delete) == {"demo-trainer-0", "demo-trainer-1", "demo-rollout-0"}


def test_a_suspend_after_the_last_step_of_a_gang_with_a_failed_pod_suspends():
    sim = running_sim(trainer={"nodes": 2, "maxSteps": 40})
    sim.set("demo-trainer-1", phase="Failed", failure="container trainer exited with code 1 (Error)")
    sim.spec = make_spec(trainer={"nodes": 2, "maxSteps": 40}, runPolicy={"suspend": True})
    assert sim.step(trained_step=40).lifecycle.phase == Phase.SUSPENDED


def test_active_deadline_fails_the_job():
    sim = running_sim(runPolicy={"activeDeadlineSeconds": 60})
    sim.now = T0 + timedelta(seconds=59)
    assert sim.step().requeue_after == pytest.approx(1.0)
    sim.now = T0 + timedelta(seconds=60)
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.FAILED and plan.lifecycle.reason == Reason.DEADLINE_EXCEEDED
    assert plan.lifecycle.message == "the job was active for more than activeDeadlineSeconds = 60 s"
    assert set(plan.delete) == {"demo-trainer-0", "demo-trainer-1", "demo-rollout-0"}


def failing_rewards(since_s: float, lasted_s: float) -> RewardFailures:
    """A streak of failing batches from T0 + ``since_s`` for ``lasted_s`` seconds (first to last batch)."""
    since = T0.timestamp() + since_s
    return RewardFailures(since=since, updated_at=since + lasted_s, batches=14, samples=512,
                          errors={"ZeroDivisionError: division by zero": 512}, version=64, last_samples=16,
                          last_errors={"ZeroDivisionError": 16})


def test_rewards_failing_for_the_deadline_fail_the_job_and_a_shorter_streak_does_not():
    sim = running_sim(rollout={"rewardFailureDeadlineSeconds": 600})
    sim.now = T0 + timedelta(seconds=900)
    plan = sim.step(failing_rewards(10, 599))
    assert plan.lifecycle.phase == Phase.RUNNING and not plan.delete
    streak = failing_rewards(10, 600)
    plan = sim.step(streak)
    assert (plan.lifecycle.phase, plan.lifecycle.reason) == (Phase.FAILED, Reason.REWARDS_FAILING)
    assert plan.lifecycle.message == streak.failed_message(600, T0.timestamp())
    assert plan.lifecycle.message.startswith(
        "ZeroDivisionError: division by zero ×512 in spec.rollout.task's reward function since 2026-01-01T12:00:10Z: "
        "every sample of 14 rollout batches failed for 600 s")
    assert plan.lifecycle.completion_time == sim.now and plan.lifecycle.failed_attempts == 0
    assert set(plan.delete) == {"demo-trainer-0", "demo-trainer-1", "demo-rollout-0"}  # cleanPodPolicy All
    sim.kubelet_removes_deleted()
    assert sim.step(None).lifecycle.phase == Phase.FAILED  # final: a later pass without the record keeps it


def test_a_streak_counts_from_the_start_time_at_the_earliest_so_a_suspension_is_not_failing_time():
    sim = running_sim(rollout={"rewardFailureDeadlineSeconds": 600})  # started (or resumed) at T0
    sim.now = T0 + timedelta(seconds=700)
    assert sim.step(failing_rewards(-5000, 5599)).lifecycle.phase == Phase.RUNNING  # 599 s since T0
    plan = sim.step(failing_rewards(-5000, 5600))
    assert plan.lifecycle.reason == Reason.REWARDS_FAILING and " since 2026-01-01T12:00:00Z: " in plan.lifecycle.message


def test_rewards_failing_delete_pods_per_clean_pod_policy_and_never_touch_a_suspended_or_succeeded_job():
    streak = failing_rewards(0, 3600)
    sim = running_sim(runPolicy={"cleanPodPolicy": "None"})
    plan = sim.step(streak)
    assert plan.lifecycle.reason == Reason.REWARDS_FAILING and plan.delete == ()
    succeeded = running_sim()
    succeeded.set("demo-trainer-0", phase="Succeeded")
    assert succeeded.step(streak).lifecycle.phase == Phase.SUCCEEDED
    suspended = running_sim()
    suspended.spec = make_spec(trainer={"nodes": 2}, runPolicy={"suspend": True})
    assert suspended.step(streak).lifecycle.phase == Phase.SUSPENDED


def test_a_record_that_keeps_no_streak_never_fails_the_job():
    sim = running_sim(rollout={"rewardFailureDeadlineSeconds": 1})
    sim.now = T0 + timedelta(days=1)
    old_worker = RewardFailures(version=64, last_samples=16, last_errors={"KeyError": 16})  # a worker before the streak
    assert sim.step(old_worker).lifecycle.phase == Phase.RUNNING


@pytest.mark.parametrize(("policy", "deleted"), [
    ("All", {"demo-trainer-0", "demo-trainer-1", "demo-rollout-0"}),
    ("Running", {"demo-trainer-1", "demo-rollout-0"}),
    ("None", set()),
])
def test_success_when_pod_0_succeeds_then_clean_pod_policy(policy, deleted):
    sim = running_sim(runPolicy={"cleanPodPolicy": policy})
    sim.set("demo-trainer-0", phase="Succeeded")
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.SUCCEEDED and plan.lifecycle.reason == Reason.TRAINING_FINISHED
    assert plan.lifecycle.completion_time == T0
    assert set(plan.delete) == deleted


def test_a_rank_that_finished_first_keeps_the_job_running_until_pod_0_exits():
    sim = running_sim()
    sim.set("demo-trainer-1", phase="Succeeded")
    plan = sim.step()
    assert plan.lifecycle.phase == Phase.RUNNING and plan.lifecycle.reason == Reason.TRAINING
    assert not plan.delete and not plan.create_trainers
    sim.set("demo-trainer-0", phase="Succeeded")
    assert sim.step().lifecycle.phase == Phase.SUCCEEDED


def test_ttl_after_finished_deletes_the_job():
    sim = running_sim(runPolicy={"ttlSecondsAfterFinished": 30})
    sim.set("demo-trainer-0", phase="Succeeded")
    sim.step()
    sim.now = T0 + timedelta(seconds=10)
    plan = sim.step()
    assert not plan.delete_job and plan.requeue_after == pytest.approx(20)
    sim.now = T0 + timedelta(seconds=30)
    assert sim.step().delete_job


def test_pods_of_an_older_attempt_found_at_start_are_removed_before_anything_is_created():
    sim = Sim(make_spec(trainer={"nodes": 2}))
    sim.lc = gang.Lifecycle(attempt=2)
    sim.pods["demo-trainer-0"] = trainer(0, 1)
    plan = sim.step()
    assert plan.delete == ("demo-trainer-0",) and plan.create_trainers == ()
    assert plan.lifecycle.reason == Reason.TEARING_DOWN
    sim.kubelet_removes_deleted()
    assert sim.step().create_trainers == (0, 1)


def test_lifecycle_round_trips_through_the_saved_status():
    from rljob_operator import job_status as st
    from rljob_api.status import RLTrainingJobStatus

    sim = running_sim()
    sim.set("demo-trainer-1", phase="Failed", failure="boom")
    plan = sim.step()
    saved = st.build_status(
        RLTrainingJobStatus(), generation=1, lifecycle=plan.lifecycle, problems=[], data_parallel_size=2,
        redis=st.RedisHealth(True, "ok"), pods=sim.pods.values(), nodes=2, replicas=1, progress=None, now=T0,
    )
    again = RLTrainingJobStatus.model_validate(st.to_json(saved))
    assert gang.Lifecycle.from_status(again) == plan.lifecycle


# --- A node that stops reporting: pods stuck terminating (DESIGN §5, issue 11 item 7) -------------------------------
def _lost(sim: Sim, node: str, since_s: float) -> dict:
    return {node: NodeView(node, ready=False, not_ready_since=T0 + timedelta(seconds=since_s),
                           reason="Unknown (NodeStatusUnknown)")}


def test_a_pod_stuck_on_a_lost_node_is_force_deleted_after_its_toleration_and_the_gang_goes_on():
    sim = running_sim()
    for name, node in (("demo-trainer-0", "n1"), ("demo-trainer-1", "n2")):
        sim.set(name, node=node)
    # n2 stops reporting at T0; the taint manager evicts demo-trainer-1 after its 300 s toleration (grace 30 s).
    sim.now = T0 + timedelta(seconds=300)
    sim.set("demo-trainer-1", deleting=True, disrupted=True, deletion_at=sim.now + timedelta(seconds=30))
    nodes = _lost(sim, "n2", 0)
    plan = gang.plan("demo", sim.spec, sim.lc, list(sim.pods.values()), sim.hashes, sim.now, nodes=nodes)
    assert plan.lifecycle.phase == Phase.RESTARTING and plan.lifecycle.reason == Reason.POD_EVICTED
    assert plan.force_delete == () and plan.delete == ("demo-trainer-0",)  # still in its grace period
    stuck_message = ("waiting for a lost node: trainer pod demo-trainer-1 is stuck terminating: node n2 is not Ready "
                     "since 12:00:00: Unknown (NodeStatusUnknown); force-deleting it at 12:05:30 unless the node "
                     "comes back")
    assert plan.lifecycle.message.endswith("; " + stuck_message)
    assert plan.requeue_after == 30.0
    sim.lc = plan.lifecycle
    sim.set("demo-trainer-0", deleting=True)
    sim.pods.pop("demo-trainer-0")  # n1's kubelet confirms its end

    sim.now = T0 + timedelta(seconds=320)  # the saved message carries the account once, not twice
    again = gang.plan("demo", sim.spec, sim.lc, list(sim.pods.values()), sim.hashes, sim.now, nodes=nodes)
    assert again.lifecycle.message.count(gang.STUCK_MARK) == 1 and again.lifecycle.message.endswith(stuck_message)
    assert again.force_delete == () and again.create_trainers == () and again.requeue_after == 10.0

    sim.now = T0 + timedelta(seconds=330)
    due = gang.plan("demo", sim.spec, again.lifecycle, list(sim.pods.values()), sim.hashes, sim.now, nodes=nodes)
    assert [s.pod.name for s in due.force_delete] == ["demo-trainer-1"]
    assert gang.STUCK_MARK not in due.lifecycle.message
    assert due.force_delete[0].why == ("trainer pod demo-trainer-1 is stuck terminating: node n2 is not Ready since "
                                       "12:00:00: Unknown (NodeStatusUnknown)")
    sim.lc = due.lifecycle
    del sim.pods["demo-trainer-1"]  # the API server removes a pod deleted with grace 0 at once
    created = sim.step()
    assert created.create_trainers == (0, 1) and created.after_create.attempt == 1


def test_a_gang_torn_down_by_the_operator_waits_for_the_nodes_toleration_not_the_pods_grace():
    """The collective timeout ended the gang while n2 was partitioned for 40 s: its pod is deleted by the operator
    with a 30 s grace, and forced only once n2 has been lost for the pod's toleration (here 60 s)."""
    sim = running_sim()
    sim.set("demo-trainer-1", node="n2", lost_node_toleration_s=60)
    sim.set("demo-trainer-0", phase="Failed", failure="exit code 1")
    sim.now = T0 + timedelta(seconds=40)
    sim.step()
    sim.set("demo-trainer-1", deletion_at=sim.now + timedelta(seconds=30))
    sim.pods.pop("demo-trainer-0")
    sim.now = T0 + timedelta(seconds=75)  # the grace is over; n2 has been lost since T0 + 20 s: 55 of 60 s
    nodes = _lost(sim, "n2", 20)
    waiting = gang.plan("demo", sim.spec, sim.lc, list(sim.pods.values()), sim.hashes, sim.now, nodes=nodes)
    assert waiting.force_delete == () and waiting.requeue_after == 5.0
    sim.now = T0 + timedelta(seconds=80)
    assert [s.pod.name for s in gang.plan("demo", sim.spec, sim.lc, list(sim.pods.values()), sim.hashes, sim.now,
                                          nodes=nodes).force_delete] == ["demo-trainer-1"]


def test_a_gone_node_forces_at_once_a_node_back_or_a_toleration_forever_never():
    sim = running_sim()
    sim.set("demo-trainer-1", node="n2", deleting=True, deletion_at=T0)
    sim.now = T0 + timedelta(seconds=1)
    pods = list(sim.pods.values())
    gone = {"n2": NodeView("n2", exists=False, ready=False, reason="the Node object is gone")}
    assert [s.pod.name for s in gang.plan("demo", sim.spec, sim.lc, pods, sim.hashes, sim.now, nodes=gone).force_delete] == [
        "demo-trainer-1"]
    back = {"n2": NodeView("n2")}
    assert gang.plan("demo", sim.spec, sim.lc, pods, sim.hashes, sim.now, nodes=back).force_delete == ()
    sim.set("demo-trainer-1", lost_node_toleration_s=-1)
    forever = gang.plan("demo", sim.spec, sim.lc, list(sim.pods.values()), sim.hashes, T0 + timedelta(days=1),
                        nodes=_lost(sim, "n2", 0))
    assert forever.force_delete == ()
    assert forever.lifecycle.message.endswith(
        "it tolerates the node's loss forever, so only the node's return or a person ends it")
