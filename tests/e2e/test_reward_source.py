"""A custom reward without a custom image (issue 12, items 2 and 7): ``examples/rljob-cpu-configmap-reward.yaml``, whose
reward code, a helper module it imports and the prompts live in one ConfigMap, which the rollout pod mounts
(spec.rollout.task.rewardSource.configMapKeyRef) and loads as rewardFunction's module, trains to Succeeded on the local
nodes. An edit of the ConfigMap while the job runs replaces the rollout pod, whose new reward reaches
status.rolloutReward, and no trainer pod."""

from __future__ import annotations

import pytest
import yaml
from rljob_api import constants as c

from .conftest import EXAMPLES, wait_for

pytestmark = pytest.mark.e2e

EXAMPLE = "rljob-cpu-configmap-reward.yaml"
EDITED_OFFSET = 10.0
"""What the edited helper adds to every reward: the new code's rewards are at least this, the example's at most 1."""
EDITED_SCORING = f"""def share(text: str, letter: str) -> float:
    return {EDITED_OFFSET} + (text.count(letter) / len(text) if text else 0.0)
"""


def test_the_configmap_reward_example_trains_to_succeeded_and_an_edit_of_it_replaces_only_the_rollout_pod(
        cluster, operator, namespace, diagnostics):
    documents = [d for d in yaml.safe_load_all((EXAMPLES / EXAMPLE).read_text()) if d]
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    (manifest,) = [d for d in documents if d["kind"] == c.KIND]
    name, steps = manifest["metadata"]["name"], manifest["spec"]["trainer"]["maxSteps"]
    diagnostics.job = name

    def job() -> dict:
        return cluster.get("rljob", name, "-n", namespace) or {}

    def pods(role: str) -> list[dict]:
        return [p for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}={role}")
                if not p["metadata"].get("deletionTimestamp")]

    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / EXAMPLE))
    first = wait_for(lambda: (j := job()) and (j.get("status") or {}).get("step", 0) >= 2
                     and j["status"].get("rolloutReward") is not None and j, 600,
                     "two steps trained on the ConfigMap's reward", diagnostics)
    assert first["status"]["phase"] == "Running", first["status"]
    assert 0.0 <= first["status"]["rolloutReward"] <= 1.0, first["status"]
    (rollout,) = pods("rollout")
    volumes = {v["name"]: v for v in rollout["spec"]["volumes"]}
    assert volumes["reward-source"]["configMap"]["name"] == config_map["metadata"]["name"]
    trainers = {p["metadata"]["uid"] for p in pods("trainer")}
    assert len(trainers) == 2

    config_map["data"]["scoring.py"] = EDITED_SCORING
    cluster.apply(config_map, namespace)
    edited = wait_for(lambda: (j := job()) and ((j.get("status") or {}).get("rolloutReward") or 0) >= EDITED_OFFSET
                      and j, 600, "a reward of the edited ConfigMap in status.rolloutReward", diagnostics)
    assert edited["status"]["phase"] == "Running", edited["status"]
    assert {p["metadata"]["uid"] for p in pods("trainer")} == trainers  # the gang the edit found, still running
    (replaced,) = pods("rollout")
    assert replaced["metadata"]["uid"] != rollout["metadata"]["uid"]
    assert (replaced["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH]
            != rollout["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH])

    final = wait_for(lambda: (j := job()) and (j.get("status") or {}).get("phase") in ("Succeeded", "Failed") and j,
                     900, "the job to finish", diagnostics)
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert (status["step"], status["restarts"], status["attempt"], status["failedAttempts"]) == (steps, 0, 0, 0), status
    assert status["rolloutReward"] >= EDITED_OFFSET
