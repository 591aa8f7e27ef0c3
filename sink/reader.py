"""The trainer's per-rollout reader: receipts in, verified training rows out (contract §7.1 steps 5-6, §8).

:class:`RolloutReader` consumes ``ns:receipts:<k>`` in consumer group
``trainers`` (one consumer name per rank). :meth:`RolloutReader.pull` returns
one :class:`~sink.pulled.PulledRollout` per rollout: trainable (receipt +
verified :class:`~sink.row.LinearizedRow`) or skipped (receipt + code +
reason); nothing is dropped silently. :meth:`RolloutReader.ack` then deletes the
staged records, retires the ledgers and acknowledges the entries.

Deduplication: a receipt can be published twice (an assembler crash between
publish and acknowledgement). Before consuming a rollout the reader claims it
with one script on the rollout's own slot: ``ns:{R}:claimed`` names the
receipt entry and reader that own the rollout; another entry for the same
rollout is acknowledged and dropped, across ranks too, and once a rollout was
consumed its ledger fence (left by ``retire``) marks every later duplicate.
The same entry redelivered after a reader crash (``XAUTOCLAIM``) takes the
claim over. Delivery is at least once: :meth:`~RolloutReader.heartbeat`
refreshes the rollouts a rank holds, and :meth:`~RolloutReader.pull` does so
when the last refresh is older than ``claim_idle_ms / 8`` (a lease renewed
well before it expires, without a round trip on every pull). A rank that
calls neither for longer than ``7/8 * claim_idle_ms`` may see its rollouts
reclaimed by another rank (ranks share one ``claim_idle_ms``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Self

import anyio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from .held import HeldRollouts, claim_rounds
from .held import entry_token as _token
from .keys import claim_key, fence_key, receipts_stream
from .ledger.redis import RedisCaptureLedger
from .pulled import CORRUPT_RECORD, MISSING_RECORD, PulledRollout, fetch_and_verify, parse_receipt_entry
from .reader_guards import AckOutcome, foreign_row_skip, own_keys
from .records import RolloutReceipt
from .settings import ReaderSettings, SourceSettings
from .store.connection import Topology, map_redis_errors
from .store.resource import AsyncResource, settings_or_fields
from .store.scripts import CLAIM_CLAIMED, CLAIM_RETIRED, CLAIM_SCRIPT, RELEASE_SCRIPT
from .store.sink import clear_staged
from .store.source import AsyncRedisStagingSource
from .store.streams import GroupConsumer, StreamEntry, default_consumer_name

__all__ = (
    "CORRUPT_RECORD",
    "MISSING_RECORD",
    "TRAINER_GROUP",
    "AckOutcome",
    "PulledRollout",
    "ReaderStatistics",
    "RolloutReader",
)

logger = logging.getLogger(__name__)

TRAINER_GROUP = "trainers"
# pull() refreshes held rollouts when the last refresh is older than claim_idle_ms / this.
_RENEWALS_PER_IDLE = 8


class ReaderStatistics(NamedTuple):
    """Counters of one :class:`RolloutReader` since it was opened; ``held`` = pulled, not yet acknowledged."""

    pulled: int
    trainable: int
    skipped: int
    duplicates_dropped: int
    acked: int
    reclaimed: int
    dead_lettered: int
    lost: int
    held: int
    double_deliveries: int = 0
    """Rollouts this reader claimed from an entry delivered before (another rank, or this one before a
    restart, may have trained them too)."""


class RolloutReader(AsyncResource):
    """Pulls verified training rows for one trainer rank (consumer group ``trainers``).

    ``from_url`` owns its client; the constructor borrows one. Use as an
    async context manager; rollouts still held at :meth:`aclose` stay
    pending (reclaimable). Methods raise
    :class:`~sink.errors.StagingConnectionError` when the server cannot be
    reached; entries in hand then stay pending and are retried by the next
    :meth:`pull`.
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, settings: ReaderSettings | None = None) -> None:
        parsed = settings or ReaderSettings()
        self._init(Topology.borrow(client, parsed), parsed)

    @classmethod
    def from_url(cls, url: str, settings: ReaderSettings | None = None, **fields: Any) -> Self:
        """Create a reader that owns its client; pass *settings* or :class:`ReaderSettings` fields.

        :raises pydantic.ValidationError: an unknown or invalid setting.
        """
        parsed = settings_or_fields(ReaderSettings, settings, fields)
        self = cls.__new__(cls)
        self._init(Topology.from_url(url, parsed), parsed)
        return self

    def _init(self, topology: Topology, settings: ReaderSettings) -> None:
        self._settings = settings
        self._topology = topology
        self._ns = settings.namespace
        client = topology.client
        self._ledger = RedisCaptureLedger(client, settings)
        source_settings = SourceSettings(
            namespace=self._ns,
            cluster=settings.cluster,
            connect_timeout_s=settings.connect_timeout_s,
            command_timeout_s=settings.command_timeout_s,
            max_record_bytes=settings.max_record_bytes,
        )
        self._source = AsyncRedisStagingSource(client, source_settings)
        self._consumer = GroupConsumer(
            topology,
            namespace=self._ns,
            role="receipts",
            streams=[receipts_stream(self._ns, shard) for shard in range(settings.receipt_shards)],
            group=TRAINER_GROUP,
            consumer=settings.consumer_name or default_consumer_name(),
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
        )
        self._held = HeldRollouts()
        self._backlog: list[StreamEntry] = []
        self._recovered = False
        self._next_claim_at = -math.inf
        self._touched_at = -math.inf
        self._counts = {"pulled": 0, "trainable": 0, "skipped": 0, "duplicates": 0, "lost": 0, "double": 0}
        self._lost_leases: set[str] = set()

    @property
    def consumer_name(self) -> str:
        """This reader's consumer name in the ``trainers`` group."""
        return self._consumer.consumer

    @property
    def held_rollouts(self) -> tuple[str, ...]:
        """Rollouts pulled by this reader and not yet acknowledged."""
        return self._held.rollout_ids()

    def statistics(self) -> ReaderStatistics:
        """Counters since open."""
        c, consumer = self._counts, self._consumer
        return ReaderStatistics(
            pulled=c["pulled"],
            trainable=c["trainable"],
            skipped=c["skipped"],
            duplicates_dropped=c["duplicates"],
            acked=consumer.acked,
            reclaimed=consumer.reclaimed,
            dead_lettered=consumer.dead_lettered,
            lost=c["lost"],
            held=len(self._held),
            double_deliveries=c["double"],
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<RolloutReader {self.consumer_name!r} pulled={s.pulled} trainable={s.trainable} skipped={s.skipped} "
            f"duplicates={s.duplicates_dropped} acked={s.acked} reclaimed={s.reclaimed} "
            f"dead={s.dead_lettered} held={s.held}>"
        )

    # --- lifecycle ----------------------------------------------------------------

    async def _open(self) -> None:
        await self._consumer.prepare()

    async def _close_resources(self) -> None:
        await self._source.aclose()
        await self._ledger.aclose()
        await self._topology.aclose()

    # --- pulling ------------------------------------------------------------------

    async def pull(self, max_rollouts: int, *, block_ms: int = 0) -> list[PulledRollout]:
        """Up to *max_rollouts* rollouts, each trainable or skipped, in delivery order.

        Order of sources: this reader's own pending entries after a restart,
        entries reclaimed from crashed readers (idle ``claim_idle_ms``), then
        new receipts, waiting up to *block_ms* when there is nothing else.
        Duplicates are acknowledged and dropped, so fewer rollouts (or none)
        may come back. Pulled rollouts are held until :meth:`ack`.

        :raises ValueError: *max_rollouts* < 1, or *block_ms* not shorter than ``command_timeout_s``.
        :raises StagingConnectionError: the server could not be reached.
        """
        if self._closed:
            raise RuntimeError("the reader is closed")
        if type(max_rollouts) is not int or max_rollouts < 1:
            raise ValueError(f"max_rollouts must be a positive int, got {max_rollouts!r}")
        if block_ms < 0 or block_ms >= self._settings.command_timeout_s * 1000:
            raise ValueError("block_ms must be >= 0 and shorter than command_timeout_s")
        if anyio.current_time() - self._touched_at >= self._settings.claim_idle_ms / _RENEWALS_PER_IDLE / 1000:
            await self.heartbeat()
        await self._refill_backlog(max_rollouts)
        if len(self._backlog) < max_rollouts:
            wanted = max_rollouts - len(self._backlog)
            shards = list(range(self._settings.receipt_shards))
            self._backlog += await self._consumer.read_new(
                shards, count=wanted, block_ms=None if self._backlog else block_ms
            )
        entries, self._backlog = self._backlog[:max_rollouts], self._backlog[max_rollouts:]
        settled: set[tuple[str, str]] = set()
        try:
            return await self._consume(entries, settled)
        except BaseException:
            # Not consumed: keep them for the next pull (they are still pending for us).
            self._backlog[:0] = [
                e for e in entries if (e.stream, e.entry_id) not in settled and not self._held.holds(e)
            ]
            raise

    async def heartbeat(self) -> int:
        """Keep held rollouts from being reclaimed by other ranks (``pull`` does this too).

        :returns: how many held rollouts were lost to another rank (idle past ``claim_idle_ms``).
        """
        self._touched_at = anyio.current_time()
        if not self._held:
            return 0
        return len(await self._drop_lost(self._held.entries()))

    async def _drop_lost(self, entries: list[StreamEntry]) -> list[str]:
        """Refresh *entries*' lease; forget (and remember) the rollouts another rank took over."""
        lost = self._held.drop_lost(await self._consumer.touch(entries))
        for rollout_id in lost:
            logger.warning(
                "reader %s lost rollout %r to another rank (idle past claim_idle_ms)", self.consumer_name, rollout_id
            )
        self._counts["lost"] += len(lost)
        self._lost_leases.update(lost)
        return lost

    async def _refill_backlog(self, wanted: int) -> None:
        known = {(e.stream, e.entry_id) for e in self._backlog}
        known |= self._held.entry_ids()
        consumer = self._consumer
        shards = list(range(self._settings.receipt_shards)) if not self._recovered else []
        shards += [s for s in consumer.take_suspect_shards() if s not in shards]
        found: list[StreamEntry] = []
        for shard in shards:
            found += await consumer.read_own_pending(shard)
        self._recovered = True
        if anyio.current_time() >= self._next_claim_at:
            self._next_claim_at = anyio.current_time() + self._settings.claim_idle_ms / 2000.0
            for shard in range(self._settings.receipt_shards):
                if len(found) + len(self._backlog) >= wanted:
                    break
                found += await consumer.reclaim(shard, count=wanted)
        for entry in found:
            if (entry.stream, entry.entry_id) not in known:
                known.add((entry.stream, entry.entry_id))
                self._backlog.append(entry)

    async def _consume(self, entries: list[StreamEntry], settled: set[tuple[str, str]]) -> list[PulledRollout]:
        """Parse, claim, fetch and verify *entries*; add the ones acknowledged here to *settled*."""
        parsed: list[tuple[StreamEntry, RolloutReceipt]] = []
        for entry in entries:
            try:
                receipt = parse_receipt_entry(entry.fields)
            except ValueError as exc:
                await self._consumer.dead_letter(entry, f"malformed receipt entry: {exc}")
                settled.add((entry.stream, entry.entry_id))
                continue
            parsed.append((entry, receipt))
        claimed = await self._claim_all(parsed, settled)
        results: list[PulledRollout | None] = [None] * len(claimed)
        limiter = anyio.CapacityLimiter(self._settings.fetch_concurrency)

        async def build(index: int, receipt: RolloutReceipt) -> None:
            async with limiter:
                results[index] = foreign_row_skip(receipt) or await fetch_and_verify(self._source, receipt)

        async with anyio.create_task_group() as group:
            for index, (_entry, receipt) in enumerate(claimed):
                group.start_soon(build, index, receipt)
        pulled: list[PulledRollout] = []
        for (entry, receipt), result in zip(claimed, results, strict=True):
            assert result is not None
            self._held.add(entry, receipt)
            self._counts["pulled"] += 1
            self._counts["trainable" if result.trainable else "skipped"] += 1
            pulled.append(result)
        return pulled

    async def _claim_all(
        self, parsed: list[tuple[StreamEntry, RolloutReceipt]], settled: set[tuple[str, str]]
    ) -> list[tuple[StreamEntry, RolloutReceipt]]:
        """Claim every parsed entry's rollout; return the claimed ones in delivery order.

        The first entry of each rollout claims concurrently with the other rollouts' (one round
        trip for all); a later entry of the same rollout in this pull claims after them, so the
        first entry in delivery order wins.
        """
        firsts, later = claim_rounds([receipt.rollout_id for _entry, receipt in parsed])
        won = [False] * len(parsed)

        async def claim(index: int) -> None:
            entry, receipt = parsed[index]
            won[index] = await self._claim(entry, receipt)

        async with anyio.create_task_group() as group:
            for index in firsts:
                group.start_soon(claim, index)
        for index in later:
            await claim(index)
        claimed = []
        for (entry, receipt), ours in zip(parsed, won, strict=True):
            if ours:
                claimed.append((entry, receipt))
            else:
                settled.add((entry.stream, entry.entry_id))
        return claimed

    async def _claim(self, entry: StreamEntry, receipt: RolloutReceipt) -> bool:
        """Claim *receipt*'s rollout for this entry; acknowledge and drop the entry if it is a duplicate."""
        rollout_id = receipt.rollout_id
        if self._held.holds(entry):
            return False  # already in hand from an earlier pull
        # A state-3 receipt (no attribution ran: the ledger was unreadable or
        # already retired at assembly) is always reported; for any other
        # receipt a retire fence means the rollout was consumed already.
        check_fence = "1" if receipt.terminal_selection is not None else "0"
        keys = [claim_key(self._ns, rollout_id), fence_key(self._ns, rollout_id)]
        with map_redis_errors(f"claim rollout {rollout_id!r}"):
            reply = await CLAIM_SCRIPT.run(
                self._topology.client, keys, [_token(entry), self.consumer_name, check_fence]
            )
        if reply[0] == CLAIM_CLAIMED:
            if entry.deliveries > 1:
                self._counts["double"] += 1
                logger.warning(
                    "reader %s claimed %r from an entry delivered %d times: it may have been trained before",
                    self.consumer_name,
                    rollout_id,
                    entry.deliveries,
                )
            return True
        retired = reply[0] == CLAIM_RETIRED
        if retired:
            # Consumed (or given up) before: finish its cleanup idempotently, then drop.
            await clear_staged(self._topology, self._ns, own_keys(receipt))
            await self._release([(rollout_id, _token(entry))])
        logger.info(
            "reader %s dropped a duplicate receipt of %r (%s)",
            self.consumer_name,
            rollout_id,
            "retired" if retired else "duplicate",
        )
        self._counts["duplicates"] += 1
        await self._consumer.ack([entry])
        return False

    # --- acknowledging ------------------------------------------------------------

    async def ack(self, rollout_ids: Iterable[str]) -> AckOutcome:
        """Finish pulled rollouts: retire their ledgers, delete their staged records, release their claims,
        then ``XACK`` + ``XDEL`` their receipt entries (in that order, so a crash part-way is completed
        by whichever reader gets the entry next).

        The lease is checked first: a rollout another rank took over (this reader held it past
        ``claim_idle_ms`` without :meth:`pull` or :meth:`heartbeat`) is left alone and reported in
        ``lost_lease``, as is one a heartbeat already found lost.

        :returns: the ledger retirement (``removed``: had a ledger; ``absent``: none, e.g. state-3
            receipts) and ``lost_lease``.
        :raises TypeError: *rollout_ids* is a bare ``str``.
        :raises ValueError: an id was not pulled by this reader (nothing changed).
        """
        if isinstance(rollout_ids, str | bytes):
            raise TypeError("ack() takes a collection of rollout ids, not a single str")
        ids = list(dict.fromkeys(rollout_ids))
        already_lost = [rollout_id for rollout_id in ids if rollout_id in self._lost_leases]
        ids = [rollout_id for rollout_id in ids if rollout_id not in self._lost_leases]
        held = self._held.select(ids, self.consumer_name)
        newly_lost = await self._drop_lost([h.entry for h in held]) if held else []
        lost_lease = list(dict.fromkeys([*already_lost, *newly_lost]))
        self._lost_leases.difference_update(lost_lease)
        held = [h for h in held if h.receipt.rollout_id not in lost_lease]
        ids = [h.receipt.rollout_id for h in held]
        if not ids:
            return AckOutcome(lost_lease=lost_lease)
        removal = await self._ledger.retire(ids)
        await clear_staged(self._topology, self._ns, [key for h in held for key in own_keys(h.receipt)])
        await self._release([(h.receipt.rollout_id, h.token) for h in held])
        await self._consumer.ack([h.entry for h in held])
        self._held.release(ids)
        return AckOutcome(removed=removal.removed, absent=removal.absent, lost_lease=lost_lease)

    async def _release(self, claims: Sequence[tuple[str, str]]) -> None:
        with map_redis_errors("release rollout claims"):
            for rollout_id, token in claims:
                await RELEASE_SCRIPT.run(self._topology.client, [claim_key(self._ns, rollout_id)], [token])

    async def retire_consumer(self) -> int:
        """Delete this reader's consumer name from the group where it owns nothing pending (on shutdown).

        :returns: on how many shards it was deleted.
        """
        return await self._consumer.retire_consumer()

    async def pending(self) -> int:
        """Receipt entries pending in the ``trainers`` group (every rank)."""
        return await self._consumer.pending_count()
