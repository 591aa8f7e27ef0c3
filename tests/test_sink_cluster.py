"""The sink and source on a local 3-primary, 3-replica Valkey cluster."""

from __future__ import annotations

import anyio
import pytest
import redis

from sink.keys import calls_stream
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink_tools.cluster import LocalCluster
from tests.helpers.staging import make_chain

pytestmark = pytest.mark.anyio


async def test_rollouts_spread_over_every_primary_and_fetch_back(cluster: LocalCluster) -> None:
    with redis.RedisCluster.from_url(cluster.url) as client:
        client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)  # the cluster is shared by the session
    chains = [make_chain(f"cl{r}", 3, n_tokens=16) for r in range(60)]
    records = [record for chain in chains for record in chain]
    async with AsyncRedisStagingSink.from_url(cluster.url, cluster=True) as sink:
        results: list[bool] = []

        async def stage_chain(index: int) -> None:
            for record in chains[index]:
                results.append((await sink.stage(record)).ok)

        async with anyio.create_task_group() as group:
            for index in range(len(chains)):
                group.start_soon(stage_chain, index)
    assert results == [True] * len(records)

    per_primary = {}
    for node in cluster.primaries():
        with node.client() as client:
            per_primary[node.port] = int(client.dbsize())
    assert len(per_primary) == 3
    # Each rollout's 3 records and its calls stream live on one node; all primaries hold some.
    assert all(count > 0 for count in per_primary.values()), per_primary
    assert sum(per_primary.values()) == len(chains) * 4

    async with AsyncRedisStagingSource.from_url(cluster.url, cluster=True) as source:
        keys = [r.staging_key for r in reversed(records)]
        fetched = await source.fetch(keys)
    assert [f.digest for f in fetched] == [r.digest for r in reversed(records)]

    with redis.RedisCluster.from_url(cluster.url) as client:
        assert all(client.xlen(calls_stream("stg", f"cl{r}")) == 3 for r in range(60))
        client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)


async def test_cluster_durability_is_verified_on_every_node(cluster: LocalCluster) -> None:
    replica = cluster.replicas()[0]
    with replica.client() as client:
        client.config_set("appendfsync", "everysec")
    try:
        async with AsyncRedisStagingSink.from_url(cluster.url, cluster=True) as sink:
            result = await sink.stage(make_chain("clx", 1)[0])
        assert not result.ok and result.error is not None
        assert f":{replica.port}" in result.error and "appendfsync" in result.error
    finally:
        with replica.client() as client:
            client.config_set("appendfsync", "always")
