"""The rollout-end flow against real servers: finished() -> Assembler -> receipts -> RolloutReader.

Covers end to end staging/assembly/pull/ack, poisoned and tampered rollouts,
receipt idempotency under two assemblers, reclaiming a killed assembler's
events with XAUTOCLAIM, dead-lettering, stream hygiene and a cluster run.
"""

from __future__ import annotations

import math
from typing import TypedDict, cast

import anyio
import numpy as np
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sink.contract.records import RolloutReceipt
from sink.errors import CodecError, StagingConnectionError
from sink.keys import (
    calls_stream,
    claim_key,
    dead_letter_stream,
    done_stream,
    fence_key,
    ledger_stream,
    receipt_key,
    receipts_stream,
    record_key,
    shard_of,
)
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import ASSEMBLER_GROUP, Assembler, finished
from sink.rollout.done_event import parse_done_event
from sink.server import DurableServer
from sink.settings import AssemblerSettings
from sink.store.streams import StreamEntry
from sink.trainer.reader.rollout_reader import TRAINER_GROUP, RolloutReader
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import EventCounter, pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until
from tests.helpers.replies import raw_entries, text_entries, text_read


class _Fast(TypedDict):
    block_ms: int
    claim_idle_ms: int


class _SingleShards(TypedDict):
    done_shards: int
    receipt_shards: int


SHARDS = 4
FAST: _Fast = {"block_ms": 50, "claim_idle_ms": 60_000}


async def _stream_lengths(client: aioredis.Redis, streams: list[str]) -> int:
    return sum([await client.xlen(stream) for stream in streams])


async def _pending(client: aioredis.Redis, streams: list[str], group: str) -> int:
    total = 0
    for stream in streams:
        if await client.exists(stream):
            total += int((await client.xpending(stream, group))["pending"])
    return total


DONE = [done_stream("stg", k) for k in range(SHARDS)]
RECEIPTS = [receipts_stream("stg", k) for k in range(SHARDS)]


# --- finished() -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_finished_writes_one_token_free_event_on_the_rollout_shard(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        entry_id = await finished(client, "r-7", reward=0.5, response={"id": "x", "b": [1]}, declared_response_id="x")
        stream = done_stream("stg", shard_of("r-7", SHARDS))
        [(found_id, fields)] = text_entries(await client.xrange(stream))
    assert found_id == entry_id
    assert fields == {
        "rollout_id": "r-7",
        "reward": "0.5",
        "response": '{"b":[1],"id":"x"}',
        "declared_response_id": "x",
    }
    event = parse_done_event(fields)
    assert (event.reward, event.response, event.declared_response_id) == (0.5, {"id": "x", "b": [1]}, "x")


@pytest.mark.anyio
async def test_finished_rejects_bad_ids_and_non_finite_rewards(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        with pytest.raises(ValueError, match="Invalid rollout id"):
            await finished(client, "bad id", reward=1.0)
        for reward in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match="finite"):
                await finished(client, "r1", reward=reward)
        with pytest.raises(TypeError):
            await finished(client, "r1", reward="1.0")  # type: ignore[arg-type]
        for huge in (10**400, -(10**400)):  # an int no float can hold: the documented ValueError, not OverflowError
            with pytest.raises(ValueError, match="finite"):
                await finished(client, "r1", reward=huge)
        assert await client.keys("*") == []  # nothing was written


def test_malformed_done_events_are_codec_errors() -> None:
    huge = {"rollout_id": "r1", "reward": "1" + "0" * 400}  # JSON int beyond any float
    for fields in ({}, {"rollout_id": "r1", "reward": "NaN"}, {"rollout_id": "a b", "reward": "1"}, huge):
        with pytest.raises(CodecError):
            parse_done_event(fields)
    assert parse_done_event({"rollout_id": "r1", "reward": "null"}).reward is None


def test_assembler_settings_are_strict() -> None:
    with pytest.raises(ValueError):
        AssemblerSettings(block_ms=20_000)  # longer than the command timeout
    with pytest.raises(ValueError):
        AssemblerSettings(claim_idle_ms=10, unknown=1)  # type: ignore[call-arg]


