"""Learning robustness: how often the CPU example learns its task and keeps it, over many seeds, with 1 and with 2
rollout replicas.

Each run is rljob's pipeline as processes over a real Redis (:mod:`rl_pipeline`: a 2-rank trainer under torchrun and
``replicas`` × ``python -m rljob_rollout``, ``OMP_NUM_THREADS=1``, pinned with ``taskset`` to ``--cores``) with the
settings of examples/rljob-cpu.yaml, ``trainer.seed`` = ``rollout.seed`` = the seed, and ``maxSteps`` = ``--through``.
The rollout reward of every weights version (the mean over every sample generated with it, all replicas) is polled
from the rollout hash. A run **passes** when some version of step <= ``--by-step`` (150) has reward >= ``--reach``
(0.95), and every version after the first such one up to step ``--through`` (300) has reward >= ``--hold`` (0.9).
A run stops as soon as its verdict is known (a fall below ``--hold``, or step ``--by-step`` passed without reaching),
so failing runs are shorter.

Per setting it prints how many runs passed, with the Wilson score 95% interval of the pass rate (Wilson 1927; the
interval of :func:`wilson_interval`), and the failures' reasons. Target: at least 90% of the seeds (18/20) in each
setting; exit status 0 only then, 1 otherwise, 2 on an error, 130 when interrupted.

Resumable: each run's record is appended to ``--results`` (JSON lines, fsynced) as it ends; run the same command
again and the runs already recorded are skipped, so the sweep can be stopped (Ctrl-C, a reboot) and continued.
A half-written last line is ignored and that run done again.

    python benchmarks/learning_robustness.py --results ~/robustness.jsonl          # 20 seeds x {1, 2}: ~1.5 h on 2 idle cores
    python benchmarks/learning_robustness.py --seeds 2 --through 30 --by-step 25 --reach 0.2 --hold 0.1   # smoke

It runs outside CI. Write-up and results: docs/learning-robustness.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_pipeline as rp  # noqa: E402 - a sibling module

TARGET_RATE = 0.9
"""Passing runs per setting, at least (18 of 20)."""


def wilson_interval(passed: int, runs: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (E. B. Wilson 1927, JASA 22:209): with p = passed / runs,
    centre (p + z²/2n) / (1 + z²/n), half-width z·sqrt(p(1 − p)/n + z²/4n²) / (1 + z²/n); z = 1.96 for 95%.
    Returns (low, high), clipped to [0, 1].

    Raises:
        ValueError: ``runs`` < 1, or ``passed`` outside [0, runs].
    """
    if runs < 1 or not 0 <= passed <= runs:
        raise ValueError(f"wilson_interval: need 0 <= passed <= runs and runs >= 1, got {passed}/{runs}")
    p, n, z2 = passed / runs, runs, z * z
    denominator = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Criterion:
    """What a passing run does: reward >= ``reach`` at some step <= ``by_step``, then never below ``hold`` through
    step ``through``."""

    reach: float = 0.95
    by_step: int = 150
    hold: float = 0.9
    through: int = 300

    def __post_init__(self) -> None:
        if not 0 < self.by_step <= self.through:
            raise ValueError(f"need 0 < by_step <= through, got by_step {self.by_step}, through {self.through}")


@dataclass(frozen=True)
class Verdict:
    """``passed`` is None while undecided. ``reached_step``: the first step with reward >= reach (None if none);
    ``lowest_after``: the lowest reward after it (through ``through``); ``reason``: why it failed, or ""."""

    passed: Optional[bool]
    reached_step: Optional[int]
    lowest_after: Optional[float]
    reason: str


