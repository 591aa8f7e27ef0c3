"""The trainer reader's rollout claims: one owner per rollout across ranks, duplicates dropped (contract §8.5).

Before consuming a rollout a :class:`~sink.trainer.reader.rollout_reader.RolloutReader` claims it with
one script on the rollout's own slot: ``ns:{R}:claimed`` names the receipt
entry and reader that own the rollout; another entry for the same rollout is
acknowledged and dropped, across ranks too, and a retire fence (left by the ledger's ``retire``) marks a
rollout consumed before. A receipt can be published twice (an assembler crash between publish and
acknowledgement); the same entry redelivered after a reader crash (``XAUTOCLAIM``) takes the claim over.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sink.contract.records import RolloutReceipt
from sink.keys import claim_key, fence_key
from sink.store.batch import BatchCall, raise_first_error, run_batch
from sink.store.connection import Topology
from sink.store.scripts import CLAIM_SCRIPT, RELEASE_SCRIPT, ClaimStatus
from sink.store.sink import clear_staged
from sink.store.streams import GroupConsumer, StreamEntry
from sink.trainer.reader.guards import own_keys
from sink.trainer.reader.held import HeldRollouts, claim_rounds
from sink.trainer.reader.held import entry_token as _token

__all__ = ("RolloutClaims", "is_group_entry")

logger = logging.getLogger("sink.trainer.reader.rollout_reader")


def is_group_entry(entry: StreamEntry) -> bool:
    """Whether *entry* is a GRPO group's entry (its members claimed with its token)."""
    return "group_members" in entry.fields


def _member(parsed: tuple[StreamEntry, RolloutReceipt]) -> tuple[StreamEntry, str]:
    return parsed[0], parsed[1].rollout_id


class RolloutClaims:
    """Claims rollouts for one reader (its *consumer* and *held* rollouts); ``duplicates``: entries dropped."""

    def __init__(self, topology: Topology, namespace: str, consumer: GroupConsumer, held: HeldRollouts) -> None:
        self._topology = topology
        self._ns = namespace
        self._consumer = consumer
        self._held = held
        self.duplicates = 0
        self.double_deliveries = 0

    async def claim_all(
        self, parsed: list[tuple[StreamEntry, RolloutReceipt]], settled: set[tuple[str, str]]
    ) -> list[tuple[StreamEntry, RolloutReceipt]]:
        """Claim every parsed entry's rollout; return the claimed ones in delivery order.

        The first entry of each rollout claims with the other rollouts' in one pipeline per node (one round trip
        for all); a later entry of the same rollout in this pull claims after them, so the first entry in
        delivery order wins.
        """
        firsts, later = claim_rounds([receipt.rollout_id for _entry, receipt in parsed])
        won = [False] * len(parsed)
        fresh = [index for index in firsts if not self._held.holds(*_member(parsed[index]))]  # in hand already
        calls = [self._claim_call(*parsed[index]) for index in fresh]
        async with self._topology.translated(f"claim {len(calls)} rollouts"):
            replies = raise_first_error(await run_batch(self._topology, calls)) if calls else []
        for index, reply in zip(fresh, replies, strict=True):
            won[index] = await self._claimed(*parsed[index], reply)
        for index in later:
            won[index] = await self.claim(*parsed[index])
        claimed = []
        for (entry, receipt), ours in zip(parsed, won, strict=True):
            if ours:
                claimed.append((entry, receipt))
            elif not is_group_entry(entry):  # a group entry is settled by the reader, with its members
                settled.add((entry.stream, entry.entry_id))
        return claimed

    async def claim(self, entry: StreamEntry, receipt: RolloutReceipt) -> bool:
        """Claim *receipt*'s rollout for this entry; acknowledge and drop the entry if it is a duplicate."""
        if self._held.holds(entry, receipt.rollout_id):
            return False  # already in hand from an earlier pull
        call = self._claim_call(entry, receipt)
        async with self._topology.translated(f"claim rollout {receipt.rollout_id!r}"):
            reply = await CLAIM_SCRIPT.run(self._topology.client, call.keys, call.args)
        return await self._claimed(entry, receipt, reply)

    def _claim_call(self, entry: StreamEntry, receipt: RolloutReceipt) -> BatchCall:
        """The claim script's call for *entry*."""
        # A state-3 receipt (no attribution ran: the ledger was unreadable or
        # already retired at assembly) is always reported; for any other
        # receipt a retire fence means the rollout was consumed already.
        check_fence = "1" if receipt.terminal_selection is not None else "0"
        keys = [claim_key(self._ns, receipt.rollout_id), fence_key(self._ns, receipt.rollout_id)]
        return BatchCall(keys, [_token(entry), self._consumer.consumer, check_fence], CLAIM_SCRIPT)

    async def _claimed(self, entry: StreamEntry, receipt: RolloutReceipt, reply: Any) -> bool:
        """Whether the claim script's *reply* made the rollout this entry's; a duplicate is dropped, its entry
        acknowledged unless it is a group entry (a retired rollout's cleanup finished first). A group entry's
        double delivery is counted once, by the reader."""
        rollout_id = receipt.rollout_id
        grouped = is_group_entry(entry)
        if reply[0] == ClaimStatus.CLAIMED:
            if entry.deliveries > 1 and not grouped:
                self.count_double_delivery(repr(rollout_id), f"an entry delivered {entry.deliveries} times")
            return True
        retired = reply[0] == ClaimStatus.RETIRED
        if retired:
            # Consumed (or given up) before: finish its cleanup idempotently, then drop.
            await clear_staged(self._topology, self._ns, own_keys(receipt))
            await self.release([(rollout_id, _token(entry))])
        if retired:
            # Said where an operator sees it (the trainer command prints warnings): never dropped silently.
            logger.warning(
                "reader %s skipped rollout %r: it is retired (consumed before, or retired by an operator)",
                self._consumer.consumer,
                rollout_id,
            )
        else:
            logger.info("reader %s dropped a duplicate receipt of %r", self._consumer.consumer, rollout_id)
        self.duplicates += 1
        if not grouped:
            await self._consumer.ack([entry])
        return False

    def count_double_delivery(self, what: str, why: str) -> None:
        """Count and log a rollout (or a whole group) delivered to a trainer again (it may have been trained
        before)."""
        self.double_deliveries += 1
        logger.warning(
            "reader %s claimed %s from %s: it may have been trained before", self._consumer.consumer, what, why
        )

    async def release(self, claims: Sequence[tuple[str, str]]) -> None:
        """Release the claims ``(rollout id, entry token)`` (one pipeline per node)."""
        calls = [BatchCall([claim_key(self._ns, rollout_id)], [token], RELEASE_SCRIPT) for rollout_id, token in claims]
        async with self._topology.translated("release rollout claims"):
            raise_first_error(await run_batch(self._topology, calls))
