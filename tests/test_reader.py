"""The trainer's RolloutReader against real servers: ranks, crashes, duplicates, dead letters, ack rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import anyio
import pytest
import redis.asyncio as aioredis

from sink.keys import claim_key, dead_letter_stream, receipts_stream, record_key
from sink.rollout.assembler import finished
from sink.settings import ReaderSettings
from sink.trainer.reader.rollout_reader import TRAINER_GROUP, PulledRollout, RolloutReader
from tests.helpers.e2e import EventCounter, StagedRollout, pull_until, running_assembler, stage_rollouts
from tests.helpers.replies import raw_entries, text_entries, xadd_fields


class _Shards(TypedDict):
    receipt_shards: int


ONE_SHARD: _Shards = {"receipt_shards": 1}
RECEIPTS = receipts_stream("stg", 0)


async def _assemble(url: str, staged: Sequence[StagedRollout]) -> None:
    """Finish every rollout and run an assembler until all receipts are published (one receipts shard)."""
    published = EventCounter(len(staged))
    async with aioredis.Redis.from_url(url) as client:
        for rollout in staged:
            await finished(client, rollout.rollout_id, reward=1.0)
    async with running_assembler(url, before_ack=published, block_ms=50, receipt_shards=1):
        with anyio.fail_after(20):
            await published.reached.wait()


async def _prepared(url: str, ids: Sequence[str]) -> dict[str, StagedRollout]:
    staged = await stage_rollouts(url, ids, calls=2)
    await _assemble(url, staged)
    return {s.rollout_id: s for s in staged}


def _check_rows(pulled: Sequence[PulledRollout], staged: dict[str, StagedRollout]) -> None:
    for item in pulled:
        assert item.row is not None, item
        assert item.row.token_ids == tuple(staged[item.rollout_id].token_ids)


async def _stream_state(url: str) -> tuple[int, int]:
    async with aioredis.Redis.from_url(url) as client:
        return await client.xlen(RECEIPTS), int((await client.xpending(RECEIPTS, TRAINER_GROUP))["pending"])


@pytest.mark.anyio
async def test_two_ranks_share_the_group_without_duplicates(redis_url: str) -> None:
    ids = [f"ranks-{i}" for i in range(8)]
    staged = await _prepared(redis_url, ids)
    results: dict[str, list[PulledRollout]] = {"rank-0": [], "rank-1": []}
    first_pull_done = anyio.Event()

    async def rank(name: str) -> None:
        async with RolloutReader.from_url(redis_url, consumer_name=name, **ONE_SHARD) as reader:
            if name == "rank-1":
                await first_pull_done.wait()  # rank-0 takes some, rank-1 the rest
            pulled = await reader.pull(4 if name == "rank-0" else 16, block_ms=100)
            first_pull_done.set()
            results[name] = pulled
            await reader.ack([item.rollout_id for item in pulled])

    async with anyio.create_task_group() as group:
        group.start_soon(rank, "rank-0")
        group.start_soon(rank, "rank-1")
    zero = {item.rollout_id for item in results["rank-0"]}
    one = {item.rollout_id for item in results["rank-1"]}
    assert len(zero) == 4 and len(one) == 4 and not zero & one and zero | one == set(ids)
    _check_rows(results["rank-0"] + results["rank-1"], staged)
    assert await _stream_state(redis_url) == (0, 0)


@pytest.mark.anyio
async def test_a_crashed_readers_rollouts_are_reclaimed_by_another_rank(redis_url: str) -> None:
    ids = [f"crash-{i}" for i in range(3)]
    staged = await _prepared(redis_url, ids)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as crashed:
        assert len(await pull_until(crashed, 3)) == 3
    # rank-0 is gone without acknowledging: its rollouts stay pending and claimed.
    assert await _stream_state(redis_url) == (3, 3)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-1", claim_idle_ms=50, **ONE_SHARD) as rescuer:
        pulled = await pull_until(rescuer, 3)
        _check_rows(pulled, staged)
        assert rescuer.statistics().reclaimed == 3
        await rescuer.ack(ids)
    assert await _stream_state(redis_url) == (0, 0)
    async with aioredis.Redis.from_url(redis_url) as client:
        assert not await client.exists(*(claim_key("stg", rollout_id) for rollout_id in ids))


@pytest.mark.anyio
async def test_a_restarted_rank_recovers_its_own_pending_rollouts_at_once(redis_url: str) -> None:
    ids = ["own-0", "own-1"]
    staged = await _prepared(redis_url, ids)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-3", **ONE_SHARD) as before:
        await pull_until(before, 2)
    async with RolloutReader.from_url(redis_url, consumer_name="rank-3", **ONE_SHARD) as after:
        pulled = await after.pull(8)  # claim_idle_ms is 5 minutes: this is not XAUTOCLAIM
        assert sorted(item.rollout_id for item in pulled) == ids
        _check_rows(pulled, staged)
        await after.ack(ids)
    assert await _stream_state(redis_url) == (0, 0)


@pytest.mark.anyio
async def test_a_receipt_published_twice_is_trained_once_across_ranks_and_after_consumption(redis_url: str) -> None:
    staged = await _prepared(redis_url, ["twice"])
    async with aioredis.Redis.from_url(redis_url) as client:
        [(_entry_id, fields)] = raw_entries(await client.xrange(RECEIPTS))
        await client.xadd(RECEIPTS, xadd_fields(fields))  # what an assembler crash after publishing leaves behind
        async with (
            RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as zero,
            RolloutReader.from_url(redis_url, consumer_name="rank-1", **ONE_SHARD) as one,
        ):
            [item] = await zero.pull(1)
            _check_rows([item], staged)
            assert await one.pull(8) == []  # the copy: rank-0 holds the rollout
            assert one.statistics().duplicates_dropped == 1
            await zero.ack(["twice"])
            # A copy published after the rollout was consumed is dropped too (the ledger is retired).
            await client.xadd(RECEIPTS, xadd_fields(fields))
            assert await one.pull(8) == []
            assert one.statistics().duplicates_dropped == 2
        assert await _stream_state(redis_url) == (0, 0)


@pytest.mark.anyio
async def test_two_copies_in_one_pull_yield_one_rollout(redis_url: str) -> None:
    staged = await _prepared(redis_url, ["copies"])
    async with aioredis.Redis.from_url(redis_url) as client:
        [(_entry_id, fields)] = raw_entries(await client.xrange(RECEIPTS))
        await client.xadd(RECEIPTS, xadd_fields(fields))
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        pulled = await reader.pull(8)
        assert [item.rollout_id for item in pulled] == ["copies"]
        _check_rows(pulled, staged)
        await reader.ack(["copies"])
    assert await _stream_state(redis_url) == (0, 0)


@pytest.mark.anyio
async def test_a_rollout_that_keeps_crashing_readers_is_dead_lettered(redis_url: str) -> None:
    await _prepared(redis_url, ["poison-pill"])
    async with RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as crashed:
        assert len(await crashed.pull(1)) == 1
    async with RolloutReader.from_url(
        redis_url, consumer_name="rank-1", claim_idle_ms=30, max_deliveries=1, **ONE_SHARD
    ) as reader:
        with anyio.fail_after(10):
            while reader.statistics().dead_lettered == 0:
                assert await reader.pull(1, block_ms=50) == []
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        [(_id, dead)] = text_entries(await client.xrange(dead_letter_stream("stg", "receipts-0")))
        assert dead["rollout_id"] == "poison-pill" and dead["dead_deliveries"] == "2"
        assert dead["dead_source"] == RECEIPTS
    assert await _stream_state(redis_url) == (0, 0)


@pytest.mark.anyio
async def test_a_malformed_receipt_entry_is_dead_lettered_not_returned(redis_url: str) -> None:
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        async with aioredis.Redis.from_url(redis_url) as client:
            await client.xadd(RECEIPTS, {"rollout_id": "r1", "receipt": "{not json"})
        assert await reader.pull(4, block_ms=100) == []
        assert reader.statistics().dead_lettered == 1
    assert await _stream_state(redis_url) == (0, 0)


@pytest.mark.anyio
async def test_ack_validates_before_changing_anything(redis_url: str) -> None:
    staged = await _prepared(redis_url, ["held"])
    async with RolloutReader.from_url(redis_url, **ONE_SHARD) as reader:
        await pull_until(reader, 1)
        with pytest.raises(TypeError):
            await reader.ack("held")
        with pytest.raises(ValueError, match="never-pulled"):
            await reader.ack(["held", "never-pulled"])
        assert reader.held_rollouts == ("held",)
        async with aioredis.Redis.from_url(redis_url) as client:
            assert await client.exists(record_key("stg", staged["held"].staging_keys[0]))
        with pytest.raises(ValueError):
            await reader.pull(0)
        removal = await reader.ack(["held", "held"])
        assert removal.removed == ["held"]
        with pytest.raises(ValueError):
            await reader.ack(["held"])  # already acknowledged


@pytest.mark.anyio
async def test_heartbeat_keeps_held_rollouts_and_consumer_retires_only_when_idle(redis_url: str) -> None:
    await _prepared(redis_url, ["beat"])
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-0", **ONE_SHARD) as holder,
        RolloutReader.from_url(redis_url, consumer_name="rank-1", claim_idle_ms=2_000, **ONE_SHARD) as other,
    ):
        await pull_until(holder, 1)
        await anyio.sleep(2.1)  # the held entry is now idle longer than claim_idle_ms: reclaimable but for ...
        assert await holder.heartbeat() == 0  # ... the heartbeat, which makes it fresh again
        assert await other.pull(1) == []  # not idle: nothing to reclaim
        # holder owns a pending entry: its consumer name must survive.
        assert await holder.retire_consumer() == 0
        await holder.ack(["beat"])
        assert await holder.retire_consumer() == 1
        assert await holder.pending() == 0
        assert "held=0" in repr(holder)


def test_reader_settings_are_strict() -> None:
    with pytest.raises(ValueError):
        ReaderSettings(consumer_name="has space")
    with pytest.raises(ValueError):
        ReaderSettings(receipt_shards=0)
    assert ReaderSettings().claim_idle_ms == 300_000


@pytest.mark.anyio
async def test_a_retired_rollout_is_skipped_with_a_warning_never_silently(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A receipt of a retired rollout is dropped with a line an operator sees (the trainer command
    prints warnings), not silently."""
    import logging

    from sink.ledger.redis import RedisCaptureLedger
    from tests.helpers.trainer import publish

    await publish(redis_url, ["ret-1"])
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        await ledger.retire(["ret-1"])
    caplog.set_level(logging.WARNING, logger="sink.trainer.reader.claims")
    async with RolloutReader.from_url(redis_url) as reader:
        assert await reader.pull(1, block_ms=200) == []
    assert any("'ret-1': it is retired" in record.getMessage() for record in caplog.records), caplog.text
