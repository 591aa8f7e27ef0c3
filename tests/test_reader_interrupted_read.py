"""A read of new receipts cut short loses nothing for the reader that made it (real servers).

The reader reads new receipts shard after shard. When the read of one shard fails (a failover's ``MOVED`` or
``UNBLOCKED``, a lost connection), the shards read before it were already served: their entries are pending for
this reader in the group. They come out of its next ``pull`` at once, not ``claim_idle_ms`` (5 minutes by default)
later, when another reader could reclaim them. The same holds for the read whose reply never arrived: its shard is
read again from this consumer's own pending entries before anything new.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sink.errors import StagingError
from sink.keys import DEFAULT_NAMESPACE, receipts_stream
from sink.settings import ServiceSettings
from sink.store.connection import Topology
from sink.store.healing import SelfHealingGroupConsumer
from sink.store.streams import StreamEntry
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.cluster import LocalCluster
from tests.helpers.group_members import publish_members
from tests.helpers.topology import owner_of, slot_of

pytestmark = pytest.mark.anyio


async def test_receipts_read_before_a_shard_failed_come_out_of_the_next_pull(redis_url: str) -> None:
    # Two shards, read one after the other, each pull starting one shard further. The default lease
    # (claim_idle_ms) is 5 minutes.
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", receipt_shards=2) as reader,
        aioredis.Redis.from_url(redis_url) as client,
    ):
        # Its own pending entries (none) are read once, at its first pull; the third pull starts at shard 0.
        assert await reader.pull(8) == []
        assert await reader.pull(8) == []
        await publish_members(redis_url, {"cut-0": None, "cut-1": None, "cut-2": None})  # on receipts shard 0
        shard_1 = receipts_stream(DEFAULT_NAMESPACE, 1)
        await client.delete(shard_1)
        await client.set(shard_1, "not a stream")  # reading shard 1 now fails (WRONGTYPE)
        with pytest.raises(StagingError, match="WRONGTYPE"):
            await reader.pull(8)
        await client.delete(shard_1)  # the next read of shard 1 recreates its stream and group
        with anyio.fail_after(20):
            pulled = await reader.pull(8)
        assert sorted(rollout.rollout_id for rollout in pulled) == ["cut-0", "cut-1", "cut-2"]
        assert all(rollout.trainable for rollout in pulled)
        await reader.ack([rollout.rollout_id for rollout in pulled])
        assert await reader.pending() == 0


def _consumer(topology: Topology, namespace: str, streams: list[str]) -> SelfHealingGroupConsumer:
    """Consumer ``c`` of group ``g`` over *streams*, with the reader's default lease (5 minutes)."""
    return SelfHealingGroupConsumer(
        topology,
        namespace=namespace,
        role="receipts",
        streams=streams,
        group="g",
        consumer="c",
        claim_idle_ms=300_000,
        max_deliveries=5,
    )


async def test_a_shard_whose_read_failed_is_suspect_until_its_own_pending_entries_are_read(redis_url: str) -> None:
    namespace = "suspect"
    streams = [receipts_stream(namespace, shard) for shard in range(2)]
    settings = ServiceSettings(namespace=namespace)
    async with aioredis.Redis.from_url(redis_url) as client:
        topology = Topology.borrow(client, settings)
        consumer = _consumer(topology, namespace, streams)
        await consumer.prepare()
        entry_id = await client.xadd(streams[1], {"rollout_id": "r-0"})
        await client.delete(streams[0])
        await client.set(streams[0], "not a stream")
        with pytest.raises(StagingError, match="WRONGTYPE"):
            await consumer.read_new([0], count=8, block_ms=None)
        assert consumer.suspect_shards() == [0]
        await client.delete(streams[0])
        with anyio.fail_after(20):
            (served,) = await consumer.read_new([1], count=8, block_ms=None)
        assert served.entry_id.encode() == entry_id
        assert consumer.suspect_shards() == [0]  # a read that succeeded clears nothing
        assert await consumer.read_own_pending(0) == []
        assert consumer.suspect_shards() == []


def _namespace_across_two_nodes(cluster: LocalCluster) -> str:
    """A namespace whose receipts shards 0 and 1 live on two different primaries."""
    for n in range(1000):
        namespace = f"suspect-{n}"
        first, second = (owner_of(cluster, slot_of(receipts_stream(namespace, shard))) for shard in range(2))
        if first.port != second.port:
            return namespace
    raise AssertionError("no namespace puts shards 0 and 1 on two nodes")


async def test_a_cluster_read_that_failed_leaves_every_shard_it_read_suspect(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a cluster each shard is read with its own command, concurrently. Shard 0's read is answered first (its
    # entry delivered and taken in); shard 1's node is paused meanwhile, then answers WRONGTYPE. The entry of shard
    # 0 went with the error: it is pending for this consumer only, so both shards must be suspect and shard 0's own
    # pending entries hold it (before the fix only the unfinished shards were, and only when no read failed).
    await anyio.to_thread.run_sync(cluster.heal)
    namespace = _namespace_across_two_nodes(cluster)
    streams = [receipts_stream(namespace, shard) for shard in range(2)]
    slow = owner_of(cluster, slot_of(streams[1]))
    topology = Topology.from_url(cluster.url, ServiceSettings(namespace=namespace, cluster=True))
    async with RedisCluster.from_url(cluster.url) as client:
        consumer = _consumer(topology, namespace, streams)
        try:
            await consumer.prepare()
            # Shard 0's reply taken in: the consumer parses a reply that delivered the entry (observed, not awaited).
            taken_in = anyio.Event()
            parse_read = consumer._parse_read

            def observed_parse(reply: Any, deliveries: int) -> tuple[list[StreamEntry], list[str]]:
                parsed = parse_read(reply, deliveries)
                if any(entry.stream == streams[0] for entry in parsed[0]):
                    taken_in.set()
                return parsed

            monkeypatch.setattr(consumer, "_parse_read", observed_parse)
            entry_id = await client.xadd(streams[0], {"rollout_id": "r-0"})
            await client.delete(streams[1])
            await client.set(streams[1], "not a stream")
            failure: list[BaseException] = []

            async def read() -> None:
                try:
                    await consumer.read_new([0, 1], count=8, block_ms=None)
                except Exception as exc:  # noqa: BLE001 (a task group's failure: checked below)
                    failure.append(exc)

            slow.pause()
            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(read)
                    # Shard 0's read was served and its reply taken in, while shard 1's node is still paused.
                    with anyio.fail_after(20):
                        await taken_in.wait()
                    assert (await client.xpending(streams[0], "g"))["pending"] == 1
                    slow.resume()
            finally:
                if slow.paused:
                    slow.resume()
            (error,) = failure
            # One typed error, as from a single server's read (not a task group's ExceptionGroup).
            assert isinstance(error, StagingError) and "WRONGTYPE" in str(error), repr(error)
            assert consumer.suspect_shards() == [0, 1]
            with anyio.fail_after(20):
                (entry,) = await consumer.read_own_pending(0)
            assert entry.entry_id.encode() == entry_id
            assert consumer.suspect_shards() == [1]
        finally:
            await client.delete(*streams)
            await topology.aclose()
