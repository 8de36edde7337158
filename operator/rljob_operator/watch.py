"""`rljob watch`: a live view of one RLTrainingJob's status (phase, step, reward, staleness, conditions).

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
    return Group(bar, figures, conditions)


def watch(
    name: str,
    namespace: str,
    *,
    timeout_seconds: float = 3600,
    interval_seconds: float = 2.0,
    console: Optional[Console] = None,
    fetch: Callable[[str, str], dict[str, Any]] = get_job,
) -> dict[str, Any]:
    """Refresh the view until the job is Succeeded or Failed, then return the final object.

    Raises:
        TimeoutError: the job did not finish within ``timeout_seconds``.
    """
    console = console or Console()
    deadline = time.monotonic() + timeout_seconds
    job = fetch(name, namespace)
    with Live(render(job), console=console, refresh_per_second=2, transient=False) as live:
        while (job.get("status") or {}).get("phase") not in FINAL_PHASES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"RLTrainingJob {namespace}/{name} did not finish within {timeout_seconds:.0f} s")
            time.sleep(interval_seconds)
            job = fetch(name, namespace)
            live.update(render(job))
    if not console.is_terminal:  # Live ends a terminal's last frame with a newline, not a file's or a pipe's
        console.line()
    return job
