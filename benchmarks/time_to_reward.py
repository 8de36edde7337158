"""Time to reward: what streaming (asynchronous) RL buys over synchronous RL, and where rljob stands against TRL.

Three variants learn the same task with the same tiny model, batch, samples per prompt, learning rate and seeds,
every process with ``OMP_NUM_THREADS=1`` and pinned to the same cores (``taskset -c``):

a. ``streaming`` — rljob's pipeline as processes over a real Redis (:mod:`rl_pipeline`: a 2-rank trainer under
   torchrun and one ``python -m rljob_rollout``), with the CPU example's settings (examples/rljob-cpu.yaml: maxLag
   1024 documents, two steps ahead), so the rollout generates while the trainer trains;
b. ``synchronous`` — the same with ``rollout.maxLag: 0``: the worker starts a batch only when every document
   written before has been trained, and it has the weights of that step by then (the trainer publishes them before
   it reports the step), so every batch is generated with the latest weights while the trainer waits, and
   every step trains on staleness 0 (DESIGN §6 "Strictly synchronous"); the benchmark prints the largest staleness
   the trainer reported to show it;
c. ``trl`` — TRL's ``GRPOTrainer`` (benchmarks/trl_grpo.py, the ``benchmark`` extra's pinned ``trl``) in 2 processes
   under torchrun (gloo), with the same spec: synchronous by construction, generation by ``transformers.generate``.

Figures, per run: **seconds** from the first scored batch to the first batch whose mean rollout reward is >=
``--threshold`` (0.9), the judged figure; **documents** trained on before the weights that generated that batch (rljob:
its weights version; TRL: (step − 1) × documents per step); **start-up**, launch to the first scored batch, and the total
from launch, for information (start-up is mostly imports on a loaded machine and has nothing to do with asynchrony).
A batch's time is when its reward appeared: rljob's rollout hash, polled every 0.25 s; TRL's reward function on rank
0. Per variant: median and spread (min–max) over ``--seeds`` seeds; the ratios of the medians.

Targets (judged on an otherwise idle machine), on the medians over the seeds, a run that does not reach the threshold
within ``--max-steps`` counting as never reaching it: (a) sooner than (c); and (a) sooner than (b) by at least 1.5×
(PipelineRL reports ~2× against synchronous RL) or by 90% of the overlap bound measured in the same run, whichever is
lower. The overlap bound (issue 26's): on few cores streaming can only overlap what the cores leave free; with r and t
the rollout's and the trainer's CPU seconds per step, measured in the synchronous runs, a synchronous step costs
r + t / ranks and an overlapped one at least max(r, t / ranks, (r + t) / cores), so at most
min((2r + t)/(r + t), 1 + t/(2r)) on 2 cores and 2 ranks (:func:`overlap_bound`; 1.5× only when r = t and nothing
else costs).

    python benchmarks/time_to_reward.py                       # 5 seeds × 3 variants (≈ 25 min on 2 idle cores)
    python benchmarks/time_to_reward.py --seeds 1 --variants streaming,synchronous
    python benchmarks/time_to_reward.py --trl-python .venv/bin/python   # where `scripts/install-dev.sh test,benchmark` went

Runs go seed by seed, the three variants of a seed one after the other, so that a change of load hits every
variant alike. Each run's record is appended to ``--results`` (JSON lines) as it ends; a rerun with the same file
skips the runs already there. Exit status 0 when both targets hold, 1 when one does not (or a run did not reach the
threshold), 2 on an error, 130 when interrupted. Write-up and results: docs/time-to-reward.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_pipeline as rp  # noqa: E402 - a sibling module
from rljob_api.spec import DIGIT_TASKS, RLTrainingJobSpec  # noqa: E402

VARIANTS = ("streaming", "synchronous", "trl")
TARGET_SYNC_RATIO = 1.5
"""(b)'s median seconds over (a)'s must be at least this, or :data:`BOUND_SHARE` of the overlap bound when lower."""
BOUND_SHARE = 0.9
"""The share of the overlap bound (:func:`overlap_bound`, median over the synchronous runs) (a) must reach over (b)."""


@dataclass(frozen=True)
class Outcome:
    """One run's figures (seconds are wall-clock; None where the threshold was not reached)."""

    variant: str
    seed: int
    reached: bool
    seconds: Optional[float]
    documents: Optional[int]
    startup: Optional[float]
    from_launch: Optional[float]
    steps: int
    max_staleness_steps: Optional[float]
    trainer_cpu_per_step: Optional[float] = None
    rollout_cpu_per_step: Optional[float] = None
    per_step: int = 512
    """Documents per optimizer step."""

    @property
    def seconds_per_step(self) -> Optional[float]:
        """Wall seconds per optimizer step from the first scored batch to the threshold."""
        return self.seconds / (self.documents / self.per_step) if self.reached and self.documents else None

    def to_record(self) -> dict[str, Any]:
        return dict(self.__dict__)


