"""`rljob watch`: a live view of one RLTrainingJob's status (phase, step, reward, staleness, conditions, capacity); plain lines
as they change when the output is not a terminal.

Reads only the job object through the API server, so it works on any cluster the kubeconfig reaches.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from rljob_api import constants as c

from rljob_operator.capacity import describe as capacity_line

FINAL_PHASES = {c.Phase.SUCCEEDED.value, c.Phase.FAILED.value}


def get_job(name: str, namespace: str) -> dict[str, Any]:
    """The RLTrainingJob object as a dict.

    Raises:
        kubernetes.client.ApiException: 404 when the job does not exist, or an API error.
    """
    from kubernetes import client

    return client.CustomObjectsApi().get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(job: dict[str, Any]) -> Group:
    """A rich renderable of the job's status: a step bar, a figures table and the conditions."""
    spec, status = job.get("spec", {}), job.get("status", {}) or {}
    max_steps = int(spec.get("trainer", {}).get("maxSteps", 100))
    step = int(status.get("step") or 0)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"))
    bar.add_task(f"{job['metadata']['name']} {status.get('phase', 'Pending')}", total=max_steps, completed=step)

    metrics = status.get("lastMetrics") or {}
    figures = Table(show_header=True, header_style="bold")
    for column in ("attempt", "DP", "documents", "modelVersion", "rollout reward", "train reward",
                   "staleness (mean/max, documents)"):
        figures.add_column(column)
    figures.add_row(
        _fmt(status.get("attempt")),
        _fmt(status.get("dataParallelSize")),
        _fmt(status.get("documentsSeen")),
        _fmt(status.get("modelVersion")),
        _fmt(status.get("rolloutReward")),
        _fmt(metrics.get("train_samples_reward")),
        f"{_fmt(metrics.get('staleness'), 1)} / {_fmt(metrics.get('max_staleness'), 0)}",
    )
    conditions = Table(show_header=True, header_style="bold")
    for column in ("condition", "status", "reason", "message"):
        conditions.add_column(column)
    for cond in status.get("conditions", []):
        conditions.add_row(cond.get("type"), cond.get("status"), cond.get("reason", ""), cond.get("message", ""))
    attempts = Table(show_header=True, header_style="bold")
    for column in ("attempt", "account"):
        attempts.add_column(column)
    for record in (status.get("attempts") or [])[-SHOWN_ATTEMPTS:]:
        attempts.add_row(_fmt(record.get("attempt")), attempt_line(record).split(": ", 1)[1])
    extra = [line for line in (capacity_line(status.get("capacity")), totals_line(status)) if line]
    return Group(bar, figures, conditions, attempts, *extra)


SHOWN_ATTEMPTS = 5
"""Attempts of status.attempts the terminal view shows (the newest)."""


def attempt_line(record: dict[str, Any]) -> str:
    """One record of status.attempts, e.g. ``attempt 1: DP 4, from the checkpoint of step 20, step 31, 64 redelivered;
    ended PodDeleted: trainer pod demo-trainer-1 of attempt 1 was deleted; ...``."""
    loaded = record.get("restoredFromStep")
    parts = [f"DP {_fmt(record.get('dataParallelSize'))}",
             "start not reported" if loaded is None else "from scratch" if loaded == 0
             else f"from the checkpoint of step {loaded}", f"step {_fmt(record.get('step'))}"]
    counts = record.get("documents") or {}
    parts += [f"{n} {what}" for what, n in (("redelivered", counts.get("redelivered")),
                                              ("dead-lettered", sum((counts.get("deadLettered") or {}).values())),
                                              ("dropped too long", counts.get("droppedTooLong"))) if n]
    ended = (f"ended {record.get('reason')}: {record.get('message', '')}" if record.get("endTime")
             else "running")
    return f"attempt {record.get('attempt')}: {', '.join(parts)}; {ended}"


def totals_line(status: dict[str, Any]) -> str:
    """status.documentTotals in words, e.g. ``documents: 64 redelivered, 3 dead-lettered (bad_value 3), 1536 lost with
    the stream (1 loss)``; "" when all are 0."""
    totals = status.get("documentTotals") or {}
    kinds = totals.get("deadLettered") or {}
    parts = [f"{totals[key]} {what}" for key, what in (("redelivered", "redelivered"),
                                                       ("droppedTooLong", "dropped too long"),
                                                       ("droppedStale", "dropped stale"),
                                                       ("lostPending", "lost pending")) if totals.get(key)]
    if kinds:
        parts.append(f"{sum(kinds.values())} dead-lettered ("
                     + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())) + ")")
    if totals.get("streamLosses"):
        losses = totals["streamLosses"]
        parts.append(f"{totals.get('streamLostEntries', 0)} lost with the stream ({losses} "
                     f"{'loss' if losses == 1 else 'losses'})")
    return f"documents: {', '.join(parts)}" if parts else ""


