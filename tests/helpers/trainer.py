"""Trainer-side helpers: stage rollouts, finish them (optionally in GRPO groups) and publish their receipts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio
import redis.asyncio as aioredis

from sink.keys import DEFAULT_NAMESPACE, group_keys
from sink.rollout.assembler import finished
from sink.settings import DEFAULT_SHARDS
from tests.helpers.e2e import EventCounter, StagedRollout, running_assembler, stage_rollouts
from tests.helpers.processes import until

__all__ = ("publish", "publish_groups", "publish_staged", "seal_groups", "wait_published")


async def publish(
    url: str,
    rollout_ids: Sequence[str],
    *,
    rewards: Mapping[str, float] | None = None,
    groups: Mapping[str, tuple[str, int]] | None = None,
    receipt_shards: int = DEFAULT_SHARDS,
    namespace: str = DEFAULT_NAMESPACE,
    group_timeout_s: float | None = None,
    **stage: Any,
) -> dict[str, StagedRollout]:
    """Stage *rollout_ids* (in *namespace*), call ``finished`` for each (reward, group) and run an assembler until
    every receipt is published (see :func:`publish_staged` for *group_timeout_s*)."""
    staged = await stage_rollouts(url, rollout_ids, namespace=namespace, **stage)
    await publish_staged(
        url,
        rollout_ids,
        rewards=rewards,
        groups=groups,
        receipt_shards=receipt_shards,
        namespace=namespace,
        group_timeout_s=group_timeout_s,
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
    group_timeout_s: float | None = None,
) -> None:
    """Call ``finished`` for rollouts staged already (reward, group) and run an assembler until every receipt is
    published: a rollout without a group, a late member, a group completed (its entry is published before the
    completing member's event is acknowledged); with *group_timeout_s* (the assembler's), also until every group of
    these rollouts is published (sealed when incomplete). Without it an incomplete group stays open (600 s)."""
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
    if group_timeout_s is not None:
        group_ids = {group_id for group_id, _size in (groups or {}).values()}
        await seal_groups(url, group_ids, group_timeout_s, receipt_shards=receipt_shards, namespace=namespace)


async def seal_groups(
    url: str,
    group_ids: Iterable[str],
    group_timeout_s: float,
    *,
    receipt_shards: int = DEFAULT_SHARDS,
    namespace: str = DEFAULT_NAMESPACE,
) -> None:
    """Run an assembler with *group_timeout_s* until every group of *group_ids* is published (sealed if still
    open). Members are recorded before (with the default timeout), so a sweep never seals a group between them."""
    async with running_assembler(
        url, block_ms=50, receipt_shards=receipt_shards, namespace=namespace, group_timeout_s=group_timeout_s
    ):
        await wait_published(url, group_ids, namespace=namespace)


async def wait_published(url: str, group_ids: Iterable[str], *, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Wait until the entry of every group of *group_ids* is published (an assembler runs meanwhile)."""
    async with aioredis.Redis.from_url(url) as client:
        for group_id in group_ids:
            meta = group_keys(namespace, group_id)[0]
            await until(partial(client.hexists, meta, "published"), f"{group_id!r} never published", timeout_s=20)


async def publish_groups(
    url: str,
    groups: Mapping[str, Sequence[str]],
    *,
    size: int | None = None,
    receipt_shards: int = DEFAULT_SHARDS,
    group_timeout_s: float | None = None,
) -> None:
    """Publish every member of *groups* (group id -> rollout ids), each with reward = its index in the group (an
    incomplete group: sealed with *group_timeout_s*, see :func:`publish_staged`)."""
    members = {rollout_id: (group_id, size or len(ids)) for group_id, ids in groups.items() for rollout_id in ids}
    rewards = {rollout_id: float(i) for ids in groups.values() for i, rollout_id in enumerate(ids)}
    await publish(
        url,
        list(members),
        rewards=rewards,
        groups=members,
        calls=2,
        receipt_shards=receipt_shards,
        group_timeout_s=group_timeout_s,
    )
