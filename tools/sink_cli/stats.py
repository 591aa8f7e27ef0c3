"""``staging-sink stats``: the command, and one snapshot of a namespace's health as a dict and a rich table.

The snapshot holds the verified durability settings of every node, memory, rollouts in flight (a capture ledger
and no receipt yet: :func:`sink.ops.metrics.collect.count_rollouts`, what the exporter's gauge shows) and
receipts stored, the NeMo Gym transport's rollouts (held, frozen, incomplete, entries), the staging rate (calls entries of the last window, read from their stream ids), the
length of every ``done``/``receipts``/``dead`` stream with its consumer groups' pending count and lag, and
every consumer's pending count and idle time, and the trainer's published weight version (or the last one
published, when its key was deleted: :func:`sink.trainer.weights.read_published_state`). ``SCAN`` walks the whole keyspace: this is an ops tool, never
a hot path.

``--check`` turns the snapshot into a verdict (:func:`check_problems`), exit 1 only when **broken**: the server
is not durable (or unreachable: exit 3), a dead-letter stream has entries newer than the operators' last
``staging-sink dead-letters ack``, a consumer group lags more than ``--max-lag`` entries (summed over its
shards; a stream with no group counts its whole length), or the published weight version was deleted or holds
what the record cannot carry. **Idle** (an empty namespace: every fresh deployment)
and **known, handled** (``prune``'s ``ns:dead:abandoned`` records, acknowledged dead letters) pass, and are
reported in ``snapshot["check"]["notes"]``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, cast

import anyio
import redis.asyncio as aioredis
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sink.ops.metrics.collect import count_rollouts
from sink.ops.metrics.exporter import STREAM_KINDS, collect_redis_gauges
from sink.store.connection import Topology, map_redis_errors, reply_text
from sink.store.durability import REQUIRED_CONFIG, verify_durability
from sink.trainer.weights import WeightVersionKeyError, read_published_state
from sink_cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    RedisTarget,
    cancel_on_signal,
    open_topology,
    stdout_console,
    write_json,
)
from sink_cli.gym_view import gym_totals
from sink_cli.health import OPERATORS_GROUP, check_notes, check_problems, unacknowledged_dead_letters

__all__ = (
    "DEFAULT_MAX_LAG",
    "OPERATORS_GROUP",
    "check_notes",
    "check_problems",
    "collect_stats",
    "namespaces_found",
    "render_stats",
    "scan_keys",
    "shared_stream_names",
    "stats_command",
)

DEFAULT_MAX_LAG = 1000
"""Default ``stats --check --max-lag``: entries a consumer group may have left to read (over its shards)."""
_SCAN_COUNT = 1000
_HINT_SCAN_KEYS = 10_000
_HINT_NAMES = 20


async def scan_keys(topology: Topology, pattern: str, key_type: str) -> list[str]:
    """Every key of *key_type* matching *pattern*, over every primary (``SCAN ... TYPE``), sorted.

    :raises redis.RedisError: the server cannot be reached or refuses ``SCAN``.
    """
    found: set[str] = set()
    for node in topology.primaries():
        async for key in node.scan_iter(match=pattern, count=_SCAN_COUNT, _type=key_type):
            found.add(reply_text(key, lenient=True))
    return sorted(found)


async def shared_stream_names(topology: Topology, namespace: str) -> list[str]:
    """The namespace's ``done``, ``receipts`` and ``dead`` streams that exist.

    :raises redis.RedisError: the server cannot be reached or refuses ``SCAN``.
    """
    return [name for kind in STREAM_KINDS for name in await scan_keys(topology, f"{namespace}:{kind}:*", "stream")]


async def _has_keys(topology: Topology, namespace: str) -> bool:
    for node in topology.primaries():
        async for _key in node.scan_iter(match=f"{namespace}:*", count=_SCAN_COUNT):
            return True
    return False


async def namespaces_found(topology: Topology) -> tuple[list[str], bool]:
    """The namespaces (key prefixes before the first ``:``) among the first keys ``SCAN`` returns, sorted, and
    whether the scan stopped early (at most 10,000 keys per primary are read).

    :raises redis.RedisError: the server cannot be reached or refuses ``SCAN``.
    """
    names: set[str] = set()
    truncated = False
    for node in topology.primaries():
        seen = 0
        async for key in node.scan_iter(count=_SCAN_COUNT):
            prefix, sep, _rest = reply_text(key, lenient=True).partition(":")
            if sep:
                names.add(prefix)
            seen += 1
            if seen >= _HINT_SCAN_KEYS:
                truncated = True
                break
    return sorted(names), truncated


async def _consumers(topology: Topology, streams: dict[str, Any]) -> list[dict[str, Any]]:
    """Each consumer of each group, over the shards: pending entries, idle time (the least over its shards)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for name, stream in streams.items():
        for group in stream["groups"]:
            for raw in await topology.node_for_key(name).xinfo_consumers(name, group):
                info = {reply_text(key, lenient=True): value for key, value in raw.items()}
                consumer = reply_text(info["name"], lenient=True)
                entry = merged.setdefault(
                    (group, consumer),
                    {"group": group, "consumer": consumer, "shards": 0, "pending": 0, "idle_ms": None},
                )
                entry["shards"] += 1
                entry["pending"] += int(info.get("pending", 0))
                idle = int(info.get("idle", 0))
                entry["idle_ms"] = idle if entry["idle_ms"] is None else min(entry["idle_ms"], idle)
    return [merged[key] for key in sorted(merged)]


