"""``staging-sink prune [--dry-run] [--interval-s S]``: bounded state on demand (the rules: :mod:`sink.ops.prune`).

Namespace-only (``SCAN MATCH ns:*``). Needs a user that may delete the namespace's keys (``admin``, or the
default user). With ``--interval-s`` it runs until SIGINT/SIGTERM, one pass per interval: the owner of
abandonment, dead-letter trimming and idle consumers in a deployment. As a service it rides out a server it
cannot reach while it opens and between passes, up to ``--max-outage-s`` (then exit 3), and stops at once
(exit 1) when the server refuses a command (:class:`sink.service.OutagePolicy`).
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from sink.ops.prune import PruneReport, prune_namespace
from sink.service import OutagePolicy
from sink.settings import DEFAULT_ABANDON_AFTER_S, DEFAULT_RETENTION_S, PruneSettings
from sink.store.connection import Topology
from sink_cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    cancel_on_signal,
    check_redis_url,
    connect_topology,
    open_topology,
    positive_int,
    positive_seconds,
    service_outage_policy,
    stderr_console,
    stdout_console,
    write_json,
)

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
        + (f"; left {len(report.skipped)} malformed alone" if report.skipped else "")
    )
    for rollout_id in sorted(report.abandoned):
        stdout_console().print(f"  abandoned {rollout_id}")
    for consumer in sorted(report.consumers_removed):
        stdout_console().print(f"  idle consumer {consumer}")
    for what, reason in sorted(report.skipped.items()):
        stdout_console().print(f"  left alone {what}: {reason}", markup=False)


async def prune_command(
    target: RedisTarget,
    settings: PruneSettings,
    *,
    dry_run: bool,
    as_json: bool,
    interval_s: float | None,
    outage: OutagePolicy | None = None,
) -> int:
    """One pass, or one per *interval_s* until SIGINT/SIGTERM (a service, riding out outages under *outage*:
    by default one built from *settings*); print what was (or would be) removed."""
    if interval_s is None:
        async with open_topology(target) as topology:
            _print(await prune_namespace(topology, settings, dry_run=dry_run), as_json=as_json)
        return EXIT_OK
    outage = outage or service_outage_policy(settings, "prune")
    one_pass = partial(prune_namespace, dry_run=dry_run)
    topology = Topology.from_url(target.url, target.settings())
    try:
        async with anyio.create_task_group() as group:
            await group.start(cancel_on_signal, group.cancel_scope)
            await outage.call(partial(connect_topology, topology, target), "opening")
            stderr_console().print(f"prune on {target.display_url} every {interval_s:g} s; Ctrl-C stops it")
            while True:
                _print(await outage.call(partial(one_pass, topology, settings), "running"), as_json=as_json)
                await anyio.sleep(interval_s)
    finally:
        with anyio.CancelScope(shield=True):
            await topology.aclose()
    return EXIT_OK


def _handle(args: argparse.Namespace) -> int:
    if not args.redis_url:
        raise CommandError("no Redis URL: pass --redis-url or set STAGING_SINK_REDIS_URL", exit_code=EXIT_USAGE)
    if args.max_outage_s is not None and args.interval_s is None:
        raise CommandError("--max-outage-s needs --interval-s (a single pass does not wait out an outage)",
                           exit_code=EXIT_USAGE)  # fmt: skip
    target = RedisTarget(check_redis_url(args.redis_url), args.namespace, args.cluster)
    settings = PruneSettings(
        namespace=target.namespace,
        cluster=target.cluster,
        connect_timeout_s=target.settings().connect_timeout_s,
        retention_s=args.retention_s,
        abandon_after_s=args.abandon_after_s,
        dead_letter_max_entries=args.dead_letter_max_entries,
        consumer_idle_max_s=args.consumer_idle_max_s,
        **({} if args.max_outage_s is None else {"max_outage_s": args.max_outage_s}),
    )
    run = partial(
        prune_command,
        target,
        settings,
        dry_run=args.dry_run,
        as_json=args.json,
        interval_s=args.interval_s,
        outage=getattr(args, "outage", None),
    )
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
    command.add_argument("--max-outage-s", type=positive_seconds, metavar="S",
                         help="with --interval-s: give up (exit 3) after the server was unreachable this long "
                              "(default: PruneSettings.max_outage_s)")  # fmt: skip
    command.set_defaults(handler=_handle)