# --- end to end -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_end_to_end_rows_verify_and_ack_removes_everything(redis_url: str) -> None:
    staged = await stage_rollouts(redis_url, [f"e2e-{i}" for i in range(3)], calls=3, n_tokens=8)
    by_id = {s.rollout_id: s for s in staged}
    async with aioredis.Redis.from_url(redis_url) as client:
        for s in staged:
            await finished(client, s.rollout_id, reward=1.5)
        async with (
            running_assembler(redis_url, **FAST) as assembler,
            RolloutReader.from_url(redis_url, consumer_name="rank-0") as reader,
        ):
            pulled = await pull_until(reader, 3)
            # Held, not acknowledged: the entries are still in the stream and pending.
            assert await _stream_lengths(client, RECEIPTS) == 3
            assert await _pending(client, RECEIPTS, TRAINER_GROUP) == 3
            assert sorted(reader.held_rollouts) == sorted(by_id)
            for item in pulled:
                expected = by_id[item.rollout_id]
                assert item.trainable and item.row is not None, item
                assert item.receipt.reward == 1.5
                assert item.row.token_ids == tuple(expected.token_ids)
                assert item.row.token_mask == tuple(expected.token_mask)
                assert item.row.logprobs == tuple(expected.logprobs)
                assert item.row.call_ids == expected.call_ids
                ids, mask, logprobs = item.row.as_numpy()
                assert ids.tolist() == expected.token_ids
                assert np.array_equal(mask, np.array(expected.token_mask, dtype=np.float32))
                assert np.array_equal(logprobs, np.array(expected.logprobs, dtype=np.float32))
            removal = await reader.ack([item.rollout_id for item in pulled])
            assert sorted(removal.removed) == sorted(by_id)
            assert "acked=3" in repr(reader) and reader.statistics().held == 0
        stats = assembler.statistics()
        assert (stats.receipts_created, stats.published, stats.acked, stats.failures) == (3, 3, 3, 0)
        assert "created=3" in repr(assembler)
        # Nothing acknowledged remains in any stream, nothing is pending.
        assert await _stream_lengths(client, DONE + RECEIPTS) == 0
        assert await _pending(client, DONE, ASSEMBLER_GROUP) == 0
        assert await _pending(client, RECEIPTS, TRAINER_GROUP) == 0
        for s in staged:
            assert not await client.exists(*(record_key("stg", key) for key in s.staging_keys))
            assert not await client.exists(calls_stream("stg", s.rollout_id), ledger_stream("stg", s.rollout_id))
            assert not await client.exists(claim_key("stg", s.rollout_id))
            assert await client.exists(fence_key("stg", s.rollout_id))  # retired
            assert await client.exists(receipt_key("stg", s.rollout_id))  # the immutable receipt stays
        # A graceful stop removed the assembler's consumer name (it owned nothing pending).
        for stream in DONE:
            assert await client.xinfo_consumers(stream, ASSEMBLER_GROUP) == []


@pytest.mark.anyio
async def test_poisoned_and_unavailable_rollouts_come_back_skipped_with_their_reason(redis_url: str) -> None:
    [_good, poisoned] = await stage_rollouts(redis_url, ["good", "poisoned"], calls=2)
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        await ledger.record_failure("poisoned", "c9", "worker_capture_failed")
        await ledger.retire(["gone"])  # retired before assembly: its manifest is unavailable
    async with aioredis.Redis.from_url(redis_url) as client:
        for rollout_id in ("good", "poisoned", "gone"):
            await finished(client, rollout_id, reward=None)
        async with running_assembler(redis_url, **FAST), RolloutReader.from_url(redis_url) as reader:
            pulled = {item.rollout_id: item for item in await pull_until(reader, 3)}
            assert pulled["good"].trainable
            assert (pulled["poisoned"].skip_code, pulled["poisoned"].skip_reason) == (
                "rollout_failed",
                "worker_capture_failed",
            )
            assert pulled["poisoned"].row is None
            assert (pulled["gone"].skip_code, pulled["gone"].skip_reason) == ("rollout_failed", "manifest_unavailable")
            assert pulled["gone"].receipt.manifest == []
            assert reader.statistics().skipped == 2
            removal = await reader.ack(list(pulled))
        assert sorted(removal.removed) == ["good", "poisoned"] and removal.absent == ["gone"]
        # The poisoned rollout's staged records are cleared too.
        assert not await client.exists(*(record_key("stg", key) for key in poisoned.staging_keys))
        assert await _stream_lengths(client, RECEIPTS) == 0


