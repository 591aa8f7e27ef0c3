"""GRPO group delivery: all rollouts of one prompt together, never split between trainer ranks.

Rollouts join a group through :func:`~sink.rollout.done_event.finished` (``group_id=``, ``group_size=``). The
group is gathered at the rollout end: every :class:`~sink.rollout.assembler.Assembler` records each member in the
group's server-side record (``ns:{grp:<id>}:members`` and ``:meta``, one slot), and the one whose member completes
the group publishes ONE receipts entry for it (:mod:`sink.rollout.group_entry`). A group still incomplete
``group_timeout_s`` (an assembler setting) after its first member was assembled is sealed by an assembler's sweep:
published with the members that arrived.

A :class:`GroupReader` wraps a :class:`~sink.trainer.reader.rollout_reader.RolloutReader`; a pull turns each group
entry into its members (claimed with the entry's token, fetched and verified as a pull does) and delivers them as
one :class:`RolloutGroup`. No rank owns a group but the one that pulled its entry, so one group is delivered whole,
by one rank; a rank that dies holding it loses the whole entry to the next rank after ``claim_idle_ms`` (one
double delivery).

Members that are not trainable (failed, poisoned, corrupt, stale weights) are acknowledged by the rank and listed
with their skip code. ``group_failure_policy``: ``deliver_rest`` delivers the trainable members with the others
listed in :attr:`RolloutGroup.failed`; ``drop_group`` acknowledges the members and delivers nothing (counted as
dropped). A sealed group (``complete=False``) is delivered partial or, with ``group_timeout_policy="dead_letter"``,
its members acknowledged and the group recorded on ``ns:dead:groups`` (``group_timeout``).

Never silent, never pending forever, never ``complete=True`` with fewer members than announced: a member arriving
after its group's member set was frozen is published alone, marked late; a rank does not deliver it alone (a group
of one has no reward variance) but acknowledges it and records it on ``ns:dead:groups`` with ``dead_code``
``late_member`` (a consumed group's ``:meta`` stays as a tombstone, so it is never a second group of the same id);
members disagreeing on ``group_size`` make the group wait for the largest size announced (``complete=True`` only
with that many; else sealed at the timeout), with a ``group_size_mismatch`` warning. Both are counted in
:class:`GroupStatistics`. Acknowledge a delivered group with :meth:`GroupReader.ack_groups` after the optimizer
step: the group's entry is acknowledged with its last member. Rollouts without a group are delivered as groups of
one (``group_id=None``).

The feature in one module: the reader (:class:`GroupReader`), what it delivers (:class:`RolloutGroup`, with the
reward statistics over its members) and its counters (:class:`GroupStatistics`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sink.keys import dead_letter_stream
from sink.rollout.group_entry import GroupEntry
from sink.store.batch import BatchCall, raise_first_error, run_batch
from sink.trainer.pulled import PulledRollout, SkippedRollout
from sink.trainer.reader.rollout_reader import RolloutReader

__all__ = ("GROUP_SIZE_MISMATCH", "LATE_MEMBER", "GroupReader", "GroupStatistics", "RolloutGroup")

logger = logging.getLogger(__name__)

LATE_MEMBER = "late_member"
"""``dead_code`` on ``ns:dead:groups``: a member that arrived after its group went out (acknowledged, recorded)."""
GROUP_SIZE_MISMATCH = "group_size_mismatch"
"""Warning code: the members of a group announced different ``group_size`` s (the largest is used)."""
GROUP_TIMEOUT = "group_timeout"
"""``dead_code`` on ``ns:dead:groups``: sealed at ``group_timeout_s`` under ``group_timeout_policy="dead_letter"``."""


@dataclass(frozen=True, slots=True, eq=False)
class RolloutGroup:
    """One delivered group: its trainable ``members`` (by rollout id), the ``failed`` ones, and reward statistics
    over the members (``NaN`` when no member has a reward). ``complete``: every member arrived."""

    group_id: str | None
    group_size: int
    members: tuple[PulledRollout, ...]
    failed: tuple[SkippedRollout, ...]
    complete: bool
    reward_mean: float = field(init=False)
    reward_std: float = field(init=False)
    reward_min: float = field(init=False)
    reward_max: float = field(init=False)

    def __post_init__(self) -> None:
        rewards = [m.receipt.reward for m in self.members if m.receipt.reward is not None]
        mean = math.fsum(rewards) / len(rewards) if rewards else math.nan
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else math.nan
        object.__setattr__(self, "reward_mean", mean)
        object.__setattr__(self, "reward_std", std)
        object.__setattr__(self, "reward_min", min(rewards) if rewards else math.nan)
        object.__setattr__(self, "reward_max", max(rewards) if rewards else math.nan)

    @property
    def rollout_ids(self) -> tuple[str, ...]:
        """The trainable members' ids (acknowledge them with :meth:`GroupReader.ack_groups`)."""
        return tuple(m.rollout_id for m in self.members)

    def __repr__(self) -> str:
        return (
            f"<RolloutGroup {self.group_id!r} members={len(self.members)}/{self.group_size} "
            f"failed={len(self.failed)} complete={self.complete} reward_mean={self.reward_mean:.4g}>"
        )


