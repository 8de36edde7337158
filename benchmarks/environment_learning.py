"""Multi-turn learning (issue 27 item 5): the tiny model learns rljob's toy environment (guess the number,
:mod:`rljob_rollout.environments.guess`) with the settings of examples/rljob-environment-cpu.yaml, over 3 seeds.

Each run is rljob's pipeline as processes over a real Redis (:mod:`rl_pipeline`: a 2-rank trainer under torchrun, one
``python -m rljob_rollout`` and the example's environment server, ``python -m rljob_rollout.environments.serve``,
started from the example's ``server.command`` and ``args`` as the operator would run it, reached by the rollout over
OpenEnv's WebSocket protocol; ``OMP_NUM_THREADS=1``, pinned to ``--cores``), from a random tiny model, with
``trainer.seed`` = ``rollout.seed`` = the seed and the example's ``maxSteps``.

Figures per seed (rewards are episode rewards: 1 when the secret is found within ``maxTurns``, else 0):

* **untrained reward**: the mean reward of the episodes sampled with the initial weights (version 0);
* **untrained turns**: the mean turns per episode over the rollout's first batch of episodes (all sampled with the
  initial weights: the trainer cannot step before it), from the rollout's ``rljob_rollout_episode_turns`` histogram
  on its ``/metrics``;
* **reached at**: the first step whose reward is >= the target, a step's reward being the sample-weighted mean over
  the weights versions of it and the ``--window`` - 1 steps before it (one version's mean is over a few hundred
  episodes and a version that saw few of them is noisy);
* **final reward**: that windowed reward at the last step the run made. A run stops ``--after`` steps after it
  reached the target (the target then holds or not at its end) or at ``maxSteps``.

Targets, every seed: untrained reward < 0.3, untrained turns >= 3, reached within ``maxSteps`` and final reward >= 0.8.
Exit status 0 when every target holds, 1 when one is missed, 2 when the machine was too busy at the start (load
average per core above ``--busy-load``: the figures are printed, not judged) or on an error. The load average is
printed at the start and the end.

The figures go to ``--data`` (JSON: the date, the load averages, the settings, per seed the curve) and the
learning-curve picture to ``--out`` (PNG, matplotlib: the ``benchmark`` extra); ``--replot`` redraws it from ``--data``.

    python benchmarks/environment_learning.py              # 3 seeds: 18 min on 2 cores at load average 1-6
    python benchmarks/environment_learning.py --replot

Write-up and results: docs/environment-learning.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_pipeline as rp  # noqa: E402 - a sibling module

EXAMPLE = rp.REPO / "examples" / "rljob-environment-cpu.yaml"
IMAGES = rp.REPO / "docs" / "images"
UNTRAINED_BELOW = 0.3
"""The untrained policy's mean episode reward must be below this (issue 27 item 5)."""
TRAINED_AT_LEAST = 0.8
"""The trained policy's mean episode reward must reach this (issue 27 item 5)."""
UNTRAINED_TURNS_AT_LEAST = 3.0
"""The untrained policy's mean turns per episode, at least: its episodes are multi-turn."""
TURNS_METRIC = "rljob_rollout_episode_turns"


@dataclass(frozen=True)
class Targets:
    """What every seed must show (module docstring)."""

    untrained_below: float = UNTRAINED_BELOW
    trained_at_least: float = TRAINED_AT_LEAST
    untrained_turns_at_least: float = UNTRAINED_TURNS_AT_LEAST
    window: int = 5


@dataclass(frozen=True)
class SeedResult:
    """One seed's figures (module docstring).

    Attributes:
        seed: the trainer and rollout seed.
        untrained: mean reward of the episodes of the initial weights (NaN when none was read).
        untrained_turns: mean turns per episode of the rollout's first batch (None when its metrics were not read).
        reached_step: the first step whose windowed reward is >= the target, or None.
        final: the windowed reward at ``last_step``.
        last_step: the newest step with a reward.
        max_steps: the run's maxSteps (the steps the target must be reached within).
    """

    seed: int
    untrained: float
    untrained_turns: Optional[float]
    reached_step: Optional[int]
    final: float
    last_step: int
    max_steps: int


def windowed(points: Sequence[rp.Point], step: int, window: int) -> tuple[float, int]:
    """(reward, samples) over the versions of steps ``step - window + 1 .. step``: the sample-weighted mean (NaN and 0
    when they hold no sample)."""
    chosen = [p for p in points if step - window < p.step <= step and p.samples > 0]
    samples = sum(p.samples for p in chosen)
    if not samples:
        return float("nan"), 0
    return sum(p.reward * p.samples for p in chosen) / samples, samples


def first_reached(points: Sequence[rp.Point], level: float, window: int) -> Optional[int]:
    """The first step whose :func:`windowed` reward is >= ``level``, or None."""
    for step in sorted({p.step for p in points}):
        reward, samples = windowed(points, step, window)
        if samples and reward >= level:
            return step
    return None


