"""GRPO groups gathered at the rollout end (sink.rollout.assembler) on real servers: an assembler that crashes
before acknowledging a member's event, several assemblers and several ranks, the timeout sweep, late members, and a
cluster.

The contract (docs/training.md#grpo-groups): the call that completes a group freezes its member set; the
assembler publishes one entry for the group, marks the record published and only then acknowledges the event. A
crash before the mark publishes the frozen set again and the ranks' claims drop the second entry; a crash after it
publishes nothing again. Each group is delivered whole, exactly once, however many assemblers gather it and ranks
read it.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sink.errors import StagingError
from sink.keys import claim_key, dead_letter_stream, group_keys, open_groups_key, receipts_stream
from sink.rollout.assembler import Assembler, finished
from sink.settings import DEFAULT_SHARDS
from sink.store.connection import reply_text
from sink.store.streams import StreamEntry
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import EventCounter, running_assembler, stage_rollouts
from tests.helpers.processes import until
from tests.helpers.replies import raw_entries, text_entries, xadd_fields
from tests.helpers.topology import fresh_namespace
from tests.helpers.trainer import publish_groups, wait_published

pytestmark = pytest.mark.anyio

NS = "stg"
ONE_SHARD: dict[str, Any] = {"receipt_shards": 1}


async def _finish(url: str, members: dict[str, tuple[str, int]], *, namespace: str = NS, **client: Any) -> None:
    async with aioredis.Redis.from_url(url, **client) as redis_client:
        for rollout_id, (group_id, size) in members.items():
            await finished(
                redis_client, rollout_id, reward=1.0, group_id=group_id, group_size=size, namespace=namespace
            )


async def _group_entries(url: str, group_id: str) -> int:
    async with aioredis.Redis.from_url(url) as client:
        entries = raw_entries(await client.xrange(receipts_stream(NS, 0)))
        return sum(1 for _id, fields in entries if fields.get(b"group_id") == group_id.encode())


async def _pull_all(groups: GroupReader, rollouts: int) -> list[RolloutGroup]:
    delivered: list[RolloutGroup] = []
    with anyio.fail_after(20):
        while groups.reader.statistics().pulled < rollouts:
            delivered += await groups.pull_groups(8, block_ms=50)
    return delivered


@pytest.mark.parametrize("crash", ["before-the-mark", "after-the-mark"])
async def test_an_assembler_crashing_before_the_acknowledgement_never_makes_two_groups(
    redis_url: str, crash: str, caplog: pytest.LogCaptureFixture
) -> None:
    members = {f"x-{i}": ("crashy", 3) for i in range(3)}
    await stage_rollouts(redis_url, list(members), calls=1)
    await _finish(redis_url, members)
    meta = group_keys(NS, "crashy")[0]
    crashed = anyio.Event()
    acked = EventCounter(len(members))
    lock = anyio.Lock()  # the events of one batch are handled concurrently: one crash only

    async def crash_once(entry: StreamEntry) -> None:
        async with lock, aioredis.Redis.from_url(redis_url) as client:
            if not crashed.is_set() and await client.hexists(meta, "published"):
                crashed.set()
                if crash == "before-the-mark":
                    await client.hdel(meta, "published")  # the crash came between the entry and the mark
                raise StagingError("the assembler crashed before acknowledging the event")
        await acked(entry)

    async with running_assembler(redis_url, before_ack=crash_once, block_ms=50, claim_idle_ms=200, **ONE_SHARD):
        with anyio.fail_after(20):
            await acked.reached.wait()  # the crashed event too: reclaimed after claim_idle_ms, done again
    assert crashed.is_set()
    assert await _group_entries(redis_url, "crashy") == (2 if crash == "before-the-mark" else 1)
    caplog.set_level(logging.INFO)
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        (group,) = await _pull_all(groups, 3)
        assert group.rollout_ids == ("x-0", "x-1", "x-2") and group.complete
        with anyio.fail_after(10):
            while await reader.pending() > 1:  # the second entry (if any): every member a duplicate, acknowledged
                assert await groups.pull_groups(8, block_ms=50) == []
        duplicates = 1 if crash == "before-the-mark" else 0  # the second entry, dropped whole
        assert reader.statistics().duplicates_dropped == duplicates
        await groups.ack_groups([group])
        assert await reader.pending() == 0 and reader.statistics().double_deliveries == 0


async def test_several_assemblers_and_ranks_deliver_each_group_whole_exactly_once(redis_url: str) -> None:
    groups_of = {f"many-{g}": [f"n{g}-{m}" for m in range(4)] for g in range(8)}
    members = {rollout_id: (group_id, 4) for group_id, ids in groups_of.items() for rollout_id in ids}
    await stage_rollouts(redis_url, list(members), calls=1)
    await _finish(redis_url, members)
    acked = EventCounter(len(members))
    async with AsyncExitStack() as stack:
        assemblers: list[Assembler] = [
            await stack.enter_async_context(
                running_assembler(redis_url, before_ack=acked, block_ms=50, batch_events=3, consumer_name=f"asm-{i}")
            )
            for i in range(3)
        ]
        with anyio.fail_after(20):
            await acked.reached.wait()
        complete = sum(a.statistics().groups_complete for a in assemblers)
        assert complete == len(groups_of) and sum(a.statistics().events for a in assemblers) == len(members)
        assert sum(a.statistics().published for a in assemblers) == len(members)  # a group entry: its receipts
    async with AsyncExitStack() as stack:
        readers = [
            await stack.enter_async_context(RolloutReader.from_url(redis_url, consumer_name=f"rank-{i}"))
            for i in range(3)
        ]
        ranks = [GroupReader(reader) for reader in readers]
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(20):
            while len(delivered) < len(groups_of):
                for rank in ranks:
                    got = await rank.pull_groups(4, block_ms=20)
                    await rank.ack_groups(got)
                    delivered += got
        assert sorted((g.group_id, g.rollout_ids) for g in delivered) == [
            (group_id, tuple(sorted(ids))) for group_id, ids in sorted(groups_of.items())
        ]
        assert all(g.complete for g in delivered)
        for reader in readers:
            stats = reader.statistics()
            assert (stats.duplicates_dropped, stats.double_deliveries, stats.held) == (0, 0, 0)
        assert await readers[0].pending() == 0


async def test_the_sweep_seals_a_group_and_the_assemblers_count_what_waits(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["w-0", "late-0"], calls=1)
    await _finish(redis_url, {"w-0": ("waits", 2)})
    acked = EventCounter(1)
    async with running_assembler(redis_url, before_ack=acked, block_ms=50, group_timeout_s=600.0) as assembler:
        with anyio.fail_after(20):
            await acked.reached.wait()
        await until(lambda: assembler.statistics().groups_waiting == 1, "not counted waiting")
    assert await _group_entries(redis_url, "waits") == 0
    async with running_assembler(redis_url, block_ms=50, group_timeout_s=0.2) as assembler:
        await wait_published(redis_url, ["waits"])
        await until(lambda: assembler.statistics().groups_waiting == 0, "still counted waiting")
        await until(lambda: assembler.statistics().groups_sealed == 1, "the seal was not counted")  # after the mark
    # A member after the group was sealed is published alone, marked late.
    late = EventCounter(1)
    await _finish(redis_url, {"late-0": ("waits", 2)})
    async with running_assembler(redis_url, before_ack=late, block_ms=50) as assembler:
        with anyio.fail_after(20):
            await late.reached.wait()
        assert assembler.statistics().late_members == 1


async def test_groups_are_gathered_and_delivered_across_cluster_slots(cluster: LocalCluster) -> None:
    namespace = "grp-cluster"
    groups_of = {f"cg-{g}": [f"cg{g}-{m}" for m in range(3)] for g in range(4)}
    members = {rollout_id: (group_id, 3) for group_id, ids in groups_of.items() for rollout_id in ids}
    members["cg-short-0"] = ("cg-short", 2)  # sealed at the timeout
    fields: dict[str, Any] = {"cluster": True, "namespace": namespace}
    async with fresh_namespace(cluster, namespace):
        await stage_rollouts(cluster.url, list(members), calls=1, **fields)
        client = RedisCluster.from_url(cluster.url)
        try:
            for rollout_id, (group_id, size) in members.items():
                await finished(client, rollout_id, reward=1.0, group_id=group_id, group_size=size, namespace=namespace)
            # Every member is recorded first (the default timeout: on a busy cluster a sweep between two members of
            # a group on different shards would seal it short), then a short timeout seals the group left open.
            acked = EventCounter(len(members))
            async with running_assembler(cluster.url, before_ack=acked, block_ms=50, **fields):
                with anyio.fail_after(20):
                    await acked.reached.wait()
            async with running_assembler(cluster.url, block_ms=50, group_timeout_s=0.3, **fields):
                meta = group_keys(namespace, "cg-short")[0]
                await until(lambda: client.hexists(meta, "published"), "cg-short never sealed", timeout_s=20)
        finally:
            await client.aclose()
        async with RolloutReader.from_url(cluster.url, **fields) as reader:
            groups = GroupReader(reader)
            delivered = await _pull_all(groups, len(members))
            assert sorted((g.group_id, g.rollout_ids, g.complete) for g in delivered) == [
                *((group_id, tuple(ids), True) for group_id, ids in sorted(groups_of.items())),
                ("cg-short", ("cg-short-0",), False),
            ]
            await groups.ack_groups(delivered)
            assert await reader.pending() == 0


async def test_a_group_published_twice_goes_whole_to_the_entry_that_claimed_it_first(redis_url: str) -> None:
    """Two ranks reading the two entries of a group published twice (an assembler crashed before the mark) claim
    the members concurrently: without a claim of the group itself, each rank could win some members and deliver
    part of the group. Here the second entry's rank has claimed the group and one member when the first entry's
    rank claims: the first entry is dropped whole."""
    await publish_groups(redis_url, {"twice": ["t-0", "t-1", "t-2"]}, receipt_shards=1)
    stream = receipts_stream(NS, 0)
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        ((_first_id, fields),) = text_entries(await client.xrange(stream))
        second_id = reply_text(await client.xadd(stream, xadd_fields(fields)), "entry id")  # the republished entry
        token = f"{stream}#{second_id}"
        # What the second entry's rank has written so far: the group's claim and one member's.
        await client.hset(group_keys(NS, "twice")[0], "claimed", token)
        await client.set(claim_key(NS, "t-1"), f"{token}\nrank-1")
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        assert await groups.pull_groups(1) == []  # the first entry: dropped whole, nothing claimed
        assert reader.held_rollouts == () and reader.statistics().duplicates_dropped == 1
        (group,) = await groups.pull_groups(1)  # the second entry (its rank "died"): the whole group
        assert group.rollout_ids == ("t-0", "t-1", "t-2") and group.complete
        await groups.ack_groups([group])
        assert await reader.pending() == 0


async def test_a_group_entry_whose_record_lacks_a_member_is_dead_lettered_whole(redis_url: str) -> None:
    await publish_groups(redis_url, {"holed": ["h-0", "h-1"]}, receipt_shards=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await client.hdel(group_keys(NS, "holed")[1], "h-1") == 1  # the record lost a member
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        assert await GroupReader(reader).pull_groups(4) == []
        assert reader.statistics().dead_lettered == 1 and await reader.pending() == 0 and reader.held_rollouts == ()
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        ((_id, fields),) = text_entries(await client.xrange(dead_letter_stream(NS, "receipts-0")))
        assert fields["group_id"] == "holed" and "lacks member 'h-1'" in fields["dead_reason"]


async def test_a_group_the_sweep_cannot_seal_is_set_aside_and_the_others_are_sealed(redis_url: str) -> None:
    """A refusal sealing one group (a record of the wrong type) is logged and counted, as a refused event is: it
    neither stops the assembler nor keeps the sweep from the other groups."""
    await stage_rollouts(redis_url, ["ok-0"], calls=1)
    await _finish(redis_url, {"ok-0": ("fine", 2)})
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.set(group_keys(NS, "broken")[0], "not a hash")
        for shard in range(DEFAULT_SHARDS):  # the broken group first in every index
            await client.zadd(open_groups_key(NS, shard), {"broken": 0})
    acked = EventCounter(1)
    async with running_assembler(redis_url, before_ack=acked, block_ms=50, group_timeout_s=0.2) as assembler:
        with anyio.fail_after(20):
            await acked.reached.wait()
        await wait_published(redis_url, ["fine"])
        await until(lambda: assembler.statistics().failures >= 1, "the broken group was never refused")
        await until(lambda: assembler.statistics().groups_sealed == 1, "the seal was not counted")  # after the mark
