"""Trainer-side helpers: stage rollouts, finish them (optionally in GRPO groups) and publish their receipts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import redis.asyncio as aioredis

from sink.keys import DEFAULT_NAMESPACE
from sink.rollout.assembler import finished
from sink.settings import DEFAULT_SHARDS
from tests.helpers.e2e import EventCounter, StagedRollout, running_assembler, stage_rollouts

__all__ = ("publish", "publish_groups", "publish_staged")


async def publish(
    url: str,
    rollout_ids: Sequence[str],
    *,
    rewards: Mapping[str, float] | None = None,
    groups: Mapping[str, tuple[str, int]] | None = None,
    receipt_shards: int = DEFAULT_SHARDS,
    namespace: str = DEFAULT_NAMESPACE,
    **stage: Any,
) -> dict[str, StagedRollout]:
    """Stage *rollout_ids* (in *namespace*), call ``finished`` for each (reward, group) and run an assembler until
    every receipt is published."""
    staged = await stage_rollouts(url, rollout_ids, namespace=namespace, **stage)
    await publish_staged(
        url, rollout_ids, rewards=rewards, groups=groups, receipt_shards=receipt_shards, namespace=namespace
    )
    return {s.rollout_id: s for s in staged}


async def publish_staged(
    url: str,
    rollout_ids: Sequence[str],
    *,
    rewards: Mapping[str, float] | None = None,
    groups: Mapping[str, tuple[str, int]] | None = None,
    receipt_shards: int = DEFAULT_SHARDS,
    namespace: str = DEFAULT_NAMESPACE,
) -> None:
    """Call ``finished`` for rollouts staged already (reward, group) and run an assembler until every receipt is
    published."""
    published = EventCounter(len(rollout_ids))
    async with aioredis.Redis.from_url(url) as client:
        for rollout_id in rollout_ids:
            group_id, group_size = (groups or {}).get(rollout_id, (None, None))
            await finished(
                client,
                rollout_id,
                reward=(rewards or {}).get(rollout_id, 1.0),
                group_id=group_id,
                group_size=group_size,
                namespace=namespace,
            )
    async with running_assembler(
        url, before_ack=published, block_ms=50, receipt_shards=receipt_shards, namespace=namespace
    ):
        with anyio.fail_after(30):
            await published.reached.wait()


async def publish_groups(
    url: str, groups: Mapping[str, Sequence[str]], *, size: int | None = None, receipt_shards: int = DEFAULT_SHARDS
) -> None:
    """Publish every member of *groups* (group id -> rollout ids), each with reward = its index in the group."""
    members = {rollout_id: (group_id, size or len(ids)) for group_id, ids in groups.items() for rollout_id in ids}
    rewards = {rollout_id: float(i) for ids in groups.values() for i, rollout_id in enumerate(ids)}
    await publish(url, list(members), rewards=rewards, groups=members, calls=2, receipt_shards=receipt_shards)
