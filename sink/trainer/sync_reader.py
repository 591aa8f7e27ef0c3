"""The synchronous trainer reader: :class:`RolloutReader`'s semantics for loops that are not async.

:class:`SyncRolloutReader` runs a :class:`~sink.trainer.reader.RolloutReader` on a
private event-loop thread (the :class:`~sink.store.resource.PortalOwner`
facade, like :class:`~sink.store.sink.RedisStagingSink`). Every method is
thread-safe: calls from several threads are serialized on the loop, one at a
time, so a heartbeat thread can run beside the training loop.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Self, TypeVar

from sink.settings import ReaderSettings
from sink.store.resource import PortalOwner
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader import RolloutReader
from sink.trainer.reader_guards import AckOutcome
from sink.trainer.statistics import ReaderStatistics

__all__ = ("SyncRolloutReader",)

T = TypeVar("T")


class SyncRolloutReader(PortalOwner[RolloutReader]):
    """Synchronous, thread-safe :class:`~sink.trainer.reader.RolloutReader`: ``pull``, ``heartbeat``, ``ack``,
    ``statistics``, and :meth:`pull_groups` (GRPO groups, see :mod:`sink.trainer.groups`).

    Open with :meth:`from_url`; close with :meth:`close` or a ``with`` block.
    Rollouts still held at close stay pending (reclaimable), as with the async reader.
    """

    def __init__(self, resource: RolloutReader) -> None:
        super().__init__(resource)
        # One reader call at a time: the reader's bookkeeping is not re-entrant across awaits.
        self._serial = threading.Lock()
        self._groups: GroupReader | None = None

    @classmethod
    def from_url(cls, url: str, settings: ReaderSettings | None = None, **fields: Any) -> Self:
        """Open a reader on *url*; the arguments are :meth:`RolloutReader.from_url`'s."""
        return cls(RolloutReader.from_url(url, settings, **fields))

    def _serialized(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        with self._serial:
            return self._call(func, *args)

    @property
    def consumer_name(self) -> str:
        return self._resource.consumer_name

    @property
    def held_rollouts(self) -> tuple[str, ...]:
        return self._resource.held_rollouts

    def pull(self, max_rollouts: int, *, block_ms: int = 0) -> list[PulledRollout]:
        """Thread-safe :meth:`RolloutReader.pull`."""

        async def run() -> list[PulledRollout]:
            return await self._resource.pull(max_rollouts, block_ms=block_ms)

        return self._serialized(run)

    def pull_groups(self, max_groups: int, *, block_ms: int = 0) -> list[RolloutGroup]:
        """Thread-safe :meth:`sink.trainer.groups.GroupReader.pull_groups` over this reader."""
        with self._serial:
            if self._groups is None:
                self._groups = GroupReader(self._resource)
            groups = self._groups

            async def run() -> list[RolloutGroup]:
                return await groups.pull_groups(max_groups, block_ms=block_ms)

            return self._call(run)

    def ack_groups(self, groups: Iterable[RolloutGroup]) -> None:
        """Thread-safe :meth:`sink.trainer.groups.GroupReader.ack_groups`: acknowledge delivered groups after the step."""
        delivered = list(groups)
        with self._serial:
            if self._groups is None:
                self._groups = GroupReader(self._resource)
            self._call(self._groups.ack_groups, delivered)

    def heartbeat(self) -> int:
        """Thread-safe :meth:`RolloutReader.heartbeat`."""
        return self._serialized(self._resource.heartbeat)

    def ack(self, rollout_ids: Iterable[str]) -> AckOutcome:
        """Thread-safe :meth:`RolloutReader.ack`."""
        if isinstance(rollout_ids, str | bytes):
            raise TypeError("ack() takes a collection of rollout ids, not a single str")
        ids = list(rollout_ids)
        return self._serialized(self._resource.ack, ids)

    def set_weight_version(self, version: int) -> None:
        """Thread-safe :meth:`RolloutReader.set_weight_version`."""
        with self._serial:
            self._resource.set_weight_version(version)

    def pending(self) -> int:
        """Thread-safe :meth:`RolloutReader.pending`."""
        return self._serialized(self._resource.pending)

    def retire_consumer(self) -> int:
        """Thread-safe :meth:`RolloutReader.retire_consumer`."""
        return self._serialized(self._resource.retire_consumer)

    def statistics(self) -> ReaderStatistics:
        with self._serial:
            return self._resource.statistics()

    def __repr__(self) -> str:
        return repr(self._resource).replace("<RolloutReader", "<SyncRolloutReader", 1)
