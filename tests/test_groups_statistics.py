"""What a GroupReader reports on real servers: each group's reward statistics, its failed members' codes and
reasons, and the counters of :class:`~sink.trainer.groups.GroupStatistics`; every rollout of a pull delivered.

The policy (sink.trainer.groups, docs/training.md#grpo-groups): ``reward_mean``/``reward_std``/``reward_min``/
``reward_max`` are over the members that have a reward, ``NaN`` when none has; a failed member is listed in
``RolloutGroup.failed`` with the skip code and reason the reader gave it; ``late`` and ``size_mismatches`` count
every late member and every group whose members disagreed on ``group_size`` (with a ``group_size_mismatch``
warning naming the group).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.keys import group_keys, open_groups_key, record_key, shard_of
from sink.settings import DEFAULT_SHARDS
from sink.trainer.groups import GROUP_SIZE_MISMATCH, GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.group_members import publish_members

pytestmark = pytest.mark.anyio

NS = "stg"
ONE_SHARD: dict[str, Any] = {"receipt_shards": 1}


async def _pull_all(groups: GroupReader, rollouts: int, *, timeout_s: float = 20.0) -> list[RolloutGroup]:
    """pull_groups until *rollouts* rollouts were pulled (whole group entries)."""
    delivered: list[RolloutGroup] = []
    reader = groups.reader
    with anyio.fail_after(timeout_s):
        while reader.statistics().pulled < rollouts:
            delivered += await groups.pull_groups(4, block_ms=50)
    return delivered


async def test_reward_statistics_are_over_the_members_with_a_reward_nan_when_none_has(redis_url: str) -> None:
    members = {"r-0": ("rewarded", 3), "r-1": ("rewarded", 3), "r-2": ("rewarded", 3)}
    members |= {"n-0": ("unrewarded", 2), "n-1": ("unrewarded", 2)}
    rewards = {"r-0": None, "r-1": 2.0, "r-2": 4.0, "n-0": None, "n-1": None}
    await publish_members(redis_url, members, rewards=rewards)
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        by_id = {g.group_id: g for g in await _pull_all(groups, 5)}
        rewarded, unrewarded = by_id["rewarded"], by_id["unrewarded"]
        assert rewarded.rollout_ids == ("r-0", "r-1", "r-2")  # a member without a reward is still trained
        assert (rewarded.reward_mean, rewarded.reward_std) == (3.0, 1.0)
        assert (rewarded.reward_min, rewarded.reward_max) == (2.0, 4.0)
        assert unrewarded.rollout_ids == ("n-0", "n-1") and unrewarded.complete
        stats = (unrewarded.reward_mean, unrewarded.reward_std, unrewarded.reward_min, unrewarded.reward_max)
        assert all(math.isnan(value) for value in stats)
        await groups.ack_groups(by_id.values())
        assert await reader.pending() == 0


async def test_a_skipped_rollout_without_a_group_is_a_group_of_one_with_no_member(redis_url: str) -> None:
    await publish_members(redis_url, {"lost-solo": None})
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await client.delete(record_key(NS, "lost-solo/c0")) == 1  # its root record is gone
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        (group,) = await _pull_all(groups, 1)
        assert group.group_id is None and group.group_size == 1 and group.members == () and group.complete
        assert [(f.rollout_id, f.skip_code) for f in group.failed] == [("lost-solo", SkipCode.MISSING_RECORD)]
        assert math.isnan(group.reward_mean) and math.isnan(group.reward_std)
        assert math.isnan(group.reward_min) and math.isnan(group.reward_max)
        assert await reader.pending() == 0  # acknowledged by the reader: nothing to train on
        assert groups.statistics().delivered == 1


async def test_every_rollout_without_a_group_in_one_pull_comes_back(redis_url: str) -> None:
    solos = ["one-0", "one-1", "one-2"]
    await publish_members(redis_url, dict.fromkeys(solos))
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(20):
            while reader.statistics().pulled < len(solos):
                before = reader.statistics().pulled
                pulled_now = await groups.pull_groups(8, block_ms=50)
                assert len(pulled_now) == reader.statistics().pulled - before  # one group per rollout pulled
                delivered += pulled_now
        assert sorted(i for g in delivered for i in g.rollout_ids) == solos
        assert groups.statistics().delivered == 3
        await groups.ack_groups(delivered)
        assert await reader.pending() == 0


async def test_pull_groups_waits_up_to_block_ms_for_a_receipt(redis_url: str) -> None:
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        delivered: list[RolloutGroup] = []

        async def pull() -> None:
            delivered.extend(await groups.pull_groups(4, block_ms=8_000))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(pull)  # nothing published yet: the pull blocks until the receipt comes
                await publish_members(redis_url, {"awaited": None})
        assert [g.rollout_ids for g in delivered] == [("awaited",)]
        await groups.ack_groups(delivered)


async def test_every_late_member_is_counted(redis_url: str) -> None:
    size = {f"late-{i}": ("late", 2) for i in range(4)}
    await publish_members(redis_url, {i: size[i] for i in ("late-0", "late-1")})
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        (group,) = await _pull_all(groups, 2)
        await groups.ack_groups([group])
        await publish_members(redis_url, {i: size[i] for i in ("late-2", "late-3")})
        assert await _pull_all(groups, 4) == []
        assert groups.statistics().late == 2
        assert await reader.pending() == 0


async def test_every_group_whose_members_disagree_on_the_size_is_counted_and_named(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Each group: one member announces 2, two announce 3 -> complete with 3 members, a mismatch each.
    members = {f"{g}-{i}": (g, 2 if i == 0 else 3) for g in ("sizes-a", "sizes-b") for i in range(3)}
    await publish_members(redis_url, members)
    caplog.set_level(logging.WARNING, logger="sink.trainer.groups")
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        delivered = await _pull_all(groups, 6)
        assert sorted((g.group_id, g.group_size, g.complete, len(g.members)) for g in delivered) == [
            ("sizes-a", 3, True, 3),
            ("sizes-b", 3, True, 3),
        ]
        assert groups.statistics().size_mismatches == 2
        await groups.ack_groups(delivered)
    warnings = [r.getMessage() for r in caplog.records if GROUP_SIZE_MISMATCH in r.getMessage()]
    assert len(warnings) == 2
    assert any("'sizes-a'" in w for w in warnings) and any("'sizes-b'" in w for w in warnings)


async def test_an_open_group_record_never_expires_and_is_indexed_until_published(redis_url: str) -> None:
    # The members' receipts live only in the record until the group's entry is consumed: an expiry would lose them.
    await publish_members(redis_url, {"open-0": ("open", 2)})
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        assert await GroupReader(reader).pull_groups(4, block_ms=50) == []  # nothing published yet
    async with aioredis.Redis.from_url(redis_url) as client:
        for key in group_keys(NS, "open"):
            assert await client.pttl(key) == -1, key
        assert await client.zscore(open_groups_key(NS, shard_of("open", DEFAULT_SHARDS)), "open") is not None


async def test_a_failed_members_reason_travels_whole_to_the_delivering_rank(redis_url: str) -> None:
    reason = '  Traceback (most recent call last):\n    File "agent.py", line 3\n  EngineError: 503'  # as the worker wrote it
    members = {"f-0": ("hurt", 3), "f-1": ("hurt", 3), "f-2": ("hurt", 3)}
    await publish_members(redis_url, members, failures={"f-1": reason})
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        groups = GroupReader(reader)
        (group,) = await _pull_all(groups, 3)
        assert group.rollout_ids == ("f-0", "f-2") and group.complete
        ((rollout_id, code, why),) = group.failed
        assert (rollout_id, code) == ("f-1", SkipCode.ROLLOUT_FAILED)
        assert why == reason  # every line of the worker's reason, its indentation too
        await groups.ack_groups([group])
        assert await reader.pending() == 0
