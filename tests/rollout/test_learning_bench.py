"""The learning benchmarks' pure parts (benchmarks/rl_pipeline.py, time_to_reward.py, learning_robustness.py,
trl_grpo.py) without running them: the reward record, the Wilson interval, a run's verdict, the resumable result file,
the parsing of TRL's log and the targets. No timing is asserted here."""

from __future__ import annotations

import math

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import learning_robustness as lr  # noqa: E402
import rl_pipeline as rp  # noqa: E402
import time_to_reward as ttr  # noqa: E402

from rljob_api.spec import RLTrainingJobSpec  # noqa: E402
from rljob_wire.model import DigitTokenizer  # noqa: E402


def points(*rewards: float, per_step: int = 512, start: float = 10.0, every: float = 2.0) -> list[rp.Point]:
    """One point per step 0, 1, 2, ... with these rewards, appearing ``every`` seconds from ``start``."""
    return [rp.Point(i * per_step, i, r, per_step, start + every * i) for i, r in enumerate(rewards)]


# --- the Wilson interval: hand-computed with z = 1.96, z² = 3.8416 ---------------------------------------------------
# 18/20: p = 0.9, z²/n = 0.19208; centre (0.9 + 0.09604) / 1.19208 = 0.835548;
#        half 1.96 · sqrt(0.09/20 + 3.8416/1600) / 1.19208 = 1.96 · 0.083072 / 1.19208 = 0.136586.
# 0/20:  centre 0.09604 / 1.19208 = 0.080565; half 1.96 · sqrt(0.002401) / 1.19208 = 0.080565.
# 20/20: centre 1.09604 / 1.19208 = 0.919435, half 0.080565.
# 1/2:   centre (0.5 + 0.9604) / 2.9208 = 0.5; half 1.96 · sqrt(0.125 + 0.2401) / 2.9208 = 0.405471.
@pytest.mark.parametrize("passed, runs, low, high", [
    (18, 20, 0.698962, 0.972134), (0, 20, 0.0, 0.161130), (20, 20, 0.838870, 1.0), (1, 2, 0.094529, 0.905471)])
def test_wilson_interval_against_hand_computed_values(passed, runs, low, high):
    assert lr.wilson_interval(passed, runs) == pytest.approx((low, high), abs=2e-6)


@pytest.mark.parametrize("passed, runs", [(0, 0), (3, 2), (-1, 5)])
def test_wilson_interval_refuses_impossible_counts(passed, runs):
    with pytest.raises(ValueError, match=f"{passed}/{runs}"):
        lr.wilson_interval(passed, runs)


# --- a robustness run's verdict ------------------------------------------------------------------------------------
SMALL = lr.Criterion(reach=0.95, by_step=3, hold=0.9, through=6)


def test_a_run_that_reaches_and_holds_passes():
    verdict = lr.judge(points(0.1, 0.5, 0.96, 0.93, 0.97, 0.91, 0.99), SMALL)
    assert verdict == lr.Verdict(True, 2, 0.91, "")


def test_a_run_that_reaches_too_late_fails_once_the_deadline_step_is_seen():
    early = points(0.1, 0.5, 0.8, 0.9)
    assert lr.judge(early, SMALL).passed is None  # step 3 may still reach 0.95 with a later batch
    late = points(0.1, 0.5, 0.8, 0.9, 0.96)
    assert lr.judge(late, SMALL) == lr.Verdict(False, None, None, "no reward >= 0.95 by step 3 (best 0.900)")


def test_a_run_that_falls_below_the_hold_level_fails_at_once():
    verdict = lr.judge(points(0.2, 0.96, 0.95, 0.85), SMALL)
    assert verdict == lr.Verdict(False, 1, 0.85, "fell to 0.850 at step 3 after reaching 0.95 at step 1")


def test_a_fall_after_the_last_judged_step_does_not_count():
    assert lr.judge(points(0.2, 0.96, 0.95, 0.92, 0.93, 0.94, 0.95, 0.1), SMALL).passed is True


