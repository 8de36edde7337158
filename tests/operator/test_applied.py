"""Which children a restarted operator applies again: only those missing, rendered differently or edited since."""

from __future__ import annotations

import copy

from rljob_api import constants as c

from rljob_operator import applied_hash, render
from rljob_operator.kube_api import adopt

from operator_helpers import make_job


def _children(owner: dict, **overrides) -> list[dict]:
    job = make_job(**overrides)
    children = render.static_children(job, render.job_config(job))
    adopt(children, owner)
    return [applied_hash.stamp(child) for child in children]


def _as_served(manifest: dict) -> dict:
    """``manifest`` the way the API server returns it: server fields and defaults added, our fields kept."""
    live = copy.deepcopy(manifest)
    live["metadata"].update(uid="u-1", resourceVersion="42", creationTimestamp="2026-01-01T00:00:00Z",
                            managedFields=[{"manager": c.FIELD_MANAGER, "operation": "Apply"}])
    live["metadata"]["annotations"]["other.example/note"] = "kept"
    if live["kind"] == "Service":
        live["spec"].update(clusterIPs=["None"], ipFamilies=["IPv4"], sessionAffinity="None", type="ClusterIP")
        if not live["spec"]["publishNotReadyAddresses"]:  # omitempty: a false is not served
            del live["spec"]["publishNotReadyAddresses"]
    if live["kind"] == "Deployment":
        live["spec"].update(revisionHistoryLimit=10, progressDeadlineSeconds=600)
        container = live["spec"]["template"]["spec"]["containers"][0]
        container["readinessProbe"].update(timeoutSeconds=1, successThreshold=1, failureThreshold=3)
        container["terminationMessagePath"] = "/dev/termination-log"
        live["status"] = {"readyReplicas": 1}
    return live


def test_the_stamp_is_a_hash_of_the_manifest_without_itself(owner):
    config_map, service, *_ = _children(owner)
    stamped = config_map["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH]
    assert len(stamped) == 16 and int(stamped, 16) >= 0
    assert applied_hash.manifest_hash(config_map) == stamped  # the annotation does not hash itself
    assert service["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH] != stamped
    other_job = _children(owner, trainer={"maxSteps": 7})[0]  # another config.json
    assert other_job["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH] != stamped


def test_children_as_the_api_server_serves_them_are_not_applied_again(owner):
    children = _children(owner)
    assert [ch["kind"] for ch in children] == ["ConfigMap", "Service", "Service", "Deployment"]
    for child in children:
        assert not applied_hash.outdated(_as_served(child), child), child["kind"]


def test_missing_changed_edited_or_unstamped_children_are_applied(owner):
    config_map, trainer_service, *_ = _children(owner)
    assert applied_hash.outdated(None, config_map)

    changed = _children(owner, trainer={"maxSteps": 7})[0]  # the spec changed while no operator ran
    assert applied_hash.outdated(_as_served(config_map), changed)

    edited = _as_served(config_map)
    edited["data"][c.CONFIG_FILE_NAME] = "{}"  # someone edited a field the operator sets
    assert applied_hash.outdated(edited, config_map)
    fewer_ports = _as_served(trainer_service)
    fewer_ports["spec"]["ports"].pop()
    assert applied_hash.outdated(fewer_ports, trainer_service)
    relabelled = _as_served(trainer_service)
    relabelled["metadata"]["labels"][c.LABEL_ROLE] = "rollout"
    assert applied_hash.outdated(relabelled, trainer_service)

    unstamped = _as_served(config_map)  # applied by an operator version without the stamp
    del unstamped["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH]
    assert applied_hash.outdated(unstamped, config_map)


def test_contains_compares_mappings_as_subsets_and_lists_item_by_item():
    assert applied_hash.contains({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}, "x": 0}, {"a": 1, "b": {"c": [1, {"d": 2}]}})
    assert not applied_hash.contains({"a": 1}, {"a": 1, "b": 2})
    assert not applied_hash.contains({"a": [1, 2, 3]}, {"a": [1, 2]})
    assert not applied_hash.contains({"a": [2, 1]}, {"a": [1, 2]})
    assert not applied_hash.contains({"a": "1"}, {"a": 1})
    assert not applied_hash.contains({"a": None}, {"a": {}})
    assert applied_hash.contains({}, {"flag": False, "n": 0, "s": "", "m": {}, "l": []})  # omitted zero values
    assert not applied_hash.contains({}, {"flag": True}) and not applied_hash.contains({}, {"m": {"k": 0}})
