"""What a trainer reader holds: rollouts pulled and claimed but not yet acknowledged (its lease bookkeeping).

A held rollout keeps its receipt entry pending under the reader's consumer
name; the entry's *token* (``<stream>#<entry id>``) is what the rollout's
claim key names. The members of a GRPO group share their group's entry: it stays pending until its last member
is acknowledged. :meth:`sink.trainer.reader.rollout_reader.RolloutReader.heartbeat` refreshes the
entries' idle time (the lease) and drops the ones another rank took over.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sink.contract.records import RolloutReceipt
from sink.store.streams import StreamEntry

__all__ = ("HeldRollout", "HeldRollouts", "claim_rounds", "entry_token")


def entry_token(entry: StreamEntry) -> str:
    """The claim token of a receipt entry: ``<stream>#<entry id>``."""
    return f"{entry.stream}#{entry.entry_id}"


def claim_rounds(rollout_ids: list[str]) -> tuple[list[int], list[int]]:
    """Split one pull's entries (by index) into two claim rounds.

    The first entry of each rollout claims in round one, concurrently with the
    other rollouts'; a later entry of the same rollout claims in round two, so
    the first entry in delivery order wins.
    """
    firsts: list[int] = []
    later: list[int] = []
    seen: set[str] = set()
    for index, rollout_id in enumerate(rollout_ids):
        (later if rollout_id in seen else firsts).append(index)
        seen.add(rollout_id)
    return firsts, later


@dataclass(frozen=True, slots=True)
class HeldRollout:
    """One held rollout: its receipt entry and the parsed receipt."""

    entry: StreamEntry
    receipt: RolloutReceipt

    @property
    def token(self) -> str:
        return entry_token(self.entry)


class HeldRollouts:
    """The rollouts one reader holds, by rollout id, in pull order (several share a group entry)."""

    def __init__(self) -> None:
        self._held: dict[str, HeldRollout] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._held

    def token_of(self, rollout_id: str) -> str:
        """The claim token of a held rollout's entry; :raises KeyError: not held."""
        return self._held[rollout_id].token

    def rollout_ids(self) -> tuple[str, ...]:
        return tuple(self._held)

    def entries(self) -> list[StreamEntry]:
        """Every held entry, once."""
        distinct = {(held.entry.stream, held.entry.entry_id): held.entry for held in self._held.values()}
        return list(distinct.values())

    def entry_ids(self) -> set[tuple[str, str]]:
        """``(stream, entry id)`` of every held entry."""
        return {(held.entry.stream, held.entry.entry_id) for held in self._held.values()}

    def holds(self, entry: StreamEntry, rollout_id: str) -> bool:
        """Whether *rollout_id* is held through *entry* itself (not through another entry of it)."""
        held = self._held.get(rollout_id)
        return held is not None and held.entry.entry_id == entry.entry_id and held.entry.stream == entry.stream

    def holds_entry(self, entry: StreamEntry) -> bool:
        """Whether any rollout is held through *entry*."""
        return (entry.stream, entry.entry_id) in self.entry_ids()

    def add(self, entry: StreamEntry, receipt: RolloutReceipt) -> None:
        self._held[receipt.rollout_id] = HeldRollout(entry, receipt)

    def drop_lost(self, lost: Iterable[StreamEntry]) -> list[str]:
        """Forget the rollouts of entries another rank took over; return their rollout ids."""
        keys = {(entry.stream, entry.entry_id) for entry in lost}
        rollout_ids = [i for i, held in self._held.items() if (held.entry.stream, held.entry.entry_id) in keys]
        for rollout_id in rollout_ids:
            del self._held[rollout_id]
        return rollout_ids

    def finished_entries(self, rollout_ids: Iterable[str]) -> list[StreamEntry]:
        """The entries of held *rollout_ids* that hold nothing else: acknowledging those rollouts finishes them."""
        ids = set(rollout_ids)
        entries = {(h.entry.stream, h.entry.entry_id): h.entry for i, h in self._held.items() if i in ids}
        for rollout_id, held in self._held.items():
            if rollout_id not in ids:
                entries.pop((held.entry.stream, held.entry.entry_id), None)
        return list(entries.values())

    def select(self, rollout_ids: list[str], consumer_name: str) -> list[HeldRollout]:
        """The held rollouts named by *rollout_ids* (distinct), in that order.

        :raises ValueError: an id is not held (never pulled, or acknowledged already).
        """
        unknown = [rollout_id for rollout_id in rollout_ids if rollout_id not in self._held]
        if unknown:
            raise ValueError(f"not held by reader {consumer_name!r} (never pulled, or acknowledged): {unknown}")
        return [self._held[rollout_id] for rollout_id in rollout_ids]

    def release(self, rollout_ids: Iterable[str]) -> None:
        """Forget acknowledged rollouts."""
        for rollout_id in rollout_ids:
            del self._held[rollout_id]
