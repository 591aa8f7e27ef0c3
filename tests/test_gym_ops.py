"""Operator commands see the NeMo Gym transport's rollouts: ``list`` shows them, ``prune`` abandons stale ones."""

from __future__ import annotations

import time

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import RolloutRetiredError
from sink.gym import RedisTokenSink, RedisTokenSource
from sink.keys import fence_key, gym_keys
from sink.ops.prune import prune_namespace
from sink.settings import PruneSettings
from sink.store.connection import Topology
from sink_cli.common import EXIT_OK
from sink_cli.listing import collect_rollouts
from sink_cli.main import main
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
            await client.hset(gym_keys("stg", "gym-stale").state, "touched_ms", str(stale_ms))
            settings = PruneSettings(abandon_after_s=600, retention_s=60)
            report = await prune_namespace(topology, settings)
            assert report.abandoned == ["gym-stale"]
            stale = gym_keys("stg", "gym-stale")
            assert await client.exists(*stale[:-1]) == 0
            assert 0 < await client.ttl(stale.tombstone) <= 60
            assert await client.exists(fence_key("stg", "gym-stale")) == 0  # the RL path's fence is not the Gym's
            assert await client.exists(gym_keys("stg", "gym-fresh").entries) == 1
        with pytest.raises(RolloutRetiredError):
            await sink.put(make_entry("gym-stale", "c2"))  # the abandoned rollout refuses late writes
        assert len((await source.freeze("gym-fresh")).entries) == 1
    finally:
        await sink.close()
        await source.close()


async def test_a_freeze_counts_as_activity_and_an_abandoned_frozen_rollout_is_tombstoned(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frozen rollout's snapshot lives in keys of its own (``gym:frozen``, ``gym:snapshot``): prune ages it by the
    newer of the sink's last write and the last freeze, deletes those keys too, and leaves the Gym tombstone."""
    sink = RedisTokenSink(redis_url=redis_url)
    source = RedisTokenSource(redis_url=redis_url)
    hour_ago = str(int((time.time() - 3600) * 1000))
    try:
        for rollout_id in ("frozen-stale", "frozen-late"):
            await sink.put(make_entry(rollout_id, "c1"))
            await source.freeze(rollout_id)
        async with aioredis.Redis.from_url(redis_url) as client:
            for key in (gym_keys("stg", "frozen-stale").state, gym_keys("stg", "frozen-stale").frozen):
                await client.hset(key, "touched_ms", hour_ago)
            await client.hset(gym_keys("stg", "frozen-late").state, "touched_ms", hour_ago)  # frozen just now
            topology = Topology.borrow(client, PruneSettings())
            report = await prune_namespace(topology, PruneSettings(abandon_after_s=600, retention_s=60))
            assert report.abandoned == ["frozen-stale"]
            stale = gym_keys("stg", "frozen-stale")
            assert await client.exists(*stale[:-1]) == 0
            assert 0 < await client.ttl(stale.tombstone) <= 60
            states = {r.rollout_id: r.state for r in await collect_rollouts(topology, "stg")}
            assert states == {"frozen-stale": "dead_lettered", "frozen-late": "gym"}  # on ns:dead:abandoned
        with pytest.raises(RolloutRetiredError):
            await source.freeze("frozen-stale")
        assert [e.model_call_id for e in (await source.freeze("frozen-late")).entries] == ["c1"]
    finally:
        await sink.close()
        await source.close()
    assert await anyio.to_thread.run_sync(main, ["inspect", "frozen-stale", "--redis-url", redis_url]) == EXIT_OK
    assert "gym transport: abandoned by prune; later calls fail" in capsys.readouterr().out
