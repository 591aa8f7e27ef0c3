"""Who delivers a GRPO group, and with what, across ranks on real servers (sink.trainer.groups).

The policy (module docstring, docs/training.md#grpo-groups): the rank whose member completes a group owns it and takes
the other ranks' members over; a member that cannot be taken over is listed in ``failed`` (its skip code, or
``member_unavailable`` when its receipt entry is gone) and nothing is stranded; the other ranks let their members
go, unacknowledged, on their next pull, whatever else they wait on; a group found complete with a dead owner, or
incomplete at ``group_timeout_s``, is delivered by a rank that waits on it. Time passing is simulated by moving
a group record's clock fields (``first_at``, ``owner_at``) back, so no test waits for a timeout.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.keys import group_keys, receipts_stream, record_key
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.group_members import publish_members
from tests.helpers.processes import until

pytestmark = pytest.mark.anyio

NS = "stg"
ONE_SHARD: dict[str, Any] = {"receipt_shards": 1}


def _group(group_id: str, size: int, *ids: str) -> dict[str, tuple[str, int] | None]:
    return dict.fromkeys(ids, (group_id, size))


async def _pull_one(groups: GroupReader, *, timeout_s: float = 20.0) -> list[RolloutGroup]:
    """pull_groups until this rank pulled one more rollout; what it delivered meanwhile."""
    delivered: list[RolloutGroup] = []
    reader = groups.reader
    target = reader.statistics().pulled + 1
    with anyio.fail_after(timeout_s):
        while reader.statistics().pulled < target:
            delivered += await groups.pull_groups(1, block_ms=50)
    return delivered


async def _delete_records(url: str, rollout_id: str) -> None:
    async with aioredis.Redis.from_url(url) as client:
        assert await client.delete(record_key(NS, f"{rollout_id}/c0")) == 1


async def _age(url: str, group_id: str, field: str, by_ms: int) -> None:
    """Move the group record's clock field *field* back by *by_ms* (as if that much time had passed)."""
    async with aioredis.Redis.from_url(url) as client:
        await client.hincrby(group_keys(NS, group_id)[0], field, -by_ms)


async def test_the_completing_rank_waits_on_the_group_no_more(redis_url: str) -> None:
    await publish_members(redis_url, _group("mine", 2, "mine-0"))
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        assert await _pull_one(groups) == [] and groups.statistics().waiting == 1
        await publish_members(redis_url, _group("mine", 2, "mine-1"))
        (group,) = await _pull_one(groups)
        assert group.rollout_ids == ("mine-0", "mine-1")
        assert groups.statistics().waiting == 0  # delivered: nothing left to wait on
        await groups.ack_groups([group])


async def test_members_taken_over_from_another_rank_come_with_no_failure(redis_url: str) -> None:
    await publish_members(redis_url, _group("whole", 3, "w-0", "w-1"))
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **ONE_SHARD) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await _pull_one(first) == [] and await _pull_one(first) == []
        await publish_members(redis_url, _group("whole", 3, "w-2"))
        (group,) = await _pull_one(second)
        assert group.rollout_ids == ("w-0", "w-1", "w-2") and group.failed == () and group.complete
        await second.ack_groups([group])
        assert await first.pull_groups(1) == [] and rank0.held_rollouts == ()
        assert await rank0.pending() == 0


async def test_a_member_whose_records_vanished_before_the_take_over_is_failed_and_finished(redis_url: str) -> None:
    await publish_members(redis_url, _group("vanished", 2, "v-0"))
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **ONE_SHARD) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await _pull_one(first) == []  # v-0 was whole when rank-0 pulled it
        await _delete_records(redis_url, "v-0")
        await publish_members(redis_url, _group("vanished", 2, "v-1"))
        (group,) = await _pull_one(second)
        assert group.rollout_ids == ("v-1",) and group.complete
        assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("v-0", SkipCode.MISSING_RECORD)]
        await second.ack_groups([group])
        assert await first.pull_groups(1) == [] and rank0.held_rollouts == ()
        assert await rank0.pending() == 0  # v-0 acknowledged by the rank that took it over


