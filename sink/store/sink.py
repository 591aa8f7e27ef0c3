"""The durable Redis/Valkey staging sink (contract §11.2, §11.3).

``stage(record)`` returns ``StageResult(ok=True)`` only after the server
acknowledged the write under ``appendfsync always`` (verified, not assumed)
and, if ``min_replicas > 0``, after ``WAIT`` on the same connection counted
enough replicas. Operational failures come back as ``ok=False`` with a precise
error; only programming errors (a wrong argument type, a closed sink) raise.

``stage`` takes either form of a staged call (the model or the worker's
:class:`~sink.contract.packed_record.PackedCallRecord`, which skips pydantic) and
queues its encoded record for the group commit
(:mod:`sink.store.commit`), which settles each one here. :func:`clear_staged`
deletes what was staged once a rollout has been consumed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream
from redis.asyncio.cluster import RedisCluster

from sink.contract.codec import encode_record
from sink.contract.packed_record import StageableRecord, require_stageable, verified_record
from sink.contract.record_schema import calls_entry
from sink.contract.records import StageResult
from sink.errors import CodecError
from sink.keys import (
    calls_stream,
    check_call_id,
    fence_key,
    incoming_key,
    record_key,
    rollout_of_staging_key,
    validate_rollout_id,
)
from sink.settings import SinkSettings
from sink.store.batch import BatchCall, raise_first_error, run_batch
from sink.store.commit import STAGE_BATCH, FollowUp, GroupCommitWriter, PendingStage
from sink.store.connection import Topology, connect, describe_redis_error
from sink.store.durability import DurabilityMonitor
from sink.store.pipeline_counters import StageOutcome, count_stage, count_staged_bytes
from sink.store.resource import AsyncResource, PortalOwner, settings_or_fields
from sink.store.scripts import CLEAR_SCRIPT, StageStatus

__all__ = (
    "CONFLICT_ERROR",
    "RETIRED_ERROR",
    "AsyncRedisStagingSink",
    "RedisStagingSink",
    "SinkStatistics",
    "clear_staged",
    "generation_prefix_suffix",
    "verified_record",
)

logger = logging.getLogger(__name__)

CONFLICT_ERROR = "conflicting staged record"
"""``StageResult.error`` when the key already holds a record with another digest (nothing was written)."""
RETIRED_ERROR = "the rollout is retired (its ledger fence is set): a late stage is refused; nothing was written"
"""``StageResult.error`` for a stage of a rollout that was consumed or retired (contract §6.9)."""
_WRONG_TYPE_ERROR = "a key of this rollout holds a value of the wrong type; nothing was written"


def _stage_status(reply: Any) -> StageStatus:
    """The stage script's status for one record (a number it never returns reads as the wrong-type refusal)."""
    try:
        return StageStatus(int(reply))
    except ValueError:
        return StageStatus.WRONG_TYPE


def generation_prefix_suffix(checkpoint_id: str, chunk_sequence: int) -> str:
    """The part a generation-cut chunk adds to its call's staging key: ``/cut/<checkpoint_id>/<chunk_sequence>``.

    :raises ValueError: invalid *checkpoint_id* or *chunk_sequence*.
    """
    validate_rollout_id(checkpoint_id)
    if type(chunk_sequence) is not int or chunk_sequence < 0:
        raise ValueError(f"chunk_sequence must be a non-negative int, got {chunk_sequence!r}")
    return f"/cut/{checkpoint_id}/{chunk_sequence}"


def _key_or_none(record: StageableRecord, key_suffix: str) -> str | None:
    try:
        return record.staging_key + key_suffix
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    """Counters of one sink since it was opened."""

    staged: int
    already_present: int
    conflicts: int
    failed: int
    batches: int
    queued: int
    repaired: int = 0
    """Re-stages that found the stored blob corrupt (same digest, other bytes) and rewrote it."""


