"""The rollout autoscaling law (rljob_operator.autoscale): each branch on hand-made signals, its fixed points on
noise-free signals, and the law on the simulated pipeline (benchmarks/autoscale_sim.py): from a wrong start balanced
within 5 decisions, and in steady state no decision reversed within 3 cooldowns."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest

from rljob_operator.autoscale import Direction, Policy, Signals, decide, needed_replicas

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("autoscale_sim", BENCHMARKS / "autoscale_sim.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules["autoscale_sim"] = sim  # dataclasses look their module up
_spec.loader.exec_module(sim)

POLICY = Policy(min_replicas=1, max_replicas=16, cooldown_s=300.0)


def signals(wait: float = 0.0, held: float = 0.0, tokens: float = 700.0, backlog: int = 3) -> Signals:
    return Signals(data_wait_share=wait, held_share=held, tokens_per_s_per_replica=tokens, backlog=backlog)


@pytest.mark.parametrize("fields, message", [
    ({"min_replicas": 0, "max_replicas": 4}, "min_replicas must be at least 1, got 0"),
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas 2 is below min_replicas 3"),
    ({"min_replicas": 1, "max_replicas": 2, "target_wait_share": 1.0}, "target_wait_share must be in [0, 1), got 1.0"),
    ({"min_replicas": 1, "max_replicas": 2, "band": -0.1}, "band must be ≥ 0"),
    ({"min_replicas": 1, "max_replicas": 2, "target_wait_share": 0.5, "band": 0.5}, "target_wait_share + band < 1"),
    ({"min_replicas": 1, "max_replicas": 2, "held_share": 1.5}, "held_share must be a share in [0, 1], got 1.5"),
    ({"min_replicas": 1, "max_replicas": 2, "cooldown_s": -1.0}, "cooldown_s must be ≥ 0, got -1.0"),
    ({"min_replicas": 1, "max_replicas": 2, "max_step": 0}, "max_step must be at least 1, got 0"),
])
def test_a_policy_out_of_range_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError) as raised:
        Policy(**fields)
    assert message in str(raised.value)


@pytest.mark.parametrize("fields, message", [
    ({"wait": 1.2}, "data_wait_share must be a share in [0, 1], got 1.2"),
    ({"held": -0.1}, "held_share must be a share in [0, 1], got -0.1"),
    ({"tokens": -1.0}, "tokens_per_s_per_replica must be ≥ 0, got -1.0"),
    ({"backlog": -1}, "backlog must be ≥ 0, got -1"),
])
def test_signals_out_of_range_are_refused(fields, message):
    with pytest.raises(ValueError) as raised:
        signals(**fields)
    assert str(raised.value) == message


def test_a_negative_count_or_time_is_refused():
    with pytest.raises(ValueError, match="replicas must be ≥ 0, got -1"):
        decide(POLICY, -1, 1000.0, signals())
    with pytest.raises(ValueError, match="since_last_change_s must be ≥ 0, got -5"):
        decide(POLICY, 2, -5.0, signals())


def test_a_count_outside_the_bounds_goes_to_the_nearest_bound_at_once_even_in_cooldown():
    policy = Policy(min_replicas=2, max_replicas=8)
    up = decide(policy, 0, 0.0, signals(tokens=0.0))
    assert (up.replicas, up.direction, up.changed) == (2, Direction.UP, True)
    assert up.reason == "rollout replicas 0 → 2: outside minReplicas 2 .. maxReplicas 8"
    down = decide(policy, 20, 10.0, signals(wait=0.9))  # 12 replicas beyond the bound: no step limit
    assert (down.replicas, down.direction) == (8, Direction.DOWN)


def test_the_cooldown_holds_and_says_how_long_it_has_run():
    hold = decide(POLICY, 2, 100.0, signals(wait=0.9))
    assert (hold.replicas, hold.direction, hold.changed, hold.needed) == (2, Direction.HOLD, False, None)
    assert hold.reason == "rollout replicas held at 2: cooldown, 100 s of 300 s since the last change"
    assert decide(POLICY, 2, 300.0, signals(wait=0.9)).direction is Direction.UP  # the cooldown is over at 300 s
    assert decide(POLICY, 2, math.inf, signals(wait=0.9)).direction is Direction.UP


def test_a_window_without_tokens_says_nothing_about_capacity():
    hold = decide(POLICY, 2, 1000.0, signals(wait=1.0, tokens=0.0))
    assert hold.direction is Direction.HOLD and "no tokens generated in the window" in hold.reason


def test_a_waiting_trainer_adds_replicas_in_proportion_to_its_wait_and_the_reason_has_the_numbers():
    wide = Policy(min_replicas=1, max_replicas=16, max_step=8)
    up = decide(wide, 1, 1000.0, signals(wait=5 / 6, tokens=700.0, backlog=3))
    assert (up.replicas, up.direction) == (6, Direction.UP)  # needed = 1 / (1 − 5/6) = 6; ceil(6 × 0.95) = 6
    assert up.needed == pytest.approx(6.0)
    assert up.reason == (
        "rollout replicas 1 → 6: the trainer waits for data and the rollouts are not held; trainer data-wait 83.3% "
        "(target 5.0%, band 5.0%), rollouts held by back-pressure 0.0% (threshold 10.0%), 700 tokens/s per replica, "
        "backlog 3; needed ≈ 1 × (1 − 0.000) / (1 − 0.833) = 6.00, 6 keep the wait at target")
    assert len(up.reason) < 1024  # a Kubernetes Event message
    assert decide(POLICY, 1, 1000.0, signals(wait=5 / 6)).replicas == 5  # the default max_step of 4
    small = decide(POLICY, 4, 1000.0, signals(wait=0.2))  # needed 5, ceil(4.75) = 5: one more
    assert (small.replicas, small.direction) == (5, Direction.UP)
    floored = decide(wide, 2, 1000.0, signals(wait=1.0))  # 1 − w floored at 0.05: needed 40, capped by the step
    assert floored.replicas == 10 and floored.needed == pytest.approx(40.0)


def test_adding_stops_at_max_replicas():
    policy = Policy(min_replicas=1, max_replicas=8)
    assert decide(policy, 6, 1000.0, signals(wait=0.5)).replicas == 8  # needed 12
    at_max = decide(policy, 8, 1000.0, signals(wait=0.5))
    assert at_max.direction is Direction.HOLD and "at maxReplicas 8" in at_max.reason


def test_held_rollouts_with_a_trainer_that_does_not_wait_remove_replicas_down_to_a_band_of_spare_capacity():
    wide = Policy(min_replicas=1, max_replicas=16, max_step=10)
    down = decide(wide, 10, 1000.0, signals(held=0.81, backlog=900))  # needed 1.9; ceil(1.9 × 1.05) = 2
    assert (down.replicas, down.direction) == (2, Direction.DOWN)
    assert down.reason == (
        "rollout replicas 10 → 2: the rollouts are held and the trainer does not wait; trainer data-wait 0.0% "
        "(target 5.0%, band 5.0%), rollouts held by back-pressure 81.0% (threshold 10.0%), 700 tokens/s per replica, "
        "backlog 900; needed ≈ 10 × (1 − 0.810) / (1 − 0.000) = 1.90, 2 feed it with 5.0% to spare")
    assert decide(wide, 10, 1000.0, signals(held=0.8, backlog=900)).replicas == 3  # needed 2.0: ceil(2.1) = 3
    assert decide(POLICY, 10, 1000.0, signals(held=0.81, backlog=900)).replicas == 6  # the default max_step of 4
    spare = decide(POLICY, 3, 1000.0, signals(held=1 / 3, backlog=900))  # needed 2.0 at 3: kept
    assert spare.direction is Direction.HOLD and "the rollouts are held but 3 feed the trainer with 5.0% to spare" in spare.reason


def test_removing_stops_at_min_replicas():
    policy = Policy(min_replicas=4, max_replicas=16)
    assert decide(policy, 6, 1000.0, signals(held=0.7, backlog=500)).replicas == 4  # needed 1.8
    at_min = decide(policy, 4, 1000.0, signals(held=0.7, backlog=500))
    assert at_min.direction is Direction.HOLD and "at minReplicas 4" in at_min.reason


@pytest.mark.parametrize("measured, why", [
    (signals(wait=0.08), "balanced"),  # waits, but within target + band
    (signals(wait=0.10), "balanced"),  # the band's edge: not above it
    (signals(held=0.10, backlog=500), "balanced"),  # held, but not above the threshold
    (signals(wait=0.3, held=0.3, backlog=500), "the trainer waits while the rollouts are held"),
    (signals(wait=0.06, held=0.4, backlog=500), "the rollouts are held but the trainer waits above its target"),
    (signals(held=0.4, backlog=0), "the rollouts are held with an empty backlog"),
    (signals(wait=0.11, held=0.1), "the trainer waits but 6 would do"),  # needed 6.07 at 6: ceil(5.76) = 6
])
def test_inside_the_hysteresis_band_or_without_a_capacity_imbalance_the_count_holds(measured, why):
    hold = decide(POLICY, 6, 1000.0, measured)
    assert (hold.replicas, hold.direction) == (6, Direction.HOLD)
    assert hold.reason.startswith(f"rollout replicas held at 6: {why}")


def exact(replicas: int, needed: float) -> Signals:
    """What a noise-free pipeline that needs ``needed`` replicas measures with ``replicas``."""
    return signals(wait=max(0.0, 1.0 - replicas / needed), held=max(0.0, 1.0 - needed / replicas), backlog=500)


def test_on_noise_free_signals_the_law_goes_in_one_step_to_a_count_it_then_holds():
    policy = Policy(min_replicas=1, max_replicas=16, max_step=16)
    for needed in [1.0 + 0.05 * i for i in range(281)]:  # 1.0 .. 15.0 replicas
        held_at = sim.balanced_counts(sim.Pipeline.needing(needed), policy)
        # the trainer waits at most target + band; the rollouts are held at most held_share, or one replica is spare
        assert needed * 0.9 <= held_at[0] and held_at[-1] < needed / 0.9 + 1, (needed, list(held_at))
        for start in range(1, 17):
            path = [start]
            for _ in range(3):
                path.append(decide(policy, path[-1], math.inf, exact(path[-1], needed)).replicas)
            assert path[1] in held_at and path[1] == path[2] == path[3], (needed, path, list(held_at))
        for count in held_at:
            assert decide(policy, count, math.inf, exact(count, needed)).direction is Direction.HOLD


def test_the_estimate_reads_the_balance_of_documents():
    assert needed_replicas(4, signals(wait=0.5)) == pytest.approx(8.0)
    assert needed_replicas(8, signals(held=0.25)) == pytest.approx(6.0)
    assert needed_replicas(3, signals()) == 3.0


# ---- the simulated pipeline


def test_the_simulation_is_deterministic_for_a_seed_and_measures_what_the_model_says():
    p = sim.Pipeline.needing(4.0)
    tick_s, window_s, _ = sim.timing(p)
    short = sim.simulate(p, 2, None, 7, tick_s, window_s, 3600.0)
    assert short.ticks == sim.simulate(p, 2, None, 7, tick_s, window_s, 3600.0).ticks
    assert short.ticks != sim.simulate(p, 2, None, 8, tick_s, window_s, 3600.0).ticks
    steady = short.ticks[len(short.ticks) // 2:]
    wait = sum(t.signals.data_wait_share for t in steady) / len(steady)
    assert wait == pytest.approx(0.5, abs=0.03)  # 1 − 2/4
    assert all(t.signals.held_share == 0.0 and t.signals.backlog < p.batch_documents for t in steady)
    tokens = sum(t.signals.tokens_per_s_per_replica for t in steady) / len(steady)
    rate = p.concurrency * p.group_documents / p.group_s * p.tokens_per_document
    assert tokens == pytest.approx(rate, rel=0.05)
    over = sim.simulate(p, 8, None, 7, tick_s, window_s, 3600.0).ticks[30:]
    held = sum(t.signals.held_share for t in over) / len(over)
    assert held == pytest.approx(0.5, abs=0.03)  # 1 − 4/8
    assert all(t.signals.data_wait_share < 0.02 and t.signals.backlog > p.max_lag / 2 for t in over)
    estimates = [needed_replicas(t.replicas, t.signals) for t in steady + over]
    assert sum(estimates) / len(estimates) == pytest.approx(4.0, rel=0.03)


def test_the_simulation_counts_what_a_removal_abandons_and_stops_at_the_reward():
    p = sim.Pipeline.needing(2.0)
    tick_s, window_s, cooldown_s = sim.timing(p)
    policy = Policy(min_replicas=1, max_replicas=16, cooldown_s=cooldown_s)
    run = sim.simulate(p, 10, policy, 0, tick_s, window_s, 4 * 3600.0)
    assert run.changes[0].decision.direction is Direction.DOWN and run.abandoned_groups > 0
    curve = sim.RewardCurve(start=0.1, scale=1000.0)
    assert curve.reward(curve.documents_to(0.9)) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="reward 1.0 is not between"):
        curve.documents_to(1.0)
    done = sim.simulate(p, 2, None, 0, tick_s, window_s, 4 * 3600.0, until_documents=curve.documents_to(0.9))
    assert done.reached_s is not None and done.trained == math.ceil(curve.documents_to(0.9) / 64) * 64


def run_law(needed: float, start: int, step_s: float, noise: float, seed: int, cooldowns: int = 40):
    p = sim.Pipeline.needing(needed, step_s=step_s, group_noise=noise)
    tick_s, window_s, cooldown_s = sim.timing(p)
    policy = Policy(min_replicas=1, max_replicas=16, cooldown_s=cooldown_s)
    run = sim.simulate(p, start, policy, seed, tick_s, window_s, cooldowns * cooldown_s)
    return run, sim.balanced_counts(p, policy), cooldown_s


WRONG_STARTS = [(6.0, 1), (2.0, 10), (5.5, 1), (3.3, 12)]


@pytest.mark.parametrize("needed, start", WRONG_STARTS)
@pytest.mark.parametrize("step_s, noise", [(4.0, 0.1), (8.0, 0.3), (16.0, 0.5), (4.0, 0.5)])
def test_from_a_wrong_start_the_law_balances_within_five_decisions(needed, start, step_s, noise):
    for seed in range(2):
        run, counts, cooldown_s = run_law(needed, start, step_s, noise, seed, cooldowns=20)
        entered = sim.balanced_after(run, counts)
        assert entered is not None and entered[1] <= 5, (seed, list(counts), [t.replicas for t in run.changes])
        assert entered[0] <= 5 * cooldown_s
        settled = [t for t in run.ticks if t.end_s > entered[0] + cooldown_s]
        waits = sum(t.signals.data_wait_share for t in settled) / len(settled)
        assert waits <= POLICY.target_wait_share + POLICY.band  # balanced: the trainer is fed


@pytest.mark.parametrize("needed", [1.5, 2.5, 3.3, 5.5, 7.7, 10.4])
def test_in_steady_state_no_decision_is_reversed_within_three_cooldowns(needed):
    for step_s, noise, seed in itertools.product((4.0, 16.0), (0.1, 0.3, 0.5), range(2)):
        start = sim.balanced_counts(sim.Pipeline.needing(needed), POLICY)[0]
        run, counts, cooldown_s = run_law(needed, start, step_s, noise, seed)
        assert sim.reversals(run, 3 * cooldown_s) == [], (step_s, noise, seed, [t.replicas for t in run.changes])
        assert all(t.decision.replicas in counts for t in run.changes)  # moves, if any, stay among the held counts
