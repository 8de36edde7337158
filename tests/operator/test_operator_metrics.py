"""Operator metrics: phases counted at scrape time, served over HTTP by prometheus-client."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

from rljob_operator.operator_metrics import OperatorMetrics, count_phases


def test_count_phases_lists_every_phase():
    counts = count_phases([{"status": {"phase": "Running"}}, {"status": {"phase": "Running"}}, {}])
    assert counts["Running"] == 2 and counts["Unknown"] == 1 and counts["Failed"] == 0
    assert set(counts) >= {"Pending", "Starting", "Restarting", "Suspended", "Succeeded", "Invalid"}


def test_metrics_endpoint_lists_jobs_at_scrape_time():
    capacity = {"dataWaitShare": 0.12, "tokensPerSecond": 1300.0, "tokensPerSecondPerReplica": 650.0, "pending": 64,
                "undelivered": 0, "replicasReporting": 2, "observedAt": "2026-01-01T12:00:00Z"}  # heldShare not reported
    jobs = [{"metadata": {"namespace": "team-a", "name": "grpo"}, "status": {"phase": "Succeeded", "restarts": 3}},
            {"metadata": {"namespace": "team-a", "name": "busy"}, "status": {"phase": "Running", "capacity": capacity}}]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def list_jobs():
        return list(jobs)

    metrics = OperatorMetrics()
    port = metrics.serve(0, list_jobs, loop, addr="127.0.0.1")
    try:
        metrics.gang_restarts.inc(2)
        metrics.reconcile_errors.labels(kind="http409").inc()
        with metrics.reconcile_duration.time():
            pass
        first = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        jobs.append({"metadata": {"namespace": "team-b", "name": "new"}, "status": {"phase": "Succeeded"}})
        second = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        metrics.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert 'rljob_operator_jobs{phase="Succeeded"} 1.0' in first
    busy = 'job_name="busy",job_namespace="team-a"'
    for sample in (f"rljob_operator_job_data_wait_share{{{busy}}} 0.12",
                   f"rljob_operator_job_rollout_tokens_per_second{{{busy}}} 1300.0",
                   f"rljob_operator_job_rollout_tokens_per_second_per_replica{{{busy}}} 650.0",
                   f'rljob_operator_job_stream_entries{{{busy},state="pending"}} 64.0',
                   f'rljob_operator_job_stream_entries{{{busy},state="undelivered"}} 0.0',
                   f"rljob_operator_job_rollout_replicas_reporting{{{busy}}} 2.0"):
        assert sample in first, sample
    assert "rljob_operator_job_rollout_held_share{" not in first  # not reported: no sample, never a 0
    assert 'rljob_operator_job_data_wait_share{job_name="grpo"' not in first  # no capacity block: no samples
    assert 'rljob_operator_jobs{phase="Succeeded"} 2.0' in second
    assert 'rljob_operator_job_restarts{job_name="grpo",job_namespace="team-a"} 3.0' in first
    assert 'rljob_operator_job_restarts{job_name="new",job_namespace="team-b"} 0.0' in second
    assert 'job_name="new"' not in first
    assert "rljob_operator_gang_restarts_total 2.0" in first
    assert 'rljob_operator_reconcile_errors_total{kind="http409"} 1.0' in first
    assert "rljob_operator_reconcile_duration_seconds_count 1.0" in first
