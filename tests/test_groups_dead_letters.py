"""What a GroupReader records on ``ns:dead:groups`` (real servers): every field of the operator-facing record.

A group sealed incomplete at the assemblers' ``group_timeout_s``, received under
``group_timeout_policy="dead_letter"``, and a member that arrives after its group went out are each recorded with one durable entry: ``group_id``, ``group_size`` (the
size announced), ``members`` (the trainable rollout ids, comma-separated), ``failed`` (``<rollout id>:<skip
code>`` of the members that could not be trained, comma-separated), ``dead_code`` (``group_timeout`` /
``late_member``), ``dead_reason`` and ``dead_consumer`` (the rank that recorded it). The write is confirmed durable
like every acknowledgement, or refused with :class:`~sink.errors.NotDurableError` and nothing acknowledged.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.errors import NotDurableError
from sink.keys import dead_letter_stream, group_keys
from sink.trainer.groups import LATE_MEMBER, GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.group_members import lose_root_records, pull_until_settled
from tests.helpers.trainer import publish, publish_groups

pytestmark = pytest.mark.anyio

NS = "stg"
DEAD_LETTER: dict[str, Any] = {"group_timeout_policy": "dead_letter", "receipt_shards": 1}
TIMEOUT_S = 0.3  # the assemblers' group_timeout_s


async def _dead_groups(url: str) -> list[dict[str, str]]:
    async with aioredis.Redis.from_url(url, decode_responses=True) as client:
        entries = await client.xrange(dead_letter_stream(NS, "groups")) or []
        return [{str(k): str(v) for k, v in (fields or {}).items()} for _id, fields in entries]


async def test_a_timed_out_group_is_recorded_with_every_field_and_its_members_acknowledged(redis_url: str) -> None:
    # "hurt" announces 5 members; 4 arrive, 2 of them untrainable. "short" announces 2; 1 arrives.
    hurt_members = ["d-0", "d-1", "d-2", "d-3"]
    await publish_groups(redis_url, {"hurt": hurt_members}, size=5, receipt_shards=1, group_timeout_s=TIMEOUT_S)
    await publish_groups(redis_url, {"short": ["e-0"]}, size=2, receipt_shards=1, group_timeout_s=TIMEOUT_S)
    await lose_root_records(redis_url, ["d-1", "d-3"])
    async with RolloutReader.from_url(redis_url, consumer_name="rank-dl", **DEAD_LETTER) as reader:
        groups = GroupReader(reader)
        assert await pull_until_settled(groups, 5) == []
        assert groups.statistics().dead_lettered == 2  # one per group, counted up
        assert groups.statistics().delivered == 0 and groups.statistics().dropped == 0
        assert await reader.pending() == 0 and reader.statistics().held == 0  # every member acknowledged
    by_group = {entry["group_id"]: entry for entry in await _dead_groups(redis_url)}
    assert set(by_group) == {"hurt", "short"}
    hurt = by_group["hurt"]
    failed = hurt.pop("failed")
    assert sorted(failed.split(",")) == [f"d-1:{SkipCode.MISSING_RECORD}", f"d-3:{SkipCode.MISSING_RECORD}"]
    assert hurt == {
        "group_id": "hurt",
        "group_size": "5",
        "members": "d-0,d-2",
        "dead_code": "group_timeout",
        "dead_reason": "sealed at group_timeout_s with 4 of 5 members",
        "dead_consumer": "rank-dl",
    }
    assert by_group["short"] == {
        "group_id": "short",
        "group_size": "2",
        "members": "e-0",
        "failed": "",
        "dead_code": "group_timeout",
        "dead_reason": "sealed at group_timeout_s with 1 of 2 members",
        "dead_consumer": "rank-dl",
    }
    async with aioredis.Redis.from_url(redis_url) as client:
        for group_id in by_group:  # closed: a member arriving now is late, never a new group
            assert await client.hget(group_keys(NS, group_id)[0], "closed") == b"1"


async def test_a_late_member_is_recorded_with_every_field(redis_url: str) -> None:
    size = {"l-0": ("late", 2), "l-1": ("late", 2), "l-2": ("late", 2)}
    await publish(redis_url, ["l-0", "l-1"], groups=size, receipt_shards=1)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-late", receipt_shards=1) as reader:
        groups = GroupReader(reader)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(20):
            while not delivered:
                delivered = await groups.pull_groups(4, block_ms=50)
        await groups.ack_groups(delivered)
        await publish(redis_url, ["l-2"], groups=size, receipt_shards=1)
        with anyio.fail_after(20):
            while groups.statistics().late < 1:
                assert await groups.pull_groups(4, block_ms=50) == []
        assert await reader.pending() == 0
    assert await _dead_groups(redis_url) == [
        {
            "group_id": "late",
            "group_size": "2",
            "members": "l-2",
            "failed": "",
            "dead_code": LATE_MEMBER,
            "dead_reason": "arrived after its group went out",
            "dead_consumer": "rank-late",
        }
    ]


async def _break_durability(url: str) -> None:
    """The session server stops confirming writes durable (the ``redis_url`` fixture restores it)."""
    async with aioredis.Redis.from_url(url) as client:
        await client.config_set("appendfsync", "everysec")


async def _pull_until_refused(groups: GroupReader, *, timeout_s: float = 20.0) -> NotDurableError:
    with anyio.fail_after(timeout_s):
        while True:
            try:
                assert await groups.pull_groups(4, block_ms=50) == []
            except NotDurableError as exc:
                return exc


async def _restore_durability(url: str) -> None:
    async with aioredis.Redis.from_url(url) as client:
        await client.config_set("appendfsync", "always")


async def test_a_refused_dead_letter_acknowledges_nothing_and_the_next_pull_finishes_it(redis_url: str) -> None:
    await publish_groups(redis_url, {"nd": ["n-0"]}, size=2, receipt_shards=1, group_timeout_s=TIMEOUT_S)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-nd", **DEAD_LETTER) as reader:
        groups = GroupReader(reader)
        await _break_durability(redis_url)
        refused = await _pull_until_refused(groups)  # the sealed group's dead letter: its write is refused
        assert "dead-letter group 'nd' durably" in str(refused) and "not durable" in str(refused)
        assert await reader.pending() == 1 and groups.statistics().dead_lettered == 0  # nothing acknowledged
        # Retrying is safe: once the server is durable again, the next pull records the group and acknowledges
        # its member (never held by this rank forever).
        await _restore_durability(redis_url)
        assert await groups.pull_groups(4) == []
        assert groups.statistics().dead_lettered == 1
        assert await reader.pending() == 0 and reader.held_rollouts == ()
    entries = await _dead_groups(redis_url)  # the refused write may have reached memory: then it is there twice
    assert 1 <= len(entries) <= 2 and all(e["group_id"] == "nd" and e["members"] == "n-0" for e in entries)


async def test_a_refused_close_of_a_group_with_nothing_to_train_is_finished_by_the_next_pull(redis_url: str) -> None:
    await publish_groups(redis_url, {"gone": ["g-0"]}, size=2, receipt_shards=1, group_timeout_s=TIMEOUT_S)
    await lose_root_records(redis_url, ["g-0"])
    options = {**DEAD_LETTER, "group_timeout_policy": "partial"}
    async with RolloutReader.from_url(redis_url, consumer_name="rank-gone", **options) as reader:
        groups = GroupReader(reader)
        await _break_durability(redis_url)
        refused = await _pull_until_refused(groups)  # sealed with nothing to train: its acknowledgement is refused
        assert "durably" in str(refused) and "not durable" in str(refused)
        assert groups.statistics().dropped == 0 and await reader.pending() == 1
        await _restore_durability(redis_url)
        assert await groups.pull_groups(4) == []  # the next pull acknowledges the member and closes the group
        assert groups.statistics().dropped == 1 and await reader.pending() == 0
    async with aioredis.Redis.from_url(redis_url) as client:
        meta = group_keys(NS, "gone")[0]
        assert await client.hget(meta, "closed") == b"1" and await client.pttl(meta) > 0