def outcome(variant: str, seed: int, points: Sequence[rp.Point], threshold: float, per_step: int, *,
            max_staleness_steps: Optional[float] = None, cpu: Optional[dict[str, Any]] = None) -> Outcome:
    """The figures of one run from its reward points (module docstring); ``per_step``: documents per optimizer step.
    ``startup`` is the first point's time. ``cpu``: :attr:`rl_pipeline.PipelineRun.extra` (CPU seconds of the trainer
    and the rollout from the first scored batch to the end, and the trainer steps in between), turned into CPU
    seconds per step."""
    trainer_cpu = rollout_cpu = None
    if cpu and cpu.get("steps_at_cpu"):
        seconds = cpu["cpu_seconds"]
        trainer_cpu = seconds.get("trainer", 0.0) / cpu["steps_at_cpu"]
        rollout_cpu = sum(v for k, v in seconds.items() if k.startswith("rollout")) / cpu["steps_at_cpu"]
    common = dict(max_staleness_steps=max_staleness_steps, trainer_cpu_per_step=trainer_cpu,
                  rollout_cpu_per_step=rollout_cpu, per_step=per_step)
    if not points:
        return Outcome(variant, seed, False, None, None, None, None, 0, **common)
    first = min(points, key=lambda p: p.seconds)
    hit = rp.first_reaching(points, threshold)
    steps = max(p.step for p in points)
    if hit is None:
        return Outcome(variant, seed, False, None, None, first.seconds, None, steps, **common)
    return Outcome(variant, seed, True, hit.seconds - first.seconds, hit.version, first.seconds, hit.seconds, steps,
                   **common)


def overlap_bound(trainer_cpu: float, rollout_cpu: float, cores: int,
                  trainer_processes: int = rp.TRAINER_PROCESSES) -> float:
    """The largest step-time speed-up any overlap of generation and training can give over a synchronous run, on
    ``cores`` cores, when a step costs ``trainer_cpu`` CPU seconds over ``trainer_processes`` single-threaded ranks and
    ``rollout_cpu`` in one single-threaded worker: a synchronous step takes rollout_cpu + trainer_cpu /
    trainer_processes, an overlapped one at least max(rollout_cpu, trainer_cpu / trainer_processes, (trainer_cpu +
    rollout_cpu) / cores). On 2 cores and 2 ranks that is issue 26's min((2r + t)/(r + t), 1 + t/(2r)). What a
    synchronous run spends beyond its CPU seconds (waits, round trips) is not in it: the measured ratio can exceed
    it."""
    synchronous = rollout_cpu + trainer_cpu / trainer_processes
    floor = max(rollout_cpu, trainer_cpu / trainer_processes, (trainer_cpu + rollout_cpu) / cores)
    return synchronous / floor


def trl_points(lines: Sequence[dict[str, Any]], launched: float, documents_per_step: int) -> list[rp.Point]:
    """rljob-style points from benchmarks/trl_grpo.py's JSON lines (``step`` from 1, ``reward``, ``time`` as
    ``time.time()``): the batch of TRL step k was generated after k − 1 updates, so its version is (k − 1) ×
    ``documents_per_step``; seconds count from ``launched`` (``time.time()`` at the launch)."""
    return [rp.Point((line["step"] - 1) * documents_per_step, line["step"] - 1, float(line["reward"]),
                     documents_per_step, line["time"] - launched) for line in lines]


