"""The Grafana dashboard (helm/rljob-operator/dashboards/rljob.json) against the metrics the code exports: every
series a panel or variable names is in the operator's, the trainer's or the rollout's Prometheus registry (imported
and instantiated here, not grepped), every label value it selects on is one the trainer reports, and the dashboard
covers what a user watches a job by."""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import promql_parser
import pytest
import redis
from prometheus_client import CollectorRegistry

from rljob_api.config import RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_operator.operator_metrics import JobsCollector, OperatorMetrics
from rljob_rollout.worker_metrics import RolloutMetrics
from rljob_trainer.metrics_registry import STREAM_COUNTERS, record_metric_names
from rljob_trainer.progress_report import RankZeroProgress

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "rljob-operator" / "dashboards" / "rljob.json"
SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count",
                                                                                      "_created")}
"""The series a metric family of each type exposes (prometheus-client's text format)."""
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<expr>.+),\s*)?(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")


def series_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry's metric families expose (their samples' names, by family type)."""
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
    return names


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The series of the operator (its metric objects and the jobs collector, run against a loop), of trainer rank 0
    (its progress reporter, serving on a free local port) and of a rollout worker."""
    names = series_names(OperatorMetrics().registry)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def list_jobs():
        return []

    jobs = CollectorRegistry()
    jobs.register(JobsCollector(list_jobs, loop))
    try:
        names |= series_names(jobs)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()

    config = resolve("demo", "ns", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}),
                     RedisConnection(host="127.0.0.1")).model_copy(update={"metrics_port": 0})
    progress = RankZeroProgress(config, redis.Redis(host="127.0.0.1", port=1), stdout=io.StringIO())
    try:
        names |= series_names(progress.registry)
    finally:
        progress.close()
    return names | series_names(RolloutMetrics().registry)


@dataclass(frozen=True)
class Selector:
    """One series selector of the dashboard: where it is, the series name and its label matchers."""

    where: str
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (``label_values(expr, label)``'s expr)."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match, f"variable {variable['name']}: not label_values(...): {variable['query']['query']}"
            if match["expr"]:
                found.append((f"variable {variable['name']}", match["expr"]))
    return found


def selectors(dashboard: dict) -> list[Selector]:
    """Every series selector in the dashboard's PromQL, parsed by promql-parser (Grafana's interval variables given
    a value first: they stand where PromQL wants a duration)."""
    out = []
    for where, expr in expressions(dashboard):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        ast = promql_parser.parse(expr)

        def visit(node, where=where):
            if isinstance(node, promql_parser.VectorSelector):
                matchers = tuple((m.name, str(m.op).rpartition(".")[2], m.value) for m in node.matchers.matchers)
                out.append(Selector(where, node.name, matchers))

        promql_parser.walk(ast, visit)
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_series_the_dashboard_reads_is_exported(dashboard, exported):
    found = selectors(dashboard)
    assert len(found) >= 30, len(found)
    missing = sorted({(s.where, s.name) for s in found if s.name not in exported})
    assert not missing, f"series no registry exports: {missing}\nexported: {sorted(exported)}"


def test_every_label_value_the_dashboard_selects_is_reported(dashboard):
    """``rljob_trainer_metric{name=...}`` names a step record's metric, ``rljob_trainer_stream{counter=...}`` a reader
    counter; the other matchers are the scrape's job filters (Grafana variables)."""
    allowed = {("rljob_trainer_metric", "name"): record_metric_names(),
               ("rljob_trainer_stream", "counter"): frozenset(STREAM_COUNTERS)}
    for s in selectors(dashboard):
        for label, op, value in s.matchers:
            if (s.name, label) in allowed:
                assert op == "Equal" and value in allowed[s.name, label], (s.where, label, op, value)
            else:
                assert op == "Re" and value.startswith("$"), (s.where, s.name, label, op, value)


def test_every_datasource_is_the_prometheus_variable(dashboard):
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (variable["name"], variable["query"]) == ("datasource", "prometheus")
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


COVERED = {
    "step rate": ("rljob_trainer_step", None),
    "train reward": ("rljob_trainer_metric", "train_samples_reward"),
    "rollout reward": ("rljob_rollout_reward", None),
    "staleness": ("rljob_trainer_metric", "staleness"),
    "tokens/s": ("rljob_trainer_tokens_per_second", None),
    "restarts": ("rljob_operator_job_restarts", None),
    "stream backlog": ("rljob_rollout_stream_backlog", None),
    "dead letters": ("rljob_trainer_stream", "dead_lettered"),
    "weight sync time": ("rljob_trainer_metric", "weight_sync_time_ms"),
    "reward errors": ("rljob_rollout_reward_errors_total", None),
    "jobs by phase": ("rljob_operator_jobs", None),
}


def test_the_dashboard_covers_what_a_job_is_watched_by(dashboard):
    found = {(s.name, value) for s in selectors(dashboard) for label, _, value in s.matchers
             if label in ("name", "counter")} | {(s.name, None) for s in selectors(dashboard)}
    assert {what for what, wanted in COVERED.items() if wanted not in found} == set()


def test_panels_do_not_overlap_and_fit_the_grid(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[x, y]!r}"
                cells[x, y] = panel["title"]
