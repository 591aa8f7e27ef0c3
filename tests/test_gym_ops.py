"""Operator commands see the NeMo Gym transport's rollouts: ``list`` shows them, ``prune`` abandons stale ones."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from sink.cli.listing import collect_rollouts
from sink.errors import RolloutRetiredError
from sink.gym import RedisTokenSink, RedisTokenSource
from sink.keys import gym_keys
from sink.ops.prune import prune_namespace
from sink.settings import PruneSettings
from sink.store.connection import Topology
from tests.helpers.gym import make_entry

pytestmark = pytest.mark.anyio


async def test_list_shows_gym_rollouts_and_prune_abandons_only_stale_ones(redis_url: str) -> None:
    sink = RedisTokenSink(redis_url=redis_url)
    source = RedisTokenSource(redis_url=redis_url)
    try:
        for rollout_id in ("gym-stale", "gym-fresh", "gym-done"):
            await sink.put(make_entry(rollout_id, "c1"))
        frozen = await source.freeze("gym-done")
        assert await source.drop("gym-done", snapshot_id=frozen.snapshot_id, version=frozen.version)
        async with aioredis.Redis.from_url(redis_url) as client:
            topology = Topology.borrow(client, PruneSettings())
            states = {r.rollout_id: r.state for r in await collect_rollouts(topology, "stg")}
            assert states == {"gym-stale": "gym", "gym-fresh": "gym", "gym-done": "retired"}
            # age one rollout: its last transport write was an hour ago
            stale_ms = int((time.time() - 3600) * 1000)
            await client.hset(gym_keys("stg", "gym-stale")[0], "touched_ms", str(stale_ms))
            settings = PruneSettings(abandon_after_s=600, retention_s=60)
            report = await prune_namespace(topology, settings)
            assert report.abandoned == ["gym-stale"]
            state, entries, digests, intents, fence = gym_keys("stg", "gym-stale")
            assert await client.exists(state, entries, digests, intents) == 0
            assert 0 < await client.ttl(fence) <= 60
            assert await client.exists(gym_keys("stg", "gym-fresh")[1]) == 1
        with pytest.raises(RolloutRetiredError):
            await sink.put(make_entry("gym-stale", "c2"))  # the abandoned rollout refuses late writes
        assert len((await source.freeze("gym-fresh")).entries) == 1
    finally:
        await sink.close()
        await source.close()
