"""Lost leases are reported, double deliveries counted, and ``staging-sink trainer``
rides through a server restart (real Valkey 8 / Redis 7.0 servers).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.keys import record_key
from sink.rollout.assembler import finished
from sink.server import DurableServer
from sink.trainer.reader.rollout_reader import TRAINER_GROUP, RolloutReader
from tests.helpers.commands import Command, staging_sink
from tests.helpers.e2e import StagedRollout, pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until


async def _prepared(url: str, ids: Sequence[str]) -> list[StagedRollout]:
    staged = await stage_rollouts(url, ids, calls=1)
    async with aioredis.Redis.from_url(url) as client:
        for rollout_id in ids:
            await finished(client, rollout_id, reward=1.0, shards=1)
        async with running_assembler(url, block_ms=20, done_shards=1, receipt_shards=1):

            async def drained() -> bool:
                return not await client.xlen("stg:done:0")

            await until(drained, "the assembler did not take in the done events within 20 s", timeout_s=20)
    return staged


async def _idle_past(client: aioredis.Redis, token: str, idle_ms: int) -> bool:
    stream, _, entry_id = token.rpartition("#")
    [pending] = await client.xpending_range(stream, TRAINER_GROUP, min=entry_id, max=entry_id, count=1)
    return int(pending["time_since_delivered"]) > idle_ms


@pytest.mark.anyio
async def test_an_ack_after_a_lost_lease_reports_it_and_the_new_owner_counts_a_double_delivery(
    redis_url: str,
) -> None:
    [staged] = await _prepared(redis_url, ["leased"])
    fast: dict[str, Any] = {"receipt_shards": 1, "claim_idle_ms": 200}
    async with (
        RolloutReader.from_url(redis_url, consumer_name="rank-slow", **fast) as slow,
        RolloutReader.from_url(redis_url, consumer_name="rank-fast", **fast) as fast_rank,
    ):
        [first] = await pull_until(slow, 1)
        assert first.trainable
        # The slow rank stalls past claim_idle_ms (no pull, no heartbeat): wait until the server says so.
        async with aioredis.Redis.from_url(redis_url) as client:
            await until(
                lambda: _idle_past(client, slow.entry_token("leased"), fast["claim_idle_ms"]),
                "the server never saw the slow rank's entry idle past claim_idle_ms",
                timeout_s=30,
            )
        [second] = await pull_until(fast_rank, 1)
        assert second.rollout_id == "leased" and second.trainable
        assert fast_rank.statistics().double_deliveries == 1
        outcome = await slow.ack(["leased"])
        assert outcome.lost_lease == ["leased"] and outcome.removed == [] and outcome.absent == []
        assert slow.statistics().lost == 1 and slow.held_rollouts == ()
        async with aioredis.Redis.from_url(redis_url) as client:
            # The slow rank's ack touched nothing: the new owner's records and ledger are intact.
            assert await client.exists(record_key("stg", staged.staging_keys[0])) == 1
        finished_ack = await fast_rank.ack(["leased"])
        assert finished_ack.removed == ["leased"] and finished_ack.lost_lease == []
        assert fast_rank.statistics().double_deliveries == 1 and fast_rank.statistics().lost == 0


def _trainer(url: str, *args: str) -> AbstractContextManager[Command]:
    return staging_sink("trainer", "--redis-url", url, "--shards", "1", *args)


READY = r"^trainer \S+ on .*Ctrl-C stops it"


@pytest.mark.slow
def test_the_trainer_command_rides_through_a_server_restart(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    anyio.run(_prepared, url, ["before"])
    with _trainer(url, "--max-rollouts", "2", "--timeout-s", "60", "--max-outage-s", "30") as command:
        command.wait_for("before", "stdout")
        fresh_server.kill()
        command.wait_for(r"unreachable while running.*retrying")  # a real outage: a failed pull, ridden out
        fresh_server.restart()
        anyio.run(_prepared, url, ["after"])
        command.wait_for("after", "stdout")
        assert command.wait(timeout_s=30) == 0, command.lines("stderr")


def test_the_trainer_command_gives_up_after_the_configured_outage(fresh_server: DurableServer) -> None:
    with _trainer(fresh_server.url, "--max-outage-s", "2") as command:
        command.wait_for(READY)  # pulling now (it used to sleep 1 s and hope it was)
        started = time.monotonic()  # before the kill: the trainer's outage cannot begin earlier
        fresh_server.kill()
        code = command.wait(timeout_s=60)  # it gives up (with no limit it would wait for the server forever)
        elapsed = time.monotonic() - started
        stderr = "\n".join(command.lines("stderr"))
    assert code == 3, stderr
    assert elapsed >= 2.0, (elapsed, stderr)  # never before the limit (the wall time after it depends on the load)
    assert "max_outage_s=2" in stderr or "2.0 s" in stderr, stderr
