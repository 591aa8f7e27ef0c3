"""No stream entry a consumer cannot parse stops it (real Valkey 8 / Redis 7.0 servers).

Every entry of ``ns:done:<k>`` (the assembler's) and ``ns:receipts:<k>`` (the reader's) that cannot be
parsed, whatever its bytes, size or JSON depth, is copied to ``ns:dead:<role>-<shard>`` with a reason
and acknowledged; the consumer goes on with the healthy entries around it. The fuzzed corpus runs a
live assembler and a live reader over hypothesis-generated entries.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sink.keys import dead_letter_stream, done_stream, receipt_key, receipts_stream
from sink.rollout.assembler import Assembler, finished
from sink.rollout.receipt import build_receipt
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.e2e import pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until
from tests.helpers.replies import raw_entries, xadd_fields

DONE = done_stream("stg", 0)
RECEIPTS = receipts_stream("stg", 0)
DEAD_DONE = dead_letter_stream("stg", "done-0")
DEAD_RECEIPTS = dead_letter_stream("stg", "receipts-0")
ONE_SHARD: dict[str, Any] = {"done_shards": 1, "receipt_shards": 1}
DEEP = 100_000
NOT_UTF8 = b"\xff\xfe\x80 not utf-8"


def _deep_list(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep_object(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


async def _dead(client: aioredis.Redis, stream: str) -> list[dict[bytes, bytes]]:
    return [fields for _id, fields in raw_entries(await client.xrange(stream))]


async def _wait_drained(client: aioredis.Redis, stream: str, timeout_s: float = 20.0) -> None:
    async def drained() -> bool:
        return not await client.xlen(stream)

    await until(drained, lambda: f"{stream} still holds entries after {timeout_s} s", timeout_s=timeout_s)


# --- the assembler (done streams) ---------------------------------------------------------------


_DONE_POISON: list[dict[bytes, bytes]] = [
    {b"rollout_id": NOT_UTF8, b"reward": b"1"},
    {b"rollout_id": b"p-1", b"reward": b"1", b"response": NOT_UTF8},
    {NOT_UTF8: b"x", b"rollout_id": b"p-2", b"reward": b"1"},
    {b"rollout_id": b"p-3", b"reward": b"1", b"response": _deep_list(DEEP)},
    {b"rollout_id": b"p-4", b"reward": _deep_list(DEEP)},
    {b"rollout_id": b"p-5", b"reward": b"1", b"response": _deep_object(DEEP)},
    {b"rollout_id": b"p-6", b"reward": b"1", b"declared_response_id": NOT_UTF8},
]


@pytest.mark.anyio
async def test_undecodable_and_deep_done_entries_are_dead_lettered_and_healthy_rollouts_assemble(
    redis_url: str,
) -> None:
    await stage_rollouts(redis_url, ["healthy-a", "healthy-b"], calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        await finished(client, "healthy-a", reward=1.0, shards=1)
        for fields in _DONE_POISON:
            await client.xadd(DONE, xadd_fields(fields))
        await finished(client, "healthy-b", reward=0.5, shards=1)
        async with running_assembler(redis_url, block_ms=20, **ONE_SHARD) as assembler:
            await _wait_drained(client, DONE)
        dead = await _dead(client, DEAD_DONE)
        assert len(dead) == len(_DONE_POISON)
        assert assembler.statistics().dead_lettered == len(_DONE_POISON)
        # The raw bytes travel to the dead letter unchanged, with the reason.
        by_id = {fields[b"rollout_id"]: fields for fields in dead}
        assert sorted(by_id) == sorted(fields[b"rollout_id"] for fields in _DONE_POISON)
        assert b"UTF-8" in by_id[NOT_UTF8][b"dead_reason"] and b"UTF-8" in by_id[b"p-1"][b"dead_reason"]
        assert by_id[b"p-2"][NOT_UTF8] == b"x"
        assert all(b"nested too deeply" in by_id[name][b"dead_reason"] for name in (b"p-3", b"p-4", b"p-5"))
        assert all(len(fields[b"dead_reason"]) < 2_100 for fields in dead)
        assert await client.exists(receipt_key("stg", "healthy-a"), receipt_key("stg", "healthy-b")) == 2
    async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
        pulled = await pull_until(reader, 2)
        assert sorted(p.rollout_id for p in pulled if p.trainable) == ["healthy-a", "healthy-b"]


# --- the reader (receipts streams) --------------------------------------------------------------


def _receipt_fields(rollout_id: str) -> dict[bytes, bytes]:
    receipt = build_receipt(None, rollout_id=rollout_id, reward=1.0)
    return {b"rollout_id": rollout_id.encode(), b"receipt": receipt.model_dump_json().encode()}


_RECEIPT_POISON: list[dict[bytes, bytes]] = [
    {b"rollout_id": NOT_UTF8, b"receipt": b"{}"},
    {**_receipt_fields("p-1"), b"receipt": NOT_UTF8},
    {**_receipt_fields("p-2"), NOT_UTF8: NOT_UTF8},
    {b"rollout_id": b"p-3", b"receipt": _deep_list(DEEP)},
    {b"rollout_id": b"p-4", b"receipt": _deep_object(DEEP)},
]


@pytest.mark.anyio
async def test_undecodable_and_deep_receipt_entries_are_dead_lettered_and_pull_goes_on(redis_url: str) -> None:
    staged = await stage_rollouts(redis_url, ["healthy"], calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        for fields in _RECEIPT_POISON:
            await client.xadd(RECEIPTS, xadd_fields(fields))
        await finished(client, "healthy", reward=1.0, shards=1)
        async with running_assembler(redis_url, block_ms=20, **ONE_SHARD):
            await _wait_drained(client, DONE)
        async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
            pulled = await pull_until(reader, 1)
            assert [p.rollout_id for p in pulled] == ["healthy"] and pulled[0].row is not None
            assert pulled[0].row.token_ids == tuple(staged[0].token_ids)
            assert reader.statistics().dead_lettered == len(_RECEIPT_POISON)
            await reader.ack(["healthy"])
        dead = await _dead(client, DEAD_RECEIPTS)
        assert len(dead) == len(_RECEIPT_POISON)
        by_id = {fields[b"rollout_id"]: fields for fields in dead}
        assert sorted(by_id) == sorted(fields[b"rollout_id"] for fields in _RECEIPT_POISON)
        assert b"UTF-8" in by_id[NOT_UTF8][b"dead_reason"] and b"UTF-8" in by_id[b"p-1"][b"dead_reason"]
        assert by_id[b"p-2"][NOT_UTF8] == NOT_UTF8
        assert all(b"malformed receipt entry" in by_id[name][b"dead_reason"] for name in (b"p-3", b"p-4"))
        assert await client.xlen(RECEIPTS) == 0


# --- the fuzzed corpus ---------------------------------------------------------------------------

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_depths = st.sampled_from([1, 2, 50, 999, 1_001, 5_000, DEEP])
_values = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=32).map(str.encode),
    st.sampled_from([b"", b"1", b"null", b"nan", b"1e999", b"-0", b"true", b'"x"', b"{}", b"[]", NOT_UTF8]),
    _depths.map(_deep_list),
    _depths.map(_deep_object),
    st.integers(min_value=1, max_value=1 << 20).map(lambda n: b"7" * n),
)


def _entries(names: list[bytes]) -> st.SearchStrategy[dict[bytes, bytes]]:
    return st.dictionaries(st.sampled_from(names) | st.binary(min_size=1, max_size=8), _values, min_size=1, max_size=5)


def _start(portal: BlockingPortal, assembler: Assembler) -> Future[Any]:
    return portal.start_task_soon(assembler.run)


def test_fuzzed_done_entries_never_stop_the_assembler(redis_url: str) -> None:
    names = [b"rollout_id", b"reward", b"response", b"declared_response_id"]
    with (
        redis.Redis.from_url(redis_url) as client,
        start_blocking_portal(backend="asyncio") as portal,
        portal.wrap_async_context_manager(Assembler.from_url(redis_url, block_ms=10, **ONE_SHARD)) as assembler,
    ):
        running = _start(portal, assembler)
        seen = {"n": 0}

        @FUZZ
        @given(_entries(names))
        def check(fields: dict[bytes, bytes]) -> None:
            seen["n"] += 1
            sentinel = f"sentinel-{seen['n']}"
            client.xadd(DONE, xadd_fields(fields))
            client.xadd(DONE, {"rollout_id": sentinel, "reward": "1"})
            for _ in range(1_000):
                if client.xlen(DONE) == 0 or running.done():
                    break
                portal.call(anyio.sleep, 0.01)
            assert not running.done(), running.exception()
            assert client.xlen(DONE) == 0, "an entry was left pending"
            assert client.exists(receipt_key("stg", sentinel)) == 1

        check()
        stats = assembler.statistics()
        portal.call(assembler.stop)
        running.result(timeout=30)
    # Every entry either made a receipt or sits in the dead letters; every sentinel made one.
    assert stats.dead_lettered + stats.published == 2 * seen["n"]
    assert stats.published >= seen["n"]
    assert stats.dead_lettered > 0


def test_fuzzed_receipt_entries_never_stop_the_reader(redis_url: str) -> None:
    names = [b"rollout_id", b"receipt"]
    reader_settings: dict[str, Any] = {"receipt_shards": 1}
    with (
        redis.Redis.from_url(redis_url) as client,
        start_blocking_portal(backend="asyncio") as portal,
        portal.wrap_async_context_manager(RolloutReader.from_url(redis_url, **reader_settings)) as reader,
    ):
        seen = {"n": 0}

        @FUZZ
        @given(_entries(names))
        def check(fields: dict[bytes, bytes]) -> None:
            seen["n"] += 1
            sentinel = f"sentinel-{seen['n']}"
            client.xadd(RECEIPTS, xadd_fields(fields))
            client.xadd(RECEIPTS, xadd_fields(_receipt_fields(sentinel)))
            pulled = portal.call(reader.pull, 8)
            ids = [p.rollout_id for p in pulled]
            assert sentinel in ids
            portal.call(reader.ack, ids)
            assert client.xlen(RECEIPTS) == 0, "an entry was left pending"

        check()
        stats = reader.statistics()
    assert stats.dead_lettered > 0
    assert stats.dead_lettered + stats.pulled >= 2 * seen["n"]
