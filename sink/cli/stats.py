"""``staging-sink stats``: the command, and one snapshot of a namespace's health as a dict and a rich table.

The snapshot holds the verified durability settings of every node, memory, rollouts in flight (ledgers
found with ``SCAN``), the staging rate (calls entries of the last window, read from their stream ids), the
length of every ``done``/``receipts``/``dead`` stream with its consumer groups' pending count and lag.
``SCAN`` walks the whole keyspace: this is an ops tool, never a hot path.
"""

from __future__ import annotations

import time
from typing import Any, cast

import anyio
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from ..metrics import STREAM_KINDS, collect_redis_gauges
from ..store.connection import Topology, map_redis_errors
from ..store.durability import REQUIRED_CONFIG, verify_durability
from .common import EXIT_OK, RedisTarget, cancel_on_signal, decode_text, open_topology, stdout_console, write_json

__all__ = ("collect_stats", "render_stats", "scan_keys", "shared_stream_names", "stats_command")

_SCAN_COUNT = 1000


async def scan_keys(topology: Topology, pattern: str, key_type: str) -> list[str]:
    """Every key of *key_type* matching *pattern*, over every primary (``SCAN ... TYPE``), sorted.

    :raises redis.RedisError: the server cannot be reached or refuses ``SCAN``.
    """
    found: set[str] = set()
    for node in topology.primaries():
        async for key in node.scan_iter(match=pattern, count=_SCAN_COUNT, _type=key_type):
            found.add(decode_text(key))
    return sorted(found)


async def shared_stream_names(topology: Topology, namespace: str) -> list[str]:
    """The namespace's ``done``, ``receipts`` and ``dead`` streams that exist.

    :raises redis.RedisError: the server cannot be reached or refuses ``SCAN``.
    """
    return [name for kind in STREAM_KINDS for name in await scan_keys(topology, f"{namespace}:{kind}:*", "stream")]


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


async def collect_stats(topology: Topology, target: RedisTarget, *, rate_window_s: float) -> dict[str, Any]:
    """One snapshot of the namespace (JSON-serializable).

    :raises StagingConnectionError: the server cannot be reached or refuses a command.
    """
    ns = target.namespace
    with map_redis_errors(f"collect stats from {target.display_url}"):
        nodes = await topology.all_nodes()
        durability = await verify_durability(nodes)
        server = await _server(topology)
        ledgers = await scan_keys(topology, f"{ns}:*:ledger", "stream")
        calls = await scan_keys(topology, f"{ns}:*:calls", "stream")
        staged_recently = await _recent_calls(topology, calls, rate_window_s)
        shared = await shared_stream_names(topology, ns)
        # The cluster client routes each keyed command; the gauges only issue keyed commands here.
        gauges = await collect_redis_gauges(cast(aioredis.Redis, topology.client), ns, streams=shared)
    dead = {name: stream["length"] for name, stream in gauges.items() if stream["kind"] == "dead"}
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
        "rollouts_in_flight": len(ledgers),
        "calls_streams": len(calls),
        "staged_calls_per_s": round(staged_recently / rate_window_s, 2),
        "rate_window_s": rate_window_s,
        "streams": gauges,
        "dead_letters": sum(dead.values()),
    }


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{count} B"


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
    summary.add_row("rollouts in flight", f"{snapshot['rollouts_in_flight']} ledger(s)")
    summary.add_row(
        "staged calls/s",
        f"{snapshot['staged_calls_per_s']} (last {snapshot['rate_window_s']:g} s, "
        f"{snapshot['calls_streams']} calls stream(s))",
    )
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


async def stats_command(target: RedisTarget, *, watch_s: float | None, as_json: bool, rate_window_s: float) -> int:
    """``staging-sink stats``: print the namespace's health once, or every *watch_s* seconds until Ctrl-C.

    :raises StagingConnectionError: the server cannot be reached or refuses a command.
    """
    console = stdout_console()
    async with open_topology(target) as topology, anyio.create_task_group() as group:
        await group.start(cancel_on_signal, group.cancel_scope)  # Ctrl-C ends --watch normally
        while True:
            snapshot = await collect_stats(topology, target, rate_window_s=watch_s or rate_window_s)
            if as_json:
                write_json(snapshot)
            else:
                if watch_s is not None:
                    console.clear()
                render_stats(console, snapshot)
            if watch_s is None:
                break
            await anyio.sleep(watch_s)
        group.cancel_scope.cancel()
    return EXIT_OK
