"""``staging-sink weights set N`` and ``staging-sink weights show``: the trainer's published weight version.

One key per namespace (:mod:`sink.trainer.weights`): proxies started with ``--weight-source published`` stamp each
call with it, read at most every ``--weight-staleness-s``. A trainer that uses :class:`~sink.trainer.reader.rollout_reader.RolloutReader`
publishes with ``publish_weight_version`` instead; this command is for scripts and operators.
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from sink.trainer.weights import (
    InvalidWeightVersionError,
    checked_weight_version,
    publish_weight_version,
    read_published_state,
)
from sink_cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    check_redis_url,
    open_topology,
    stdout_console,
)

__all__ = ("add_weights_command", "weights_command")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


async def weights_command(target: RedisTarget, version: int | None) -> int:
    """Publish *version* (``None``: show the published one); print the result.

    :raises CommandError: the record cannot carry *version* (exit 2, nothing written).
    """
    if version is not None:
        try:
            checked_weight_version(version)
        except InvalidWeightVersionError as exc:
            raise CommandError(str(exc), exit_code=EXIT_USAGE) from exc
    async with open_topology(target) as topology:
        if version is not None:
            await publish_weight_version(topology.client, target.namespace, version)
        current, deleted = await read_published_state(topology.client, target.namespace)
    if current is None:
        was = "" if deleted is None else f" ({deleted} was, and the key was deleted)"
        stdout_console().print(f"no weight version published in namespace {target.namespace!r}{was}")
        return EXIT_FAILURE
    stdout_console().print(f"weight version {current} (namespace {target.namespace!r})")
    return EXIT_OK


def _handle(args: argparse.Namespace) -> int:
    if not args.redis_url:
        raise CommandError("no Redis URL: pass --redis-url or set STAGING_SINK_REDIS_URL", exit_code=EXIT_USAGE)
    target = RedisTarget(check_redis_url(args.redis_url), args.namespace, args.cluster)
    return anyio.run(partial(weights_command, target, getattr(args, "version", None)))


def add_weights_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    """Register ``weights set N`` / ``weights show`` on *commands* (with the shared Redis options *redis*)."""
    text = "the trainer's published weight version (read by proxies started with --weight-source published)"
    command = commands.add_parser("weights", help=text, description=text)
    actions = command.add_subparsers(dest="weights_action", required=True, metavar="{set,show}")
    publish = actions.add_parser("set", parents=[redis], help="publish weight version N in the namespace")
    publish.add_argument("version", type=_integer, metavar="N", help="an integer in [0, 2**64) (the record's u64)")
    publish.set_defaults(handler=_handle)
    show = actions.add_parser("show", parents=[redis], help="print the published weight version (exit 1: none)")
    show.set_defaults(handler=_handle)
