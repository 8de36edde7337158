"""Rollout autoscaling on a simulated pipeline (issue 28 item 6, the simulation half): the control law
(:mod:`rljob_operator.autoscale`) against the best fixed replica count, measured in the same run.

Each scenario is a pipeline of :mod:`autoscale_sim` (a trainer of 64-document batches at 8 s a step, rollout replicas of
4 groups of 8 documents in flight, ``maxLag`` 1024, a replica start of 60 s, group times with log-normal noise σ 0.3)
whose group time is set so that the trainer needs a given number of replicas:

- ``short``: 6 needed, the job starts with 1;
- ``over``: 2 needed, the job starts with 10;
- ``fractional``: 5.5 needed (neither 5 nor 6 fits: the count most prone to flapping), starts with 1;
- ``drift``: 3 needed, starts with 3; once a third of the documents to the reward are trained, groups take twice as long
  (answers grow as the policy learns), so 6 are needed from then on.

The policy: 1 to 16 replicas, the law's defaults (target data-wait share 5%, band 5%, held threshold 10%, at most 4
replicas a step) and the cooldown :func:`autoscale_sim.timing` gives (a start plus a 32-step window plus a tick: 380 s).
The reward is a function of trained documents (:class:`autoscale_sim.RewardCurve`, 0.1 rising to 1 with scale 40,000
documents: 0.9 after ~88,000 documents, ~3 h at the trainer's full rate), so the time to 0.9 measures throughput.

Figures, per scenario and seed: **time to balance** (the change after which the count stays in the counts the law
holds without noise, :func:`autoscale_sim.balanced_counts`; for ``drift`` also after the slowdown, from its start) and
the **decisions** that took; all **changes**; **reversals**, consecutive changes in opposite directions within 3
cooldowns, split into transient ones (an overshoot corrected before balance) and steady-state ones (after balance);
**time to a reward of 0.9** with the law, against every fixed count from 1 to 16 with the same seed, and the ratio to
the best (fastest) of them; replica-hours spent by the law, the best fixed count and the leanest fixed count (the fewest
replicas within 2% of the best time), for information.

Targets: every run balanced within 5 decisions (each phase of ``drift``), no steady-state reversal, and time to 0.9
within 10% of the best fixed count.

    python benchmarks/autoscale.py                 # 4 scenarios × 3 seeds (a few seconds)
    python benchmarks/autoscale.py --seeds 10 --scenarios short,drift

Exit status 0 when every target holds, 1 when one is missed. The cluster half of item 6 (the CPU example made
rollout-bound on the local cluster, ≥ 3 seeds: balance reached and no reversals) is benchmarks/autoscale_cluster.py.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import autoscale_sim as sim  # noqa: E402 - a sibling module
from rljob_operator.autoscale import Policy  # noqa: E402

REWARD = 0.9
CURVE = sim.RewardCurve(start=0.1, scale=40_000.0)
MIN_REPLICAS, MAX_REPLICAS = 1, 16
TARGET_DECISIONS = 5
TARGET_RATIO = 1.10
"""The law's time to 0.9 over the best fixed count's must be at most this."""
COOLDOWNS_FOR_REVERSAL = 3
LEAN = 1.02
"""The leanest fixed count: the fewest replicas within 2% of the best fixed count's time (information)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    pipeline: sim.Pipeline
    start: int


def scenarios() -> dict[str, Scenario]:
    drift_after = int(CURVE.documents_to(REWARD) / 3)
    return {s.name: s for s in (
        Scenario("short", sim.Pipeline.needing(6.0), 1),
        Scenario("over", sim.Pipeline.needing(2.0), 10),
        Scenario("fractional", sim.Pipeline.needing(5.5), 1),
        Scenario("drift", sim.Pipeline.needing(3.0, slowdown_after_documents=drift_after, slowdown=2.0), 3),
    )}


@dataclass(frozen=True)
class Outcome:
    scenario: str
    seed: int
    balance: list[Optional[tuple[float, int]]]  # per phase: (time to balance from the phase's start, decisions)
    changes: int
    transient_reversals: int
    steady_reversals: int
    auto_s: Optional[float]
    auto_replica_h: float
    best_count: int
    best_s: float
    best_replica_h: float
    lean_count: int
    lean_replica_h: float

    @property
    def ratio(self) -> Optional[float]:
        return None if self.auto_s is None else self.auto_s / self.best_s

    def met(self) -> bool:
        return (all(b is not None and b[1] <= TARGET_DECISIONS for b in self.balance) and self.steady_reversals == 0
                and self.ratio is not None and self.ratio <= TARGET_RATIO)


