"""The sink's group commit: queued stages written in batches, then confirmed.

Each of the sink's ``writer_connections`` :meth:`GroupCommitWriter.run` tasks
takes everything queued so far (up to ``max_batch_records``, and :data:`MAX_BATCH_VALUE_BYTES` of record
blobs), writes it with one :class:`BatchScript` call per
cluster slot (the staging sink's :data:`STAGE_BATCH`, or the Gym transport's),
pipelined with its node's confirmation (``WAIT``, ``WAITAOF``, the persistence settings read back) through
the one durable write path (:mod:`sink.store.batch`), and settles every item through its owner's callback. While one
batch waits for its fsync the next one forms, so one fsync covers many records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from sink.contract.codec import DIGEST_HEAD_BYTES
from sink.contract.records import StageResult
from sink.settings import SinkSettings
from sink.store.batch import BatchCall, Sent, send_calls
from sink.store.connection import Topology, describe_redis_error, is_topology_reply
from sink.store.durability import Confirmation, DurabilityMonitor
from sink.store.pipeline_counters import StageOutcome
from sink.store.scripts import STAGE_SCRIPT
from sink.store.scripts.runner import ServerScript

__all__ = (
    "INCOMING_EXPIRY_MS",
    "MAX_BATCH_VALUE_BYTES",
    "STAGE_BATCH",
    "BatchScript",
    "Committable",
    "FollowUp",
    "GroupCommitWriter",
    "PendingStage",
    "Settle",
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FollowUp:
    """A write sent right behind one stage: in its round trip, on its node (its keys share the record's slot), after
    its slot's script call and before the node's durable confirmation, which therefore covers both. The writer sets
    ``reply`` and ``unconfirmed`` before the stage's result; a follow-up whose stage was never sent keeps ``sent``
    ``False``. Its outcome is its owner's to read: it never changes the stage's result.

    The capture ledger's custody row rides on its call's stage this way (contract §6.6: one durable round per captured
    call); the row's script appends only when the record is stored, so a failed stage leaves no row behind.
    """

    call: BatchCall
    sent: bool = False
    reply: Any = None
    """The call's reply, or the exception it met (a refusal, an unreachable node)."""
    unconfirmed: str | None = None
    """Why the node did not confirm the round durable (the call ran, but is not acknowledged)."""


@dataclass(slots=True)
class PendingStage:
    """One queued stage: its key, encoded blob, ``calls`` entry values and the slot for its result."""

    staging_key: str
    record_key: str
    calls_key: str
    fence_key: str
    incoming_key: str
    digest: str
    blob: bytes
    entry: tuple[str, ...]
    then: FollowUp | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    result: StageResult | None = None
    outcome: StageOutcome | None = None

    @property
    def route_key(self) -> str:
        return self.record_key

    def finish(self, result: StageResult, outcome: StageOutcome) -> None:
        """Set the result once and wake the caller (later calls are ignored)."""
        if self.result is None:
            self.result = result
            self.outcome = outcome
            self.done.set()


class Committable(Protocol):
    """What the group commit needs of a queued write: the key that routes it, and whether it is settled."""

    @property
    def route_key(self) -> str: ...

    @property
    def result(self) -> object: ...


_Item = TypeVar("_Item", bound=Committable)


@dataclass(frozen=True, slots=True)
class BatchScript(Generic[_Item]):
    """How a batch of one slot's queued writes becomes one script call: the script, the ``ARGV`` that comes
    first (from the settings), and each item's ``KEYS`` and ``ARGV``. The script returns one reply per item.

    ``reads`` (optional): plain read commands of an item, queued right after its slot's script call in the same
    round trip (so a large read is not copied through the script); their replies are appended to the item's
    script reply, in order. They run after the script, not atomically with it.

    ``values`` (optional): the large values an item writes, as ``(key, value)`` pairs. Each goes with a plain
    ``SET`` (expiring after :data:`INCOMING_EXPIRY_MS`) ahead of its slot's script call, in one ``MULTI``/``EXEC``
    with it, so a value never passes through the script: the script moves it into place (``RENAME``) or deletes it.

    ``then`` (optional): an item's :class:`FollowUp`, sent after its slot's script call (and reads) in the same round
    trip, under the same confirmation.
    """

    script: ServerScript
    head: Callable[[SinkSettings], Sequence[Any]]
    item: Callable[[_Item], tuple[Sequence[str], Sequence[Any]]]
    reads: Callable[[_Item], Sequence[Sequence[Any]]] | None = None
    values: Callable[[_Item], Sequence[tuple[str, bytes]]] | None = None
    then: Callable[[_Item], FollowUp | None] | None = None


def _stage_head(settings: SinkSettings) -> list[Any]:
    return [DIGEST_HEAD_BYTES]


def _stage_item(p: PendingStage) -> tuple[Sequence[str], Sequence[Any]]:
    return (p.record_key, p.calls_key, p.fence_key, p.incoming_key), (p.digest, *p.entry)


def _stage_values(p: PendingStage) -> Sequence[tuple[str, bytes]]:
    return ((p.incoming_key, p.blob),)


def _stage_then(p: PendingStage) -> FollowUp | None:
    return p.then


STAGE_BATCH: BatchScript[PendingStage] = BatchScript(
    STAGE_SCRIPT, _stage_head, _stage_item, values=_stage_values, then=_stage_then
)
"""The staging sink's batch: :data:`STAGE_SCRIPT` over :class:`PendingStage` s, each blob sent as a plain value."""

INCOMING_EXPIRY_MS = 600_000
"""The expiry of a value written ahead of its script (:attr:`BatchScript.values`). The script moves or deletes every
such value in the same transaction; the expiry only removes one whose script did not run (the function library was
missing and could not be loaded again), 10 minutes later."""

MAX_BATCH_VALUE_BYTES = 1 << 20
"""A writer stops adding queued items to a batch once their values (:attr:`BatchScript.values`: the record blobs)
reach this many bytes, so a large record goes alone or with a few others. The server copies a transaction's writes
into its append-only file buffer, and that copying grows faster than the transaction: 16 stagers of 1.2 MB records
sent in one transaction of everything queued cost the server 1.4-2.0x a plain ``SET``'s CPU per record, in batches
bounded by this 0.9-1.2x (``staging-sink bench stage``, docs/performance.md). Small records still share one
transaction and one fsync (a 2,048-token record is about 19 KB)."""

Settle = Callable[[_Item, Any, str | None], None]
"""Settles one unsettled item: ``(item, its script reply or None when nothing ran, error or None)``."""


class GroupCommitWriter(Generic[_Item]):
    """Writes queued items in batches (one :class:`BatchScript` call per slot, then the durability
    confirmation); every item it takes is settled exactly once."""

    def __init__(
        self,
        topology: Topology,
        settings: SinkSettings,
        durability: DurabilityMonitor,
        settle: Settle[_Item],
        batch_script: BatchScript[_Item],
    ) -> None:
        self._topology = topology
        self._settings = settings
        self._durability = durability
        self._settle = settle
        self._batch_script = batch_script
        self.batches = 0

    async def run(self, receive: MemoryObjectReceiveStream[_Item]) -> None:
        """Write batches of what *receive* delivers until it is closed and drained."""
        async with receive:
            async for first in receive:
                batch = [first]
                size = self._value_bytes(first)
                while len(batch) < self._settings.max_batch_records and size < MAX_BATCH_VALUE_BYTES:
                    try:
                        item = receive.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    batch.append(item)
                    size += self._value_bytes(item)
                await self.write_batch(batch)

    def _value_bytes(self, item: _Item) -> int:
        values = self._batch_script.values
        return 0 if values is None else sum(len(value) for _key, value in values(item))

    async def write_batch(self, batch: list[_Item]) -> None:
        """Write *batch* (one script call per slot, then each node's confirmation) and settle every item of it.

        It goes through the one durable write path (:func:`~sink.store.batch.send_calls`): items the cluster did not
        run because its topology changed (a failover, a slot migration) are written again once the slot map is
        reloaded, for up to ``command_timeout_s``; then they fail with "cluster topology changed, retry".

        :meth:`run` calls it for each batch it forms; a caller that forms batches itself (the Gym transport,
        which has no writer tasks of its own) calls it directly.
        """
        self.batches += 1
        try:
            await self._write(batch)
        except Exception as exc:  # a bug must not strand callers waiting on their event
            logger.exception("staging sink writer failed")
            self._fail_all(batch, f"internal error: {describe_redis_error(exc)}")
        finally:
            self._fail_all(batch, "the write was interrupted before it was confirmed")

    async def _write(self, batch: list[_Item]) -> None:
        settings = self._settings
        batch_script = self._batch_script
        # One call per slot (every item's keys and arguments after the head), each followed by its items' reads.
        calls: list[BatchCall] = []
        slots: list[tuple[int, list[_Item], list[int]]] = []  # (its call's index, its items, reads per item)
        follow_ups: list[tuple[int, FollowUp]] = []  # (its call's index, the follow-up)
        for indices in self._topology.group_by_slot([item.route_key for item in batch]).values():
            chunk = [batch[i] for i in indices]
            keys: list[str] = []
            args: list[Any] = list(batch_script.head(settings))
            before: list[tuple[Any, ...]] = []
            for item in chunk:
                item_keys, item_args = batch_script.item(item)
                keys += item_keys
                args += item_args
                if batch_script.values is not None:
                    before += [
                        ("SET", key, value, "PX", INCOMING_EXPIRY_MS) for key, value in batch_script.values(item)
                    ]
            slots.append((len(calls), chunk, []))
            calls.append(BatchCall(keys, args, batch_script.script, atomic=bool(before), before=before))
            for item in chunk:
                reads = batch_script.reads(item) if batch_script.reads is not None else ()
                slots[-1][2].append(len(reads))
                calls += [BatchCall([keys[0]], command) for command in reads]
            for item in chunk:
                then = batch_script.then(item) if batch_script.then is not None else None
                if then is not None:
                    follow_ups.append((len(calls), then))
                    calls.append(then.call)
        confirmation = Confirmation(
            timeout_s=settings.confirm_timeout_s,
            waitaof=self._durability.supports_waitaof,
            # The persistence settings, read back in the same round trip, after the writes: a configuration
            # changed since the last check fails this batch, not one durability_check_interval_s later.
            config=settings.durability == "fsync",
            replicas=settings.min_replicas,
            # A server with WAITAOF (Redis >= 7.2, every Valkey) takes every name in one CONFIG GET (Redis >= 7.0).
            config_in_one_get=self._durability.supports_waitaof,
        )
        sent = await send_calls(
            self._topology,
            calls,
            confirmation=None if confirmation.empty else confirmation,
            redirect_budget_s=settings.command_timeout_s,
        )
        for position, then in follow_ups:  # before the stages settle: a stage's waiter reads its follow-up
            then.sent, then.reply, then.unconfirmed = True, sent[position].reply, sent[position].unconfirmed
        for position, chunk, read_counts in slots:
            self._settle_slot(chunk, sent[position], sent[position + 1 : position + 1 + sum(read_counts)], read_counts)

    def _settle_slot(self, chunk: list[_Item], script: Sent, reads: list[Sent], read_counts: list[int]) -> None:
        """Settle one slot's items from its script call's result and its items' reads."""
        reply = script.reply
        if isinstance(reply, BaseException):
            changed = "cluster topology changed, retry: " if is_topology_reply(reply) else ""
            self._fail_all(chunk, changed + describe_redis_error(reply))
            return
        if script.config_problem and script.unconfirmed is not None:
            self._durability.invalidate(script.unconfirmed)
        start = 0
        for item, item_reply, count in zip(chunk, reply, read_counts, strict=True):
            item_reads = reads[start : start + count]
            start += count
            failed = next((read.reply for read in item_reads if isinstance(read.reply, BaseException)), None)
            if failed is not None:
                self._settle(item, None, f"a read after the script failed: {describe_redis_error(failed)}")
            elif count:
                self._settle(item, [*item_reply, *(read.reply for read in item_reads)], script.unconfirmed)
            else:
                self._settle(item, item_reply, script.unconfirmed)

    def _fail_all(self, items: Sequence[_Item], error: str) -> None:
        for pending in items:
            if pending.result is None:
                self._settle(pending, None, error)
