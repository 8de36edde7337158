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


def test_the_attempts_and_the_document_totals_are_shown_and_printed_when_they_change():
    ended = {"attempt": 0, "startTime": "2026-01-01T12:00:00Z", "endTime": "2026-01-01T12:05:00Z",
             "reason": "PodDeleted", "message": "trainer pod demo-trainer-1 of attempt 0 was deleted",
             "dataParallelSize": 2, "restoredFromStep": 0, "step": 12,
             "documents": {"redelivered": 0, "deadLettered": {"bad_value": 3}, "droppedTooLong": 0}}
    running = {"attempt": 1, "startTime": "2026-01-01T12:06:00Z", "dataParallelSize": 4, "restoredFromStep": 10,
               "step": 14, "documents": {"redelivered": 64, "deadLettered": {}}}
    state = job("Running", 14)
    state["status"]["attempts"] = [ended, running]
    state["status"]["documentTotals"] = {"redelivered": 64, "deadLettered": {"bad_value": 3}, "streamLosses": 1,
                                         "streamLostEntries": 1536}
    shown: dict = {}
    lines = plain_lines(state, shown, "10:00:00")
    assert lines[2:] == [
        "10:00:00 demo attempt 0: DP 2, from scratch, step 12, 3 dead-lettered; ended PodDeleted: trainer pod "
        "demo-trainer-1 of attempt 0 was deleted",
        "10:00:00 demo attempt 1: DP 4, from the checkpoint of step 10, step 14, 64 redelivered; running",
        "10:00:00 demo documents: 64 redelivered, 3 dead-lettered (bad_value 3), 1536 lost with the stream (1 loss)",
    ]
    running["step"] = 15
    assert plain_lines(state, shown, "10:00:02") == [
        "10:00:02 demo attempt 1: DP 4, from the checkpoint of step 10, step 15, 64 redelivered; running"]
    out = text_of(render(state))
    assert "ended PodDeleted" in out and "from the checkpoint of step 10" in out and "1536 lost with the stream" in out


def test_the_capacity_signals_are_a_line_of_their_own_printed_when_they_change():
    state = job("Running", 14)
    state["status"]["capacity"] = {"dataWaitShare": 0.4, "heldShare": 0.0, "tokensPerSecond": 900.0,
                                   "tokensPerSecondPerReplica": 450.0, "pending": 64, "undelivered": 0,
                                   "replicasReporting": 2, "observedAt": "2026-01-01T12:00:00Z"}
    shown: dict = {}
    assert plain_lines(state, shown, "10:00:00")[2:] == [
        "10:00:00 demo capacity: trainer waits 40%, rollouts held 0% (2 replicas reporting), 900 tokens/s (450 per "
        "replica), backlog 0 undelivered + 64 pending"]
    state["status"]["capacity"]["observedAt"] = "2026-01-01T12:00:05Z"  # the same values: no line
    assert plain_lines(state, shown, "10:00:02") == []
    state["status"]["capacity"].update(heldShare=None, tokensPerSecond=None, tokensPerSecondPerReplica=None,
                                       replicasReporting=0)
    assert plain_lines(state, shown, "10:00:04") == [
        "10:00:04 demo capacity: trainer waits 40%, rollouts: no replica reporting, backlog 0 undelivered + 64 pending"]
    assert "trainer waits 40%" in text_of(render(state))