async def _recent_calls(topology: Topology, streams: list[str], window_s: float) -> int:
    """Calls entries staged in the last *window_s* seconds (stream ids start with their millisecond time)."""
    since_ms = int((time.time() - window_s) * 1000)
    total = 0
    for stream in streams:
        entries = await topology.node_for_key(stream).xrange(stream, min=f"{since_ms}-0", max="+")
        total += len(entries or [])
    return total


async def _server(topology: Topology) -> dict[str, Any]:
    used = peak = maxmemory = 0
    version = "?"
    for node in topology.primaries():
        memory = await node.info("memory")
        used += int(memory.get("used_memory", 0))
        peak += int(memory.get("used_memory_peak", 0))
        maxmemory += int(memory.get("maxmemory", 0))
        info = await node.info("server")
        name = "valkey" if "valkey_version" in info else "redis"
        version = f"{name} {info.get('valkey_version', info.get('redis_version', '?'))}"
    return {
        "version": version,
        "primaries": len(topology.primaries()),
        "used_memory_bytes": used,
        "used_memory_peak_bytes": peak,
        "maxmemory_bytes": maxmemory,
    }


async def _weight_version(topology: Topology, namespace: str) -> dict[str, Any]:
    """The published weight version, the last one published when it was deleted, and what makes the key unusable."""
    try:
        state = await read_published_state(topology.client, namespace)
    except WeightVersionKeyError as exc:
        return {"published": None, "deleted": None, "unusable": str(exc)}
    return {"published": state.version, "deleted": state.deleted, "unusable": None}


