"""A ``pull_groups`` interrupted by a refused write loses nothing (real servers).

A refused write (:class:`~sink.errors.NotDurableError`: the server stopped confirming writes durable) or a lost
connection in one step of a pull raises out of ``pull_groups``. Every group settled earlier in that pull, and every
group entry pulled but not settled yet (the one cut short too) comes out of the next ``pull_groups``: none stays
held by the rank forever (pending, never delivered, never acknowledged).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.errors import NotDurableError
from sink.keys import record_key
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.group_members import publish_members

pytestmark = pytest.mark.anyio

NS = "stg"


async def _set_appendfsync(url: str, value: str) -> None:
    """``everysec``: the session server stops confirming writes durable (the ``redis_url`` fixture restores it)."""
    async with aioredis.Redis.from_url(url) as client:
        await client.config_set("appendfsync", value)


def _assert_nothing_in_hand(groups: GroupReader) -> None:
    """No work of an interrupted pull is left (white box)."""
    assert (groups._ready, groups._pending) == ([], [])


async def _pull_until(groups: GroupReader, pulled: int) -> list[RolloutGroup]:
    """pull_groups until the rank pulled *pulled* rollouts in all; what it delivered meanwhile."""
    delivered: list[RolloutGroup] = []
    with anyio.fail_after(20):
        while groups.reader.statistics().pulled < pulled:
            delivered += await groups.pull_groups(4, block_ms=50)
    return delivered


async def test_rollouts_around_a_refused_late_member_dead_letter_come_out_of_the_next_pull(redis_url: str) -> None:
    await publish_members(redis_url, {"late-g-0": ("late-g", 1)})
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", receipt_shards=1) as reader:
        groups = GroupReader(reader)
        (first,) = await _pull_until(groups, 1)
        await groups.ack_groups([first])  # the group is closed: a member after it is late
        # One pull takes all three: a rollout of no group, the late member, another rollout of no group.
        for member in ({"solo-0": None}, {"late-g-1": ("late-g", 1)}, {"solo-1": None}):  # in this order
            await publish_members(redis_url, member)
        await _set_appendfsync(redis_url, "everysec")
        with anyio.fail_after(20), pytest.raises(NotDurableError):  # the late member's dead letter is refused
            while True:
                assert await groups.pull_groups(4, block_ms=50) == []
        assert reader.statistics().pulled == 4
        await _set_appendfsync(redis_url, "always")
        delivered = await groups.pull_groups(4)
        assert [group.rollout_ids for group in delivered] == [("solo-0",), ("solo-1",)]
        assert groups.statistics().late == 1
        await groups.ack_groups(delivered)
        assert await reader.pending() == 0 and reader.held_rollouts == ()
        _assert_nothing_in_hand(groups)


async def test_a_group_whose_failed_members_acknowledgement_was_refused_is_delivered_by_the_next_pull(
    redis_url: str,
) -> None:
    await publish_members(redis_url, {"t-0": ("t", 2)})
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await client.delete(record_key(NS, "t-0/c0")) == 1  # it cannot be trained
    await publish_members(redis_url, {"solo-t": None})  # before the group's entry on the stream
    await publish_members(redis_url, {"t-1": ("t", 2)})  # completes the group: its entry is published
    async with RolloutReader.from_url(redis_url, consumer_name="rank-1", receipt_shards=1) as rank1:
        second = GroupReader(rank1)
        await _set_appendfsync(redis_url, "everysec")
        # The rank delivers solo-t, then must acknowledge t-0 (untrainable) of the group: refused.
        with anyio.fail_after(20), pytest.raises(NotDurableError):
            while True:
                assert await second.pull_groups(4, block_ms=50) == []
        await _set_appendfsync(redis_url, "always")
        solo, group = await second.pull_groups(4)
        assert solo.rollout_ids == ("solo-t",) and solo.group_id is None
        await second.ack_groups([solo])
        assert group.rollout_ids == ("t-1",) and group.complete
        assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("t-0", SkipCode.MISSING_RECORD)]
        await second.ack_groups([group])
        assert await second.pull_groups(4) == []
        assert await rank1.pending() == 0 and rank1.held_rollouts == ()
        _assert_nothing_in_hand(second)


async def test_what_an_interrupted_pull_delivered_outlives_a_refused_dead_letter_of_the_next(redis_url: str) -> None:
    await publish_members(redis_url, {"late-w-0": ("late-w", 1)})
    options: dict[str, Any] = {"receipt_shards": 1, "group_timeout_policy": "dead_letter"}
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **options) as reader:
        groups = GroupReader(reader)
        (closed,) = await _pull_until(groups, 1)
        await groups.ack_groups([closed])
        await publish_members(redis_url, {"solo-w": None})  # before the sealed group and the late member
        await publish_members(redis_url, {"w-0": ("w", 2)}, group_timeout_s=0.3)  # sealed with one member
        await publish_members(redis_url, {"late-w-1": ("late-w", 1)})
        await _set_appendfsync(redis_url, "everysec")
        with anyio.fail_after(20), pytest.raises(NotDurableError):  # solo-w delivered, w's dead letter refused
            while True:
                assert await groups.pull_groups(4, block_ms=50) == []
        with pytest.raises(NotDurableError):  # refused again: nothing delivered is lost meanwhile
            await groups.pull_groups(4)
        await _set_appendfsync(redis_url, "always")
        delivered = await groups.pull_groups(4)
        assert [group.rollout_ids for group in delivered] == [("solo-w",)]
        assert groups.statistics().dead_lettered == 1 and groups.statistics().late == 1
        await groups.ack_groups(delivered)
        assert await reader.pending() == 0 and reader.held_rollouts == ()
        _assert_nothing_in_hand(groups)