def figures_line(job: dict[str, Any]) -> str:
    """The job's figures on one line, e.g. ``demo Running step 3/40 attempt 1 DP 2 documents 192 modelVersion 192
    rollout reward 0.812 train reward 0.750 staleness 12.5/64`` ("-" where status has no value yet)."""
    spec, status = job.get("spec", {}), job.get("status", {}) or {}
    metrics = status.get("lastMetrics") or {}
    max_steps = int(spec.get("trainer", {}).get("maxSteps", 100))
    return (f"{job['metadata']['name']} {status.get('phase', 'Pending')} step {int(status.get('step') or 0)}/{max_steps}"
            f" attempt {_fmt(status.get('attempt'))} DP {_fmt(status.get('dataParallelSize'))}"
            f" documents {_fmt(status.get('documentsSeen'))} modelVersion {_fmt(status.get('modelVersion'))}"
            f" rollout reward {_fmt(status.get('rolloutReward'))}"
            f" train reward {_fmt(metrics.get('train_samples_reward'))}"
            f" staleness {_fmt(metrics.get('staleness'), 1)}/{_fmt(metrics.get('max_staleness'), 0)}")


def plain_lines(job: dict[str, Any], shown: dict[str, Any], now: str) -> list[str]:
    """What a file or a pipe gets for ``job`` (no live redraw there): the figures line when it changed since the lines
    in ``shown`` (updated), then one line per condition whose status, reason or message changed, per attempt record
    that changed (:func:`attempt_line`), the capacity signals (:func:`rljob_operator.capacity.describe`) and the
    document totals (:func:`totals_line`) when they changed, each prefixed with ``now`` (HH:MM:SS)."""
    lines = []
    figures = figures_line(job)
    if shown.get("figures") != figures:
        shown["figures"] = figures
        lines.append(f"{now} {figures}")
    for cond in (job.get("status") or {}).get("conditions", []):
        told = (cond.get("status"), cond.get("reason", ""), cond.get("message", ""))
        if shown.setdefault("conditions", {}).get(cond.get("type")) != told:
            shown["conditions"][cond.get("type")] = told
            lines.append(f"{now} {job['metadata']['name']} {cond.get('type')}={told[0]} {told[1]}: {told[2]}")
    status = job.get("status") or {}
    for record in status.get("attempts") or []:
        line = attempt_line(record)
        if shown.setdefault("attempts", {}).get(record.get("attempt")) != line:
            shown["attempts"][record.get("attempt")] = line
            lines.append(f"{now} {job['metadata']['name']} {line}")
    for key, line in (("capacity", capacity_line(status.get("capacity"))), ("totals", totals_line(status))):
        if line and shown.get(key) != line:
            shown[key] = line
            lines.append(f"{now} {job['metadata']['name']} {line}")
    return lines


def watch(
    name: str,
    namespace: str,
    *,
    timeout_seconds: float = 3600,
    interval_seconds: float = 2.0,
    console: Optional[Console] = None,
    fetch: Callable[[str, str], dict[str, Any]] = get_job,
    clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S"),
) -> dict[str, Any]:
    """Refresh the view until the job is Succeeded or Failed, then return the final object. On a terminal the view is
    redrawn in place (:func:`render`); to a file or a pipe (``rljob watch JOB > log``) it prints plain lines as they
    change (:func:`plain_lines`, stamped by ``clock``), each written at once.

    Raises:
        TimeoutError: the job did not finish within ``timeout_seconds``.
    """
    console = console or Console()
    deadline = time.monotonic() + timeout_seconds
    job = fetch(name, namespace)
    if not console.is_terminal:
        shown: dict[str, Any] = {}
        while True:
            for line in plain_lines(job, shown, clock()):
                console.out(line, highlight=False)
                console.file.flush()
            if (job.get("status") or {}).get("phase") in FINAL_PHASES:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"RLTrainingJob {namespace}/{name} did not finish within {timeout_seconds:.0f} s")
            time.sleep(interval_seconds)
            job = fetch(name, namespace)
    with Live(render(job), console=console, refresh_per_second=2, transient=False) as live:
        while (job.get("status") or {}).get("phase") not in FINAL_PHASES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"RLTrainingJob {namespace}/{name} did not finish within {timeout_seconds:.0f} s")
            time.sleep(interval_seconds)
            job = fetch(name, namespace)
            live.update(render(job))
    return job
