"""GRPO group delivery (sink.trainer.groups) against real servers: one entry per group, two ranks, a rank that
dies holding a group, timeouts, failed members, groups of one."""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.keys import dead_letter_stream, group_keys, receipts_stream, record_key
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.reader.sync_reader import SyncRolloutReader
from tests.helpers.replies import raw_entries
from tests.helpers.trainer import publish, publish_groups

GROUPS = {f"prompt-{g}": [f"p{g}-m{m}" for m in range(4)] for g in range(3)}
WARNING = "may have been trained before"


async def _pull_groups(
    readers: list[GroupReader], wanted: int, *, timeout_s: float = 20.0
) -> list[tuple[str, RolloutGroup]]:
    """Round-robin pull_groups over *readers* (2 rollouts per pull) until *wanted* groups came back."""
    delivered: list[tuple[str, RolloutGroup]] = []
    with anyio.fail_after(timeout_s):
        while len(delivered) < wanted:
            for group_reader in readers:
                for group in await group_reader.pull_groups(2, block_ms=20):
                    delivered.append((group_reader.reader.consumer_name, group))
    return delivered


@pytest.mark.anyio
async def test_a_complete_group_is_one_receipts_entry_naming_its_members(redis_url: str) -> None:
    await publish_groups(redis_url, {"one": ["o-0", "o-1", "o-2"]}, receipt_shards=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        ((_id, fields),) = raw_entries(await client.xrange(receipts_stream("stg", 0)))
        assert b"receipt" not in fields  # the members' receipts are in the group's record, not on the stream
        assert fields[b"group_id"] == b"one" and fields[b"group_state"] == b"complete"
        assert fields[b"group_members"] == b"o-0,o-1,o-2" and fields[b"group_size"] == b"3"
        meta, members = group_keys("stg", "one")
        assert await client.hget(meta, "published") == b"1" and await client.hlen(members) == 3
    async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
        groups = GroupReader(reader)
        (group,) = await groups.pull_groups(1)  # a pull returns whole groups: more than max_rollouts here
        assert group.rollout_ids == ("o-0", "o-1", "o-2") and group.complete
        await groups.ack_groups([group])
        assert await reader.pending() == 0


@pytest.mark.anyio
async def test_two_ranks_never_split_a_group(redis_url: str) -> None:
    await publish_groups(redis_url, GROUPS)
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0") as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1") as rank1,
    ):
        readers = [GroupReader(rank0), GroupReader(rank1)]
        delivered = await _pull_groups(readers, len(GROUPS))
        by_id = {group.group_id: (rank, group) for rank, group in delivered}
        assert len(delivered) == len(by_id) == len(GROUPS)  # each group once
        for group_id, (rank, group) in by_id.items():
            assert group.complete and group.group_size == 4 and not group.failed
            assert group_id is not None and group.rollout_ids == tuple(sorted(GROUPS[group_id]))  # whole, sorted
            assert all(m.row is not None and m.group is not None for m in group.members)
            assert group.reward_mean == 1.5 and group.reward_min == 0.0 and group.reward_max == 3.0
            assert math.isclose(group.reward_std, math.sqrt(1.25))
            owner = rank0 if rank == "rank-0" else rank1
            assert all(owner.holds(rollout_id) for rollout_id in group.rollout_ids)
        # Each rank holds exactly the members of the groups it delivered.
        for group_reader in readers:
            assert await group_reader.pull_groups(1) == []
            own = [g for rank, g in delivered if rank == group_reader.reader.consumer_name]
            assert set(group_reader.reader.held_rollouts) == {i for g in own for i in g.rollout_ids}
            await group_reader.ack_groups(own)
        assert await rank0.pending() == 0
        assert sum(r.statistics().delivered for r in readers) == 3
        assert rank0.statistics().double_deliveries == rank1.statistics().double_deliveries == 0
    async with aioredis.Redis.from_url(redis_url) as client:
        # Closed at ack: both keys expire (a tombstone), the meta marked closed (late members are late).
        for group_id in GROUPS:
            meta, members = group_keys("stg", group_id)
            assert await client.hget(meta, "closed") == b"1" and await client.pttl(meta) > 0
            assert await client.pttl(members) > 0


