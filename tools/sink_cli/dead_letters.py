"""``staging-sink dead-letters list|ack|clear``: inspect, acknowledge and clear a namespace's dead letters.

Dead letters are the ``ns:dead:*`` streams: entries a service gave up on (``done-<k>``, ``receipts-<k>``),
groups sealed dead (``groups``) and rollouts ``prune`` abandoned (``abandoned``). ``ack`` records that an
operator has seen every entry so far: it moves the stream's ``operators`` consumer group to the newest entry,
and ``stats --check`` then fails only on dead letters newer than that. ``clear`` deletes the streams (after
``list``/``export``, when they are no longer needed). Namespace-only; ``ack`` and ``clear`` need a user that
may write the namespace's keys (``admin`` or the default user).
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio
import redis.exceptions as redis_errors

from sink.store.connection import map_redis_errors, reply_text
from sink_cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    check_redis_url,
    open_topology,
    stdout_console,
    write_json,
)
from sink_cli.stats import OPERATORS_GROUP, shared_stream_names

__all__ = ("add_dead_letters_command", "dead_letters_command")


async def dead_letters_command(target: RedisTarget, action: str, *, count: int, as_json: bool) -> int:
    """``list`` (the newest *count* entries of each stream), ``ack`` or ``clear`` every ``ns:dead:*`` stream."""
    console = stdout_console()
    async with open_topology(target) as topology:
        with map_redis_errors(f"{action} dead letters in namespace {target.namespace!r}"):
            streams = [name for name in await shared_stream_names(topology, target.namespace) if ":dead:" in name]
            report: dict[str, object] = {}
            for stream in streams:
                client = topology.node_for_key(stream)
                if action == "list":
                    entries = await client.xrevrange(stream, count=count)
                    report[stream] = [
                        {
                            "id": reply_text(entry_id, lenient=True),
                            **{
                                reply_text(k, lenient=True): reply_text(v, lenient=True)
                                for k, v in (fields or {}).items()
                            },
                        }
                        for entry_id, fields in entries or []
                    ]
                elif action == "ack":
                    try:
                        await client.xgroup_create(stream, OPERATORS_GROUP, id="$")
                    except redis_errors.ResponseError as exc:
                        if "BUSYGROUP" not in str(exc):
                            raise
                        await client.xgroup_setid(stream, OPERATORS_GROUP, id="$")
                    report[stream] = "acknowledged"
                else:
                    report[stream] = "deleted" if await client.delete(stream) else "absent"
    if as_json:
        write_json({"namespace": target.namespace, "action": action, "streams": report}, one_line=False)
        return EXIT_OK
    if not streams:
        console.print(f"no dead letters in namespace {target.namespace!r}", markup=False)
    for stream, outcome in report.items():
        if isinstance(outcome, list):
            console.print(f"{stream}: {len(outcome)} newest entr{'y' if len(outcome) == 1 else 'ies'}", markup=False)
            for entry in outcome:
                reason = entry.get("dead_reason") or entry.get("reason") or ""
                console.print(f"  {entry['id']}  {reason[:200]}", markup=False)
        else:
            console.print(f"{stream}: {outcome}", markup=False)
    return EXIT_OK


def add_dead_letters_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    """Register ``dead-letters`` on *commands* (with the shared Redis options *redis*)."""
    text = (
        "inspect (list), acknowledge (ack: stats --check then ignores entries up to now) or delete (clear) the "
        "namespace's dead letters (ns:dead:*; namespace only)"
    )
    command = commands.add_parser("dead-letters", parents=[redis], help=text, description=text)
    command.add_argument("action", choices=("list", "ack", "clear"), help="list | ack | clear")
    command.add_argument("--count", type=int, default=20, help="list: newest entries shown per stream")
    command.add_argument("--json", action="store_true", help="machine-readable output")

    def handle(args: argparse.Namespace) -> int:
        if not args.redis_url:
            raise CommandError("no Redis URL: pass --redis-url or set STAGING_SINK_REDIS_URL", exit_code=EXIT_USAGE)
        target = RedisTarget(check_redis_url(args.redis_url), args.namespace, args.cluster)
        run = partial(dead_letters_command, target, args.action, count=args.count, as_json=args.json)
        return anyio.run(run)

    command.set_defaults(handler=handle)