async def collect_stats(topology: Topology, target: RedisTarget, *, rate_window_s: float) -> dict[str, Any]:
    """One snapshot of the namespace (JSON-serializable).

    :raises StagingConnectionError: the server cannot be reached or refuses a command.
    """
    ns = target.namespace
    with map_redis_errors(f"collect stats from {target.display_url}"):
        nodes = await topology.all_nodes()
        durability = await verify_durability(nodes)
        server = await _server(topology)
        rollouts = await count_rollouts(topology.primaries(), ns)
        calls = await scan_keys(topology, f"{ns}:*:calls", "stream")
        gym = await gym_totals(topology, ns)
        staged_recently = await _recent_calls(topology, calls, rate_window_s)
        shared = await shared_stream_names(topology, ns)
        # The cluster client routes each keyed command; the gauges only issue keyed commands here.
        gauges = await collect_redis_gauges(cast(aioredis.Redis, topology.client), ns, streams=shared)
        consumers = await _consumers(topology, dict(gauges))
        empty = not (calls or shared or gym["rollouts"]) and not await _has_keys(topology, ns)
        found = await namespaces_found(topology) if empty else ([], False)
        dead = {name: stream["length"] for name, stream in gauges.items() if stream["kind"] == "dead"}
        unacknowledged = {name: await unacknowledged_dead_letters(topology, name, dict(gauges[name])) for name in dead}
        weights = await _weight_version(topology, ns)
    return {
        "url": target.display_url,
        "namespace": ns,
        "server": server,
        "durability": {
            "durable": durability.problem is None,
            "problem": durability.problem,
            "required": REQUIRED_CONFIG,
            "waitaof": durability.supports_waitaof,
            "nodes_checked": len(nodes),
        },
        "rollouts_in_flight": rollouts.in_flight,
        "receipts_retained": rollouts.receipts_retained,
        "calls_streams": len(calls),
        "gym_rollouts": gym,
        "staged_calls_per_s": round(staged_recently / rate_window_s, 2),
        "rate_window_s": rate_window_s,
        "streams": gauges,
        "consumers": consumers,
        "dead_letters": sum(dead.values()),
        "dead_letters_unacknowledged": unacknowledged,
        "weight_version": weights,
        "namespace_empty": empty,
        "namespaces_found": found[0],
        "namespaces_scan_truncated": found[1],
    }


def _duration(ms: int | None) -> str:
    if ms is None:
        return "?"
    seconds = ms / 1000
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{count} B"


def _weight_line(weights: dict[str, Any]) -> str:
    if weights["unusable"]:
        return f"[red]unusable[/]: {escape(weights['unusable'])}"
    if weights["deleted"] is not None:
        return f"[red]deleted[/] ({weights['deleted']} was published; proxies stamp their --weight-version)"
    return "none published" if weights["published"] is None else f"{weights['published']} (published)"


def render_stats(console: Console, snapshot: dict[str, Any]) -> None:
    """Print *snapshot* (from :func:`collect_stats`) as a summary and a stream table."""
    durability = snapshot["durability"]
    server = snapshot["server"]
    if durability["durable"]:
        durable = "[green]durable[/] (" + ", ".join(f"{k} {v}" for k, v in durability["required"].items()) + ")"
        durable += ", WAITAOF confirmations" if durability["waitaof"] else ""
    else:
        durable = f"[red]NOT durable[/]: {durability['problem']}"
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("server", f"{snapshot['url']} ({server['version']}, {server['primaries']} primary node(s))")
    summary.add_row("namespace", snapshot["namespace"])
    summary.add_row("durability", f"{durable}; {durability['nodes_checked']} node(s) checked")
    maxmemory = _bytes(server["maxmemory_bytes"]) if server["maxmemory_bytes"] else "no limit"
    summary.add_row(
        "memory",
        f"{_bytes(server['used_memory_bytes'])} used, peak {_bytes(server['used_memory_peak_bytes'])}, "
        f"maxmemory {maxmemory}",
    )
    summary.add_row(
        "rollouts in flight",
        f"{snapshot['rollouts_in_flight']} (a capture ledger, no receipt yet); "
        f"{snapshot['receipts_retained']} receipt(s) stored",
    )
    gym = snapshot["gym_rollouts"]
    summary.add_row(
        "gym rollouts",
        f"{gym['rollouts']} held ({gym['frozen']} frozen, {gym['incomplete']} incomplete), {gym['entries']} entries",
    )
    summary.add_row(
        "staged calls/s",
        f"{snapshot['staged_calls_per_s']} (last {snapshot['rate_window_s']:g} s, "
        f"{snapshot['calls_streams']} calls stream(s))",
    )
    summary.add_row("weight version", _weight_line(snapshot["weight_version"]))
    dead_style = "red" if snapshot["dead_letters"] else "green"
    summary.add_row("dead letters", f"[{dead_style}]{snapshot['dead_letters']}[/]")
    console.print(summary)
    streams = Table(title="shared streams", title_justify="left")
    for column in ("stream", "kind", "length", "group", "consumers", "pending", "lag"):
        streams.add_column(column, justify="left" if column in ("stream", "kind", "group") else "right")
    for name, stream in snapshot["streams"].items():
        groups = stream["groups"] or {"-": None}
        for group, gauges in groups.items():
            if gauges is None:
                streams.add_row(name, stream["kind"], str(stream["length"]), "-", "-", "-", "-")
                continue
            lag = "?" if gauges["lag"] is None else str(gauges["lag"])
            streams.add_row(
                name,
                stream["kind"],
                str(stream["length"]),
                group,
                str(gauges["consumers"]),
                str(gauges["pending"]),
                lag,
            )
    if not snapshot["streams"]:
        streams.add_row("(none yet)", "", "", "", "", "", "")
    console.print(streams)
    if snapshot["consumers"]:
        consumers = Table(title="consumers", title_justify="left")
        for column in ("group", "consumer", "shards", "pending", "idle"):
            consumers.add_column(column, justify="left" if column in ("group", "consumer") else "right")
        for consumer in snapshot["consumers"]:
            consumers.add_row(
                escape(consumer["group"]),
                escape(consumer["consumer"]),
                str(consumer["shards"]),
                str(consumer["pending"]),
                _duration(consumer["idle_ms"]),
            )
        console.print(consumers)


