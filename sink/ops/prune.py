"""Bounded state: the owner of everything no running service removes (``staging-sink prune``).

Every key and stream of a namespace has an owner that removes it:

========================================  =============================================================
key                                       removed by
========================================  =============================================================
``ns:{R}:rec:*``, ``ns:{R}:calls``        the trainer's ``ack`` (``clear_staged``); else abandonment here
``ns:{R}:ledger``, ``ns:{R}:ledger:ids``  the trainer's ``ack`` (ledger retirement); else abandonment here
``ns:{R}:claimed``                        the trainer's ``ack``; else abandonment here
``ns:{R}:receipt``, ``ns:{R}:fence``      expire ``retention_s`` after the ack (:mod:`sink.trainer.reader.retention`);
                                          a consumed rollout's keys left without a TTL get one here
``ns:gym:{R}``, ``ns:gym:{R}:*``          the NeMo Gym transport's ``drop`` (its tombstone expires); else
                                          abandonment here
``ns:{grp:G}:*``                          the reader that consumed the group (``PEXPIRE``, GRPO groups)
``ns:groups:open:<k>``                    the assemblers (a group leaves it once published)
``ns:done:<k>``, ``ns:receipts:<k>``      fixed count; entries ``XACK`` + ``XDEL`` once processed;
                                          consumer names idle ``consumer_idle_max_s`` with nothing
                                          pending are deleted here
``ns:dead:*``                             trimmed here to the newest ``dead_letter_max_entries``
========================================  =============================================================

**Abandonment.** A rollout with staged records, a ledger or NeMo Gym transport keys but no receipt, whose last
``calls`` or ledger entry (or Gym transport write, ``touched_ms``) is at least ``abandon_after_s`` old, never
finished (or its Gym snapshot was never dropped): its records, ``calls`` stream, ledger, Gym keys and claim are
deleted and its fence set (the RL retire fence for an RL rollout, the Gym tombstone for a Gym one, both expiring
after ``retention_s``) in one ``MULTI`` guarded by ``WATCH`` (a write in between leaves it alone), and a failure
is recorded on ``ns:dead:abandoned`` and counted
(``staging_sink_rollouts_abandoned_total``). A rollout that has a receipt belongs to the trainer: never touched.

Only keys of the namespace are read or changed (``SCAN MATCH ns:{*`` and ``ns:gym:{*`` on every primary).

**One bad entry never stops a pass.** A rollout whose state cannot be read (a Gym ``touched_ms`` that is not a
millisecond count, written by hand or by another tool) and a key name that is not UTF-8 are left exactly as they
are, logged, and listed in :attr:`PruneReport.skipped` with the reason; the pass goes on with the rest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.errors import CodecError
from sink.keys import (
    calls_stream,
    claim_key,
    dead_letter_stream,
    fence_key,
    gym_key_kind,
    gym_key_prefix,
    gym_keys,
    ledger_ids_key,
    ledger_stream,
    ledger_text_key,
    receipt_key,
)
from sink.settings import PruneSettings
from sink.store.connection import Topology, reply_text
from sink.store.pipeline_counters import count_rollouts_abandoned

__all__ = ("ABANDONED_STREAM", "ABANDONED_TOMBSTONE", "PruneReport", "prune_namespace")

logger = logging.getLogger(__name__)

ABANDONED_STREAM = "abandoned"
"""``ns:dead:abandoned``: one entry per abandoned rollout (``rollout_id``, ``reason``, ``last_activity_ms``)."""

_RL_LIVE_KINDS = frozenset({"calls", "ledger", "ledger:ids", "ledger:text", "claimed", "rec"})
_GYM_LIVE_KINDS = frozenset({"gym", "gym:entries", "gym:digests", "gym:intents", "gym:frozen", "gym:snapshot"})
_LIVE_KINDS = _RL_LIVE_KINDS | _GYM_LIVE_KINDS
ABANDONED_TOMBSTONE = "gym-abandoned "
"""The Gym tombstone an abandonment leaves: this prefix, then the time (a drop's starts with ``gym-drop``)."""


@dataclass
class PruneReport:
    """What :func:`prune_namespace` did (or, with ``dry_run``, would do)."""

    dry_run: bool
    rollouts_seen: int = 0
    retained: list[str] = field(default_factory=list)
    """Consumed rollouts whose receipt/fence got the ``retention_s`` TTL."""
    abandoned: list[str] = field(default_factory=list)
    dead_letters_trimmed: dict[str, int] = field(default_factory=dict)
    consumers_removed: list[str] = field(default_factory=list)
    """``stream group consumer`` of each deleted consumer name."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Rollout ids (or, for a name that is not UTF-8, the key's ``repr``) left alone because what the pass read
    of them is malformed, each with the reason; nothing of them was changed."""

    def skip(self, what: str, reason: str) -> None:
        """Leave *what* alone for this pass, logged with *reason*."""
        logger.warning("prune: %s left alone: %s", what, reason)
        self.skipped[what] = reason

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "rollouts_seen": self.rollouts_seen,
            "retained": sorted(self.retained),
            "abandoned": sorted(self.abandoned),
            "dead_letters_trimmed": dict(sorted(self.dead_letters_trimmed.items())),
            "consumers_removed": sorted(self.consumers_removed),
            "skipped": dict(sorted(self.skipped.items())),
        }