def test_a_finished_run_is_decided_without_a_batch_of_its_last_weights():
    reached = points(0.2, 0.96, 0.95, 0.92, 0.93)  # the trainer ended at step 6; the rollout sampled up to step 4
    assert lr.judge(reached, SMALL).passed is None
    assert lr.judge(reached, SMALL, finished=True) == lr.Verdict(True, 1, 0.92, "")
    assert lr.judge(points(0.2, 0.3), SMALL, finished=True).reason == "no reward >= 0.95 by step 3 (best 0.300)"


def test_criterion_needs_the_deadline_within_the_run():
    with pytest.raises(ValueError, match="by_step 400, through 300"):
        lr.Criterion(by_step=400, through=300)


def test_tally_counts_one_setting_and_needs_ninety_percent():
    records = [{"replicas": 1, "seed": s, "passed": s != 4, "reason": "fell" if s == 4 else ""} for s in range(20)]
    records += [{"replicas": 2, "seed": s, "passed": s % 5 != 0, "reason": "late"} for s in range(20)]
    records += [{"replicas": 1, "seed": 25, "passed": False, "reason": "outside the seeds asked for"}]
    one, two = lr.tally(records, 1, 20), lr.tally(records, 2, 20)
    assert (one.runs, one.passed, one.required, one.met, one.failures) == (20, 19, 18, True, ["seed 4: fell"])
    assert (two.passed, two.met) == (16, False)
    assert one.interval == pytest.approx(lr.wilson_interval(19, 20))
    assert lr.tally(records, 1, 2).required == 2


# --- the resumable result file ------------------------------------------------------------------------------------
def test_result_file_keeps_finished_runs_and_skips_a_torn_last_line(tmp_path):
    results = rp.ResultFile(tmp_path / "sweep" / "results.jsonl")
    assert results.records() == {}
    results.add("1/0", {"passed": True})
    results.add("2/0", {"passed": False})
    with results.path.open("a") as f:
        f.write('{"key": "1/1", "pass')  # the sweep was killed while writing
    assert set(results.records()) == {"1/0", "2/0"}
    again = rp.ResultFile(results.path)  # a restarted sweep
    again.add("1/1", {"passed": True})
    assert again.records() == {"1/0": {"key": "1/0", "passed": True}, "2/0": {"key": "2/0", "passed": False},
                               "1/1": {"key": "1/1", "passed": True}}
    assert len(results.path.read_text().splitlines()) == 4  # the torn line stays, alone on its line


def test_a_later_record_of_the_same_key_wins(tmp_path):
    results = rp.ResultFile(tmp_path / "r.jsonl")
    results.add("k", {"value": 1})
    results.add("k", {"value": 2})
    assert results.records() == {"k": {"key": "k", "value": 2}}


# --- the reward record ------------------------------------------------------------------------------------------------
def test_reward_watch_keeps_the_first_time_and_the_latest_mean():
    watch = rp.RewardWatch(documents_per_step=512)
    watch.update({0: (0.07, 512)}, 3.0)
    watch.update({0: (0.07, 512), 512: (0.10, 512)}, 4.5)
    watch.update({0: (0.08, 1024), 512: (0.10, 512), 1024: (0.2, 512)}, 6.0)  # a second replica's batch of version 0
    assert watch.points == [rp.Point(0, 0, 0.08, 1024, 3.0), rp.Point(512, 1, 0.10, 512, 4.5),
                            rp.Point(1024, 2, 0.2, 512, 6.0)]
    with pytest.raises(ValueError, match="documents_per_step=0"):
        rp.RewardWatch(0)


def test_first_reaching_is_the_earliest_in_time():
    late_version_first = [rp.Point(1024, 2, 0.95, 512, 9.0), rp.Point(512, 1, 0.91, 512, 9.5), rp.Point(0, 0, 0.1, 512, 1)]
    assert rp.first_reaching(late_version_first, 0.9).version == 1024
    assert rp.first_reaching(late_version_first, 0.99) is None


