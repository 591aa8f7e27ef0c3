"""The GRPO group scripts (group gather, group check, group close) on real servers: each reply and the group record
it leaves, driven through the script runner as two ranks would (``rank-0``, ``rank-1``), and through
:class:`~sink.trainer.groups.GroupReader` where a reader shows it.

The contract (sink.store.scripts.consumer): a member recorded in a group a live rank owns gets ``TAKEN`` and that
owner, the owner itself ``OWNED``; an owner idle past ``claim_idle_ms`` loses a whole group to the next rank that
gathers or checks it (``COMPLETE``, ``deliveries`` counting the owners it had); a closed group is ``GONE`` to a
check and ``LATE`` to a new member, even when its record expired before the close; both records expire.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.keys import group_keys
from sink.store.scripts import GROUP_CHECK_SCRIPT, GROUP_CLOSE_SCRIPT, GROUP_GATHER_SCRIPT, GroupStatus
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.processes import until
from tests.helpers.trainer import publish

pytestmark = pytest.mark.anyio

NS = "grpscripts"
LIVE_MS = 600_000
"""``claim_idle_ms`` under which every owner is live; ``0``: every owner is idle past it (dead)."""
TTL_MS = 600_000


async def _gather(
    client: aioredis.Redis,
    group_id: str,
    member: str,
    consumer: str,
    size: int,
    *,
    claim_idle_ms: int = LIVE_MS,
    ttl_ms: int = TTL_MS,
) -> list[Any]:
    record = f"ok\n{member}-entry\n{consumer}"
    args = [member, record, consumer, size, claim_idle_ms, ttl_ms]
    return list(await GROUP_GATHER_SCRIPT.run(client, group_keys(NS, group_id), args))


async def _check(client: aioredis.Redis, group_id: str, consumer: str, *, timeout_ms: int = LIVE_MS) -> list[Any]:
    return list(await GROUP_CHECK_SCRIPT.run(client, group_keys(NS, group_id), [consumer, timeout_ms]))


async def _close(client: aioredis.Redis, group_id: str, ttl_ms: int = TTL_MS) -> None:
    assert list(await GROUP_CLOSE_SCRIPT.run(client, group_keys(NS, group_id), [ttl_ms])) == [0]


def _members(reply: list[Any]) -> dict[bytes, bytes]:
    flat = reply[3:]
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


async def _meta(client: aioredis.Redis, group_id: str) -> dict[bytes, bytes]:
    meta = await client.hgetall(group_keys(NS, group_id)[0])
    return {k: v for k, v in meta.items() if isinstance(k, bytes) and isinstance(v, bytes)}


async def _server_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _after(client: aioredis.Redis, ms: int) -> int:
    """Wait until the server's clock is past *ms* (the scripts' clock); return its time then."""
    with anyio.fail_after(10):
        while True:
            if (now := await _server_ms(client)) > ms:
                return now
            await anyio.sleep(0.001)


async def _complete_by_rank1(client: aioredis.Redis, group_id: str) -> None:
    """rank-0 records m0, rank-1 records m1 and completes the group of two: rank-1 owns it."""
    assert await _gather(client, group_id, "m0", "rank-0", 2) == [GroupStatus.WAIT]
    reply = await _gather(client, group_id, "m1", "rank-1", 2)
    assert reply[:3] == [GroupStatus.COMPLETE, b"2", b"0"] and set(_members(reply)) == {b"m0", b"m1"}


async def test_a_member_of_a_group_a_live_rank_owns_is_taken_and_the_owner_is_told_it_owns_it(
    redis_url: str,
) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        await _complete_by_rank1(client, "g")
        # rank-0 reads its member again (a restart, a reclaim): rank-1 is live and owns the group.
        assert await _gather(client, "g", "m0", "rank-0", 2) == [GroupStatus.TAKEN, b"rank-1"]
        assert await _gather(client, "g", "m1", "rank-1", 2) == [GroupStatus.OWNED]
        assert (await _meta(client, "g"))[b"deliveries"] == b"1"
        # rank-1 idle past claim_idle_ms: rank-0 gathering a member takes the whole group over.
        await _after(client, int((await _meta(client, "g"))[b"owner_at"]))  # idle 1 ms at least: past 0
        reply = await _gather(client, "g", "m0", "rank-0", 2, claim_idle_ms=0)
        assert reply[:3] == [GroupStatus.COMPLETE, b"2", b"0"] and set(_members(reply)) == {b"m0", b"m1"}
        meta = await _meta(client, "g")
        assert meta[b"owner"] == b"rank-0" and meta[b"deliveries"] == b"2"


async def test_a_check_tells_the_owner_it_owns_the_group_and_keeps_it_live(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        await _complete_by_rank1(client, "g")
        assert await _check(client, "g", "rank-0") == [GroupStatus.TAKEN, b"rank-1"]
        owned_at = int((await _meta(client, "g"))[b"owner_at"])
        before = await _after(client, owned_at)
        assert await _check(client, "g", "rank-1") == [GroupStatus.OWNED]
        assert int((await _meta(client, "g"))[b"owner_at"]) >= before  # the owner's check refreshes it
        assert await _check(client, "g", "rank-0") == [GroupStatus.TAKEN, b"rank-1"]


async def test_a_check_never_takes_a_group_from_its_owner_however_long_since_it_took_it(redis_url: str) -> None:
    """A rank waiting on a group another rank owns lets its members go, even when the owner took the group
    longer than ``claim_idle_ms`` ago (its trainer may still work on it); a dead owner's members come back through
    their receipt entries, to the gather."""
    async with aioredis.Redis.from_url(redis_url) as client:
        await _complete_by_rank1(client, "g")
        await _after(client, int((await _meta(client, "g"))[b"owner_at"]))
        assert await _check(client, "g", "rank-0", timeout_ms=0) == [GroupStatus.TAKEN, b"rank-1"]
        meta = await _meta(client, "g")
        assert meta[b"owner"] == b"rank-1" and meta[b"deliveries"] == b"1"


async def test_a_check_seals_a_group_at_its_timeout_and_makes_the_caller_its_owner(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await _gather(client, "g", "m0", "rank-0", 3) == [GroupStatus.WAIT]
        assert await _gather(client, "g", "m1", "rank-1", 3) == [GroupStatus.WAIT]
        assert await _check(client, "g", "rank-0") == [GroupStatus.WAIT]  # not timed out yet
        await _after(client, int((await _meta(client, "g"))[b"first_at"]))
        reply = await _check(client, "g", "rank-0", timeout_ms=1)
        assert reply[:3] == [GroupStatus.SEALED, b"3", b"0"] and set(_members(reply)) == {b"m0", b"m1"}
        meta = await _meta(client, "g")
        assert meta[b"owner"] == b"rank-0" and meta[b"deliveries"] == b"1"
        # rank-0 owns it now: the other rank, checking too, lets it go (never a second delivery).
        assert await _check(client, "g", "rank-1", timeout_ms=1) == [GroupStatus.TAKEN, b"rank-0"]


async def test_a_closed_group_is_gone_to_a_check_and_a_new_member_is_late(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        await _complete_by_rank1(client, "g")
        await _close(client, "g")
        assert await _check(client, "g", "rank-0") == [GroupStatus.GONE]
        assert await _check(client, "g", "rank-0", timeout_ms=0) == [GroupStatus.GONE]
        assert await _gather(client, "g", "m2", "rank-0", 2, claim_idle_ms=0) == [GroupStatus.LATE]


async def test_both_group_records_expire_and_a_closed_group_stays_a_tombstone_for_the_close_ttl(
    redis_url: str,
) -> None:
    meta_key, members_key = group_keys(NS, "g")
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await _gather(client, "g", "m0", "rank-0", 2, ttl_ms=50_000) == [GroupStatus.WAIT]
        assert 0 < await client.pttl(meta_key) <= 50_000 and 0 < await client.pttl(members_key) <= 50_000
        assert (await _gather(client, "g", "m1", "rank-0", 2, ttl_ms=50_000))[0] == GroupStatus.COMPLETE
        await _close(client, "g", ttl_ms=TTL_MS)
        assert not await client.exists(members_key)
        assert 50_000 < await client.pttl(meta_key) <= TTL_MS  # the tombstone's own TTL, not the gather's


async def test_a_member_after_a_close_is_late_even_when_the_group_record_expired_before_the_close(
    redis_url: str,
) -> None:
    """A training step longer than the group records' TTL: they expire before the ack closes the group."""
    meta_key, members_key = group_keys(NS, "g")
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await _gather(client, "g", "m0", "rank-0", 3, ttl_ms=100) == [GroupStatus.WAIT]
        assert await _gather(client, "g", "m1", "rank-0", 3, ttl_ms=100) == [GroupStatus.WAIT]

        async def expired() -> bool:  # a real TTL, waited for
            return not await client.exists(meta_key, members_key)

        await until(expired, "the group records did not expire within 10 s of their 100 ms TTL", timeout_s=10)
        await _close(client, "g")
        assert await _gather(client, "g", "m2", "rank-0", 3) == [GroupStatus.LATE]
        assert not await client.exists(members_key)  # nothing recorded for the late member


