"""The durable Redis/Valkey staging sink (architecture §4).

``stage(record)`` returns ``StageResult(ok=True)`` only after the server
acknowledged the write under ``appendfsync always`` (verified, not assumed)
and, if ``min_replicas > 0``, after ``WAIT`` on the same connection counted
enough replicas. Operational failures come back as ``ok=False`` with a precise
error; only programming errors (a wrong argument type, a closed sink) raise.

Group commit: ``stage`` calls queue their encoded record; ``writer_connections``
writer tasks each take everything queued so far, stage it with one script call
per cluster slot, pipelined with ``WAIT``/``WAITAOF`` on one connection, and
wake the callers. While one batch waits for its fsync the next one forms, so
one fsync covers many records.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from pydantic_core import PydanticSerializationError
from redis.asyncio.cluster import RedisCluster

from ..codec import DIGEST_HEAD_BYTES, encode_record
from ..digest import compute_extras_digest
from ..errors import CodecError
from ..keys import calls_stream, record_key, validate_rollout_id
from ..record_schema import calls_entry
from ..records import StagedCallRecord, StageResult
from ..settings import SinkSettings
from .cleanup import clear_staged
from .connection import ServerScript, Topology, describe_redis_error
from .durability import DurabilityReport, verify_durability
from .memory import CONFLICT_ERROR
from .resource import PortalOwner
from .scripts import STAGE_CONFLICT, STAGE_SAME, STAGE_SCRIPT, STAGE_WRITTEN

__all__ = (
    "CONFLICT_ERROR",
    "AsyncRedisStagingSink",
    "RedisStagingSink",
    "SinkStatistics",
    "generation_prefix_key",
    "generation_prefix_suffix",
    "verified_record",
)

logger = logging.getLogger(__name__)

_STAGE = ServerScript(STAGE_SCRIPT)
_TOPOLOGY_ERRORS = (
    redis_errors.MovedError,
    redis_errors.AskError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
)


def generation_prefix_suffix(checkpoint_id: str, chunk_sequence: int) -> str:
    """The part a generation-cut chunk adds to its call's staging key: ``/cut/<checkpoint_id>/<chunk_sequence>``.

    :raises ValueError: invalid *checkpoint_id* or *chunk_sequence*.
    """
    validate_rollout_id(checkpoint_id)
    if type(chunk_sequence) is not int or chunk_sequence < 0:
        raise ValueError(f"chunk_sequence must be a non-negative int, got {chunk_sequence!r}")
    return f"/cut/{checkpoint_id}/{chunk_sequence}"


def generation_prefix_key(record: StagedCallRecord, checkpoint_id: str, chunk_sequence: int) -> str:
    """Staging key of one generation-cut chunk: ``R/C/cut/<checkpoint_id>/<chunk_sequence>``."""
    return record.staging_key + generation_prefix_suffix(checkpoint_id, chunk_sequence)


def verified_record(record: StagedCallRecord) -> StagedCallRecord:
    """*record* if it is unchanged since it was validated, else a freshly validated copy.

    A record built by ``model_construct``, or whose fields were reassigned
    after validation, is validated again, so the sink never stores a blob the
    source would reject. (Element assignment inside a column after validation
    is not detected: records are values, do not mutate them.)

    :raises ValueError: the record is invalid (``pydantic.ValidationError`` is a ``ValueError``).
    :raises TypeError: an extras value is unsupported.
    """
    if record._unchanged_since_validation() and (
        record.extras is None or compute_extras_digest(record.extras) == record.extras_digest
    ):
        return record
    try:
        data = record.model_dump(warnings=False)
    except PydanticSerializationError as exc:
        raise ValueError(f"record cannot be serialized: {exc}") from exc
    return StagedCallRecord.model_validate(data)


def _key_or_none(record: StagedCallRecord, key_suffix: str) -> str | None:
    try:
        return record.staging_key + key_suffix
    except (ValueError, TypeError):
        return None


@dataclass(slots=True)
class _Pending:
    """One queued stage: its key, encoded blob, entry fields and the slot for its result."""

    staging_key: str
    record_key: str
    calls_key: str
    digest: str
    blob: bytes
    entry: tuple[str, ...]
    done: anyio.Event = field(default_factory=anyio.Event)
    result: StageResult | None = None

    def finish(self, result: StageResult) -> None:
        if self.result is None:
            self.result = result
            self.done.set()


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    """Counters of one sink since it was opened."""

    staged: int
    already_present: int
    conflicts: int
    failed: int
    batches: int
    queued: int


class AsyncRedisStagingSink:
    """Durable, idempotent staging of :class:`StagedCallRecord` into Redis/Valkey.

    Use as an async context manager::

        async with AsyncRedisStagingSink.from_url(url) as sink:
            result = await sink.stage(record)

    ``from_url`` owns its clients; passing a client to the constructor borrows it.
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, settings: SinkSettings | None = None) -> None:
        settings = settings or SinkSettings()
        self._bind(settings, Topology.borrow(client, settings))

    @classmethod
    def from_url(cls, url: str, **settings: Any) -> Self:
        """Create a sink that owns its connection(s) to *url*; keyword arguments are :class:`SinkSettings`."""
        parsed = SinkSettings(**settings)
        self = cls.__new__(cls)
        self._bind(parsed, Topology.from_url(url, parsed))
        return self

    def _bind(self, settings: SinkSettings, topology: Topology) -> None:
        """The one initialisation both constructors share."""
        self._settings = settings
        self._topology = topology
        self._send: MemoryObjectSendStream[_Pending] | None = None
        self._task_group: TaskGroup | None = None
        self._durability: DurabilityReport | None = None
        self._checked_at = -math.inf
        self._check_lock = anyio.Lock()
        self._closed = False
        self._counts = {"staged": 0, "already_present": 0, "conflicts": 0, "failed": 0, "batches": 0}

    @property
    def settings(self) -> SinkSettings:
        return self._settings

    def statistics(self) -> SinkStatistics:
        """Counters since open (``queued`` = records waiting for a writer)."""
        queued = self._send.statistics().current_buffer_used if self._send is not None else 0
        return SinkStatistics(queued=queued, **self._counts)

    def __repr__(self) -> str:
        c = self._counts
        return (
            f"<AsyncRedisStagingSink staged={c['staged']} present={c['already_present']} "
            f"conflicts={c['conflicts']} failed={c['failed']} batches={c['batches']}>"
        )

    # --- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._closed or self._task_group is not None:
            raise RuntimeError("a staging sink can be entered once")
        try:
            await self._open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._topology.aclose()
            self._closed = True
            raise
        return self

    async def _open(self) -> None:
        try:
            await self._topology.initialize()
        except (redis_errors.RedisError, OSError) as exc:
            # Not fatal: stages fail with this error until the server is reachable.
            logger.warning("staging sink could not load the cluster topology: %s", describe_redis_error(exc))
        await self._refresh_durability(force=True)
        send, receive = anyio.create_memory_object_stream[_Pending](self._settings.max_batch_records * 4)
        self._send = send
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        for _ in range(self._settings.writer_connections):
            self._task_group.start_soon(self._writer, receive.clone())
        receive.close()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            # Closing the send side lets the writers drain what is queued, then stop.
            if self._send is not None:
                self._send.close()
            if self._task_group is not None:
                # The group must exit in the scope it was entered in (no shield around it);
                # cancelled writers fail their callers' stages, they never half-write.
                await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                await self._topology.aclose()
        return None

    async def aclose(self) -> None:
        """Stop accepting stages, finish queued ones, close owned connections."""
        if not self._closed:
            await self.__aexit__(None, None, None)

    # --- staging ----------------------------------------------------------------

    async def stage(self, record: StagedCallRecord) -> StageResult:
        """Stage *record* under its default key ``rollout_id/model_call_id``.

        :returns: ``ok=True`` only once the write is durable (and replicated,
            if required); ``ok=False`` with a precise error otherwise.
        :raises TypeError: *record* is not a :class:`StagedCallRecord`.
        :raises RuntimeError: the sink is not open.
        """
        if not isinstance(record, StagedCallRecord):
            raise TypeError(f"stage() takes a StagedCallRecord, got {type(record).__name__}")
        return await self._stage(record, "")

    async def stage_generation_prefix(
        self, record: StagedCallRecord, *, checkpoint_id: str, chunk_sequence: int
    ) -> StageResult:
        """Stage one generation-cut chunk under ``R/C/cut/<checkpoint_id>/<chunk_sequence>``.

        :raises TypeError: *record* is not a :class:`StagedCallRecord`.
        :raises ValueError: invalid *checkpoint_id* or *chunk_sequence*.
        """
        if not isinstance(record, StagedCallRecord):
            raise TypeError(f"stage_generation_prefix() takes a StagedCallRecord, got {type(record).__name__}")
        return await self._stage(record, generation_prefix_suffix(checkpoint_id, chunk_sequence))

    async def _stage(self, record: StagedCallRecord, key_suffix: str) -> StageResult:
        if self._send is None or self._closed:
            raise RuntimeError("the staging sink is not open: use 'async with sink:'")
        try:
            record = verified_record(record)
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
        report = await self._refresh_durability()
        if report.problem is not None:
            return self._failed(staging_key, report.problem)
        pending = _Pending(
            staging_key=staging_key,
            record_key=record_key(self._settings.namespace, staging_key),
            calls_key=calls_stream(self._settings.namespace, record.rollout_id),
            digest=record.digest,
            blob=blob,
            entry=calls_entry(staging_key, record, len(blob)),
        )
        try:
            await self._send.send(pending)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return self._failed(staging_key, "the staging sink is closing")
        # Cancelling here leaves the queued write to complete atomically or not at all.
        await pending.done.wait()
        assert pending.result is not None
        return pending.result

    def _failed(self, staging_key: str | None, error: str) -> StageResult:
        self._counts["failed"] += 1
        return StageResult(ok=False, staging_key=staging_key, error=error)

    # --- durability -------------------------------------------------------------

    async def _refresh_durability(self, *, force: bool = False) -> DurabilityReport:
        if self._settings.durability == "none":
            return DurabilityReport(problem=None, supports_waitaof=False)
        fresh = time.monotonic() - self._checked_at < self._settings.durability_check_interval_s
        if self._durability is not None and fresh and not force:
            return self._durability
        async with self._check_lock:
            fresh = time.monotonic() - self._checked_at < self._settings.durability_check_interval_s
            if self._durability is None or not fresh or force:
                report = await self._verify_all_nodes()
                self._durability = report
                # A failed check is retried on the next stage rather than cached.
                self._checked_at = time.monotonic() if report.problem is None else -math.inf
                if report.problem is not None:
                    logger.error("staging sink refuses to acknowledge writes: %s", report.problem)
        assert self._durability is not None
        return self._durability

    async def _verify_all_nodes(self) -> DurabilityReport:
        try:
            nodes = await self._topology.all_nodes()
        except (redis_errors.RedisError, OSError) as exc:
            return DurabilityReport(
                problem=f"cannot verify durability: {describe_redis_error(exc)}", supports_waitaof=False
            )
        return await verify_durability(nodes)

    # --- group commit -----------------------------------------------------------

    async def _writer(self, receive: MemoryObjectReceiveStream[_Pending]) -> None:
        async with receive:
            async for first in receive:
                batch = [first]
                while len(batch) < self._settings.max_batch_records:
                    try:
                        batch.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                await self._write_batch(batch)

    async def _write_batch(self, batch: list[_Pending]) -> None:
        self._counts["batches"] += 1
        by_node: dict[int, tuple[aioredis.Redis, list[_Pending]]] = {}
        try:
            for pending in batch:
                client = self._topology.node_for_key(pending.record_key)
                by_node.setdefault(id(client), (client, []))[1].append(pending)
        except (redis_errors.RedisError, OSError) as exc:
            self._fail_all(batch, f"cannot route the write: {describe_redis_error(exc)}")
            return
        async with anyio.create_task_group() as group:
            for client, items in by_node.values():
                group.start_soon(self._write_node, client, items)

    async def _write_node(self, client: aioredis.Redis, items: list[_Pending]) -> None:
        try:
            await self._write_node_once(client, items)
        except redis_errors.NoScriptError:
            # The script cache is empty (server restarted): nothing ran; load and retry once.
            try:
                await client.script_load(_STAGE.source)
                await self._write_node_once(client, items)
            except (redis_errors.RedisError, OSError) as exc:
                self._fail_all(items, describe_redis_error(exc))
        except _TOPOLOGY_ERRORS as exc:
            self._fail_all(items, f"cluster topology changed, retry: {describe_redis_error(exc)}")
            await self._refresh_topology()
        except (redis_errors.RedisError, OSError) as exc:
            self._fail_all(items, describe_redis_error(exc))
            if self._topology.is_cluster:
                await self._refresh_topology()
        except Exception as exc:  # a bug must not strand callers waiting on their event
            logger.exception("staging sink writer failed")
            self._fail_all(items, f"internal error: {describe_redis_error(exc)}")
        finally:
            self._fail_all(items, "the write was interrupted before it was confirmed")

    async def _refresh_topology(self) -> None:
        try:
            await self._topology.refresh()
        except (redis_errors.RedisError, OSError) as exc:
            logger.warning("could not refresh the cluster topology: %s", describe_redis_error(exc))

    async def _write_node_once(self, client: aioredis.Redis, items: list[_Pending]) -> None:
        groups = self._topology.group_by_slot([p.record_key for p in items])
        settings = self._settings
        timeout_ms = max(1, int(settings.confirm_timeout_s * 1000))
        pipe = client.pipeline(transaction=False)
        slot_items: list[list[_Pending]] = []
        for indices in groups.values():
            chunk = [items[i] for i in indices]
            slot_items.append(chunk)
            keys: list[str] = []
            args: list[Any] = [DIGEST_HEAD_BYTES, "1" if settings.min_replicas > 0 else "0"]
            for p in chunk:
                keys += (p.record_key, p.calls_key)
                args += (p.digest, p.blob, *p.entry)
            pipe.evalsha(_STAGE.sha, len(keys), *keys, *args)
        if settings.min_replicas > 0:
            pipe.execute_command("WAIT", settings.min_replicas, timeout_ms)
        waitaof = self._durability is not None and self._durability.supports_waitaof and settings.durability == "fsync"
        if waitaof:
            pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, redis_errors.NoScriptError):
                raise reply
        script_replies = replies[: len(slot_items)]
        confirmation_error = self._confirmation_error(replies[len(slot_items) :], waitaof)
        topology_changed = False
        for chunk, reply in zip(slot_items, script_replies, strict=True):
            if isinstance(reply, BaseException):
                topology_changed |= isinstance(reply, _TOPOLOGY_ERRORS)
                self._fail_all(chunk, describe_redis_error(reply))
                continue
            for pending, status in zip(chunk, reply, strict=True):
                self._settle(pending, int(status), confirmation_error)
        if topology_changed:
            await self._refresh_topology()

    def _confirmation_error(self, replies: Sequence[Any], waitaof: bool) -> str | None:
        settings = self._settings
        position = 0
        if settings.min_replicas > 0:
            acked = replies[position]
            position += 1
            if isinstance(acked, BaseException):
                return f"replica confirmation failed: {describe_redis_error(acked)}"
            if int(acked) < settings.min_replicas:
                return (
                    f"only {int(acked)} of {settings.min_replicas} required replicas acknowledged "
                    f"within confirm_timeout_s={settings.confirm_timeout_s}"
                )
        if waitaof:
            reply = replies[position]
            if isinstance(reply, BaseException):
                return f"WAITAOF failed: {describe_redis_error(reply)}"
            if int(reply[0]) < 1:
                return "the server did not confirm the AOF fsync (WAITAOF numlocal=0)"
        return None

    def _settle(self, pending: _Pending, status: int, confirmation_error: str | None) -> None:
        if status == STAGE_CONFLICT:
            self._counts["conflicts"] += 1
            self._counts["failed"] += 1
            pending.finish(StageResult(ok=False, staging_key=pending.staging_key, error=CONFLICT_ERROR))
        elif status not in (STAGE_WRITTEN, STAGE_SAME):
            self._counts["failed"] += 1
            pending.finish(
                StageResult(
                    ok=False,
                    staging_key=pending.staging_key,
                    error="a key of this rollout holds a value of the wrong type; nothing was written",
                )
            )
        elif confirmation_error is not None:
            self._counts["failed"] += 1
            pending.finish(StageResult(ok=False, staging_key=pending.staging_key, error=confirmation_error))
        else:
            self._counts["staged" if status == STAGE_WRITTEN else "already_present"] += 1
            pending.finish(StageResult(ok=True, staging_key=pending.staging_key))

    def _fail_all(self, items: Sequence[_Pending], error: str) -> None:
        for pending in items:
            if pending.result is None:
                self._counts["failed"] += 1
                pending.finish(StageResult(ok=False, staging_key=pending.staging_key, error=error))

    # --- cleanup ----------------------------------------------------------------

    async def clear(self, staging_keys: Sequence[str]) -> int:
        """Delete the records named by *staging_keys* and their ``calls`` entries.

        :returns: how many records existed.
        :raises StagingConnectionError: the server could not be reached.
        """
        return await clear_staged(self._topology, self._settings.namespace, staging_keys)


