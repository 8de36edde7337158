"""The live status view renders what status holds and stops at a final phase."""

import io

from rich.console import Console

from rljob_operator.watch import render, watch


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


def test_watch_polls_until_a_final_phase():
    states = iter([job("Running", 1), job("Running", 20), job("Succeeded", 40)])
    calls = []

    def fetch(name, namespace):
        calls.append((name, namespace))
        return next(states)

    out = io.StringIO()
    final = watch("demo", "ns", interval_seconds=0, console=Console(file=out), fetch=fetch)
    assert final["status"]["phase"] == "Succeeded"
    assert calls == [("demo", "ns")] * 3
    assert out.getvalue().endswith("┘\n")  # the last frame's table, then a newline (output to a file or a pipe)