def max_staleness_steps(steps: Sequence[dict[str, Any]], documents_per_step: int) -> Optional[float]:
    """The largest ``max_staleness`` (documents) over the trainer's step lines, in steps; None without any."""
    values = [line["metrics"].get("max_staleness") for line in steps if "metrics" in line]
    values = [v for v in values if v is not None and v == v]
    return max(values) / documents_per_step if values else None


@dataclass(frozen=True)
class Summary:
    """One variant's runs: ``seconds``, ``documents`` and ``startup`` are the median and spread over the runs that
    reached the threshold (information); ``judged`` is the median seconds over every run, a run that did not reach
    it counting as infinite (the figure the targets read; infinite when half or more did not)."""

    variant: str
    runs: int
    reached: int
    seconds: tuple[float, float, float]
    documents: tuple[float, float, float]
    startup: tuple[float, float, float]
    judged: float = math.inf


def summarize(outcomes: Sequence[Outcome], variant: str) -> Summary:
    mine = [o for o in outcomes if o.variant == variant]
    hit = [o for o in mine if o.reached]
    judged = statistics.median([o.seconds if o.reached else math.inf for o in mine]) if mine else math.inf
    return Summary(variant, len(mine), len(hit), rp.spread([o.seconds for o in hit]),
                   rp.spread([float(o.documents) for o in hit]), rp.spread([o.startup for o in mine if o.startup is not None]),
                   judged)


def verdict(summaries: dict[str, Summary], bound: Optional[float] = None) -> tuple[bool, list[str]]:
    """Whether both targets hold, and one line per target (module docstring), on the judged medians (a run that did
    not reach the threshold counts as never reaching it). ``bound``: the overlap bound measured in the same run (median
    over the synchronous runs); None: the synchronous target is 1.5× alone. A variant not run fails its target."""
    lines, ok = [], True
    a = summaries.get("streaming")
    sync_target = TARGET_SYNC_RATIO if bound is None else min(TARGET_SYNC_RATIO, BOUND_SHARE * bound)
    sync_name = (f"(a) >= {sync_target:.2f}x sooner than (b)" + ("" if bound is None else
                 f" (the lower of {TARGET_SYNC_RATIO}x and {BOUND_SHARE:.0%} of the overlap bound {bound:.2f})"))
    for other, name, target in (("synchronous", sync_name, sync_target), ("trl", "(a) sooner than (c)", None)):
        b = summaries.get(other)
        if a is None or b is None or not a.runs or not b.runs:
            lines.append(f"{name}: not measured")
            ok = False
            continue
        if math.isinf(a.judged):
            met, figure = False, f"median streaming never reached the threshold ({a.reached}/{a.runs} runs did)"
        else:
            ratio = b.judged / a.judged
            met = ratio > 1.0 if target is None else ratio >= target
            never = f" ({b.reached}/{b.runs} {other} runs reached it)" if b.reached < b.runs else ""
            figure = f"median {other} / median streaming = {'never' if math.isinf(ratio) else f'{ratio:.2f}'}{never}"
        ok &= met
        lines.append(f"{name}: {figure} -> {'met' if met else 'missed'}")
    return ok, lines


def run_rljob(variant: str, seed: int, args: argparse.Namespace, work: Path) -> Outcome:
    overrides: dict[str, Any] = {"rollout": {"task": {"name": args.task}}}
    if variant == "synchronous":
        overrides["rollout"]["maxLag"] = 0
    if args.strategy is not None:
        overrides["trainer"] = {"parallelism": {"strategy": args.strategy}}
    spec = rp.local_spec(rp.example_spec(), seed=seed, max_steps=args.max_steps, overrides=overrides)
    per_step = spec["trainer"]["batch"]["documentsPerStep"]
    run = rp.run_pipeline(spec, work, cores=args.cores, timeout_s=args.timeout,
                          stop_when=lambda points: rp.first_reaching(points, args.threshold) is not None)
    if run.returncode not in (None, 0):
        raise RuntimeError(f"{variant} seed {seed}: the trainer exited with {run.returncode}; logs in {work}")
    return outcome(variant, seed, run.points, args.threshold, per_step,
                   max_staleness_steps=max_staleness_steps(run.steps, per_step), cpu=run.extra)