@pytest.mark.anyio
async def test_a_group_held_by_a_rank_that_died_is_delivered_whole_by_another_rank(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    members = ["c-0", "c-1", "c-2"]
    await publish_groups(redis_url, {"crashed": members}, receipt_shards=1)
    options: dict[str, Any] = {"receipt_shards": 1, "claim_idle_ms": 3_000}  # not idle until rank-1 is gone
    caplog.set_level(logging.INFO)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **options) as rank0:
        survivor = GroupReader(rank0)
        async with RolloutReader.from_url(redis_url, consumer_name="rank-1", **options) as rank1:
            (group,) = await GroupReader(rank1).pull_groups(2)
            assert group.rollout_ids == tuple(members)
            # rank-1 "dies": it closes without acknowledging, its group entry stays pending under its name.
        assert await survivor.pull_groups(1) == [] and rank0.held_rollouts == ()
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(10):
            while not delivered:
                delivered = await survivor.pull_groups(4, block_ms=50)
        (again,) = delivered
        assert again.group_id == "crashed" and again.rollout_ids == tuple(members) and again.complete
        assert rank0.statistics().double_deliveries == 1  # the group, once
        await survivor.ack_groups(delivered)
        assert await rank0.pending() == 0
    assert caplog.text.count(WARNING) == 1


@pytest.mark.anyio
async def test_a_rank_crashing_between_its_members_acknowledgements_gets_back_only_the_others(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    members = ["k-0", "k-1", "k-2"]
    await publish_groups(redis_url, {"cut": members}, receipt_shards=1)
    options: dict[str, Any] = {"receipt_shards": 1, "consumer_name": "rank-0"}
    caplog.set_level(logging.WARNING)
    async with RolloutReader.from_url(redis_url, **options) as first:
        (group,) = await GroupReader(first).pull_groups(4)
        assert group.rollout_ids == tuple(members)
        await first.ack(["k-0"])  # the trainer crashes after the first member's acknowledgement
        assert await first.pending() == 1  # the entry stays pending until its last member
    async with RolloutReader.from_url(redis_url, **options) as again:  # restarted under the same name
        groups = GroupReader(again)
        (rest,) = await groups.pull_groups(4)
        assert rest.group_id == "cut" and rest.rollout_ids == ("k-1", "k-2") and not rest.complete  # k-0 is gone
        assert again.statistics().duplicates_dropped == 1  # k-0: retired, dropped with its warning
        await groups.ack_groups([rest])
        assert await again.pending() == 0
    assert "skipped rollout 'k-0': it is retired" in caplog.text


@pytest.mark.anyio
async def test_the_rollout_reader_alone_returns_a_group_entrys_members(redis_url: str) -> None:
    await publish_groups(redis_url, {"plain": ["r-0", "r-1"]}, receipt_shards=1)
    async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
        pulled = await reader.pull(1)  # whole entries: both members
        assert sorted(p.rollout_id for p in pulled) == ["r-0", "r-1"]
        assert all(p.trainable and p.group is not None and p.group.group_id == "plain" for p in pulled)
        assert all(p.group_entry is not None and p.group_entry.state == "complete" for p in pulled)
        await reader.ack(["r-1"])
        assert await reader.pending() == 1 and reader.held_rollouts == ("r-0",)
        await reader.ack(["r-0"])  # the last member: the entry goes with it
        assert await reader.pending() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["partial", "dead_letter"])
