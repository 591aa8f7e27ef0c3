"""GRPO group delivery: all rollouts of one prompt together, never split between trainer ranks.

Rollouts join a group through :func:`~sink.rollout.done_event.finished` (``group_id=``, ``group_size=``). A
:class:`GroupReader` wraps a :class:`~sink.trainer.reader.rollout_reader.RolloutReader`; each rank pulls rollouts as usual and
records every group member it receives in the group's server-side record (``ns:{grp:<id>}:members`` and
``:meta``, one slot) with one script. The rank whose member completes the group becomes its *owner* (atomically:
exactly one rank) and takes the other ranks' members over (``XCLAIM`` of their receipt entries, then claim,
fetch and verify as a pull does); the other ranks see the owner on their next :meth:`GroupReader.pull_groups`
and let go of their members without acknowledging them. So one group is delivered whole, by one rank.

Members that are not trainable (failed, poisoned, corrupt, stale weights) are acknowledged by the rank that
received them and recorded with their skip code. ``group_failure_policy``: ``deliver_rest`` delivers the
trainable members with the others listed in :attr:`RolloutGroup.failed`; ``drop_group`` acknowledges the members
and delivers nothing (counted as dropped).

A group still incomplete ``group_timeout_s`` after its first member arrived is sealed by a rank holding one of
its members: delivered partial (``complete=False``) or, with ``group_timeout_policy="dead_letter"``, its members
acknowledged and the group recorded on ``ns:dead:groups``. An owner keeps its groups while it lives (a rank
still waiting on one of them lets its members go, however long since the owner took it); a crashed owner loses
them to the next rank that reclaims one of their receipt entries (idle past ``claim_idle_ms``), and a rank
restarted under the same ``consumer_name`` is a new owner that gets its predecessor's groups back that way
(double deliveries). Rollouts without a group are delivered as groups of one (``group_id=None``).

Never silent, never pending forever, never ``complete=True`` with fewer members than announced: a member arriving
after its group went out (delivered by any rank, acknowledged, dropped, sealed) is not delivered alone (a group of
one has no reward variance) but acknowledged and recorded on ``ns:dead:groups`` with ``dead_code`` ``late_member``
(a closed group's ``:meta`` stays ``retention_s`` as a tombstone, so it is never a second group of the same id);
members disagreeing on ``group_size`` make the group wait for the largest size announced (``complete=True`` only
with that many; else sealed at the timeout), with a ``group_size_mismatch`` warning. Both are counted in
:class:`GroupStatistics`. Acknowledge a delivered group with :meth:`GroupReader.ack_groups` after the optimizer step.

The feature in one module: the reader (:class:`GroupReader`), what it delivers (:class:`RolloutGroup`, with the
reward statistics over its members) and its counters (:class:`GroupStatistics`).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio

from sink.contract.skip_codes import SkipCode
from sink.keys import dead_letter_stream, group_keys
from sink.rollout.done_event import GroupTag
from sink.store.batch import BatchCall, raise_first_error, run_batch
from sink.store.connection import reply_text
from sink.store.scripts import GROUP_CHECK_SCRIPT, GROUP_CLOSE_SCRIPT, GROUP_GATHER_SCRIPT, GroupStatus
from sink.tasks import task_group
from sink.trainer.pulled import PulledRollout, SkippedRollout
from sink.trainer.reader.rollout_reader import RolloutReader

__all__ = ("GROUP_SIZE_MISMATCH", "LATE_MEMBER", "GroupReader", "GroupStatistics", "RolloutGroup")

logger = logging.getLogger(__name__)

LATE_MEMBER = "late_member"
"""``dead_code`` on ``ns:dead:groups``: a member that arrived after its group went out (acknowledged, recorded)."""
GROUP_SIZE_MISMATCH = "group_size_mismatch"
"""Warning code: the members of a group announced different ``group_size`` s (the largest is used)."""
GROUP_TIMEOUT = "group_timeout"
"""``dead_code`` on ``ns:dead:groups``: incomplete at ``group_timeout_s`` under ``group_timeout_policy="dead_letter"``."""


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
    """Counters of one :class:`GroupReader`: groups delivered (``partial``: sealed at the
    timeout), dropped by ``drop_group``, dead-lettered at the timeout, handed to another rank; ``waiting``: groups
    this rank holds members of, not complete; ``late``: members after their group went out
    (:data:`LATE_MEMBER`); ``size_mismatches``: groups whose members disagreed on
    ``group_size``."""

    delivered: int
    partial: int
    dropped: int
    dead_lettered: int
    handed_over: int
    waiting: int
    late: int = 0
    size_mismatches: int = 0


class GroupReader:
    """Delivers whole GRPO groups over a :class:`~sink.trainer.reader.rollout_reader.RolloutReader` (borrowed; open it first)."""

    def __init__(self, reader: RolloutReader) -> None:
        self._reader = reader
        self._settings = reader.settings
        self._ns = self._settings.namespace
        self._parked: dict[str, dict[str, PulledRollout]] = {}
        self._watched: dict[str, GroupTag] = {}
        # This pull's rollouts: a group completed by one of them may include others not gathered yet.
        self._fresh: dict[str, PulledRollout] = {}
        # A pull a refused write (or a lost connection) interrupted: what it had settled and not returned yet, the
        # rollouts it had pulled and not gathered yet, and the groups it was owning: the next pull goes on with them.
        self._ready: list[RolloutGroup] = []
        self._backlog: list[PulledRollout] = []
        self._owning: dict[str, tuple[GroupTag, Sequence[object], bool]] = {}
        self._counts = dict.fromkeys(("delivered", "partial", "dropped", "dead", "handed", "late", "mismatch"), 0)
        self._unclosed: set[str | None] = set()  # acknowledged groups whose close was not confirmed yet
        self._owner = f"{reader.consumer_name}/{secrets.token_hex(4)}"  # a restart under the same name: a new owner
        # Owned groups a refused write left unsettled: (tag, members, failed, complete, redelivered), see _settle.
        self._unsettled: dict[str, tuple[GroupTag, list[PulledRollout], list[SkippedRollout], bool, bool]] = {}
        reader.claims.defer_grouped = True  # a parked member read again was never trained: counted at delivery

    @property
    def reader(self) -> RolloutReader:
        return self._reader

    def statistics(self) -> GroupStatistics:
        c = self._counts
        counts = (c["delivered"], c["partial"], c["dropped"], c["dead"], c["handed"])
        return GroupStatistics(*counts, len(self._watched), c["late"], c["mismatch"])

    def waiting_groups(self) -> dict[str, tuple[int, int]]:
        """The incomplete groups this rank waits on: group id -> (members it holds, group size announced)."""
        return {group_id: (len(self._parked.get(group_id, {})), tag.group_size) for group_id, tag in self._watched.items()}

    async def pull_groups(self, max_rollouts: int, *, block_ms: int = 0) -> list[RolloutGroup]:
        """Pull up to *max_rollouts* rollouts and return the groups that are now whole (or timed out) and owned
        by this rank; members of incomplete groups stay held here until their group completes.

        :raises ValueError: as :meth:`RolloutReader.pull`.
        :raises StagingConnectionError: the server could not be reached.
        """
        # An interrupted pull left work behind (see __init__): finish it first, each step safe to redo.
        self._fresh = {item.rollout_id: item for item in self._backlog if item.trainable}
        for tag, reply, complete in list(self._owning.values()):
            self._ready += await self._own(tag, reply, complete=complete)
        for group_id in list(self._unsettled):
            self._ready += await self._settle(group_id)
        await self._check_watched()
        if not self._backlog:
            self._backlog = list(await self._reader.pull(max_rollouts, block_ms=block_ms))
            self._fresh = {item.rollout_id: item for item in self._backlog if item.trainable}
        while self._backlog:
            item = self._backlog[0]
            if item.group is None:
                self._ready.append(await self._solo(item))
            else:
                self._ready += await self._gather(item) or []
            self._backlog.pop(0)  # gathered: not again
        delivered, self._ready = self._ready, []
        return delivered

    async def ack_groups(self, groups: Iterable[RolloutGroup]) -> None:
        """Acknowledge delivered groups (their trainable members), then close their server-side records, each
        durable or refused (:class:`~sink.errors.NotDurableError`: calling again with the same groups is safe,
        the members of a group whose close was refused are not acknowledged twice)."""
        groups = list(groups)
        unclosed, ids = self._unclosed, [g.group_id for g in groups if g.group_id is not None]
        await self._reader.ack([i for g in groups if g.group_id not in unclosed for i in g.rollout_ids])
        unclosed.update(ids)
        await self._delete(ids)
        unclosed.difference_update(ids)

    async def _delete(self, group_ids: Sequence[str]) -> None:
        """Close groups that went out: members record deleted, the meta kept as a tombstone (see the module)."""
        settings = self._settings
        ttl_ms = int(max(settings.retention_s, settings.group_timeout_s * 4, settings.claim_idle_ms / 1000 * 4) * 1000)
        calls = [BatchCall(group_keys(self._ns, group_id), [ttl_ms], GROUP_CLOSE_SCRIPT) for group_id in group_ids]
        await self._write(calls, f"close {len(calls)} group records")

    async def _write(self, calls: list[BatchCall], action: str) -> list[Any]:
        """Acknowledged writes: one pipeline per node, each confirmed durable in it, as every acknowledgement
        (:func:`~sink.store.batch.run_batch`; :class:`~sink.errors.NotDurableError` otherwise)."""
        durability, timeout_s = self._settings.durability, self._settings.command_timeout_s / 2
        async with self._reader.topology.translated(action):
            replies = await run_batch(
                self._reader.topology, calls, durability=durability, timeout_s=timeout_s, action=action
            )
            return raise_first_error(replies)

    def _record(self, item: PulledRollout) -> str:
        consumer = self._reader.consumer_name
        if item.trainable:
            return f"ok\n{self._reader.entry_token(item.rollout_id)}\n{consumer}"
        return f"skip\n{item.skip_code}\n{item.skip_reason or ''}"

    async def _gather(self, item: PulledRollout) -> list[RolloutGroup] | None:
        tag = item.group
        assert tag is not None
        ttl_ms = int(max(self._settings.group_timeout_s * 1000 * 4, self._settings.claim_idle_ms * 4))
        async with self._reader.topology.translated(f"record member {item.rollout_id!r} of group {tag.group_id!r}"):
            reply = await GROUP_GATHER_SCRIPT.run(
                self._reader.client,
                group_keys(self._ns, tag.group_id),
                [
                    item.rollout_id,
                    self._record(item),
                    self._owner,
                    tag.group_size,
                    self._settings.claim_idle_ms,
                    ttl_ms,
                ],
            )
        state = GroupStatus(int(reply[0]))
        if state == GroupStatus.LATE:
            await self._record_dead(tag, [item.rollout_id], [], LATE_MEMBER, "arrived after its group went out")
            await self._ack_held([item.rollout_id])
            self._counts["late"] += 1
            return None
        if not item.trainable:
            await self._ack_held([item.rollout_id])  # recorded with its code; nothing to train on
        elif state in (GroupStatus.WAIT, GroupStatus.COMPLETE):
            self._parked.setdefault(tag.group_id, {})[item.rollout_id] = item
        if state == GroupStatus.TAKEN:
            self._hand_over(tag.group_id, [item.rollout_id])
            return None
        if state == GroupStatus.WAIT:
            self._watched[tag.group_id] = tag
            return None
        if state == GroupStatus.COMPLETE:
            return await self._own(tag, reply[1:], complete=True)
        return None  # OWNED: delivered by this rank already

    async def _ack_held(self, rollout_ids: list[str]) -> None:
        """Acknowledge those of *rollout_ids* this rank still holds (a step redone after a refused write)."""
        await self._reader.ack([rollout_id for rollout_id in rollout_ids if self._reader.holds(rollout_id)])

    async def _check_watched(self) -> None:
        """Check every group this rank waits on (the scripts run concurrently), then act on each state: the groups
        it comes to own go to ``_ready``."""
        watched = list(self._watched.items())
        replies: list[Any] = [None] * len(watched)
        limiter = anyio.CapacityLimiter(self._settings.fetch_concurrency)
        arguments = [self._owner, int(self._settings.group_timeout_s * 1000)]

        async def check(index: int, group_id: str) -> None:
            async with limiter, self._reader.topology.translated(f"check group {group_id!r}"):
                replies[index] = await GROUP_CHECK_SCRIPT.run(
                    self._reader.client, group_keys(self._ns, group_id), arguments
                )

        async with task_group() as checks:
            for index, (group_id, _tag) in enumerate(watched):
                checks.start_soon(check, index, group_id)
        if any(GroupStatus(int(reply[0])) in (GroupStatus.COMPLETE, GroupStatus.SEALED) for reply in replies):
            # About to own a group: the heartbeat finds a parked member taken over meanwhile, so it is claimed back.
            await self._reader.heartbeat()
        for (group_id, tag), reply in zip(watched, replies, strict=True):
            state = GroupStatus(int(reply[0]))
            if state == GroupStatus.WAIT:
                continue
            del self._watched[group_id]
            if state in (GroupStatus.TAKEN, GroupStatus.GONE):
                self._hand_over(group_id, list(self._parked.pop(group_id, {})))
            elif state in (GroupStatus.COMPLETE, GroupStatus.SEALED):
                self._ready += await self._own(tag, reply[1:], complete=state == GroupStatus.COMPLETE)

    def _hand_over(self, group_id: str, rollout_ids: list[str]) -> None:
        """Another rank owns the group: let go of our members without acknowledging them."""
        self._reader.forget(rollout_ids)
        self._reader.claims.take_redelivered(rollout_ids)
        parked = self._parked.get(group_id, {})
        for rollout_id in rollout_ids:
            parked.pop(rollout_id, None)
        if not parked:
            self._parked.pop(group_id, None)
        self._counts["handed"] += len(rollout_ids)

    async def _own(self, tag: GroupTag, reply: Sequence[object], *, complete: bool) -> list[RolloutGroup]:
        """This rank owns the group: collect every member (taking over the other ranks'), then deliver.

        *reply*: the group's size (the largest announced), whether sizes disagreed, then its members record.
        Until the group is handed to :meth:`_finish` it stays in ``_owning`` with its members parked (those taken
        over too): a refused write or a lost connection on the way leaves it there for the next pull to own again.
        """
        self._watched.pop(tag.group_id, None)
        self._owning[tag.group_id] = (tag, reply, complete)
        announced = int(reply_text(reply[0], "group size"))
        mismatch, flat = reply_text(reply[1], "group size mismatch") == "1", reply[2:]
        tag = GroupTag(tag.group_id, announced)
        local = self._parked.setdefault(tag.group_id, {})
        members: dict[str, PulledRollout] = {}
        failed: list[SkippedRollout] = []
        skipped: list[str] = []  # taken over, cannot be trained: acknowledged here
        tokens: dict[str, str] = {}
        for index in range(0, len(flat), 2):
            rollout_id, (kind, first, second) = (
                reply_text(flat[index], "group member"),
                (reply_text(flat[index + 1], "group member").split("\n", 2) + ["", ""])[:3],
            )
            if kind == "skip":
                failed.append(SkippedRollout(rollout_id, first, second))
            elif (taken := local.get(rollout_id)) is not None and not taken.trainable:  # an interrupted owning's
                failed.append(taken.skipped())
                skipped.append(rollout_id)
            elif (mine := local.get(rollout_id) or self._fresh.get(rollout_id)) and self._reader.holds(rollout_id):
                members[rollout_id] = mine
            else:
                tokens[rollout_id] = first
        for item in await self._reader.take_over(list(tokens.values())) if tokens else []:
            local[item.rollout_id] = item  # parked until the group is finished, trainable or not
            if item.trainable:
                members[item.rollout_id] = item
            else:
                failed.append(item.skipped())
                skipped.append(item.rollout_id)
        if skipped:
            await self._ack_held(skipped)  # one ack for every member taken over that cannot be trained
        for rollout_id in tokens:
            if rollout_id not in members and all(f.rollout_id != rollout_id for f in failed):
                failed.append(SkippedRollout(rollout_id, SkipCode.MEMBER_UNAVAILABLE, "its receipt entry was gone"))
        if mismatch:
            self._counts["mismatch"] += 1
            text = "%s: members of group %r announced different group_size values; using the largest, %d"
            logger.warning(text, GROUP_SIZE_MISMATCH, tag.group_id, announced)
        self._owning.pop(tag.group_id, None)
        self._parked.pop(tag.group_id, None)
        ordered = [members[rollout_id] for rollout_id in sorted(members)]
        return await self._finish(tag, ordered, failed, complete=complete)

    async def _solo(self, item: PulledRollout) -> RolloutGroup:
        """A rollout without a group, as a group of one (a skipped one is acknowledged here and listed failed)."""
        if not item.trainable:
            await self._ack_held([item.rollout_id])  # before counting: a refused ack redoes this step
        self._counts["delivered"] += 1
        members, failed = ((item,), ()) if item.trainable else ((), (item.skipped(),))
        return RolloutGroup(None, 1, members, failed, True)

    async def _finish(
        self, tag: GroupTag, members: list[PulledRollout], failed: list[SkippedRollout], *, complete: bool
    ) -> list[RolloutGroup]:
        ids = [m.rollout_id for m in members] + [f.rollout_id for f in failed]
        self._unsettled[tag.group_id] = (tag, members, failed, complete, self._reader.claims.take_redelivered(ids))
        return await self._settle(tag.group_id)

    async def _settle(self, group_id: str) -> list[RolloutGroup]:
        """Deliver, drop or dead-letter a group this rank owns. A refused write (:class:`~sink.errors.NotDurableError`,
        a lost connection) raises and leaves it unsettled: the next :meth:`pull_groups` settles it again (every
        step is safe to redo; a dead letter is then recorded again, never lost)."""
        tag, members, failed, complete, redelivered = self._unsettled[group_id]
        settings, held = self._settings, [m.rollout_id for m in members if self._reader.holds(m.rollout_id)]
        delivered: list[RolloutGroup] = []  # acknowledged: the members still held (a retry skips the acknowledged)
        if not members:
            await self._delete([tag.group_id])
            self._counts["dropped"] += 1
            failed_only = RolloutGroup(tag.group_id, tag.group_size, (), tuple(failed), complete)
            logger.warning("group %r has no trainable member: %r", tag.group_id, failed_only)
        elif failed and settings.group_failure_policy == "drop_group":
            await self._reader.ack(held)
            await self._delete([tag.group_id])
            self._counts["dropped"] += 1
            logger.warning("dropped group %r: failed members %s", tag.group_id, [f.skip_code for f in failed])
        elif not complete and settings.group_timeout_policy == "dead_letter":
            await self._dead_letter(tag, [m.rollout_id for m in members], failed)
        else:
            if redelivered and await self._delivered_before(tag.group_id):
                for member in members:
                    self._reader.claims.count_double_delivery(
                        member.rollout_id, f"group {group_id!r}, delivered before"
                    )
            if not complete:
                self._counts["partial"] += 1
            self._counts["delivered"] += 1
            delivered.append(RolloutGroup(tag.group_id, tag.group_size, tuple(members), tuple(failed), complete))
        del self._unsettled[group_id]
        return delivered

    async def _delivered_before(self, group_id: str) -> bool:
        """Whether the group had an owner before this rank (``deliveries`` counts them, in the scripts)."""
        async with self._reader.topology.translated(f"read group {group_id!r}"):
            count = await self._reader.client.hget(group_keys(self._ns, group_id)[0], "deliveries")
        return count is not None and int(reply_text(count, "group deliveries")) > 1

    async def _record_dead(
        self, tag: GroupTag, members: Sequence[str], failed: Sequence[SkippedRollout], code: str, reason: str
    ) -> None:
        """One durable ``ns:dead:groups`` entry (``dead_code`` *code*) for *members* of the group *tag*."""
        stream = dead_letter_stream(self._ns, "groups")
        record = {
            "group_id": tag.group_id,
            "group_size": str(tag.group_size),
            "members": ",".join(members),
            "failed": ",".join(f"{f.rollout_id}:{f.skip_code}" for f in failed),
            "dead_code": code,
            "dead_reason": reason,
            "dead_consumer": self._reader.consumer_name,
        }
        flat = [part for pair in record.items() for part in pair]
        await self._write([BatchCall([stream], ["XADD", stream, "*", *flat])], f"dead-letter group {tag.group_id!r}")
        logger.warning("%s: group %r members %s recorded on %s: %s", code, tag.group_id, list(members), stream, reason)

    async def _dead_letter(self, tag: GroupTag, members: list[str], failed: list[SkippedRollout]) -> None:
        reason = f"incomplete after group_timeout_s={self._settings.group_timeout_s}"
        await self._record_dead(tag, members, failed, GROUP_TIMEOUT, reason)
        await self._reader.ack([rollout_id for rollout_id in members if self._reader.holds(rollout_id)])
        await self._delete([tag.group_id])
        self._counts["dead"] += 1