@dataclass
class _Rollout:
    kinds: set[str] = field(default_factory=set)
    records: list[str] = field(default_factory=list)


async def _scan(
    topology: Topology, match: str, count: int, report: PruneReport, key_type: str | None = None
) -> AsyncIterator[str]:
    for node in topology.primaries():
        async for key in node.scan_iter(match=match, count=count, _type=key_type):
            try:
                name = reply_text(key, "key name")
            except CodecError as exc:
                report.skip(repr(key), str(exc))
                continue
            yield name


async def _rollouts(topology: Topology, ns: str, count: int, report: PruneReport) -> dict[str, _Rollout]:
    found: dict[str, _Rollout] = {}
    prefix = f"{ns}:{{"
    async for key in _scan(topology, f"{gym_key_prefix(ns)}*", count, report):
        gym = gym_key_kind(ns, key)
        if gym is not None:
            found.setdefault(gym[0], _Rollout()).kinds.add(gym[1])
    async for key in _scan(topology, f"{prefix}*", count, report):
        tag, sep, kind = key[len(prefix) :].partition("}:")
        if not sep or tag.startswith("grp:") or kind.startswith("incoming:"):
            continue  # not a rollout's; or a stage's blob, which its transaction removes (else its expiry does)
        rollout = found.setdefault(tag, _Rollout())
        if kind.startswith("rec:"):
            rollout.kinds.add("rec")
            rollout.records.append(key)
        else:
            rollout.kinds.add(kind)
    return found


def _entry_ms(entry_id: object) -> int:
    return int(reply_text(entry_id, "stream id").split("-", 1)[0])


async def _last_activity_ms(client: aioredis.Redis, ns: str, rollout_id: str) -> int:
    """Newest ``calls``/ledger entry time or Gym transport write; 0 when there is none (orphaned records)."""
    newest = 0
    for stream in (calls_stream(ns, rollout_id), ledger_stream(ns, rollout_id)):
        entries = await client.xrevrange(stream, count=1)
        if entries:
            newest = max(newest, _entry_ms(entries[0][0]))
    keys = gym_keys(ns, rollout_id)
    for key in (keys.state, keys.frozen):  # the sink's last write, the source's last freeze
        touched = await client.hget(key, "touched_ms")
        if touched is not None:
            text = reply_text(touched, "touched_ms")
            try:
                newest = max(newest, int(text))
            except ValueError:
                raise CodecError(f"its Gym state's touched_ms is not a millisecond count: {text!r}") from None
    return newest


async def _retain(topology: Topology, ns: str, rollout_id: str, settings: PruneSettings, report: PruneReport) -> None:
    keys = [receipt_key(ns, rollout_id), fence_key(ns, rollout_id)]
    client = topology.node_for_key(keys[0])
    untimed = [key for key in keys if await client.ttl(key) == -1]
    if not untimed:
        return
    report.retained.append(rollout_id)
    if not report.dry_run:
        for key in untimed:
            await client.expire(key, max(1, math.ceil(settings.retention_s)))


