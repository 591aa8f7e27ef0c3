"""The storage protocols the worker and the framework program against (contract §5.1).

The synchronous pair is the reference's contract for inference servers whose
hooks are synchronous; the async pair is what our anyio core implements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from sink.contract.packed_record import StageableRecord
from sink.contract.records import StagedCallSnapshot, StageResult

__all__ = ("AsyncStagingSink", "AsyncStagingSource", "StagingSink", "StagingSource")


@runtime_checkable
class StagingSink(Protocol):
    """Synchronous, thread-safe sink: ``ok=True`` only once the record is durable and fetchable.

    ``stage`` takes either form of a staged call: the seed's ``StagedCallRecord`` or the
    :class:`~sink.contract.packed_record.PackedCallRecord` the worker builds.
    """

    def stage(self, record: StageableRecord) -> StageResult: ...


@runtime_checkable
class StagingSource(Protocol):
    """Synchronous source: one validated snapshot per key, in request order; ``KeyError`` on any miss."""

    def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]: ...


@runtime_checkable
class AsyncStagingSink(Protocol):
    """Async twin of :class:`StagingSink`."""

    async def stage(self, record: StageableRecord) -> StageResult: ...


@runtime_checkable
class AsyncStagingSource(Protocol):
    """Async twin of :class:`StagingSource`."""

    async def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]: ...
