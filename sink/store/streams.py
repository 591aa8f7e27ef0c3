"""Consumer-group machinery shared by the assembler and the trainer reader.

Both services consume sharded streams (``ns:done:<k>``, ``ns:receipts:<k>``) through a Redis consumer group.
The delivery guarantee is **at least once**:

* an entry is acknowledged only after the work it triggered is durable, and the acknowledgement is ``XACK``
  plus ``XDEL`` of the same ids in one ``MULTI`` on the stream's own slot, itself confirmed durable in its
  round trip (:func:`~sink.store.batch.write_durably`), so acknowledged entries never pile up and an
  unacknowledged entry is never trimmed or deleted (nothing here ever runs ``XTRIM``/``MAXLEN``);
* entries left pending by a consumer that died are reclaimed by any live one with ``XAUTOCLAIM`` once idle
  for ``claim_idle_ms``;
* an entry delivered more than ``max_deliveries`` times is copied to ``ns:dead:<role>-<shard>`` and only then
  acknowledged, so a poison entry cannot crash consumers forever and is never lost;
* a consumer is deleted from its group only if it owns no pending entry.

Each stream uses exactly one consumer group: ``XDEL`` after ``XACK`` would remove entries another group has
not read yet. In a cluster every shard stream hashes to its own slot, so every command here names one stream;
only on a single server does one ``XREADGROUP`` cover several shards.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.client import Pipeline

from sink.errors import CodecError
from sink.keys import dead_letter_stream
from sink.store.batch import BatchCall, raise_first_error, run_batch, write_durably
from sink.store.connection import Topology, reply_text
from sink.store.dead_letters import UndecodableEntry, dead_letter_record
from sink.store.durability import Durability
from sink.store.pipeline_counters import count_dead_letter
from sink.store.scripts import RETIRE_CONSUMER_SCRIPT, TOUCH_SCRIPT, RemovalStatus
from sink.tasks import task_group

__all__ = ("GroupConsumer", "StreamEntry", "default_consumer_name")

logger = logging.getLogger(__name__)

_NAME_JUNK = re.compile(r"[^A-Za-z0-9._-]+")


def default_consumer_name() -> str:
    """A consumer name unique to this process: ``<host>-<pid>-<random>``."""
    host = _NAME_JUNK.sub("-", socket.gethostname()).strip("-") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One delivered stream entry: where it lives, its fields, and how often it was delivered."""

    stream: str
    shard: int
    entry_id: str
    fields: dict[str, str]
    deliveries: int


