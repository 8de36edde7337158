"""The ConfigMap of ``spec.rollout.task.rewardSource.configMapKeyRef`` as a pass sees it: whether the rollout pods can
load the reward module from it, and a hash of its content, so that rollout pods made from other content are replaced.

Read with one GET per pass of a job that names one. There is no ConfigMap watch (a cluster holds many ConfigMaps, few
of them rljob's), so an edit is seen at the job's next pass, within ``--active-interval``. The kubelet mounts the
content it finds when a pod starts, so a rollout pod whose ``rljob.dev/reward-source-hash`` differs from the current
content is deleted and made again (:class:`~rljob_operator.gang.ConfigHashes`): every rollout pod runs the code the
ConfigMap holds now, and the trainer gang never restarts for it. A path on a volume is not read: its rollout pods keep
the code they loaded at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rljob_api.canonical import canonical_hash
from rljob_api.spec import RLTrainingJobSpec

from rljob_operator.runtime import Context

FIELD = "spec.rollout.task.rewardSource.configMapKeyRef"


@dataclass(frozen=True)
class RewardSourceState:
    """``hash``: short sha256 of the ConfigMap's ``data`` and ``binaryData`` (the rollout pods' label), None when the
    job has no ConfigMap source or it does not exist (then the pods that run are kept: they hold the code they loaded).
    ``problem``: RolloutReady's message while the reward module cannot be loaded from it (the ConfigMap or its key
    missing), None otherwise."""

    hash: Optional[str] = None
    problem: Optional[str] = None


def reward_source_state(spec: RLTrainingJobSpec, namespace: str,
                        config_map: Optional[Mapping[str, Any]]) -> RewardSourceState:
    """The :class:`RewardSourceState` of ``spec``'s ConfigMap source, given the ConfigMap as the API server returned it
    (None: not found)."""
    source = spec.rollout.task.reward_source
    ref = source.config_map_key_ref if source is not None else None
    if ref is None:
        return RewardSourceState()
    if config_map is None:
        return RewardSourceState(problem=(
            f"ConfigMap {ref.name} ({FIELD}) not found in namespace {namespace}: rollout pods cannot start until it "
            "exists (running ones keep the reward code they loaded)"))
    data, binary = config_map.get("data") or {}, config_map.get("binaryData") or {}
    content_hash = canonical_hash({"data": data, "binaryData": binary}, digits=16)
    if ref.key not in data and ref.key not in binary:
        keys = ", ".join(sorted([*data, *binary])) or "none"
        return RewardSourceState(content_hash, (
            f"ConfigMap {ref.name} has no key {ref.key} ({FIELD}.key; its keys: {keys}): rollout pods cannot load the "
            "reward module until it exists"))
    return RewardSourceState(content_hash)


async def read_reward_source(spec: RLTrainingJobSpec, namespace: str, ctx: Context) -> RewardSourceState:
    """:func:`reward_source_state` of the ConfigMap ``spec`` names, read now (one GET; none without a ConfigMap
    source or rollout pods).

    Raises:
        ApiError: a refused read other than 404.
    """
    source = spec.rollout.task.reward_source
    if source is None or source.config_map_key_ref is None or spec.rollout.replicas == 0:
        return RewardSourceState()
    found = await ctx.api.get("v1", "ConfigMap", namespace, source.config_map_key_ref.name)
    return reward_source_state(spec, namespace, found)