def test_local_spec_runs_the_example_on_one_node_and_leaves_it_unchanged():
    example = rp.example_spec()
    assert example["rollout"]["task"] == {"name": "digits-copy", "digits": 4}
    spec = rp.local_spec(example, seed=7, replicas=2, max_steps=30,
                         overrides={"rollout": {"maxLag": 0, "task": {"name": "digits-sort"}}})
    parsed = RLTrainingJobSpec.model_validate(spec)
    assert (parsed.trainer.nodes, parsed.trainer.processes_per_node, parsed.trainer.seed) == (1, 2, 7)
    assert (parsed.rollout.replicas, parsed.rollout.seed, parsed.rollout.max_lag) == (2, 7, 0)
    assert (parsed.rollout.task.name, parsed.rollout.task.digits) == ("digits-sort", 4)  # merged, not replaced
    assert parsed.trainer.max_steps == 30 and parsed.trainer.checkpoint.volume is None
    assert parsed.trainer.optimizer.learning_rate == 0.002  # the example's
    assert example == rp.example_spec()


# --- time to reward ---------------------------------------------------------------------------------------------------
def test_trl_log_lines_become_points_of_the_weights_that_sampled_them():
    lines = [{"step": 1, "reward": 0.07, "time": 1000.0}, {"step": 2, "reward": 0.5, "time": 1002.5}]
    assert ttr.trl_points(lines, launched=990.0, documents_per_step=512) == [
        rp.Point(0, 0, 0.07, 512, 10.0), rp.Point(512, 1, 0.5, 512, 12.5)]


def test_outcome_counts_from_the_first_scored_batch():
    run = points(0.1, 0.4, 0.92, 0.95, start=20.0, every=3.0)  # scored at 20, 23, 26, 29 s
    cpu = {"cpu_seconds": {"trainer": 12.0, "rollout-0": 3.0, "rollout-1": 1.0}, "steps_at_cpu": 4}
    result = ttr.outcome("streaming", 0, run, 0.9, 512, max_staleness_steps=2.0, cpu=cpu)
    assert (result.reached, result.seconds, result.documents, result.startup, result.from_launch) == (
        True, 6.0, 1024, 20.0, 26.0)
    assert result.steps == 3 and result.max_staleness_steps == 2.0
    assert result.seconds_per_step == 3.0  # 6 s over the 2 steps from version 0 to version 1024
    assert (result.trainer_cpu_per_step, result.rollout_cpu_per_step) == (3.0, 1.0)
    missed = ttr.outcome("trl", 1, run, 0.99, 512)
    assert (missed.reached, missed.seconds, missed.startup, missed.seconds_per_step) == (False, None, 20.0, None)
    assert missed.trainer_cpu_per_step is None
    assert ttr.outcome("trl", 2, [], 0.9, 512).reached is False
    assert ttr.Outcome(**{k: v for k, v in result.to_record().items()}) == result  # a result file's record reads back


def test_overlap_bound_and_core_counts():
    # trainer t = 0.8 CPU s over 2 ranks, rollout r = 0.5: synchronous 0.5 + 0.4 = 0.9 s a step, overlapped at
    # least max(0.5, 0.4, 1.3/2) = 0.65: issue 26's min((2r + t)/(r + t), 1 + t/(2r)) = min(1.8/1.3, 1.8)
    assert ttr.overlap_bound(trainer_cpu=0.8, rollout_cpu=0.5, cores=2) == pytest.approx(0.9 / 0.65)
    assert ttr.overlap_bound(trainer_cpu=0.8, rollout_cpu=0.5, cores=2) == pytest.approx(min(1.8 / 1.3, 1 + 0.8 / 1.0))
    # on 8 cores the single-threaded rollout is the floor: 0.9 / 0.5 = 1 + t/(2r)
    assert ttr.overlap_bound(trainer_cpu=0.8, rollout_cpu=0.5, cores=8) == pytest.approx(1.8)
    # 1.5 only when r = t
    assert ttr.overlap_bound(trainer_cpu=1.0, rollout_cpu=1.0, cores=2) == pytest.approx(1.5)
    assert ttr.overlap_bound(trainer_cpu=1.0, rollout_cpu=0.5, cores=2) == pytest.approx(1.0 / 0.75)
    assert [ttr.count_cores(c) for c in ("0,1", "0-3,6", "5")] == [2, 5, 1]


