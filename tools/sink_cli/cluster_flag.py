"""``--cluster`` / ``--no-cluster`` / neither: the cluster mode of a command, read from the server.

Without either flag the server decides (``INFO cluster``: ``cluster_enabled``); an explicit flag that contradicts
the server ends the command with one line and exit 2, never a traceback from deep inside redis-py.

A service command (``assembler``, ``trainer``, ``prune --interval-s``, ``metrics``) is already opening when it
asks: it asks under its outage policy (a server that is down is waited for, up to ``--max-outage-s``; the
metrics exporter, which never gives up while it runs, waits for as long), and hands that policy on as
``args.outage`` so the outage goes on counting from its start.
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from sink.errors import ClusterModeMismatchError
from sink.settings import OutageSettings
from sink.store.cluster_mode import detect_cluster_mode
from sink_cli.common import EXIT_USAGE, CommandError, check_redis_url, mask_url, service_outage_policy

__all__ = ("CLUSTER_HELP", "resolve_cluster_flag")

CLUSTER_HELP = (
    "the URL is one node of a Redis/Valkey Cluster (--no-cluster: a standalone server); "
    "default: detected from the server (INFO cluster), except by `proxy`, which is standalone unless --cluster "
    "is given"
)
_DETECT_TIMEOUT_S = 3.0
SERVICE_COMMANDS = frozenset({"assembler", "trainer"})
"""Long-running commands: they wait out an outage while they open (and run, and close), up to
``--max-outage-s``; so does ``prune`` when it runs a pass every ``--interval-s``."""


def _outage_settings(args: argparse.Namespace) -> OutageSettings | None:
    """The outage settings of a service command, ``None`` for a one-shot command."""
    command = getattr(args, "command", None)
    if command == "metrics":  # it never gives up while it runs, nor while it opens
        return OutageSettings(max_outage_s=None)
    if command in SERVICE_COMMANDS or (command == "prune" and args.interval_s is not None):
        limit = getattr(args, "max_outage_s", None)
        return OutageSettings() if limit is None else OutageSettings(max_outage_s=limit)
    return None


def resolve_cluster_flag(args: argparse.Namespace) -> None:
    """Replace ``args.cluster`` (``True``/``False``/``None``) by the mode to use, a ``bool``.

    Asks the server only when ``--redis-url`` is given, and not for ``proxy``.

    :raises CommandError: (exit 2) the flag contradicts the server; (exit 2) a malformed URL.
    :raises StagingConnectionError: the server cannot be reached.
    """
    if not hasattr(args, "cluster"):
        return
    url = getattr(args, "redis_url", None)
    # The proxy validates its settings before it connects; it keeps the explicit flag (default: standalone).
    if not url or getattr(args, "command", None) == "proxy":
        args.cluster = bool(args.cluster)
        return
    detect = partial(
        detect_cluster_mode,
        check_redis_url(url),
        requested=args.cluster,
        connect_timeout_s=_DETECT_TIMEOUT_S,
        where=mask_url(url),
    )
    try:
        settings = _outage_settings(args)
        if settings is not None:
            args.outage = service_outage_policy(settings, args.command)
            args.cluster = anyio.run(args.outage.call, partial(anyio.to_thread.run_sync, detect), "opening")
        else:
            args.cluster = detect()
    except ClusterModeMismatchError as exc:
        raise CommandError(str(exc), exit_code=EXIT_USAGE) from exc
