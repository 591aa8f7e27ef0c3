"""Soak (bounded state): 5,000 rollouts through stage -> finished -> receipt -> pull -> ack, plus a share
never finished (abandoned by prune); once retention passes, the keyspace and ``used_memory`` are back at the
baseline plus a stated bound. Prints the figures (keys and bytes before, at peak, after)."""

from __future__ import annotations

import math
import time

import anyio
import pytest
import redis.asyncio as aioredis

from sink.ledger.redis import RedisCaptureLedger
from sink.ops.prune import prune_namespace
from sink.rollout.assembler import finished
from sink.server import DurableServer
from sink.settings import DEFAULT_SHARDS, PruneSettings
from sink.store.connection import Topology
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.retention import consumed_keys, expire_consumed
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.e2e import running_assembler, stage_rollout
from tests.helpers.processes import until

ROLLOUTS = 5_000
ABANDONED_SHARE = 10  # every 10th rollout never finishes
RETENTION_S = 10.0
"""The retention the test starts counting once every rollout is acknowledged (it re-applies it then)."""
ACK_RETENTION_S = 3_600.0
"""The reader's retention during the run: nothing can expire while the acknowledgement loop runs, however slow."""
CONCURRENCY = 128
FIXED_KEYS = 2 * DEFAULT_SHARDS + 1  # ns:done:<k>, ns:receipts:<k> (with their groups), ns:dead:abandoned
MEMORY_BOUND_BYTES = 1536 * 1024
"""used_memory after the soak may exceed the baseline by at most this (1.5 MiB), whatever the rollout count:
the fixed streams and their groups (~0.7 KB each), ``ns:dead:abandoned`` (~105 bytes per abandoned rollout,
bounded by ``dead_letter_max_entries``) and the server's own bookkeeping (cached scripts, client buffers, table
minimums: ~0.9 MiB measured, the same after 1,000 or 5,000 rollouts)."""


async def _figures(client: aioredis.Redis) -> tuple[int, int]:
    await client.execute_command("MEMORY", "PURGE")  # type: ignore[no-untyped-call]
    memory = await client.info("memory")
    return int(await client.dbsize()), int(memory["used_memory"])


async def _stage_all(url: str, ids: list[str]) -> None:
    limit = anyio.Semaphore(CONCURRENCY)
    async with (
        AsyncRedisStagingSink.from_url(url) as sink,
        RedisCaptureLedger.from_url(url) as ledger,
        anyio.create_task_group() as group,
    ):

        async def one(rollout_id: str) -> None:
            async with limit:
                await stage_rollout(sink, ledger, rollout_id, calls=1, n_tokens=16)

        for rollout_id in ids:
            group.start_soon(one, rollout_id)


async def _finish(client: aioredis.Redis, rollout_ids: list[str]) -> None:
    for rollout_id in rollout_ids:
        await finished(client, rollout_id, reward=1.0)


async def _soak(url: str) -> dict[str, tuple[int, int]]:
    ids = [f"soak-{index}" for index in range(ROLLOUTS)]
    finishing = [rid for index, rid in enumerate(ids) if index % ABANDONED_SHARE]
    figures: dict[str, tuple[int, int]] = {}
    async with aioredis.Redis.from_url(url) as client:
        figures["before"] = await _figures(client)
        await _stage_all(url, ids)
        async with anyio.create_task_group() as group:
            for start in range(0, len(finishing), len(finishing) // 8 + 1):
                group.start_soon(_finish, client, finishing[start : start + len(finishing) // 8 + 1])
        figures["peak"] = await _figures(client)  # every rollout staged, in flight
        async with (
            running_assembler(url, block_ms=50, batch_events=256),
            RolloutReader.from_url(url, retention_s=ACK_RETENTION_S, consumer_name="soak") as reader,
        ):
            acked = 0
            with anyio.fail_after(120):
                while acked < len(finishing):
                    pulled = await reader.pull(512, block_ms=200)
                    assert all(rollout.row is not None for rollout in pulled)
                    await reader.ack([rollout.rollout_id for rollout in pulled])
                    acked += len(pulled)
            await reader.retire_consumer()
        figures["acked"] = await _figures(client)  # receipts and fences retained; the abandoned still in flight
        topology = Topology.borrow(client, PruneSettings())
        # Every consumed rollout's receipt and fence got the reader's retention at its ack ...
        for rollout_id in finishing:
            for key in consumed_keys("stg", rollout_id):
                assert 0 < await client.ttl(key) <= ACK_RETENTION_S, key
        # ... and the test starts the short retention now, a point it controls (the same call ack makes).
        assert await expire_consumed(topology, "stg", finishing, RETENTION_S) == 2 * len(finishing)
        await topology.aclose()
        settings = PruneSettings(abandon_after_s=0.5, retention_s=RETENTION_S)
        topology = Topology.borrow(client, settings)
        # Ages counted to a time the test fixes: every rollout was staged before it.
        report = await prune_namespace(topology, settings, now_s=time.time() + 2 * settings.abandon_after_s)
        await topology.aclose()
        assert len(report.abandoned) == ROLLOUTS - len(finishing)
        left: list[int] = []

        async def expired() -> bool:  # retention passes; active expiry removes the keys
            left[:] = [int(await client.dbsize())]
            return left[0] <= FIXED_KEYS

        await until(expired, lambda: f"{left} keys left 60 s after retention, not {FIXED_KEYS}", timeout_s=60)
        figures["after"] = await _figures(client)
    return figures


@pytest.mark.slow
def test_soak_state_returns_to_baseline() -> None:
    with DurableServer() as server:
        figures = anyio.run(_soak, server.url)
    for stage, (keys, used) in figures.items():
        print(f"soak {stage:>6}: {keys:>6} keys, used_memory {used:>11,} bytes")
    (keys_before, used_before), (keys_peak, used_peak) = figures["before"], figures["peak"]
    keys_acked, used_acked = figures["acked"]
    keys_after, used_after = figures["after"]
    finished_count = ROLLOUTS - math.ceil(ROLLOUTS / ABANDONED_SHARE)
    print(f"soak bytes per in-flight rollout: {(used_peak - used_before) / ROLLOUTS:,.0f}")
    in_flight = (used_peak - used_before) / ROLLOUTS
    retained = (used_acked - used_before - in_flight * (ROLLOUTS - finished_count)) / finished_count
    print(f"soak bytes per retained receipt (+fence): {retained:,.0f}")
    assert keys_peak > ROLLOUTS * 3  # calls, ledger, ledger:ids, record per rollout
    assert keys_acked >= finished_count * 2  # receipt + fence per consumed rollout, until retention passes
    assert keys_after == keys_before + FIXED_KEYS
    assert used_after - used_before <= MEMORY_BOUND_BYTES, (used_before, used_after)
