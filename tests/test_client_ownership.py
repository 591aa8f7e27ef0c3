"""Who closes the client: ``from_url`` and ``owns_client=True`` close it at ``aclose``; a borrowed client stays open.

Every async resource that takes a client has the same two constructors (a real server).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import Assembler
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.reader.rollout_reader import RolloutReader

RESOURCES: dict[str, Callable[..., Any]] = {
    "sink": AsyncRedisStagingSink,
    "source": AsyncRedisStagingSource,
    "ledger": RedisCaptureLedger,
    "assembler": Assembler,
    "reader": RolloutReader,
}


class _CountingRedis(aioredis.Redis):
    """A real client that counts its ``aclose`` calls."""

    closes = 0

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        self.closes += 1
        await super().aclose(close_connection_pool)


@pytest.mark.anyio
@pytest.mark.parametrize("name", RESOURCES)
@pytest.mark.parametrize("owns", [False, True])
async def test_the_client_is_closed_exactly_when_the_resource_owns_it(redis_url: str, name: str, owns: bool) -> None:
    client = _CountingRedis(connection_pool=aioredis.ConnectionPool.from_url(redis_url))
    try:
        async with RESOURCES[name](client, owns_client=owns):
            assert await client.ping() is True
        assert client.closes == (1 if owns else 0)
    finally:
        await client.aclose(close_connection_pool=True)


@pytest.mark.parametrize("name", RESOURCES)
def test_a_client_that_is_not_a_redis_asyncio_client_is_refused(name: str) -> None:
    with pytest.raises(TypeError, match="expected a redis.asyncio client, got str"):
        RESOURCES[name]("redis://localhost:6379")
