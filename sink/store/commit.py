"""The sink's group commit: queued stages written in batches, then confirmed.

Each of the sink's ``writer_connections`` :meth:`GroupCommitWriter.run` tasks
takes everything queued so far, writes it with one :class:`BatchScript` call per
cluster slot (the staging sink's :data:`STAGE_BATCH`, or the Gym transport's),
pipelined with ``WAIT``/``WAITAOF`` on one connection of the slot's primary,
and settles every item through its owner's callback. While one
batch waits for its fsync the next one forms, so one fsync covers many records.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from anyio.streams.memory import MemoryObjectReceiveStream

from sink.contract.codec import DIGEST_HEAD_BYTES
from sink.contract.records import StageResult
from sink.settings import SinkSettings
from sink.store.connection import Topology, describe_redis_error, is_topology_reply
from sink.store.durability import REQUIRED_CONFIG, DurabilityMonitor, config_problem, node_address, waitaof_problem
from sink.store.pipeline_counters import StageOutcome
from sink.store.scripts import LIBRARY, STAGE_SCRIPT
from sink.store.scripts.runner import ScriptMode, ServerScript

__all__ = ("STAGE_BATCH", "BatchScript", "Committable", "GroupCommitWriter", "PendingStage", "Settle")

logger = logging.getLogger(__name__)


class _ScriptMissingError(Exception):
    """A queued stage found neither the script nor the function on the server (nothing ran)."""

    def __init__(self, mode: ScriptMode, reply: BaseException) -> None:
        super().__init__(str(reply))
        self.mode = mode
        self.reply = reply


@dataclass(slots=True)
class PendingStage:
    """One queued stage: its key, encoded blob, ``calls`` entry values and the slot for its result."""

    staging_key: str
    record_key: str
    calls_key: str
    fence_key: str
    digest: str
    blob: bytes
    entry: tuple[str, ...]
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
    """

    script: ServerScript
    head: Callable[[SinkSettings], Sequence[Any]]
    item: Callable[[_Item], tuple[Sequence[str], Sequence[Any]]]
    reads: Callable[[_Item], Sequence[Sequence[Any]]] | None = None


def _stage_head(settings: SinkSettings) -> list[Any]:
    return [DIGEST_HEAD_BYTES, "1" if settings.min_replicas > 0 else "0"]


def _stage_item(p: PendingStage) -> tuple[Sequence[str], Sequence[Any]]:
    return (p.record_key, p.calls_key, p.fence_key), (p.digest, p.blob, *p.entry)