async def test_a_member_whose_receipt_entry_is_gone_is_listed_unavailable(redis_url: str) -> None:
    await publish_members(redis_url, _group("gone", 3, "g-0", "g-1"))
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **ONE_SHARD) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await _pull_one(first) == [] and await _pull_one(first) == []
        await rank0.ack(["g-0"])  # acknowledged outside the group: its receipt entry is gone
        await publish_members(redis_url, _group("gone", 3, "g-2"))
        (group,) = await _pull_one(second)
        assert group.rollout_ids == ("g-1", "g-2") and group.complete
        ((rollout_id, code, reason),) = group.failed
        assert (rollout_id, code) == ("g-0", SkipCode.MEMBER_UNAVAILABLE)
        assert isinstance(reason, str) and reason  # says why
        await second.ack_groups([group])
        assert await rank0.pending() == 0


async def test_a_rank_completing_a_group_with_a_failed_member_and_nothing_else_of_it(redis_url: str) -> None:
    await publish_members(redis_url, _group("last-failed", 2, "lf-0"))
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **ONE_SHARD) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await _pull_one(first) == []
        await publish_members(redis_url, _group("last-failed", 2, "lf-1"))
        await _delete_records(redis_url, "lf-1")
        (group,) = await _pull_one(second)  # lf-1 completes the group, and cannot be trained
        assert group.rollout_ids == ("lf-0",) and group.complete
        assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("lf-1", SkipCode.MISSING_RECORD)]
        await second.ack_groups([group])
        assert await first.pull_groups(1) == [] and await rank0.pending() == 0


async def test_a_rank_whose_only_member_failed_lets_the_group_go(redis_url: str) -> None:
    await publish_members(redis_url, _group("first-failed", 2, "ff-0"))
    await _delete_records(redis_url, "ff-0")
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **ONE_SHARD) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await _pull_one(first) == [] and first.statistics().waiting == 1  # watched, nothing parked
        await publish_members(redis_url, _group("first-failed", 2, "ff-1"))
        (group,) = await _pull_one(second)
        assert group.rollout_ids == ("ff-1",)
        assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("ff-0", SkipCode.MISSING_RECORD)]
        assert await first.pull_groups(1) == [] and first.statistics().waiting == 0
        await second.ack_groups([group])
        assert await rank0.pending() == 0


async def test_a_rank_lets_go_of_every_group_taken_even_behind_one_still_waiting(redis_url: str) -> None:
    settings: dict[str, Any] = {**ONE_SHARD, "group_timeout_s": 3600.0}
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **settings) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **settings) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        for group_id in ("waits", "taken-a", "taken-b"):  # watched by rank-0 in this order
            await publish_members(redis_url, _group(group_id, 2, f"{group_id}-0"))
            assert await _pull_one(first) == []
        assert first.statistics().waiting == 3
        await publish_members(redis_url, _group("taken-a", 2, "taken-a-1") | _group("taken-b", 2, "taken-b-1"))
        delivered = await _pull_one(second) + await _pull_one(second)
        assert sorted(g.group_id or "" for g in delivered) == ["taken-a", "taken-b"]
        assert await first.pull_groups(1) == []
        stats = first.statistics()
        assert (stats.handed_over, stats.waiting) == (2, 1)
        assert rank0.held_rollouts == ("waits-0",) and rank0.statistics().acked == 0
        await second.ack_groups(delivered)


async def test_every_group_past_its_timeout_is_sealed_in_one_pull(redis_url: str) -> None:
    timeout_s = 10_000.0
    settings: dict[str, Any] = {**ONE_SHARD, "group_timeout_s": timeout_s}
    await publish_members(redis_url, _group("late-a", 2, "la-0") | _group("late-b", 2, "lb-0"))
    async with RolloutReader.from_url(redis_url, **settings) as reader:
        groups = GroupReader(reader)
        assert await _pull_one(groups) == [] and await _pull_one(groups) == []
        for group_id in ("late-a", "late-b"):
            await _age(redis_url, group_id, "first_at", int(timeout_s * 1000) + 1_000)  # the timeout passed
        delivered = await groups.pull_groups(1)
        assert sorted((g.group_id, g.rollout_ids, g.complete) for g in delivered) == [
            ("late-a", ("la-0",), False),
            ("late-b", ("lb-0",), False),
        ]
        assert groups.statistics().partial == 2 and groups.statistics().waiting == 0
        await groups.ack_groups(delivered)
        assert await reader.pending() == 0