def judge(points: Sequence[rp.Point], criterion: Criterion, *, finished: bool = False) -> Verdict:
    """The verdict of a run from its points so far (pure; module docstring). Versions are taken in step order; a
    failure is final as soon as it shows, a pass only once a version of step >= ``through`` was seen or the run
    ``finished`` (its trainer reached maxSteps = ``through``: the rollout may not have sampled the last weights)."""
    ordered = sorted(points, key=lambda p: p.version)
    last_step = ordered[-1].step if ordered else -1
    reached = next((p for p in ordered if p.step <= criterion.by_step and p.reward >= criterion.reach), None)
    if reached is None:
        if last_step > criterion.by_step or finished:
            best = max((p.reward for p in ordered if p.step <= criterion.by_step), default=float("nan"))
            return Verdict(False, None, None, f"no reward >= {criterion.reach} by step {criterion.by_step} "
                                                f"(best {best:.3f})")
        return Verdict(None, None, None, "")
    after = [p for p in ordered if reached.version < p.version and p.step <= criterion.through]
    lowest = min(after, key=lambda p: p.reward, default=None)
    if lowest is not None and lowest.reward < criterion.hold:
        return Verdict(False, reached.step, lowest.reward,
                       f"fell to {lowest.reward:.3f} at step {lowest.step} after reaching {criterion.reach} at step "
                       f"{reached.step}")
    low = lowest.reward if lowest else None
    if last_step >= criterion.through or finished:
        return Verdict(True, reached.step, low, "")
    return Verdict(None, reached.step, low, "")


@dataclass(frozen=True)
class SettingResult:
    replicas: int
    runs: int
    passed: int
    interval: tuple[float, float]
    required: int
    failures: list[str]

    @property
    def met(self) -> bool:
        return self.runs > 0 and self.passed >= self.required


def tally(records: Sequence[dict[str, Any]], replicas: int, seeds: int) -> SettingResult:
    """Pass count of one setting over seeds 0..seeds-1 from the result records (``replicas``, ``seed``, ``passed``,
    ``reason``); the required count is ceil(:data:`TARGET_RATE` × seeds)."""
    mine = sorted((r for r in records if r["replicas"] == replicas and r["seed"] < seeds), key=lambda r: r["seed"])
    passed = sum(1 for r in mine if r["passed"])
    interval = wilson_interval(passed, len(mine)) if mine else (float("nan"), float("nan"))
    failures = [f"seed {r['seed']}: {r['reason']}" for r in mine if not r["passed"]]
    return SettingResult(replicas, len(mine), passed, interval, math.ceil(TARGET_RATE * seeds - 1e-9), failures)