def test_max_staleness_in_steps_from_the_trainer_lines():
    lines = [{"step": 1, "metrics": {"max_staleness": 0.0}}, {"step": 2, "metrics": {"max_staleness": 1024.0}},
             {"step": 3, "metrics": {"max_staleness": float("nan")}}, {"event": "other"}]
    assert ttr.max_staleness_steps(lines, 512) == 2.0
    assert ttr.max_staleness_steps([], 512) is None


def outcomes(variant: str, *seconds: float, reached: bool = True) -> list[ttr.Outcome]:
    return [ttr.Outcome(variant, i, reached, s if reached else None, 512 * (i + 1), 5.0, 5.0 + s, 10, 0.0)
            for i, s in enumerate(seconds)]


def test_summary_is_median_and_spread_of_the_runs_that_reached_and_judges_misses_as_never():
    runs = outcomes("streaming", 30.0, 20.0, 40.0) + outcomes("streaming", 99.0, reached=False)
    summary = ttr.summarize(runs, "streaming")
    assert (summary.runs, summary.reached, summary.seconds, summary.documents) == (4, 3, (30.0, 20.0, 40.0),
                                                                                 (1024.0, 512.0, 1536.0))
    assert summary.judged == 35.0  # median of 20, 30, 40 and never
    assert ttr.summarize(outcomes("trl", 1.0, 2.0, reached=False) + outcomes("trl", 5.0), "trl").judged == math.inf


def test_verdict_reads_the_judged_medians_and_the_overlap_bound():
    a, b, c = outcomes("streaming", 20.0, 22.0, 30.0), outcomes("synchronous", 33.0, 40.0, 50.0), outcomes("trl", 25.0)
    summaries = {s.variant: s for s in (ttr.summarize(a + b + c, v) for v in ttr.VARIANTS)}
    ok, lines = ttr.verdict(summaries)
    assert ok, lines
    assert lines == ["(a) >= 1.50x sooner than (b): median synchronous / median streaming = 1.82 -> met",
                     "(a) sooner than (c): median trl / median streaming = 1.14 -> met"]
    slow_b = {**summaries, "synchronous": ttr.summarize(outcomes("synchronous", 30.0), "synchronous")}
    ok, lines = ttr.verdict(slow_b)
    assert not ok and lines[0].endswith("= 1.36 -> missed")
    ok, lines = ttr.verdict(slow_b, bound=1.45)  # 90% of the bound (1.305) is below 1.5: 1.36 meets it
    assert ok and lines[0] == ("(a) >= 1.30x sooner than (b) (the lower of 1.5x and 90% of the overlap bound 1.45): "
                               "median synchronous / median streaming = 1.36 -> met")
    assert ttr.verdict(slow_b, bound=3.0)[1][0].startswith("(a) >= 1.50x sooner than (b) (the lower of")
    ok, lines = ttr.verdict({"streaming": summaries["streaming"], "synchronous": summaries["synchronous"]})
    assert not ok and lines[1] == "(a) sooner than (c): not measured"
    never_c = {**summaries, "trl": ttr.summarize(outcomes("trl", 1.0, 2.0, reached=False) + outcomes("trl", 3.0), "trl")}
    ok, lines = ttr.verdict(never_c)  # TRL's median never reached: streaming is sooner
    assert ok and lines[1] == ("(a) sooner than (c): median trl / median streaming = never (1/3 trl runs reached it) "
                               "-> met")
    never_a = {**summaries, "streaming": ttr.summarize(outcomes("streaming", 9.0, 9.0, reached=False), "streaming")}
    ok, lines = ttr.verdict(never_a)
    assert not ok and lines[1] == "(a) sooner than (c): median streaming never reached the threshold (0/2 runs did) -> missed"