async def _abandon(
    topology: Topology,
    ns: str,
    rollout_id: str,
    rollout: _Rollout,
    settings: PruneSettings,
    report: PruneReport,
    now_s: float,
) -> None:
    client = topology.node_for_key(calls_stream(ns, rollout_id))
    cutoff_ms = int((now_s - settings.abandon_after_s) * 1000)
    gym = gym_keys(ns, rollout_id)
    watched = [calls_stream(ns, rollout_id), ledger_stream(ns, rollout_id), receipt_key(ns, rollout_id), gym.state]
    watched.append(gym.frozen)
    if report.dry_run:  # plain reads, no WATCH: the read-only ops user can run a dry run
        if await _last_activity_ms(client, ns, rollout_id) <= cutoff_ms and not await client.exists(watched[2]):
            report.abandoned.append(rollout_id)
        return
    async with client.pipeline(transaction=True) as pipe:
        await pipe.watch(*watched)
        last_ms = await _last_activity_ms(pipe, ns, rollout_id)  # immediate mode while watching
        if last_ms > cutoff_ms or await pipe.exists(watched[2]):
            await pipe.unwatch()  # type: ignore[no-untyped-call]
            return
        pipe.multi()  # type: ignore[no-untyped-call]
        pipe.delete(
            *watched[:2],
            ledger_ids_key(ns, rollout_id),
            ledger_text_key(ns, rollout_id),
            claim_key(ns, rollout_id),
            *gym[:-1],
            *rollout.records,
        )
        retention_s = max(1, math.ceil(settings.retention_s))
        if rollout.kinds & _RL_LIVE_KINDS or not rollout.kinds & _GYM_LIVE_KINDS:
            pipe.set(fence_key(ns, rollout_id), repr(time.time()), ex=retention_s)
        if rollout.kinds & _GYM_LIVE_KINDS:
            pipe.set(gym.tombstone, f"{ABANDONED_TOMBSTONE}{time.time()!r}", ex=retention_s)
        try:
            await pipe.execute()
        except redis_errors.WatchError:
            return  # written to meanwhile: alive after all
    dead = dead_letter_stream(ns, ABANDONED_STREAM)
    await topology.node_for_key(dead).xadd(
        dead,
        {
            "rollout_id": rollout_id,
            "dead_reason": f"abandoned: no receipt and no activity for {settings.abandon_after_s:g} s",
            "last_activity_ms": str(last_ms),
            "records": str(len(rollout.records)),
        },
        maxlen=settings.dead_letter_max_entries,
        approximate=True,
    )
    report.abandoned.append(rollout_id)
    count_rollouts_abandoned(ns)


async def _trim_dead_letters(topology: Topology, ns: str, settings: PruneSettings, report: PruneReport) -> None:
    limit = settings.dead_letter_max_entries
    async for stream in _scan(topology, f"{ns}:dead:*", settings.scan_count, report, "stream"):
        client = topology.node_for_key(stream)
        length = int(await client.xlen(stream))
        if length <= limit:
            continue
        if report.dry_run:
            report.dead_letters_trimmed[stream] = length - limit
            continue
        await client.xtrim(stream, maxlen=limit, approximate=False)
        report.dead_letters_trimmed[stream] = length - int(await client.xlen(stream))


async def _remove_idle_consumers(topology: Topology, ns: str, settings: PruneSettings, report: PruneReport) -> None:
    idle_ms = settings.consumer_idle_max_s * 1000
    for pattern in (f"{ns}:done:*", f"{ns}:receipts:*"):
        async for stream in _scan(topology, pattern, settings.scan_count, report, "stream"):
            client = topology.node_for_key(stream)
            for group in await client.xinfo_groups(stream):
                name = reply_text(group["name"], "group name")
                for consumer in await client.xinfo_consumers(stream, name):
                    if int(consumer["pending"]) or int(consumer["idle"]) < idle_ms:
                        continue
                    who = reply_text(consumer["name"], "consumer name")
                    if not report.dry_run:
                        await client.xgroup_delconsumer(stream, name, who)
                    report.consumers_removed.append(f"{stream} {name} {who}")


async def prune_namespace(
    topology: Topology, settings: PruneSettings, *, dry_run: bool = False, now_s: float | None = None
) -> PruneReport:
    """Apply the module's rules to ``settings.namespace`` once; *dry_run*: report only, change nothing.

    *now_s*: the wall-clock time (``time.time()``) ages are counted to, default now; a test or a replay passes
    its own, so what counts as abandoned does not depend on how fast it runs.

    :raises StagingConnectionError: the server could not be reached or refused a command (a cluster's topology
        change, ``MOVED``, ``ASK``...: unavailable, and the slot map is reloaded for the next pass).
    """
    ns = settings.namespace
    report = PruneReport(dry_run=dry_run)
    now_s = time.time() if now_s is None else now_s
    async with topology.translated(f"prune namespace {ns!r}"):  # an outage reloads a cluster's slot map
        rollouts = await _rollouts(topology, ns, settings.scan_count, report)
        report.rollouts_seen = len(rollouts)
        for rollout_id, rollout in sorted(rollouts.items()):
            try:
                if not rollout.kinds & _LIVE_KINDS:
                    await _retain(topology, ns, rollout_id, settings, report)
                elif "receipt" not in rollout.kinds:
                    await _abandon(topology, ns, rollout_id, rollout, settings, report, now_s)
            except CodecError as exc:  # nothing of it was changed: the reads come before any write
                report.skip(rollout_id, str(exc))
        await _trim_dead_letters(topology, ns, settings, report)
        await _remove_idle_consumers(topology, ns, settings, report)
    return report
