"""The chart's monitoring objects with `helm template`: the Grafana dashboard ConfigMap, the operator's ServiceMonitor
and the jobs' PodMonitor, each off by default; the PodMonitor's selector and relabelling applied to the pods rljob
renders keep exactly trainer pod 0 and the rollout pods."""

from __future__ import annotations

import json
import re

import pytest

from helm_tools import CHART, helm, helm_binary, render
from operator_helpers import make_job
from rljob_operator import render as rendering

pytestmark = pytest.mark.skipif(
    helm_binary() is None, reason="helm is not built on this machine: run localcluster/build-go-tools.sh helm"
)
MONITORING = {"ConfigMap", "ServiceMonitor", "PodMonitor"}


def _one(objs: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


def test_monitoring_objects_are_rendered_only_when_enabled():
    assert not MONITORING & {o["kind"] for o in render()}
    objs = render("grafanaDashboard.enabled=true", "serviceMonitor.enabled=true", "podMonitor.enabled=true")
    assert MONITORING <= {o["kind"] for o in objs}
    for kind, value in [("ConfigMap", "grafanaDashboard"), ("ServiceMonitor", "serviceMonitor"),
                        ("PodMonitor", "podMonitor")]:
        assert {o["kind"] for o in render(f"{value}.enabled=true")} & MONITORING == {kind}


def test_dashboard_config_map_carries_the_dashboard_and_the_sidecar_label():
    cm = _one(render("grafanaDashboard.enabled=true"), "ConfigMap")
    assert cm["metadata"]["name"] == "rel-rljob-operator-dashboard"
    assert cm["metadata"]["namespace"] == "rljob-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in cm["metadata"]
    assert json.loads(cm["data"]["rljob.json"]) == json.loads((CHART / "dashboards" / "rljob.json").read_text())

    cm = _one(render("grafanaDashboard.enabled=true", "grafanaDashboard.namespace=monitoring",
                     "grafanaDashboard.annotations.grafana_folder=rljob", "grafanaDashboard.labels.team=ml"),
              "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "rljob"}
    assert cm["metadata"]["labels"]["team"] == "ml" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_service_monitor_selects_only_the_operator_metrics_service():
    objs = render("serviceMonitor.enabled=true", "serviceMonitor.interval=1m", "serviceMonitor.labels.release=prom")
    monitor = _one(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["rljob-system"]}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [o for o in objs if o["kind"] == "Service" and wanted.items() <= o["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["rel-rljob-operator-metrics"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "1m"}
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}


def test_service_monitor_without_the_metrics_service_fails_with_the_reason():
    result = helm("template", "rel", str(CHART), "--set", "serviceMonitor.enabled=true", "--set",
                  "metrics.service=false", check=False)
    assert result.returncode != 0
    assert "serviceMonitor.enabled needs metrics.service: true" in result.stderr


def _selected(monitor: dict, labels: dict[str, str]) -> bool:
    selector = monitor["spec"]["selector"]
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expression in selector["matchExpressions"]:
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _kept(endpoint: dict, labels: dict[str, str]) -> bool:
    """Prometheus's keep relabelling on the pod's labels (meta label names sanitised as Kubernetes SD does; a
    Prometheus regex is anchored at both ends)."""
    meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in labels.items()}
    for rule in endpoint["relabelings"]:
        assert rule["action"] == "keep", rule
        value = rule["separator"].join(meta.get(name, "") for name in rule["sourceLabels"])
        if not re.fullmatch(rule["regex"], value):
            return False
    return True


def test_pod_monitor_scrapes_trainer_pod_zero_and_every_rollout_pod():
    monitor = _one(render("podMonitor.enabled=true"), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podTargetLabels"] == ["rljob.dev/job-name", "rljob.dev/role"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")

    job = make_job(trainer={"nodes": 3}, rollout={"replicas": 2})
    config = rendering.job_config(job)
    pods = [rendering.trainer_pod(job, config, i, attempt=1) for i in range(3)]
    pods += [rendering.rollout_pod(job, config, i) for i in range(2)]
    redis = rendering.redis_deployment(job, config)["spec"]["template"]
    scraped = [p["metadata"]["name"] for p in pods + [redis]
               if _selected(monitor, p["metadata"]["labels"]) and _kept(endpoint, p["metadata"]["labels"])]
    assert scraped == ["demo-trainer-0", "demo-rollout-0", "demo-rollout-1"]
    for pod in pods:
        if pod["metadata"]["name"] in scraped:
            (container,) = pod["spec"]["containers"]
            assert endpoint["port"] in {p["name"] for p in container["ports"]}
            assert {"rljob.dev/job-name", "rljob.dev/role"} <= pod["metadata"]["labels"].keys()

    watched = _one(render("podMonitor.enabled=true", "watchNamespaces={team-a,team-b}", "peering.enabled=false"),
                   "PodMonitor")
    assert watched["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


@pytest.mark.parametrize("bad", ["podMonitor.interval=soon", "serviceMonitor.interval=30", "grafanaDashboard.folder=x",
                                 "grafanaDashboard.namespace=Not_A_Namespace"])
def test_values_schema_rejects_bad_monitoring_values(bad):
    result = helm("template", "rel", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in result.stderr
