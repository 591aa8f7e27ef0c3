"""The exported counters move with the work: a demo run's scrape equals the demo's own summary."""

from __future__ import annotations

import json
import secrets
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sink.ops.metrics.exporter import EXPORTED_METRICS, Metrics, serve_metrics
from sink_cli.main import main

pytestmark = pytest.mark.redis


def _scrape(url: str, namespace: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name in EXPORTED_METRICS, sample.name
            if sample.labels.get("namespace") == namespace:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "namespace"))
                out[(sample.name, labels)] = sample.value
    return out


def _sum(scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(
        value for (sample, sample_labels), value in scraped.items() if sample == name and wanted <= set(sample_labels)
    )


def test_exported_counters_equal_the_demo_summary(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = f"metrics-{secrets.token_hex(3)}"
    argv = ["demo", "--redis-url", redis_url, "--namespace", namespace, "--rollouts", "10", "--turns", "3"]
    assert main([*argv, "--inject-failures", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["staged"] > 0 and len(summary["skipped"]) == 2

    with serve_metrics(
        0, Metrics(namespace=namespace)
    ) as exporter:  # this process: assembler, reader, workers' reports
        scraped = _scrape(exporter.url, namespace)

    assert _sum(scraped, "staging_sink_stages_total", result="ok") == summary["staged"]
    assert _sum(scraped, "staging_sink_stages_total") == summary["staged"] + summary["stage_failures"]
    assert _sum(scraped, "staging_sink_stage_latency_seconds_count") == summary["staged"] + summary["stage_failures"]
    assert _sum(scraped, "staging_sink_staged_bytes_total") == summary["record_bytes"]
    assert _sum(scraped, "staging_sink_receipts_published_total") == summary["receipts"]
    assert _sum(scraped, "staging_sink_rollouts_pulled_total", outcome="trainable") == summary["verified"]
    assert _sum(scraped, "staging_sink_rollouts_pulled_total", outcome="skipped") == len(summary["skipped"])
    skips = Counter(skip["code"] for skip in summary["skipped"].values())
    assert {
        dict(labels)["code"]: value
        for (name, labels), value in scraped.items()
        if name == "staging_sink_rollouts_skipped_total"
    } == skips
    assert _sum(scraped, "staging_sink_verification_failures_total") == 0  # injected failures are upstream skips
    shards = {
        dict(labels)["shard"]
        for (name, labels), _ in scraped.items()
        if name == "staging_sink_receipts_published_total"
    }
    assert shards and shards <= {str(k) for k in range(16)}
