"""The NeMo Gym transport's store: every operation is one item of the staging sink's group commit.

:class:`AsyncGymStore` queues each ``put``, ``mark_incomplete``, ``begin_call``, ``freeze`` and ``drop``, and
writes the queue in batches with the group commit of :mod:`sink.store.commit` (``GroupCommitWriter.write_batch``),
which runs them with :data:`~sink.store.scripts.GYM_SCRIPT` (one call per cluster slot per batch), pipelined
with the same durability confirmation as ``stage()``:
``WAITAOF`` (the server fsynced), ``WAIT`` when ``min_replicas > 0``, and the persistence settings read back in
the same round trip, after a :class:`~sink.store.durability.DurabilityMonitor` verdict. So concurrent puts
share one fsync, and an operation returns only once its effect is durable; otherwise it raises
:class:`~sink.errors.CaptureWriteError`. It runs in the caller's event loop (no thread, no task of its own).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import redis.exceptions as redis_errors

from sink.errors import (
    CaptureWriteError,
    GymInputError,
    RolloutFrozenError,
    RolloutRetiredError,
    TokenEntryConflictError,
)
from sink.gym.codec import EncodedEntry, check_call_id, check_rollout_id, decode_entry
from sink.gym.entry import EntryTypes
from sink.keys import GymKeys, gym_keys
from sink.settings import GymTransportSettings
from sink.store.commit import BatchScript, GroupCommitWriter
from sink.store.connection import Topology, describe_redis_error, reply_text
from sink.store.durability import DurabilityMonitor
from sink.store.pipeline_counters import count_gym_operation
from sink.store.scripts import GYM_SCRIPT, GymStatus

__all__ = ("AsyncGymStore", "GymOp")

logger = logging.getLogger(__name__)

_WRONG_TYPE: Final = "a key of this rollout holds a value of the wrong type; nothing was written"
_RESULTS: Final = {
    GymStatus.OK: "ok",
    GymStatus.SAME: "ok",
    GymStatus.CONFLICT: "conflict",
    GymStatus.FROZEN: "frozen",
    GymStatus.RETIRED: "retired",
    GymStatus.DROP_REFUSED: "refused",
}


@dataclass(slots=True)
class GymOp:
    """One queued operation: the rollout's keys, the script's four values, and the slot for its reply."""

    keys: tuple[str, ...]
    args: tuple[Any, ...]
    done: anyio.Event = field(default_factory=anyio.Event)
    reply: list[Any] | None = None
    error: str | None = None
    taken: bool = False
    """A batch took it: it is settled when that batch ends (the group commit settles every item it takes)."""

    @property
    def route_key(self) -> str:
        return self.keys[0]

    @property
    def result(self) -> object:
        return self.reply if self.error is None else self.error

    def settle(self, reply: Any, error: str | None) -> None:
        """Set the outcome once and wake the caller (later calls are ignored)."""
        if self.done.is_set():
            return
        if reply is None or error is not None:
            self.error = error or "nothing was written"
        else:
            self.reply = list(reply)
        self.done.set()


def _item(op: GymOp) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    return op.keys, op.args


def _reads(op: GymOp) -> tuple[tuple[str, ...], ...]:
    """A freeze reads its entries right after the script (``HVALS`` of the snapshot), then the snapshot id and
    the tombstone again: the script froze the rollout, so its entries can only have changed since if it was
    dropped, abandoned or deleted meanwhile, which those two reads show."""
    if op.args[0] != "freeze":
        return ()
    keys = GymKeys(*op.keys)
    return ("HVALS", keys.snapshot), ("HGET", keys.frozen, "snapshot_id"), ("EXISTS", keys.tombstone)


def _batch_script(settings: GymTransportSettings) -> BatchScript[GymOp]:
    """:data:`GYM_SCRIPT` over :class:`GymOp` s; ``ARGV`` starts with the tombstone retention and the rewrite flag."""
    head = (int(settings.tombstone_retention_s * 1000), "1" if settings.min_replicas > 0 else "0")
    return BatchScript(GYM_SCRIPT, lambda _settings: head, _item, _reads)


def _settle(op: GymOp, reply: Any, error: str | None) -> None:
    op.settle(reply, error)


def _call_id(entry: Any) -> str:
    return str(entry.model_call_id)


def _status(reply: list[Any]) -> GymStatus:
    return GymStatus(int(reply[0]))


class AsyncGymStore:
    """The operations of :class:`~sink.gym.RedisTokenSink` and :class:`~sink.gym.RedisTokenSource`, durable.

    It has no task of its own: the caller whose operation finds fewer than ``writer_connections`` batches in
    flight takes everything queued (up to ``max_batch_records``) and writes it as one batch, shielded from
    cancellation (bounded by the socket timeouts), so one fsync covers every operation queued meanwhile. It
    belongs to the event loop that first used it.
    """

    def __init__(self, url: str, settings: GymTransportSettings, types: EntryTypes) -> None:
        self._settings = settings
        self._types = types
        self._topology = Topology.from_url(url, settings)
        self._durability = DurabilityMonitor(self._topology, settings)
        self._writer = GroupCommitWriter(self._topology, settings, self._durability, _settle, _batch_script(settings))
        self._queue: deque[GymOp] = deque()
        self._flushing = 0
        self._flushed: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open_lock: anyio.Lock | None = None
        self._opened = False
        self._closed = False

    @property
    def settings(self) -> GymTransportSettings:
        return self._settings

    @property
    def batches(self) -> int:
        """Batches written so far (each one script call per slot and one durability confirmation)."""
        return self._writer.batches

    async def _ensure_open(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._open_lock, self._flushed = loop, anyio.Lock(), anyio.Event()
        elif self._loop is not loop:
            raise RuntimeError("the gym transport is bound to the event loop that first used it")
        if self._closed:
            raise RuntimeError("the gym transport is closed")
        if self._opened:
            return
        assert self._open_lock is not None
        async with self._open_lock:
            if not self._opened:
                try:
                    await self._topology.initialize()
                except (redis_errors.RedisError, OSError) as exc:
                    # Not fatal: operations fail with this error until the server is reachable.
                    logger.warning("gym transport could not load the cluster topology: %s", describe_redis_error(exc))
                await self._durability.report(force=True)
                self._opened = True

    async def aclose(self) -> None:
        """Refuse new operations, let queued ones finish, close the connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            return  # the connections belong to another (ended) loop: nothing here can close them
        if self._loop is not None:
            while self._queue or self._flushing:
                if self._queue and self._flushing < self._settings.writer_connections:
                    await self._flush()
                else:
                    assert self._flushed is not None
                    await self._flushed.wait()
        with anyio.CancelScope(shield=True):
            await self._topology.aclose()

    async def _flush(self) -> None:
        batch: list[GymOp] = []
        while self._queue and len(batch) < self._settings.max_batch_records:
            op = self._queue.popleft()
            op.taken = True
            batch.append(op)
        self._flushing += 1
        try:
            # Shielded: the batch holds other callers' operations; the socket timeouts bound it.
            with anyio.CancelScope(shield=True):
                await self._writer.write_batch(batch)
        finally:
            self._flushing -= 1
            assert self._flushed is not None
            flushed, self._flushed = self._flushed, anyio.Event()
            flushed.set()

    async def _commit(self, op: GymOp) -> None:
        self._queue.append(op)
        try:
            while not op.done.is_set():
                if op.taken:
                    await op.done.wait()  # in a batch now: only its own outcome wakes this caller
                elif self._queue and self._flushing < self._settings.writer_connections:
                    await self._flush()
                else:
                    assert self._flushed is not None
                    await self._flushed.wait()
        except BaseException:
            if op in self._queue:  # cancelled before any batch took it: it is never written
                self._queue.remove(op)
            raise

    # --- one operation --------------------------------------------------------------------------------

    async def _run(self, rollout_id: str, op: str, *values: Any) -> list[Any]:
        result = "failed"
        try:
            reply = await self._run_once(rollout_id, op, *values)
            result = _RESULTS.get(_status(reply), "failed")
            return reply
        finally:
            count_gym_operation(self._settings.namespace, op, result)

    async def _run_once(self, rollout_id: str, op: str, *values: Any) -> list[Any]:
        await self._ensure_open()
        report = await self._durability.report()
        if report.problem is not None:
            raise CaptureWriteError(f"{op} of rollout {rollout_id!r} refused: {report.problem}")
        padded = (op, *values, *([""] * (3 - len(values))))
        pending = GymOp(keys=gym_keys(self._settings.namespace, rollout_id), args=padded)
        await self._commit(pending)
        if pending.error is not None or pending.reply is None:
            raise CaptureWriteError(f"{op} of rollout {rollout_id!r} is not confirmed durable: {pending.error}")
        if _status(pending.reply) == GymStatus.WRONG_TYPE:
            raise CaptureWriteError(f"{op} of rollout {rollout_id!r}: {_WRONG_TYPE}")
        return pending.reply

    # --- the sink side ----------------------------------------------------------------------------------

    async def put(self, encoded: EncodedEntry) -> None:
        """Store one encoded entry (see :class:`~sink.gym.RedisTokenSink.put`).

        :raises GymInputError: the entry is larger than ``max_record_bytes`` (nothing is written).
        """
        if len(encoded.blob) > self._settings.max_record_bytes:
            raise GymInputError(
                f"entry {encoded.model_call_id!r} of rollout {encoded.rollout_id!r} is {len(encoded.blob)} bytes "
                f"encoded, more than max_record_bytes={self._settings.max_record_bytes}"
            )
        reply = await self._run(encoded.rollout_id, "put", encoded.model_call_id, encoded.digest, encoded.blob)
        status = _status(reply)
        if status in (GymStatus.OK, GymStatus.SAME):
            return
        rollout_id, call_id = encoded.rollout_id, encoded.model_call_id
        if status == GymStatus.CONFLICT:
            raise TokenEntryConflictError(
                f"rollout {rollout_id!r} already holds another entry for model_call_id {call_id!r}: the stored "
                "entry is kept and the rollout is marked incomplete"
            )
        self._refuse(status, rollout_id, f"put of model_call_id {call_id!r}")

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        check_rollout_id(rollout_id)
        check_call_id(model_call_id, allow_empty=True)
        reply = await self._run(rollout_id, "mark", model_call_id)
        if _status(reply) != GymStatus.OK:
            self._refuse(_status(reply), rollout_id, "mark_incomplete")

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        check_rollout_id(rollout_id)
        check_call_id(model_call_id)
        reply = await self._run(rollout_id, "begin", model_call_id)
        if _status(reply) != GymStatus.OK:
            self._refuse(_status(reply), rollout_id, f"begin_call of model_call_id {model_call_id!r}")

    @staticmethod
    def _refuse(status: int, rollout_id: str, what: str) -> None:
        if status == GymStatus.FROZEN:
            raise RolloutFrozenError(f"rollout {rollout_id!r} is frozen: {what} refused; nothing was written")
        if status == GymStatus.RETIRED:
            raise RolloutRetiredError(rollout_id)
        raise CaptureWriteError(f"{what} of rollout {rollout_id!r}: unexpected script status {status}")

    # --- the source side --------------------------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> Any:
        """Freeze *rollout_id* (see :class:`~sink.gym.RedisTokenSource.freeze`)."""
        check_rollout_id(rollout_id)
        reply = await self._run(rollout_id, "freeze", uuid.uuid4().hex)
        if _status(reply) != GymStatus.OK:
            self._refuse(_status(reply), rollout_id, "freeze")
        snapshot_id, version, incomplete, blobs, snapshot_after, tombstoned_after = reply[1:7]
        if int(tombstoned_after):
            raise RolloutRetiredError(rollout_id)  # dropped or abandoned while its entries were read
        if snapshot_after != snapshot_id:
            raise CaptureWriteError(
                f"rollout {rollout_id!r} was deleted or replaced while it was frozen: retry the freeze"
            )
        entry_type = self._types.entry
        # Sorted by call id: the order carries no meaning, and a repeated freeze returns an equal snapshot.
        entries = tuple(sorted((decode_entry(blob, entry_type) for blob in blobs), key=_call_id))
        return self._types.snapshot(
            rollout_id=rollout_id,
            entries=entries,
            incomplete=bool(int(incomplete)),
            snapshot_id=reply_text(snapshot_id, "gym snapshot id"),
            version=int(version),
        )

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the frozen snapshot if it is still *snapshot_id* at *version* (see ``RedisTokenSource.drop``)."""
        check_rollout_id(rollout_id)
        # Any str and int are an identity (one no snapshot has, such as "" and 0 for a never-frozen rollout, is
        # refused by the script: False, as Gym's own store answers); another type is a caller's mistake.
        if type(snapshot_id) is not str:
            raise GymInputError(f"snapshot_id must be a str, got {snapshot_id!r}")
        if type(version) is not int:
            raise GymInputError(f"version must be an int, got {version!r}")
        reply = await self._run(rollout_id, "drop", snapshot_id, str(version))
        status = _status(reply)
        if status not in (GymStatus.OK, GymStatus.DROP_REFUSED):
            raise CaptureWriteError(f"drop of rollout {rollout_id!r}: unexpected script status {status}")
        return status == GymStatus.OK
