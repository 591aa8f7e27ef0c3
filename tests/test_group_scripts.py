"""The GRPO group scripts (record, seal, due, close) on real servers: each reply and the group record it leaves,
driven through the script runner as assemblers and ranks would.

The contract (sink.store.scripts.consumer): the first member opens the group (``first_at``); the call that brings
it to its size freezes its member set (``COMPLETE`` with every member); a member after the set was frozen is
``LATE`` and not recorded; a redo of a frozen member returns the set again until the group is marked published,
then ``PUBLISHED``; sizes that disagree keep the largest and flag a mismatch; a seal freezes an open group past the
timeout (``SEALED``); the due script lists open groups past the timeout; a take gives a group to the first entry
that claims it (another entry of it is a duplicate, a closed or missing record retired) and reads its members; a
close makes both keys expire, for at least the ``tombstone_ms`` the assembler stamped.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from sink.keys import group_keys, open_groups_key
from sink.store.scripts import (
    GROUP_CLOSE_SCRIPT,
    GROUP_DUE_SCRIPT,
    GROUP_RECORD_SCRIPT,
    GROUP_SEAL_SCRIPT,
    GROUP_TAKE_SCRIPT,
    ClaimStatus,
    GroupStatus,
)
from tests.helpers.processes import until

pytestmark = pytest.mark.anyio

NS = "grpscripts"
TOMBSTONE_MS = 600_000


async def _record(client: aioredis.Redis, group_id: str, member: str, size: int) -> list[Any]:
    args = [member, f'{{"rollout_id":"{member}"}}', size, TOMBSTONE_MS]
    return list(await GROUP_RECORD_SCRIPT.run(client, group_keys(NS, group_id), args))


async def _seal(client: aioredis.Redis, group_id: str, timeout_ms: int) -> list[Any]:
    return list(await GROUP_SEAL_SCRIPT.run(client, group_keys(NS, group_id), [timeout_ms]))


def _frozen(reply: list[Any]) -> tuple[int, bytes, bytes, set[bytes]]:
    """(status, size, mismatch, members) of a frozen reply."""
    return int(reply[0]), reply[1], reply[2], set(reply[4:])


async def _server_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _after(client: aioredis.Redis, ms: int) -> None:
    """Wait until the server's clock (the scripts' clock) is past *ms*."""

    async def past() -> bool:
        return await _server_ms(client) > ms

    await until(past, "the server's clock stood still", timeout_s=10)


async def test_the_member_completing_a_group_freezes_it_and_a_later_one_is_late(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        before = await _server_ms(client)
        opened = await _record(client, "g", "m0", 2)
        assert opened[0] == GroupStatus.OPEN and int(opened[1]) >= before  # first_at: the first member's time
        assert _frozen(await _record(client, "g", "m1", 2)) == (GroupStatus.COMPLETE, b"2", b"0", {b"m0", b"m1"})
        assert await _record(client, "g", "m2", 2) == [GroupStatus.LATE]
        meta, members = group_keys(NS, "g")
        assert await client.hget(meta, "state") == b"complete" and await client.hlen(members) == 2
        # A redo of a frozen member (an assembler crashed before its acknowledgement) returns the set again...
        assert _frozen(await _record(client, "g", "m0", 2))[3] == {b"m0", b"m1"}
        await client.hset(meta, "published", "1")
        assert await _record(client, "g", "m1", 2) == [GroupStatus.PUBLISHED]  # ... until it is published


async def test_members_disagreeing_on_the_size_keep_the_largest_and_flag_a_mismatch(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        assert (await _record(client, "s", "m0", 2))[0] == GroupStatus.OPEN
        assert (await _record(client, "s", "m1", 3))[0] == GroupStatus.OPEN  # two members are not three
        assert _frozen(await _record(client, "s", "m2", 2)) == (
            GroupStatus.COMPLETE,
            b"3",
            b"1",
            {b"m0", b"m1", b"m2"},
        )


async def test_a_seal_freezes_an_open_group_past_the_timeout_only(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        opened = await _record(client, "t", "m0", 3)
        assert (await _seal(client, "t", 600_000))[0] == GroupStatus.OPEN
        await _after(client, int(opened[1]) + 20)
        assert _frozen(await _seal(client, "t", 10)) == (GroupStatus.SEALED, b"3", b"0", {b"m0"})
        assert await _record(client, "t", "m1", 3) == [GroupStatus.LATE]  # frozen: no second group
        assert _frozen(await _seal(client, "t", 10))[0] == GroupStatus.SEALED  # a redo, not yet published
        await client.hset(group_keys(NS, "t")[0], "published", "1")
        assert await _seal(client, "t", 10) == [GroupStatus.PUBLISHED]
        assert await _seal(client, "never", 10) == [GroupStatus.GONE]


async def test_the_due_script_lists_the_open_groups_past_the_timeout(redis_url: str) -> None:
    index = open_groups_key(NS, 0)
    async with aioredis.Redis.from_url(redis_url) as client:
        now = await _server_ms(client)
        await client.zadd(index, {"old": now - 10_000, "new": now + 60_000})
        reply = list(await GROUP_DUE_SCRIPT.run(client, [index], [5_000, 10]))
        assert reply == [2, b"old"]


async def test_a_close_keeps_the_record_as_a_tombstone_for_the_longer_bound(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        await _record(client, "c", "m0", 1)
        meta, members = group_keys(NS, "c")
        assert await client.pttl(meta) == -1 and await client.pttl(members) == -1  # open/published: kept
        assert list(await GROUP_CLOSE_SCRIPT.run(client, [meta, members], [1_000])) == [0]
        assert TOMBSTONE_MS - 60_000 < await client.pttl(meta) <= TOMBSTONE_MS  # the stamped bound wins
        assert TOMBSTONE_MS - 60_000 < await client.pttl(members) <= TOMBSTONE_MS
        assert await client.hget(meta, "closed") == b"1"
        assert await _record(client, "c", "m1", 1) == [GroupStatus.LATE]


async def test_a_take_gives_a_group_to_one_entry_and_reads_its_members(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        await _record(client, "k", "m0", 2)
        await _record(client, "k", "m1", 2)
        keys = group_keys(NS, "k")
        taken = list(await GROUP_TAKE_SCRIPT.run(client, keys, ["s#1-0", "m0", "m1", "gone"]))
        assert taken == [ClaimStatus.CLAIMED, b'{"rollout_id":"m0"}', b'{"rollout_id":"m1"}', None]
        assert list(await GROUP_TAKE_SCRIPT.run(client, keys, ["s#2-0", "m0"])) == [ClaimStatus.DUPLICATE]
        assert (await GROUP_TAKE_SCRIPT.run(client, keys, ["s#1-0", "m0"]))[0] == ClaimStatus.CLAIMED  # redelivered
        assert list(await GROUP_CLOSE_SCRIPT.run(client, keys, [1_000])) == [0]
        assert list(await GROUP_TAKE_SCRIPT.run(client, keys, ["s#1-0", "m0"])) == [ClaimStatus.RETIRED]
        assert list(await GROUP_TAKE_SCRIPT.run(client, group_keys(NS, "none"), ["s#3-0", "m0"])) == [
            ClaimStatus.RETIRED
        ]