# --- TRL's tokenizer --------------------------------------------------------------------------------------------------
def test_the_hf_tokenizer_has_the_ids_of_the_digit_tokenizer():
    import trl_grpo

    hf, ours = trl_grpo.hf_digit_tokenizer(), DigitTokenizer()
    for text in ("0123456789|", "90|", "5"):
        assert hf(text)["input_ids"] == ours.encode(text)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.decode([1, 13, 4, 3, 2], skip_special_tokens=True) == ours.decode([1, 13, 4, 3, 2]) == "90|"
    assert len(hf) == ours.vocab_size == 14


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_sweep_started_in_the_background_stops_on_sigterm_and_sigint(signum):
    """A process whose shell left SIGINT ignored (a background job) still turns SIGTERM and SIGINT into
    KeyboardInterrupt once :func:`rl_pipeline.stop_on_signals` ran, so the sweep's cleanup runs."""
    import signal
    import subprocess

    script = ("import signal, sys, time\n"
              f"sys.path.insert(0, {str(Path(rp.__file__).parent)!r})\n"
              "import rl_pipeline as rp\n"
              "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
              "rp.stop_on_signals()\n"
              "try:\n    print('ready', flush=True)\n    time.sleep(60)\n"
              "except KeyboardInterrupt as stop:\n    print('stopped', stop, flush=True)\n"
              "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(getattr(signal, signum))
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, out.strip()) == (130, f"stopped {signum}")


def refused(main, argv: list[str], capsys) -> str:
    """The last line argparse writes to stderr when ``main`` refuses ``argv`` (exit status 2, before any run)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "argument --seeds: must be a whole number >= 1, got 0"),
    (["--reach", "2"], "argument --reach: must be a rollout reward in (0, 1] (the task's rewards lie in [0, 1]), got 2"),
    (["--hold", "nan"], "argument --hold: must be a rollout reward in (0, 1] (the task's rewards lie in [0, 1]), got nan"),
    (["--replicas", "0"], "argument --replicas: every count must be >= 1 (0 replicas would leave the trainer unfed), "
                          "got '0'"),
    (["--replicas", "1,two"], "argument --replicas: must be comma-separated whole numbers such as 1,2, got '1,two'"),
    (["--by-step", "400", "--through", "300"], "--by-step 400 is after --through 300: the step to reach --reach by "
                                               "must be within the judged run"),
    (["--timeout", "0"], "argument --timeout: must be a number > 0, got 0"),
    (["--cores", "1-0"], "argument --cores: must be a taskset -c list such as 0,1 or 0-3,6, got '1-0'"),
])
def test_the_robustness_sweep_refuses_bad_arguments_naming_the_option(argv, message, capsys):
    assert refused(lr.main, argv, capsys) == f"{Path(sys.argv[0]).name}: error: {message}"


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "-1"], "argument --seeds: must be a whole number >= 1, got -1"),
    (["--threshold", "1.5"], "argument --threshold: must be a rollout reward in (0, 1] (the task's rewards lie in "
                             "[0, 1]), got 1.5"),
    (["--task", "math"], "argument --task: invalid choice: 'math' (choose from 'digits-copy', 'digits-reverse', "
                         "'digits-sort')"),
    (["--max-steps", "0"], "argument --max-steps: must be a whole number >= 1, got 0"),
    (["--variants", "streaming,async"], "--variants: unknown ['async']; choose from ('streaming', 'synchronous', 'trl')"),
    (["--strategy", "zero3"], "argument --strategy: invalid choice: 'zero3' (choose from 'fsdp', 'ddp')"),
])
def test_time_to_reward_refuses_bad_arguments_naming_the_option(argv, message, capsys):
    assert refused(ttr.main, argv, capsys) == f"{Path(sys.argv[0]).name}: error: {message}"


def test_a_core_list_names_only_cores_this_process_may_use():
    allowed = sorted(os.sched_getaffinity(0))
    assert rp.core_list(f"{allowed[0]}") == f"{allowed[0]}"
    with pytest.raises(argparse.ArgumentTypeError, match=r"'100000' names cores this process may not use \(allowed: "):
        rp.core_list("100000")
