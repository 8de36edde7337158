"""The learning test (DESIGN §10): one CPU rollout worker feeding a 2-rank trainer over real Redis learns the
digit-copy task, so the whole loop — task, rewards, advantages, log-probabilities, version tagging, weight
transfer, loss — has the right sign.

Processes: ``torchrun --nproc-per-node=2 -m rljob_trainer.train`` (2 gloo ranks) and
``python -m rljob_trainer.rollout`` (the pod entry point), both reading one config file, fixed seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from rollout_harness import TOY, make_config
from rljob_trainer.rollout.writer import rollout_rewards

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from train_harness import REPO, Torchrun  # noqa: E402 - the trainer tests' torchrun launcher

STEPS = 150
DOCUMENTS_PER_STEP = 128  # 16 prompts x 8 samples, as DESIGN §10


def _rollout_process(config_path: Path, password: str, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, RLJOB_CONFIG=str(config_path), REDIS_PASSWORD=password, RLJOB_REPLICA_INDEX="0",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "api"), str(REPO / "trainer_image"), env.get("PYTHONPATH", "")])
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "rljob_trainer.rollout"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rollout_reward_learns(redis_server, tmp_path):
    config = make_config(
        redis_server,
        tiny=TOY,
        rollout={"promptsPerBatch": 16, "samplesPerPrompt": 8, "maxLag": DOCUMENTS_PER_STEP, "seed": 3,
                 "sampling": {"temperature": 1.0, "topP": 1.0}, "task": {"name": "digits-copy", "digits": 2}},
        trainer={
            "processesPerNode": 2,
            "batch": {"documentsPerStep": DOCUMENTS_PER_STEP, "microBatchTokens": 2048},
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
    config_path = tmp_path / "config.json"
    config_path.write_text(config.to_json())
    client = redis_server.client()

    trainer = Torchrun(config_path, 2, free_port(), redis_server.password, tmp_path, "trainer")
    rollout = _rollout_process(config_path, redis_server.password, tmp_path / "rollout.log")
    try:
        assert trainer.wait(360) == 0, trainer.logs()
        assert rollout.wait(60) == 0, (tmp_path / "rollout.log").read_text()[-4000:]
    finally:
        for process in (rollout, trainer):
            if process is trainer:
                if trainer.process.poll() is None:
                    trainer.kill()
            elif process.poll() is None:
                process.kill()
                process.wait(10)

    rewards = rollout_rewards(client, config.keys.rollout)
    versions = sorted(rewards)
    assert len(versions) >= STEPS // 2, f"too few weights versions generated with: {versions}"
    first = _mean([rewards[v] for v in versions[:3]])
    last = _mean([rewards[v] for v in versions[-5:]])
    trajectory = {v: round(rewards[v][0], 3) for v in versions}
    assert last >= first + 0.4, f"rollout reward did not rise by 0.4: first {first:.3f}, last {last:.3f}; per version {trajectory}"


def _mean(pairs: list[tuple[float, int]]) -> float:
    """Sample-weighted mean of (mean, count) pairs."""
    return sum(m * n for m, n in pairs) / sum(n for _, n in pairs)