def measure(scenario: Scenario, seed: int) -> Outcome:
    p = scenario.pipeline
    tick_s, window_s, cooldown_s = sim.timing(p)
    policy = Policy(min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS, cooldown_s=cooldown_s)
    until = CURVE.documents_to(REWARD)
    horizon = 100 * 3600.0
    run = sim.simulate(p, scenario.start, policy, seed, tick_s, window_s, horizon, until)
    phases = [(0.0, run.slowed_at_s, sim.balanced_counts(p, policy))]
    if run.slowed_at_s is not None:
        phases.append((run.slowed_at_s, None, sim.balanced_counts(p, policy, slowed=True)))
    balance, steady_from = [], []
    for start, end, counts in phases:
        entered = sim.balanced_after(run, counts, start, end)
        balance.append(None if entered is None else (entered[0] - start, entered[1]))
        steady_from.append((math.inf if entered is None else entered[0], math.inf if end is None else end))
    pairs = sim.reversals(run, COOLDOWNS_FOR_REVERSAL * cooldown_s)
    steady = sum(1 for a, _ in pairs if any(lo < a.end_s < hi for lo, hi in steady_from))
    fixed = {n: sim.simulate(p, n, None, seed, tick_s, window_s, horizon, until) for n in range(MIN_REPLICAS,
                                                                                               MAX_REPLICAS + 1)}
    reached = [n for n in fixed if fixed[n].reached_s is not None]
    best = min(reached, key=lambda n: fixed[n].reached_s)
    lean = min(n for n in reached if fixed[n].reached_s <= LEAN * fixed[best].reached_s)
    return Outcome(scenario.name, seed, balance, len(run.changes), len(pairs) - steady, steady, run.reached_s,
                   run.replica_seconds / 3600, best, fixed[best].reached_s, fixed[best].replica_seconds / 3600,
                   lean, fixed[lean].replica_seconds / 3600)


def fmt_balance(b: Optional[tuple[float, int]]) -> str:
    return "never" if b is None else f"{b[0]:.0f} s / {b[1]}"


def report(outcomes: list[Outcome], pipelines: dict[str, Scenario]) -> bool:
    print("\n| scenario | seed | needed | start | balance: s / decisions | changes | reversals transient / steady "
          "| law to 0.9 h | best fixed | fixed to 0.9 h | ratio | replica-h law / best fixed / leanest fixed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for o in outcomes:
        s = pipelines[o.scenario]
        needed = f"{s.pipeline.needed():g}" + (f" → {s.pipeline.needed(True):g}" if len(o.balance) > 1 else "")
        auto = "not reached" if o.auto_s is None else f"{o.auto_s / 3600:.3f}"
        ratio = "-" if o.ratio is None else f"{o.ratio:.3f}"
        print(f"| {o.scenario} | {o.seed} | {needed} | {s.start} | {', '.join(fmt_balance(b) for b in o.balance)} "
              f"| {o.changes} | {o.transient_reversals} / {o.steady_reversals} | {auto} | {o.best_count} "
              f"| {o.best_s / 3600:.3f} | {ratio} | {o.auto_replica_h:.1f} / {o.best_replica_h:.1f} / "
              f"{o.lean_replica_h:.1f} ({o.lean_count}) |")
    decisions = [b[1] for o in outcomes for b in o.balance if b is not None]
    unbalanced = sum(1 for o in outcomes for b in o.balance if b is None)
    ratios = [o.ratio for o in outcomes if o.ratio is not None]
    seconds = [b[0] for o in outcomes for b in o.balance if b is not None]
    steady = sum(o.steady_reversals for o in outcomes)
    print(f"\ntime to balance: median {statistics.median(seconds):.0f} s, worst {max(seconds):.0f} s; decisions: "
          f"median {statistics.median(decisions):g}, worst {max(decisions)}; phases never balanced: {unbalanced}")
    print(f"reversals within {COOLDOWNS_FOR_REVERSAL} cooldowns: transient "
          f"{sum(o.transient_reversals for o in outcomes)}, steady-state {steady}")
    if ratios:
        print(f"time to {REWARD} with the law / best fixed count: median {statistics.median(ratios):.3f}, "
              f"worst {max(ratios):.3f}")
    targets = [
        (f"balanced within {TARGET_DECISIONS} decisions", unbalanced == 0 and max(decisions) <= TARGET_DECISIONS),
        ("no steady-state reversal", steady == 0),
        (f"time to {REWARD} within {TARGET_RATIO - 1:.0%} of the best fixed count",
         len(ratios) == len(outcomes) and max(ratios) <= TARGET_RATIO),
    ]
    for what, ok in targets:
        print(f"target {what}: {'met' if ok else 'MISSED'}")
    return all(ok for _, ok in targets)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 per scenario (default 3)")
    parser.add_argument("--scenarios", default=",".join(scenarios()), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    known = scenarios()
    chosen = [name for name in args.scenarios.split(",") if name]
    unknown = sorted(set(chosen) - set(known))
    if unknown or args.seeds < 1:
        parser.error(f"unknown scenarios {unknown} (known: {sorted(known)})" if unknown else "--seeds must be ≥ 1")
    started = time.monotonic()
    p = sim.Pipeline()
    tick_s, window_s, cooldown_s = sim.timing(p)
    print(f"autoscale on the simulation: scenarios {', '.join(chosen)}, seeds 0-{args.seeds - 1}; replicas "
          f"{MIN_REPLICAS}-{MAX_REPLICAS}; window {window_s:.0f} s ({sim.WINDOW_STEPS} steps), tick {tick_s:.0f} s, "
          f"cooldown {cooldown_s:.0f} s; reward {REWARD} after {CURVE.documents_to(REWARD):.0f} trained documents")
    outcomes = [measure(known[name], seed) for name in chosen for seed in range(args.seeds)]
    ok = report(outcomes, known)
    print(f"simulated in {time.monotonic() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