async def test_a_group_completed_by_a_member_announcing_a_smaller_size_keeps_the_largest(redis_url: str) -> None:
    announced = {"z-0": ("sizes", 3), "z-1": ("sizes", 2), "z-2": ("sizes", 2)}
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", receipt_shards=1) as rank0:
        groups = GroupReader(rank0)
        delivered: list[RolloutGroup] = []
        for index, rollout_id in enumerate(announced):  # one at a time, in order: the first says 3, the others 2
            assert delivered == [], delivered
            await publish(redis_url, [rollout_id], groups=announced, receipt_shards=1)
            with anyio.fail_after(20):
                while rank0.statistics().pulled <= index:
                    delivered += await groups.pull_groups(1, block_ms=50)
        (group,) = delivered
        assert group.complete and group.group_size == 3 and group.rollout_ids == ("z-0", "z-1", "z-2")
        assert groups.statistics().size_mismatches == 1
        await groups.ack_groups(delivered)
        assert await rank0.pending() == 0


async def test_a_group_owner_restarted_under_the_same_consumer_name_delivers_its_group_again(redis_url: str) -> None:
    """A rank that delivered a group and crashed before the ack, restarted under its name (``rank-0``): its
    group's members come back to it and are delivered again once the old owner is idle past ``claim_idle_ms``
    (counted as double deliveries), never held unacknowledged forever."""
    members = ["r-0", "r-1"]
    options: dict[str, Any] = {"consumer_name": "rank-0", "receipt_shards": 1, "claim_idle_ms": 300}
    await publish(redis_url, members, groups=dict.fromkeys(members, ("restart", 2)), calls=1, receipt_shards=1)
    async with RolloutReader.from_url(redis_url, **options) as first:
        (group,) = await GroupReader(first).pull_groups(4, block_ms=2000)
        assert group.complete and group.rollout_ids == tuple(members)
    async with RolloutReader.from_url(redis_url, **options) as again:
        groups = GroupReader(again)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(20):
            while not delivered:
                delivered = await groups.pull_groups(4, block_ms=50)
        (group,) = delivered
        assert group.complete and group.rollout_ids == tuple(members)
        assert again.statistics().double_deliveries == len(members)
        await groups.ack_groups(delivered)
        assert await again.pending() == 0


