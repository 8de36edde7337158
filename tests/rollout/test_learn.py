"""The learning test (DESIGN §10): one CPU rollout worker feeding a 2-rank trainer over real Redis learns the
digit-copy task, so the whole loop — task, rewards, advantages, log-probabilities, version tagging, weight
transfer, loss — has the right sign, and does so while training on stale documents (the worker may run
``MAX_LAG`` documents ahead; the trainer's staleness metric must show it did).

A second test runs the same processes with ``maxLag: 0`` and checks that they are then strictly synchronous
(staleness 0 at every step, DESIGN §6).

Processes: ``torchrun --nproc-per-node=2 -m rljob_trainer.train`` (2 gloo ranks) and
``python -m rljob_rollout`` (the pod entry point), both reading one config file, fixed seeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from source_tree import pythonpath
from pathlib import Path

import pytest

from portutil import free_port
from rollout_harness import TOY, make_config
from rollout_harness import rollout_rewards

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from train_harness import Torchrun, json_lines  # noqa: E402 - the trainer tests' torchrun launcher

DIGITS = 4
PROMPTS, SAMPLES = 32, 16
DOCUMENTS_PER_STEP = PROMPTS * SAMPLES  # 512: one rollout batch per optimizer step
MAX_LAG = 2 * DOCUMENTS_PER_STEP  # the worker may run two steps ahead, so documents are stale (off-policy)
STEPS = 80
"""The settings of :class:`rljob_rollout.tasks.DigitsTask`'s docstring: measured here, rollout reward 0.07
at step 0, 0.15 at step 20, 0.30 at step 40, ~0.6 at step 60, > 0.85 at step 70, 0.98 at step 80 (30-60 s on 2
cores), so the asserted rise of 0.4 has a wide margin."""


def _rollout_process(config_path: Path, password: str, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, RLJOB_CONFIG=str(config_path), REDIS_PASSWORD=password, RLJOB_REPLICA_INDEX="0",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = pythonpath(env)
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "rljob_rollout"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run_to_the_end(config, redis_server, tmp_path: Path, trainer_timeout: float) -> Torchrun:
    """Write ``config``, run the 2-rank trainer and one rollout process until both exit 0 (killed on failure)."""
    config_path = tmp_path / "config.json"
    config_path.write_text(config.to_json())
    trainer = Torchrun(config_path, 2, free_port(), redis_server.password, tmp_path, "trainer")
    rollout = _rollout_process(config_path, redis_server.password, tmp_path / "rollout.log")
    try:
        assert trainer.wait(trainer_timeout) == 0, trainer.logs()
        assert rollout.wait(60) == 0, (tmp_path / "rollout.log").read_text()[-4000:]
    finally:
        if trainer.process.poll() is None:
            trainer.kill()
        if rollout.poll() is None:
            rollout.kill()
            rollout.wait(10)
    return trainer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollout_reward_learns(redis_server, tmp_path):
    config = make_config(
        redis_server,
        tiny=TOY,
        rollout={"promptsPerBatch": PROMPTS, "samplesPerPrompt": SAMPLES, "maxLag": MAX_LAG, "seed": 3,
                 "sampling": {"temperature": 1.0, "topP": 1.0}, "task": {"name": "digits-copy", "digits": DIGITS}},
        trainer={
            "processesPerNode": 2,
            "batch": {"documentsPerStep": DOCUMENTS_PER_STEP, "microBatchTokens": 4096},
            "optimizer": {"learningRate": 2e-3, "beta2": 0.99, "gradClip": 1.0},
            "checkpoint": {"everySteps": 1000},
            "maxSteps": STEPS,
            "seed": 1,
            "collectiveTimeoutSeconds": 120,
            "dataTimeoutSeconds": 120,
        },
        algorithm={"loss": "grpo", "metrics": "basic"},
        redis={"maxPending": 100_000},
    ).model_copy(update={"checkpoint_dir": str(tmp_path / "checkpoints"), "metrics_port": 0})
    client = redis_server.client()
    trainer = _run_to_the_end(config, redis_server, tmp_path, 240)

    rewards = rollout_rewards(client, config.keys.rollout)
    versions = sorted(rewards)
    assert len(versions) >= STEPS // 2, f"too few weights versions generated with: {versions}"
    first = _mean([rewards[v] for v in versions[:3]])
    last = _mean([rewards[v] for v in versions[-5:]])
    trajectory = {v // DOCUMENTS_PER_STEP: round(rewards[v][0], 3) for v in versions}  # step -> reward
    (tmp_path / "rollout_rewards.json").write_text(json.dumps(trajectory))  # kept for inspection
    assert first < 0.2, f"the random policy should score near 1/14 per digit, got {first:.3f}"
    assert last >= first + 0.4, f"rollout reward did not rise by 0.4: first {first:.3f}, last {last:.3f}; per step {trajectory}"

    # Asynchrony was exercised: most steps trained on documents of older weights (staleness, DESIGN §4). The
    # progress hash carries the last step's metrics; the per-step JSON lines carry every step's.
    steps = json_lines(trainer)
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    reported = json.loads(client.hget(config.keys.progress, "metrics"))
    assert reported["staleness"] == steps[-1]["metrics"]["staleness"]
    stale = [line["metrics"]["staleness"] for line in steps]
    assert sum(value > 0 for value in stale) >= STEPS // 2, f"staleness per step (documents): {stale}"


def _mean(pairs: list[tuple[float, int]]) -> float:
    """Sample-weighted mean of (mean, count) pairs."""
    return sum(m * n for m, n in pairs) / sum(n for _, n in pairs)


SYNC_STEPS = 12


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_max_lag_zero_is_strictly_synchronous(redis_server, tmp_path):
    """DESIGN §6 "Strictly synchronous": with maxLag 0, one replica and a batch that divides documentsPerStep (here two
    batches of 8 per step of 16), every step trains on documents of the weights it started from: staleness 0."""
    config = make_config(
        redis_server,
        rollout={"promptsPerBatch": 2, "samplesPerPrompt": 4, "maxLag": 0, "seed": 1,
                 "task": {"name": "digits-copy", "digits": DIGITS}},
        trainer={"processesPerNode": 2, "batch": {"documentsPerStep": 16, "microBatchTokens": 4096},
                 "optimizer": {"learningRate": 2e-3}, "checkpoint": {"everySteps": 5}, "maxSteps": SYNC_STEPS,
                 "collectiveTimeoutSeconds": 120, "dataTimeoutSeconds": 120},
        algorithm={"loss": "grpo", "metrics": "basic"},
    ).model_copy(update={"checkpoint_dir": str(tmp_path / "checkpoints"), "metrics_port": 0})
    trainer = _run_to_the_end(config, redis_server, tmp_path, 200)
    steps = json_lines(trainer)
    assert [line["step"] for line in steps] == list(range(1, SYNC_STEPS + 1))
    stale = [line["metrics"]["max_staleness"] for line in steps]
    assert stale == [0.0] * SYNC_STEPS, f"max staleness per step (documents): {stale}"
    versions = sorted(rollout_rewards(redis_server.client(), config.keys.rollout))
    assert versions == [16 * step for step in range(len(versions))], versions  # one version per step, none skipped
