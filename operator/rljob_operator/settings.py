"""kopf settings and the operator's startup/cleanup, in one place.

Peering (two replicas, one active): kopf peering is not leader election — operators of *equal* priority all
pause. So every replica draws a random priority at start (:func:`draw_priority`); the highest live one
works, the others stay paused and resume when its peering record disappears (removed on a clean exit,
expired ``peering_lifetime_s`` after a crash). Peering uses the cluster-scoped ``ClusterKopfPeering``
object named by ``--peering`` (the Helm chart installs its CRD and the object); ``--standalone`` runs
without peering (one replica, or local development).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Optional

import kopf

from rljob_api import constants as c

from rljob_operator.kube_api import KubeApi
from rljob_operator.operator_metrics import OperatorMetrics
from rljob_operator.runtime import Context
from rljob_operator.job_status import Event

FINALIZER = f"{c.GROUP}/finalizer"
"""Held by kopf on every job while the operator runs its per-job daemon; delete jobs before uninstalling."""
CLOSE_TIMEOUT_S = 10.0
"""How long cleanup waits for the per-job loops to finish their pass (seconds)."""
CHILD_LABEL_SELECTOR = c.LABEL_JOB_NAME
"""Server-side label selector of the child watches (pods, Deployments): only this operator's children."""


@dataclass
class OperatorOptions:
    """What ``rljob operator`` passes to the startup handler (through kopf's memo).

    ``namespaces`` empty = all namespaces. Intervals and lifetimes in seconds.
    """

    namespaces: tuple[str, ...] = ()
    metrics_port: Optional[int] = 9090
    kubeconfig: Optional[str] = None
    active_interval_s: float = 5.0
    idle_interval_s: float = 60.0
    peering_lifetime_s: int = 30
    read_progress: bool = True


def draw_priority() -> int:
    """A random peering priority in [1, 2**30): distinct replicas practically never tie."""
    return random.randrange(1, 2**30)


def post_event(body, event: Event) -> None:
    """Post ``event`` on the job through kopf's event queue (asynchronous, best effort)."""
    kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Apply rljob's kopf settings, connect to the API server and start the metrics endpoint."""
    options: OperatorOptions = memo.get("options") or OperatorOptions()
    # Progress and the last-handled spec live in annotations under rljob.dev/; status is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    # kopf puts a finalizer on every job while its daemon runs, so the daemon stops before the job goes.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    settings.peering.clusterwide = True
    settings.peering.lifetime = options.peering_lifetime_s
    settings.peering.stealth = True
    settings.posting.reporting_component = c.FIELD_MANAGER
    # Watch streams are re-established every 5 minutes at most, and considered dead after 10 s of
    # silence beyond that; connecting must not hang an operator forever.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 310
    settings.watching.connect_timeout = 10
    for resource in (("v1", "pods"), ("apps", "v1", "deployments")):
        settings.watching.label_selectors[resource] = CHILD_LABEL_SELECTOR
    # A handler error is retried after these delays (seconds) unless it says otherwise.
    settings.execution.default_backoff = 10

    metrics = OperatorMetrics()
    api = await KubeApi.connect(options.kubeconfig, on_request=metrics.count_request)
    memo["api"] = api
    memo["metrics"] = metrics
    memo["jobs"] = {}
    # kopf hands every job a shallow copy of this memo: shared state must be a mutable object made here.
    memo["closing"] = asyncio.Event()
    memo["context"] = Context(
        api=api,
        post_event=post_event,
        on_restart=metrics.gang_restarts.inc,
        active_interval_s=options.active_interval_s,
        idle_interval_s=options.idle_interval_s,
        read_progress=options.read_progress,
    )
    if options.metrics_port is not None:
        namespaces = options.namespaces or (None,)

        async def list_jobs() -> list[dict[str, Any]]:
            jobs: list[dict[str, Any]] = []
            for namespace in namespaces:
                jobs += await api.list(c.API_VERSION, c.KIND, namespace)
            return jobs

        port = metrics.serve(options.metrics_port, list_jobs, asyncio.get_running_loop())
        logger.info("metrics on port %d", port)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Let the per-job loops finish their pass and exit (kopf runs cleanup before it stops daemons), then
    close the shared Redis clients, stop the metrics endpoint and close the API client."""
    if "closing" in memo:
        memo["closing"].set()
    jobs = memo.get("jobs", {})
    deadline = asyncio.get_running_loop().time() + CLOSE_TIMEOUT_S
    while any(runtime.looping for runtime in jobs.values()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if any(runtime.looping for runtime in jobs.values()):
        logger.warning("job loops still running after %s s; closing anyway", CLOSE_TIMEOUT_S)
    if "context" in memo:
        await memo["context"].redis_clients.close()
    if "metrics" in memo:
        memo["metrics"].stop()
    if "api" in memo:
        await memo["api"].close()
