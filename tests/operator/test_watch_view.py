"""The live status view renders what status holds and stops at a final phase."""

import io

from rich.console import Console

from rljob_operator.watch import plain_lines, render, watch


def job(phase: str, step: int) -> dict:
    return {
        "metadata": {"name": "demo"},
        "spec": {"trainer": {"maxSteps": 40}},
        "status": {
            "phase": phase, "step": step, "attempt": 1, "dataParallelSize": 2, "documentsSeen": step * 64,
            "modelVersion": step * 64, "rolloutReward": 0.8125,
            "lastMetrics": {"train_samples_reward": 0.75, "staleness": 12.5, "max_staleness": 64.0},
            "conditions": [{"type": "Running", "status": "True", "reason": "Training", "message": "step 3"}],
        },
    }


def text_of(renderable) -> str:
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(renderable)
    return console.export_text()


def test_render_shows_figures_and_conditions():
    out = text_of(render(job("Running", 3)))
    assert "demo Running" in out and "3/40 steps" in out
    assert "0.812" in out and "0.750" in out and "12.5 / 64" in out
    assert "Training" in out and "step 3" in out


def test_watch_polls_until_a_final_phase_and_prints_plain_lines_to_a_file():
    states = iter([job("Running", 1), job("Running", 1), job("Running", 20), job("Succeeded", 40)])
    calls = []

    def fetch(name, namespace):
        calls.append((name, namespace))
        return next(states)

    out = io.StringIO()
    final = watch("demo", "ns", interval_seconds=0, console=Console(file=out), fetch=fetch, clock=lambda: "12:00:00")
    assert final["status"]["phase"] == "Succeeded"
    assert calls == [("demo", "ns")] * 4
    figures = ("12:00:00 demo {phase} step {step}/40 attempt 1 DP 2 documents {docs} modelVersion {docs} rollout reward "
               "0.812 train reward 0.750 staleness 12.5/64")
    assert out.getvalue().splitlines() == [
        figures.format(phase="Running", step=1, docs=64),
        "12:00:00 demo Running=True Training: step 3",  # the unchanged second read adds nothing
        figures.format(phase="Running", step=20, docs=1280),
        figures.format(phase="Succeeded", step=40, docs=2560),
    ]


def test_a_condition_line_when_a_condition_changes_and_dashes_before_status_has_figures():
    shown = {}
    bare = {"metadata": {"name": "demo"}, "spec": {}, "status": {}}
    assert plain_lines(bare, shown, "09:00:00") == [
        "09:00:00 demo Pending step 0/100 attempt - DP - documents - modelVersion - rollout reward - train reward - "
        "staleness -/-"]
    failed = job("Failed", 3)
    failed["status"]["conditions"] = [{"type": "Running", "status": "False", "reason": "BackoffLimitExceeded",
                                       "message": "3 restarts"}]
    lines = plain_lines(failed, shown, "09:00:05")
    assert lines[1:] == ["09:00:05 demo Running=False BackoffLimitExceeded: 3 restarts"]
    assert plain_lines(failed, shown, "09:00:07") == []


def test_a_terminal_gets_the_live_view():
    out = io.StringIO()
    states = iter([job("Running", 1), job("Succeeded", 40)])
    watch("demo", "ns", interval_seconds=0, console=Console(file=out, force_terminal=True, width=160),
          fetch=lambda name, namespace: next(states))
    assert "40/40 steps" in out.getvalue() and "12:00:00" not in out.getvalue()