async def test_a_live_owner_keeps_its_group_when_a_waiting_rank_pulls_after_claim_idle_ms(redis_url: str) -> None:
    """rank-0 parks a member and does not pull for longer than ``claim_idle_ms`` (a long training step) while
    rank-1 completes the group and trains on it, renewing its lease (``heartbeat``): rank-0's next pull lets its
    member go, never delivers the group a second time."""
    members = ["s-0", "s-1"]
    options: dict[str, Any] = {"receipt_shards": 1, "claim_idle_ms": 300}
    await publish(redis_url, members, groups=dict.fromkeys(members, ("slow", 2)), calls=1, receipt_shards=1)
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **options) as rank0,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", **options) as rank1,
    ):
        first, second = GroupReader(rank0), GroupReader(rank1)
        assert await first.pull_groups(1, block_ms=2000) == []
        (group,) = await second.pull_groups(1, block_ms=2000)
        assert group.rollout_ids == tuple(members)
        async with aioredis.Redis.from_url(redis_url) as client:
            owner_at = int((await client.hgetall(group_keys("stg", "slow")[0]))[b"owner_at"])
            with anyio.fail_after(10):
                while True:
                    assert await rank1.heartbeat() == 0  # the owner lives: its lease on the members is renewed
                    if await _server_ms(client) > owner_at + 2 * 300:  # it took the group over claim_idle_ms ago
                        break
                    await anyio.sleep(0.02)
        assert await first.pull_groups(1, block_ms=50) == []
        assert rank0.held_rollouts == () and first.statistics().handed_over == 1
        assert set(rank1.held_rollouts) == set(members)
        await second.ack_groups([group])
        assert await rank1.pending() == 0 and rank1.statistics().double_deliveries == 0