def _empty_hint(snapshot: dict[str, Any]) -> str:
    found = [name for name in snapshot["namespaces_found"] if name != snapshot["namespace"]]
    shown = ", ".join(found[:_HINT_NAMES]) + (", ..." if len(found) > _HINT_NAMES else "")
    sampled = " (from the first keys scanned)" if snapshot["namespaces_scan_truncated"] else ""
    listed = f"namespaces found{sampled}: {shown}" if found else "the server has no other namespace either"
    return f"note: no keys in namespace {snapshot['namespace']!r} at {snapshot['url']}; {listed} (--namespace)"


async def stats_command(
    target: RedisTarget,
    *,
    watch_s: float | None,
    as_json: bool,
    rate_window_s: float,
    check: bool = False,
    max_lag: int = DEFAULT_MAX_LAG,
) -> int:
    """``staging-sink stats``: print the namespace's health once, or every *watch_s* seconds until Ctrl-C
    (with ``--json``: one JSON object per line). With *check*, also a verdict: exit 1 when the last snapshot
    has a problem (:func:`check_problems`).

    :raises StagingConnectionError: the server cannot be reached or refuses a command.
    """
    console = stdout_console()
    problems: list[str] = []
    async with open_topology(target) as topology, anyio.create_task_group() as group:
        await group.start(cancel_on_signal, group.cancel_scope)  # Ctrl-C ends --watch normally
        while True:
            snapshot = await collect_stats(topology, target, rate_window_s=watch_s or rate_window_s)
            problems = check_problems(snapshot, max_lag=max_lag) if check else []
            notes = check_notes(snapshot) if check else []
            if check:
                snapshot["check"] = {"ok": not problems, "problems": problems, "notes": notes, "max_lag": max_lag}
            if snapshot["namespace_empty"]:
                sys.stderr.write(_empty_hint(snapshot) + "\n")
            if as_json:
                write_json(snapshot, one_line=watch_s is not None)
            else:
                if watch_s is not None:
                    console.clear()
                render_stats(console, snapshot)
                if check:
                    verdict = "[green]check: ok[/]" if not problems else f"[red]check: {len(problems)} problem(s)[/]"
                    console.print(verdict)
                    for problem in problems:
                        console.print(f"  - {problem}", markup=False)
                    for note in notes:
                        console.print(f"  note: {note}", markup=False)
            if watch_s is None:
                break
            await anyio.sleep(watch_s)
        group.cancel_scope.cancel()
    return EXIT_FAILURE if problems else EXIT_OK
