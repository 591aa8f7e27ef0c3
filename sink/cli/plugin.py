"""The public API of the command line for packages that add commands or benchmarks to ``staging-sink``.

``sink`` never imports ``worker``: the worker's commands (``demo``, ``proxy``, ``engine``) and benchmarks
(``bench worker``, ``bench proxy``) are registered through entry points of the installed distribution, declared in
``pyproject.toml``:

* group :data:`COMMANDS_GROUP`: ``name = "package.module:register"``, where ``register(commands, context)`` adds
  subcommands to *commands* (the parser's subparsers) and gets a :class:`CommandContext` (the environment and the
  shared Redis options). Plugins register in the order of their entry-point names.
* group :data:`BENCHMARKS_GROUP`: ``name = "package.module:main"``, run by ``staging-sink bench name ARGS...`` as
  ``main(ARGS)`` (an exit code).

A plugin imports what it needs of the command line from this module only (the rest of :mod:`sink.cli` is
private to it): the exit codes, :class:`CommandError`, argument types, output helpers and
:func:`~sink.cli.logs.configure_logging` (for a plugin's own worker processes) below.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sink.cli.cluster_flag import CLUSTER_HELP
from sink.cli.common import (
    EXIT_CANNOT_LISTEN,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    check_redis_url,
    int_at_least,
    mask_url,
    namespace_name,
    non_negative_int,
    open_topology,
    positive_int,
    positive_seconds,
    stderr_console,
    stdout_console,
    write_json,
)
from sink.cli.logs import configure_logging
from sink.keys import DEFAULT_NAMESPACE

__all__ = (
    "BENCHMARKS_GROUP",
    "COMMANDS_GROUP",
    "ENV_GATE_REDIS_URL",
    "ENV_NAMESPACE",
    "ENV_REDIS_URL",
    "EXIT_CANNOT_LISTEN",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "CommandContext",
    "CommandError",
    "RedisTarget",
    "check_redis_url",
    "configure_logging",
    "int_at_least",
    "mask_url",
    "non_negative_int",
    "open_topology",
    "plugin_benchmarks",
    "positive_int",
    "positive_seconds",
    "redis_options",
    "register_commands",
    "stderr_console",
    "stdout_console",
    "write_json",
)

COMMANDS_GROUP = "staging_sink.commands"
"""Entry-point group of the functions that add subcommands: ``register(commands, context)``."""
BENCHMARKS_GROUP = "staging_sink.benchmarks"
"""Entry-point group of the benchmarks ``staging-sink bench NAME`` runs: ``main(argv) -> int``."""

ENV_REDIS_URL = "STAGING_SINK_REDIS_URL"
ENV_GATE_REDIS_URL = "STAGING_SINK_GATE_REDIS_URL"
ENV_NAMESPACE = "STAGING_SINK_NAMESPACE"


def redis_options(
    env: Mapping[str, str],
    *,
    url_help: str,
    namespace_default: str | None = DEFAULT_NAMESPACE,
    namespace_help: str | None = None,
) -> argparse.ArgumentParser:
    """A parent parser with ``--redis-url``, ``--namespace`` and ``--cluster``, defaults from *env*."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("Redis")
    group.add_argument("--redis-url", default=env.get(ENV_REDIS_URL) or None, metavar="URL", help=url_help)
    group.add_argument(
        "--namespace",
        default=env.get(ENV_NAMESPACE) or namespace_default,
        type=namespace_name,
        metavar="NS",
        help=namespace_help or f"key namespace (default: ${ENV_NAMESPACE} or {DEFAULT_NAMESPACE!r})",
    )
    group.add_argument("--cluster", action=argparse.BooleanOptionalAction, default=None, help=CLUSTER_HELP)
    return parent


@dataclass(frozen=True, slots=True)
class CommandContext:
    """What a command plugin gets: the environment the defaults come from, and the shared Redis options."""

    env: Mapping[str, str]
    redis: argparse.ArgumentParser
    """The parent parser of every command that talks to Redis (``--redis-url``, ``--namespace``, ``--cluster``)."""

    def redis_options(
        self, *, url_help: str, namespace_default: str | None = DEFAULT_NAMESPACE, namespace_help: str | None = None
    ) -> argparse.ArgumentParser:
        """Redis options with other help texts or namespace default (see :func:`redis_options`)."""
        return redis_options(
            self.env, url_help=url_help, namespace_default=namespace_default, namespace_help=namespace_help
        )


def _entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=group), key=lambda entry: entry.name)


def register_commands(commands: Any, context: CommandContext) -> None:
    """Let every installed plugin of :data:`COMMANDS_GROUP` add its subcommands to *commands*, by name order."""
    for entry in _entry_points(COMMANDS_GROUP):
        register: Callable[[Any, CommandContext], None] = entry.load()
        register(commands, context)


def plugin_benchmarks() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed benchmarks of :data:`BENCHMARKS_GROUP` by name (loaded only when one runs)."""
    return {entry.name: entry for entry in _entry_points(BENCHMARKS_GROUP)}
