"""GRPO group members for the group tests: finished with any reward (``None`` too) and, optionally, a failure
the worker recorded on the rollout's ledger (a ``rollout_failed`` skip carrying that reason)."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import redis.asyncio as aioredis

from sink.keys import DEFAULT_NAMESPACE, record_key
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import finished
from sink.trainer.groups import GroupReader, RolloutGroup
from tests.helpers.e2e import EventCounter, running_assembler, stage_rollouts
from tests.helpers.trainer import seal_groups

__all__ = ("lose_root_records", "publish_members", "pull_until_settled")


async def publish_members(
    url: str,
    members: Mapping[str, tuple[str, int] | None],
    *,
    rewards: Mapping[str, float | None] | None = None,
    failures: Mapping[str, str] | None = None,
    calls: int = 2,
    group_timeout_s: float | None = None,
    recorded_with_timeout_s: float | None = None,
) -> None:
    """Stage *members* (rollout id -> ``(group_id, group_size)`` or ``None`` for no group), record *failures*
    (rollout id -> reason) on their ledgers, finish each with its reward (default 1.0) and publish the receipts on
    one receipts stream (``receipt_shards=1``). The assembler may publish them in any order: to order receipts on
    the stream, publish them in separate calls. With *group_timeout_s* (the assembler's), also wait until every
    group is published (sealed when incomplete, after every member was recorded); *recorded_with_timeout_s*: the
    ``group_timeout_s`` of the assembler that records them (default 600)."""
    staged = await stage_rollouts(url, list(members), calls=calls)
    if failures:
        async with RedisCaptureLedger.from_url(url) as ledger:
            for rollout_id, reason in failures.items():
                await ledger.record_failure(rollout_id, "c9", reason)
    published = EventCounter(len(staged))
    async with aioredis.Redis.from_url(url) as client:
        for rollout_id, group in members.items():
            await finished(
                client,
                rollout_id,
                reward=(rewards or {}).get(rollout_id, 1.0),
                group_id=group[0] if group else None,
                group_size=group[1] if group else None,
            )
    recording = {} if recorded_with_timeout_s is None else {"group_timeout_s": recorded_with_timeout_s}
    async with running_assembler(url, before_ack=published, block_ms=50, receipt_shards=1, **recording):
        with anyio.fail_after(30):
            await published.reached.wait()
    if group_timeout_s is not None:
        await seal_groups(url, {group[0] for group in members.values() if group}, group_timeout_s, receipt_shards=1)


async def lose_root_records(url: str, rollout_ids: list[str]) -> None:
    """Delete each rollout's root record: the reader reports it skipped with ``missing_record``."""
    async with aioredis.Redis.from_url(url) as client:
        keys = [record_key(DEFAULT_NAMESPACE, f"{rollout_id}/c0") for rollout_id in rollout_ids]
        assert await client.delete(*keys) == len(keys)


async def pull_until_settled(groups: GroupReader, pulled: int, *, timeout_s: float = 20.0) -> list[RolloutGroup]:
    """Pull until *pulled* rollouts came in (whole group entries: every group they belong to is settled)."""
    delivered: list[RolloutGroup] = []
    with anyio.fail_after(timeout_s):
        while groups.reader.statistics().pulled < pulled:
            delivered += await groups.pull_groups(4, block_ms=50)
    return delivered
