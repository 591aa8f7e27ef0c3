"""Double deliveries under GRPO groups: a member only parked by a rank (its group incomplete) and read again after
a restart or taken over by the completing rank was never given to a trainer, so it is no double delivery; a
group delivered before (its owner crashed without acknowledging) and delivered again is one, per member."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.trainer import publish

WARNING = "may have been trained before"
OPTIONS: dict[str, Any] = {"receipt_shards": 1}


async def _publish_members(url: str, group_id: str, members: list[str], size: int) -> None:
    await publish(url, members, groups=dict.fromkeys(members, (group_id, size)), calls=1, receipt_shards=1)


@pytest.mark.anyio
async def test_a_restarted_reader_with_an_incomplete_group_reports_no_double_delivery(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _publish_members(redis_url, "half", ["h-0", "h-1"], size=3)
    caplog.set_level(logging.INFO)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **OPTIONS) as first:
        assert await GroupReader(first).pull_groups(4) == []  # parked: the group waits for its third member
        assert set(first.held_rollouts) == {"h-0", "h-1"}
    # The trainer restarts under the same name: its own pending entries come back (delivered twice to the
    # reader, never to the training loop).
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **OPTIONS) as again:
        groups = GroupReader(again)
        assert await groups.pull_groups(4) == []
        assert set(again.held_rollouts) == {"h-0", "h-1"}
        await _publish_members(redis_url, "half", ["h-2"], size=3)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(10):
            while not delivered:
                delivered = await groups.pull_groups(4, block_ms=50)
        (group,) = delivered
        assert group.rollout_ids == ("h-0", "h-1", "h-2") and group.complete
        assert again.statistics().double_deliveries == 0
        await groups.ack_groups(delivered)
    assert WARNING not in caplog.text


@pytest.mark.anyio
async def test_taking_over_another_ranks_parked_members_is_no_double_delivery(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _publish_members(redis_url, "taken", ["t-0", "t-1", "t-2", "t-3"], size=4)
    caplog.set_level(logging.INFO)
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **OPTIONS) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **OPTIONS) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await first.pull_groups(2) == []
        (group,) = await second.pull_groups(2)  # completes the group and takes rank-0's two members over
        assert len(group.rollout_ids) == 4
        assert rank1.statistics().double_deliveries == 0
        await second.ack_groups([group])
    assert WARNING not in caplog.text


@pytest.mark.anyio
async def test_a_group_delivered_again_after_its_owner_crashed_counts_every_member(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    members = ["c-0", "c-1", "c-2"]
    await _publish_members(redis_url, "crashed", members, size=3)
    options = {**OPTIONS, "claim_idle_ms": 300}
    caplog.set_level(logging.INFO)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **options) as rank0:
        survivor = GroupReader(rank0)
        assert await survivor.pull_groups(1) == []
        async with RolloutReader.from_url(redis_url, consumer_name="rank-1", **options) as rank1:
            (group,) = await GroupReader(rank1).pull_groups(2)  # delivered to rank-1's trainer, never acked
            assert group.rollout_ids == tuple(members)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(10):
            while not delivered:
                delivered = await survivor.pull_groups(4, block_ms=50)
        assert delivered[0].rollout_ids == tuple(members)
        assert rank0.statistics().double_deliveries == len(members)
        await survivor.ack_groups(delivered)
    assert caplog.text.count(WARNING) == len(members)