STAGE_BATCH: BatchScript[PendingStage] = BatchScript(STAGE_SCRIPT, _stage_head, _stage_item)
"""The staging sink's batch: :data:`STAGE_SCRIPT` over :class:`PendingStage` s."""

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
                while len(batch) < self._settings.max_batch_records:
                    try:
                        batch.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                await self.write_batch(batch)

    async def write_batch(self, batch: list[_Item]) -> None:
        """Write *batch* (one script call per slot, then the confirmation) and settle every item of it.

        Items the cluster did not run because its topology changed (``MOVED``, ``ASK``, ``READONLY``,
        ``TRYAGAIN``, ``CLUSTERDOWN``: a failover, a slot migration) are written again once the slot map is
        reloaded, for up to ``command_timeout_s``; then they fail with "cluster topology changed, retry".

        :meth:`run` calls it for each batch it forms; a caller that forms batches itself (the Gym transport,
        which has no writer tasks of its own) calls it directly.
        """
        self.batches += 1
        deadline = anyio.current_time() + self._settings.command_timeout_s
        pending = batch
        try:
            for tries in itertools.count():
                redirected: dict[int, str] = {}  # id(item) -> the topology reply it met (nothing of it ran)
                by_node: dict[int, tuple[aioredis.Redis, list[_Item]]] = {}
                try:
                    for item in pending:
                        client = self._topology.node_for_key(item.route_key)
                        by_node.setdefault(id(client), (client, []))[1].append(item)
                except (redis_errors.RedisError, OSError) as exc:
                    self._fail_all(pending, f"cannot route the write: {describe_redis_error(exc)}")
                    return
                async with anyio.create_task_group() as group:
                    for client, items in by_node.values():
                        group.start_soon(self._write_node, client, items, redirected)
                pending = [item for item in pending if id(item) in redirected and item.result is None]
                if not pending or not await self._topology.wait_for_redirect(deadline, tries):
                    for item in pending:
                        self._settle(item, None, f"cluster topology changed, retry: {redirected[id(item)]}")
                    return
        finally:
            self._fail_all(batch, "the write was interrupted before it was confirmed")

    async def _write_node(self, client: aioredis.Redis, items: list[_Item], redirected: dict[int, str]) -> None:
        """Write *items* on *client*'s node; the ones the cluster redirected are left unsettled in *redirected*."""
        try:
            await self._write_node_once(client, items, redirected)
        except _ScriptMissingError as missing:
            # The script cache is empty (server restarted) or the functions were flushed: nothing ran;
            # load (or probe the library again) and retry once.
            try:
                await self._batch_script.script.recover(client, missing.mode)
                await self._write_node_once(client, items, redirected)
            except _ScriptMissingError as again:
                self._fail_all(items, describe_redis_error(again.reply))
            except (redis_errors.RedisError, OSError) as exc:
                self._fail_all(items, describe_redis_error(exc))
        except (redis_errors.RedisError, OSError) as exc:
            if is_topology_reply(exc):  # before anything was sent: every item goes again
                redirected.update((id(item), describe_redis_error(exc)) for item in items if item.result is None)
                return
            self._fail_all(items, describe_redis_error(exc))
            if self._topology.is_cluster:
                await self._topology.refresh_quietly()
        except Exception as exc:  # a bug must not strand callers waiting on their event
            logger.exception("staging sink writer failed")
            self._fail_all(items, f"internal error: {describe_redis_error(exc)}")

    async def _write_node_once(self, client: aioredis.Redis, items: list[_Item], redirected: dict[int, str]) -> None:
        groups = self._topology.group_by_slot([p.route_key for p in items])
        settings = self._settings
        mode = await LIBRARY.mode(client)
        timeout_ms = max(1, int(settings.confirm_timeout_s * 1000))
        pipe = client.pipeline(transaction=False)
        batch_script = self._batch_script
        slot_items: list[list[_Item]] = []
        slot_reads: list[list[int]] = []  # per slot: how many read commands follow each item's script reply
        for indices in groups.values():
            chunk = [items[i] for i in indices]
            slot_items.append(chunk)
            keys: list[str] = []
            args: list[Any] = list(batch_script.head(settings))
            for p in chunk:
                item_keys, item_args = batch_script.item(p)
                keys += item_keys
                args += item_args
            batch_script.script.queue(pipe, mode, keys, args)
            reads = [batch_script.reads(p) if batch_script.reads is not None else () for p in chunk]
            for commands in reads:
                for command in commands:
                    pipe.execute_command(*command)
            slot_reads.append([len(commands) for commands in reads])
        if settings.min_replicas > 0:
            pipe.execute_command("WAIT", settings.min_replicas, timeout_ms)
        waitaof = self._durability.supports_waitaof
        if waitaof:
            pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
        # The persistence settings, read back in the same round trip, after the writes: a configuration
        # changed since the last check fails this batch, not one durability_check_interval_s later.
        check_config = settings.durability == "fsync"
        if check_config:
            for name in REQUIRED_CONFIG:
                pipe.config_get(name)  # one name per CONFIG GET: Redis 6.2 takes a single pattern
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if ServerScript.missing(reply):
                raise _ScriptMissingError(mode, reply)
        script_replies: list[Any] = []
        read_replies: list[list[Any]] = []
        position = 0
        for counts in slot_reads:
            script_replies.append(replies[position])
            read_replies.append(replies[position + 1 : position + 1 + sum(counts)])
            position += 1 + sum(counts)
        confirmation_error = self._confirmation_error(replies[position:], waitaof)
        if check_config:
            problem = config_problem(node_address(client), replies[len(replies) - len(REQUIRED_CONFIG) :])
            if problem is not None:
                self._durability.invalidate(problem)
                confirmation_error = confirmation_error or problem
        read_failed = False
        for chunk, reply, counts, reads in zip(slot_items, script_replies, slot_reads, read_replies, strict=True):
            if is_topology_reply(reply):  # the script did not run: written again once the slot map is reloaded
                redirected.update((id(item), describe_redis_error(reply)) for item in chunk)
                continue
            if isinstance(reply, BaseException):
                self._fail_all(chunk, LIBRARY.explain_refusal(client, mode, reply) or describe_redis_error(reply))
                continue
            start = 0
            for pending, item_reply, count in zip(chunk, reply, counts, strict=True):
                item_reads = reads[start : start + count]
                start += count
                failed = next((r for r in item_reads if isinstance(r, BaseException)), None)
                if failed is not None:
                    read_failed |= is_topology_reply(failed)
                    self._settle(pending, None, f"a read after the script failed: {describe_redis_error(failed)}")
                elif count:
                    self._settle(pending, [*item_reply, *item_reads], confirmation_error)
                else:
                    self._settle(pending, item_reply, confirmation_error)
        if read_failed:
            await self._topology.refresh_quietly()

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
            return waitaof_problem(replies[position])
        return None

    def _fail_all(self, items: Sequence[_Item], error: str) -> None:
        for pending in items:
            if pending.result is None:
                self._settle(pending, None, error)