def evaluate(seed: int, points: Sequence[rp.Point], untrained_turns: Optional[float], max_steps: int,
             targets: Targets) -> SeedResult:
    """A seed's :class:`SeedResult` from its final reward readings (pure)."""
    initial = [p for p in points if p.version == 0]
    untrained = initial[0].reward if initial and initial[0].samples else float("nan")
    last_step = max((p.step for p in points), default=0)
    return SeedResult(seed, untrained, untrained_turns, first_reached(points, targets.trained_at_least, targets.window),
                      windowed(points, last_step, targets.window)[0], last_step, max_steps)


def verdicts(result: SeedResult, targets: Targets) -> list[tuple[str, bool]]:
    """(what, held) for each target of one seed; a NaN or missing figure never holds."""
    turns = result.untrained_turns
    return [
        (f"untrained reward {result.untrained:.3f} < {targets.untrained_below}", result.untrained < targets.untrained_below),
        (f"untrained turns {'-' if turns is None else f'{turns:.2f}'} >= {targets.untrained_turns_at_least}",
         turns is not None and turns >= targets.untrained_turns_at_least),
        (f"reached {targets.trained_at_least} at step {result.reached_step} within {result.max_steps}",
         result.reached_step is not None and result.reached_step <= result.max_steps),
        (f"final reward {result.final:.3f} >= {targets.trained_at_least} (step {result.last_step})",
         result.final >= targets.trained_at_least),
    ]


def exit_status(results: Sequence[SeedResult], seeds: int, targets: Targets, *, busy: bool, failed: bool) -> int:
    """0 when every seed ran and met every target, 2 when the run failed or the machine was ``busy`` at the start (not
    judged), else 1."""
    if failed or busy:
        return 2
    met = len(results) == seeds and all(held for r in results for _, held in verdicts(r, targets))
    return 0 if met else 1


class TurnsWatch:
    """The untrained policy's turns per episode: the mean of the rollout's turns histogram (``_sum`` / ``_count``) at
    the first reading that covers at least ``documents`` episodes (the first batch: all sampled with the initial
    weights)."""

    def __init__(self, work_dir: Path, documents: int) -> None:
        self.work_dir = work_dir
        self.documents = documents
        self.mean: Optional[float] = None
        self.episodes = 0

    def poll(self) -> None:
        if self.mean is not None:
            return
        text = rp.rollout_metrics(self.work_dir)
        if text is None:
            return
        count = rp.metric_value(text, f"{TURNS_METRIC}_count") or 0.0
        if count >= self.documents:
            self.mean = (rp.metric_value(text, f"{TURNS_METRIC}_sum") or 0.0) / count
            self.episodes = int(count)


def run_seed(seed: int, args: argparse.Namespace, targets: Targets, work: Path) -> tuple[SeedResult, rp.PipelineRun]:
    """One seed of the example, stopped ``args.after`` steps after it reached the target."""
    spec = rp.local_spec(rp.example_spec(args.example), seed=seed)
    max_steps = spec["trainer"]["maxSteps"]
    turns = TurnsWatch(work, spec["trainer"]["batch"]["documentsPerStep"])

    def stop(points: list[rp.Point]) -> bool:
        turns.poll()
        reached = first_reached(points, targets.trained_at_least, targets.window)
        return reached is not None and turns.mean is not None and max(p.step for p in points) >= reached + args.after

    run = rp.run_pipeline(spec, work, cores=args.cores, timeout_s=args.timeout, stop_when=stop,
                          echo=lambda line: print(line, flush=True))
    if run.returncode not in (None, 0):
        raise RuntimeError(f"seed {seed}: the trainer exited with {run.returncode}; logs in {work}")
    if run.timed_out:
        raise RuntimeError(f"seed {seed}: not done after {args.timeout:.0f} s; logs in {work}")
    return evaluate(seed, run.points, turns.mean, max_steps, targets), run


