"""Which receipt entries a trainer reader consumes next (used by :class:`~sink.trainer.reader.RolloutReader`).

Order of sources: the reader's own pending entries after a restart (and on shards its consumer found suspect),
entries reclaimed from crashed readers (idle ``claim_idle_ms``, tried at most every ``reclaim_interval_s``), then
new receipts. Entries the reader already holds or has queued are never queued twice. :meth:`ReceiptBacklog.take_over`
moves named entries of other ranks to this reader (GRPO groups, :mod:`sink.trainer.groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sink.keys import receipts_stream
from sink.service import ReclaimSchedule
from sink.settings import ReaderSettings
from sink.store.connection import Topology, reply_text
from sink.store.healing import SelfHealingGroupConsumer
from sink.store.streams import StreamEntry
from sink.trainer.held import HeldRollouts

__all__ = ("TRAINER_GROUP", "ReceiptBacklog")

TRAINER_GROUP = "trainers"


def _text_fields(fields: Any) -> dict[str, str]:
    return {
        reply_text(key, "receipts entry"): reply_text(value, "receipts entry") for key, value in dict(fields).items()
    }


class ReceiptBacklog:
    """The queue of receipt entries in hand for one reader, not yet consumed."""

    def __init__(
        self,
        topology: Topology,
        settings: ReaderSettings,
        consumer: SelfHealingGroupConsumer,
        held: HeldRollouts,
    ) -> None:
        self._topology = topology
        self._settings = settings
        self._consumer = consumer
        self._held = held
        self._entries: list[StreamEntry] = []
        self._recovered = False
        self._reclaims = ReclaimSchedule(settings)

    async def take(self, wanted: int, *, block_ms: int) -> list[StreamEntry]:
        """Up to *wanted* entries, waiting up to *block_ms* for new receipts when there is nothing else."""
        await self._refill(wanted)
        if len(self._entries) < wanted:
            shards = list(range(self._settings.receipt_shards))
            self._entries += await self._consumer.read_new(
                shards, count=wanted - len(self._entries), block_ms=None if self._entries else block_ms
            )
        entries, self._entries = self._entries[:wanted], self._entries[wanted:]
        return entries

    def put_back(self, entries: list[StreamEntry], settled: set[tuple[str, str]]) -> None:
        """Keep *entries* not consumed (not in *settled*, not held) for the next :meth:`take`: still pending for us."""
        self._entries[:0] = [e for e in entries if (e.stream, e.entry_id) not in settled and not self._held.holds(e)]

    async def _refill(self, wanted: int) -> None:
        known = {(e.stream, e.entry_id) for e in self._entries}
        known |= self._held.entry_ids()
        consumer = self._consumer
        shards = list(range(self._settings.receipt_shards)) if not self._recovered else []
        shards += [s for s in consumer.take_suspect_shards() if s not in shards]
        found: list[StreamEntry] = []
        for shard in shards:
            found += await consumer.read_own_pending(shard)
        self._recovered = True
        if self._reclaims.due():
            for shard in range(self._settings.receipt_shards):
                if len(found) + len(self._entries) >= wanted:
                    break
                found += await consumer.reclaim(shard, count=wanted)
        for entry in found:
            if (entry.stream, entry.entry_id) not in known:
                known.add((entry.stream, entry.entry_id))
                self._entries.append(entry)

    async def take_over(self, tokens: Sequence[str]) -> list[StreamEntry]:
        """Move the receipt entries named by *tokens* (``<stream>#<entry id>``, pending under other ranks of the
        ``trainers`` group) to this reader (``XCLAIM``); an entry that is gone (acknowledged meanwhile) or already
        held is left out.

        :raises ValueError: a token does not name one of this reader's receipts streams.
        :raises StagingConnectionError: the server could not be reached.
        """
        ns = self._settings.namespace
        shard_of_stream = {receipts_stream(ns, s): s for s in range(self._settings.receipt_shards)}
        wanted: list[tuple[str, int, str]] = []
        for token in tokens:
            stream, _, entry_id = token.rpartition("#")
            if stream not in shard_of_stream or not entry_id:
                raise ValueError(f"not a receipt entry token of this reader: {token!r}")
            wanted.append((stream, shard_of_stream[stream], entry_id))
        entries: list[StreamEntry] = []
        async with self._topology.translated("take over receipt entries"):
            for stream, shard, entry_id in wanted:
                client = self._topology.node_for_key(stream)
                consumer = self._consumer.consumer
                reply: list[Any] = await client.xclaim(stream, TRAINER_GROUP, consumer, 0, [entry_id])
                for claimed_id, fields in reply or []:
                    if fields:
                        entries.append(
                            StreamEntry(
                                stream, shard, reply_text(claimed_id, "receipts entry"), _text_fields(fields), 1
                            )
                        )
        return [e for e in entries if not self._held.holds(e)]
