"""Every role's acknowledged write is durable, or refused loudly (real Valkey 8 and Redis 7.0 servers).

The gate's ledger rows and ``finished`` events, the assembler's receipts and the trainer's acknowledgements
are each checked in their own round trip (``WAITAOF`` where the server has it, the persistence settings read
back), and so is the close of a delivered GRPO group's record: on a server with ``appendfsync everysec`` or ``appendonly no`` they raise :class:`NotDurableError`
instead of answering success, and nothing downstream treats them as done.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import NotDurableError, StagingConnectionError
from sink.keys import done_stream, group_keys, receipts_stream, shard_of
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import ASSEMBLER_GROUP
from sink.rollout.done_event import finished
from sink.settings import DEFAULT_SHARDS
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.e2e import pull_until, running_assembler, stage_rollouts
from tests.helpers.group_members import publish_members
from tests.helpers.ledger import root_commit
from tests.helpers.processes import until
from tests.helpers.trainer import wait_published

pytestmark = pytest.mark.anyio

NS = "stg"
NOT_DURABLE = pytest.mark.parametrize(
    ("name", "value"), [("appendfsync", "everysec"), ("appendonly", "no")], ids=["everysec", "appendonly-no"]
)


async def _break_durability(url: str, name: str, value: str) -> None:
    """Make the session server non-durable (the ``redis_url`` fixture restores it for the next test)."""
    async with aioredis.Redis.from_url(url) as client:
        await client.config_set(name, value)


async def _restore_durability(url: str, name: str) -> None:
    """Undo :func:`_break_durability`, and wait until the AOF turned back on is written (a server refuses to
    shut down while it writes its first AOF)."""
    async with aioredis.Redis.from_url(url) as client:
        await client.config_set(name, "always" if name == "appendfsync" else "yes")

        async def rewritten() -> bool:
            info = await client.info("persistence")
            return not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled")

        await until(rewritten, f"the AOF rewrite after turning {name} back on did not end within 30 s", timeout_s=30)


async def _receipt_entries(client: aioredis.Redis) -> int:
    streams = [receipts_stream(NS, shard) for shard in range(DEFAULT_SHARDS)]
    return sum([int(await client.xlen(stream)) for stream in streams if await client.exists(stream)])


@NOT_DURABLE
async def test_a_ledger_row_on_a_non_durable_server_is_refused(redis_url: str, name: str, value: str) -> None:
    await _break_durability(redis_url, name, value)
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        with pytest.raises(NotDurableError, match=f"not durable: .*{name}={value!r}"):
            await ledger.record(root_commit())
        with pytest.raises(NotDurableError, match="not durable"):
            await ledger.retire(["r-any"])


@NOT_DURABLE
async def test_a_finished_event_on_a_non_durable_server_is_refused(redis_url: str, name: str, value: str) -> None:
    await _break_durability(redis_url, name, value)
    async with aioredis.Redis.from_url(redis_url) as client:
        with pytest.raises(NotDurableError, match=f"announce that rollout 'r1' finished durably: .*{name}"):
            await finished(client, "r1", reward=1.0)
        # durability="none" is the explicit opt-out (benchmarks, throwaway runs).
        assert await finished(client, "r2", reward=1.0, durability="none")


async def test_a_not_durable_error_is_a_connection_error_that_names_the_server(redis_url: str) -> None:
    await _break_durability(redis_url, "appendfsync", "everysec")
    async with aioredis.Redis.from_url(redis_url) as client:
        with pytest.raises(StagingConnectionError) as caught:
            await finished(client, "r1", reward=1.0)
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    assert isinstance(caught.value, NotDurableError) and f":{port} is not durable" in str(caught.value)


@NOT_DURABLE
async def test_the_assembler_stores_no_receipt_on_a_non_durable_server(redis_url: str, name: str, value: str) -> None:
    (staged,) = await stage_rollouts(redis_url, ["r-asm"])
    async with aioredis.Redis.from_url(redis_url) as client:
        await finished(client, staged.rollout_id, reward=1.0)
        await _break_durability(redis_url, name, value)
        # A short shutdown grace: on leaving the block the event is still retrying its refused write.
        async with running_assembler(redis_url, shutdown_grace_s=0.2) as assembler:
            await until(
                lambda: assembler.statistics().failures >= 1,
                "the assembler never failed a write on the non-durable server",
                timeout_s=20,
            )
        assert await _receipt_entries(client) == 0  # nothing published
        stream = done_stream(NS, shard_of(staged.rollout_id, DEFAULT_SHARDS))
        pending = await client.xpending(stream, ASSEMBLER_GROUP)
        assert pending["pending"] == 1  # the done event is not acknowledged: retried once durable


@NOT_DURABLE
async def test_a_refused_sweep_of_open_groups_leaves_the_assembler_running_and_the_next_sweep_seals(
    redis_url: str, name: str, value: str
) -> None:
    await publish_members(redis_url, {"sw-0": ("swept", 2)})  # an open group: its second member never comes
    await _break_durability(redis_url, name, value)
    async with running_assembler(redis_url, block_ms=50, group_timeout_s=0.1, shutdown_grace_s=0.2) as assembler:
        await until(lambda: assembler.statistics().failures >= 1, "the seal was never refused", timeout_s=20)
        await _restore_durability(redis_url, name)  # the assembler runs on: its next sweep seals the group
        await wait_published(redis_url, ["swept"])
        await until(lambda: assembler.statistics().groups_waiting == 0, "the sealed group is still indexed")


@asynccontextmanager
async def _pulled(url: str) -> AsyncIterator[tuple[RolloutReader, str]]:
    (staged,) = await stage_rollouts(url, ["r-ack"])
    async with aioredis.Redis.from_url(url) as client:
        await finished(client, staged.rollout_id, reward=1.0)
    async with running_assembler(url), RolloutReader.from_url(url) as reader:
        (pulled,) = await pull_until(reader, 1)
        yield reader, pulled.rollout_id


@NOT_DURABLE
async def test_the_trainers_ack_on_a_non_durable_server_is_refused_and_safe_to_retry(
    redis_url: str, name: str, value: str
) -> None:
    async with _pulled(redis_url) as (reader, rollout_id):
        await _break_durability(redis_url, name, value)
        with pytest.raises(NotDurableError, match="not durable"):
            await reader.ack([rollout_id])
        assert await reader.pending() == 1  # the receipt entry is still pending
        await _restore_durability(redis_url, name)
        outcome = await reader.ack([rollout_id])  # retrying once durable finishes the ack
        assert await reader.pending() == 0 and outcome.lost_lease == []


@NOT_DURABLE
async def test_acknowledging_a_delivered_group_on_a_non_durable_server_is_refused_and_safe_to_retry(
    redis_url: str, name: str, value: str
) -> None:
    (staged,) = await stage_rollouts(redis_url, ["r-grp"])
    async with aioredis.Redis.from_url(redis_url) as client:
        await finished(client, staged.rollout_id, reward=1.0, group_id="g-ack", group_size=1)
        async with running_assembler(redis_url), RolloutReader.from_url(redis_url) as reader:
            groups = GroupReader(reader)
            delivered: list[RolloutGroup] = []
            with anyio.fail_after(20):
                while not delivered:
                    delivered = await groups.pull_groups(1, block_ms=100)
            # The group's close goes with its last member's acknowledgement: refused with it, and retried with it.
            meta, _members = group_keys(NS, "g-ack")
            await _break_durability(redis_url, name, value)
            with pytest.raises(NotDurableError, match="durably: .*not durable"):
                await groups.ack_groups(delivered)
            assert await reader.pending() == 1 and reader.holds(staged.rollout_id)
            await _restore_durability(redis_url, name)
            await groups.ack_groups(delivered)  # retrying once durable closes it
            assert await reader.pending() == 0
            assert await client.hget(meta, "closed") == b"1"
