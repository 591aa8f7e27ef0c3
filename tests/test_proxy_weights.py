"""Weight versions through the capture proxy (the simulated engine in exact-prefix mode): stamped from the engine's
``weight_versions`` spans (``--weight-source engine``), from the trainer's published key (``published``), or the
fixed ``--weight-version``; an engine label the rule cannot map stops the proxy at start."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from sink.trainer.weights import publish_weight_version
from tests.helpers.proxy import close_clients, finish, proxy_config, pull, run_agent
from worker.errors import StagingModeError
from worker.proxy.app import build_proxy
from worker.proxy.serve import running_server
from worker.simulated.http_app import EngineApp
from worker.simulated.options import EngineOptions


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
    with running_server(build_proxy(config)) as proxy:
        assert _versions(redis_url, proxy, "w-default") == (4, 4)  # label "default" is --weight-version
        httpx.post(f"{engine}/update_weight_version", json={"new_version": "6"}).raise_for_status()
        assert _versions(redis_url, proxy, "w-six") == (6, 6)


def test_an_engine_label_the_rule_refuses_stops_the_start(redis_url: str, engine: str) -> None:
    httpx.post(f"{engine}/update_weight_version", json={"new_version": "v2"}).raise_for_status()
    proxy = build_proxy(proxy_config(redis_url, engine, weight_source="engine"))
    with pytest.raises(StagingModeError, match="'v2' is not a non-negative integer"):
        anyio.run(proxy.open)
    assert proxy.middleware is None  # and everything it opened is closed again (no ResourceWarning)


def test_versions_follow_the_trainers_published_key(redis_url: str, engine: str) -> None:
    async def publish(version: int) -> None:
        async with aioredis.from_url(redis_url) as client:
            await publish_weight_version(client, "stg", version)

    config = proxy_config(redis_url, engine, weight_source="published", weight_version=1, weight_staleness_s=0.001)
    with running_server(build_proxy(config)) as proxy:
        assert _versions(redis_url, proxy, "p-none") == (1, 1)  # nothing published: --weight-version
        anyio.run(publish, 8)
        assert _versions(redis_url, proxy, "p-eight") == (8, 8)