def run_trl(seed: int, args: argparse.Namespace, work: Path) -> Outcome:
    spec = rp.local_spec(rp.example_spec(), seed=seed, max_steps=args.max_steps,
                         overrides={"rollout": {"task": {"name": args.task}}})
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    log = work / "trl.jsonl"
    log.unlink(missing_ok=True)
    command = [args.trl_python, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={rp.TRAINER_PROCESSES}",
               "--master-addr=127.0.0.1", f"--master-port={rp.free_port()}", str(Path(__file__).parent / "trl_grpo.py"),
               "--spec", str(work / "spec.json"), "--out", str(log), "--stop-at", str(args.threshold)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    launched = time.time()
    with open(work / "trl.stdout", "w") as out, open(work / "trl.stderr", "w") as err:
        process = subprocess.Popen(rp.pinned(command, args.cores), env=env, stdout=out, stderr=err,
                                   start_new_session=True, cwd=work)
        try:
            code = process.wait(args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            rp.kill_tree(process)
    if code not in (None, 0):
        tail = (work / "trl.stderr").read_text()[-3000:]
        raise RuntimeError(f"trl seed {seed}: exited with {code}:\n{tail}")
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    per_step = spec["trainer"]["batch"]["documentsPerStep"]
    return outcome("trl", seed, trl_points(lines, launched, per_step), args.threshold, per_step)


def count_cores(cores: str) -> int:
    """How many cores a ``taskset -c`` list names (``"0,1"`` → 2, ``"0-3,6"`` → 5)."""
    total = 0
    for part in cores.split(","):
        low, _, high = part.partition("-")
        total += int(high or low) - int(low) + 1
    return total


def print_report(outcomes: Sequence[Outcome], variants: Sequence[str], threshold: float, cores: int) -> bool:
    print(f"\nper run (threshold {threshold}):")
    print("| variant | seed | reached | seconds | documents | s/step | start-up s | from launch s | max staleness (steps) "
          "| trainer CPU s/step | rollout CPU s/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    for o in sorted(outcomes, key=lambda o: (VARIANTS.index(o.variant), o.seed)):
        print(f"| {o.variant} | {o.seed} | {'yes' if o.reached else 'no'} | {fmt(o.seconds)} | {fmt(o.documents, '{}')} "
              f"| {fmt(o.seconds_per_step, '{:.2f}')} | {fmt(o.startup)} | {fmt(o.from_launch)} "
              f"| {fmt(o.max_staleness_steps, '{:.0f}')} | {fmt(o.trainer_cpu_per_step, '{:.2f}')} "
              f"| {fmt(o.rollout_cpu_per_step, '{:.2f}')} |")
    synchronous = [o for o in outcomes if o.variant == "synchronous" and o.trainer_cpu_per_step
                   and o.rollout_cpu_per_step]
    bounds = [overlap_bound(o.trainer_cpu_per_step, o.rollout_cpu_per_step, cores) for o in synchronous]
    bound = rp.spread(bounds)[0] if bounds else None
    if bounds:
        overheads = [o.seconds_per_step / (o.rollout_cpu_per_step + o.trainer_cpu_per_step / rp.TRAINER_PROCESSES)
                     for o in synchronous if o.seconds_per_step]
        print(f"overlap bound on {cores} cores (a synchronous step's CPU seconds, rollout + trainer / "
              f"{rp.TRAINER_PROCESSES} ranks, over the least an overlapped step can take): median {bound:.2f} (per run "
              f"{', '.join(f'{b:.2f}' for b in bounds)}); the synchronous runs' s/step over their CPU seconds' share: "
              f"{', '.join(f'{f:.2f}' for f in overheads)} (above 1: waits and round trips the bound leaves out)")
    summaries = {v: summarize(outcomes, v) for v in variants}
    print("\nper variant (median, min-max over the runs that reached it):")
    print("| variant | reached | seconds | documents | start-up s |")
    print("| --- | --- | --- | --- | --- |")
    for s in summaries.values():
        print(f"| {s.variant} | {s.reached}/{s.runs} | {s.seconds[0]:.1f} ({s.seconds[1]:.1f}-{s.seconds[2]:.1f}) | "
              f"{s.documents[0]:.0f} ({s.documents[1]:.0f}-{s.documents[2]:.0f}) | "
              f"{s.startup[0]:.1f} ({s.startup[1]:.1f}-{s.startup[2]:.1f}) |")
    a = summaries.get("streaming")
    for other in variants:
        if a is not None and other != "streaming" and a.reached and summaries[other].reached:
            print(f"ratio median {other} / median streaming: seconds {summaries[other].seconds[0] / a.seconds[0]:.2f}, "
                  f"documents {summaries[other].documents[0] / a.documents[0]:.2f}")
    ok, lines = verdict(summaries, bound)
    print("\n" + "\n".join(lines))
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=rp.positive_int, default=5, help="seeds 0..N-1 (default 5)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--threshold", type=rp.reward_level, default=0.9,
                        help="rollout reward to reach, in (0, 1] (default 0.9)")
    parser.add_argument("--task", default="digits-copy", choices=DIGIT_TASKS,
                        help="spec.rollout.task.name, a built-in digit task (default the example's)")
    parser.add_argument("--max-steps", type=rp.positive_int, default=200, help="give up after this many steps (default 200)")
    parser.add_argument("--cores", type=rp.core_list, default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
                        help="taskset -c list for every process (default: every core this process may use)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the Python with the benchmark extra (trl) installed (default: this one)")
    parser.add_argument("--strategy", choices=("fsdp", "ddp"), default=None,
                        help="the rljob variants' spec.trainer.parallelism.strategy (default: the example's); their "
                             "results are kept apart by it (TRL's data parallelism is DDP whatever it is)")
    parser.add_argument("--timeout", type=rp.positive_float, default=1200, help="seconds per run before it is killed")
    parser.add_argument("--results", type=Path, default=None, help="JSON lines of finished runs (resumable)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep every run's logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    if "trl" in variants and subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True).returncode:
        parser.error(f"--trl-python {args.trl_python}: cannot import trl; scripts/install-dev.sh test,benchmark there, "
                     f"or leave trl out of --variants")
    rp.require_psutil()
    strategy = args.strategy or RLTrainingJobSpec.model_validate(rp.example_spec()).trainer.parallelism.strategy
    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="rljob-time-to-reward-"))
    results = rp.ResultFile(args.results or work_root / "results.jsonl")
    print(f"time to reward {args.threshold}: task {args.task}, seeds 0-{args.seeds - 1}, variants {variants}, "
          f"cores {args.cores}, strategy {strategy}, load average {rp.load_average()}, "
          f"results {results.path}", flush=True)
    outcomes: list[Outcome] = []
    code = 0
    rp.stop_on_signals()
    try:
        done = results.records()
        for seed in range(args.seeds):
            for variant in variants:
                key = f"{args.task}/{variant}/{seed}/{args.threshold}"
                if variant != "trl":  # an rljob run is kept with its strategy: the example's may change
                    key += f"/{strategy}"
                if key in done:
                    record = {k: v for k, v in done[key].items() if k not in ("key", "load")}
                    outcomes.append(Outcome(**record))
                    print(f"{variant} seed {seed}: from {results.path}", flush=True)
                    continue
                started = time.monotonic()
                load = rp.load_average()
                work = work_root / f"{variant}-{seed}"
                result = run_trl(seed, args, work) if variant == "trl" else run_rljob(variant, seed, args, work)
                outcomes.append(result)
                results.add(key, {**result.to_record(), "load": load})
                print(f"{variant} seed {seed}: {'reached' if result.reached else 'NOT reached'} "
                      f"{'' if result.seconds is None else f'in {result.seconds:.1f} s, {result.documents} documents'} "
                      f"(run {time.monotonic() - started:.0f} s, load at start {load})", flush=True)
        code = 0 if print_report(outcomes, variants, args.threshold, count_cores(args.cores)) else 1
    except KeyboardInterrupt:
        print("interrupted; the runs so far:")
        print_report(outcomes, variants, args.threshold, count_cores(args.cores))
        code = 130
    except Exception:  # noqa: BLE001 - reported with what was measured
        traceback.print_exc()
        if outcomes:
            print_report(outcomes, variants, args.threshold, count_cores(args.cores))
        code = 2
    print(f"load average at the end: {rp.load_average()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
