"""What a trainer reader has in hand and gives up goes to another reader at once (before, a DataLoader worker that
stopped left rollouts it had read pending until ``claim_idle_ms``, then they came back as false double deliveries).

A pull reads no more receipt entries than it returns; entries a reader read and never returned
(:meth:`RolloutReader.release_unpulled`) and rollouts it holds and gives up (:meth:`RolloutReader.release_held`)
are taken by the next reader that finds nothing new, without waiting for a lease to expire. ``claim_idle_ms`` is an
hour in every test here, and every reader has done its first (scheduled) reclaim before anything is released."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest
import redis.asyncio as aioredis

from sink.keys import receipts_stream
from sink.settings import DEFAULT_SHARDS
from sink.trainer.reader.backlog import TRAINER_GROUP
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.trainer import publish

AN_HOUR_MS = 3_600_000
pytestmark = pytest.mark.anyio


async def _pending(url: str) -> dict[str, int]:
    """Pending receipt entries per consumer, over every shard."""
    counts: dict[str, int] = {}
    async with aioredis.Redis.from_url(url, decode_responses=True) as client:
        for shard in range(DEFAULT_SHARDS):
            stream = receipts_stream("stg", shard)
            if await client.exists(stream):
                for row in (await client.xpending(stream, TRAINER_GROUP))["consumers"]:
                    counts[row["name"]] = counts.get(row["name"], 0) + int(row["pending"])
    return counts


@asynccontextmanager
async def _one_shard_readers(url: str, ids: list[str], *names: str) -> AsyncIterator[list[RolloutReader]]:
    """Publish *ids* on one receipts shard, then open one reader per name (``claim_idle_ms`` an hour)."""
    await publish(url, ids, receipt_shards=1)
    async with AsyncExitStack() as stack:
        readers = [
            await stack.enter_async_context(
                RolloutReader.from_url(url, consumer_name=name, claim_idle_ms=AN_HOUR_MS, receipt_shards=1)
            )
            for name in names
        ]
        yield readers


async def test_a_pull_reads_no_more_receipt_entries_than_it_returns(redis_url: str) -> None:
    ids = [f"exact-{i}" for i in range(8)]
    await publish(redis_url, ids)
    async with aioredis.Redis.from_url(redis_url) as client:
        lengths = [int(await client.xlen(receipts_stream("stg", shard))) for shard in range(DEFAULT_SHARDS)]
    assert sum(1 for n in lengths if n) >= 2, lengths  # the receipts are spread over several shards
    async with RolloutReader.from_url(redis_url, consumer_name="exact", claim_idle_ms=AN_HOUR_MS) as reader:
        got = [item.rollout_id for item in await reader.pull(1)]
        assert len(got) == 1 and await _pending(redis_url) == {"exact": 1}  # one read, one returned
        got += [item.rollout_id for item in await reader.pull(3)]
        assert len(got) == 4 and await _pending(redis_url) == {"exact": 4}
        got += [item.rollout_id for item in await reader.pull(8)]
        assert sorted(got) == sorted(ids)
        await reader.ack(got)
    assert await _pending(redis_url) == {}


async def test_entries_read_but_never_pulled_go_back_as_first_deliveries(redis_url: str) -> None:
    ids = [f"ahead-{i}" for i in range(4)]
    async with _one_shard_readers(redis_url, ids, "idle", "ahead") as (idle, ahead):
        # What a blocking read that raced new receipts leaves behind: entries read, in hand, never pulled.
        ahead._backlog._entries += await ahead._consumer.read_new([0], count=4, block_ms=None)
        assert await _pending(redis_url) == {"ahead": 4}
        assert await idle.pull(4) == []  # nothing for it: its first (scheduled) reclaim is done
        assert await ahead.release_unpulled() == 4
        with anyio.fail_after(10):
            pulled = await idle.pull(4, block_ms=100)
        assert sorted(item.rollout_id for item in pulled) == sorted(ids)
        stats = idle.statistics()
        assert stats.reclaimed == 4 and stats.double_deliveries == 0  # never given to a trainer before
        await idle.ack(ids)
        assert await ahead.pull(4) == []  # nothing of them left in its hand
    assert await _pending(redis_url) == {}


async def test_held_rollouts_released_go_to_an_idle_reader_at_once(redis_url: str) -> None:
    ids = [f"held-{i}" for i in range(3)]
    async with _one_shard_readers(redis_url, ids, "holder", "idle") as (holder, idle):
        assert len(await holder.pull(3)) == 3
        assert await idle.pull(3) == []  # its first (scheduled) reclaim found nothing idle
        assert await holder.release_held() == 3
        assert holder.held_rollouts == ()
        with pytest.raises(ValueError, match="not held"):
            await holder.ack(ids[:1])  # given up: no longer this reader's to acknowledge
        with anyio.fail_after(10):
            pulled = await idle.pull(3, block_ms=100)
        assert sorted(item.rollout_id for item in pulled) == sorted(ids)
        assert idle.statistics().double_deliveries == 3  # pulled before: they may have been trained
        await idle.ack(ids)
    assert await _pending(redis_url) == {}
