"""The trainer's device check (trainer_image/device_check_trainer.py) in its CPU dry run: the script a GPU machine
runs must pass here on gloo, with its own redis-server or with the one ``--redis-url`` names, and must say what to
install when redis-server is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "trainer_image" / "device_check_trainer.py"
CHECKS = [
    "grpo_loss_cpu_matches_cpu",
    "gspo_loss_cpu_matches_cpu",
    "step_metrics_gloo_matches_cpu",
    "step_metrics_hand_values",
    "trainer_exit_0",
    "steps_completed",
    "loss_finite_and_matches_reference",
    "metrics_reward",
    "metrics_staleness",
    "checkpoint_committed",
    "weights_ready_published",
    "trainer_ran_on_cpu",
    "progress_hash_advanced",
    "weights_trained_and_exported",
]


def run_check(*args: str, path: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)


def verdicts(stdout: str) -> dict[str, str]:
    """check name -> PASS/FAIL, from the script's ``PASS name: detail`` lines."""
    found = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASS", "FAIL"):
            found[rest.split(":", 1)[0]] = word
    return found


def test_dry_run_passes_every_check_with_its_own_redis():
    result = run_check("--dry-run-cpu")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-6000:]}"
    assert verdicts(result.stdout) == dict.fromkeys(CHECKS, "PASS"), result.stdout
    assert f"device_check_trainer: PASSED ({len(CHECKS)}/{len(CHECKS)} checks" in result.stdout


def test_dry_run_on_a_shared_redis_uses_its_own_keys_and_deletes_them(redis_server):
    client = redis_server.client()
    client.set("someone-else", "kept")
    url = f"redis://:{redis_server.password}@{redis_server.host}:{redis_server.port}/0"
    result = run_check("--dry-run-cpu", "--redis-url", url)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-6000:]}"
    assert verdicts(result.stdout) == dict.fromkeys(CHECKS, "PASS"), result.stdout
    assert client.keys("*") == [b"someone-else"]


def test_missing_redis_server_names_the_package(tmp_path):
    result = run_check("--dry-run-cpu", path=str(tmp_path), timeout=120)  # a PATH without redis-server
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr[-3000:]}"
    assert verdicts(result.stdout) == {"setup": "FAIL"}, result.stdout
    assert "redis-server is not on PATH: install it (apt-get install redis-server) or pass --redis-url" in result.stdout
