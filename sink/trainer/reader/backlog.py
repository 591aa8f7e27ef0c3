"""Which receipt entries a trainer reader consumes next (used by :class:`~sink.trainer.reader.rollout_reader.RolloutReader`).

Order of sources: the reader's own pending entries after a restart (and on shards its consumer found suspect),
entries reclaimed from crashed readers (idle ``claim_idle_ms``, tried every ``reclaim_interval_s``), then new
receipts, read shard after shard and no more than wanted, so a pull reads no more than it returns and nothing
waits in one reader's hand while another has nothing. With nothing in hand and nothing new, a reader about to
wait reclaims first: entries another reader gave back (:meth:`ReceiptBacklog.give_back_unpulled`,
:meth:`ReceiptBacklog.give_back_held`: left pending, idle ``claim_idle_ms`` already) are taken then, not after a
lease. Entries the reader already holds or has queued are never queued twice. A GRPO group entry counts as many
rollouts as it names members, and a take returns whole entries (so it may return more rollouts than wanted); a
read asks for as many entries as the entries read last suggest (a reader's first read of new receipts probes with
one), so it reads no group entry it will not return.
"""

from __future__ import annotations

import math

from sink.service import ReclaimSchedule
from sink.settings import ReaderSettings
from sink.store.batch import BatchCall, raise_first_error, run_batch
from sink.store.connection import Topology
from sink.store.healing import SelfHealingGroupConsumer
from sink.store.scripts import GIVE_BACK_SCRIPT
from sink.store.streams import StreamEntry
from sink.trainer.reader.held import HeldRollouts

__all__ = ("TRAINER_GROUP", "ReceiptBacklog", "rollouts_of")

TRAINER_GROUP = "trainers"


