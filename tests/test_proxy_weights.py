"""Weight versions through the capture proxy (the simulated engine in exact-prefix mode): stamped from the engine's
``weight_versions`` spans (``--weight-source engine``), from the trainer's published key (``published``), or the
fixed ``--weight-version``; an engine label the rule cannot map stops the proxy at start."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from sink.keys import weight_version_key
from sink.trainer.weights import publish_weight_version
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import (
    SYSTEM,
    RecordingEngine,
    client_for,
    close_clients,
    finish,
    manifest,
    proxy_before,
    proxy_config,
    pull,
    run_agent,
)
from worker.errors import StagingModeError
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

BODY: dict[str, Any] = {"model": "simulated", "messages": [SYSTEM, {"role": "user", "content": "go"}], "max_tokens": 4}


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


@pytest.fixture
def engine() -> Iterator[str]:
    with running_server(EngineApp(EngineOptions(seed=9, scale_out=True))) as url:
        yield url


def _versions(redis_url: str, proxy: str, rollout_id: str) -> tuple[int, ...]:
    _, last_id = run_agent([proxy], rollout_id, turns=2)
    finish(proxy, rollout_id, 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None, pulled.skip_reason
    return pulled.row.weight_versions


def test_versions_follow_the_engine_labels(redis_url: str, engine: str) -> None:
    config = proxy_config(redis_url, engine, weight_source="engine", weight_version=4)
    with running_server(ProxyApp(config)) as proxy:
        assert _versions(redis_url, proxy, "w-default") == (4, 4)  # label "default" is --weight-version
        httpx.post(f"{engine}/update_weight_version", json={"new_version": "6"}).raise_for_status()
        assert _versions(redis_url, proxy, "w-six") == (6, 6)


def test_an_engine_label_the_rule_refuses_stops_the_start(redis_url: str, engine: str) -> None:
    httpx.post(f"{engine}/update_weight_version", json={"new_version": "v2"}).raise_for_status()
    proxy = ProxyApp(proxy_config(redis_url, engine, weight_source="engine"))
    with pytest.raises(StagingModeError, match="'v2' is not a non-negative integer"):
        anyio.run(proxy.open)
    assert proxy.middleware is None  # and everything it opened is closed again (no ResourceWarning)


def test_versions_follow_the_trainers_published_key(redis_url: str, engine: str) -> None:
    async def publish(version: int) -> None:
        async with aioredis.from_url(redis_url) as client:
            await publish_weight_version(client, "stg", version)

    config = proxy_config(redis_url, engine, weight_source="published", weight_version=1, weight_staleness_s=0.001)
    with running_server(ProxyApp(config)) as proxy:
        assert _versions(redis_url, proxy, "p-none") == (1, 1)  # nothing published: --weight-version
        anyio.run(publish, 8)
        assert _versions(redis_url, proxy, "p-eight") == (8, 8)


def test_a_published_version_the_record_cannot_carry_is_refused_before_the_engine_generates(redis_url: str) -> None:
    """A key written by hand beyond the record's u64: every call is refused with one precise error before it is
    admitted or forwarded (nothing generated, nothing recorded), and calls are captured again once it is fixed."""
    engine = RecordingEngine()
    with redis.Redis.from_url(redis_url) as client:
        client.set(weight_version_key("stg"), str(1 << 64))
        config = {"weight_source": "published", "weight_staleness_s": 0.001, "prefix_mode": "verify"}
        with proxy_before(engine, redis_url, **config) as (url, proxy):
            with pytest.raises(openai.APIStatusError) as raised:
                client_for(url, "w-big").chat.completions.create(**BODY)
            assert engine.paths == []  # never forwarded: the engine generated nothing
            shown = manifest(redis_url, "w-big")
            assert (shown.records, shown.failures) == ([], [])  # nothing admitted: the rollout is not poisoned
            client.set(weight_version_key("stg"), str((1 << 64) - 1))  # the operator fixes it: the largest u64
            _, last_id = run_agent([url], "w-big", turns=2)
            finish(url, "w-big", 1.0, last_id)
    assert raised.value.status_code == 503
    message = (
        f"stg:weight_version holds '{1 << 64}', not an integer in [0, 2**64) (the record's u64 weight_version); "
        "the call is refused before it is generated (publish a valid version: staging-sink weights set N)"
    )
    assert raised.value.response.json() == {
        "error": {"message": message, "type": "WeightVersionUnusable", "param": None, "code": 503}
    }
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and pulled.row.weight_versions == ((1 << 64) - 1, (1 << 64) - 1)
    assert proxy.metrics.counts == {"captured": 2, "uncaptured": 0, "capture_failed": 1, "capture_error": 0}


def test_a_deleted_published_version_is_loud(redis_url: str, engine: str, caplog: pytest.LogCaptureFixture) -> None:
    """The key existed, then vanished (redis-cli DEL): calls keep the documented fallback (--weight-version), and
    the state is logged once per transition and counted per call stamped meanwhile."""
    caplog.set_level(logging.INFO, logger="worker.weight_version")
    counter = "staging_proxy_deleted_weight_version_calls_total"
    config = proxy_config(redis_url, engine, weight_source="published", weight_version=1, weight_staleness_s=0.001)
    with redis.Redis.from_url(redis_url) as client, running_server(ProxyApp(config)) as proxy:
        assert _versions(redis_url, proxy, "d-none") == (1, 1)  # never published: the fallback, quietly
        assert "deleted" not in caplog.text
        anyio.run(partial(_publish, redis_url, 8))
        assert _versions(redis_url, proxy, "d-eight") == (8, 8)
        client.delete(weight_version_key("stg"))
        assert _versions(redis_url, proxy, "d-gone") == (1, 1)
        assert _versions(redis_url, proxy, "d-gone-2") == (1, 1)
        metrics = httpx.get(f"{proxy}/staging-sink/metrics").text
        anyio.run(partial(_publish, redis_url, 9))
        assert _versions(redis_url, proxy, "d-nine") == (9, 9)
        after = httpx.get(f"{proxy}/staging-sink/metrics").text
    deleted = [r.getMessage() for r in caplog.records if "was deleted" in r.getMessage()]
    message = (
        "the published weight version (8) was deleted: stg:weight_version is gone; calls are stamped with the "
        "fallback version (--weight-version) until the trainer publishes again (staging-sink weights set N)"
    )
    assert deleted == [message]
    assert [r.levelno for r in caplog.records if "was deleted" in r.getMessage()] == [logging.ERROR]
    again = [r.getMessage() for r in caplog.records if "published again" in r.getMessage()]
    assert again == ["a weight version is published again (9): calls are stamped with it"]
    assert f"{counter} 4.0" in metrics  # two rollouts of two calls each were stamped meanwhile
    assert f"{counter} 4.0" in after  # and none since


async def _publish(redis_url: str, version: int) -> None:
    async with aioredis.from_url(redis_url) as client:
        await publish_weight_version(client, "stg", version)
