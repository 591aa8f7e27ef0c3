"""The verdict of ``staging-sink stats --check``: broken, idle, or known and handled (see :mod:`sink_cli.stats`).

Broken (exit 1): not durable, dead letters newer than the operators' last ``staging-sink dead-letters ack``,
a consumer group lagging past ``--max-lag``, a published weight version that was deleted (proxies with
``--weight-source published`` fall back to their ``--weight-version``) or that the record cannot carry (they refuse
every call). Idle (an empty namespace) and known, handled (``prune``'s
``ns:dead:abandoned`` records, acknowledged dead letters) pass and are listed as notes.
"""

from __future__ import annotations

from typing import Any

from sink.keys import weight_version_key
from sink.store.connection import Topology, reply_text

__all__ = (
    "HANDLED_DEAD_LETTERS",
    "OPERATORS_GROUP",
    "check_notes",
    "check_problems",
    "unacknowledged_dead_letters",
)

OPERATORS_GROUP = "operators"
"""The consumer group ``staging-sink dead-letters ack`` moves to a dead-letter stream's newest entry."""
HANDLED_DEAD_LETTERS = ("abandoned",)
"""Dead-letter streams of routine, handled events (``prune``'s abandonment records a failure per rollout)."""
_UNACKED_CAP = 10_000


def _lags(snapshot: dict[str, Any]) -> dict[tuple[str, str], int]:
    """Entries left to read per (stream kind, group), summed over shards; ``(kind, "-")``: no group at all."""
    lags: dict[tuple[str, str], int] = {}
    for stream in snapshot["streams"].values():
        if stream["kind"] not in ("done", "receipts"):
            continue
        if not stream["groups"]:
            key = (stream["kind"], "-")
            lags[key] = lags.get(key, 0) + stream["length"]
        for group, gauges in stream["groups"].items():
            # Consumers XDEL what they acknowledge, so length - pending bounds the unread when lag is unknown.
            lag = gauges["lag"] if gauges["lag"] is not None else max(stream["length"] - gauges["pending"], 0)
            lags[(stream["kind"], group)] = lags.get((stream["kind"], group), 0) + lag
    return lags


async def unacknowledged_dead_letters(topology: Topology, stream: str, gauges: dict[str, Any]) -> int:
    """Entries of a dead-letter stream newer than the operators group's position (all, without the group)."""
    if OPERATORS_GROUP not in gauges["groups"]:
        return int(gauges["length"])
    client = topology.node_for_key(stream)
    for raw in await client.xinfo_groups(stream):
        info = {reply_text(key, lenient=True): value for key, value in raw.items()}
        if reply_text(info["name"], lenient=True) == OPERATORS_GROUP:
            last = reply_text(info["last-delivered-id"], lenient=True)
            return len(await client.xrange(stream, min=f"({last}", max="+", count=_UNACKED_CAP) or [])
    return int(gauges["length"])


def _handled(stream: str) -> bool:
    return stream.rsplit(":", 1)[-1] in HANDLED_DEAD_LETTERS


def check_notes(snapshot: dict[str, Any]) -> list[str]:
    """What ``stats --check`` passes but reports in *snapshot*: idle, and known, handled dead letters."""
    notes = []
    if snapshot["namespace_empty"]:
        notes.append(f"idle: no keys in namespace {snapshot['namespace']!r} yet")
    unacked = snapshot["dead_letters_unacknowledged"]
    for name, stream in sorted(snapshot["streams"].items()):
        if stream["kind"] != "dead" or not stream["length"]:
            continue
        if _handled(name):
            notes.append(f"handled: {stream['length']} entr(ies) in {name} (routine, recorded by prune)")
        elif unacked.get(name, 0) == 0:
            notes.append(f"acknowledged: {stream['length']} dead letter(s) in {name} (dead-letters ack)")
    return notes


def _weight_problems(snapshot: dict[str, Any]) -> list[str]:
    weights, key = snapshot["weight_version"], weight_version_key(snapshot["namespace"])
    published = "proxies with --weight-source published"
    if weights["unusable"]:
        return [f"{weights['unusable']}: {published} refuse every call (staging-sink weights set N)"]
    if weights["deleted"] is None:
        return []
    fallback = "stamp their --weight-version (publish again: staging-sink weights set N)"
    return [f"weight version {weights['deleted']} was published and {key} is gone: {published} {fallback}"]


def check_problems(snapshot: dict[str, Any], *, max_lag: int) -> list[str]:
    """What ``stats --check`` fails on in *snapshot* (from :func:`collect_stats`), one sentence each: broken only."""
    problems = []
    if not snapshot["durability"]["durable"]:
        problems.append(f"not durable: {snapshot['durability']['problem']}")
    unacked = {n: c for n, c in snapshot["dead_letters_unacknowledged"].items() if c and not _handled(n)}
    if unacked:
        problems.append(
            f"{sum(unacked.values())} dead letter(s) newer than the last `staging-sink dead-letters ack` in "
            f"{', '.join(sorted(unacked))} (inspect: `staging-sink dead-letters list`)"
        )
    problems.extend(_weight_problems(snapshot))
    for (kind, group), lag in sorted(_lags(snapshot).items()):
        if lag > max_lag:
            who = "no consumer group reads them" if group == "-" else f"group {group!r} has not read them"
            problems.append(f"{kind} streams lag {lag} entries > --max-lag {max_lag} ({who})")
    return problems