def run_one(seed: int, replicas: int, criterion: Criterion, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec = rp.local_spec(rp.example_spec(), seed=seed, replicas=replicas, max_steps=criterion.through)
    run = rp.run_pipeline(spec, work, cores=args.cores, timeout_s=args.timeout,
                          stop_when=lambda points: judge(points, criterion).passed is False)
    if run.returncode not in (None, 0):
        raise RuntimeError(f"replicas {replicas} seed {seed}: the trainer exited with {run.returncode}; logs in {work}")
    verdict = judge(run.points, criterion, finished=run.returncode == 0)
    if verdict.passed is None:  # timed out
        verdict = Verdict(False, verdict.reached_step, verdict.lowest_after,
                          f"undecided after {run.seconds:.0f} s at step {max((p.step for p in run.points), default=0)}")
    return {"replicas": replicas, "seed": seed, "passed": verdict.passed, "reason": verdict.reason,
            "reached_step": verdict.reached_step, "lowest_after": verdict.lowest_after,
            "steps": max((p.step for p in run.points), default=0), "seconds": round(run.seconds, 1),
            "curve": [[p.step, round(p.reward, 4)] for p in run.points]}


def print_report(records: Sequence[dict[str, Any]], settings: Sequence[int], seeds: int, criterion: Criterion) -> bool:
    print(f"\nreach {criterion.reach} by step {criterion.by_step}, stay >= {criterion.hold} through step "
          f"{criterion.through}; target >= {TARGET_RATE:.0%} of the seeds per setting")
    print("| rollout replicas | passed | rate | Wilson 95% | target | result |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    results = [tally(records, replicas, seeds) for replicas in settings]
    for r in results:
        complete = r.runs == seeds
        ok &= r.met and complete
        status = ("met" if r.met else "missed") if complete else f"incomplete ({r.runs}/{seeds} runs)"
        rate, interval = (f"{r.passed / r.runs:.0%}", f"{r.interval[0]:.0%}-{r.interval[1]:.0%}") if r.runs else ("-", "-")
        print(f"| {r.replicas} | {r.passed}/{r.runs} | {rate} | {interval} | >= {r.required}/{seeds} | {status} |")
    for r in results:
        for line in r.failures:
            print(f"  replicas {r.replicas}, {line}")
    return ok


def replica_counts(text: str) -> list[int]:
    """An argparse type: comma-separated rollout replica counts, each >= 1 (0 would run a trainer-only job that nothing
    feeds: the run would wait for its timeout)."""
    try:
        counts = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers such as 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every count must be >= 1 (0 replicas would leave the trainer unfed), "
                                         f"got {text!r}")
    return counts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=rp.positive_int, default=20, help="seeds 0..N-1 per setting (default 20)")
    parser.add_argument("--replicas", type=replica_counts, default=[1, 2],
                        help="rollout replica counts, comma-separated, each >= 1 (default 1,2)")
    parser.add_argument("--reach", type=rp.reward_level, default=0.95, help="reward to reach, in (0, 1] (default 0.95)")
    parser.add_argument("--by-step", type=rp.positive_int, default=150, help="step to reach it by (default 150)")
    parser.add_argument("--hold", type=rp.reward_level, default=0.9,
                        help="reward to stay at or above after reaching, in (0, 1] (default 0.9)")
    parser.add_argument("--through", type=rp.positive_int, default=300,
                        help="last step judged, the runs' maxSteps; at least --by-step (default 300)")
    parser.add_argument("--results", type=Path, default=Path("learning_robustness.jsonl"),
                        help="JSON lines, one per finished run; rerun with the same file to continue")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep each run's logs here (default: a temp dir)")
    parser.add_argument("--cores", type=rp.core_list, default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
                        help="taskset -c list for every process (default: every core this process may use)")
    parser.add_argument("--timeout", type=rp.positive_float, default=3600, help="seconds per run before it is killed")
    args = parser.parse_args(argv)
    if args.by_step > args.through:
        parser.error(f"--by-step {args.by_step} is after --through {args.through}: the step to reach --reach by must "
                     "be within the judged run")
    rp.require_psutil()
    criterion = Criterion(args.reach, args.by_step, args.hold, args.through)
    settings = args.replicas
    results = rp.ResultFile(args.results)
    prefix = f"{criterion.reach}/{criterion.by_step}/{criterion.hold}/{criterion.through}"
    work_root = args.work_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "rljob-learning-robustness"
    print(f"learning robustness: seeds 0-{args.seeds - 1} x replicas {settings}, cores {args.cores}, load average "
          f"{rp.load_average()}, results {results.path}", flush=True)
    code = 0
    rp.stop_on_signals()
    try:
        for seed in range(args.seeds):  # seed-major: an interrupted sweep has both settings up to the same seed
            for replicas in settings:
                key = f"{prefix}/{replicas}/{seed}"
                if key in results.records():
                    continue
                load = rp.load_average()
                started = time.monotonic()
                record = run_one(seed, replicas, criterion, args, work_root / f"r{replicas}-s{seed}")
                results.add(key, {**record, "load": load})
                print(f"replicas {replicas} seed {seed}: {'passed' if record['passed'] else 'FAILED ' + record['reason']}"
                      f" (reached at step {record['reached_step']}, {time.monotonic() - started:.0f} s, load {load})",
                      flush=True)
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to continue")
        code = 130
    except Exception:  # noqa: BLE001 - reported with what was measured
        traceback.print_exc()
        code = 2
    records = [r for k, r in results.records().items() if k.startswith(prefix + "/")]
    ok = print_report(records, settings, args.seeds, criterion)
    print(f"load average at the end: {rp.load_average()}")
    return code or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
