"""Prometheus metrics (sink.ops.metrics.exporter, sink.store.pipeline_counters): counters, exposition, the HTTP exporter, and the
Redis gauges."""

from __future__ import annotations

import re
import sys
import urllib.error
import urllib.request

import pytest
import redis
import redis.asyncio as aioredis

from sink.errors import MetricsExtraMissingError, StagingError
from sink.ops.metrics.exporter import EXPORTED_METRICS, STAGE_RESULTS, Metrics, collect_redis_gauges, serve_metrics
from sink.store.pipeline_counters import (
    PipelineCounters,
    StageOutcome,
    count_dead_letter,
    count_pulled,
    count_receipt_published,
    count_stage,
    count_staged_bytes,
    pipeline_counters,
)

NS = "stg"


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _series_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_stage_counters_latency_and_bytes() -> None:
    counters = PipelineCounters()
    metrics = Metrics(counters, namespace=NS)
    assert [sample(metrics, "staging_sink_stages_total", namespace=NS, result=r) for r in STAGE_RESULTS] == [0.0] * 3
    counters.add("staging_sink_stages", namespace=NS, result="ok")
    counters.observe_latency(NS, 0.003)
    counters.observe_latency(NS, 0.2)
    counters.add("staging_sink_staged_bytes", 2000, namespace=NS)
    assert sample(metrics, "staging_sink_stages_total", namespace=NS, result="ok") == 1
    assert sample(metrics, "staging_sink_staged_bytes_total", namespace=NS) == 2000
    assert sample(metrics, "staging_sink_stage_latency_seconds_count", namespace=NS) == 2
    assert sample(metrics, "staging_sink_stage_latency_seconds_bucket", namespace=NS, le="0.005") == 1
    assert sample(metrics, "staging_sink_stage_latency_seconds_bucket", namespace=NS, le="+Inf") == 2
    assert sample(metrics, "staging_sink_stage_latency_seconds_sum", namespace=NS) == pytest.approx(0.203)


def test_the_process_hooks_count_into_the_process_counters() -> None:
    counters = pipeline_counters()
    before = counters.snapshot()
    try:
        counters.reset()
        count_stage("hooks", StageOutcome.OK, 0.001)
        count_stage("hooks", StageOutcome.CONFLICT, 0.002)
        count_staged_bytes("hooks", 100)
        count_receipt_published("hooks", 2)
        count_dead_letter("hooks", "done", 1)
        count_pulled("hooks", None)
        count_pulled("hooks", "rollout_failed")  # upstream: a skip, not a verification failure
        count_pulled("hooks", "wrong_digest")
        metrics = Metrics(namespace="hooks")
        expected = {
            ("staging_sink_stages_total", (("namespace", "hooks"), ("result", "ok"))): 1,
            ("staging_sink_stages_total", (("namespace", "hooks"), ("result", "conflict"))): 1,
            ("staging_sink_staged_bytes_total", (("namespace", "hooks"),)): 100,
            ("staging_sink_receipts_published_total", (("namespace", "hooks"), ("shard", "2"))): 1,
            ("staging_sink_dead_letters_total", (("namespace", "hooks"), ("role", "done"), ("shard", "1"))): 1,
            ("staging_sink_rollouts_pulled_total", (("namespace", "hooks"), ("outcome", "trainable"))): 1,
            ("staging_sink_rollouts_pulled_total", (("namespace", "hooks"), ("outcome", "skipped"))): 2,
            ("staging_sink_rollouts_skipped_total", (("code", "rollout_failed"), ("namespace", "hooks"))): 1,
            ("staging_sink_rollouts_skipped_total", (("code", "wrong_digest"), ("namespace", "hooks"))): 1,
            ("staging_sink_verification_failures_total", (("code", "wrong_digest"), ("namespace", "hooks"))): 1,
        }
        for (name, labels), value in expected.items():
            assert sample(metrics, name, **dict(labels)) == value, name
        assert (
            sample(metrics, "staging_sink_verification_failures_total", namespace="hooks", code="rollout_failed")
            is None
        )
    finally:
        counters.reset()
        counters.merge(before)


