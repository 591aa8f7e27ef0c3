"""What ``prune`` reads and changes besides rollouts: only its own namespace's keys (a namespace of the same
length next to it is left exactly as it was), GRPO group keys are not rollouts, a key of another type under a
stream pattern does not stop a pass, dead-letter streams keep their newest ``dead_letter_max_entries`` (the
dry run counts the same), and a consumer name is deleted only when idle past ``consumer_idle_max_s`` with
nothing pending."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from sink.keys import calls_stream, dead_letter_stream, done_stream, fence_key, group_keys, receipts_stream
from sink.ledger.redis import RedisCaptureLedger
from sink.ops.prune import prune_namespace
from sink.settings import PruneSettings
from sink.store.connection import Topology, reply_text
from sink.store.sink import AsyncRedisStagingSink
from tests.helpers.e2e import stage_rollout, stage_rollouts
from tests.helpers.prune import key_state, next_millisecond
from tests.helpers.replies import raw_entries

pytestmark = pytest.mark.anyio


async def _consumers(client: aioredis.Redis, stream: str, group: str) -> dict[str, int]:
    """Consumer name -> entries it has pending."""
    return {
        reply_text(consumer["name"]): int(consumer["pending"])
        for consumer in await client.xinfo_consumers(stream, group)
    }


async def _wait_idle(client: aioredis.Redis, stream: str, group: str, idle_ms: int) -> None:
    """Until every consumer of *group* on *stream* has been idle at least *idle_ms* (idle only grows)."""
    while any(int(consumer["idle"]) < idle_ms for consumer in await client.xinfo_consumers(stream, group)):
        await next_millisecond()


async def test_prune_reads_and_changes_only_its_namespace(redis_url: str) -> None:
    """``ns2`` is as long as ``stg``: a key of it read as one of ``stg`` would name a ``stg`` rollout."""
    async with (
        AsyncRedisStagingSink.from_url(redis_url, namespace="ns2") as sink,
        RedisCaptureLedger.from_url(redis_url, namespace="ns2") as ledger,
    ):
        await stage_rollout(sink, ledger, "elsewhere", calls=1)
    await stage_rollouts(redis_url, ["long"], calls=12)  # a live rollout's calls stream, longer than the cap
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.set(fence_key("ns2", "retired"), "1")
        for ns in ("ns2", "stg"):
            for index in range(30):
                await client.xadd(dead_letter_stream(ns, "receipts-0"), {"n": str(index)})
            await client.xgroup_create(done_stream(ns, 0), "assemblers", id="0", mkstream=True)
            await client.xgroup_createconsumer(done_stream(ns, 0), "assemblers", "gone")
            await _wait_idle(client, done_stream(ns, 0), "assemblers", 20)
        before = await key_state(client, "ns2:*")
        settings = PruneSettings(
            abandon_after_s=600, retention_s=60, dead_letter_max_entries=10, consumer_idle_max_s=0.01
        )
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings, now_s=await next_millisecond() + 3600)
        await topology.aclose()
        assert report.as_dict() == {
            "dry_run": False,
            "rollouts_seen": 1,
            "retained": [],
            "abandoned": ["long"],
            "dead_letters_trimmed": {dead_letter_stream("stg", "receipts-0"): 20},
            "consumers_removed": [f"{done_stream('stg', 0)} assemblers gone"],
            "skipped": {},
        }
        assert await key_state(client, "ns2:*") == before  # the other namespace: not a key changed
        assert await _consumers(client, done_stream("ns2", 0), "assemblers") == {"gone": 0}
        assert await client.keys("stg:{elsewhere}:*") == [] and await client.keys("stg:{retired}:*") == []


async def test_the_calls_stream_of_a_live_rollout_is_never_trimmed(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["long"], calls=12)
    async with aioredis.Redis.from_url(redis_url) as client:
        settings = PruneSettings(abandon_after_s=600, dead_letter_max_entries=10)
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings, now_s=await next_millisecond())
        await topology.aclose()
        assert (report.abandoned, report.dead_letters_trimmed) == ([], {})
        assert await client.xlen(calls_stream("stg", "long")) == 12


async def test_group_keys_are_not_rollouts(redis_url: str) -> None:
    ids = [f"stale-{index}" for index in range(10)]
    await stage_rollouts(redis_url, ids, calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        for index in range(10):  # GRPO group mode's server-side records: the reader expires them
            meta, members = group_keys("stg", f"g{index}")
            await client.hset(meta, mapping={"size": "4", "owner": "reader-0"})
            await client.hset(members, "stale-0", "0-1")
        before = await key_state(client, "stg:{grp:*")
        settings = PruneSettings(abandon_after_s=600, retention_s=60)
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings, now_s=await next_millisecond() + 600)
        await topology.aclose()
        assert report.rollouts_seen == 10
        assert report.abandoned == sorted(ids)  # every rollout, wherever the group keys fall in the scan
        assert report.retained == []
        assert await key_state(client, "stg:{grp:*") == before


async def test_a_key_of_another_type_under_a_stream_pattern_does_not_stop_a_pass(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        strays = ["stg:dead:note", "stg:done:note", "stg:receipts:note"]  # e.g. left by hand
        for stray in strays:
            await client.set(stray, "not a stream")
        dead = dead_letter_stream("stg", "done-0")
        for index in range(12):
            await client.xadd(dead, {"n": str(index)})
        settings = PruneSettings(dead_letter_max_entries=10)
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings)
        await topology.aclose()
        assert report.dead_letters_trimmed == {dead: 2}
        assert [await client.get(stray) for stray in strays] == [b"not a stream"] * 3


async def test_dead_letter_streams_keep_their_newest_entries_and_the_dry_run_counts_the_same(redis_url: str) -> None:
    limit = 8
    async with aioredis.Redis.from_url(redis_url) as client:
        lengths = {dead_letter_stream("stg", f"over-{index}"): limit + 1 + index for index in range(5)}
        lengths |= {dead_letter_stream("stg", f"at-cap-{index}"): limit for index in range(3)}
        lengths |= {dead_letter_stream("stg", f"under-{index}"): 2 for index in range(3)}
        newest: dict[str, list[str]] = {}
        for stream, length in lengths.items():
            ids = [reply_text(await client.xadd(stream, {"n": str(index)})) for index in range(length)]
            newest[stream] = ids[-limit:]
        expected = {stream: length - limit for stream, length in lengths.items() if length > limit}
        settings = PruneSettings(dead_letter_max_entries=limit)
        topology = Topology.borrow(client, settings)
        before = await key_state(client, "stg:*")
        dry = await prune_namespace(topology, settings, dry_run=True)
        assert dry.dead_letters_trimmed == expected  # a stream at the cap is not listed
        assert await key_state(client, "stg:*") == before
        report = await prune_namespace(topology, settings)
        await topology.aclose()
        assert report.dead_letters_trimmed == expected
        for stream in lengths:
            kept = [reply_text(entry_id) for entry_id, _fields in raw_entries(await client.xrange(stream))]
            assert kept == newest[stream]


async def test_only_consumer_names_idle_past_the_limit_with_nothing_pending_are_deleted(redis_url: str) -> None:
    done, receipts = done_stream("stg", 0), receipts_stream("stg", 0)
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.xadd(done, {"rollout_id": "r1"})
        await client.xgroup_create(done, "assemblers", id="0")
        await client.xreadgroup("assemblers", "a-busy", {done: ">"}, count=1)  # owns one pending entry
        await client.xgroup_createconsumer(done, "assemblers", "b-gone")
        await client.xgroup_create(receipts, "trainers", id="0", mkstream=True)
        await client.xgroup_createconsumer(receipts, "trainers", "t-gone")
        await _wait_idle(client, done, "assemblers", 30)
        await _wait_idle(client, receipts, "trainers", 30)
        everyone = {done: {"a-busy": 1, "b-gone": 0}, receipts: {"t-gone": 0}}
        groups = {done: "assemblers", receipts: "trainers"}

        async def consumers() -> dict[str, dict[str, int]]:
            return {stream: await _consumers(client, stream, group) for stream, group in groups.items()}

        recent = PruneSettings(consumer_idle_max_s=3600)  # all of them were active within the hour
        topology = Topology.borrow(client, recent)
        assert (await prune_namespace(topology, recent, dry_run=True)).consumers_removed == []
        assert (await prune_namespace(topology, recent)).consumers_removed == []
        assert await consumers() == everyone
        idle = PruneSettings(consumer_idle_max_s=0.02)
        gone = [f"{done} assemblers b-gone", f"{receipts} trainers t-gone"]
        assert sorted((await prune_namespace(topology, idle, dry_run=True)).consumers_removed) == gone
        assert await consumers() == everyone
        assert sorted((await prune_namespace(topology, idle)).consumers_removed) == gone
        await topology.aclose()
        assert await consumers() == {done: {"a-busy": 1}, receipts: {}}  # its pending entry is still owned