async def clear_staged(topology: Topology, namespace: str, staging_keys: Sequence[str]) -> int:
    """Delete the records named by *staging_keys* and their ``calls`` entries; return how many existed.

    Each rollout's records and its ``calls`` entries go in one single-slot
    script, so this never leaves a ``calls`` entry pointing at a deleted record; the scripts of every rollout
    go in one pipeline per node (:func:`~sink.store.batch.run_batch`).

    :raises TypeError: *staging_keys* is a single ``str``.
    :raises ValueError: a key was not minted by this sink (``R/...``).
    :raises StagingConnectionError: the server could not be reached.
    """
    if isinstance(staging_keys, str):
        raise TypeError("clear() takes a sequence of staging keys, not a single str")
    by_rollout: dict[str, list[str]] = {}
    for key in dict.fromkeys(staging_keys):
        by_rollout.setdefault(rollout_of_staging_key(key), []).append(key)
    calls = [
        BatchCall([calls_stream(namespace, rollout_id), *(record_key(namespace, k) for k in keys)], keys, CLEAR_SCRIPT)
        for rollout_id, keys in by_rollout.items()
    ]
    async with topology.translated("clear staged records"):
        return sum(int(reply[1]) for reply in raise_first_error(await run_batch(topology, calls)))


class AsyncRedisStagingSink(AsyncResource):
    """Durable, idempotent staging of staged calls into Redis/Valkey.

    A call comes in either form (:data:`~sink.contract.packed_record.StageableRecord`): the seed's
    ``StagedCallRecord`` or the worker's ``PackedCallRecord``; both are stored as the same blob.

    Use as an async context manager::

        async with AsyncRedisStagingSink.from_url(url) as sink:
            result = await sink.stage(record)

    ``from_url`` owns its clients; passing a client to the constructor borrows it.
    """

    def __init__(
        self, client: aioredis.Redis | RedisCluster, settings: SinkSettings | None = None, *, owns_client: bool = False
    ) -> None:
        """*owns_client*: :meth:`aclose` closes *client* (by default the caller keeps it open)."""
        settings = settings or SinkSettings()
        topology = Topology(client, settings, owned=owns_client)
        self._settings = settings
        self._topology = topology
        self._send: MemoryObjectSendStream[PendingStage] | None = None
        self._task_group: TaskGroup | None = None
        self._durability = DurabilityMonitor(topology, settings)
        self._writer = GroupCommitWriter(topology, settings, self._durability, self._settle, STAGE_BATCH)
        self._counts = {"staged": 0, "already_present": 0, "conflicts": 0, "failed": 0, "repaired": 0}
        self._incoming = itertools.count()  # incoming keys unique among this sink's stages (one transaction's)

    @classmethod
    def from_url(cls, url: str, settings: SinkSettings | None = None, **fields: Any) -> Self:
        """Create a sink that owns its connection(s) to *url*; pass *settings* or :class:`SinkSettings` fields.

        :raises pydantic.ValidationError: an unknown or invalid setting.
        """
        parsed = settings_or_fields(SinkSettings, settings, fields)
        return cls(connect(url, parsed), parsed, owns_client=True)

    @property
    def settings(self) -> SinkSettings:
        return self._settings

    def statistics(self) -> SinkStatistics:
        """Counters since open (``queued`` = records waiting for a writer)."""
        queued = self._send.statistics().current_buffer_used if self._send is not None else 0
        return SinkStatistics(queued=queued, batches=self._writer.batches, **self._counts)

    def __repr__(self) -> str:
        c = self._counts
        return (
            f"<AsyncRedisStagingSink staged={c['staged']} present={c['already_present']} "
            f"conflicts={c['conflicts']} failed={c['failed']} batches={self._writer.batches}>"
        )

    # --- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._closed or self._task_group is not None:
            raise RuntimeError("a staging sink can be entered once")
        return await super().__aenter__()

    async def _open(self) -> None:
        try:
            await self._topology.initialize()
        except (redis_errors.RedisError, OSError) as exc:
            # Not fatal: stages fail with this error until the server is reachable.
            logger.warning("staging sink could not load the cluster topology: %s", describe_redis_error(exc))
        await self._durability.report(force=True)
        send, receive = anyio.create_memory_object_stream[PendingStage](self._settings.max_batch_records * 4)
        self._send = send
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        for _ in range(self._settings.writer_connections):
            self._task_group.start_soon(self._writer.run, receive.clone())
        receive.close()

    async def _stop(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop accepting stages and let the writers finish what is queued (stages meanwhile fail as closing)."""
        try:
            # Closing the send side lets the writers drain what is queued, then stop.
            if self._send is not None:
                self._send.close()
            if self._task_group is not None:
                # The group must exit in the scope it was entered in (no shield around it);
                # cancelled writers fail their callers' stages, they never half-write.
                await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._send = None

    async def _close_resources(self) -> None:
        await self._topology.aclose()

    # --- staging ----------------------------------------------------------------

    async def stage(self, record: StageableRecord, *, then: FollowUp | None = None) -> StageResult:
        """Stage *record* (either form) under its default key ``rollout_id/model_call_id``.

        *then*: a write of the record's slot to send right behind the stage, in its round trip and under its durable
        confirmation (:class:`~sink.store.commit.FollowUp`: the capture ledger's row of the call); its outcome is set
        on it before this returns, and never changes the stage's result. A stage refused before it is sent (an
        invalid record, a durability problem, a closing sink) leaves it unsent.

        :returns: ``ok=True`` only once the write is durable (and replicated,
            if required); ``ok=False`` with a precise error otherwise.
        :raises TypeError: *record* is neither a :class:`StagedCallRecord` nor a ``PackedCallRecord``.
        :raises RuntimeError: the sink is not open.
        """
        require_stageable(record, "stage()")
        started = time.perf_counter()
        return self._counted(*await self._stage(record, "", then), started)

    async def stage_generation_prefix(
        self, record: StageableRecord, *, checkpoint_id: str, chunk_sequence: int
    ) -> StageResult:
        """Stage one generation-cut chunk (either form) under ``R/C/cut/<checkpoint_id>/<chunk_sequence>``.

        :raises TypeError: *record* is neither a :class:`StagedCallRecord` nor a ``PackedCallRecord``.
        :raises ValueError: invalid *checkpoint_id* or *chunk_sequence*.
        """
        require_stageable(record, "stage_generation_prefix()")
        started = time.perf_counter()
        return self._counted(
            *await self._stage(record, generation_prefix_suffix(checkpoint_id, chunk_sequence)), started
        )

    def _counted(self, result: StageResult, outcome: StageOutcome, started: float) -> StageResult:
        count_stage(self._settings.namespace, outcome, time.perf_counter() - started)  # stage counters and latency
        return result

    async def _stage(
        self, record: StageableRecord, key_suffix: str, then: FollowUp | None = None
    ) -> tuple[StageResult, StageOutcome]:
        send = self._send  # set to None once closed; a stage already past this point fails as closing
        if send is None:
            raise RuntimeError("the staging sink is not open: use 'async with sink:'")
        try:
            record = verified_record(record)
            check_call_id(record.model_call_id)
            staging_key = record.staging_key + key_suffix
            validate_rollout_id(record.rollout_id)
            blob = encode_record(record)
        except (CodecError, ValueError, TypeError) as exc:
            return self._failed(_key_or_none(record, key_suffix), f"record cannot be staged: {exc}")
        if len(blob) > self._settings.max_record_bytes:
            return self._failed(
                staging_key,
                f"record of {len(blob)} bytes exceeds max_record_bytes={self._settings.max_record_bytes}",
            )
        report = await self._durability.report()
        if report.problem is not None:
            return self._failed(staging_key, report.problem)
        pending = PendingStage(
            staging_key=staging_key,
            record_key=record_key(self._settings.namespace, staging_key),
            calls_key=calls_stream(self._settings.namespace, record.rollout_id),
            fence_key=fence_key(self._settings.namespace, record.rollout_id),
            incoming_key=incoming_key(self._settings.namespace, record.rollout_id, next(self._incoming)),
            digest=record.digest,
            blob=blob,
            entry=calls_entry(staging_key, record, len(blob)),
            then=then,
        )
        try:
            await send.send(pending)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return self._failed(staging_key, "the staging sink is closing")
        # Cancelling here leaves the queued write to complete atomically or not at all.
        await pending.done.wait()
        assert pending.result is not None and pending.outcome is not None
        return pending.result, pending.outcome

    def _failed(
        self, staging_key: str | None, error: str, outcome: StageOutcome = StageOutcome.FAILED
    ) -> tuple[StageResult, StageOutcome]:
        self._counts["failed"] += 1
        return StageResult(ok=False, staging_key=staging_key, error=error), outcome

    def _settle(self, pending: PendingStage, reply: Any, error: str | None) -> None:
        """The group commit's verdict on *pending*: a script status (``None``: nothing ran) and an error."""
        status = None if reply is None else _stage_status(reply)
        outcome = StageOutcome.FAILED
        if status is StageStatus.CONFLICT:
            self._counts["conflicts"] += 1
            error, outcome = CONFLICT_ERROR, StageOutcome.CONFLICT
        elif status is StageStatus.RETIRED:
            error = RETIRED_ERROR
        elif status is StageStatus.REPAIRED:
            logger.warning("repaired corrupt stored record %r (same digest, other bytes)", pending.staging_key)
        elif status is StageStatus.WRONG_TYPE:
            error = _WRONG_TYPE_ERROR
        if status is None or error is not None:
            pending.finish(*self._failed(pending.staging_key, error or "nothing was written", outcome))
            return
        counter = {StageStatus.WRITTEN: "staged", StageStatus.REPAIRED: "repaired"}.get(status, "already_present")
        self._counts[counter] += 1
        if status in (StageStatus.WRITTEN, StageStatus.REPAIRED):
            count_staged_bytes(self._settings.namespace, len(pending.blob))
        pending.finish(StageResult(ok=True, staging_key=pending.staging_key), StageOutcome.OK)

    # --- cleanup ----------------------------------------------------------------

    async def clear(self, staging_keys: Sequence[str]) -> int:
        """Delete the records named by *staging_keys* and their ``calls`` entries.

        :returns: how many records existed.
        :raises StagingConnectionError: the server could not be reached.
        """
        return await clear_staged(self._topology, self._settings.namespace, staging_keys)


class RedisStagingSink(PortalOwner[AsyncRedisStagingSink]):
    """Synchronous, thread-safe facade implementing the reference ``StagingSink`` protocol.

    It runs an :class:`AsyncRedisStagingSink` on a private event-loop thread.
    Open with :meth:`from_url`; close with :meth:`close` or a ``with`` block.
    """

    @classmethod
    def from_url(cls, url: str, settings: SinkSettings | None = None, **fields: Any) -> Self:
        """Open a sink on *url*; the arguments are :meth:`AsyncRedisStagingSink.from_url`'s."""
        return cls(AsyncRedisStagingSink.from_url(url, settings, **fields))

    def stage(self, record: StageableRecord) -> StageResult:
        """Thread-safe :meth:`AsyncRedisStagingSink.stage` (either form of the record)."""
        return self._call(self._resource.stage, record)

    def stage_generation_prefix(
        self, record: StageableRecord, *, checkpoint_id: str, chunk_sequence: int
    ) -> StageResult:
        """Thread-safe :meth:`AsyncRedisStagingSink.stage_generation_prefix`."""

        async def run() -> StageResult:
            return await self._resource.stage_generation_prefix(
                record, checkpoint_id=checkpoint_id, chunk_sequence=chunk_sequence
            )

        return self._call(run)

    def clear(self, staging_keys: Sequence[str]) -> int:
        """Thread-safe :meth:`AsyncRedisStagingSink.clear`."""
        return self._call(self._resource.clear, staging_keys)

    def statistics(self) -> SinkStatistics:
        return self._resource.statistics()

    def __repr__(self) -> str:
        return repr(self._resource).replace("AsyncRedisStagingSink", "RedisStagingSink", 1)