@pytest.mark.anyio
async def test_tampered_and_missing_records_are_skipped_with_a_code(redis_url: str) -> None:
    [tampered, missing, donor] = await stage_rollouts(redis_url, ["tampered", "missing", "donor"], calls=2)
    async with aioredis.Redis.from_url(redis_url) as client:
        blob = cast("bytes", await client.get(record_key("stg", donor.staging_keys[1])))
        await client.set(record_key("stg", tampered.staging_keys[1]), blob)
        await client.delete(record_key("stg", missing.staging_keys[0]))
        for rollout_id in ("tampered", "missing"):
            await finished(client, rollout_id, reward=0.0)
        async with running_assembler(redis_url, **FAST), RolloutReader.from_url(redis_url) as reader:
            pulled = {item.rollout_id: item for item in await pull_until(reader, 2)}
            await reader.ack(list(pulled))
    assert pulled["tampered"].skip_code == "corrupt_record"
    assert "belongs to" in (pulled["tampered"].skip_reason or "")
    assert pulled["missing"].skip_code == "missing_record"
    assert missing.staging_keys[0] in (pulled["missing"].skip_reason or "")


# --- idempotency and recovery --------------------------------------------------------------


@pytest.mark.anyio
async def test_two_assemblers_on_the_same_events_store_exactly_one_receipt_per_rollout(redis_url: str) -> None:
    ids = [f"dup-{i}" for i in range(6)]
    await stage_rollouts(redis_url, ids, calls=2)
    async with aioredis.Redis.from_url(redis_url) as client:
        for rollout_id in ids * 2:  # every rollout finished twice: two events each
            await finished(client, rollout_id, reward=1.0)
        first, second = EventCounter(1), EventCounter(1)
        started, done = anyio.Event(), anyio.Event()

        async def count(counter: EventCounter, entry: StreamEntry) -> None:
            counter.entries.append(entry)
            if first.entries and second.entries:
                started.set()  # both have events in hand: neither can take them all
            if len(first.entries) + len(second.entries) == 12:
                done.set()
            await started.wait()

        async with (
            running_assembler(redis_url, before_ack=lambda e: count(first, e), batch_events=2, **FAST) as one,
            running_assembler(redis_url, before_ack=lambda e: count(second, e), batch_events=2, **FAST) as two,
        ):
            with anyio.fail_after(20):
                await done.wait()
        created = one.statistics().receipts_created + two.statistics().receipts_created
        reused = one.statistics().receipts_reused + two.statistics().receipts_reused
        assert (created, reused) == (6, 6)
        assert first.entries and second.entries  # both assemblers took part
        # Every published receipt of a rollout is the one stored receipt.
        for stream in RECEIPTS:
            for _entry_id, fields in raw_entries(await client.xrange(stream)):
                stored = await client.get(receipt_key("stg", fields[b"rollout_id"].decode()))
                assert fields[b"receipt"] == stored
        assert await _stream_lengths(client, RECEIPTS) == 12
        async with RolloutReader.from_url(redis_url) as reader:
            pulled = await pull_until(reader, 6)
            assert await reader.pull(16, block_ms=0) == []  # the rest were duplicates
            assert sorted(item.rollout_id for item in pulled) == ids
            assert all(item.trainable for item in pulled)
            assert reader.statistics().duplicates_dropped == 6
            await reader.ack(ids)
        assert await _stream_lengths(client, DONE + RECEIPTS) == 0


