"""The capture proxy end to end: the official openai client -> proxy (uvicorn) -> HTTP engine (uvicorn) -> Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from sink.keys import DEFAULT_NAMESPACE
from sink.settings import ProxySettings
from sink.store.durability import supports_waitaof
from sink_tools.cluster import LocalCluster
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.acl import start_acl_server
from tests.helpers.proxy import (
    client_for,
    close_clients,
    expected_ids,
    finish,
    manifest,
    proxy_config,
    pull,
    run_agent,
)
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    """Every openai client of the test is closed at its end."""
    yield
    close_clients()


@pytest.fixture
def engine() -> Iterator[tuple[EngineApp, str]]:
    app = EngineApp(EngineOptions(seed=7))
    with running_server(app) as url:
        yield app, url


@pytest.fixture
def proxy(redis_url: str, engine: tuple[EngineApp, str]) -> Iterator[str]:
    with running_server(ProxyApp(proxy_config(redis_url, engine[1]))) as url:
        yield url


def test_rollout_through_proxy_is_pulled_and_verified(
    redis_url: str, engine: tuple[EngineApp, str], proxy: str
) -> None:
    app, _ = engine
    conversation, last_id = run_agent([proxy], "proxy-r1", turns=3)
    finish(proxy, "proxy-r1", 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None, pulled.skip_reason
    assert list(pulled.row.token_ids) == expected_ids(app, conversation)
    assert pulled.receipt.capture_poisoned is False
    assert sum(pulled.row.token_mask) == sum(
        len(app.engine.tokenizer.encode(m["content"])) + 1 for m in conversation if m["role"] == "assistant"
    )


def test_two_proxies_serve_one_rollout_alternately(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    app, upstream = engine
    with (
        running_server(ProxyApp(proxy_config(redis_url, upstream))) as one,
        running_server(ProxyApp(proxy_config(redis_url, upstream))) as two,
    ):
        conversation, last_id = run_agent([one, two], "proxy-two", turns=4)
        finish(two, "proxy-two", 0.5, last_id)
    shown = manifest(redis_url, "proxy-two")
    assert len(shown.records) == 4 and not shown.failures
    assert [r.parent_call_id for r in shown.records][1:] == [r.model_call_id for r in shown.records][:-1]
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and list(pulled.row.token_ids) == expected_ids(app, conversation)


def test_requests_without_rollout_are_forwarded_uncaptured(redis_url: str, proxy: str) -> None:
    completion = client_for(proxy).chat.completions.create(
        model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.choices[0].message.content is not None
    models = client_for(proxy).models.list()
    assert [m.id for m in models.data] == ["simulated"]
    with redis.Redis.from_url(redis_url) as client:
        assert not list(client.scan_iter(f"{DEFAULT_NAMESPACE}:*ledger*"))


def test_proxy_with_least_privilege_users(server_binary: Path, tmp_path: Path) -> None:
    """The proxy stages as ACL user ``worker`` and writes the ledger and done events as ``gate``."""
    server = start_acl_server(server_binary, tmp_path)
    with server, running_server(EngineApp(EngineOptions(seed=9))) as upstream:
        config = ProxySettings(
            upstream_url=upstream, redis_url=server.role_url("worker"), gate_redis_url=server.role_url("gate")
        )
        app = ProxyApp(config)
        with running_server(app) as url:
            _, last_id = run_agent([url], "acl-1", turns=3)
            finish(url, "acl-1", 1.0, last_id)
        shown = manifest(server.role_url("gate"), "acl-1")
    assert app.metrics.counts["captured"] == 3 and len(shown.records) == 3 and not shown.failures


@pytest.mark.slow
def test_proxy_on_a_cluster(cluster: LocalCluster) -> None:
    with redis.RedisCluster.from_url(cluster.url) as client:
        client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)  # the cluster is shared by the session
    with running_server(EngineApp(EngineOptions(seed=10))) as upstream:
        app = ProxyApp(ProxySettings(upstream_url=upstream, redis_url=cluster.url, cluster=True))
        with running_server(app) as url:
            for rollout_id in ("cl-1", "cl-2", "cl-3"):
                _, last_id = run_agent([url], rollout_id, turns=2)
                finish(url, rollout_id, 1.0, last_id)
    assert app.metrics.counts == {"captured": 6, "uncaptured": 0, "capture_failed": 0, "capture_error": 0}


def test_bare_proxy_forwards_rollout_routes(engine: tuple[EngineApp, str]) -> None:
    _, upstream = engine
    with running_server(ProxyApp(ProxySettings(upstream_url=upstream, capture=False))) as url:
        completion = client_for(url, "bare-1").chat.completions.create(
            model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert completion.choices[0].message.content is not None
        assert httpx.get(f"{url}/r/bad%20id/v1/models").status_code == 400


def test_exact_mode_counts_every_engine_round_trip_by_route(redis_url: str) -> None:
    # Render (the request; a continuation's history too), generate and derender: each is one upstream latency.
    with (
        running_server(EngineApp(EngineOptions(seed=1, scale_out=True))) as engine,
        running_server(ProxyApp(proxy_config(redis_url, engine))) as url,
    ):
        run_agent([url], "metrics-exact", turns=2)
        text = httpx.get(f"{url}/staging-sink/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    counts = {
        route: float(samples.get(f'staging_proxy_upstream_seconds_count{{route="{route}"}}', 0))
        for route in ("/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender")
    }
    assert counts == {
        "/v1/chat/completions/render": 3.0,
        "/inference/v1/generate": 2.0,
        "/v1/chat/completions/derender": 2.0,
    }


def test_latency_and_bytes_metrics(proxy: str) -> None:
    run_agent([proxy], "metrics-1", turns=2)
    text = httpx.get(f"{proxy}/staging-sink/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples['staging_proxy_upstream_seconds_count{route="/v1/chat/completions"}']) == 2.0
    assert float(samples["staging_proxy_stage_seconds_count"]) == 2.0
    assert float(samples["staging_proxy_stage_seconds_sum"]) > 0
    assert float(samples["staging_proxy_response_bytes_total"]) > 100


def _config_gets(redis_url: str) -> tuple[int, int]:
    """``CONFIG GET`` calls the server has run, and how many one durable confirmation makes: it reads the four
    persistence settings back in one ``CONFIG GET`` where the server has ``WAITAOF`` (so takes several names), else
    one by one."""
    with redis.Redis.from_url(redis_url) as client:
        entry = client.info("commandstats").get("cmdstat_config|get")
        per_confirmation = 1 if supports_waitaof(client.info("server")) else 4
    return (int(entry["calls"]) if isinstance(entry, dict) else 0), per_confirmation


@pytest.mark.parametrize("scale_out", [False, True], ids=["verify", "exact"])
def test_a_captured_call_stages_and_commits_in_one_durable_round(redis_url: str, scale_out: bool) -> None:
    """The stage and the ledger row share one round trip and one confirmation: per captured call the server reads
    the persistence settings back once, not once for the stage and again for the commit."""
    with (
        running_server(EngineApp(EngineOptions(seed=4, scale_out=scale_out))) as upstream,
        running_server(ProxyApp(proxy_config(redis_url, upstream))) as url,
    ):
        run_agent([url], "one-round-warm", turns=1)  # the sink's and the ledger's first checks are behind us
        before, per_confirmation = _config_gets(redis_url)
        _, last_id = run_agent([url], "one-round", turns=3)
        confirmations = (_config_gets(redis_url)[0] - before) / per_confirmation
        finish(url, "one-round", 1.0, last_id)
    shown = manifest(redis_url, "one-round")
    assert len(shown.records) == 3 and not shown.failures
    assert confirmations == 3, f"{confirmations} durable confirmations for 3 captured calls"
    [pulled] = pull(redis_url, 1)  # the rows are the same as ever: the rollout verifies end to end
    assert pulled.rollout_id == "one-round" and pulled.row is not None, pulled.skip_reason