async def test_a_group_whose_owner_died_is_delivered_complete_by_a_rank_waiting_on_it(redis_url: str) -> None:
    await publish_members(redis_url, _group("orphan", 3, "o-0"))
    options: dict[str, Any] = {**ONE_SHARD, "claim_idle_ms": 300}
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **options) as rank0:
        survivor = GroupReader(rank0)
        assert await _pull_one(survivor) == []
        await publish_members(redis_url, _group("orphan", 3, "o-1", "o-2"))
        async with RolloutReader.from_url(redis_url, consumer_name="rank-1", **options) as rank1:
            crashed = GroupReader(rank1)
            delivered: list[RolloutGroup] = []
            with anyio.fail_after(20):
                while not delivered:
                    delivered = await crashed.pull_groups(2, block_ms=50)
            # rank-1 delivered the group and "crashes": closes without acknowledging.
        # Its lease runs out (its receipt entries idle past claim_idle_ms): the waiting rank reclaims a member and
        # takes the whole group over (a check alone never takes a group from its owner: it may be alive).
        await _idle_at_least(redis_url, receipts_stream(NS, 0), 300)
        with anyio.fail_after(20):
            while not (redelivered := await survivor.pull_groups(4, block_ms=50)):
                pass
        (again,) = redelivered
        assert again.rollout_ids == ("o-0", "o-1", "o-2") and again.complete is True
        assert survivor.statistics().partial == 0
        await survivor.ack_groups([again])
        assert await rank0.pending() == 0


async def _idle_at_least(url: str, rollout_stream: str, ms: int) -> None:
    """Wait until every pending receipt entry has been idle at least *ms* (its rank stopped refreshing it)."""
    async with aioredis.Redis.from_url(url) as client:
        pending: list[dict[str, Any]] = []

        async def idle() -> bool:
            pending[:] = await client.xpending_range(rollout_stream, "trainers", min="-", max="+", count=100)
            return bool(pending) and all(int(p["time_since_delivered"]) >= ms for p in pending)

        await until(idle, lambda: f"the pending entries were not all idle {ms} ms within 20 s: {pending}", timeout_s=20)


async def test_a_parked_member_lost_to_another_rank_is_taken_back_by_the_completing_rank(redis_url: str) -> None:
    settings: dict[str, Any] = {**ONE_SHARD, "claim_idle_ms": 300}
    await publish_members(redis_url, _group("lapsed", 2, "lp-0"))
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **settings) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **settings) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await _pull_one(first) == []
        await _idle_at_least(redis_url, receipts_stream(NS, 0), 300)  # rank-0 stalls past its lease
        with anyio.fail_after(20):
            while not rank1.holds("lp-0"):  # rank-1 reclaims the idle entry; the group still waits
                assert await second.pull_groups(1, block_ms=50) == []
        await publish_members(redis_url, _group("lapsed", 2, "lp-1"))
        (group,) = await _pull_one(first)  # rank-0 completes the group: lp-0 must be its own again
        assert group.rollout_ids == ("lp-0", "lp-1") and group.failed == ()
        outcome_before = rank0.statistics().acked
        await first.ack_groups([group])
        assert rank0.statistics().acked == outcome_before + 2
        assert await second.pull_groups(1) == [] and rank1.held_rollouts == ()
        assert await rank0.pending() == 0


async def test_a_rank_lets_go_of_every_member_of_a_group_a_live_rank_owns(redis_url: str) -> None:
    # rank-9 owns the group (its record as the gather script writes it: owner, a fresh owner_at, the member it
    # recorded), and rank-0 reads that member again: rank-0 lets it go, and its parked one, unacknowledged.
    await publish_members(redis_url, _group("owned", 2, "ow-0"))
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as rank0:
        groups = GroupReader(rank0)
        assert await _pull_one(groups) == [] and rank0.holds("ow-0")
        async with aioredis.Redis.from_url(redis_url) as client:
            seconds, micros = await client.time()
            meta, members = group_keys(NS, "owned")
            await client.hset(meta, mapping={"owner": "rank-9", "owner_at": seconds * 1000 + micros // 1000})
            await client.hset(members, "ow-1", f"ok\n{receipts_stream(NS, 0)}#0-1\nrank-9")
        await publish_members(redis_url, _group("owned", 2, "ow-1"))
        assert await _pull_one(groups) == []
        stats = groups.statistics()
        assert (stats.handed_over, stats.waiting, stats.delivered, stats.late) == (2, 0, 0, 0)
        assert rank0.held_rollouts == () and rank0.statistics().acked == 0
        assert await rank0.pending() == 2  # left for the owner
