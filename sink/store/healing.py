"""Self-healing consumer groups, and the line between a failure worth retrying and one that is not.

A consumer group lives inside its stream: ``FLUSHALL``/``FLUSHDB``, deleting the stream, or restarting from an
AOF or RDB older than the group removes it, and every ``XREADGROUP``/``XAUTOCLAIM``/``XPENDING`` then fails
with ``NOGROUP``. :class:`SelfHealingGroupConsumer` recreates the group (``XGROUP CREATE ... 0 MKSTREAM``, so
every event still in the stream is delivered: at least once, as before), logs one warning per recreation, and
retries the command once.

:func:`raise_if_unrecoverable` is for a service's retry loop: an error that waiting cannot fix (the ACL denies
a command, a wrong password, a key of the wrong type) ends the service with
:class:`~sink.errors.UnrecoverableServiceError` instead of a retry line forever.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import redis.exceptions as redis_errors

from sink.errors import StagingConnectionError, UnrecoverableServiceError
from sink.store.cluster_mode import resolve_cluster_mode, server_cluster_enabled
from sink.store.connection import describe_redis_error, map_redis_errors
from sink.store.streams import GroupConsumer, StreamEntry

__all__ = ("SelfHealingGroupConsumer", "is_missing_group", "raise_if_unrecoverable")

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FATAL_PREFIXES = ("NOPERM", "WRONGTYPE", "WRONGPASS", "NOAUTH", "ERR UNKNOWN COMMAND")


def _causes(exc: BaseException) -> list[BaseException]:
    """*exc*, its ``__cause__`` chain, and the same for every leaf of an exception group."""
    found: list[BaseException] = []
    pending = [exc]
    while pending:
        current: BaseException | None = pending.pop()
        while current is not None:
            if isinstance(current, BaseExceptionGroup):
                pending.extend(current.exceptions)
                break
            found.append(current)
            current = current.__cause__
    return found


def is_missing_group(exc: BaseException) -> bool:
    """Whether *exc* (a translated error, or a group of them) is a server's ``NOGROUP`` reply, and only that."""
    leaves = [c for c in _causes(exc) if isinstance(c, redis_errors.ResponseError)]
    return bool(leaves) and all(str(c).startswith("NOGROUP") for c in leaves)


def raise_if_unrecoverable(exc: BaseException, service: str) -> None:
    """Re-raise *exc* as :class:`UnrecoverableServiceError` when retrying cannot fix it; return otherwise.

    :param service: who failed, for the message (``"assembler host-1-abc"``).
    """
    for cause in _causes(exc):
        text = str(cause).upper()
        if isinstance(cause, redis_errors.AuthenticationError | redis_errors.NoPermissionError) or (
            isinstance(cause, redis_errors.ResponseError) and text.startswith(_FATAL_PREFIXES)
        ):
            raise UnrecoverableServiceError(
                f"{service} stopped: {exc} (retrying cannot fix this: check the ACL user, the password and "
                "that nothing else writes the namespace's keys)"
            ) from exc


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
        with map_redis_errors("read the server's cluster mode"):
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
        with map_redis_errors(f"recreate consumer group {self.group!r}"):
            for shard, stream in enumerate(self.streams):
                try:
                    await self._client(shard).xgroup_create(stream, self.group, id="0", mkstream=True)
                except redis_errors.ResponseError as exc:
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

    async def reclaim(self, shard: int, *, count: int) -> list[StreamEntry]:
        return await self._healing(partial(GroupConsumer.reclaim, self, shard, count=count))

    async def touch(self, entries: Sequence[StreamEntry]) -> list[StreamEntry]:
        return await self._healing(partial(GroupConsumer.touch, self, entries))

    async def pending_count(self) -> int:
        return await self._healing(partial(GroupConsumer.pending_count, self))
