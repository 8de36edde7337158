"""A job deleted and applied again at once under the same name (``kubectl delete -f; kubectl apply -f``): the new
job waits until the garbage collector has removed the old one's children instead of adopting them, and ends up
owning a complete set of its own. Suspended, so nothing trains."""

from __future__ import annotations

import pytest

from rljob_api import constants as c

from .conftest import children, get_job, job_manifest, phase, wait_for

pytestmark = pytest.mark.e2e


def _owners(cluster, namespace: str, kind: str, name: str) -> list[str]:
    obj = cluster.get(kind, name, "-n", namespace) or {}
    return [ref["uid"] for ref in obj.get("metadata", {}).get("ownerReferences") or [] if ref.get("controller")]


def test_same_name_recreated_at_once_gets_its_own_children(cluster, operator, namespace, diagnostics):
    name = "again"
    diagnostics.job = name
    manifest = job_manifest(name, {"runPolicy": {"suspend": True}})
    cluster.apply(manifest, namespace)
    wait_for(lambda: (kids := children(cluster, namespace, name))["deployments"] and kids["secrets"]
             and any(n.startswith(f"{name}-redis-") for n, _ in kids["pods"]),
             120, "the first job's Redis", diagnostics)
    old_uid = get_job(cluster, namespace, name)["metadata"]["uid"]
    old_secret = children(cluster, namespace, name)["secrets"]

    cluster.kubectl("delete", "rljob", name, "-n", namespace, "--wait=true", "--timeout=60s")
    cluster.apply(manifest, namespace)
    new_uid = get_job(cluster, namespace, name)["metadata"]["uid"]
    assert new_uid != old_uid

    def settled():
        kids = children(cluster, namespace, name)
        redis_pods = [n for n, _ in kids["pods"] if n.startswith(f"{name}-redis-")]
        return (phase(get_job(cluster, namespace, name)) == "Suspended" and len(kids["deployments"]) == 1
                and len(kids["secrets"]) == 1 and len(redis_pods) == 1 and kids)

    kids = wait_for(settled, 180, "the new job to settle with one set of children", diagnostics)
    for kind, objs in (("configmap", kids["configmaps"]), ("service", kids["services"]),
                       ("secret", kids["secrets"]), ("deployment", kids["deployments"])):
        for child, _ in objs:
            assert _owners(cluster, namespace, kind, child) == [new_uid], (kind, child)
    assert kids["secrets"] != old_secret  # a new password Secret, not the old one kept alive
    job = get_job(cluster, namespace, name)
    assert job["status"]["restarts"] == 0 and job["status"]["failedAttempts"] == 0
    assert next(cd for cd in job["status"]["conditions"]
                if cd["type"] == c.ConditionType.VALID.value)["status"] == "True"