class GroupStatistics(NamedTuple):
    """Counters of one :class:`GroupReader`: groups delivered (``partial``: sealed at the timeout), dropped by
    ``drop_group`` (or with no trainable member), dead-lettered at the timeout; ``late``: members after their group
    went out (:data:`LATE_MEMBER`); ``size_mismatches``: groups whose members disagreed on ``group_size``. (Groups
    still waiting for members are counted by the assemblers: ``AssemblerStatistics.groups_waiting``.)"""

    delivered: int
    partial: int
    dropped: int
    dead_lettered: int
    late: int = 0
    size_mismatches: int = 0


class _Batch(NamedTuple):
    """What one entry delivered to this rank: a group entry's members (``entry`` set), a late member, or a rollout
    without a group (``entry`` None)."""

    entry: GroupEntry | None
    items: list[PulledRollout]


class GroupReader:
    """Delivers whole GRPO groups over a :class:`~sink.trainer.reader.rollout_reader.RolloutReader` (borrowed; open it first)."""

    def __init__(self, reader: RolloutReader) -> None:
        self._reader = reader
        self._settings = reader.settings
        self._ns = self._settings.namespace
        # A pull a refused write (or a lost connection) interrupted: the groups it had settled and not returned yet,
        # and the entries it had pulled and not settled yet; the next pull goes on with them.
        self._ready: list[RolloutGroup] = []
        self._pending: list[_Batch] = []
        self._counts = dict.fromkeys(("delivered", "partial", "dropped", "dead", "late", "mismatch"), 0)

    @property
    def reader(self) -> RolloutReader:
        return self._reader

    def statistics(self) -> GroupStatistics:
        c = self._counts
        return GroupStatistics(c["delivered"], c["partial"], c["dropped"], c["dead"], c["late"], c["mismatch"])

    async def pull_groups(self, max_rollouts: int, *, block_ms: int = 0) -> list[RolloutGroup]:
        """Pull up to *max_rollouts* rollouts (whole group entries, so possibly more) and return their groups.

        Safe to call again after it raised (:class:`~sink.errors.NotDurableError`, a lost connection): what the
        interrupted pull had in hand is settled first (each step safe to redo; a dead letter may be recorded twice,
        never lost).

        :raises ValueError: as :meth:`RolloutReader.pull`.
        :raises StagingConnectionError: the server could not be reached.
        """
        if not self._pending:
            self._pending = _batches(await self._reader.pull(max_rollouts, block_ms=block_ms))
        while self._pending:
            self._ready += await self._settle(self._pending[0])
            self._pending.pop(0)  # settled: not again
        delivered, self._ready = self._ready, []
        return delivered

    async def ack_groups(self, groups: Iterable[RolloutGroup]) -> None:
        """Acknowledge delivered groups (their trainable members; a group's entry goes with its last member, its
        record closed first), each acknowledgement durable or refused (:class:`~sink.errors.NotDurableError`:
        calling again with the same groups is safe, members acknowledged already are not acknowledged twice)."""
        await self._ack_held([i for group in groups for i in group.rollout_ids])

    async def _ack_held(self, rollout_ids: list[str]) -> None:
        """Acknowledge those of *rollout_ids* this rank still holds (a step redone after a refused write)."""
        await self._reader.ack([rollout_id for rollout_id in rollout_ids if self._reader.holds(rollout_id)])

    async def _settle(self, batch: _Batch) -> list[RolloutGroup]:
        """Deliver, drop or dead-letter what one entry delivered. A refused write raises and leaves it for the next
        :meth:`pull_groups` (every step is safe to redo; counted once, at the end)."""
        entry, items = batch
        if entry is None:
            return [await self._single(items[0])]
        if entry.state == "late":
            for item in items:
                reason = "arrived after its group went out"
                await self._record_dead(entry, [item.rollout_id], [], LATE_MEMBER, reason)
                await self._ack_held([item.rollout_id])
                self._counts["late"] += 1
            return []
        members = sorted((item for item in items if item.trainable), key=lambda item: item.rollout_id)
        failed = [item.skipped() for item in items if not item.trainable]
        await self._ack_held([f.rollout_id for f in failed])  # listed with their codes; nothing to train on
        # complete: every member announced arrived, and every one is here (an entry delivered again after some of its
        # members were acknowledged brings back the others only).
        whole = {item.rollout_id for item in items} == set(entry.members)
        complete, settings = entry.state == "complete" and whole, self._settings
        group = RolloutGroup(entry.group_id, entry.group_size, tuple(members), tuple(failed), complete)
        delivered: list[RolloutGroup] = []
        if not members:
            logger.warning("group %r has no trainable member: %r", entry.group_id, group)
            self._counts["dropped"] += 1
        elif failed and settings.group_failure_policy == "drop_group":
            await self._ack_held([m.rollout_id for m in members])
            logger.warning("dropped group %r: failed members %s", entry.group_id, [f.skip_code for f in failed])
            self._counts["dropped"] += 1
        elif entry.state == "sealed" and settings.group_timeout_policy == "dead_letter":
            reason = f"sealed at group_timeout_s with {len(entry.members)} of {entry.group_size} members"
            await self._record_dead(entry, [m.rollout_id for m in members], failed, GROUP_TIMEOUT, reason)
            await self._ack_held([m.rollout_id for m in members])
            self._counts["dead"] += 1
        else:
            self._counts["delivered"] += 1
            self._counts["partial"] += not complete
            delivered.append(group)
        if entry.mismatch:
            self._counts["mismatch"] += 1
            text = "%s: members of group %r announced different group_size values; using the largest, %d"
            logger.warning(text, GROUP_SIZE_MISMATCH, entry.group_id, entry.group_size)
        return delivered

    async def _single(self, item: PulledRollout) -> RolloutGroup:
        """A rollout without a group, as a complete group of one (a skipped one is acknowledged here and listed
        failed). A grouped rollout published alone by an assembler of the previous version is a group of one of
        its group (the receipts streams should have been drained before the upgrade, see docs/contract.md)."""
        if not item.trainable:
            await self._ack_held([item.rollout_id])  # before counting: a refused ack redoes this step
        self._counts["delivered"] += 1
        members, failed = ((item,), ()) if item.trainable else ((), (item.skipped(),))
        if item.group is None:
            return RolloutGroup(None, 1, members, failed, True)
        size = item.group.group_size
        return RolloutGroup(item.group.group_id, size, members, failed, size == 1)

    async def _record_dead(
        self, entry: GroupEntry, members: Sequence[str], failed: Sequence[SkippedRollout], code: str, reason: str
    ) -> None:
        """One durable ``ns:dead:groups`` entry (``dead_code`` *code*) for *members* of the group of *entry*."""
        stream = dead_letter_stream(self._ns, "groups")
        record = {
            "group_id": entry.group_id,
            "group_size": str(entry.group_size),
            "members": ",".join(members),
            "failed": ",".join(f"{f.rollout_id}:{f.skip_code}" for f in failed),
            "dead_code": code,
            "dead_reason": reason,
            "dead_consumer": self._reader.consumer_name,
        }
        flat = [part for pair in record.items() for part in pair]
        action = f"dead-letter group {entry.group_id!r}"
        durability, timeout_s = self._settings.durability, self._settings.command_timeout_s / 2
        async with self._reader.topology.translated(action):
            calls = [BatchCall([stream], ["XADD", stream, "*", *flat])]
            replies = await run_batch(
                self._reader.topology, calls, durability=durability, timeout_s=timeout_s, action=action
            )
            raise_first_error(replies)
        logger.warning(
            "%s: group %r members %s recorded on %s: %s", code, entry.group_id, list(members), stream, reason
        )


def _batches(pulled: list[PulledRollout]) -> list[_Batch]:
    """*pulled* by the entry each came in: a group entry's members together (in pull order), every other rollout
    alone."""
    batches: list[_Batch] = []
    by_entry: dict[int, _Batch] = {}
    for item in pulled:
        entry = item.group_entry
        if entry is None or entry.state == "late":
            batches.append(_Batch(entry, [item]))
        elif (batch := by_entry.get(id(entry))) is not None:
            batch.items.append(item)
        else:
            by_entry[id(entry)] = batch = _Batch(entry, [item])
            batches.append(batch)
    return batches