@pytest.mark.anyio
async def test_a_killed_assemblers_events_are_reclaimed_and_finished_by_another(redis_url: str) -> None:
    ids = [f"kill-{i}" for i in range(5)]
    await stage_rollouts(redis_url, ids, calls=2)
    read_all = anyio.Event()
    seen: list[StreamEntry] = []

    async def hang_before_ack(entry: StreamEntry) -> None:
        seen.append(entry)
        if len(seen) == len(ids):
            read_all.set()
        await anyio.sleep_forever()  # "killed" before acknowledging anything

    async with aioredis.Redis.from_url(redis_url) as client:
        for rollout_id in ids:
            await finished(client, rollout_id, reward=1.0, shards=1)
        single: _SingleShards = {"done_shards": 1, "receipt_shards": 1}
        async with anyio.create_task_group() as victim_group:
            victim = Assembler.from_url(redis_url, before_ack=hang_before_ack, batch_events=16, **single, **FAST)
            async with victim:
                victim_group.start_soon(victim.run)
                with anyio.fail_after(20):
                    await read_all.wait()
                victim_group.cancel_scope.cancel()  # a crash: no graceful stop, no acknowledgement
        assert victim.statistics().acked == 0
        assert int((await client.xpending(done_stream("stg", 0), ASSEMBLER_GROUP))["pending"]) == len(ids)

        rescued = EventCounter(len(ids))
        async with running_assembler(redis_url, before_ack=rescued, **single, block_ms=30, claim_idle_ms=50) as rescuer:
            with anyio.fail_after(20):
                await rescued.reached.wait()
        stats = rescuer.statistics()
        assert stats.reclaimed == len(ids) and stats.receipts_reused == len(ids) and stats.acked == len(ids)
        assert await client.xlen(done_stream("stg", 0)) == 0
        assert int((await client.xpending(done_stream("stg", 0), ASSEMBLER_GROUP))["pending"]) == 0
        # Each rollout: one stored receipt, published twice, trained once.
        assert await client.xlen(receipts_stream("stg", 0)) == 2 * len(ids)
        async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
            pulled = await pull_until(reader, len(ids))
            assert await reader.pull(16) == []
            assert sorted(item.rollout_id for item in pulled) == ids and all(item.trainable for item in pulled)
            await reader.ack(ids)
        assert await client.xlen(receipts_stream("stg", 0)) == 0


@pytest.mark.anyio
async def test_an_event_that_keeps_failing_is_dead_lettered_after_max_deliveries(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["doomed"], calls=1)
    attempts: list[int] = []

    async def outage(entry: StreamEntry) -> None:
        attempts.append(entry.deliveries)
        raise StagingConnectionError("simulated outage while publishing")

    dead = dead_letter_stream("stg", "done-0")
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        await finished(client, "doomed", reward=1.0, shards=1)
        await client.xadd(done_stream("stg", 0), {"rollout_id": "not valid!", "reward": "1"})  # malformed
        async with running_assembler(
            redis_url, before_ack=outage, done_shards=1, block_ms=20, claim_idle_ms=30, max_deliveries=2
        ) as assembler:
            with anyio.fail_after(20):
                dead_entries: list[tuple[str, dict[str, str]]] = []
                while len(dead_entries) < 2:
                    last = dead_entries[-1][0] if dead_entries else "0"
                    reply = text_read(await client.xread({dead: last}, block=5_000))
                    dead_entries += reply[0][1] if reply else []
        by_reason = {fields["rollout_id"]: fields for _id, fields in dead_entries}
        assert by_reason["doomed"]["dead_deliveries"] == "3"
        assert "max_deliveries=2" in by_reason["doomed"]["dead_reason"]
        assert by_reason["doomed"]["dead_source"] == done_stream("stg", 0)
        assert "malformed done event" in by_reason["not valid!"]["dead_reason"]
        assert attempts == [1, 2]
        assert assembler.statistics().dead_lettered == 2
        assert await client.xlen(done_stream("stg", 0)) == 0
        assert int((await client.xpending(done_stream("stg", 0), ASSEMBLER_GROUP))["pending"]) == 0


@pytest.mark.anyio
async def test_stop_before_run_returns_at_once_and_repr_reports_state(redis_url: str) -> None:
    async with Assembler.from_url(redis_url, **FAST) as assembler:
        assert "idle" in repr(assembler)
        assembler.stop()
        with anyio.fail_after(5):
            await assembler.run()
    assert "closed" in repr(assembler)