class GroupConsumer:
    """One consumer in one consumer group over a list of shard streams (index = shard).

    It borrows *topology*. Counters (``read``, ``reclaimed``, ``acked``, ``dead_lettered``) are plain attributes
    for the owning service's statistics. Every method raises :class:`~sink.errors.StagingConnectionError` when
    the server cannot be reached or refuses a command (:class:`~sink.errors.NotDurableError`: not durable).
    """

    def __init__(
        self,
        topology: Topology,
        *,
        namespace: str,
        role: str,
        streams: Sequence[str],
        group: str,
        consumer: str,
        claim_idle_ms: int,
        max_deliveries: int,
        durability: Durability = "fsync",
        confirm_timeout_s: float = 5.0,
    ) -> None:
        self._topology = topology
        self._durability, self._confirm_timeout_s = durability, confirm_timeout_s
        self._namespace = namespace
        self._role = role
        self.streams = tuple(streams)
        self.group = group
        self.consumer = consumer
        self._claim_idle_ms = claim_idle_ms
        self._max_deliveries = max_deliveries
        self._claim_cursor = ["0-0"] * len(self.streams)
        self._shard_of_stream = {stream: shard for shard, stream in enumerate(self.streams)}
        self._suspect: set[int] = set()
        self._undecodable: list[UndecodableEntry] = []
        self.read = self.reclaimed = self.acked = self.dead_lettered = 0

    def _client(self, shard: int) -> aioredis.Redis:
        return self._topology.node_for_key(self.streams[shard])

    async def _write(self, call: BatchCall, action: str) -> Any:
        """An acknowledged write, answered only once durable (:func:`~sink.store.batch.write_durably`)."""
        async with self._topology.translated(action):
            return await write_durably(
                self._topology, call, durability=self._durability, timeout_s=self._confirm_timeout_s, action=action
            )

    # --- setup -------------------------------------------------------------------

    async def prepare(self) -> None:
        """Load the cluster topology, then :meth:`ensure_groups` (a service's ``async with`` entry)."""
        async with self._topology.translated("load the cluster topology"):
            await self._topology.initialize()
        await self.ensure_groups()

    async def ensure_groups(self) -> None:
        """``XGROUP CREATE <stream> <group> 0 MKSTREAM`` on every shard; an existing group is kept."""
        async with self._topology.translated(f"create consumer group {self.group!r}"):
            for shard, stream in enumerate(self.streams):
                try:
                    # Start at 0: events written before the group existed are delivered too.
                    await self._client(shard).xgroup_create(stream, self.group, id="0", mkstream=True)
                except redis_errors.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    # --- reading -----------------------------------------------------------------

    def _entries(self, shard: int, raw: Iterable[Any], deliveries: int) -> list[StreamEntry]:
        """Decode *raw* entries; an entry that is not UTF-8 text is set aside for :meth:`reject_undecodable`."""
        entries = []
        for entry_id, fields in raw:
            if fields is None:
                continue  # history of an entry deleted after delivery; nothing to process
            entry_text = reply_text(entry_id, "stream entry")
            try:
                decoded = {reply_text(k, "stream entry"): reply_text(v, "stream entry") for k, v in fields.items()}
            except CodecError as exc:
                self._undecodable.append(UndecodableEntry(shard, entry_text, dict(fields), deliveries, str(exc)))
                continue
            entries.append(StreamEntry(self.streams[shard], shard, entry_text, decoded, deliveries))
        return entries

    def _parse_read(self, reply: Any, deliveries: int) -> tuple[list[StreamEntry], list[str]]:
        """Entries of an ``XREADGROUP`` reply, and every raw id it held (deleted entries included)."""
        items = reply.items() if isinstance(reply, dict) else (reply or [])
        entries: list[StreamEntry] = []
        raw_ids: list[str] = []
        for stream, raw in items:
            raw_ids.extend(reply_text(entry_id, "stream entry") for entry_id, _fields in raw or [])
            shard = self._shard_of_stream[reply_text(stream, "stream entry")]
            entries.extend(self._entries(shard, raw or [], deliveries))
        return entries, raw_ids

    async def reject_undecodable(self) -> int:
        """Dead-letter every entry read so far that was not UTF-8 text (its raw bytes are kept). The read methods
        call this before returning, so a consumer never sees such an entry and one undecodable entry never stops it.

        :returns: how many entries were dead-lettered.
        """
        rejected, self._undecodable = self._undecodable, []
        for item in rejected:
            stream = self.streams[item.shard]
            await self._copy_to_dead_letter(
                item.shard, stream, item.entry_id, item.fields, item.deliveries, f"undecodable entry: {item.reason}"
            )
            await self._ack_ids(stream, [item.entry_id])
        return len(rejected)

    async def read_new(self, shards: Sequence[int], *, count: int, block_ms: int | None) -> list[StreamEntry]:
        """New entries (``>``) for this consumer, up to *count* per shard.

        On a single server one ``XREADGROUP`` covers every shard and returns as soon as any has entries. In a
        cluster each shard is read with its own command, concurrently; with *block_ms* the first shard that
        delivers ends the wait and the other reads are cancelled. A read that was cancelled or failed (a lost
        connection, a failover's ``MOVED`` or ``UNBLOCKED``) may have been served by the server already: its
        entries stay pending for this consumer and its shard is :meth:`suspect <suspect_shards>` until
        :meth:`read_own_pending` reads it.

        :param block_ms: ``None`` or ``0`` for a non-blocking read.
        """
        block = block_ms or None
        if not shards:
            return []
        if not self._topology.is_cluster or len(shards) == 1:
            client = self._client(shards[0])
            streams: dict[Any, Any] = {self.streams[shard]: ">" for shard in shards}
            try:
                async with self._topology.translated(f"read {self._role} streams"):
                    reply = await client.xreadgroup(self.group, self.consumer, streams, count=count, block=block)
            except BaseException:
                self._suspect.update(shards)
                raise
            entries, _ = self._parse_read(reply, 1)
        else:
            entries = await self._read_cluster(shards, count=count, block=block)
        self.read += len(entries)
        await self.reject_undecodable()
        return entries

    async def _read_cluster(self, shards: Sequence[int], *, count: int, block: int | None) -> list[StreamEntry]:
        entries: list[StreamEntry] = []
        unfinished = set(shards)

        async def read_one(shard: int, scope: anyio.CancelScope) -> None:
            async with self._topology.translated(f"read {self.streams[shard]}"):
                reply = await self._client(shard).xreadgroup(
                    self.group, self.consumer, {self.streams[shard]: ">"}, count=count, block=block
                )
            unfinished.discard(shard)
            got, _ = self._parse_read(reply, 1)
            entries.extend(got)
            if got and block is not None:
                scope.cancel()  # the first shard that delivers ends the wait

        try:
            async with task_group() as group:  # a failure is one typed error, as a single server's read raises
                for shard in shards:
                    group.start_soon(read_one, shard, group.cancel_scope)
        except BaseException:
            # What the shards that answered delivered goes with the failure: pending for us, read again later.
            self._suspect.update(shards)
            raise
        self._suspect |= unfinished
        return entries

    def suspect_shards(self) -> list[int]:
        """Shards whose read of new entries was cancelled or failed, not read by :meth:`read_own_pending` since."""
        return sorted(self._suspect)

    async def read_own_pending(self, shard: int, *, count: int = 256) -> list[StreamEntry]:
        """Every entry pending for this consumer on *shard* (``XREADGROUP ... 0``), e.g. after a restart.

        Reading history counts as a delivery; entries past ``max_deliveries`` are dead-lettered, not returned.
        """
        collected: list[StreamEntry] = []
        start = "0"
        async with self._topology.translated(f"read own pending entries of {self.streams[shard]}"):
            while True:
                reply = await self._client(shard).xreadgroup(
                    self.group, self.consumer, {self.streams[shard]: start}, count=count
                )
                batch, raw_ids = self._parse_read(reply, 1)
                collected.extend(batch)
                if len(raw_ids) < count:
                    break
                start = raw_ids[-1]
        self._suspect.discard(shard)
        await self.reject_undecodable()
        return await self._screen(shard, collected)

    async def reclaim(self, shard: int, *, count: int, full_pass: bool = True) -> list[StreamEntry]:
        """``XAUTOCLAIM`` entries idle longer than ``claim_idle_ms`` (from any consumer) on *shard*, until *count* or
        a full pass over the pending list (``full_pass=False``: one ``XAUTOCLAIM``, from where the last stopped).

        Entries past ``max_deliveries`` are dead-lettered and not returned.
        """
        client = self._client(shard)
        claimed: list[StreamEntry] = []
        calls = 0
        async with self._topology.translated(f"reclaim idle entries of {self.streams[shard]}"):
            while len(claimed) < count and (full_pass or calls == 0):
                calls += 1
                cursor, raw, *_deleted = await client.xautoclaim(
                    self.streams[shard],
                    self.group,
                    self.consumer,
                    self._claim_idle_ms,
                    start_id=self._claim_cursor[shard],
                    count=count - len(claimed),
                )
                self._claim_cursor[shard] = reply_text(cursor, "stream entry")
                claimed.extend(self._entries(shard, raw, 0))
                if self._claim_cursor[shard] == "0-0":
                    break  # one full pass over the pending list
        await self.reject_undecodable()
        if not claimed:
            return []
        self.reclaimed += len(claimed)
        logger.info("%s reclaimed %d idle entries of %s", self.consumer, len(claimed), self.streams[shard])
        return await self._screen(shard, claimed)

    async def _screen(self, shard: int, entries: list[StreamEntry]) -> list[StreamEntry]:
        """Attach delivery counts (``XPENDING`` per id, one pipeline); dead-letter entries past the limit."""
        if not entries:
            return []
        async with self._topology.translated(f"read delivery counts of {self.streams[shard]}"):
            pipe = self._client(shard).pipeline(transaction=False)
            for entry in entries:
                pipe.xpending_range(entry.stream, self.group, entry.entry_id, entry.entry_id, 1)
            replies = await pipe.execute()
        kept: list[StreamEntry] = []
        for entry, reply in zip(entries, replies, strict=True):
            deliveries = int(reply[0]["times_delivered"]) if reply else 1
            counted = StreamEntry(entry.stream, entry.shard, entry.entry_id, entry.fields, deliveries)
            if deliveries > self._max_deliveries:
                await self.dead_letter(counted, f"delivered {deliveries} times (max_deliveries={self._max_deliveries})")
            else:
                kept.append(counted)
        return kept

    # --- settling ----------------------------------------------------------------

    async def ack(self, entries: Sequence[StreamEntry]) -> int:
        """Acknowledge and delete *entries*: ``XACK`` + ``XDEL`` of the same ids in one ``MULTI`` per stream.

        Runs shielded from cancellation, so a settled batch is never half-acknowledged.

        :returns: how many entries were still pending (``XACK``'s count).
        """
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry.entry_id)
        acked = 0
        with anyio.CancelScope(shield=True):
            for stream, ids in by_stream.items():
                acked += await self._ack_ids(stream, ids)
        return acked

    async def _ack_ids(self, stream: str, ids: list[str]) -> int:

        def queue(pipe: Pipeline) -> None:
            pipe.xack(stream, self.group, *ids)
            pipe.xdel(stream, *ids)

        call = BatchCall([stream], commands=queue, atomic=True)
        with anyio.CancelScope(shield=True):
            xack_count, _deleted = await self._write(call, f"acknowledge {stream}")
        self.acked += int(xack_count)
        return int(xack_count)

    async def dead_letter(self, entry: StreamEntry, reason: str) -> None:
        """Copy *entry* to ``ns:dead:<role>-<shard>`` (with its origin and *reason*), then acknowledge it.

        The two streams live on different slots: a crash between the copy and
        the acknowledgement leaves the entry pending, so it may be copied twice,
        never lost.
        """
        await self._copy_to_dead_letter(
            entry.shard, entry.stream, entry.entry_id, entry.fields, entry.deliveries, reason
        )
        await self.ack([entry])

    async def _copy_to_dead_letter(
        self,
        shard: int,
        stream: str,
        entry_id: str,
        fields: Mapping[Any, Any],
        deliveries: int,
        reason: str,
    ) -> None:
        dead = dead_letter_stream(self._namespace, f"{self._role}-{shard}")
        record = dead_letter_record(
            fields, stream=stream, entry_id=entry_id, deliveries=deliveries, reason=reason, consumer=self.consumer
        )
        with anyio.CancelScope(shield=True):
            call = BatchCall([dead], commands=lambda pipe: pipe.xadd(dead, record))
            await self._write(call, f"dead-letter {stream} {entry_id}")
        logger.warning("dead-lettered %s %s to %s: %s", stream, entry_id, dead, str(record["dead_reason"])[:200])
        self.dead_lettered += 1
        count_dead_letter(self._namespace, self._role, shard)  # the dead-letters counter

    async def touch(self, entries: Sequence[StreamEntry]) -> list[StreamEntry]:
        """Reset the idle time of held *entries* so no other consumer reclaims them (a heartbeat).

        :returns: the entries this consumer no longer owns (reclaimed by another consumer after
            ``claim_idle_ms``, or already acknowledged).
        """
        by_stream: dict[str, list[StreamEntry]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry)
        ids = {stream: [entry.entry_id for entry in held] for stream, held in by_stream.items()}
        calls = [BatchCall([stream], [self.group, self.consumer, *held], TOUCH_SCRIPT) for stream, held in ids.items()]
        async with self._topology.translated(f"refresh held {self._role} entries"):
            replies = raise_first_error(await run_batch(self._topology, calls))  # one pipeline per node
        gone = {(stream, reply_text(value, "stream entry")) for stream, reply in zip(ids, replies, strict=True) for value in reply[1:]}
        return [entry for entry in entries if (entry.stream, entry.entry_id) in gone]

    async def retire_consumer(self) -> int:
        """Delete this consumer from the group on every shard where it owns no pending entry.

        :returns: on how many shards it was deleted.
        """
        deleted = 0
        with anyio.CancelScope(shield=True):
            async with self._topology.translated(f"retire consumer {self.consumer!r}"):
                for shard, stream in enumerate(self.streams):
                    reply = await RETIRE_CONSUMER_SCRIPT.run(self._client(shard), [stream], [self.group, self.consumer])
                    if reply[0] == RemovalStatus.REMOVED:
                        deleted += 1
        return deleted

    async def pending_count(self) -> int:
        """Entries pending in the group over every shard (all consumers)."""
        total = 0
        async with self._topology.translated(f"count pending {self._role} entries"):
            for shard, stream in enumerate(self.streams):
                summary = await self._client(shard).xpending(stream, self.group)
                total += int(summary["pending"])
        return total
