"""The learning curves of docs/tasks.md: the CPU example's digits-copy task and the harder digits-sort task, each learned by
rljob's real pipeline (:mod:`rl_pipeline`: a 2-rank trainer under torchrun and one ``python -m rljob_rollout`` over a
real Redis, ``OMP_NUM_THREADS=1``, pinned to ``--cores``), from a random tiny model.

Runs (one seed each; the settings of examples/rljob-cpu.yaml, with these changes):

* ``digits-copy``: none (100 steps);
* ``digits-sort``: ``rollout.task.name: digits-sort``, ``trainer.optimizer.learningRate: 1e-3`` (at the example's 2e-3
  the policy turns deterministic at ~0.7 and stays there: it emits the smallest digit, then repeats digits), 300 steps.

The rollout reward of every weights version (mean over the batch sampled with it) is plotted against the optimizer
step and against the wall-clock seconds since the first scored batch. The figures go to ``--data`` (JSON, with the
date, the load average and the settings) and the picture to ``--out`` (PNG, matplotlib: the ``benchmark`` extra).
``--replot`` redraws the picture from ``--data`` without running anything.

    python benchmarks/learning_curve.py                  # ≈ 3 min on 2 idle cores, 11 min at load average 11-14
    python benchmarks/learning_curve.py --replot
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_pipeline as rp  # noqa: E402 - a sibling module

TASKS: dict[str, dict[str, Any]] = {
    "digits-copy": {"max_steps": 100, "overrides": {}},
    "digits-sort": {"max_steps": 300, "overrides": {"rollout": {"task": {"name": "digits-sort"}},
                                                     "trainer": {"optimizer": {"learningRate": 1e-3}}}},
}
IMAGES = rp.REPO / "docs" / "images"


def run(seed: int, cores: Optional[str], work: Path) -> dict[str, Any]:
    """Run every task of :data:`TASKS` once; returns the data file's content."""
    data: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "load_at_start": rp.load_average(), "cores": cores, "seed": seed, "tasks": {}}
    for name, settings in TASKS.items():
        spec = rp.local_spec(rp.example_spec(), seed=seed, max_steps=settings["max_steps"],
                             overrides=settings["overrides"])
        print(f"{name}: {settings['max_steps']} steps, load average {rp.load_average()}", flush=True)
        result = rp.run_pipeline(spec, work / name, cores=cores, echo=lambda line: print(line, flush=True))
        if result.returncode != 0:
            raise SystemExit(f"{name}: the trainer exited with {result.returncode}; logs in {work / name}")
        first = min(p.seconds for p in result.points)
        data["tasks"][name] = {
            "overrides": settings["overrides"], "max_steps": settings["max_steps"], "seconds": round(result.seconds, 1),
            "curve": [[p.step, round(p.reward, 4), round(p.seconds - first, 2)] for p in result.points]}
        last = result.points[-5:]
        print(f"{name}: {result.seconds:.0f} s, rollout reward over the last 5 versions "
              f"{sum(p.reward for p in last) / len(last):.3f}", flush=True)
    data["load_at_end"] = rp.load_average()
    return data


def plot(data: dict[str, Any], out: Path) -> None:
    """Two panels: rollout reward against the optimizer step and against seconds since the first scored batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    example_rate = rp.example_spec()["trainer"]["optimizer"]["learningRate"]
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for name, task in data["tasks"].items():
        steps, rewards, seconds = zip(*task["curve"])
        rate = task["overrides"].get("trainer", {}).get("optimizer", {}).get("learningRate", example_rate)
        label = f"{name} (lr {rate:g})"
        by_step.plot(steps, rewards, label=label, linewidth=1.2)
        by_time.plot(seconds, rewards, label=label, linewidth=1.2)
    by_step.set_xlabel("optimizer step (512 documents each)")
    by_time.set_xlabel("seconds since the first scored batch")
    by_step.set_ylabel("rollout reward")
    for axes in (by_step, by_time):
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
    by_step.legend(loc="lower right")
    fig.suptitle(f"tiny model from random weights, 2 trainer ranks + 1 rollout worker on {len(str(data['cores']).split(','))} "
                 f"CPU cores ({data['date']}, load average {data['load_at_start'].split(',')[0]})", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    parser.add_argument("--data", type=Path, default=IMAGES / "learning-curves.json")
    parser.add_argument("--out", type=Path, default=IMAGES / "learning-curves.png")
    parser.add_argument("--replot", action="store_true", help="redraw --out from --data, run nothing")
    args = parser.parse_args(argv)
    if args.replot:
        data = json.loads(args.data.read_text())
    else:
        data = run(args.seed, args.cores, Path(tempfile.mkdtemp(prefix="rljob-learning-curve-")))
        args.data.parent.mkdir(parents=True, exist_ok=True)
        args.data.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
