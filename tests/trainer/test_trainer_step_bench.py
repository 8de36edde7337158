"""The trainer-step benchmark (benchmarks/trainer_step.py): its case names, timed windows and target rule, the device
check's arguments (benchmarks/device/trainer_step_gpu.py), and a ``--quick`` run that prints every table."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(BENCHMARKS))
bench = _load("trainer_step", BENCHMARKS / "trainer_step.py")
check = _load("trainer_step_gpu", BENCHMARKS / "device" / "trainer_step_gpu.py")


def test_case_names():
    workload, strategy, ranks = bench.parse_case("example-fsdp-2")
    assert (workload.documents, workload.length, strategy, ranks) == (512, 10, "fsdp", 2)
    assert bench.parse_case("gpu150m-ddp-1")[0].model == "150m"
    with pytest.raises(ValueError, match="expected"):
        bench.parse_case("example-zero-2")


def test_the_window_leaves_out_warmup_and_the_final_step():
    stamps = [1.0, 2.0, 4.0, 7.0, 11.0, 100.0]  # ends of steps 1..6; step 6 is rljob's final, checkpointing one
    assert bench.window(stamps, warmup=2, steps=3) == [2.0, 3.0, 4.0]  # steps 3, 4 and 5
    assert bench.window(stamps, warmup=1, steps=2) == [1.0, 2.0]  # steps 2 and 3


def figures(*rounds):
    return bench.CaseFigures("x", 1000, list(rounds), [(r["a"],) for r in rounds], {})


def test_targets_are_ratios_for_long_steps_and_a_fixed_cost_for_short_ones():
    long = figures({"a": 100.0, "b": 110.0, "c0": 200.0, "c": 240.0})
    assert [ok for _, ok, _ in long.verdicts()] == [True, False]  # 100/110 = 90.9% >= 90%; 200/240 = 83.3% < 85%
    short = figures({"a": 20.0, "b": 36.0, "c0": 30.0, "c": 44.0})
    assert [ok for _, ok, _ in short.verdicts()] == [False, True]  # +16 ms > 15 ms; +14 ms <= 15 ms
    assert figures({"a": 20.0}).verdicts() == []


def test_the_verdict_takes_the_median_round_each_against_its_own_bare_blocks():
    # Round 2's bare step ran slow (a noisy neighbour): its ratio is an outlier, as round 3's on the other side.
    rounds = figures({"a": 60.0, "b": 65.0}, {"a": 80.0, "b": 66.0}, {"a": 60.0, "b": 75.0})
    assert rounds.ratios("b", "a") == pytest.approx([60 / 65, 80 / 66, 60 / 75])
    assert rounds.ms == {"a": 60.0, "b": 66.0}  # medians per mode, for the table
    ((what, ok, how),) = rounds.verdicts()
    assert ok and "92.3% of (a)'s tokens/s (median of 3 rounds)" in how
    missed = figures({"a": 60.0, "b": 70.0}, {"a": 60.0, "b": 65.0}, {"a": 60.0, "b": 68.0})
    assert [ok for _, ok, _ in missed.verdicts()] == [False]  # median 60/68 = 88.2%


def test_device_check_arguments():
    assert check.trainer_step_argv(check.parse_args([])) == ["--modes", "a,b", "--cases", check.CASES]
    assert check.trainer_step_argv(check.parse_args(["--dry-run-cpu", "--steps", "3"])) == [
        "--modes", "a,b", "--cases", "example-ddp-1", "--steps", "3", "--quick"]


def test_quick_run_prints_every_table():
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, str(BENCHMARKS / "trainer_step.py"), "--quick"], env=environment,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode in (0, 1, 2), f"{result.stdout}\n{result.stderr[-6000:]}"  # 2: a busy machine, not judged
    out = result.stdout
    assert "ERROR" not in out, f"{out}\n{result.stderr[-6000:]}"
    assert "| example-ddp-1 | " in out and "tok/s" in out, out
    assert "example-ddp-1: where the time goes" in out, out
    for label, _, _ in bench.phase_rows():
        assert f"| {label} | " in out, (label, out)
    assert "target (b) vs (a)" in out and "target (c) vs (c0)" in out, out
    assert "load average" in out and out.count("one core's speed: fastest") == 2, out  # at the start and the end


def test_steadiness_swing_is_the_90th_percentile_over_the_fastest_chunk():
    rp = sys.modules["rl_pipeline"]  # loaded by the benchmark's import
    steady = rp.cpu_steadiness(chunks=10, iterations=1000)
    assert 0 < steady.fastest_ms <= steady.median_ms <= steady.p90_ms and steady.swing >= 1.0
    assert rp.Steadiness(25.0, 40.0, 50.0).swing == 2.0
    assert "fastest 25.0 ms, median 40.0, p90 50.0 per chunk (swing 2.00)" in str(rp.Steadiness(25.0, 40.0, 50.0))
