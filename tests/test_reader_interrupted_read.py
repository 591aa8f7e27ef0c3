"""A read of new receipts cut short loses nothing for the reader that made it (real servers).

The reader reads new receipts shard after shard. When the read of one shard fails (a failover's ``MOVED`` or
``UNBLOCKED``, a lost connection), the shards read before it were already served: their entries are pending for
this reader in the group. They come out of its next ``pull`` at once, not ``claim_idle_ms`` (5 minutes by default)
later, when another reader could reclaim them. The same holds for the read whose reply never arrived: its shard is
read again from this consumer's own pending entries before anything new.
"""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import StagingError
from sink.keys import DEFAULT_NAMESPACE, receipts_stream
from sink.settings import ServiceSettings
from sink.store.connection import Topology
from sink.store.healing import SelfHealingGroupConsumer
from sink.trainer.reader import RolloutReader
from tests.helpers.group_members import publish_members

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


async def test_a_shard_whose_read_failed_is_suspect_until_its_own_pending_entries_are_read(redis_url: str) -> None:
    namespace = "suspect"
    streams = [receipts_stream(namespace, shard) for shard in range(2)]
    settings = ServiceSettings(namespace=namespace)
    async with aioredis.Redis.from_url(redis_url) as client:
        topology = Topology.borrow(client, settings)
        consumer = SelfHealingGroupConsumer(
            topology,
            namespace=namespace,
            role="receipts",
            streams=streams,
            group="g",
            consumer="c",
            claim_idle_ms=300_000,
            max_deliveries=5,
        )
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