def test_snapshots_merge_across_processes() -> None:
    worker, parent = PipelineCounters(), PipelineCounters()
    worker.add("staging_sink_stages", namespace=NS, result="ok")
    worker.observe_latency(NS, 0.01)
    parent.add("staging_sink_stages", namespace=NS, result="ok")
    parent.merge(worker.snapshot())
    assert parent.value("staging_sink_stages", namespace=NS, result="ok") == 2
    assert parent.latency()[NS][2] == 1  # one observation, from the worker
    for bad in ({}, {"counters": [["x"]], "latency": {}}, {"counters": [], "latency": {NS: [1.0]}}):
        with pytest.raises(ValueError, match="snapshot"):
            parent.merge(bad)
    assert parent.value("staging_sink_stages", namespace=NS, result="ok") == 2  # a bad snapshot changed nothing


def test_each_metrics_object_has_its_own_registry() -> None:
    from prometheus_client import REGISTRY

    first, second = Metrics(PipelineCounters()), Metrics(PipelineCounters())  # no "Duplicated timeseries"
    first.counters.add("staging_sink_stages", namespace=NS, result="failed")
    assert sample(first, "staging_sink_stages_total", namespace=NS, result="failed") == 1
    assert sample(second, "staging_sink_stages_total", namespace=NS, result="failed") == 0
    assert REGISTRY.get_sample_value("staging_sink_stages_total", {"namespace": NS, "result": "failed"}) is None


def test_the_exposition_follows_prometheus_conventions() -> None:
    metrics = Metrics(PipelineCounters())
    metrics.counters.add("staging_sink_verification_failures", namespace=NS, code="row_count_mismatch")
    metrics.counters.observe_latency(NS, 0.01)
    metrics.collection_failed(NS)
    metrics.update_redis_gauges(
        {
            "stg:done:0": {
                "kind": "done",
                "length": 3,
                "groups": {"asm": {"pending": 1, "lag": 2, "consumers": 1, "idle_ms": {"a1": 1500}}},
            }
        }
    )
    text = metrics.exposition().decode()
    names = _series_names(text)
    assert not any(name.endswith("_created") for name in names)
    assert names <= EXPORTED_METRICS, names - EXPORTED_METRICS
    assert 'staging_sink_consumer_lag{group="asm",kind="done",namespace="stg",shard="0"} 2.0' in text
    assert (
        'staging_sink_consumer_idle_seconds{consumer="a1",group="asm",kind="done",namespace="stg",shard="0"} 1.5'
        in text
    )
    assert 'staging_sink_dead_letter_length{namespace="stg"} 0.0' in text  # 0 when there is no dead letter
    assert 'staging_sink_collection_up{namespace="stg"} 0.0' in text
    assert re.search(r'staging_sink_build_info\{version="[^"]+"\} 1\.0', text)
    counters = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE") and line.endswith("counter")]
    assert counters and all(name.endswith("_total") for name in counters)
    assert "staging_sink_collection_errors_total 1.0" in text


def test_the_http_exporter_serves_and_stops() -> None:
    metrics = Metrics(PipelineCounters())
    metrics.counters.add("staging_sink_stages", namespace=NS, result="ok")
    with serve_metrics(0, metrics) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.status == 200
            body = response.read().decode()
        assert 'staging_sink_stages_total{namespace="stg",result="ok"} 1.0' in body
        metrics.counters.add("staging_sink_stages", namespace=NS, result="ok")
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert 'staging_sink_stages_total{namespace="stg",result="ok"} 2.0' in response.read().decode()
    assert not server._thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)
    server.stop()  # idempotent


def test_a_missing_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(MetricsExtraMissingError, match=r"-e '\.\[metrics\]'") as missing:
        Metrics()
    assert isinstance(missing.value, ImportError) and isinstance(missing.value, StagingError)


# --- Redis gauges ----------------------------------------------------------------------------------------


def _seed(url: str) -> None:
    with redis.Redis.from_url(url) as client:
        for index in range(5):
            client.xadd(f"{NS}:done:0", {"rollout": f"r{index}"})
        client.xgroup_create(f"{NS}:done:0", "asm", id="0")
        client.xreadgroup("asm", "a1", {f"{NS}:done:0": ">"}, count=2)  # 2 pending, 3 not delivered
        client.xadd(f"{NS}:receipts:1", {"rollout": "r0"})
        client.xadd(f"{NS}:dead:done-0", {"reason": "x"})
        client.set(f"{NS}:done:9", b"not a stream")
        client.xadd(f"{NS}:{{r0}}:calls", {"key": "r0/c1"})  # per-rollout streams are not shared queues
        client.xadd("other:done:0", {"rollout": "r0"})
        client.xadd(f"{NS}:{{r0}}:ledger", {"row": "x"})  # r0: receipt stored
        client.set(f"{NS}:{{r0}}:receipt", b"{}")
        client.xadd(f"{NS}:{{r1}}:ledger", {"row": "x"})  # r1, r2: in flight
        client.xadd(f"{NS}:{{r2}}:ledger", {"row": "x"})


