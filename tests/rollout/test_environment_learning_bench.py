"""The environment-learning benchmark (benchmarks/environment_learning.py) without a learning run: the windowed reward,
a seed's figures, the targets and the exit status; and rl_pipeline's local environment server command and metric
reading, which it uses."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import environment_learning as el  # noqa: E402
import rl_pipeline as rp  # noqa: E402

TARGETS = el.Targets(window=2)


def points(*rewards: float, samples: int = 100) -> list[rp.Point]:
    """One version per step 0, 1, 2, ... (512 documents per step) with these rewards and ``samples`` each."""
    return [rp.Point(i * 512, i, r, samples, float(i)) for i, r in enumerate(rewards)]


def test_the_windowed_reward_is_the_sample_weighted_mean_of_the_last_steps():
    curve = [rp.Point(0, 0, 0.1, 300, 0.0), rp.Point(512, 1, 0.5, 100, 1.0), rp.Point(1024, 2, 1.0, 100, 2.0)]
    assert el.windowed(curve, 1, 2) == pytest.approx((0.2, 400))  # (0.1 × 300 + 0.5 × 100) / 400
    assert el.windowed(curve, 2, 2) == pytest.approx((0.75, 200))
    assert el.windowed(curve, 2, 3)[1] == 500
    reward, samples = el.windowed(curve, 9, 2)
    assert math.isnan(reward) and samples == 0


def test_one_noisy_version_does_not_reach_the_target_alone():
    # step 2's version saw 10 episodes, all found: alone 1.0, over 2 steps (0.3 × 100 + 1.0 × 10) / 110 = 0.36
    curve = points(0.1, 0.3) + [rp.Point(1024, 2, 1.0, 10, 2.0)] + points(0, 0, 0, 0.7, 0.9)[3:]
    assert el.first_reached(curve, 0.8, 2) == 4  # (0.7 + 0.9) / 2 = 0.8
    assert el.first_reached(curve, 0.8, 1) == 2


def test_a_seed_that_learns_meets_every_target():
    result = el.evaluate(3, points(0.12, 0.3, 0.7, 0.85, 0.9, 0.95), 4.6, 200, TARGETS)
    # windowed over 2 steps: 0.21, 0.5, 0.775 at step 3, 0.875 at step 4 (reached), 0.925 at step 5
    assert result == el.SeedResult(3, 0.12, 4.6, 4, pytest.approx(0.925), 5, 200)
    assert [held for _, held in el.verdicts(result, TARGETS)] == [True, True, True, True]
    assert el.exit_status([result], 1, TARGETS, busy=False, failed=False) == 0


def test_each_target_is_missed_on_its_own():
    learned = points(0.12, 0.9, 0.9)
    cases = {
        "untrained reward": el.evaluate(0, points(0.3, 0.9, 0.9), 4.0, 200, TARGETS),  # 0.3 is not below 0.3
        "untrained turns": el.evaluate(0, learned, 2.9, 200, TARGETS),
        "reached": el.evaluate(0, points(0.1, 0.2, 0.9, 0.9), 4.0, 2, TARGETS),  # at step 3 (window 2) > maxSteps 2
        "final reward": el.evaluate(0, points(0.1, 0.9, 0.9, 0.5, 0.6), 4.0, 200, TARGETS),  # 0.55 at step 4
    }
    for missed, result in cases.items():
        failing = [what for what, held in el.verdicts(result, TARGETS) if not held]
        assert len(failing) == 1 and failing[0].startswith(missed), (missed, failing)
        assert el.exit_status([result], 1, TARGETS, busy=False, failed=False) == 1
    never = el.evaluate(0, points(0.1, 0.5, 0.7, 0.75), 4.0, 200, TARGETS)  # 0.725 at best
    assert never.reached_step is None and [held for _, held in el.verdicts(never, TARGETS)] == [True, True, False, False]
    no_turns = el.evaluate(0, learned, None, 200, TARGETS)  # the rollout's metrics were never read
    assert [held for _, held in el.verdicts(no_turns, TARGETS)] == [True, False, True, True]


def test_a_run_without_the_initial_version_has_no_untrained_reward():
    result = el.evaluate(0, points(0.1, 0.9, 0.9)[1:], 4.0, 200, TARGETS)
    assert math.isnan(result.untrained) and el.verdicts(result, TARGETS)[0][1] is False


def test_the_exit_status_needs_every_seed_and_a_quiet_machine():
    good = el.evaluate(0, points(0.1, 0.9, 0.9), 4.0, 200, TARGETS)
    assert el.exit_status([good, good, good], 3, TARGETS, busy=False, failed=False) == 0
    assert el.exit_status([good, good], 3, TARGETS, busy=False, failed=False) == 1  # a seed missing
    assert el.exit_status([good] * 3, 3, TARGETS, busy=True, failed=False) == 2
    assert el.exit_status([good] * 3, 3, TARGETS, busy=False, failed=True) == 2


def test_the_example_server_runs_as_a_local_process():
    spec = rp.example_spec(el.EXAMPLE)
    command = rp.environment_server_command(spec["rollout"]["environment"]["server"], 4321)
    assert command == [sys.executable, "-m", "rljob_rollout.environments.serve", "--entrypoint",
                       "rljob_rollout.environments.guess:GuessNumber", "--port", "8000", "--max-sessions", "512",
                       "--host", "127.0.0.1", "--port", "4321"]
    with pytest.raises(ValueError, match="server.command"):
        rp.environment_server_command({"image": "x:1", "args": ["--port", "1"]}, 1)


def test_metric_values_are_read_from_prometheus_text():
    text = ('# HELP rljob_rollout_episode_turns x\nrljob_rollout_episode_turns_bucket{le="1.0"} 3.0\n'
            "rljob_rollout_episode_turns_count 512.0\nrljob_rollout_episode_turns_sum 2304.0\n")
    assert rp.metric_value(text, "rljob_rollout_episode_turns_count") == 512.0
    assert rp.metric_value(text, "rljob_rollout_episode_turns_sum") == 2304.0
    assert rp.metric_value(text, "rljob_rollout_episode_turns") is None
