"""How many rollout replicas a job runs, and the autoscaler's turn in a reconcile pass (issue 28, DESIGN §6).

Without ``spec.rollout.autoscaling`` a job runs ``spec.rollout.replicas`` (as written, or as ``kubectl scale`` set it
through the ``/scale`` subresource). With it, the operator keeps the count it runs in ``status.autoscaling.replicas``
and never writes the spec, so a GitOps tool that owns the spec (Argo CD, Flux) has nothing to fight over;
``spec.rollout.replicas`` is then the count the job starts with, clamped to ``[minReplicas, maxReplicas]``.

Each pass of a running job reads the capacity signals from ``status.capacity`` (:func:`.capacity.signals`) and asks the law
(:func:`rljob_operator.autoscale.decide`); a change is written to ``status.autoscaling`` with the pass's status and
told in a ``RolloutsScaled`` Event carrying the law's reason (the numbers it used); the pods follow in the next pass,
like any change of the replica count (pods above it are deleted, SIGTERM: DESIGN §6 "Rollouts that come and go").
A change of replicas replaces no trainer pod; under Kueue the rollout pod set asks for ``maxReplicas``
(:func:`quota_replicas`), so scaling between the bounds never changes the Workload.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Optional

from rljob_api.spec import RLTrainingJobSpec
from rljob_api.status import AutoscalingStatus

from rljob_operator import autoscale

def replicas_to_run(spec: RLTrainingJobSpec, autoscaling: Optional[AutoscalingStatus]) -> int:
    """The rollout replicas the job runs: ``spec.rollout.replicas``, or with autoscaling the status's count (the spec's
    clamped to the bounds before the first decision, or when the bounds moved)."""
    auto = spec.rollout.autoscaling
    if auto is None:
        return spec.rollout.replicas
    count = autoscaling.replicas if autoscaling is not None else spec.rollout.replicas
    return min(max(count, auto.min_replicas), auto.max_replicas)


def quota_replicas(spec: RLTrainingJobSpec) -> int:
    """The rollout pod set's count in a Kueue Workload: what the job may grow to (``maxReplicas``) with autoscaling,
    else ``spec.rollout.replicas``."""
    auto = spec.rollout.autoscaling
    return spec.rollout.replicas if auto is None else auto.max_replicas


def with_replicas(spec: RLTrainingJobSpec, replicas: int) -> RLTrainingJobSpec:
    """``spec`` with ``spec.rollout.replicas`` = ``replicas`` (the pass plans, renders and reports with it)."""
    if spec.rollout.replicas == replicas:
        return spec
    return spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"replicas": replicas})})


def policy(spec: RLTrainingJobSpec) -> autoscale.Policy:
    """The law's policy from ``spec.rollout.autoscaling`` (its band, held share and step at the law's defaults).

    Raises:
        ValueError: no autoscaling in ``spec``.
    """
    auto = spec.rollout.autoscaling
    if auto is None:
        raise ValueError("spec.rollout.autoscaling is not set")
    return autoscale.Policy(auto.min_replicas, auto.max_replicas, target_wait_share=auto.target_data_wait_share,
                            cooldown_s=float(auto.cooldown_seconds))


def decide(spec: RLTrainingJobSpec, current: Optional[AutoscalingStatus], replicas: int,
           measured: Optional[autoscale.Signals], now: datetime,
           started: Optional[datetime]) -> tuple[AutoscalingStatus, Optional[autoscale.Decision]]:
    """The autoscaler's turn: the status to write and the law's decision (None when it was not asked: no signals).

    Args:
        spec: the job's spec, with autoscaling.
        current: ``status.autoscaling`` as stored (None before the first pass with autoscaling).
        replicas: the count the pass runs (:func:`replicas_to_run`).
        measured: :func:`.capacity.signals` of the pass's status, or None.
        now: the pass's time.
        started: when the rollouts started counting for the cooldown before any change (the job's start), if known.

    Raises:
        ValueError: no autoscaling in ``spec``.
    """
    law = policy(spec)
    kept = AutoscalingStatus(replicas=replicas, last_change_time=current.last_change_time if current else None,
                             last_decision=current.last_decision if current else None)
    if measured is None:
        return kept, None
    since = kept.last_change_time or started
    since_s = math.inf if since is None else max(0.0, (now - since).total_seconds())
    decision = autoscale.decide(law, replicas, since_s, measured)
    if not decision.changed:  # a hold is not written: its numbers change every pass, the status would with them
        return kept, decision
    return AutoscalingStatus(replicas=decision.replicas, last_change_time=now, last_decision=decision.reason), decision