# --- cluster ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_assembler_and_reader_work_across_cluster_slots(cluster: LocalCluster) -> None:
    url = cluster.url
    ids = [f"cl-{i}" for i in range(4)]
    staged = {s.rollout_id: s for s in await stage_rollouts(url, ids, calls=2, cluster=True)}
    client = RedisCluster.from_url(url)
    try:
        for rollout_id in ids:
            await finished(client, rollout_id, reward=2.0)
        async with (
            running_assembler(url, cluster=True, **FAST),
            RolloutReader.from_url(url, cluster=True, consumer_name="rank-0") as reader,
        ):
            pulled = await pull_until(reader, len(ids))
            for item in pulled:
                assert item.row is not None and item.row.token_ids == tuple(staged[item.rollout_id].token_ids)
            await reader.ack(ids)
        for rollout_id in ids:
            receipt = RolloutReceipt.model_validate_json(
                cast("bytes", await client.get(receipt_key("stg", rollout_id)))
            )
            assert receipt.reward == 2.0 and not receipt.capture_poisoned
            assert not await client.exists(record_key("stg", staged[rollout_id].staging_keys[0]))
        for stream in DONE + RECEIPTS:
            assert await client.xlen(stream) == 0
    finally:
        # Leave the shared cluster clean for other tests.
        for rollout_id in ids:
            await client.delete(receipt_key("stg", rollout_id), fence_key("stg", rollout_id))
        for stream in DONE + RECEIPTS:
            await client.delete(stream)
        await client.aclose()


@pytest.mark.anyio
async def test_stop_interrupts_a_blocked_read_and_cancels_in_flight_events_after_the_grace(redis_url: str) -> None:
    stuck = anyio.Event()

    async def never_finishes(entry: StreamEntry) -> None:
        stuck.set()
        await anyio.sleep_forever()

    async with aioredis.Redis.from_url(redis_url) as client:
        async with Assembler.from_url(redis_url, block_ms=60_000, command_timeout_s=120, done_shards=1) as idle:
            returned = anyio.Event()

            async def run_idle() -> None:
                await idle.run()
                returned.set()

            async def parked() -> bool:  # the XREADGROUP BLOCK waits on the server
                return int((await client.info("clients"))["blocked_clients"]) >= 1

            async with anyio.create_task_group() as group:
                group.start_soon(run_idle)
                await until(parked, "the assembler's blocked read never reached the server")
                idle.stop()
                with anyio.fail_after(30):  # far below block_ms: the blocked read is interrupted
                    await returned.wait()
            assert "idle" in repr(idle)

        await stage_rollouts(redis_url, ["stuck"], calls=1)
        await finished(client, "stuck", reward=1.0, shards=1)
        async with Assembler.from_url(
            redis_url, before_ack=never_finishes, done_shards=1, shutdown_grace_s=0.1, **FAST
        ) as assembler:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as group:
                    group.start_soon(assembler.run)
                    await stuck.wait()
                    assembler.stop()  # run() returns once the 0.1 s grace cancelled the stuck event
        # Cancelled after the grace, never acknowledged: still pending, and the consumer that owns it stays.
        stream = done_stream("stg", 0)
        assert int((await client.xpending(stream, ASSEMBLER_GROUP))["pending"]) == 1
        [consumer] = await client.xinfo_consumers(stream, ASSEMBLER_GROUP)
        assert consumer["name"].decode() == assembler.consumer_name and consumer["pending"] == 1


@pytest.mark.anyio
async def test_the_assembler_gives_up_after_max_outage_s(fresh_server: DurableServer) -> None:
    """Services ride through outages with bounded backoff and give up only after a
    configurable outage (here 1 s), with a StagingConnectionError (the CLI's exit 3)."""
    settings = AssemblerSettings(max_outage_s=1.0, reconnect_backoff_s=0.1, block_ms=50, connect_timeout_s=0.2)
    async with Assembler.from_url(fresh_server.url, settings) as assembler:
        fresh_server.kill()
        with anyio.fail_after(20), pytest.raises((StagingConnectionError, BaseExceptionGroup)) as caught:
            await assembler.run()
    # every shard loop gives up the same way (an exception group of them, or one)
    errors, todo = [], [caught.value]
    while todo:
        error = todo.pop()
        if isinstance(error, BaseExceptionGroup):
            todo.extend(error.exceptions)
        else:
            errors.append(error)
    assert errors and all(
        isinstance(error, StagingConnectionError) and "max_outage_s=1" in str(error) for error in errors
    ), errors