class RedisStagingSink(PortalOwner):
    """Synchronous, thread-safe facade implementing the reference ``StagingSink`` protocol.

    It runs an :class:`AsyncRedisStagingSink` on a private event-loop thread.
    Open with :meth:`from_url`; close with :meth:`close` or a ``with`` block.
    """

    def __init__(self, sink: AsyncRedisStagingSink) -> None:
        self._sink = sink
        super().__init__(sink)

    @classmethod
    def from_url(cls, url: str, **settings: Any) -> Self:
        """Open a sink on *url*; keyword arguments are :class:`SinkSettings`."""
        return cls(AsyncRedisStagingSink.from_url(url, **settings))

    def stage(self, record: StagedCallRecord) -> StageResult:
        """Thread-safe :meth:`AsyncRedisStagingSink.stage`."""
        return self._call(self._sink.stage, record)

    def stage_generation_prefix(
        self, record: StagedCallRecord, *, checkpoint_id: str, chunk_sequence: int
    ) -> StageResult:
        """Thread-safe :meth:`AsyncRedisStagingSink.stage_generation_prefix`."""

        async def run() -> StageResult:
            return await self._sink.stage_generation_prefix(
                record, checkpoint_id=checkpoint_id, chunk_sequence=chunk_sequence
            )

        return self._call(run)

    def clear(self, staging_keys: Sequence[str]) -> int:
        """Thread-safe :meth:`AsyncRedisStagingSink.clear`."""
        return self._call(self._sink.clear, staging_keys)

    def statistics(self) -> SinkStatistics:
        return self._sink.statistics()

    def __repr__(self) -> str:
        return repr(self._sink).replace("AsyncRedisStagingSink", "RedisStagingSink", 1)
