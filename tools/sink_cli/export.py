"""``staging-sink export ROLLOUT... --format jsonl|parquet``: write verified rows before ``ack`` deletes them.

The work is :func:`sink.trainer.export.export_rollouts`; this module parses the
arguments (registered by :func:`add_export_command`) and maps its errors to
exit codes: 2 for a bad rollout id or format, 1 when a rollout cannot be
exported (nothing is written then).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import anyio

from sink.errors import BatchInputError
from sink.trainer.export import EXPORT_FORMATS, ExportFormat, export_rollouts
from sink_cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    check_redis_url,
    open_topology,
    stderr_console,
)

__all__ = ("add_export_command", "export_command")


async def export_command(target: RedisTarget, rollout_ids: list[str], *, output: str, fmt: ExportFormat) -> int:
    """Export *rollout_ids* to *output* (``-``: stdout, JSON Lines only); print the count on stderr."""
    if fmt == "parquet" and output == "-":
        raise CommandError("--format parquet needs --output PATH", exit_code=EXIT_USAGE)
    async with open_topology(target) as topology:
        try:
            if output == "-":
                written = await export_rollouts(
                    topology.client,
                    rollout_ids,
                    sys.stdout,
                    fmt=fmt,
                    namespace=target.namespace,
                    cluster=target.cluster,
                )
            else:
                # Written to a temporary name and renamed, so a failed export leaves no partial file.
                temporary = Path(output).with_name(Path(output).name + ".partial")
                written = await export_rollouts(
                    topology.client, rollout_ids, temporary, fmt=fmt, namespace=target.namespace, cluster=target.cluster
                )
                temporary.replace(output)
        except BatchInputError as exc:
            raise CommandError(str(exc), exit_code=EXIT_USAGE) from exc
        except LookupError as exc:
            raise CommandError(str(exc)) from exc
    stderr_console().print(f"exported {written} verified row(s) as {fmt} to {output}")
    return EXIT_OK


def _target(args: argparse.Namespace) -> RedisTarget:
    if not args.redis_url:
        raise CommandError("no Redis URL: pass --redis-url or set STAGING_SINK_REDIS_URL", exit_code=EXIT_USAGE)
    return RedisTarget(check_redis_url(args.redis_url), args.namespace, args.cluster)


def add_export_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    """Register ``export`` on *commands* (with the shared Redis options *redis*)."""
    command = commands.add_parser(
        "export",
        parents=[redis],
        help="write rollouts' verified rows (ids, masks, log-probs, reward, receipt) before they are acknowledged",
    )
    command.add_argument("rollout_ids", metavar="ROLLOUT", nargs="+")
    command.add_argument("--format", dest="fmt", choices=EXPORT_FORMATS, default="jsonl", help="default: jsonl")
    command.add_argument("--output", "-o", default="-", metavar="PATH", help="file to write (default: stdout)")
    command.set_defaults(
        handler=lambda a: anyio.run(partial(export_command, _target(a), a.rollout_ids, output=a.output, fmt=a.fmt))
    )