def _check(gauges: dict[str, object]) -> None:
    assert list(gauges) == [f"{NS}:dead:done-0", f"{NS}:done:0", f"{NS}:receipts:1"]
    done = gauges[f"{NS}:done:0"]
    assert isinstance(done, dict)
    assert done["kind"] == "done" and done["length"] == 5
    asm = done["groups"]["asm"]
    assert (asm["pending"], asm["lag"], asm["consumers"], list(asm["idle_ms"])) == (2, 3, 1, ["a1"])
    assert gauges[f"{NS}:receipts:1"] == {"kind": "receipts", "length": 1, "groups": {}}
    assert gauges[f"{NS}:dead:done-0"]["kind"] == "dead"  # type: ignore[index]


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
async def test_refresh_sets_every_gauge_and_follows_the_streams(redis_url: str) -> None:
    _seed(redis_url)
    metrics = Metrics(PipelineCounters())
    where = {"namespace": NS, "kind": "done", "shard": "0"}
    async with aioredis.Redis.from_url(redis_url) as client:
        await metrics.refresh(client, NS)
        assert sample(metrics, "staging_sink_stream_length", **where) == 5
        assert sample(metrics, "staging_sink_consumer_pending", **where, group="asm") == 2
        assert sample(metrics, "staging_sink_consumer_lag", **where, group="asm") == 3
        idle = sample(metrics, "staging_sink_consumer_idle_seconds", **where, group="asm", consumer="a1")
        assert idle is not None and 0 <= idle < 60
        assert sample(metrics, "staging_sink_dead_letter_length", namespace=NS) == 1
        assert sample(metrics, "staging_sink_rollouts_in_flight", namespace=NS) == 2
        assert sample(metrics, "staging_sink_receipts_retained", namespace=NS) == 1
        assert sample(metrics, "staging_sink_collection_up", namespace=NS) == 1
        node = f"{client.connection_pool.connection_kwargs['host']}:{client.connection_pool.connection_kwargs['port']}"
        assert sample(metrics, "staging_sink_durable", node=node) == 1  # the fixture's server is durable
        used = sample(metrics, "staging_sink_used_memory_bytes", node=node)
        assert used is not None and used > 0
        assert sample(metrics, "staging_sink_maxmemory_bytes", node=node) is not None
        await client.delete(f"{NS}:done:0", f"{NS}:dead:done-0")
        await metrics.refresh(client, NS)
    assert sample(metrics, "staging_sink_stream_length", **where) is None
    assert sample(metrics, "staging_sink_consumer_pending", **where, group="asm") is None
    assert sample(metrics, "staging_sink_stream_length", namespace=NS, kind="receipts", shard="1") == 1
    assert sample(metrics, "staging_sink_dead_letter_length", namespace=NS) == 0


@pytest.mark.anyio
async def test_a_failed_collection_is_up_0_and_counted() -> None:
    metrics = Metrics(PipelineCounters())
    async with aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1) as client:
        with pytest.raises((redis.RedisError, OSError)):
            await metrics.refresh(client, NS)
    assert sample(metrics, "staging_sink_collection_up", namespace=NS) == 0
    assert sample(metrics, "staging_sink_collection_errors_total") == 1


def test_a_service_metrics_port_serves_the_process_counters() -> None:
    from sink.ops.metrics.exporter import serve_process_metrics

    with serve_process_metrics(None) as nothing:
        assert nothing is None
    namespace = "svc-port"
    with serve_process_metrics(0, namespace=namespace) as server:
        assert server is not None
        count_stage(namespace, StageOutcome.OK, 0.002)  # counted after the server started: read at scrape time
        with urllib.request.urlopen(server.url, timeout=5) as response:
            body = response.read().decode()
    assert f'staging_sink_stages_total{{namespace="{namespace}",result="ok"}} 1.0' in body
    assert f'staging_sink_stages_total{{namespace="{namespace}",result="failed"}} 0.0' in body
