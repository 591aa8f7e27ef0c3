"""``staging-sink prune [--dry-run] [--interval-s S]``: bounded state on demand (the rules: :mod:`sink.ops.prune`).

Namespace-only (``SCAN MATCH ns:*``). Needs a user that may delete the namespace's keys (``admin``, or the
default user). With ``--interval-s`` it runs until SIGINT/SIGTERM, one pass per interval: the owner of
abandonment, dead-letter trimming and idle consumers in a deployment.
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from sink.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    cancel_on_signal,
    check_redis_url,
    open_topology,
    positive_int,
    positive_seconds,
    stdout_console,
    write_json,
)
from sink.ops.prune import PruneReport, prune_namespace
from sink.settings import DEFAULT_ABANDON_AFTER_S, DEFAULT_RETENTION_S, PruneSettings

__all__ = ("add_prune_command", "prune_command")


def _print(report: PruneReport, *, as_json: bool) -> None:
    if as_json:
        write_json(report.as_dict(), one_line=True)
        return
    verb = "would" if report.dry_run else "did"
    trimmed = sum(report.dead_letters_trimmed.values())
    stdout_console().print(
        f"prune ({'dry run' if report.dry_run else 'applied'}): {report.rollouts_seen} rollout(s) seen; {verb} "
        f"set retention on {len(report.retained)}, abandon {len(report.abandoned)}, trim {trimmed} dead "
        f"letter(s), remove {len(report.consumers_removed)} idle consumer(s)"
    )
    for rollout_id in sorted(report.abandoned):
        stdout_console().print(f"  abandoned {rollout_id}")
    for consumer in sorted(report.consumers_removed):
        stdout_console().print(f"  idle consumer {consumer}")


async def prune_command(
    target: RedisTarget, settings: PruneSettings, *, dry_run: bool, as_json: bool, interval_s: float | None
) -> int:
    """One pass (or one per *interval_s* until a signal); print what was (or would be) removed."""
    async with open_topology(target) as topology, anyio.create_task_group() as group:
        if interval_s is not None:
            await group.start(cancel_on_signal, group.cancel_scope)
        while True:
            _print(await prune_namespace(topology, settings, dry_run=dry_run), as_json=as_json)
            if interval_s is None:
                break
            await anyio.sleep(interval_s)
        group.cancel_scope.cancel()
    return EXIT_OK


def _handle(args: argparse.Namespace) -> int:
    if not args.redis_url:
        raise CommandError("no Redis URL: pass --redis-url or set STAGING_SINK_REDIS_URL", exit_code=EXIT_USAGE)
    target = RedisTarget(check_redis_url(args.redis_url), args.namespace, args.cluster)
    settings = PruneSettings(
        namespace=target.namespace,
        cluster=target.cluster,
        connect_timeout_s=target.settings().connect_timeout_s,
        retention_s=args.retention_s,
        abandon_after_s=args.abandon_after_s,
        dead_letter_max_entries=args.dead_letter_max_entries,
        consumer_idle_max_s=args.consumer_idle_max_s,
    )
    run = partial(prune_command, target, settings, dry_run=args.dry_run, as_json=args.json, interval_s=args.interval_s)
    return anyio.run(run)


def add_prune_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    """Register ``prune`` on *commands* (with the shared Redis options *redis*)."""
    text = (
        "bounded state: give consumed rollouts' receipts/fences their retention TTL, abandon rollouts that never "
        "finished, trim dead letters, delete idle consumers (namespace only)"
    )
    command = commands.add_parser("prune", parents=[redis], help=text, description=text)
    command.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    command.add_argument("--json", action="store_true", help="one JSON object per pass")
    command.add_argument("--retention-s", type=positive_seconds, default=DEFAULT_RETENTION_S, metavar="S",
                         help="TTL of a consumed rollout's receipt and fence")  # fmt: skip
    command.add_argument("--abandon-after-s", type=positive_seconds, default=DEFAULT_ABANDON_AFTER_S, metavar="S",
                         help="abandon a rollout with no receipt and no activity for this long")  # fmt: skip
    command.add_argument("--dead-letter-max-entries", type=positive_int, default=10_000, metavar="N",
                         help="keep the newest N entries of each dead-letter stream")  # fmt: skip
    command.add_argument("--consumer-idle-max-s", type=positive_seconds, default=DEFAULT_RETENTION_S, metavar="S",
                         help="delete consumer names idle this long with nothing pending")  # fmt: skip
    command.add_argument("--interval-s", type=positive_seconds, metavar="S",
                         help="run a pass every S seconds until SIGINT/SIGTERM (default: one pass)")  # fmt: skip
    command.set_defaults(handler=_handle)
