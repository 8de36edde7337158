"""Helpers shared by the operator tests: spec builders and pod views (plain data, no cluster)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


from rljob_api.spec import RLTrainingJobSpec

from rljob_operator import render
from rljob_operator.observe import PodView

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def make_spec(**overrides: Any) -> RLTrainingJobSpec:
    """A spec from camelCase overrides, e.g. make_spec(trainer={"nodes": 2})."""
    return RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}, **overrides})


def make_job(name: str = "demo", namespace: str = "ns", labels: dict | None = None, **overrides: Any) -> render.Job:
    return render.Job(name, namespace, make_spec(**overrides), labels or {})


def trainer(index: int, attempt: int, phase: str = "Running", config_hash: str = "h1", **kw: Any) -> PodView:
    kw.setdefault("uid", f"t{index}-{attempt}")
    return PodView(name=f"demo-trainer-{index}", role="trainer", index=index, attempt=attempt,
                   config_hash=config_hash, phase=phase, **kw)


def rollout(index: int, phase: str = "Running", config_hash: str = "h1", **kw: Any) -> PodView:
    kw.setdefault("uid", f"r{index}")
    return PodView(name=f"demo-rollout-{index}", role="rollout", index=index, attempt=None,
                   config_hash=config_hash, phase=phase, ready=phase == "Running", **kw)


# --- raw pods as the kubelet reports them (what observe.pod_view reads) --------------------------------------------
def kubelet_pod(role: str, index: int, phase: str, attempt: int | None = None, **container: Any) -> dict:
    """Pod ``demo-<role>-<index>`` whose one container (``role``) has the given status fields (``state``,
    ``lastState``, ``restartCount``), as the kubelet writes them: scheduled, Ready while the container runs."""
    running = "running" in container.get("state", {})
    labels = {"rljob.dev/role": role, "rljob.dev/replica-index": str(index), "rljob.dev/config-hash": "h1"}
    if attempt is not None:
        labels["rljob.dev/attempt"] = str(attempt)
    return {
        "metadata": {"name": f"demo-{role}-{index}", "uid": f"{role[0]}{index}", "labels": labels},
        "status": {
            "phase": phase,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True" if running else "False",
                            **({} if running else {"reason": "ContainersNotReady"})}],
            "containerStatuses": [{"name": role, "image": "rljob/trainer-cpu:0.1.0", "imageID": "",
                                   "ready": running, "started": running, "restartCount": 0, **container}],
        },
    }


def kubelet_rollout_pod(**container: Any) -> dict:
    """Rollout pod 0 (restartPolicy OnFailure: phase Running while its container restarts)."""
    return kubelet_pod("rollout", 0, "Running", **container)


NO_DATASET = ("2026-01-01 12:00:03,120 INFO rljob_rollout: loading the tiny model\n"
              "2026-01-01 12:00:03,512 ERROR rljob_rollout.__main__: rollout: cannot start: "
              "spec.rollout.task.datasetPath: no file at '/data/nope.jsonl'\n")
CRASHED = {"terminated": {"exitCode": 2, "reason": "Error", "message": NO_DATASET,
                          "startedAt": "2026-01-01T12:00:02Z", "finishedAt": "2026-01-01T12:00:04Z"}}
