"""Admission as a pure function (issue 22 item 3): :func:`admission.decide` reads nothing, resolves the config the
pass runs once and hands it down, renders the pods for the podTemplate check only when the config changes, and takes
an invalid edit's kept spec from what this process applied or from the record."""

from __future__ import annotations

import inspect

from rljob_api.constants import Phase, Reason

from rljob_operator import admission, gang, render, resolution
from rljob_operator.runtime import JobRuntime, Recorded

from operator_helpers import make_job, rollout, trainer

TEMPLATE = {"spec": {"containers": [{"name": "trainer", "env": [{"name": "TEAM", "value": "a"}]}]}}


def body(generation: int = 1, status: bool = True, **spec) -> dict:
    raw = {"model": {"source": "tiny"}, **spec}
    return {"metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": generation, "labels": {}},
            "spec": raw, **({"status": {"phase": "Running"}} if status else {})}


RUNNING = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, reason=Reason.TRAINING, message="runs")


def recorded_of(job_body: dict, generation: int) -> Recorded:
    job = make_job(**{k: v for k, v in job_body["spec"].items() if k != "model"})
    return Recorded(resolution.as_recorded(render.job_config(job)), generation)


def test_decide_is_pure_and_hands_down_the_config_it_resolved_once(monkeypatch):
    assert not inspect.iscoroutinefunction(admission.decide)
    assert "api" not in inspect.signature(admission.decide).parameters
    calls = []
    real = resolution.effective_config
    monkeypatch.setattr(resolution, "effective_config", lambda *a, **k: calls.append(a) or real(*a, **k))
    job_body = body(trainer={"podTemplate": TEMPLATE})
    decision = admission.decide(job_body, RUNNING, [trainer(0, 0), rollout(0)], None, JobRuntime(), None)
    assert decision.problems == () and decision.run is not None and len(calls) == 1
    assert decision.config == render.job_config(make_job(trainer={"podTemplate": TEMPLATE}))
    recorded = recorded_of(job_body, 1)
    same = admission.decide(job_body, RUNNING, [], None, JobRuntime(), recorded)
    assert same.config is recorded.config  # the record of this generation is what runs


def test_the_pods_are_rendered_for_the_template_check_only_when_the_config_changes(monkeypatch):
    rendered = []
    real = render.override_problems
    monkeypatch.setattr(render, "override_problems", lambda job, config: rendered.append(1) or real(job, config))
    runtime = JobRuntime()
    for _ in range(3):
        admission.decide(body(), RUNNING, [], None, runtime, None)
    assert len(rendered) == 1
    admission.decide(body(generation=2, trainer={"podTemplate": TEMPLATE}), RUNNING, [], None, runtime, None)
    assert len(rendered) == 2


def test_a_template_problem_found_once_is_still_reported_on_the_next_passes():
    runtime = JobRuntime()
    bad = body(trainer={"podTemplate": {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "RLJOB_CONFIG", "value": "/x"}]}]}}})
    first = admission.decide(bad, RUNNING, [], None, runtime, None)
    second = admission.decide(bad, RUNNING, [], None, runtime, None)
    assert first.problems and [str(p) for p in first.problems] == [str(p) for p in second.problems]
    assert "spec.trainer.podTemplate" in str(first.problems[0])


def test_an_invalid_edit_after_an_operator_restart_goes_on_with_the_recorded_spec_and_the_edits_run_policy():
    valid = body(generation=1)
    recorded = recorded_of(valid, 1)
    invalid = body(generation=2, model={"source": "tiny", "tiny": {"heads": 3}}, runPolicy={"backoffLimit": 7})
    decision = admission.decide(invalid, RUNNING, [trainer(0, 0), rollout(0)], None, JobRuntime(), recorded)
    assert [p.field for p in decision.problems] == ["spec.model.tiny.heads"]
    assert decision.run.model.tiny.heads == 4 and decision.run.run_policy.backoff_limit == 7
    assert decision.note == "the job goes on with its last valid spec until then"
    assert decision.config is not None and decision.config.spec.model.tiny.heads == 4
    nothing = admission.decide(invalid, RUNNING, [trainer(0, 0)], None, JobRuntime(), None)
    assert nothing.run is None and nothing.config is None


def test_an_edit_to_a_topology_no_trainer_runs_keeps_the_gang_and_names_its_counts():
    """tensorParallel > 1 is not implemented (no checkpoint could be resharded to it): the edit is refused naming the
    value, and the note names the counts the running gang keeps; an edit of the data-parallel counts alone runs."""
    valid = body(generation=1, trainer={"nodes": 2, "processesPerNode": 2})
    recorded = recorded_of(valid, 1)
    edited = body(generation=2, trainer={"nodes": 1, "processesPerNode": 4, "tensorParallel": 2})
    decision = admission.decide(edited, RUNNING, [trainer(0, 0), trainer(1, 0), rollout(0)], None, JobRuntime(),
                                recorded)
    assert [str(p) for p in decision.problems] == [
        "spec.trainer.tensorParallel: 2: tensor parallelism > 1 is not supported yet (the trainer parallelises over "
        "data-parallel ranks only): set it to 1"]
    assert decision.note == ("the job goes on with its last valid spec until then; its gang keeps nodes 2, "
                             "processesPerNode 2, tensorParallel 1")
    assert (decision.run.trainer.nodes, decision.run.trainer.processes_per_node) == (2, 2)
    resized = admission.decide(body(generation=2, trainer={"nodes": 1, "processesPerNode": 4}), RUNNING,
                               [trainer(0, 0), trainer(1, 0), rollout(0)], None, JobRuntime(), recorded)
    assert resized.applies and resized.config.data_parallel_size == 4