async def test_an_incomplete_group_is_sealed_at_its_timeout(redis_url: str, policy: str) -> None:
    await publish_groups(redis_url, {"short": ["s-0", "s-1"]}, size=3, group_timeout_s=0.3)
    async with RolloutReader.from_url(redis_url, group_timeout_policy=policy) as reader:
        groups = GroupReader(reader)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(10):
            while reader.statistics().pulled < 2:
                delivered += await groups.pull_groups(4, block_ms=50)
        if policy == "partial":
            (group,) = delivered
            assert not group.complete and group.rollout_ids == ("s-0", "s-1") and group.group_size == 3
            assert groups.statistics().partial == 1
            await groups.ack_groups(delivered)
        else:
            assert delivered == [] and groups.statistics().dead_lettered == 1
        assert await reader.pending() == 0 and reader.statistics().held == 0
    if policy == "dead_letter":
        async with aioredis.Redis.from_url(redis_url) as client:
            ((_id, fields),) = raw_entries(await client.xrange(dead_letter_stream("stg", "groups")))
            assert fields[b"group_id"] == b"short" and fields[b"members"] == b"s-0,s-1"


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["deliver_rest", "drop_group"])
async def test_a_group_with_a_failed_member_follows_the_policy(redis_url: str, policy: str) -> None:
    await publish_groups(redis_url, {"hurt": ["h-0", "h-1", "h-2"]})
    async with aioredis.Redis.from_url(redis_url) as client:
        # h-1's root record is gone: it becomes a missing_record skip.
        deleted = await client.delete(record_key("stg", "h-1/c0"))
        assert deleted == 1
    async with RolloutReader.from_url(redis_url, group_failure_policy=policy) as reader:
        groups = GroupReader(reader)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(10):
            while reader.statistics().pulled < 3:
                delivered += await groups.pull_groups(4, block_ms=50)
        if policy == "deliver_rest":
            (group,) = delivered
            assert group.complete and group.rollout_ids == ("h-0", "h-2")
            assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("h-1", SkipCode.MISSING_RECORD)]
            await groups.ack_groups(delivered)
        else:
            assert delivered == [] and groups.statistics().dropped == 1
        assert await reader.pending() == 0 and reader.statistics().held == 0


@pytest.mark.anyio
async def test_rollouts_without_a_group_come_as_groups_of_one(redis_url: str) -> None:
    await publish(redis_url, ["alone"])
    async with RolloutReader.from_url(redis_url) as reader:
        groups = GroupReader(reader)
        with anyio.fail_after(10):
            delivered: list[RolloutGroup] = []
            while not delivered:
                delivered = await groups.pull_groups(4, block_ms=50)
        (group,) = delivered
        assert group.group_id is None and group.group_size == 1 and group.rollout_ids == ("alone",)
        assert group.reward_mean == 1.0 and group.reward_std == 0.0
        await groups.ack_groups(delivered)
        assert await reader.pending() == 0


def test_the_sync_reader_delivers_groups(redis_url: str) -> None:
    anyio.run(publish_groups, redis_url, {"sync-g": ["sg-0", "sg-1"]})
    with SyncRolloutReader.from_url(redis_url) as reader:
        delivered: list[RolloutGroup] = []
        for _ in range(100):
            delivered += reader.pull_groups(4, block_ms=50)
            if delivered:
                break
        (group,) = delivered
        assert group.rollout_ids == ("sg-0", "sg-1") and group.complete
        reader.ack_groups([group])
        assert reader.pending() == 0


@pytest.mark.anyio
async def test_a_pull_reads_no_more_group_entries_than_it_returns(redis_url: str) -> None:
    """Found by ``staging-sink bench groups``: a pull of n rollouts read up to n group entries (n whole groups),
    returned the first ones and kept the rest in hand, where no other rank could take them."""
    await publish_groups(redis_url, {f"few-{g}": [f"f{g}-0", f"f{g}-1"] for g in range(3)}, receipt_shards=1)
    options: dict[str, Any] = {"receipt_shards": 1}
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **options) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **options) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        (mine,) = await first.pull_groups(2)
        theirs = await second.pull_groups(2)
        theirs += await second.pull_groups(2)  # both other groups: none waits in the first rank's hand
        assert sorted(g.group_id or "" for g in [mine, *theirs]) == ["few-0", "few-1", "few-2"]
        await first.ack_groups([mine])
        await second.ack_groups(theirs)
        assert await rank0.pending() == 0
