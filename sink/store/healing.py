"""Self-healing consumer groups.

A consumer group lives inside its stream: ``FLUSHALL``/``FLUSHDB``, deleting the stream, or restarting from an
AOF or RDB older than the group removes it, and every ``XREADGROUP``/``XAUTOCLAIM``/``XPENDING`` then fails
with ``NOGROUP``. :class:`SelfHealingGroupConsumer` recreates the group (``XGROUP CREATE ... 0 MKSTREAM``, so
every event still in the stream is delivered: at least once, as before), logs one warning per recreation, and
retries the command once. A recreation that meets a topology change (``MOVED``, ``ASK``, ``READONLY``,
``TRYAGAIN``, ``CLUSTERDOWN``: the stream's slot moved, or its primary stepped down and ended a blocked read with
``UNBLOCKED``) is an outage, not a refusal: the slot map is reloaded and the service tries again.

Which failures a service waits out and which stop it is :mod:`sink.service`'s outage policy.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import redis.exceptions as redis_errors

from sink.errors import StagingConnectionError, StagingRefusedError, UnrecoverableServiceError
from sink.store.cluster_mode import resolve_cluster_mode, server_cluster_enabled
from sink.store.connection import describe_redis_error, is_topology_reply
from sink.store.streams import GroupConsumer, StreamEntry

__all__ = ("SelfHealingGroupConsumer", "is_missing_group")

logger = logging.getLogger(__name__)

T = TypeVar("T")

# NOGROUP: the group is gone. UNBLOCKED (Redis 7.0): the stream, and so its group, was deleted under a blocked
# XREADGROUP.
_GROUP_GONE = frozenset({"NOGROUP", "UNBLOCKED"})


def is_missing_group(exc: BaseException) -> bool:
    """Whether *exc* (a translated error, or a group of them) is the server's reply that the consumer group is
    gone (``NOGROUP``, or ``UNBLOCKED``: its stream was deleted under a blocked read), and only that."""
    if isinstance(exc, BaseExceptionGroup):
        return bool(exc.exceptions) and all(is_missing_group(inner) for inner in exc.exceptions)
    return isinstance(exc, StagingRefusedError) and exc.code in _GROUP_GONE


class SelfHealingGroupConsumer(GroupConsumer):
    """A :class:`GroupConsumer` that recreates its missing consumer group (see the module) and checks,
    on :meth:`prepare`, that the server's cluster mode matches the topology's.

    ``groups_recreated`` counts streams whose group was recreated.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups_recreated = 0
        self._recreating = anyio.Lock()  # shard loops that meet NOGROUP together recreate (and log) once

    async def prepare(self) -> None:
        """Check the cluster mode, then :meth:`GroupConsumer.prepare`.

        :raises ClusterModeMismatchError: a cluster topology on a standalone server, or the reverse.
        """
        topology = self._topology
        if topology.is_cluster:
            await super().prepare()  # Topology.initialize refuses a standalone server
            return
        async with topology.translated("read the server's cluster mode"):
            try:
                enabled = await server_cluster_enabled(topology.primaries()[0])
            except redis_errors.NoPermissionError:
                enabled = False  # a custom ACL denies INFO and CLUSTER INFO: cannot tell, do not refuse
        resolve_cluster_mode(False, enabled, "the server")
        await super().prepare()

    async def _healing(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except (StagingConnectionError, BaseExceptionGroup) as exc:
            if not is_missing_group(exc):
                raise
        await self._recreate_groups()
        return await call()

    async def _recreate_groups(self) -> None:
        async with self._recreating:
            await self._recreate_missing()

    async def _recreate_missing(self) -> None:
        created: list[str] = []
        async with self._topology.translated(f"recreate consumer group {self.group!r}"):
            for shard, stream in enumerate(self.streams):
                try:
                    await self._client(shard).xgroup_create(stream, self.group, id="0", mkstream=True)
                except redis_errors.ResponseError as exc:
                    if is_topology_reply(exc):
                        raise  # the stream's slot moved (a failover, a migration): an outage, retried
                    if "BUSYGROUP" not in str(exc):
                        raise UnrecoverableServiceError(
                            f"cannot recreate consumer group {self.group!r} on {stream}: {describe_redis_error(exc)}"
                        ) from exc
                    continue
                created.append(stream)
        self._claim_cursor = ["0-0"] * len(self.streams)
        self.groups_recreated += len(created)
        if created:
            logger.warning(
                "consumer group %r was missing on %s (the server was flushed, or restored from an older AOF/RDB): "
                "recreated it; entries still in the stream are delivered again",
                self.group,
                ", ".join(created),
            )

    async def read_new(self, shards: Sequence[int], *, count: int, block_ms: int | None) -> list[StreamEntry]:
        return await self._healing(partial(GroupConsumer.read_new, self, shards, count=count, block_ms=block_ms))

    async def read_own_pending(self, shard: int, *, count: int = 256) -> list[StreamEntry]:
        return await self._healing(partial(GroupConsumer.read_own_pending, self, shard, count=count))

    async def reclaim(self, shard: int, *, count: int, full_pass: bool = True) -> list[StreamEntry]:
        return await self._healing(partial(GroupConsumer.reclaim, self, shard, count=count, full_pass=full_pass))

    async def touch(self, entries: Sequence[StreamEntry]) -> list[StreamEntry]:
        return await self._healing(partial(GroupConsumer.touch, self, entries))

    async def pending_count(self) -> int:
        return await self._healing(partial(GroupConsumer.pending_count, self))
