"""What a GroupReader delivers and counts (real servers): groups of one, groups with nothing to train, the policies'
counters, and how long a closed group's tombstone lasts.

Policy (sink.trainer.groups, docs/training.md#grpo-groups): a rollout without a group is a complete group of one; a
skipped one is acknowledged at once and listed in ``failed``. A group with no trainable member is never
delivered: counted as dropped and closed. ``drop_group`` drops a group with a failed member; a group sealed at
``group_timeout_s`` under ``partial`` is delivered ``complete=False``. :class:`GroupStatistics` counts each group
once. A closed group's record (``:meta`` and ``:members``) stays as a tombstone for the longest of the reader's
``retention_s``, 4 x the assemblers' ``group_timeout_s`` and 4 x ``claim_idle_ms`` (so a member arriving later is
always seen late).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.keys import group_keys
from sink.trainer.groups import GroupReader
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.group_members import lose_root_records, publish_members, pull_until_settled
from tests.helpers.trainer import publish, publish_groups

pytestmark = pytest.mark.anyio

NS = "stg"
ONE_SHARD: dict[str, Any] = {"receipt_shards": 1}


async def _closed(url: str, group_ids: list[str]) -> list[bool]:
    async with aioredis.Redis.from_url(url) as client:
        return [await client.hget(group_keys(NS, group_id)[0], "closed") == b"1" for group_id in group_ids]


async def test_a_rollout_without_a_group_is_a_complete_group_of_one_with_nothing_failed(redis_url: str) -> None:
    await publish(redis_url, ["alone"], **ONE_SHARD)
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        (group,) = await pull_until_settled(groups, 1)
        assert group.group_id is None and group.group_size == 1 and group.rollout_ids == ("alone",)
        assert group.failed == () and group.complete is True
        assert reader.holds("alone")  # acknowledged with the group, after the optimizer step
        await groups.ack_groups([group])
        assert await reader.pending() == 0


async def test_a_skipped_rollout_without_a_group_is_acknowledged_and_listed_failed(redis_url: str) -> None:
    await publish(redis_url, ["lost"], **ONE_SHARD)
    await lose_root_records(redis_url, ["lost"])
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        (group,) = await pull_until_settled(groups, 1)
        assert group.group_id is None and group.group_size == 1 and group.members == ()
        assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("lost", SkipCode.MISSING_RECORD)]
        assert group.complete is True and groups.statistics().delivered == 1
        assert await reader.pending() == 0 and not reader.holds("lost")  # acknowledged at once, nothing to train


async def test_groups_with_no_trainable_member_are_dropped_closed_and_counted(redis_url: str) -> None:
    await publish_groups(redis_url, {"void-a": ["va-0", "va-1"], "void-b": ["vb-0", "vb-1"]}, **ONE_SHARD)
    await lose_root_records(redis_url, ["va-0", "va-1", "vb-0", "vb-1"])
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        assert await pull_until_settled(groups, 4) == []
        assert groups.statistics().dropped == 2 and groups.statistics().delivered == 0
        assert await reader.pending() == 0 and reader.statistics().held == 0
    assert await _closed(redis_url, ["void-a", "void-b"]) == [True, True]


async def test_drop_group_counts_every_dropped_group(redis_url: str) -> None:
    await publish_groups(redis_url, {"hurt-a": ["ha-0", "ha-1"], "hurt-b": ["hb-0", "hb-1"]}, **ONE_SHARD)
    await lose_root_records(redis_url, ["ha-1", "hb-0"])
    async with RolloutReader.from_url(redis_url, group_failure_policy="drop_group", **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        assert await pull_until_settled(groups, 4) == []
        assert groups.statistics().dropped == 2 and groups.statistics().delivered == 0
        assert await reader.pending() == 0 and reader.statistics().held == 0  # trainable members acknowledged
    assert await _closed(redis_url, ["hurt-a", "hurt-b"]) == [True, True]


async def test_partial_groups_are_each_counted(redis_url: str) -> None:
    parts = {"part-a": ["pa-0", "pa-1"], "part-b": ["pb-0", "pb-1"]}
    await publish_groups(redis_url, parts, size=3, group_timeout_s=0.3, **ONE_SHARD)
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        delivered = await pull_until_settled(groups, 4)
        assert sorted((g.group_id, g.rollout_ids, g.complete) for g in delivered) == [
            ("part-a", ("pa-0", "pa-1"), False),
            ("part-b", ("pb-0", "pb-1"), False),
        ]
        assert groups.statistics().partial == 2 and groups.statistics().delivered == 2
        await groups.ack_groups(delivered)
        assert await reader.pending() == 0


TOMBSTONES: dict[str, tuple[dict[str, Any], float | None, int]] = {
    # reader settings, the assemblers' group_timeout_s -> the tombstone's lifetime, ms: the longest bound wins
    "retention": ({"retention_s": 100_000.0}, None, 100_000_000),
    "group-timeout": ({"retention_s": 1.0}, 100_000.0, 400_000_000),
    "claim-idle": ({"retention_s": 1.0, "claim_idle_ms": 100_000_000}, None, 400_000_000),
}


@pytest.mark.parametrize("bound", list(TOMBSTONES))
async def test_a_closed_groups_tombstone_lasts_its_longest_bound(redis_url: str, bound: str) -> None:
    settings, group_timeout_s, ttl_ms = TOMBSTONES[bound]
    # The assembler that records the group stamps its tombstone bound (4 x its group_timeout_s).
    await publish_members(redis_url, {"k-0": ("kept", 1)}, recorded_with_timeout_s=group_timeout_s)
    async with RolloutReader.from_url(redis_url, **settings, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        delivered = await pull_until_settled(groups, 1)
        await groups.ack_groups(delivered)
        async with aioredis.Redis.from_url(redis_url) as client:
            meta, members = group_keys(NS, "kept")
            remaining_ms = int(await client.pttl(meta))
            members_ms = int(await client.pttl(members))  # kept as long: a redelivered entry still reads it
            assert await client.hget(meta, "closed") == b"1"
    # A minute of slack for a slow machine between the close and the read; far below every bound's difference.
    assert ttl_ms - 60_000 < remaining_ms <= ttl_ms and ttl_ms - 60_000 < members_ms <= ttl_ms
