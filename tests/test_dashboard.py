"""deploy/grafana and deploy/prometheus: the dashboard asks only for series the exporter emits, and the compose
profile "monitoring" provisions Prometheus and Grafana with them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from sink.ops.metrics.exporter import EXPORTED_METRICS

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "staging-sink.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "staging-sink.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"

PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "rate", "irate", "increase", "histogram_quantile",
    "and", "or", "unless", "on", "ignoring", "group_left", "group_right", "offset", "bool", "topk", "bottomk",
    "clamp_min", "clamp_max", "abs", "time", "vector", "scalar", "label_replace", "delta", "deriv",
}  # fmt: skip
"""PromQL functions, aggregations and keywords the dashboard may use (anything else must be a metric)."""
REQUIRED_SERIES = {
    "staging_sink_stages_total",
    "staging_sink_stage_latency_seconds_bucket",
    "staging_sink_durable",
    "staging_sink_consumer_lag",
    "staging_sink_consumer_pending",
    "staging_sink_dead_letter_length",
    "staging_sink_used_memory_bytes",
    "staging_sink_verification_failures_total",
}
"""What operators need on the dashboard (stage rate and latency, durability, lag, pending, dead letters, memory,
verification failures): each series a panel must query, whatever the panel is called."""


def _yaml(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _expressions() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _dashboard()["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers left once label matchers, grouping clauses, ranges,
    strings, numbers and PromQL words are removed."""
    text = re.sub(r'"[^"]*"', " ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {word for word in words if word not in PROMQL_WORDS}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le, ns) (rate(a_bucket{x="1"}[$__rate_interval]))', {"a_bucket"}),
        ("histogram_quantile(0.99, b) > 0 or on (node) c", {"b", "c"}),
        ("count by (version) (d)", {"d"}),
    ],
)
def test_the_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_every_dashboard_expression_names_only_exported_metrics() -> None:
    expressions = _expressions()
    assert len(expressions) >= len(REQUIRED_SERIES)
    for title, expr in expressions:
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= EXPORTED_METRICS, (title, names - EXPORTED_METRICS)


def test_the_dashboard_shows_what_operators_need() -> None:
    shown = {name for _title, expr in _expressions() for name in metric_names(expr)}
    assert REQUIRED_SERIES <= shown, sorted(REQUIRED_SERIES - shown)
    quantiles = [expr for _title, expr in _expressions() if "histogram_quantile" in expr]
    assert quantiles and all("le" in expr for expr in quantiles)  # the quantiles aggregate by bucket bound
    uids = {t["datasource"]["uid"] for p in _dashboard()["panels"] for t in p["targets"]}
    assert uids == {_yaml(DATASOURCES)["datasources"][0]["uid"]}


def test_prometheus_scrapes_the_exporter_of_the_compose_stack() -> None:
    config = _yaml(PROMETHEUS)
    targets = [t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    services = _yaml(COMPOSE)["services"]
    command = services["metrics"]["command"]
    assert f"metrics:{command[command.index('--port') + 1]}" in targets


def test_the_monitoring_profile_provisions_prometheus_and_grafana() -> None:
    services = _yaml(COMPOSE)["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = _yaml(DASHBOARD_PROVIDERS)["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    datasource = _yaml(DATASOURCES)["datasources"][0]
    port = prometheus["ports"][0].rsplit(":", 1)[1]
    assert datasource["url"] == f"http://prometheus:{port}" and datasource["type"] == "prometheus"
