"""The Helm chart: `helm lint --strict`, `helm template`, least-privilege RBAC, the Deployment's hardening."""

from __future__ import annotations

import pytest

from helm_tools import CHART, helm, helm_binary, render

pytestmark = pytest.mark.skipif(
    helm_binary() is None, reason="helm is not built on this machine: run localcluster/build-go-tools.sh helm"
)

NAMESPACED_RULES = {
    ("rljob.dev", "rltrainingjobs"): {"list", "watch", "patch", "delete"},
    ("rljob.dev", "rltrainingjobs/status"): {"patch"},
    ("rljob.dev", "rltrainingjobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch", "delete"},
    ("", "secrets"): {"get", "create"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"get", "create", "delete"},
    ("", "events"): {"create", "list"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch", "create", "patch", "delete"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
}
CLUSTER_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "nodes"): {"get"},
    ("kopf.dev", "clusterkopfpeerings"): {"list", "watch", "patch"},
    ("kueue.x-k8s.io", "resourceflavors"): {"get"},
    ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
}


def _rules(obj: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in obj["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert "*" not in (group, resource) and "*" not in rule["verbs"]
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_lint_strict_passes():
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


def test_default_render_is_cluster_wide_with_peering_and_exact_rbac():
    objs = render()
    assert sorted(o["kind"] for o in objs) == [
        "ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount"
    ]
    (role,) = _kind(objs, "ClusterRole")
    assert _rules(role) == {**CLUSTER_RULES, **NAMESPACED_RULES}
    (binding,) = _kind(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-rljob-operator", "namespace": "rljob-system"}]
    (deployment,) = _kind(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == [
        "rljob", "operator", "--all-namespaces", "--peering=rljob-operator", "--liveness-port=8080",
        "--metrics-port=9090", "--active-interval=5", "--idle-interval=60",
    ]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["serviceAccountName"] == "rel-rljob-operator"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}
    }
    assert container["resources"]["requests"] and container["resources"]["limits"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert _kind(objs, "ClusterKopfPeering")[0]["metadata"]["name"] == "rljob-operator"


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_cluster_needs():
    objs = render("watchNamespaces={team-a,team-b}", "peering.enabled=false", "replicas=1")
    roles = _kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(_rules(r) == NAMESPACED_RULES for r in roles)
    assert sorted(b["metadata"]["namespace"] for b in _kind(objs, "RoleBinding")) == ["team-a", "team-b"]
    (cluster_role,) = _kind(objs, "ClusterRole")
    assert _rules(cluster_role) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "nodes"): {"get"},
        ("", "namespaces"): {"list", "watch"},
        ("kueue.x-k8s.io", "resourceflavors"): {"get"},
        ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
    }
    command = _kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--namespace=team-a" in command and "--namespace=team-b" in command
    assert "--all-namespaces" not in command and not any(a.startswith("--peering") for a in command)
    assert not _kind(objs, "ClusterKopfPeering")


@pytest.mark.parametrize("bad", ["replicas=2,peering.enabled=false", "unknownKey=1", "metrics.port=0",
                                 "watchNamespaces={Bad_NS}"])
def test_values_schema_rejects_bad_values(bad):
    result = helm("template", "rel", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in result.stderr
