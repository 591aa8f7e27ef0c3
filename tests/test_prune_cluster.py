"""``prune`` on a cluster: every rule runs on the primary that owns the key (retention of consumed rollouts,
dead-letter trimming, idle consumer names), whichever primary that is. Its own namespace: the cluster is
shared by the session's cluster tests."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from sink.keys import dead_letter_stream, done_stream, fence_key
from sink.ops.prune import prune_namespace
from sink.settings import PruneSettings
from sink.store.connection import Topology
from sink_tools.cluster import LocalCluster
from tests.helpers.prune import next_millisecond


@pytest.mark.anyio
async def test_prune_on_a_cluster_retains_trims_and_removes_idle_consumers_on_every_primary(
    cluster: LocalCluster,
) -> None:
    ns = "prune-cl"
    retired = [f"prune-r-{index}" for index in range(6)]
    dead = [dead_letter_stream(ns, f"receipts-{index}") for index in range(6)]
    done = [done_stream(ns, index) for index in range(6)]
    settings = PruneSettings(
        namespace=ns, dead_letter_max_entries=2, consumer_idle_max_s=0.01, retention_s=60, cluster=True
    )
    async with RedisCluster.from_url(cluster.url) as client:
        topology = Topology.borrow(client, settings)
        await topology.initialize()
        assert len({topology.node_for_key(fence_key(ns, rid)) for rid in retired}) > 1
        assert len({topology.node_for_key(stream) for stream in dead}) > 1
        assert len({topology.node_for_key(stream) for stream in done}) > 1
        for rid in retired:
            await client.set(fence_key(ns, rid), "1")  # consumed, no TTL
        for stream in dead:
            for index in range(5):
                await client.xadd(stream, {"n": str(index)})
        for stream in done:
            await client.xgroup_create(stream, "assemblers", id="0", mkstream=True)
            await client.xgroup_createconsumer(stream, "assemblers", "gone")
        for stream in done:
            while any(int(c["idle"]) < 20 for c in await client.xinfo_consumers(stream, "assemblers")):
                await next_millisecond()
        report = await prune_namespace(topology, settings)
        await topology.aclose()
        assert report.retained == sorted(retired)
        assert report.dead_letters_trimmed == dict.fromkeys(dead, 3)
        assert sorted(report.consumers_removed) == sorted(f"{stream} assemblers gone" for stream in done)
        for rid in retired:
            assert 0 < await client.ttl(fence_key(ns, rid)) <= 60
        for stream in dead:
            assert await client.xlen(stream) == 2
        for stream in done:
            assert await client.xinfo_consumers(stream, "assemblers") == []
        for rid in retired:
            await client.delete(fence_key(ns, rid))
        for stream in (*dead, *done):
            await client.delete(stream)