def plot(data: dict[str, Any], out: Path) -> None:
    """The windowed episode reward of every seed against the optimizer step, with the two targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = data["window"]
    fig, axes = plt.subplots(figsize=(6.4, 3.6))
    for seed in data["seeds"]:
        points = [rp.Point(v, s, r, n, 0.0) for v, s, r, n in seed["curve"]]
        steps = sorted({p.step for p in points})
        axes.plot(steps, [windowed(points, s, window)[0] for s in steps], linewidth=1.2, label=f"seed {seed['seed']}")
    axes.axhline(data["targets"]["trained_at_least"], color="grey", linestyle="--", linewidth=0.8)
    axes.axhline(data["targets"]["untrained_below"], color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel(f"optimizer step ({data['documents_per_step']} episodes each)")
    axes.set_ylabel(f"episode reward (mean over {window} steps)")
    axes.set_ylim(0, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    fig.suptitle(f"guess the number (0-9), tiny model from random weights, {data['environment']}\n"
                 f"{data['date']}, {len(str(data['cores']).split(','))} CPU cores, load average "
                 f"{data['load_at_start'].split(',')[0]} at the start", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def print_report(results: Sequence[SeedResult], runs: dict[int, float], targets: Targets) -> None:
    print(f"\n| seed | untrained reward | untrained turns | reached {targets.trained_at_least} at step | final reward "
          "(step) | seconds | result |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        missed = [what for what, held in verdicts(r, targets) if not held]
        turns = "-" if r.untrained_turns is None else f"{r.untrained_turns:.2f}"
        print(f"| {r.seed} | {r.untrained:.3f} | {turns} | {r.reached_step if r.reached_step is not None else 'never'} "
              f"| {r.final:.3f} ({r.last_step}) | {runs.get(r.seed, float('nan')):.0f} | "
              f"{'met' if not missed else 'MISSED: ' + '; '.join(missed)} |")
    if results:
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        reached = [r.reached_step for r in results if r.reached_step is not None]
        print(f"mean over {len(results)} seeds: untrained reward {mean([r.untrained for r in results]):.3f} "
              f"(target < {targets.untrained_below}), final reward {mean([r.final for r in results]):.3f} "
              f"(target >= {targets.trained_at_least}), ratio final / untrained "
              f"{mean([r.final for r in results]) / max(mean([r.untrained for r in results]), 1e-9):.1f}"
              + (f", reached at step {min(reached)}-{max(reached)}" if reached else ""))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=rp.positive_int, default=3, help="how many seeds (default 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the job whose spec is run")
    parser.add_argument("--window", type=rp.positive_int, default=5, help="steps a step's reward is the mean over")
    parser.add_argument("--after", type=int, default=10, help="steps run after reaching the target (default 10)")
    parser.add_argument("--cores", type=rp.core_list, default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
                        help="taskset -c list for every process (default: every core this process may use)")
    parser.add_argument("--busy-load", type=float, default=0.5,
                        help="1-minute load average per core at the start above which nothing is judged (exit 2)")
    parser.add_argument("--timeout", type=rp.positive_float, default=1200, help="seconds per seed before it is killed")
    parser.add_argument("--data", type=Path, default=IMAGES / "environment-learning.json")
    parser.add_argument("--out", type=Path, default=IMAGES / "environment-learning.png")
    parser.add_argument("--replot", action="store_true", help="redraw --out from --data, run nothing")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.data.read_text()), args.out)
        return 0
    rp.require_psutil()
    targets = Targets(window=args.window)
    example = rp.example_spec(args.example)
    environment = example["rollout"]["environment"]
    cores = len(rp.parse_cores(args.cores))
    load = os.getloadavg()
    busy = load[0] / cores > args.busy_load
    print(f"environment learning: {args.example.name}, seeds {args.first_seed}-{args.first_seed + args.seeds - 1}, cores {args.cores}, load average "
          f"{rp.load_average()} at the start{' (too busy: not judged)' if busy else ''}", flush=True)
    data: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_at_start": rp.load_average(), "cores": args.cores, "window": targets.window, "targets": asdict(targets),
        "documents_per_step": example["trainer"]["batch"]["documentsPerStep"],
        "environment": "OpenEnv server" if "server" in environment else "in-process", "seeds": []}
    results: list[SeedResult] = []
    seconds: dict[int, float] = {}
    failed = False
    rp.stop_on_signals()
    work_root = Path(tempfile.mkdtemp(prefix="rljob-environment-learning-"))
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            print(f"seed {seed}: load average {rp.load_average()}", flush=True)
            result, run = run_seed(seed, args, targets, work_root / f"seed-{seed}")
            results.append(result)
            seconds[seed] = run.seconds
            data["seeds"].append({**asdict(result), "seconds": round(run.seconds, 1),
                                  "curve": [[p.version, p.step, round(p.reward, 4), p.samples] for p in run.points]})
            print(f"seed {seed}: untrained reward {result.untrained:.3f}, untrained turns {result.untrained_turns}, "
                  f"reached {targets.trained_at_least} at step {result.reached_step}, final reward {result.final:.3f} "
                  f"at step {result.last_step} ({run.seconds:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted")
        failed = True
    except Exception:  # noqa: BLE001 - reported with what was measured
        traceback.print_exc()
        failed = True
    data["load_at_end"] = rp.load_average()
    print_report(results, seconds, targets)
    print(f"load average {data['load_at_end']} at the end")
    if data["seeds"]:
        args.data.parent.mkdir(parents=True, exist_ok=True)
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        plot(data, args.out)
    code = exit_status(results, args.seeds, targets, busy=busy, failed=failed)
    print(f"environment learning: {['every target met', 'a target MISSED', 'not judged (busy machine or error)'][code]}")
    return code


if __name__ == "__main__":
    sys.exit(main())
