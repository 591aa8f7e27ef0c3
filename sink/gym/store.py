"""The NeMo Gym transport's store: every operation is one item of the staging sink's group commit.

:class:`AsyncGymStore` queues each ``put``, ``mark_incomplete``, ``begin_call``, ``freeze`` and ``drop`` for
the group commit of :mod:`sink.store.commit`, which runs them with :data:`~sink.store.scripts.GYM_SCRIPT`
(one call per cluster slot per batch), pipelined with the same durability confirmation as ``stage()``:
``WAITAOF`` (the server fsynced), ``WAIT`` when ``min_replicas > 0``, and the persistence settings read back in
the same round trip, after a :class:`~sink.store.durability.DurabilityMonitor` verdict. So concurrent puts
share one fsync, and an operation returns only once its effect is durable; otherwise it raises
:class:`~sink.errors.CaptureWriteError`. The transport classes of :mod:`sink.gym.transport` run it on a
private loop thread.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import anyio
import redis.exceptions as redis_errors
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from sink.errors import CaptureWriteError, RolloutFrozenError, RolloutRetiredError, TokenEntryConflictError
from sink.gym.codec import EncodedEntry, check_call_id, check_rollout_id, decode_entry
from sink.gym.entry import EntryTypes
from sink.keys import gym_keys
from sink.settings import GymTransportSettings
from sink.store.commit import BatchScript, GroupCommitWriter
from sink.store.connection import Topology, describe_redis_error
from sink.store.durability import DurabilityMonitor
from sink.store.gym_scripts import (
    GYM_CONFLICT,
    GYM_DROP_REFUSED,
    GYM_FROZEN,
    GYM_OK,
    GYM_RETIRED,
    GYM_SAME,
    GYM_WRONG_TYPE,
)
from sink.store.resource import AsyncResource
from sink.store.scripts import GYM_SCRIPT

__all__ = ("AsyncGymStore", "GymOp")

logger = logging.getLogger(__name__)

_WRONG_TYPE: Final = "a key of this rollout holds a value of the wrong type; nothing was written"


@dataclass(slots=True)
class GymOp:
    """One queued operation: the rollout's keys, the script's four values, and the slot for its reply."""

    keys: tuple[str, ...]
    args: tuple[Any, ...]
    done: anyio.Event = field(default_factory=anyio.Event)
    reply: list[Any] | None = None
    error: str | None = None

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


def _head(settings: Any) -> list[Any]:
    assert isinstance(settings, GymTransportSettings)
    return [int(settings.tombstone_retention_s * 1000), "1" if settings.min_replicas > 0 else "0"]


def _item(op: GymOp) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    return op.keys, op.args


_GYM_BATCH: Final[BatchScript[GymOp]] = BatchScript(GYM_SCRIPT, _head, _item)


def _settle(op: GymOp, reply: Any, error: str | None) -> None:
    op.settle(reply, error)


def _status(reply: list[Any]) -> int:
    return int(reply[0])


class AsyncGymStore(AsyncResource):
    """The operations of :class:`~sink.gym.RedisTokenSink` and :class:`~sink.gym.RedisTokenSource`, durable."""

    def __init__(self, url: str, settings: GymTransportSettings, types: EntryTypes) -> None:
        self._settings = settings
        self._types = types
        self._topology = Topology.from_url(url, settings)
        self._durability = DurabilityMonitor(self._topology, settings)
        self._writer = GroupCommitWriter(self._topology, settings, self._durability, _settle, _GYM_BATCH)
        self._send: MemoryObjectSendStream[GymOp] | None = None
        self._task_group: TaskGroup | None = None

    @property
    def settings(self) -> GymTransportSettings:
        return self._settings

    async def _open(self) -> None:
        try:
            await self._topology.initialize()
        except (redis_errors.RedisError, OSError) as exc:
            # Not fatal: operations fail with this error until the server is reachable.
            logger.warning("gym transport could not load the cluster topology: %s", describe_redis_error(exc))
        await self._durability.report(force=True)
        send, receive = anyio.create_memory_object_stream[GymOp](self._settings.max_batch_records * 4)
        self._send = send
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        for _ in range(self._settings.writer_connections):
            self._task_group.start_soon(self._writer.run, receive.clone())
        receive.close()

    async def _stop(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._send is not None:
                self._send.close()  # the writers drain what is queued, then stop
            if self._task_group is not None:
                await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._send = None

    async def _close_resources(self) -> None:
        await self._topology.aclose()

    # --- one operation --------------------------------------------------------------------------------

    async def _run(self, rollout_id: str, op: str, *values: Any) -> list[Any]:
        send = self._send
        if send is None:
            raise RuntimeError("the gym transport is closed")
        report = await self._durability.report()
        if report.problem is not None:
            raise CaptureWriteError(f"{op} of rollout {rollout_id!r} refused: {report.problem}")
        padded = (op, *values, *([""] * (3 - len(values))))
        pending = GymOp(keys=gym_keys(self._settings.namespace, rollout_id), args=padded)
        try:
            await send.send(pending)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise RuntimeError("the gym transport is closing") from None
        # Cancelling here leaves the queued operation to complete atomically or not at all.
        await pending.done.wait()
        if pending.error is not None or pending.reply is None:
            raise CaptureWriteError(f"{op} of rollout {rollout_id!r} is not confirmed durable: {pending.error}")
        if _status(pending.reply) == GYM_WRONG_TYPE:
            raise CaptureWriteError(f"{op} of rollout {rollout_id!r}: {_WRONG_TYPE}")
        return pending.reply

    # --- the sink side ----------------------------------------------------------------------------------

    async def put(self, encoded: EncodedEntry) -> None:
        """Store one encoded entry (see :class:`~sink.gym.RedisTokenSink.put`)."""
        reply = await self._run(encoded.rollout_id, "put", encoded.model_call_id, encoded.digest, encoded.blob)
        status = _status(reply)
        if status in (GYM_OK, GYM_SAME):
            return
        rollout_id, call_id = encoded.rollout_id, encoded.model_call_id
        if status == GYM_CONFLICT:
            raise TokenEntryConflictError(
                f"rollout {rollout_id!r} already holds another entry for model_call_id {call_id!r}: the stored "
                "entry is kept and the rollout is marked incomplete"
            )
        self._refuse(status, rollout_id, f"put of model_call_id {call_id!r}")

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        check_rollout_id(rollout_id)
        check_call_id(model_call_id, allow_empty=True)
        reply = await self._run(rollout_id, "mark", model_call_id)
        if _status(reply) != GYM_OK:
            self._refuse(_status(reply), rollout_id, "mark_incomplete")

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        check_rollout_id(rollout_id)
        check_call_id(model_call_id)
        reply = await self._run(rollout_id, "begin", model_call_id)
        if _status(reply) != GYM_OK:
            self._refuse(_status(reply), rollout_id, f"begin_call of model_call_id {model_call_id!r}")

    @staticmethod
    def _refuse(status: int, rollout_id: str, what: str) -> None:
        if status == GYM_FROZEN:
            raise RolloutFrozenError(f"rollout {rollout_id!r} is frozen: {what} refused; nothing was written")
        if status == GYM_RETIRED:
            raise RolloutRetiredError(rollout_id)
        raise CaptureWriteError(f"{what} of rollout {rollout_id!r}: unexpected script status {status}")

    # --- the source side --------------------------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> Any:
        """Freeze *rollout_id* (see :class:`~sink.gym.RedisTokenSource.freeze`)."""
        check_rollout_id(rollout_id)
        reply = await self._run(rollout_id, "freeze", uuid.uuid4().hex)
        if _status(reply) != GYM_OK:
            self._refuse(_status(reply), rollout_id, "freeze")
        snapshot_id, version, incomplete = reply[1], reply[2], reply[3]
        entry_type = self._types.entry
        entries = tuple(decode_entry(blob, entry_type) for blob in reply[4:])
        return self._types.snapshot(
            rollout_id=rollout_id,
            entries=entries,
            incomplete=bool(int(incomplete)),
            snapshot_id=snapshot_id.decode() if isinstance(snapshot_id, bytes) else str(snapshot_id),
            version=int(version),
        )

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the frozen snapshot if it is still *snapshot_id* at *version* (see ``RedisTokenSource.drop``)."""
        check_rollout_id(rollout_id)
        if type(snapshot_id) is not str or not snapshot_id:
            raise ValueError(f"snapshot_id must be a non-empty str, got {snapshot_id!r}")
        if type(version) is not int:
            raise ValueError(f"version must be an int, got {version!r}")
        reply = await self._run(rollout_id, "drop", snapshot_id, str(version))
        status = _status(reply)
        if status not in (GYM_OK, GYM_DROP_REFUSED):
            raise CaptureWriteError(f"drop of rollout {rollout_id!r}: unexpected script status {status}")
        return status == GYM_OK
