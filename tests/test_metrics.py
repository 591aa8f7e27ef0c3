"""Prometheus metrics (sink.metrics): counters, exposition, the HTTP exporter, and the Redis stream gauges."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import pytest
import redis
import redis.asyncio as aioredis

from sink.errors import MetricsExtraMissingError, StagingError
from sink.metrics import STAGE_RESULTS, Metrics, collect_redis_gauges, serve_metrics

NS = "stg"
METRIC_NAMES = (
    "staging_sink_stages_total",
    "staging_sink_stage_latency_seconds_bucket",
    "staging_sink_staged_bytes_total",
    "staging_sink_receipts_total",
    "staging_sink_verification_failures_total",
    "staging_sink_dead_letters_total",
    "staging_sink_stream_length",
    "staging_sink_consumer_pending",
    "staging_sink_consumer_lag",
    "staging_sink_redis_collect_errors_total",
)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_stage_counters_latency_and_bytes() -> None:
    metrics = Metrics()
    assert [sample(metrics, "staging_sink_stages_total", result=r) for r in STAGE_RESULTS] == [0.0] * 4
    metrics.observe_stage("ok", 0.003, staged_bytes=1500)
    metrics.observe_stage("ok", 0.2, staged_bytes=500)
    metrics.observe_stage("conflict", 0.001)
    metrics.observe_stage("durability_refused", 0.0)
    assert sample(metrics, "staging_sink_stages_total", result="ok") == 2
    assert sample(metrics, "staging_sink_stages_total", result="conflict") == 1
    assert sample(metrics, "staging_sink_stages_total", result="failed") == 0
    assert sample(metrics, "staging_sink_staged_bytes_total") == 2000
    assert sample(metrics, "staging_sink_stage_latency_seconds_count") == 4
    assert sample(metrics, "staging_sink_stage_latency_seconds_bucket", le="0.005") == 3
    assert sample(metrics, "staging_sink_stage_latency_seconds_sum") == pytest.approx(0.204)


def test_receipts_verification_failures_and_dead_letters_by_label() -> None:
    metrics = Metrics()
    metrics.record_receipt("built")
    metrics.record_receipt("built")
    metrics.record_receipt("dead_lettered")
    metrics.record_verification_failure("wrong_digest")
    metrics.record_dead_letter("stg:dead:assembler")
    assert sample(metrics, "staging_sink_receipts_total", outcome="built") == 2
    assert sample(metrics, "staging_sink_receipts_total", outcome="dead_lettered") == 1
    assert sample(metrics, "staging_sink_verification_failures_total", code="wrong_digest") == 1
    assert sample(metrics, "staging_sink_dead_letters_total", stream="stg:dead:assembler") == 1


@pytest.mark.parametrize(
    "bad",
    [
        lambda m: m.observe_stage("okay", 0.1),
        lambda m: m.observe_stage("ok", -1.0),
        lambda m: m.observe_stage("ok", 0.1, staged_bytes=-5),
        lambda m: m.record_receipt(""),
        lambda m: m.record_verification_failure("has spaces"),
        lambda m: m.record_dead_letter("x" * 65),
    ],
)
def test_bad_labels_and_values_raise(bad: object) -> None:
    metrics = Metrics()
    with pytest.raises(ValueError):
        bad(metrics)  # type: ignore[operator]


def test_each_metrics_object_has_its_own_registry() -> None:
    from prometheus_client import REGISTRY

    first, second = Metrics(), Metrics()  # a shared registry would raise "Duplicated timeseries"
    first.observe_stage("failed", 0.01)
    assert sample(first, "staging_sink_stages_total", result="failed") == 1
    assert sample(second, "staging_sink_stages_total", result="failed") == 0
    assert REGISTRY.get_sample_value("staging_sink_stages_total", {"result": "failed"}) is None


def test_the_exposition_names_every_metric() -> None:
    metrics = Metrics()
    metrics.observe_stage("ok", 0.01, staged_bytes=10)
    metrics.record_receipt("built")
    metrics.record_verification_failure("row_count_mismatch")
    metrics.record_dead_letter("stg:dead:trainer")
    metrics.redis_collect_errors.inc()
    metrics.update_redis_gauges(
        {"stg:done:0": {"kind": "done", "length": 3, "groups": {"asm": {"pending": 1, "lag": 2, "consumers": 1}}}}
    )
    text = metrics.exposition().decode()
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    assert 'staging_sink_consumer_lag{group="asm",stream="stg:done:0"} 2.0' in text


def test_the_http_exporter_serves_and_stops() -> None:
    metrics = Metrics()
    metrics.observe_stage("ok", 0.01)
    with serve_metrics(0, metrics) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.status == 200
            body = response.read().decode()
        assert 'staging_sink_stages_total{result="ok"} 1.0' in body
        metrics.observe_stage("ok", 0.01)
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert 'staging_sink_stages_total{result="ok"} 2.0' in response.read().decode()
    assert not server._thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)
    server.stop()  # idempotent


def test_a_missing_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(MetricsExtraMissingError, match=r"staging-sink\[metrics\]") as missing:
        Metrics()
    assert isinstance(missing.value, ImportError) and isinstance(missing.value, StagingError)


# --- Redis stream gauges ---------------------------------------------------------------------------


def _seed(url: str) -> None:
    with redis.Redis.from_url(url) as client:
        for index in range(5):
            client.xadd(f"{NS}:done:0", {"rollout": f"r{index}"})
        client.xgroup_create(f"{NS}:done:0", "asm", id="0")
        client.xreadgroup("asm", "a1", {f"{NS}:done:0": ">"}, count=2)  # 2 pending, 3 not delivered
        client.xadd(f"{NS}:receipts:1", {"rollout": "r0"})
        client.xadd(f"{NS}:dead:assembler", {"reason": "x"})
        client.set(f"{NS}:done:9", b"not a stream")
        client.xadd(f"{NS}:{{r0}}:calls", {"key": "r0/c1"})  # per-rollout streams are not shared queues
        client.xadd("other:done:0", {"rollout": "r0"})


def _check(gauges: dict[str, object]) -> None:
    assert list(gauges) == [f"{NS}:dead:assembler", f"{NS}:done:0", f"{NS}:receipts:1"]
    assert gauges[f"{NS}:done:0"] == {
        "kind": "done",
        "length": 5,
        "groups": {"asm": {"pending": 2, "lag": 3, "consumers": 1}},
    }
    assert gauges[f"{NS}:receipts:1"] == {"kind": "receipts", "length": 1, "groups": {}}
    assert gauges[f"{NS}:dead:assembler"]["kind"] == "dead"  # type: ignore[index]


@pytest.mark.anyio
async def test_collect_redis_gauges_finds_the_shared_streams(redis_url: str) -> None:
    _seed(redis_url)
    async with aioredis.Redis.from_url(redis_url) as client:
        _check(await collect_redis_gauges(client, NS))  # type: ignore[arg-type]
        explicit = await collect_redis_gauges(client, NS, streams=[f"{NS}:done:0", f"{NS}:done:7", f"{NS}:done:9"])
    assert list(explicit) == [f"{NS}:done:0"]  # missing and non-stream keys are tolerated


@pytest.mark.anyio
async def test_collect_redis_gauges_with_decoded_responses(redis_url: str) -> None:
    _seed(redis_url)
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        _check(await collect_redis_gauges(client, NS))  # type: ignore[arg-type]
        assert await collect_redis_gauges(client, "nothing-here") == {}


@pytest.mark.anyio
async def test_gauges_follow_the_streams(redis_url: str) -> None:
    _seed(redis_url)
    metrics = Metrics()
    async with aioredis.Redis.from_url(redis_url) as client:
        metrics.update_redis_gauges(await collect_redis_gauges(client, NS))
        assert sample(metrics, "staging_sink_stream_length", stream=f"{NS}:done:0", kind="done") == 5
        assert sample(metrics, "staging_sink_consumer_pending", stream=f"{NS}:done:0", group="asm") == 2
        assert sample(metrics, "staging_sink_consumer_lag", stream=f"{NS}:done:0", group="asm") == 3
        await client.delete(f"{NS}:done:0")
        metrics.update_redis_gauges(await collect_redis_gauges(client, NS))
    assert sample(metrics, "staging_sink_stream_length", stream=f"{NS}:done:0", kind="done") is None
    assert sample(metrics, "staging_sink_consumer_pending", stream=f"{NS}:done:0", group="asm") is None
    assert sample(metrics, "staging_sink_stream_length", stream=f"{NS}:receipts:1", kind="receipts") == 1
