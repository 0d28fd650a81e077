"""deploy/grafana and deploy/k8s/monitoring, checked offline against what the exporter emits.

The list of series comes from a real :class:`launch.metrics.NodeMetrics` fed the events of a
job with a crash, a restore, saves and an in-place change, never from a hard-coded list: a
panel or alert that names a series (or a label) the exporter does not emit fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from launch.metrics import NodeMetrics
from tests.unit.deploy.kustomize_lite import load_documents
from tests.unit.launch.test_metrics import JOB, NODE, _restart_job

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "elastic-run-dashboard.json"
MONITORING = ROOT / "deploy" / "k8s" / "monitoring"
K8S = ROOT / "deploy" / "k8s"
#: What the issue asks the board to show (by series family).
REQUIRED_ON_THE_BOARD = (
    "elastic_run_steps_total", "elastic_run_step_seconds", "elastic_run_world_size",
    "elastic_run_membership_changes_total", "elastic_run_recovery_seconds",
    "elastic_run_checkpoint_blocking_seconds", "elastic_run_checkpoint_durable_seconds",
    "elastic_run_checkpoint_last_committed_step", "elastic_run_worker_restarts_total",
    "elastic_run_goodput_ratio",
)
_NAME = re.compile(r"\belastic_run_[A-Za-z0-9_]+")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


@pytest.fixture(scope="module")
def emitted() -> tuple[set[str], set[str]]:
    """Sample names and label names a real exporter emits after a realistic job."""
    metrics = NodeMetrics(job=JOB, node=NODE)
    for record, durable in _restart_job():
        metrics.write(record, durable)
    names: set[str] = set()
    labels: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            names.add(sample.name)
            labels |= set(sample.labels)
    return names, labels


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _dashboard_queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(_dashboard()["panels"])
            for t in p.get("targets", [])]


def _rule_queries() -> list[tuple[str, str]]:
    (rules,) = load_documents(MONITORING / "prometheusrule.yaml")
    return [(r["alert"], r["expr"]) for g in rules["spec"]["groups"] for r in g["rules"]]


def _check_query(where: str, expr: str, names: set[str], labels: set[str]) -> None:
    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    for opening, closing in ("()", "[]", "{}"):
        depth = 0
        for char in expr:
            depth += (char == opening) - (char == closing)
            assert depth >= 0, f"{where}: unbalanced {opening}{closing} in {expr}"
        assert depth == 0, f"{where}: unbalanced {opening}{closing} in {expr}"
    found = _NAME.findall(expr)
    assert found, f"{where}: names no elastic_run series: {expr}"
    for name in found:
        assert name in names, f"{where}: {name} is not emitted by the exporter"
    used = {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",")
            if label.strip()}
    for matchers in _MATCHERS.findall(expr):
        used |= set(_MATCHER_LABEL.findall(matchers))
    assert used <= labels, f"{where}: labels {sorted(used - labels)} are not emitted"


def test_every_panel_query_names_only_series_and_labels_the_exporter_emits(
    emitted: tuple[set[str], set[str]],
) -> None:
    names, labels = emitted
    queries = _dashboard_queries()
    assert len(queries) >= 15
    for title, expr in queries:
        _check_query(f"panel {title!r}", expr, names, labels)


def test_the_board_shows_every_series_the_issue_asks_for() -> None:
    text = " ".join(expr for _, expr in _dashboard_queries())
    for family in REQUIRED_ON_THE_BOARD:
        assert family in text, f"no panel shows {family}"


def test_the_dashboard_is_a_loadable_grafana_dashboard() -> None:
    board = _dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job_id"]["type"] == "query"
    panels = list(_panels(board["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"stat", "timeseries"}
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'job_id=~"$job_id"' in target["expr"], panel["title"]
    # Alert-worthy stat panels turn red.
    red = [p["title"] for p in panels if p["type"] == "stat" and any(
        s["color"] == "red" for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"])]
    assert len(red) >= 2, red


def test_every_alert_names_only_series_and_labels_the_exporter_emits(
    emitted: tuple[set[str], set[str]],
) -> None:
    names, labels = emitted
    rules = _rule_queries()
    assert {"ElasticRunTrainingStalled", "ElasticRunCheckpointFailing"} <= {a for a, _ in rules}
    for alert, expr in rules:
        _check_query(f"alert {alert}", expr, names, labels)


_CUSTOM_RESOURCE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"enum": ["PodMonitor", "PrometheusRule"]},
        "metadata": {
            "type": "object", "required": ["name", "namespace"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "pattern": "^[a-z0-9-]+$"},
                           "namespace": {"const": "elastic-run"},
                           "labels": {"type": "object",
                                      "additionalProperties": {"type": "string"}}},
        },
        "spec": {"type": "object"},
    },
}
# The fields of monitoring.coreos.com/v1 PodMonitor that this manifest uses (prometheus-operator
# API reference); additionalProperties catches a misspelt one.
_PODMONITOR_SPEC = {
    "type": "object",
    "required": ["selector", "podMetricsEndpoints"],
    "additionalProperties": False,
    "properties": {
        "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                     "properties": {"matchLabels": {"type": "object",
                                                    "additionalProperties": {"type": "string"}}}},
        "namespaceSelector": {"type": "object", "additionalProperties": False,
                              "properties": {"matchNames": {"type": "array",
                                                            "items": {"type": "string"}},
                                             "any": {"type": "boolean"}}},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port"], "additionalProperties": False,
            "properties": {
                "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                "relabelings": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"sourceLabels": {"type": "array", "items": {"type": "string"}},
                                   "targetLabel": {"type": "string"},
                                   "action": {"type": "string"},
                                   "regex": {"type": "string"},
                                   "replacement": {"type": "string"}}}},
            }}},
    },
}
_RULE_SPEC = {
    "type": "object", "required": ["groups"], "additionalProperties": False,
    "properties": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "rules": {"type": "array", "items": {
            "type": "object", "required": ["alert", "expr"], "additionalProperties": False,
            "properties": {
                "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                "expr": {"type": "string"},
                "for": {"type": "string", "pattern": "^[0-9]+(s|m|h)$"},
                "labels": {"type": "object", "properties": {
                    "severity": {"enum": ["critical", "warning", "info"]}}},
                "annotations": {"type": "object", "required": ["summary"],
                                "additionalProperties": {"type": "string"}},
            }}}}}}},
}


def _training_pods() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template, elastic-run container) of the Job and of the PyTorchJob."""
    job = load_documents(K8S / "train" / "job.yaml")[0]["spec"]["template"]
    pytorchjob = load_documents(K8S / "pytorchjob" / "pytorchjob.yaml")[0]
    worker = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return [(job, job["spec"]["containers"][0]), (worker, worker["spec"]["containers"][0])]


def test_the_pod_monitor_has_the_operators_shape_and_selects_the_training_pods() -> None:
    (monitor,) = load_documents(MONITORING / "podmonitor.yaml")
    jsonschema.validate(monitor, _CUSTOM_RESOURCE)
    jsonschema.validate(monitor["spec"], _PODMONITOR_SPEC)
    assert monitor["kind"] == "PodMonitor"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for template, container in _training_pods():
        labels = template["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert endpoint["port"] in ports
        assert endpoint["path"] == template["metadata"]["annotations"]["prometheus.io/path"]
        assert f"--metrics-port={ports[endpoint['port']]}" in container["args"]


def test_a_misspelt_pod_monitor_field_is_caught() -> None:
    (monitor,) = load_documents(MONITORING / "podmonitor.yaml")
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor["spec"], _PODMONITOR_SPEC)


def test_the_alert_rules_have_the_operators_shape() -> None:
    (rules,) = load_documents(MONITORING / "prometheusrule.yaml")
    jsonschema.validate(rules, _CUSTOM_RESOURCE)
    jsonschema.validate(rules["spec"], _RULE_SPEC)
    assert yaml.safe_dump(rules)  # plain YAML all the way down
