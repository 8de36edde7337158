"""Write efficiency of one job's passes: a pass that runs before the watch shows this process's own status write
reads the job as written (no stale write refused with 409), and the job's own watch events wake its daemon only
for what a pass depends on (not for the daemon's status writes)."""

from __future__ import annotations

from rljob_operator.handlers import pass_inputs
from rljob_operator.reconcile import JobRuntime
from rljob_operator.settings import FINALIZER


def job(resource_version: str, status: dict | None = None, generation: int = 1, labels: dict | None = None,
        finalizers: tuple = (FINALIZER,)) -> dict:
    return {"metadata": {"name": "demo", "namespace": "ns", "resourceVersion": resource_version,
                         "generation": generation, "labels": labels or {}, "finalizers": list(finalizers)},
            "spec": {"trainer": {"nodes": 2}}, "status": status or {}}


def test_a_pass_on_a_body_older_than_its_own_writes_reads_the_job_as_written():
    runtime = JobRuntime()
    stale = job("10")
    assert runtime.catch_up(stale) is stale  # nothing written yet

    runtime.remember_write("10", job("11", {"phase": "Pending"}))
    runtime.remember_write("11", job("12", {"phase": "Starting", "gangCreated": True}))  # after creating pods
    for seen in ("10", "11"):  # the watch has not delivered the writes yet
        caught = runtime.catch_up(job(seen, {}))
        assert caught["metadata"]["resourceVersion"] == "12"
        assert caught["status"] == {"phase": "Starting", "gangCreated": True}
        assert caught["spec"] == stale["spec"] and caught["metadata"]["generation"] == 1
    assert runtime.catch_up(job("10"))["metadata"]["name"] == "demo"

    current = job("12", {"phase": "Starting", "gangCreated": True})
    assert runtime.catch_up(current) is current and runtime.written is None  # the watch caught up: forgotten
    assert runtime.catch_up(job("10"))["metadata"]["resourceVersion"] == "10"


def test_a_job_changed_by_someone_else_since_the_write_is_taken_as_it_is():
    runtime = JobRuntime()
    runtime.remember_write("10", job("11", {"phase": "Pending"}))
    edited = job("13", {"phase": "Pending"}, generation=2)  # a spec edit after the write
    assert runtime.catch_up(edited) is edited and runtime.written is None


def test_the_daemon_is_woken_by_spec_labels_and_the_finalizer_not_by_its_own_status_writes():
    runtime = JobRuntime()
    new = job("1", finalizers=())
    runtime.seen = pass_inputs(new)
    assert pass_inputs(job("2", finalizers=())) == runtime.seen
    assert pass_inputs(job("2")) != runtime.seen  # kopf's finalizer arrived: the first pass may run

    runtime.seen = pass_inputs(job("2"))
    assert pass_inputs(job("3", {"phase": "Starting"})) == runtime.seen  # a status write
    assert pass_inputs(job("4", generation=2)) != runtime.seen
    assert pass_inputs(job("5", labels={"kueue.x-k8s.io/queue-name": "q"})) != runtime.seen
