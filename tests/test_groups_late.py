"""GRPO group members that come late or disagree on the size, across two ranks on real servers.

The policy (sink.trainer.groups): a member that reaches the assembler after its group's member set was frozen
(complete, sealed at its timeout, consumed) is published alone, marked late, never delivered on its own and never
left pending: the rank acknowledges it and records it on ``ns:dead:groups`` with reason code ``late_member``.
Members that disagree on ``group_size`` make the group wait for the largest size announced; it is
``complete=True`` only with that many members, else sealed partial at the assemblers' ``group_timeout_s``
(``complete=False``), with a warning and reason code ``group_size_mismatch``.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.keys import dead_letter_stream
from sink.trainer.groups import LATE_MEMBER, GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.trainer import publish

pytestmark = pytest.mark.anyio

NS = "stg"


async def _dead_groups(url: str) -> list[dict[str, str]]:
    async with aioredis.Redis.from_url(url, decode_responses=True) as client:
        entries = await client.xrange(dead_letter_stream(NS, "groups")) or []
        return [{str(k): str(v) for k, v in (fields or {}).items()} for _id, fields in entries]


async def _pull_until(reader: GroupReader, *, timeout_s: float = 20.0) -> list[RolloutGroup]:
    with anyio.fail_after(timeout_s):
        while True:
            groups = await reader.pull_groups(4, block_ms=50)
            if groups:
                return groups


async def _drain(reader: GroupReader, pulls: int = 3) -> list[RolloutGroup]:
    delivered: list[RolloutGroup] = []
    for _ in range(pulls):
        delivered += await reader.pull_groups(4, block_ms=50)
    return delivered


async def test_a_late_member_on_the_same_rank_is_acknowledged_and_recorded_never_stranded(redis_url: str) -> None:
    size = {"l-0": ("late", 2), "l-1": ("late", 2), "l-2": ("late", 2)}
    await publish(redis_url, ["l-0", "l-1"], groups=size, receipt_shards=1)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", receipt_shards=1) as rank0:
        first = GroupReader(rank0)
        (group,) = await _pull_until(first)
        assert group.complete and group.rollout_ids == ("l-0", "l-1")
        # Same rank, before the ack: l-2 arrives after its group went out.
        await publish(redis_url, ["l-2"], groups=size, receipt_shards=1)
        assert await _drain(first) == []
        assert not rank0.holds("l-2")  # acknowledged, not held forever
        await first.ack_groups([group])
        assert await rank0.pending() == 0 and first.statistics().late == 1
    assert [(d["group_id"], d["members"], d["dead_code"]) for d in await _dead_groups(redis_url)] == [
        ("late", "l-2", LATE_MEMBER)
    ]


async def test_a_member_after_its_group_was_acknowledged_is_never_a_second_group(redis_url: str) -> None:
    size = {"a-0": ("acked", 2), "a-1": ("acked", 2), "a-2": ("acked", 2)}
    await publish(redis_url, ["a-0", "a-1"], groups=size, receipt_shards=1)
    settings: dict[str, Any] = {"receipt_shards": 1}
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **settings) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **settings) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        (group,) = await _pull_until(first)
        await first.ack_groups([group])
        # The other rank, after the ack: a-2 must not come back as a one-member group "acked" at the timeout.
        await publish(redis_url, ["a-2"], groups=size, receipt_shards=1, group_timeout_s=0.3)
        with anyio.fail_after(10):
            while True:
                again = await second.pull_groups(4, block_ms=200)
                assert again == [], f"a late member came back as a second group: {again}"
                if await rank1.pending() == 0 and not rank1.holds("a-2") and second.statistics().late == 1:
                    break
        assert second.statistics().late == 1
    assert [(d["group_id"], d["members"], d["dead_code"]) for d in await _dead_groups(redis_url)] == [
        ("acked", "a-2", LATE_MEMBER)
    ]


async def test_members_disagreeing_on_the_size_never_make_a_complete_group_with_members_missing(
    redis_url: str,
) -> None:
    announced = {"s-0": ("sized", 2), "s-1": ("sized", 3)}
    settings: dict[str, Any] = {"receipt_shards": 1}
    await publish(redis_url, ["s-0"], groups=announced, receipt_shards=1)
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **settings) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **settings) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await first.pull_groups(1, block_ms=200) == []  # s-0 (size 2) waits: nothing published
        # s-1 says 3: two members are not a whole group; sealed at the assemblers' timeout.
        await publish(redis_url, ["s-1"], groups=announced, receipt_shards=1, group_timeout_s=0.3)
        delivered: list[tuple[GroupReader, RolloutGroup]] = []
        with anyio.fail_after(20):
            while not delivered:
                for reader in (first, second):
                    delivered += [(reader, g) for g in await reader.pull_groups(1, block_ms=50)]
        ((owner, group),) = delivered
        assert not group.complete and group.group_size == 3 and group.rollout_ids == ("s-0", "s-1")
        await owner.ack_groups([group])
        assert first.statistics().size_mismatches + second.statistics().size_mismatches == 1
        assert await rank0.pending() == 0


async def test_rollouts_without_a_group_are_counted_as_delivered_groups(redis_url: str) -> None:
    """Kills the mutant ``delivered += 1`` -> ``= 1`` of groups of one (found by mutmut)."""
    await publish(redis_url, ["solo-0", "solo-1", "solo-2"], receipt_shards=1)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", receipt_shards=1) as rank0:
        groups = GroupReader(rank0)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(20):
            while len(delivered) < 3:
                delivered += await groups.pull_groups(1, block_ms=50)
        assert [g.group_id for g in delivered] == [None, None, None]
        assert groups.statistics().delivered == 3
        await groups.ack_groups(delivered)