def rollouts_of(entry: StreamEntry) -> int:
    """How many rollouts *entry* delivers: a group entry's members, else one."""
    members = entry.fields.get("group_members")
    return members.count(",") + 1 if members else 1


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
        self._first_shard = 0  # where the next read of new receipts starts (one further each time)
        self._per_entry: float | None = None  # rollouts per entry, as the last entries read held (None: none read)

    async def take(self, wanted: int, *, block_ms: int) -> list[StreamEntry]:
        """Entries of up to *wanted* rollouts (whole entries: a group entry may pass it), waiting up to *block_ms*
        for new receipts when there is nothing else.

        Only the wait may read more than *wanted* (receipts arriving on several shards at once): the rest stays
        in hand for the next take, or goes back with :meth:`give_back_unpulled`.
        """
        await self._refill(wanted)
        if self._in_hand() < wanted:
            await self._read_new(wanted)
        if not self._entries and block_ms:
            await self._reclaim(wanted, full_pass=False)  # given back by another reader: at once, not after a lease
            if not self._entries:
                shards = list(range(self._settings.receipt_shards))
                count = self._entries_for(wanted)
                self._keep(await self._consumer.read_new(shards, count=count, block_ms=block_ms))
        count = taken = 0
        while count < len(self._entries) and taken < wanted:  # whole entries: a group entry may pass wanted
            taken += rollouts_of(self._entries[count])
            count += 1
        entries, self._entries = self._entries[:count], self._entries[count:]
        return entries

    async def give_back_unpulled(self) -> int:
        """Give back the entries in hand that no take returned (the rest of a wait that read more than wanted, own
        pending entries after a restart): pending in the group, idle ``claim_idle_ms`` already, with the delivery
        count they had before this reader read them, so the next reader about to wait takes them at once, and not
        as a double delivery. :returns: how many were given back."""
        entries, self._entries = self._entries, []
        return await self._give_back(entries, uncount=True)

    async def give_back_held(self) -> int:
        """Give up every held rollout, unacknowledged, the same way (its delivery counted: the next reader counts a
        double delivery, this one may have trained it); it is no longer this reader's to acknowledge.
        :returns: how many were given back (one another rank took over meanwhile is not counted)."""
        entries = self._held.entries()
        self._held.release(self._held.rollout_ids())
        return await self._give_back(entries, uncount=False)

    async def _give_back(self, entries: list[StreamEntry], *, uncount: bool) -> int:
        """One script per stream: each entry still pending for this reader made idle ``claim_idle_ms``, with its
        delivery count (less this reader's read, with *uncount*)."""
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            count = entry.deliveries - 1 if uncount else entry.deliveries
            by_stream.setdefault(entry.stream, []).extend([entry.entry_id, str(max(count, 0))])
        consumer = self._consumer
        prefix = [consumer.group, consumer.consumer, self._settings.claim_idle_ms]
        calls = [BatchCall([stream], [*prefix, *pairs], GIVE_BACK_SCRIPT) for stream, pairs in by_stream.items()]
        if not calls:
            return 0
        async with self._topology.translated("give back receipt entries"):
            replies = raise_first_error(await run_batch(self._topology, calls))  # one pipeline per node
        return len(entries) - sum(len(reply) - 1 for reply in replies)  # a reply lists the ids not ours any more

    def put_back(self, entries: list[StreamEntry], settled: set[tuple[str, str]]) -> None:
        """Keep *entries* not consumed (not in *settled*, not held) for the next :meth:`take`: still pending for us."""
        self._entries[:0] = [
            e for e in entries if (e.stream, e.entry_id) not in settled and not self._held.holds_entry(e)
        ]

    async def _refill(self, wanted: int) -> None:
        consumer = self._consumer
        shards = list(range(self._settings.receipt_shards)) if not self._recovered else []
        shards += [s for s in consumer.suspect_shards() if s not in shards]
        for shard in shards:
            self._keep(await consumer.read_own_pending(shard))
        self._recovered = True
        if self._reclaims.due():
            await self._reclaim(wanted, full_pass=True)

    async def _read_new(self, wanted: int) -> None:
        """New receipts without waiting, shard after shard, until *wanted* are in hand. Each shard's are kept as
        they come: when a later shard's read fails, the earlier ones' are served already (pending for us)."""
        shards = self._settings.receipt_shards
        first, self._first_shard = self._first_shard, (self._first_shard + 1) % shards  # no shard always read last
        for step in range(shards):
            shard = (first + step) % shards
            while self._in_hand() < wanted:
                count = self._entries_for(wanted - self._in_hand(), probe=True)
                found = await self._consumer.read_new([shard], count=count, block_ms=None)
                self._keep(found)
                if len(found) < count:
                    break  # the shard has no more
            if self._in_hand() >= wanted:
                break

    async def _reclaim(self, wanted: int, *, full_pass: bool) -> None:
        """Reclaim entries idle past ``claim_idle_ms`` until *wanted* are in hand."""
        for shard in range(self._settings.receipt_shards):
            missing = wanted - self._in_hand()
            if missing <= 0:
                break
            self._keep(await self._consumer.reclaim(shard, count=self._entries_for(missing), full_pass=full_pass))

    def _in_hand(self) -> int:
        """Rollouts the entries in hand deliver."""
        return sum(rollouts_of(entry) for entry in self._entries)

    def _entries_for(self, missing: int, *, probe: bool = False) -> int:
        """How many entries to read for *missing* rollouts, so a read takes no more than a take returns: as many
        as the last entries read suggest (a group entry holds its members). While none was read: one to *probe*
        (a read of new receipts goes on once it knows), else one entry per rollout."""
        if self._per_entry is None:
            return 1 if probe else missing
        return max(1, math.ceil(missing / self._per_entry))

    def _keep(self, found: list[StreamEntry]) -> None:
        """Queue the entries of *found* neither queued nor held already."""
        if found:
            self._per_entry = sum(rollouts_of(entry) for entry in found) / len(found)
        known = {(e.stream, e.entry_id) for e in self._entries} | self._held.entry_ids()
        for entry in found:
            if (entry.stream, entry.entry_id) not in known:
                known.add((entry.stream, entry.entry_id))
                self._entries.append(entry)
